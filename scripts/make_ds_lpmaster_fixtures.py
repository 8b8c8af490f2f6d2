"""Make the low-precision master-state fixtures in tests/data/ds_lpmaster/ with real DeepSpeed.

    .venv/bin/python scripts/make_ds_lpmaster_fixtures.py --ds-python /work/ds-venv/bin/python [--cases a,b]

DeepSpeed 0.19.8 (CPU accelerator, gloo, 2 ranks) and dslaunch run the training script of
scripts/make_ds_fixtures.py (the tiny MLP, WarmupLR, gradient clipping, fixed global batches)
with `bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states` and
`fp16.fp16_master_weights_and_grads` set as each case (CASES) says, saving at step 3 and
running 3 steps more. For each case it writes:

  ds/CASE/          DeepSpeed's checkpoint at global_step3
  dslaunch/CASE/    dslaunch's checkpoint of the same run
  expected.json     per case: DeepSpeed's 6 losses, dslaunch's, and DeepSpeed's 3 losses
                    resuming dslaunch/CASE; under "refused" the one line DeepSpeed stops with
                    for each combination it does not allow (REFUSED)

tests/runtime/zero/test_lpmaster.py replays our side against them without DeepSpeed: the losses, dslaunch
resuming ds/CASE, and our refusals carrying DeepSpeed's reason.

fp16: DeepSpeed's CPU accelerator refuses fp16 unless the processor's oneDNN has fp16 kernels
("Type fp16 is not supported on your device"); for the fp16 cases the DeepSpeed workers tell it
they have them (CPU_Accelerator.is_fp16_supported, as make_ds_pystyle_fixtures.py does); torch
computes fp16 on any CPU and nothing else of DeepSpeed is changed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_lpmaster")
_spec = importlib.util.spec_from_file_location("make_ds_fixtures", os.path.join(HERE, "make_ds_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

WORLD, SAVE_AT = 2, 3


class Case(NamedTuple):
    """One combination: ZeRO stage; the model dtype ("bf16": bf16.enabled, "autocast": fp32
    parameters under torch_autocast bf16, "fp32"); the master flags; offload; the optimizer
    (make_ds_fixtures.OPTIMIZERS' name: torch_adamw, or adam, which offload makes DeepSpeedCPUAdam);
    "autocast16" is fp32 parameters under torch_autocast float16. scale_power: fp16's
    initial_scale_power (0: DeepSpeed's default), set high so that steps overflow and are skipped.
    low_states: optimizer.params.fp32_optimizer_states false (under offload DeepSpeedCPUAdam then keeps
    the moments in the masters' dtype)."""

    stage: int
    dtype: str = "bf16"
    bf16_masters: bool = True
    bf16_states: bool = True
    fp16_masters: bool = False
    offload: bool = False
    optimizer: str = "torch_adamw"
    scale_power: int = 0
    low_states: bool = False
    offload_param: bool = False


# What DeepSpeed 0.19.8 allows (stage_1_and_2.py / stage3.py `_configure_master_weights`):
# bf16 masters with bf16 optimizer states on the device at stages 1-3; bf16 masters with fp32
# states only under CPU offload with DeepSpeedCPUAdam; fp16 masters (fp32 moments, or fp16 ones with
# fp32_optimizer_states false) only under CPU offload with DeepSpeedCPUAdam, with fp16 parameters or
# under torch_autocast bfloat16.
_F16 = dict(bf16_masters=False, bf16_states=False, fp16_masters=True)
CASES = {
    "z1_bf16": Case(1), "z2_bf16": Case(2), "z3_bf16": Case(3),
    "z2_autocast": Case(2, "autocast"), "z3_autocast": Case(3, "autocast"),
    "z2_bf16_offload_fp32_states": Case(2, bf16_states=False, offload=True, optimizer="adam"),
    "z2_bf16_offload_bf16_states": Case(2, offload=True, optimizer="adam"),
    "z3_bf16_offload_fp32_states": Case(3, bf16_states=False, offload=True, optimizer="adam"),
    "z1_fp16_offload": Case(1, "fp16", offload=True, optimizer="adam", **_F16),
    # at 2**17 the first step overflows and is skipped, the scale halves to 2**16 and training goes
    # on (hysteresis 1: each overflow halves the scale)
    "z2_fp16_offload_overflow": Case(2, "fp16", offload=True, optimizer="adam", scale_power=17, **_F16),
    "z3_fp16_offload_overflow": Case(3, "fp16", offload=True, optimizer="adam", scale_power=17, **_F16),
    "z2_fp16_autocast_offload": Case(2, "autocast", offload=True, optimizer="adam", **_F16),
    # fp16 moments: DeepSpeedCPUAdam(fp32_optimizer_states=False) beside fp16 masters
    "z2_fp16_offload_fp16_states": Case(2, "fp16", offload=True, optimizer="adam", low_states=True, **_F16),
    "z3_fp16_offload_fp16_states": Case(3, "fp16", offload=True, optimizer="adam", low_states=True, **_F16),
    "z3_fp16_offload_all_fp16_states": Case(3, "fp16", offload=True, optimizer="adam", low_states=True,
                                            offload_param=True, **_F16),
}
# What it refuses: the one line it stops with is recorded.
REFUSED = {
    "z0_bf16_masters": Case(0),
    "z2_states_without_masters": Case(2, bf16_masters=False),
    "z2_bf16_fp32_states_no_offload": Case(2, bf16_states=False),
    "z2_bf16_offload_torch_adamw": Case(2, bf16_states=False, offload=True),
    "z0_fp16_masters": Case(0, "fp16", **_F16),
    "z2_fp16_masters_no_offload": Case(2, "fp16", **_F16),
    "z3_fp16_masters_no_offload": Case(3, "fp16", **_F16),
    "z2_fp16_masters_offload_torch_adamw": Case(2, "fp16", offload=True, **_F16),
    # allowed by its checks, but its ZeRO steps through torch's GradScaler, which refuses fp16
    # gradients at the first step
    "z2_fp16_autocast16_offload": Case(2, "autocast16", offload=True, optimizer="adam", **_F16),
}


def case_config(case: Case, world: int) -> dict:
    """make_ds_fixtures' config for the case, with the master-state keys."""
    model_dtype = case.dtype if case.dtype in ("bf16", "fp16") else "fp32"
    cfg = fx.config(case.stage, model_dtype, world, case.optimizer)
    if case.offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if case.offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if case.dtype in ("autocast", "autocast16"):
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16" if case.dtype == "autocast" else "float16"}
    if case.bf16_masters or case.bf16_states:
        cfg.setdefault("bf16", {"enabled": False})
        cfg["bf16"].update(bf16_master_weights_and_grads=case.bf16_masters,
                           bf16_optimizer_states=case.bf16_states)
    if case.fp16_masters:
        cfg.setdefault("fp16", {"enabled": False})
        cfg["fp16"]["fp16_master_weights_and_grads"] = True
    if case.scale_power:
        cfg["fp16"].update(initial_scale_power=case.scale_power, hysteresis=1)
    if case.low_states:
        cfg["optimizer"] = dict(cfg["optimizer"], params=dict(cfg["optimizer"]["params"], fp32_optimizer_states=False))
    return cfg


def worker(rank: int, job: dict) -> None:
    import torch.distributed as dist

    from bench_ranks import finish_script_rank, script_rank  # scripts/, on sys.path in a worker

    deepspeed = script_rank(rank, job)
    if job["engine"] == "deepspeed" and (job["case"]["dtype"] == "fp16" or job["case"]["fp16_masters"]):
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring
    case = Case(**job["case"])
    model = fx.make_model()
    engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                  config=case_config(case, job["world"]))[0]
    start = 0
    if job.get("load"):
        path, _ = engine.load_checkpoint(job["load"])
        assert path is not None, job["load"]
        start = engine.global_steps
    losses, skipped, scales = [], [], []
    xdtype = fx.torch_dtype(case.dtype)  # autocast: fp32 inputs
    for step in range(start, SAVE_AT + 3):
        x, y = fx.batch(step, rank, job["world"], xdtype)
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / job["world"])
        if job.get("scaler"):  # after each step: steps skipped so far, and the loss scale
            skipped.append(int(engine.skipped_steps))
            scales.append(float(engine.optimizer.loss_scaler.cur_scale))
        if job.get("save") and step + 1 == SAVE_AT:
            engine.save_checkpoint(job["save"], tag=f"global_step{SAVE_AT}", client_state={"source": job["engine"]})
    if rank == 0 and job.get("scaler"):
        with open(job["scaler"], "w") as fh:
            json.dump({"skipped": skipped, "scale": scales}, fh)
    finish_script_rank(rank, job, losses)


def run(python: str, job: dict, capture: bool = False):
    from bench_ranks import run_script_ranks  # on sys.path when run as a script

    return run_script_ranks(python, __file__, job, job["world"], ROOT, capture=capture)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds-python", default="/work/ds-venv/bin/python", help="a python with deepspeed==0.19.8")
    ap.add_argument("--cases", default=",".join(list(CASES) + list(REFUSED)))
    ap.add_argument("--deepspeed-only", action="store_true",
                    help="record DeepSpeed's side only (dslaunch's losses and the resume of ours are left as they are)")
    ap.add_argument("--ours-only", action="store_true",
                    help="keep DeepSpeed's recorded run and checkpoint; record dslaunch's and DeepSpeed resuming it")
    args = ap.parse_args()
    path = os.path.join(OUT, "expected.json")
    expected = {}
    if os.path.exists(path):
        with open(path) as fh:
            expected = json.load(fh)
    os.makedirs(OUT, exist_ok=True)
    for name in args.cases.split(","):
        if name in REFUSED:
            case = REFUSED[name]
            got = run(args.ds_python, dict(case=case._asdict(), engine="deepspeed", world=WORLD), capture=True)
            if isinstance(got, list):
                raise SystemExit(f"{name}: DeepSpeed ran it ({got}); move it to CASES")
            expected.setdefault("refused", {})[name] = {"case": case._asdict(), "error": got}
            print(f"{name}: DeepSpeed refuses: {got}", flush=True)
            _write(path, "refused", name, expected["refused"][name])
            continue
        case = CASES[name]
        base = dict(case=case._asdict(), world=WORLD)
        ds_dir, our_dir = os.path.join(OUT, "ds", name), os.path.join(OUT, "dslaunch", name)
        entry = expected.setdefault("cases", {}).setdefault(name, {})
        entry["case"] = case._asdict()
        scaler = os.path.join(OUT, f".{name}.scaler.json") if case.scale_power else None
        if not args.ours_only:
            shutil.rmtree(ds_dir, ignore_errors=True)
            entry["deepspeed"] = run(args.ds_python, dict(base, engine="deepspeed", save=ds_dir, scaler=scaler))
            fx._tidy(ds_dir)
            if scaler:
                entry["deepspeed_scaler"] = _pop_json(scaler)
        if not args.deepspeed_only:
            shutil.rmtree(our_dir, ignore_errors=True)
            entry["dslaunch"] = run(sys.executable, dict(base, engine="dslaunch", save=our_dir, scaler=scaler))
            if scaler:
                entry["dslaunch_scaler"] = _pop_json(scaler)
            entry["deepspeed_resumed_dslaunch"] = run(args.ds_python, dict(base, engine="deepspeed", load=our_dir))
            fx._tidy(our_dir)
        print(f"{name}: {json.dumps(entry)}", flush=True)
        _write(path, "cases", name, entry)


def _pop_json(path: str):
    with open(path) as fh:
        got = json.load(fh)
    os.remove(path)
    return got


def _write(path: str, section: str, name: str, entry: dict) -> None:
    """After every case, into the file as it is now: a long run keeps what it made, and runs of
    other cases at the same time keep theirs."""
    expected = {}
    if os.path.exists(path):
        with open(path) as fh:
            expected = json.load(fh)
    expected.setdefault(section, {})[name] = entry
    with open(path + ".tmp", "w") as fh:
        json.dump(expected, fh, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    from bench_ranks import script_main  # scripts/, on sys.path when run as a script

    script_main(worker, main)
