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
    ("Adam", CPU, "AdamW"), ("adam", OFFLOAD, "CPUAdam"), ("AdamW", OFFLOAD, "CPUAdam"),
    ("Lion", CPU, "Lion"), ("Lion", OFFLOAD, "CPULion"), ("Adagrad", CPU, "Adagrad"), ("Adagrad", OFFLOAD, "CPUAdagrad"),
    ("Lamb", CPU, "Lamb"), ("FusedLamb", OFFLOAD, "FusedLamb"), ("CPUAdam", CPU, "DeepSpeedCPUAdam"),
    ("DeepSpeedCPUAdam", OFFLOAD, "DeepSpeedCPUAdam"), ("CPULion", OFFLOAD, "DeepSpeedCPULion"),
    ("DeepSpeedCPUAdagrad", OFFLOAD, "DeepSpeedCPUAdagrad"), ("FusedLion", CPU, "FusedLion"),
    ("SGD", CPU, "SGD"), ("RMSprop", OFFLOAD, "RMSprop"), ("NAdam", CPU, "NAdam"),
])
def test_each_type_builds_the_implementation_for_where_the_step_runs(name, target, cls):
    assert type(_build(name, target=target)).__name__ == cls


def test_adam_modes_and_deepspeed_defaults():
    adam = _build("Adam", {"adam_w_mode": False})
    assert type(adam) is torch.optim.Adam
    cpu = _build("Adam", {"adam_w_mode": False, "lr": 0.5}, OFFLOAD)
    assert cpu.param_groups[0]["decoupled_weight_decay"] is False and cpu.param_groups[0]["lr"] == 0.5
    # DeepSpeed's defaults: weight_decay 0 for Adam and AdamW alike, Lion lr 1e-3 and betas (0.9, 0.999).
    assert _build("AdamW").param_groups[0]["weight_decay"] == 0.0
    lion = _build("Lion", target=OFFLOAD).param_groups[0]
    assert lion["lr"] == 1e-3 and lion["betas"] == (0.9, 0.999)
    # bias_correction false: torch's Adam cannot, so the CPU kernel steps it.
    assert type(_build("Adam", {"bias_correction": False})).__name__ == "CPUAdam"
    # torch_adam: torch's own step even with offload; the offload is told not to fuse it.
    from dslaunch.kernels import describe

    forced = _build("Adam", {"torch_adam": True}, OFFLOAD)
    assert type(forced) is torch.optim.AdamW and "torch_adam" in describe(forced)


@pytest.mark.parametrize("name,params,target,words", [
    ("OneBitAdam", {}, CPU, "1-bit optimizers compress gradients"),
    ("ZeroOneAdam", {}, OFFLOAD, "use Adam"),
    ("OneBitLamb", {}, CPU, "use Lamb"),
    ("MuAdamW", {}, CPU, "mup"),
    ("Muon", {}, CPU, "initialize(optimizer=...)"),
    ("LBFGS", {}, CPU, "closure"),
    ("Adamm", {}, CPU, "did you mean"),
    ("Adam", {"lrr": 0.1}, CPU, "optimizer.params.lrr: not a parameter of Adam"),
    ("Adam", {"max_grad_norm": 1.0}, CPU, "gradient_clipping"),
    ("AdamW", {"adam_w_mode": False}, CPU, "contradicts type AdamW"),
    ("Adam", {"fp32_optimizer_states": False}, OFFLOAD, "fp32_optimizer_states"),
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
    with pytest.raises(ValueError, match="fp32_optimizer_states"):
        DeepSpeedCPULion([p], fp32_optimizer_states=False)
    with pytest.raises(ValueError, match="no AMSGrad"):
        DeepSpeedCPUAdagrad([p], amsgrad=True)
    lion = FusedLion([p], 0.1, (0.9, 0.999), 0.0, False)
    p.grad = torch.ones(5)
    lion.step()
    lion.zero_grad()  # set_grad_none=False: gradients zeroed, not dropped
    assert p.grad is not None and float(p.grad.abs().sum()) == 0.0


# -- the 2-rank ZeRO job --------------------------------------------------------------

CASES = [  # (type, params, stage, offload): each against the same type at stage 0 without offload
    ("Lion", {"lr": 0.003, "weight_decay": 0.1}, 2, "cpu"),
    ("Adagrad", {"lr": 0.05, "weight_decay": 0.01, "initial_accumulator_value": 0.1}, 1, "nvme"),
    ("Adam", {"lr": 0.03, "weight_decay": 0.1}, 2, "cpu"),
]


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


def _types_worker():
    import warnings

    from dslaunch.kernels import describe

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    nvme = tempfile.mkdtemp(prefix="opt-types-nvme-")
    for opt_type, opt_params, stage, offload in CASES:
        runs = {}
        for where in ("reference", "offload"):
            args = (opt_type, opt_params, 0, "none") if where == "reference" else (opt_type, opt_params, stage, offload)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine, optimizer = _engine(*args, nvme)
                losses = []
                for step, (x, y) in enumerate(batches(rank, world, 4, 1)):
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    losses.append(global_mean(float(loss)))
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            host = getattr(engine.strategy, "host", None)  # the ZeRO stage's optimizer host
            from dslaunch.runtime.monitor.report import startup_line

            runs[where] = {"losses": losses, "params": params, "class": type(optimizer).__name__,
                           "startup": startup_line(engine),
                           "describe": describe(optimizer), "fused": getattr(host, "kernel", None) is not None,
                           "warnings": [str(w.message) for w in caught if "fused" in str(w.message)]}
            engine.destroy() if hasattr(engine, "destroy") else None
        ref, off = runs["reference"], runs["offload"]
        out[opt_type] = {"ref_class": ref["class"], "class": off["class"], "describe": off["describe"],
                         "startup": off["startup"],
                         "fused": off["fused"], "warnings": off["warnings"], "losses": (ref["losses"], off["losses"]),
                         "max_param_diff": max(float((off["params"][n] - ref["params"][n]).abs().max())
                                               for n in ref["params"])}
    return out


@pytest.mark.timeout(300)
def test_offloaded_lion_adagrad_and_adam_run_their_cpu_kernels_and_match_stage0():
    expected = {"Lion": ("Lion", "CPULion", "dslaunch CPU Lion"),
                "Adagrad": ("Adagrad", "CPUAdagrad", "dslaunch CPU Adagrad"),
                "Adam": ("AdamW", "CPUAdam", "dslaunch CPU Adam")}
    for result in run_function(_types_worker, nprocs=2, timeout=280):
        for opt_type, (ref_class, cls, kernel) in expected.items():
            r = result[opt_type]
            assert (r["ref_class"], r["class"]) == (ref_class, cls), (opt_type, r)
            assert r["fused"] and kernel in r["describe"] and r["warnings"] == [], (opt_type, r)
            assert f"optimizer {cls} stepped by {kernel}" in r["startup"], r["startup"]
            ref_losses, losses = r["losses"]
            assert losses == pytest.approx(ref_losses, rel=FP32_TOL, abs=FP32_TOL), opt_type
            assert r["max_param_diff"] <= 1e-4, (opt_type, r["max_param_diff"])
