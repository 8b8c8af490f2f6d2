"""Low-precision master states (`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`,
`fp16.fp16_master_weights_and_grads`) against DeepSpeed 0.19.8, through fixtures it recorded
(scripts/make_ds_lpmaster_fixtures.py; DeepSpeed is not needed here).

- Every combination DeepSpeed allows that the fixtures hold (bf16 masters: ZeRO 1-3, bf16
  parameters or fp32 ones under torch_autocast, CPU offload with fp32 or bf16 moments; fp16
  masters: ZeRO 1-3 under CPU offload with DeepSpeedCPUAdam and fp32 moments, fp16 parameters or
  fp32 ones under torch_autocast bfloat16, with overflowing steps skipped by the dynamic loss
  scaler) trains here on 2 ranks with DeepSpeed's losses, and resumes DeepSpeed's checkpoint with
  DeepSpeed's losses after it. DeepSpeed resumed ours with our losses (recorded by the script).
- Every combination DeepSpeed refuses is refused here in one line with its reason.
- The precision policy says each tensor's dtype, and the strategy keeps what it says.

Tolerance, per master dtype: bf16 losses within 2e-2 relative. A bf16 number carries 8
significant bits (relative spacing 2**-8 = 0.4%); the two runs sum the same gradients in another
order (bucket and reduce layout, gloo's reduction), so a master or a moment may round one bf16
step apart at a step, and over 6 Adam steps those steps add up to about a percent of the loss.
fp16 losses within 2e-3 relative: fp16 carries 11 significant bits (spacing 2**-11 = 0.05%), the
same argument at an eighth of the step (the recorded runs with fp16 parameters agree to the bit;
under torch_autocast DeepSpeed reduces Linear gradients in bf16, we in fp32: 1.2e-4). The loss scaler's
skipped steps and scale are integers and powers of two: equal exactly.
"""
import json
import os

import pytest
import torch

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
DATA = os.path.join(ROOT, "tests", "data", "ds_lpmaster")
lp = load_script("make_ds_lpmaster_fixtures")
fx = lp.fx

with open(os.path.join(DATA, "expected.json")) as _fh:
    EXPECTED = json.load(_fh)
TOL = {"torch.bfloat16": 2e-2, "torch.float16": 2e-3}  # by master dtype: see the module docstring
ON_DEVICE = sorted(n for n, c in lp.CASES.items() if not c.offload)
OFFLOADED = sorted(n for n, c in lp.CASES.items() if c.offload and not c.fp16_masters)
FP16 = sorted(n for n, c in lp.CASES.items() if c.fp16_masters)

# DeepSpeed's reason (its line ends with it) -> the words our one line carries for the same reason
REASONS = {
    "z0_bf16_masters": ("only supported with ZeRO Stage 1, 2, or 3", "only supported with ZeRO stage 1, 2 or 3"),
    "z2_states_without_masters": ("bf16_optimizer_states requires bf16_master_weights_and_grads",
                                  "requires bf16.bf16_master_weights_and_grads"),
    "z2_bf16_fp32_states_no_offload": ("Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam",
                                       "need zero_optimization.offload_optimizer.device \"cpu\" with DeepSpeedCPUAdam"),
    "z2_bf16_offload_torch_adamw": ("Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam",
                                    "the optimizer must be DeepSpeedCPUAdam"),
    "z0_fp16_masters": ("Fp16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3",
                        "only supported with ZeRO stage 1, 2 or 3"),
    "z2_fp16_masters_no_offload": ("Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam",
                                   "requires zero_optimization.offload_optimizer.device \"cpu\" with DeepSpeedCPUAdam"),
    "z3_fp16_masters_no_offload": ("Master weights feature requires ZeRO-3 Offload with DeepSpeedCPUAdam",
                                   "requires zero_optimization.offload_optimizer.device \"cpu\" with DeepSpeedCPUAdam"),
    "z2_fp16_masters_offload_torch_adamw": ("Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam",
                                            "fp16_master_weights_and_grads: under ZeRO-2 CPU offload the optimizer "
                                            "must be DeepSpeedCPUAdam"),
    # DeepSpeed's checks pass; its step fails in torch's GradScaler: refused before training here
    "z2_fp16_autocast16_offload": ("Attempting to unscale FP16 gradients",
                                   "with torch_autocast dtype float16 is not supported"),
}
def _engine(case, world, rank_config=None):
    import dslaunch.runtime as deepspeed

    model = fx.make_model()
    return deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                config=rank_config or lp.case_config(case, world))[0]


def _train(engine, case, rank, world, start, steps=lp.SAVE_AT + 3, scaler=None):
    """The mean loss of each step; with `scaler` (a dict), also the steps skipped so far and
    the loss scale after each, as the fixture script records them."""
    import torch.distributed as dist

    losses = []
    for step in range(start, steps):
        x, y = fx.batch(step, rank, world, fx.torch_dtype(case.dtype))
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
        if scaler is not None:
            scaler.setdefault("skipped", []).append(int(engine.skipped_steps))
            scaler.setdefault("scale", []).append(float(engine.optimizer.loss_scaler.cur_scale))
    return losses


def replay_body(cases):
    """Each case trained from the start, and resumed from DeepSpeed's checkpoint at step 3; with
    what the strategy keeps between steps (dtypes of masters, state, gradients)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    for name in cases:
        case = lp.CASES[name]
        engine = _engine(case, world)
        scaler = {} if case.scale_power else None
        losses = _train(engine, case, rank, world, 0, scaler=scaler)
        kept = _kept(engine)
        engine.destroy()
        engine = _engine(case, world)
        path, client = engine.load_checkpoint(os.path.join(DATA, "ds", name))
        resumed_scaler = {} if case.scale_power else None
        resumed = _train(engine, case, rank, world, engine.global_steps, scaler=resumed_scaler)
        engine.destroy()
        out[name] = {"losses": losses, "resumed": resumed, "client": client, "kept": kept, "scaler": scaler,
                     "resumed_scaler": resumed_scaler}
    return out


def _kept(engine):
    """The dtypes the strategy holds between steps, and whether any gradient survives the step."""
    s = engine.strategy
    groups = [(g.master, g.grad) if hasattr(g, "master") else (g["master"], g["grad"]) for g in s.groups]
    states = [v.dtype for gi in range(len(groups)) for k, v in s.host.state_of(gi).items()
              if torch.is_tensor(v) and k != "step"]
    return {"master": sorted({str(m.dtype) for m, _ in groups}), "state": sorted({str(d) for d in states}),
            "grads_held": any(g is not None for _, g in groups), "policy": engine.precision.describe()}


def _check(outs, cases):
    for name in cases:
        case, got, want = lp.CASES[name], outs[0][name], EXPECTED["cases"][name]
        master = "torch.float16" if case.fp16_masters else "torch.bfloat16"
        tol = TOL[master]
        assert got["losses"] == pytest.approx(want["deepspeed"], rel=tol), (name, got["losses"], want["deepspeed"])
        assert got["resumed"] == pytest.approx(want["deepspeed"][lp.SAVE_AT:], rel=tol), (name, got["resumed"])
        assert got["client"] == {"source": "deepspeed"}, name
        # DeepSpeed's load_checkpoint resumed our checkpoint and went on as we did (fixture script)
        assert want["deepspeed_resumed_dslaunch"] == pytest.approx(want["dslaunch"][lp.SAVE_AT:], rel=tol), name
        # moments: bf16 states, or the masters' dtype under fp32_optimizer_states false, else fp32
        state = "torch.bfloat16" if case.bf16_states else master if case.low_states else "torch.float32"
        assert got["kept"]["master"] == [master] and got["kept"]["state"] == [state], (name, got["kept"])
        assert not got["kept"]["grads_held"], name
        if case.scale_power:  # the same steps overflowed and were skipped, the scale came down alike
            ds = want["deepspeed_scaler"]
            assert 0 < ds["skipped"][-1] < len(ds["skipped"]), ds  # some steps skipped, some applied
            assert got["scaler"] == ds, (name, got["scaler"])
            # resuming DeepSpeed's checkpoint restores its scale and skipped-step count
            assert got["resumed_scaler"] == {k: v[lp.SAVE_AT:] for k, v in ds.items()}, (name, got["resumed_scaler"])


def test_fixtures_hold_every_case():
    assert sorted(EXPECTED["cases"]) == sorted(lp.CASES)
    for name in lp.CASES:
        entry = EXPECTED["cases"][name]
        assert len(entry["deepspeed"]) == lp.SAVE_AT + 3 and len(entry["dslaunch"]) == lp.SAVE_AT + 3, name
        assert os.path.isdir(os.path.join(DATA, "ds", name, f"global_step{lp.SAVE_AT}")), name
    assert sorted(EXPECTED["refused"]) == sorted(lp.REFUSED)


@pytest.mark.parametrize("name", sorted(REASONS))
def test_what_deepspeed_refuses_is_refused_with_its_reason(name):
    from dslaunch.runtime.core.strict import ConfigError

    ds_line = EXPECTED["refused"][name]["error"]
    theirs, ours = REASONS[name]
    assert theirs in ds_line, ds_line
    case = lp.REFUSED[name]
    with pytest.raises(ConfigError) as err:
        # (torch's AdamW under offload is refused first for its slow step unless this says to accept it)
        _engine(case, 1, dict(lp.case_config(case, 1), zero_force_ds_cpu_optimizer=False))
    line = str(err.value)
    assert ours in line and "\n" not in line, line


def test_fp32_optimizer_states_false_keeps_moments_in_the_masters_dtype_under_offload():
    # DeepSpeed 0.19.8 builds DeepSpeedCPUAdam(fp32_optimizer_states=False) beside low-precision
    # masters under offload: the moments are the masters' dtype (z2_fp16_offload_fp16_states holds
    # the fp16 case to DeepSpeed's run); the precision policy says so
    from dslaunch.runtime.core.config import DeepSpeedConfig
    from dslaunch.runtime.core.precision import PrecisionPolicy

    for name, dtype in (("z1_fp16_offload", torch.float16), ("z2_bf16_offload_fp32_states", torch.bfloat16)):
        cfg = lp.case_config(lp.CASES[name], 2)
        assert PrecisionPolicy.from_config(DeepSpeedConfig.load(cfg)).optimizer_state == torch.float32, name
        cfg["optimizer"] = dict(cfg["optimizer"], params=dict(cfg["optimizer"]["params"], fp32_optimizer_states=False))
        assert PrecisionPolicy.from_config(DeepSpeedConfig.load(cfg)).optimizer_state == dtype, name
    # beside bf16 masters with bf16 states it says what the policy does: accepted
    cfg = lp.case_config(lp.CASES["z2_bf16_offload_bf16_states"], 1)
    cfg["optimizer"]["params"]["fp32_optimizer_states"] = False
    engine = _engine(lp.CASES["z2_bf16_offload_bf16_states"], 1, cfg)
    assert engine.precision.optimizer_state == torch.bfloat16
    engine.destroy()


def test_policy_from_config():
    from dslaunch.runtime.core.config import DeepSpeedConfig
    from dslaunch.runtime.core.precision import PrecisionPolicy

    p = PrecisionPolicy.from_config(DeepSpeedConfig.load(lp.case_config(lp.CASES["z3_bf16"], 2)))
    assert (p.compute, p.master, p.grad, p.optimizer_state, p.autocast, p.loss_scaler) == (
        torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, None, None)
    p = PrecisionPolicy.from_config(DeepSpeedConfig.load(lp.case_config(lp.CASES["z2_autocast"], 2)))
    assert (p.compute, p.master, p.optimizer_state, p.autocast) == (
        torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    p = PrecisionPolicy.from_config(DeepSpeedConfig.load(lp.case_config(lp.CASES["z2_bf16_offload_fp32_states"], 2)))
    assert (p.master, p.grad, p.optimizer_state) == (torch.bfloat16, torch.bfloat16, torch.float32)
    p = PrecisionPolicy.from_config(DeepSpeedConfig.load(lp.case_config(lp.CASES["z1_fp16_offload"], 2)))
    assert (p.compute, p.master, p.grad, p.optimizer_state) == (torch.float16, torch.float16, torch.float16,
                                                                 torch.float32)
    assert p.loss_scaler is not None and p.loss_scaler.dynamic
    p = PrecisionPolicy.from_config(DeepSpeedConfig.load(fx.config(2, "fp16", 2)))
    # gradients accumulate in the model dtype unless data_types.grad_accum_dtype says otherwise (DeepSpeed's
    # gradient_accumulation_dtype default)
    assert (p.compute, p.master, p.grad, p.optimizer_state) == (torch.float16, torch.float32, torch.float16,
                                                                 torch.float32)
    assert p.loss_scaler is not None
    cfg = fx.config(2, "fp16", 2)
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    assert PrecisionPolicy.from_config(DeepSpeedConfig.load(cfg)).grad == torch.float32


@pytest.mark.timeout(600)
def test_on_device_cases_train_and_resume_as_deepspeed():
    outs = run_function(replay_body, nprocs=2, kwargs={"cases": ON_DEVICE}, timeout=500)
    _check(outs, ON_DEVICE)


@pytest.mark.timeout(600)
def test_offloaded_cases_train_and_resume_as_deepspeed():
    outs = run_function(replay_body, nprocs=2, kwargs={"cases": OFFLOADED}, timeout=500)
    _check(outs, OFFLOADED)


@pytest.mark.timeout(600)
def test_fp16_masters_train_skip_overflows_and_resume_as_deepspeed():
    outs = run_function(replay_body, nprocs=2, kwargs={"cases": FP16}, timeout=500)
    _check(outs, FP16)


def test_bench_formula_rows():
    bench = load_script("bench_vs_deepspeed")
    P, N = 1_000_000, 4
    m16 = bench.Row(3, "bf16", masters="bf16")
    # between steps (no gradients): DeepSpeed 2 + 2 + 4 bytes per element over N; ours 2 + 4 (the shard is the
    # master); fp32 masters 2 + 4 + 8
    assert bench.formula_bytes(m16, P, N, 0, side="deepspeed") == 8 * P / N
    assert bench.formula_bytes(m16, P, N, 0) == 6 * P / N
    assert bench.formula_bytes(bench.Row(3, "bf16"), P, N, 0) == 14 * P / N
    assert bench.formula_bytes(bench.Row(2, "bf16", "cpu", masters="bf16s32"), P, N, 0, side="deepspeed") == 2 * P + 10 * P / N
    assert {r.name for r in bench.all_rows()} >= {"1-bf16-m16", "3-bf16-m16", "2-bf16-cpu-m16", "3-bf16-cpu-m16s32"}
    cfg = bench.ds_config(bench.Row(2, "bf16", "cpu", masters="bf16s32"), type("A", (), dict(
        bucket=0, persistence=None, micro=1, gas=1, grad_accum_dtype=None))(), "/tmp")
    assert cfg["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": False}
