"""The engine surface the HF Trainer and Accelerate drive, through dslaunch.runtime directly
(no transformers needed): one 2-rank job checks every item and returns what it saw.

- Accelerate's loop: set_gradient_accumulation_boundary before each backward, the loss
  already divided by the accumulation steps (backward(scale_wrt_gas=False)), step() only at
  the boundary: the same weights as the engine's own counted loop.
- _zero3_consolidated_16bit_state_dict / save_16bit_model (stage3_gather_16bit_weights_on_model_save).
- compile(); get_global_grad_norm; config.get (the Trainer reads engine.config as a dict);
  optimizer.overflow after an fp16 step (Accelerate's step_was_skipped).
- set_z3_leaf_modules: a module that calls its child a rank-dependent number of times
  (per-child hooks would issue a different number of gathers per rank) trains under ZeRO-3
  as one leaf, equal to stage 0; register_external_parameter: a module using another's weight.
- A ZeRO checkpoint brings back the optimizer groups' lr for a scheduler the engine does not
  own (the Trainer's LambdaLR).
- ZeRO-3 with no optimizer at all is a forward-only engine (the Trainer's evaluate/predict
  without training); other stages still require one. A training engine built afterwards on
  the same sharded module takes it over.
"""
import os

import pytest
import torch

from dist_harness import run_function

TOL = 1e-5


class Repeat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(6, 6)

    def forward(self, x, times):
        for _ in range(times):
            x = torch.tanh(self.inner(x))
        return x


class User(torch.nn.Linear):
    """Its forward also uses another module's weight: an external parameter for ZeRO-3."""

    def __init__(self, shared: torch.nn.Linear):
        super().__init__(6, 6)
        self.__dict__["other"] = shared  # not a child module: the weight belongs to Net.shared

    def forward(self, x):
        return super().forward(x) + x @ self.other.weight.t()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.rep = Repeat()
        self.shared = torch.nn.Linear(6, 6)
        self.user = User(self.shared)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x, y, times=1):
        h = self.user(self.rep(self.emb(x), times))
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 11), y.view(-1))


def _config(stage, gas=2, gather=False, clip=0.5):
    return {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "steps_per_print": float("inf"),
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "stage3_param_persistence_threshold": 6,
                                  "stage3_gather_16bit_weights_on_model_save": gather}}


def _data(rank, n):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        x = torch.randint(0, 11, (2, 3, 4), generator=g)
        y = torch.randint(0, 11, (2, 3, 4), generator=g)
        out.append((x[rank], y[rank]))
    return out


def _engine(cfg, leaf=False):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero import register_external_parameter
    from dslaunch.runtime.zero.hook_scope import set_z3_leaf_modules

    torch.manual_seed(0)
    model = Net()
    if leaf:
        set_z3_leaf_modules(model, [Repeat])
    register_external_parameter(model.user, model.shared.weight)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _full(engine):
    from dslaunch.runtime.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _counted(engine, data, times):
    for x, y in data:
        engine.backward(engine(x, y, times))
        engine.step()


def _accelerate_style(engine, data, times, gas):
    for i, (x, y) in enumerate(data):
        boundary = (i + 1) % gas == 0
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(engine(x, y, times) / gas, scale_wrt_gas=False)
        if boundary:
            engine.step()


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _job(out_dir):
    import torch.distributed as dist

    from dslaunch.runtime.zero.hook_scope import hooked_modules

    rank = dist.get_rank()
    times = 1 + rank  # rank 0 applies rep.inner once, rank 1 twice
    data = _data(rank, 4)
    seen = {}

    ref = _engine(_config(0))
    with torch.no_grad():
        initial = float(ref(*data[0], times))
    _counted(ref, data, times)
    want = _full(ref)
    seen["grad_norm"] = ref.get_global_grad_norm()
    seen["config_get"] = ref.config.get("zero_optimization", {}).get("stage")

    acc = _engine(_config(2))
    _accelerate_style(acc, data, times, 2)
    seen["accelerate_vs_counted"] = _max_diff(_full(acc), want)
    seen["accelerate_steps"] = acc.global_steps

    z3 = _engine(_config(3, gather=True), leaf=True)
    hooked = hooked_modules(z3.module)
    seen["hooked"] = sorted(n for n, m in z3.module.named_modules() if any(m is h for h in hooked))
    _counted(z3, data, times)
    seen["leaf_external_vs_stage0"] = _max_diff(_full(z3), want)
    consolidated = z3._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        seen["consolidated_vs_stage0"] = _max_diff({k: consolidated[k] for k in want}, want)
        seen["tied_shared"] = consolidated["head.weight"] is consolidated["emb.weight"]
        seen["consolidated_keys"] = sorted(consolidated)
    else:
        seen["consolidated_other_rank"] = consolidated
    seen["saved_z3"] = z3.save_16bit_model(out_dir, "z3.bin")
    z3_nogather = _engine(_config(3))
    seen["saved_z3_without_flag"] = z3_nogather.save_16bit_model(out_dir, "z3_nogather.bin")
    try:
        acc._zero3_consolidated_16bit_state_dict()
    except ValueError as exc:
        seen["stage2_consolidate_error"] = str(exc)
    seen["saved_z2"] = acc.save_16bit_model(out_dir, "z2.bin")

    # no optimizer anywhere under ZeRO-3: a forward-only engine (the Trainer's evaluate/predict
    # without training), the model sharded; backward is one clear error
    inference = _config(3)
    del inference["optimizer"]
    fwd = _engine(inference, leaf=True)  # rep runs a rank-dependent number of times
    with torch.no_grad():
        seen["forward_only_vs_stage0"] = abs(float(fwd(*data[0], times)) - initial)
    seen["forward_only_sharded"] = sorted(n for n, p in fwd.module.named_parameters() if p.numel() == 0)
    try:
        fwd.backward(fwd(*data[0], times))
    except Exception as exc:
        seen["forward_only_backward"] = f"{type(exc).__name__}: {exc}"
    try:
        _engine({k: v for k, v in _config(2).items() if k != "optimizer"})
    except Exception as exc:
        seen["stage2_without_optimizer"] = str(exc)
    # a training engine built later on the same (already sharded) module takes it over
    import dslaunch.runtime as deepspeed

    taker, _, _, _ = deepspeed.initialize(model=fwd.module, model_parameters=fwd.module.parameters(),
                                          config=_config(3))
    seen["hooks_after_takeover"] = len(taker.module.emb._forward_pre_hooks)  # the forward-only engine's are gone
    _counted(taker, data, times)
    seen["takeover_vs_stage0"] = _max_diff(_full(taker), want)

    # fp16 overflow: the optimizer says the step was skipped (Accelerate's step_was_skipped)
    half = _config(2)
    half["fp16"] = {"enabled": True, "initial_scale_power": 4}
    f16 = _engine(half)
    flags = []
    for scale in (float("inf"), 1.0):
        for x, y in data[:2]:
            f16.backward(f16(x, y, times) * scale)
            f16.step()
        flags.append(f16.optimizer.overflow)
    seen["overflow_flags"] = flags

    # compile: the same losses as the eager engine it was built like
    comp = _engine(_config(2))
    comp.compile(backend="eager")
    comp.compile(backend="eager")  # a second call is a no-op
    first = [float(comp(x, y, times)) for x, y in data[:1]]
    seen["compiled"] = comp.is_compiled
    seen["compiled_loss_vs_eager"] = abs(first[0] - float(_engine(_config(2))(*data[0], times)))

    # a scheduler the engine does not own (the HF Trainer's LambdaLR) and a checkpoint
    lam = _engine(_config(2))
    sched = torch.optim.lr_scheduler.LambdaLR(lam.optimizer, lambda s: 1.0 / (1 + s))
    for i, (x, y) in enumerate(data):
        lam.backward(lam(x, y, times))
        lam.step()
        if (i + 1) % 2 == 0:  # after each optimizer step, as the Trainer does
            sched.step()
    seen["lr_saved"] = lam.get_lr()
    lam.save_checkpoint(os.path.join(out_dir, "ckpt"))
    back = _engine(_config(2))
    torch.optim.lr_scheduler.LambdaLR(back.optimizer, lambda s: 1.0 / (1 + s))  # sets lr to its step-0 value
    back.load_checkpoint(os.path.join(out_dir, "ckpt"))
    seen["lr_loaded"] = back.get_lr()
    for e in (ref, acc, z3, z3_nogather, fwd, taker, f16, comp, lam, back):
        e.destroy()
    return seen


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_engine")
    results = run_function(_job, nprocs=2, kwargs={"out_dir": str(out)}, timeout=240)
    return results, out


@pytest.mark.timeout(300)
def test_accelerate_boundary_and_prescaled_loss_equal_the_counted_loop(seen):
    r0, r1 = seen[0]
    assert r0["accelerate_vs_counted"] <= TOL and r1["accelerate_vs_counted"] <= TOL
    assert r0["accelerate_steps"] == 2


def test_leaf_module_and_external_parameter_under_zero3_equal_stage0(seen):
    r0, r1 = seen[0]
    assert r0["leaf_external_vs_stage0"] <= TOL and r1["leaf_external_vs_stage0"] <= TOL
    # rep is one unit (rep.inner gets no hooks of its own); shared's weight is gathered by user too
    assert r0["hooked"] == ["emb", "head", "rep", "shared", "user"]


def test_zero3_consolidated_state_dict_and_16bit_save(seen):
    (r0, r1), out = seen
    assert r0["consolidated_vs_stage0"] <= TOL and r0["tied_shared"]
    assert r1["consolidated_other_rank"] is None
    assert r0["saved_z3"] and r1["saved_z3"]
    saved = torch.load(out / "z3.bin")
    assert sorted(saved) == r0["consolidated_keys"]
    assert r0["saved_z3_without_flag"] is False and not (out / "z3_nogather.bin").exists()
    assert "requires ZeRO-3" in r0["stage2_consolidate_error"]
    assert r0["saved_z2"] and "emb.weight" in torch.load(out / "z2.bin")


def test_compile_get_global_grad_norm_config_get_and_overflow_flag(seen):
    r0, _ = seen[0]
    assert r0["overflow_flags"] == [True, False]  # an inf loss: the step skipped; then a normal one
    assert r0["compiled"] and r0["compiled_loss_vs_eager"] <= TOL
    assert isinstance(r0["grad_norm"], float) and r0["grad_norm"] > 0
    assert r0["config_get"] == 0


def test_zero_checkpoint_restores_the_groups_lr_for_an_outside_scheduler(seen):
    r0, r1 = seen[0]
    assert r0["lr_loaded"] == r0["lr_saved"] and r1["lr_loaded"] == r1["lr_saved"]
    assert r0["lr_saved"] != [0.02]  # the outside scheduler moved it


def test_zero3_without_an_optimizer_is_a_forward_only_engine(seen):
    r0, r1 = seen[0]
    assert r0["forward_only_vs_stage0"] <= TOL and r1["forward_only_vs_stage0"] <= TOL
    assert "emb.weight" in r0["forward_only_sharded"]  # 66 elements > the threshold of 6: a shard at rest
    assert r0["forward_only_backward"].startswith("OptimizerRequiredError: optimizer: none given")
    assert "forward only; backward() needs one" in r0["forward_only_backward"]
    assert r0["stage2_without_optimizer"].startswith("optimizer: none given, and ZeRO stage 2 requires an optimizer")
    assert r0["takeover_vs_stage0"] <= TOL and r1["takeover_vs_stage0"] <= TOL
    assert r0["hooks_after_takeover"] == 1

