"""What deepspeed.utils.nvtx's instrument_w_nvtx records, case by case: the cases that
scripts/make_ds_nvtx_fixtures.py runs through DeepSpeed 0.19.8 (tests/data/ds_nvtx.json) and
tests/runtime/core/test_nvtx_ranges.py replays on dslaunch's module.

`run_all(mod)` takes the nvtx module under test, swaps its enable_nvtx, is_compiling and
get_accelerator for each case (restoring them after), and returns {case: {"result", "calls"}}:
what the wrapped function returned and the range calls the accelerator received.
"""


class DomainAccelerator:
    """An accelerator that takes NVTX domains (DeepSpeed's CUDA accelerator with the nvtx package)."""
    supports_nvtx_domain = True

    def __init__(self, calls):
        self.calls = calls

    def range_push(self, msg, domain=None, category=None):
        self.calls.append(["push", msg, domain, category])

    def range_pop(self, domain=None):
        self.calls.append(["pop", domain])


class PlainAccelerator:
    """An accelerator with range_push(msg)/range_pop() only (DeepSpeed's CPU one, and ours)."""

    def __init__(self, calls):
        self.calls = calls

    def range_push(self, msg):
        self.calls.append(["push", msg])

    def range_pop(self):
        self.calls.append(["pop"])


def sample(x, y=1):
    return x + y


class Holder:
    def method(self, x):
        return 2 * x


# name -> (accelerator class, enable_nvtx, compiling)
CASES = {
    "domain": (DomainAccelerator, True, False),
    "plain": (PlainAccelerator, True, False),
    "disabled": (DomainAccelerator, False, False),
    "compiling": (PlainAccelerator, True, True),
}


def run_all(mod) -> dict:
    saved = (mod.enable_nvtx, mod.is_compiling, mod.get_accelerator)
    out = {}
    try:
        for name, (accel_cls, enabled, compiling) in CASES.items():
            calls = []
            mod.enable_nvtx = enabled
            mod.is_compiling = lambda compiling=compiling: compiling
            mod.get_accelerator = lambda: accel_cls(calls)
            result = mod.instrument_w_nvtx(sample)(3, y=4)
            method = mod.instrument_w_nvtx(Holder.method)(Holder(), 5)
            out[name] = {"result": [result, method], "calls": calls}
    finally:
        mod.enable_nvtx, mod.is_compiling, mod.get_accelerator = saved
    out["constants"] = {"domain": mod.DEEPSPEED_NVTX_DOMAIN, "enabled": mod.enable_nvtx}
    return out
