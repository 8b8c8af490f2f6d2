"""Make the Muon fixtures in tests/data/ds_muon/expected.json with real DeepSpeed.

    .venv/bin/python scripts/make_ds_muon_fixtures.py --ds-python /work/ds-venv/bin/python [--cases a,b]

DeepSpeed (0.19.8, CPU accelerator, gloo) and dslaunch run the same training script
(`worker` below: the same calls, `import deepspeed` or `import dslaunch.runtime as
deepspeed`) with `"optimizer": {"type": "Muon"}`: a small transformer-shaped model (token
embedding, two blocks of LayerNorm + fused QKV + projection + MLP, LM head) whose Muon
matrices are laid out so that partition boundaries cut through them at 2 ranks (one at 3),
fixed global batches split over the ranks (so the losses do not depend on the world size),
separate muon_lr / adam_lr, weight decay, and DeepSpeed's default gradient clipping of 1.0
(at ZeRO 1-3 DeepSpeed clips the orthogonalised update, at stage 0 the raw gradient, so the
clip is what tells the stages apart). A case (CASES) is a ZeRO stage, a dtype, an offload,
the Newton-Schulz method and the accumulation steps. For each it records DeepSpeed's losses
and dslaunch's over STEPS steps; under "refused_by_deepspeed" the error DeepSpeed stops with
for each REFUSED case (dslaunch runs those: see docs/muon.md).

DeepSpeed also saves its checkpoint of the DS_SAVED cases at step SAVE_AT (tests/data/ds_muon/ds/),
and dslaunch its checkpoint of the OURS_SAVED cases (tests/data/ds_muon/dslaunch/), which DeepSpeed
then resumes: "deepspeed_resumed_dslaunch" holds DeepSpeed's losses for the steps after SAVE_AT,
or "deepspeed_resumed_dslaunch_error" the line it stopped with.

tests/runtime/core/test_muon.py replays dslaunch's side against these without DeepSpeed, resumes
dslaunch's checkpoints and DeepSpeed's at other world sizes and stages against DeepSpeed's
uninterrupted losses, and checks that dslaunch runs the cases DeepSpeed refuses.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_muon")
VOCAB, DIM, SEQ, ROWS, STEPS, SAVE_AT = 20, 12, 6, 12, 6, 3


class Case(NamedTuple):
    stage: int
    dtype: str = "fp32"
    offload: bool = False
    ns_method: str = "gram"
    gas: int = 1
    world: int = 2
    reduce_scatter: bool = False  # DeepSpeed's stage 3 refuses Muon unless it is false


CASES = {
    "s0_fp32": Case(0), "s1_fp32": Case(1), "s2_fp32": Case(2), "s3_fp32": Case(3),
    "s2_fp32_w3": Case(2, world=3),  # a second boundary through another matrix
    "s2_fp32_gas2": Case(2, gas=2),
    "s1_fp32_offload": Case(1, offload=True), "s2_fp32_offload": Case(2, offload=True),
    "s3_fp32_offload": Case(3, offload=True),
    "s2_fp32_standard": Case(2, ns_method="standard"),  # standard NS runs in bf16 on a CPU, in both
    "s0_bf16": Case(0, "bf16"), "s2_bf16": Case(2, "bf16"),
}
# DeepSpeed stops on these (see "refused_by_deepspeed" in expected.json); dslaunch runs them
REFUSED = {"s3_fp32_reduce_scatter": Case(3, reduce_scatter=True)}
# DeepSpeed's own checkpoint of these at step SAVE_AT goes to tests/data/ds_muon/ds/CASE (resumed here)
DS_SAVED = ("s0_fp32", "s1_fp32", "s2_fp32", "s3_fp32")
# dslaunch's checkpoint of these at step SAVE_AT goes to tests/data/ds_muon/dslaunch/CASE, and
# DeepSpeed resumes it on the same ranks: its losses, or the error it stops with, are recorded
OURS_SAVED = ("s0_fp32", "s1_fp32", "s2_fp32", "s2_fp32_gas2", "s1_fp32_offload", "s2_fp32_offload", "s3_fp32")


# -- the training script both engines run ----------------------------------------------------------
def make_model():
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(DIM)
            self.qkv = torch.nn.Linear(DIM, 3 * DIM)
            self.proj = torch.nn.Linear(DIM, DIM)
            self.fc1 = torch.nn.Linear(DIM, 4 * DIM)
            self.fc2 = torch.nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(-2, -1) / DIM ** 0.5, dim=-1)
            x = x + self.proj(att @ v)
            return x + self.fc2(torch.tanh(self.fc1(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, DIM)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
            self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.lm_head(h)

    torch.manual_seed(0)
    return Net()


def config(case: Case) -> dict:
    zero = {"stage": case.stage}
    if case.stage == 3:
        zero["reduce_scatter"] = case.reduce_scatter
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_batch_size": ROWS, "gradient_accumulation_steps": case.gas, "steps_per_print": 1000,
           "train_micro_batch_size_per_gpu": ROWS // (case.world * case.gas),
           "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 0.005, "momentum": 0.9,
                                                    "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                    "ns_method": case.ns_method}},
           "zero_optimization": zero}
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(step: int, micro: int, rank: int, case: Case):
    """Micro-batch `micro` of this rank: the global batch of `step` cut by micro-batch and rank."""
    import torch

    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    n = ROWS // (case.world * case.gas)
    at = (micro * case.world + rank) * n
    return tokens[at:at + n, :-1], tokens[at:at + n, 1:]


def train(engine, case: Case, rank: int, start: int, stop: int, save=None) -> list:
    """Steps start..stop-1; each step's loss averaged over ranks and micro-batches."""
    import torch
    import torch.distributed as dist

    losses = []
    for step in range(start, stop):
        total = torch.zeros(())
        for micro in range(case.gas):
            x, y = batch(step, micro, rank, case)
            logits = engine(x).float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if dist.is_initialized() and case.world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / (case.world * case.gas))
        if save is not None and step + 1 == SAVE_AT:
            engine.save_checkpoint(save, tag=f"global_step{SAVE_AT}")
    return losses


def worker(rank: int, job: dict) -> None:
    from bench_ranks import finish_script_rank, script_rank  # scripts/, on sys.path in a worker

    deepspeed = script_rank(rank, job)
    case = Case(**{k: job[k] for k in Case._fields if k in job})
    model = make_model()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(case))[0]
    start = 0
    if job.get("load"):  # resume a checkpoint saved at SAVE_AT (the other engine's, below)
        engine.load_checkpoint(job["load"])
        start = engine.global_steps
    finish_script_rank(rank, job, train(engine, case, rank, start, STEPS, save=job.get("save")))


def run(python: str, job: dict, capture: bool = False):
    from bench_ranks import run_script_ranks  # on sys.path when run as a script
    # a slow shared machine can take minutes per run
    return run_script_ranks(python, __file__, job, job["world"], ROOT, timeout=1800, capture=capture)


def resume_ours(ds_python: str, name: str) -> dict:
    """dslaunch's run of the case, saved at SAVE_AT to tests/data/ds_muon/dslaunch/NAME, and
    DeepSpeed resuming that checkpoint on the same ranks: its losses, or the line it stopped with."""
    case, save = CASES[name], os.path.join(OUT, "dslaunch", name)
    shutil.rmtree(save, ignore_errors=True)
    out = {"dslaunch": run(sys.executable, dict(case._asdict(), engine="dslaunch", save=save))}
    _tidy(save)
    resumed = run(ds_python, dict(case._asdict(), engine="deepspeed", load=save), capture=True)
    out["deepspeed_resumed_dslaunch" if isinstance(resumed, list) else "deepspeed_resumed_dslaunch_error"] = resumed
    return out


def _tidy(save_dir: str) -> None:
    for leftover in ("zero_to_fp32.py", "zero_to_torch.py"):  # the engines' recovery scripts: not fixtures
        script = os.path.join(save_dir, leftover)
        if os.path.exists(script):
            os.remove(script)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds-python", default="/work/ds-venv/bin/python", help="a python with deepspeed==0.19.8")
    ap.add_argument("--cases", default=",".join(list(CASES) + list(REFUSED)))
    ap.add_argument("--dslaunch-checkpoints-only", action="store_true",
                    help="for the OURS_SAVED cases only redo dslaunch's checkpoint and DeepSpeed's resume of it "
                         "(the cases side by side), keeping the recorded losses")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    path = os.path.join(OUT, "expected.json")
    expected = {}
    if os.path.exists(path):
        with open(path) as fh:
            expected = json.load(fh)
    if args.dslaunch_checkpoints_only:
        from concurrent.futures import ThreadPoolExecutor

        names = [n for n in args.cases.split(",") if n in OURS_SAVED]

        def one(i_name):
            time.sleep(20 * i_name[0])  # apart, so the free ports each run picks do not collide
            return resume_ours(args.ds_python, i_name[1])

        with ThreadPoolExecutor(len(names)) as pool:
            for name, got in zip(names, pool.map(one, enumerate(names))):
                for stale in ("deepspeed_resumed_dslaunch", "deepspeed_resumed_dslaunch_error"):
                    expected[name].pop(stale, None)
                expected[name].update(got)
                print(f"{name}: {got}", flush=True)
        with open(path, "w") as fh:
            json.dump(expected, fh, indent=1, sort_keys=True)
        return
    for name in args.cases.split(","):
        if name in REFUSED:
            case = REFUSED[name]
            got = run(args.ds_python, dict(case._asdict(), engine="deepspeed"), capture=True)
            if isinstance(got, list):
                raise SystemExit(f"{name}: DeepSpeed ran it ({got}); move it to CASES")
            expected.setdefault("refused_by_deepspeed", {})[name] = {**case._asdict(), "error": got}
            print(f"{name}: DeepSpeed stops: {got}", flush=True)
            continue
        case = CASES[name]
        save = {}
        if name in DS_SAVED:
            save["save"] = os.path.join(OUT, "ds", name)
            shutil.rmtree(save["save"], ignore_errors=True)
        ds = run(args.ds_python, dict(case._asdict(), engine="deepspeed", **save))
        if save:
            _tidy(save["save"])
        if name in OURS_SAVED:
            expected[name] = {**case._asdict(), "deepspeed": ds, **resume_ours(args.ds_python, name)}
        else:
            expected[name] = {**case._asdict(), "deepspeed": ds,
                              "dslaunch": run(sys.executable, dict(case._asdict(), engine="dslaunch"))}
        ours = expected[name]["dslaunch"]
        print(f"{name}: deepspeed {ds}\n{' ' * len(name)}  dslaunch  {ours}", flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(expected, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    from bench_ranks import script_main  # scripts/, on sys.path when run as a script

    script_main(worker, main)
