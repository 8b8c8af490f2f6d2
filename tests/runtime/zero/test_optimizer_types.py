"""Optimizers by config `type`: which implementation each name builds for where its step
runs, what is refused and why, DeepSpeed's import paths, and (one 2-rank job) Lion,
Adagrad and Adam under ZeRO with the optimizer offloaded to the CPU kernels against the
same optimizer at stage 0 without offload.
"""
import inspect
import os
import tempfile

import pytest
import torch

from dist_harness import run_function
from dslaunch.runtime.config import OptimizerConfig
from dslaunch.runtime.optim import OptimizerTarget, build_optimizer
from dslaunch.runtime.strict import ConfigError
from test_zero_parity import FP32_TOL, batches, global_mean, make_model

CPU, OFFLOAD, CUDA = OptimizerTarget(), OptimizerTarget(offload=True), OptimizerTarget(cuda=True)


def _build(name, params=None, target=CPU):
    return build_optimizer(OptimizerConfig(name, params or {}), [torch.nn.Parameter(torch.zeros(3))], target)


@pytest.mark.parametrize("name,target,cls", [
    ("Adam", CPU, "FusedAdam"), ("adam", OFFLOAD, "DeepSpeedCPUAdam"), ("AdamW", OFFLOAD, "DeepSpeedCPUAdam"),
    ("Lion", CPU, "FusedLion"), ("Lion", OFFLOAD, "DeepSpeedCPULion"), ("Adagrad", CPU, "Adagrad"), ("Adagrad", OFFLOAD, "CPUAdagrad"),
    ("Lamb", CPU, "Lamb"), ("FusedLamb", OFFLOAD, "FusedLamb"), ("CPUAdam", CPU, "DeepSpeedCPUAdam"),
    ("DeepSpeedCPUAdam", OFFLOAD, "DeepSpeedCPUAdam"), ("CPULion", OFFLOAD, "DeepSpeedCPULion"),
    ("DeepSpeedCPUAdagrad", OFFLOAD, "DeepSpeedCPUAdagrad"), ("FusedLion", CPU, "FusedLion"),
    ("SGD", CPU, "SGD"), ("RMSprop", OFFLOAD, "RMSprop"), ("NAdam", CPU, "NAdam"),
])
def test_each_type_builds_the_implementation_for_where_the_step_runs(name, target, cls):
    assert type(_build(name, target=target)).__name__ == cls


def test_adam_modes_and_deepspeed_defaults():
    adam = _build("Adam", {"adam_w_mode": False})  # CPU parameters: FusedAdam (the SIMD kernel) in Adam's L2 form
    assert type(adam).__name__ == "FusedAdam" and adam.param_groups[0]["decoupled_weight_decay"] is False
    assert adam.adam_w_mode is False  # DeepSpeed's attribute, which scripts read
    assert type(_build("Adam", {"torch_adam": True})) is torch.optim.AdamW  # torch's own, when asked
    # with torch_adam an unset weight_decay is torch's class default, as DeepSpeed passes the params as they are
    assert _build("Adam", {"torch_adam": True}).param_groups[0]["weight_decay"] == 0.01
    assert _build("Adam", {"torch_adam": True, "adam_w_mode": False}).param_groups[0]["weight_decay"] == 0.0
    assert _build("AdamW", {"torch_adam": True, "weight_decay": 0.0}).param_groups[0]["weight_decay"] == 0.0
    cpu = _build("Adam", {"adam_w_mode": False, "lr": 0.5}, OFFLOAD)
    assert cpu.param_groups[0]["decoupled_weight_decay"] is False and cpu.param_groups[0]["lr"] == 0.5
    # DeepSpeed's defaults: weight_decay 0 for Adam and AdamW alike, Lion lr 1e-3 and betas (0.9, 0.999).
    assert _build("AdamW").param_groups[0]["weight_decay"] == 0.0
    lion = _build("Lion", target=OFFLOAD).param_groups[0]
    assert lion["lr"] == 1e-3 and lion["betas"] == (0.9, 0.999)
    # bias_correction false: torch's Adam cannot, so the CPU kernel steps it (DeepSpeed's FusedAdam).
    assert type(_build("Adam", {"bias_correction": False})).__name__ == "FusedAdam"
    # torch_adam: torch's own step even with offload; the offload is told not to fuse it.
    from dslaunch.kernels import describe

    forced = _build("Adam", {"torch_adam": True}, OFFLOAD)
    assert type(forced) is torch.optim.AdamW and "torch_adam" in describe(forced)


@pytest.mark.parametrize("name,params,target,words", [
    ("OneBitAdam", {}, CPU, "1-bit optimizers compress gradients"),
    ("ZeroOneAdam", {}, OFFLOAD, "use Adam"),
    ("OneBitLamb", {}, CPU, "use Lamb"),
    ("MuAdamW", {}, CPU, "mup"),
    ("Muon", {}, CPU, "Muon needs every parameter tagged with use_muon"),  # untagged: not through initialize
    ("LBFGS", {}, CPU, "closure"),
    ("Adamm", {}, CPU, "did you mean"),
    ("Adam", {"lrr": 0.1}, CPU, "optimizer.params.lrr: not a parameter of Adam"),
    ("Adam", {"max_grad_norm": 1.0}, CPU, "gradient_clipping"),
    ("AdamW", {"adam_w_mode": False}, CPU, "contradicts type AdamW"),
    ("Adam", {"fp32_optimizer_states": False}, OFFLOAD, "fp32_optimizer_states"),
    ("CPULion", {"fp32_optimizer_states": False}, OFFLOAD, "steps fp32 master parameters"),
    ("FusedAdam", {}, CPU, "there is no GPU"),
    ("FusedAdam", {}, OptimizerTarget(offload=True, cuda=True), "offload_optimizer puts the step on the CPU"),
    ("CPUAdam", {}, CUDA, "offload_optimizer.device"),
    ("Lamb", {"amsgrad": True}, CPU, "no AMSGrad"),
])
def test_refusals_name_the_key_and_the_reason(name, params, target, words):
    with pytest.raises(ConfigError) as info:
        _build(name, params, target)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_deepspeed_import_paths_take_deepspeeds_signatures():
    from dslaunch.runtime.ops.adagrad import DeepSpeedCPUAdagrad
    from dslaunch.runtime.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from dslaunch.runtime.ops.lamb import FusedLamb
    from dslaunch.runtime.ops.lion import DeepSpeedCPULion, FusedLion

    expected = {  # DeepSpeed 0.19.8's parameter names, in order
        DeepSpeedCPUAdam: "model_params lr bias_correction betas eps weight_decay amsgrad adamw_mode "
                          "fp32_optimizer_states",
        FusedAdam: "params lr bias_correction betas eps adam_w_mode weight_decay amsgrad set_grad_none",
        DeepSpeedCPULion: "model_params lr betas weight_decay fp32_optimizer_states",
        FusedLion: "params lr betas weight_decay set_grad_none",
        DeepSpeedCPUAdagrad: "model_params lr eps weight_decay amsgrad fp32_optimizer_states",
        FusedLamb: "params lr bias_correction betas eps eps_inside_sqrt weight_decay max_grad_norm max_coeff "
                   "min_coeff amsgrad",
    }
    for cls, names in expected.items():
        assert list(inspect.signature(cls.__init__).parameters)[1:] == names.split(), cls.__name__
    p = torch.nn.Parameter(torch.ones(5))
    p.grad = torch.ones(5)
    # Positional, as DeepSpeed callers write it: lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode.
    opt = DeepSpeedCPUAdam([p], 0.1, True, (0.9, 0.999), 1e-8, 0.0, False, False)
    opt.step()
    assert opt.param_groups[0]["decoupled_weight_decay"] is False and float(p.detach()[0]) == pytest.approx(0.9, abs=1e-6)
    with pytest.raises(ValueError, match="no AMSGrad"):
        DeepSpeedCPUAdagrad([p], amsgrad=True)
    lion = FusedLion([p], 0.1, (0.9, 0.999), 0.0, False)
    p.grad = torch.ones(5)
    lion.step()
    lion.zero_grad()  # set_grad_none=False: gradients zeroed, not dropped
    assert p.grad is not None and float(p.grad.abs().sum()) == 0.0


# -- the 2-rank ZeRO job --------------------------------------------------------------

# type -> (params, the ZeRO runs: (stage, offload, class built, kernel named by describe() or None)).
# Each run is compared with the same type at stage 0 without offload.
CASES = {
    "Lion": ({"lr": 0.003, "weight_decay": 0.1},
             [(2, "cpu", "DeepSpeedCPULion", "dslaunch CPU Lion"), (2, "none", "FusedLion", None)]),
    "Adagrad": ({"lr": 0.05, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
                [(1, "nvme", "CPUAdagrad", "dslaunch CPU Adagrad"), (3, "none", "Adagrad", None)]),
    "Adam": ({"lr": 0.03, "weight_decay": 0.1}, [(2, "cpu", "DeepSpeedCPUAdam", "dslaunch CPU Adam")]),
    "DeepSpeedCPUAdam": ({"lr": 0.03, "adamw_mode": False},
                         [(3, "cpu", "DeepSpeedCPUAdam", "dslaunch CPU Adam")]),
    "DeepSpeedCPULion": ({"lr": 0.003}, [(1, "cpu", "DeepSpeedCPULion", "dslaunch CPU Lion")]),
    "DeepSpeedCPUAdagrad": ({"lr": 0.05}, [(2, "nvme", "DeepSpeedCPUAdagrad", "dslaunch CPU Adagrad")]),
}


def _engine(opt_type, opt_params, stage, offload, nvme):
    import dslaunch.runtime as deepspeed

    cfg = {"train_batch_size": 12, "steps_per_print": 1000, "gradient_clipping": 0.5,
           "optimizer": {"type": opt_type, "params": opt_params},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40,
                                 "sub_group_size": 16}}
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": nvme}
    engine, optimizer, _, _ = deepspeed.initialize(model=make_model(), config=cfg)
    return engine, optimizer


def _run(opt_type, opt_params, stage, offload, nvme, rank, world):
    import warnings

    from dslaunch.kernels import describe
    from dslaunch.runtime.monitor.report import startup_line

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer = _engine(opt_type, opt_params, stage, offload, nvme)
        losses = []
        for x, y in batches(rank, world, 4, 1):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(global_mean(float(loss)))
    host = getattr(engine.strategy, "host", None)  # the ZeRO stage's optimizer host
    run = {"losses": losses, "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
           "class": type(optimizer).__name__,
           # DeepSpeed scripts reach the optimizer under its ZeRO wrapper as engine.optimizer.optimizer
           "base_is_itself": engine.optimizer.optimizer is optimizer is engine.optimizer, "describe": describe(optimizer), "startup": startup_line(engine),
           "fused": getattr(host, "kernel", None) is not None,
           "warnings": [str(w.message) for w in caught if "fused" in str(w.message)]}
    if hasattr(engine, "destroy"):
        engine.destroy()
    return run


def _types_worker(tmp):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nvme = tempfile.mkdtemp(prefix="opt-types-nvme-", dir=tmp)
    out = {}
    for opt_type, (opt_params, runs) in CASES.items():
        ref = _run(opt_type, opt_params, 0, "none", nvme, rank, world)
        for stage, offload, _, _ in runs:
            r = _run(opt_type, opt_params, stage, offload, nvme, rank, world)
            r["max_param_diff"] = max(float((r["params"][n] - ref["params"][n]).abs().max()) for n in ref["params"])
            r["ref_losses"] = ref["losses"]
            del r["params"]
            out[f"{opt_type}-s{stage}-{offload}"] = r
    return out


@pytest.mark.timeout(300)
def test_each_type_under_zero_with_and_without_offload_matches_stage0(tmp_path):
    """Lion, Adagrad and Adam (and the DeepSpeed-named classes) under ZeRO stages 1-3: with
    offload the optimizer's CPU kernel steps the host partitions (CPU and NVMe), without it
    the optimizer itself; either way the result equals the same type at stage 0."""
    for result in run_function(_types_worker, nprocs=2, kwargs={"tmp": str(tmp_path)}, timeout=280):
        for opt_type, (_, runs) in CASES.items():
            for stage, offload, cls, kernel in runs:
                key = f"{opt_type}-s{stage}-{offload}"
                r = result[key]
                assert r["class"] == cls and r["warnings"] == [], (key, r["class"], r["warnings"])
                assert r["base_is_itself"], key
                assert r["fused"] == (kernel is not None), key
                if kernel:
                    assert kernel in r["describe"], (key, r["describe"])
                    # the type the config asked for, then the class that implements it (and
                    # Adam's weight decay): "optimizer Adam (DeepSpeedCPUAdam, adam_w_mode) stepped by ..."
                    label = opt_type if cls == opt_type else f"{opt_type} ({cls}"
                    assert f"optimizer {label}" in r["startup"], (key, r["startup"])
                    assert f") stepped by {kernel}" in r["startup"] or f"{cls} stepped by {kernel}" in r["startup"]
                    mode = {"Adam": "adam_w_mode)", "DeepSpeedCPUAdam": "(adam_w_mode false: L2 weight decay)"}
                    assert mode.get(opt_type, "") in r["startup"], (key, r["startup"])
                assert r["losses"] == pytest.approx(r["ref_losses"], rel=FP32_TOL, abs=FP32_TOL), key
                assert r["max_param_diff"] <= 1e-4, (key, r["max_param_diff"])


@pytest.mark.parametrize("opt_type,params,label", [
    ("AdamW", {}, "AdamW (FusedAdam, adam_w_mode)"),
    ("Adam", {"adam_w_mode": False}, "Adam (FusedAdam, adam_w_mode false: L2 weight decay)"),
    ("Adam", {"torch_adam": True}, "Adam (AdamW, adam_w_mode)"),
    ("SGD", {"lr": 0.1}, "SGD"),
])
def test_the_start_up_line_names_the_optimizer_the_config_asked_for(opt_type, params, label):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.monitor.report import startup_line

    model = torch.nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=model, config={"train_batch_size": 1, "log_level": "warning",
                                                           "optimizer": {"type": opt_type, "params": params}})
    assert f"| optimizer {label} stepped by " in startup_line(engine)


# DeepSpeed 0.19.8's table for "Adam"/"AdamW", taken from the expectations written in its own
# ops/adam/test_adamw.py (not recorded by running DeepSpeed): (type, offload, torch_adam,
# adam_w_mode) -> (class, the class's adam_w_mode). An AdamW
# with adam_w_mode false is refused here in one line ("contradicts type AdamW", above), where
# DeepSpeed silently keeps AdamW; those rows are left out.
DEEPSPEED_ADAM_TABLE = [
    ("AdamW", False, False, True, "FusedAdam", True), ("AdamW", False, True, True, "AdamW", None),
    ("AdamW", True, False, True, "DeepSpeedCPUAdam", True), ("AdamW", True, True, True, "AdamW", None),
    ("Adam", False, False, False, "FusedAdam", False), ("Adam", False, True, False, "Adam", None),
    ("Adam", True, False, False, "DeepSpeedCPUAdam", False), ("Adam", True, True, False, "Adam", None),
    ("Adam", False, False, True, "FusedAdam", True), ("Adam", False, True, True, "AdamW", None),
    ("Adam", True, False, True, "DeepSpeedCPUAdam", True), ("Adam", True, True, True, "AdamW", None),
]


@pytest.mark.parametrize("opt_type,offload,torch_adam,adam_w_mode,cls,mode", DEEPSPEED_ADAM_TABLE)
def test_adam_classes_are_deepspeeds(opt_type, offload, torch_adam, adam_w_mode, cls, mode):
    from dslaunch.runtime.ops import adam as ds_adam

    built = _build(opt_type, {"lr": 1.5e-4, "torch_adam": torch_adam, "adam_w_mode": adam_w_mode},
                   OFFLOAD if offload else CPU)
    assert type(built).__name__ == cls
    if mode is not None:
        assert isinstance(built, getattr(ds_adam, cls)) and built.adam_w_mode is mode


def test_initialize_returns_deepspeeds_fused_adam_for_a_config_adam():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.ops.adam import FusedAdam

    model = torch.nn.Linear(4, 2)
    _, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                              config={"train_batch_size": 1, "log_level": "warning",
                                                      "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert isinstance(optimizer, FusedAdam) and optimizer.adam_w_mode is True
