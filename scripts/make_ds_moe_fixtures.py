"""Make the MoE fixtures in tests/data/ds_moe/ with real DeepSpeed (0.19.8, CPU, gloo).

    /work/ds-venv/bin/python scripts/make_ds_moe_fixtures.py [--only gating|training|checkpoint]
    /work/ds-venv/bin/python scripts/make_ds_moe_fixtures.py --resume DIR [--stage N]

gating.pt       per GATING_CASES entry: the logits, DeepSpeed's top1/top2/topkgating outputs
                (l_aux, exp_counts, the routes) for them, under the case's
                torch seed (RTS, RSample and top-2 sampling draw from it), in the sparse form its MOELayer uses
                (capacity; per route: expert or -1, slot, weight); and per LAYER_CASES
                entry: a DeepSpeed MoE layer's state_dict, an input, its (output, l_aux,
                exp_counts) and the input's gradient, in one process (ep_size 1)
expected.json   per TRAINING_CASES entry: the losses (averaged over ranks, or over the
                micro-batches of one process) and the tokens routed to each expert (summed
                over ranks and micro-batches) of `train` below on `world` gloo processes
                (`--cases a,b` remakes those and keeps the others); per CHECKPOINT_CASES
                entry, the losses of the steps after DeepSpeed resumed its own checkpoint
ckpt_<case>/    per CHECKPOINT_CASES entry: the checkpoint DeepSpeed saved after SAVE_AT
                steps of `train` (its MoE layout: expert, expp_rank and model-states files;
                a zero_to_fp32.py beside the tag would be left out)

`train` is the training script both engines run (tests/runtime/moe/test_moe_training.py runs it with
`import dslaunch.runtime as deepspeed`): dense layer, MoE(num_experts=4, drop_tokens=False,
use_rts=False) with its experts given distinct weights by global expert id, dense layer;
loss = MSE + 0.01 x l_aux; AdamW (torch's); fixed global batches of ROWS sequences split
over the ranks. The one-process cases hold all 4 experts and take the same per-rank
batches as gradient-accumulation micro-batches, so their losses are what the expert-
parallel runs must reproduce.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_moe")

H, FFN, SEQ, ROWS, NUM_EXPERTS, STEPS = 8, 12, 4, 8, 4, 4

# gating: k, tokens, experts, capacity_factor, min_capacity, drop_tokens, use_rts, noisy policy
# (top-1), second-expert sampling (top-2), used_token mask (top-1), seed
GATING_CASES = {
    "top1_drop": dict(k=1, tokens=16, experts=4, cf=1.0, min_cap=2, drop=True, rts=True, seed=1),
    "top1_drop_no_rts": dict(k=1, tokens=16, experts=4, cf=0.5, min_cap=1, drop=True, rts=False, seed=2),
    "top1_no_drop": dict(k=1, tokens=12, experts=3, cf=1.0, min_cap=4, drop=False, rts=False, seed=3),
    "top1_rsample": dict(k=1, tokens=16, experts=4, cf=1.0, min_cap=4, drop=True, rts=True, noisy="RSample", seed=4),
    "top1_used_token": dict(k=1, tokens=10, experts=2, cf=1.0, min_cap=2, drop=True, rts=True, used=True, seed=5),
    "top1_big_capacity": dict(k=1, tokens=6, experts=2, cf=4.0, min_cap=1, drop=True, rts=True, seed=6),
    "top1_skewed": dict(k=1, tokens=8, experts=4, cf=1.0, min_cap=1, drop=True, rts=False, skew=True, seed=7),
    "top2_drop": dict(k=2, tokens=16, experts=4, cf=1.0, min_cap=2, drop=True, sample=False, seed=8),
    "top2_sampled": dict(k=2, tokens=16, experts=4, cf=1.0, min_cap=2, drop=True, sample=True, seed=9),
    "top2_no_drop": dict(k=2, tokens=12, experts=4, cf=1.0, min_cap=2, drop=False, sample=False, seed=10),
    "top2_big_capacity": dict(k=2, tokens=6, experts=3, cf=4.0, min_cap=1, drop=True, sample=False, seed=11),
    "top3_drop": dict(k=3, tokens=16, experts=6, cf=1.0, min_cap=2, drop=True, seed=12),
    "top3_no_drop": dict(k=3, tokens=10, experts=4, cf=1.0, min_cap=2, drop=False, seed=13),
    "top3_big_capacity": dict(k=3, tokens=5, experts=4, cf=4.0, min_cap=1, drop=True, seed=14),
}
LAYER_CASES = {
    "k1": dict(k=1, drop_tokens=True, use_rts=True, min_capacity=4, capacity_factor=1.0),
    "k2_residual": dict(k=2, drop_tokens=True, min_capacity=2, capacity_factor=1.25, use_residual=True,
                        top2_2nd_expert_sampling=False),
    "k1_no_drop_residual": dict(k=1, drop_tokens=False, use_rts=False, use_residual=True),
}
# name: world, ep_size, ZeRO stage, k, gradient accumulation steps
TRAINING_CASES = {
    "one_k1_gas2": dict(world=1, ep=1, stage=0, k=1, gas=2),
    "one_k1_gas4": dict(world=1, ep=1, stage=0, k=1, gas=4),
    "one_k2_gas2": dict(world=1, ep=1, stage=0, k=2, gas=2),
    "ep1_w2_s0": dict(world=2, ep=1, stage=0, k=1, gas=1),
    "ep2_w2_s0": dict(world=2, ep=2, stage=0, k=1, gas=1),
    "ep2_w2_s2": dict(world=2, ep=2, stage=2, k=1, gas=1),
    "ep2_w4_s1": dict(world=4, ep=2, stage=1, k=1, gas=1),
    "ep2_w2_top2_s0": dict(world=2, ep=2, stage=0, k=2, gas=1),
    # gradient clipping: the norm counts every expert once
    "one_k1_gas2_clip": dict(world=1, ep=1, stage=0, k=1, gas=2, clip=0.05),
    "one_k1_gas4_clip": dict(world=1, ep=1, stage=0, k=1, gas=4, clip=0.05),
    "ep2_w2_s0_clip": dict(world=2, ep=2, stage=0, k=1, gas=1, clip=0.05),
    "ep2_w2_s2_clip": dict(world=2, ep=2, stage=2, k=1, gas=1, clip=0.05),
    "ep2_w4_s1_clip": dict(world=4, ep=2, stage=1, k=1, gas=1, clip=0.05),
}
# DeepSpeed saves after SAVE_AT steps, then resumes from that checkpoint in fresh processes
SAVE_AT = 2
CHECKPOINT_CASES = {
    "ckpt_ep2_w2_s0": dict(world=2, ep=2, stage=0, k=1, gas=1),
    "ckpt_ep2_w2_s2": dict(world=2, ep=2, stage=2, k=1, gas=1),
}
# which one-process case each expert-parallel case must equal
ONE_PROCESS = {"ep1_w2_s0": "one_k1_gas2", "ep2_w2_s0": "one_k1_gas2", "ep2_w2_s2": "one_k1_gas2",
               "ep2_w4_s1": "one_k1_gas4", "ep2_w2_top2_s0": "one_k2_gas2", "ep2_w2_s0_clip": "one_k1_gas2_clip",
               "ep2_w2_s2_clip": "one_k1_gas2_clip", "ep2_w4_s1_clip": "one_k1_gas4_clip"}
# DeepSpeed's ZeRO-0 clipping with expert parallelism takes a norm that differs from one
# process's (its stage-0 norm does not count every expert once); ours equals one process's
DS_DIFFERS_FROM_ONE_PROCESS = {"ep2_w2_s0_clip"}


# -- gating ------------------------------------------------------------------------------------
def gating_logits(case: dict):
    import torch

    g = torch.Generator().manual_seed(100 + case["seed"])
    logits = torch.randn(case["tokens"], case["experts"], generator=g)
    if case.get("skew"):  # every token prefers expert 0: the others get none, expert 0 overflows
        logits[:, 0] += 5.0
    used = (torch.rand(case["tokens"], generator=g) > 0.3).float() if case.get("used") else None
    return logits, used


def ds_gating(name: str) -> dict:
    import torch
    from deepspeed.moe import sharded_moe

    case = GATING_CASES[name]
    logits, used = gating_logits(case)
    torch.manual_seed(case["seed"])
    if case["k"] == 1:
        out = sharded_moe.top1gating(logits.clone(), case["cf"], case["min_cap"], used, case.get("noisy"),
                                     case["drop"], case.get("rts", True), sparse_routes=True)
    elif case["k"] == 2:
        out = sharded_moe.top2gating(logits.clone(), case["cf"], case["min_cap"], case["drop"],
                                     top2_2nd_expert_sampling=case.get("sample", True), sparse_routes=True)
    else:
        out = sharded_moe.topkgating(logits.clone(), case["k"], case["cf"], case["min_cap"], case["drop"],
                                     sparse_routes=True)
    # the routes as MOELayer uses them: [k, tokens] expert (-1 dropped), slot, weight
    l_aux, capacity, _, indices, locations, gates, counts = out
    return {"logits": logits, "used_token": used, "l_aux": l_aux, "capacity": int(capacity),
            "indices": indices.long(), "locations": locations.long(), "weights": gates, "exp_counts": counts}


def layer_input(name: str):
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randn(3, 5, H, generator=g)


def ds_layer(name: str) -> dict:
    import torch
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(H, FFN), torch.nn.ReLU(), torch.nn.Linear(FFN, H))
    layer = MoE(H, expert, num_experts=4, **LAYER_CASES[name])
    with torch.no_grad():  # distinct experts
        for i, e in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.add_(0.1 * (i + 1) * torch.randn_like(p))
    x = layer_input(name).requires_grad_(True)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    torch.manual_seed(3)
    out, l_aux, counts = layer(x)
    (out.pow(2).sum() + l_aux).backward()
    return {"state": state, "x": x.detach(), "out": out.detach(), "l_aux": l_aux.detach(), "exp_counts": counts,
            "x_grad": x.grad}


# -- training ----------------------------------------------------------------------------------
def make_model(deepspeed_moe_layer, ep: int, ep_rank: int, k: int):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp = torch.nn.Linear(H, H)
            expert = torch.nn.Sequential(torch.nn.Linear(H, FFN), torch.nn.ReLU(), torch.nn.Linear(FFN, H))
            self.moe = deepspeed_moe_layer.MoE(H, expert, num_experts=NUM_EXPERTS, ep_size=ep, k=k,
                                               drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
            self.out = torch.nn.Linear(H, 3)
            local = NUM_EXPERTS // ep
            with torch.no_grad():  # expert g gets weights of its own (global id g), whatever ep is
                for i, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                    gen = torch.Generator().manual_seed(1000 + ep_rank * local + i)
                    for p in e.parameters():
                        p.copy_(0.4 * torch.randn(p.shape, generator=gen))
            self.counts = None

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            m, l_aux, counts = self.moe(h)
            self.counts = counts
            return self.out(h + m), l_aux

    return Net()


def batch(step: int, index: int, parts: int):
    """Part `index` of `parts` of step `step`'s global batch."""
    import torch

    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(ROWS, SEQ, H, generator=g)
    y = torch.randn(ROWS, SEQ, 3, generator=g)
    n = ROWS // parts
    return x[index * n:(index + 1) * n], y[index * n:(index + 1) * n]


def config(job: dict) -> dict:
    cfg = {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // (job["world"] * job["gas"]),
           "gradient_accumulation_steps": job["gas"], "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": job["stage"]}}
    if job.get("clip"):
        cfg["gradient_clipping"] = job["clip"]
    return cfg


def train(deepspeed, moe_layer, job: dict, rank: int, save_dir: str = None, load_dir: str = None,
          save_at: int = SAVE_AT, one_group: bool = False) -> dict:
    """Run job's steps; returns {"losses", "counts"} (the same on every rank). With
    save_dir: save a checkpoint there after `save_at` steps (and go on); with load_dir: load
    the checkpoint there first and run the steps after the ones it holds. one_group: the
    script's own torch AdamW (the config's maths) over every parameter in one param group,
    experts included, instead of the config's optimizer section."""
    import torch
    import torch.distributed as dist

    world, ep, gas = job["world"], job["ep"], job["gas"]
    model = make_model(moe_layer, ep, rank % ep, job["k"])
    cfg = config(job)
    if one_group:
        opt = cfg.pop("optimizer")["params"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], weight_decay=opt["weight_decay"])
        engine = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)[0]
    else:
        engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]
    first = 0
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
        first = engine.global_steps
    losses, counts = [], []
    for step in range(first, STEPS):
        if save_dir is not None and step == save_at:
            engine.save_checkpoint(save_dir)
        total = torch.zeros(1)
        routed = torch.zeros(NUM_EXPERTS, dtype=torch.long)
        for micro in range(gas):
            x, y = batch(step, rank * gas + micro, world * gas)
            out, l_aux = engine(x)
            loss = (out - y).pow(2).mean() + 0.01 * l_aux
            engine.backward(loss)
            engine.step()
            total += loss.detach()
            routed += engine.module.counts.long()
        if world > 1:
            dist.all_reduce(total)
            dist.all_reduce(routed)
        losses.append(float(total) / (world * gas))
        counts.append([int(c) for c in routed])
    return {"losses": losses, "counts": counts}


def worker(rank: int, job: dict) -> None:
    from bench_ranks import finish_script_rank, script_rank  # scripts/, on sys.path in a worker

    deepspeed = script_rank(rank, job, deepspeed_only=True)
    from deepspeed.moe import layer

    finish_script_rank(rank, job, train(deepspeed, layer, job, rank, job.get("save_dir"), job.get("load_dir")))


def run(job: dict) -> dict:
    from bench_ranks import run_script_ranks  # on sys.path when run as a script (tests import this file without it)
    return run_script_ranks(sys.executable, __file__, job, job["world"], ROOT, quiet=True)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["gating", "training", "checkpoint"])
    ap.add_argument("--cases", default=",".join(TRAINING_CASES), help="training cases to (re)make")
    ap.add_argument("--resume", metavar="DIR", help="only resume the checkpoint in DIR (one dslaunch saved with "
                    "`train` at ep 2 on 2 ranks) under this Python's engine and print the losses of the steps after it")
    ap.add_argument("--stage", type=int, default=0, help="ZeRO stage for --resume")
    args = ap.parse_args()
    if args.resume:
        print(json.dumps(run(dict(world=2, ep=2, stage=args.stage, k=1, gas=1, load_dir=args.resume))))
        return
    os.makedirs(OUT, exist_ok=True)
    if args.only in (None, "gating"):
        torch.save({"gating": {n: ds_gating(n) for n in GATING_CASES},
                    "layer": {n: ds_layer(n) for n in LAYER_CASES}}, os.path.join(OUT, "gating.pt"))
        print("gating.pt written", flush=True)
    if args.only in (None, "training"):
        path = os.path.join(OUT, "expected.json")
        expected = json.load(open(path)) if os.path.exists(path) else {}
        for name in args.cases.split(","):
            expected[name] = run(TRAINING_CASES[name])
            print(name, expected[name], flush=True)
        with open(path, "w") as fh:
            json.dump(expected, fh, indent=1, sort_keys=True)
    if args.only in (None, "checkpoint"):
        path = os.path.join(OUT, "expected.json")
        expected = json.load(open(path)) if os.path.exists(path) else {}
        for name, job in CHECKPOINT_CASES.items():
            folder = os.path.join(OUT, name)
            shutil.rmtree(folder, ignore_errors=True)
            whole = run(dict(job, save_dir=folder))
            if os.path.exists(os.path.join(folder, "zero_to_fp32.py")):
                os.remove(os.path.join(folder, "zero_to_fp32.py"))
            resumed = run(dict(job, load_dir=folder))
            assert resumed["losses"] == pytest_approx(whole["losses"][SAVE_AT:]), (whole, resumed)
            expected[name] = resumed
            print(name, sorted(os.listdir(os.path.join(folder, "global_step%d" % SAVE_AT))), resumed, flush=True)
        with open(path, "w") as fh:
            json.dump(expected, fh, indent=1, sort_keys=True)


def pytest_approx(values):
    """DeepSpeed's resumed losses equal its uninterrupted ones (1e-6)."""
    class _Near(list):
        def __eq__(self, other):
            return len(other) == len(self) and all(abs(a - b) <= 1e-6 for a, b in zip(self, other))

    return _Near(values)


if __name__ == "__main__":
    from bench_ranks import script_main  # scripts/, on sys.path when run as a script

    script_main(worker, main)
