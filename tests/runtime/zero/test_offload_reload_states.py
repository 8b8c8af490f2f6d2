"""engine.offload_states / engine.reload_states (DeepSpeed's dynamic state offload) through
the public API, at ZeRO stages 1, 2 and 3 on 2 ranks.

A run that offloads every state between two steps and reloads it trains bit-identically to
the same run without (losses and final weights equal, not close); in between the states
report the requested device (get_state_devices) and the optimizer still holds the same
tensor objects. On a CPU-only machine the states are already in host memory and moving
them is a no-op, so the "simulated" runs copy every state into fresh host storage: only
if the parameters and shared masters are re-seated onto what moved does training stay
bit-identical. The refusals (stage 0, nvme, offload_param,
unknown state) are one line each.
"""
import pytest

from dist_harness import run_function

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


def _config(stage, bf16, offload_optimizer=False):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def _train(stage, bf16, offload, include, mid_backward, offload_optimizer, simulate=False):
    """simulate: every move copies into fresh storage, even host to host (this machine has no
    accelerator to move from), so a view left pointing at the old storage would diverge."""
    from dslaunch.runtime.zero import offload_states

    real = offload_states._must_move, offload_states._copy_to, offload_states._copy_back
    if simulate:
        offload_states._must_move = lambda t, device: True
        offload_states._copy_to = lambda t, device, pin, non_blocking: t.data.clone()
        offload_states._copy_back = lambda t, home, non_blocking: t.data.clone()
    try:
        return _steps(stage, bf16, offload, include, mid_backward, offload_optimizer)
    finally:
        offload_states._must_move, offload_states._copy_to, offload_states._copy_back = real


def _storages(engine):
    """Where each parameter's data (stage 3: this rank's shard of it) lives."""
    return [(p._zero.shard if hasattr(p, "_zero") else p).data_ptr() for p in engine.module.parameters()]


def _steps(stage, bf16, offload, include, mid_backward, offload_optimizer):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.offload_config import OffloadStateTypeEnum
    from dslaunch.runtime.zero.offload_states import get_state_devices

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    groups = [{"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                           config=_config(stage, bf16, offload_optimizer))
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(1 + torch.distributed.get_rank())
    data = [torch.randn(2, 12, dtype=dtype) for _ in range(4)]
    losses, between = [], {}
    kinds = None if include is None else [OffloadStateTypeEnum(k) for k in include]
    for step, x in enumerate(data):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        if offload and step == 1 and mid_backward:  # gradient partitions exist only until the step
            engine.offload_states(include=kinds, pin_memory=True, non_blocking=True)
            between = {k: sorted(str(d) for d in get_state_devices(engine, OffloadStateTypeEnum(k))) for k in KINDS}
            engine.reload_states(non_blocking=True)
        engine.step()
        if offload and step == 1 and not mid_backward:
            keys = [id(k) for k in engine.optimizer.state]
            ptrs = _storages(engine)
            engine.offload_states(include=kinds, pin_memory=False)
            between = {k: sorted(str(d) for d in get_state_devices(engine, OffloadStateTypeEnum(k))) for k in KINDS}
            between["same_state_keys"] = keys == [id(k) for k in engine.optimizer.state]
            if stage < 3:  # DeepSpeed's name for the masters: the optimizer's partitions, where they are now
                parts = engine.optimizer.single_partition_of_fp32_groups
                between["partitions"] = ([id(p) for p in parts] == [id(g["params"][0]) for g in engine.optimizer.
                                                                     param_groups], sorted({str(p.device) for p in parts}))
            between["params_moved"] = all(a != b for a, b in zip(ptrs, _storages(engine)))
            engine.reload_states()
        losses.append(float(loss))
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if stage == 3:
        from dslaunch.runtime.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return losses, weights, between


def _pairs():
    out = {}
    for stage in (1, 2, 3):
        for bf16 in (False, True):
            ref = _train(stage, bf16, False, None, False, False)
            for include, mid in ((None, False), (None, True), (["lp_params"], False), (["optim_states"], False)):
                got = _train(stage, bf16, True, include, mid, False)
                out[(stage, bf16, str(include), mid)] = (ref, got)
        ref = _train(stage, True, False, None, False, True)
        out[(stage, "offload_optimizer")] = (ref, _train(stage, True, True, None, False, True))
        for bf16 in (False, True):  # fp32: the masters share the parameters' storage
            ref = _train(stage, bf16, False, None, False, False)
            out[(stage, bf16, "simulated")] = (ref, _train(stage, bf16, True, None, False, False, simulate=True))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_function(_pairs, nprocs=2, timeout=600)[0]


def test_round_trip_is_bit_identical(runs):
    import torch

    for key, (ref, got) in runs.items():
        assert got[0] == ref[0], key  # losses equal, not close
        assert ref[1].keys() == got[1].keys()
        for n in ref[1]:
            assert torch.equal(ref[1][n], got[1][n]), (key, n)


def test_states_report_the_requested_device(runs):
    for key, (_, got) in runs.items():
        between = got[2]
        for kind in KINDS:
            assert between[kind] in ([], ["cpu"]), (key, kind)
        if len(key) == 4 and not key[3]:  # after the step: everything but gradients is held
            assert between["same_state_keys"], key
            for kind in ("optim_states", "hp_params", "lp_params"):
                assert between[kind] == ["cpu"], (key, kind)
            assert between["lp_grads"] == [] and between["contiguous_grad_buffer"] == [], key
            if key[0] < 3:
                assert between["partitions"] == (True, ["cpu"]), key
        if len(key) == 4 and key[3]:  # between backward and step the reduced partitions exist
            assert between["lp_grads"] == ["cpu"], key
        if key[-1] == "simulated":  # fresh storage: the module's parameters follow what moved
            assert between["params_moved"] and between["same_state_keys"], key


def _refusals():
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.offload_config import OffloadDeviceEnum
    from dslaunch.runtime.zero.offload_states import OffloadStatesError

    out = {}

    def attempt(name, stage, call, extra=None):
        model = torch.nn.Linear(4, 2)
        cfg = _config(stage, False)
        cfg["zero_optimization"].update(extra or {})
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        try:
            call(engine)
            out[name] = None
        except (OffloadStatesError, ValueError) as e:
            out[name] = str(e)

    attempt("stage0", 0, lambda e: e.offload_states())
    attempt("nvme", 2, lambda e: e.offload_states(device=OffloadDeviceEnum.nvme))
    attempt("unknown", 1, lambda e: e.offload_states(include=["activations"]))
    attempt("param_offload", 3, lambda e: e.offload_states(), {"offload_param": {"device": "cpu"}})
    attempt("none", 2, lambda e: e.offload_states(device=OffloadDeviceEnum.none))
    return out


def test_refusals_are_one_line():
    out = run_function(_refusals, nprocs=1, timeout=300)[0]
    assert "stage 1, 2 or 3" in out["stage0"]
    assert "nvme is not supported" in out["nvme"]
    assert "activations" in out["unknown"]
    assert "offload_param" in out["param_offload"]
    assert out["none"] is None  # DeepSpeed: nothing to do
    for name in ("stage0", "nvme", "unknown", "param_offload"):
        assert "\n" not in out[name]
