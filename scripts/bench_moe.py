"""Mixture-of-Experts training with expert parallelism: tokens/s and all-to-all bytes per
step at ep = 1, 2, 4, bytes per rank against the dense model of the same active size, and
DeepSpeed's MoE beside ours.

    python scripts/bench_moe.py [--ep 1 2 4] [--experts 8] [--hidden 256] [--ffn 1024]
        [--layers 2] [--seq 64] [--micro 8] [--k 1] [--steps 5] [--rounds 2] [--autoep]
        [--deepspeed-python /work/ds-venv/bin/python|none] [--cuda]

The model: `--layers` blocks of Linear(hidden, hidden) -> MoE(num_experts=--experts,
expert=Linear(hidden, ffn)-ReLU-Linear(ffn, hidden), k=--k, drop_tokens=False,
use_rts=False) with a residual; MSE loss + 0.01 x aux. For each ep, ep fresh ranks (one
expert-parallel group; data parallel = ep) train it through initialize() with torch's AdamW,
ZeRO off; one warm-up step, then `--steps` timed ones. DeepSpeed (the same file run by
`--deepspeed-python`, importing deepspeed and deepspeed.moe.layer) runs in turn with ours,
`--rounds` times each, so load from elsewhere falls on both. Printed per ep and side:

* tokens/s: every rank's tokens over the median (over steps) of the slowest rank's step;
* a2a MiB: bytes rank 0 sends to other ranks in all-to-alls per step (forward dispatch and
  combine, and their two backward all-to-alls), counted where each side calls
  all_to_all_single (torch.distributed's for DeepSpeed, dslaunch.runtime.comm's for ours; input
  bytes x (n - 1) / n);
* params/grads/optim MiB per rank (rank 0's tensors), and the same for the dense model of
  the same active size (each MoE replaced by k experts' worth: one expert with ffn x k).

With `--autoep`, the model is transformers' Mixtral instead (`--layers` decoder layers of width
`--hidden`, `--experts` experts of `--ffn`, top `--k`, vocabulary 1024, eager attention, its
load-balancing loss on), trained as a causal LM with AutoEP (`"expert_parallel": {"enabled":
true, "autoep_size": ep}`), DeepSpeed's AutoEP beside it (its Python needs transformers 5.17.0
too); the "no AutoEP" rows are the same model on the same ranks with every expert on each rank.

On the CPU each rank runs one thread; ep ranks need ep free cores for the times to mean
anything, so say the load average with the figures. `--cuda` runs one GPU per rank (NCCL).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ranks import mib, run_peer, spawn as spawn_ranks, start_rank, take_turns, write_result  # noqa: E402
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)


def build(layer_mod, args, ep: int, dense: bool):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(args.hidden, args.hidden)
            ffn = args.ffn * args.k if dense else args.ffn
            expert = torch.nn.Sequential(torch.nn.Linear(args.hidden, ffn), torch.nn.ReLU(),
                                         torch.nn.Linear(ffn, args.hidden))
            self.ffn = expert if dense else layer_mod.MoE(args.hidden, expert, num_experts=args.experts, ep_size=ep,
                                                          k=args.k, drop_tokens=False, use_rts=False,
                                                          top2_2nd_expert_sampling=False)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            if isinstance(self.ffn, torch.nn.Sequential):
                return x + self.ffn(h), h.new_zeros(())
            out, l_aux, _ = self.ffn(h)
            return x + out, l_aux

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(args.layers)])

        def forward(self, x):
            aux = x.new_zeros(())
            for b in self.blocks:
                x, l_aux = b(x)
                aux = aux + l_aux
            return x, aux

    return Net()


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None and torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class A2ACounter:
    """Bytes sent to other ranks by all_to_all_single: torch.distributed's for DeepSpeed, and
    dslaunch.runtime.comm's for ours (same-host groups carry it through shared memory, past
    torch.distributed)."""

    def __init__(self, rt):
        import torch.distributed as dist

        self.sent = 0
        where = dist if rt.__name__ == "deepspeed" else importlib.import_module("dslaunch.runtime.comm")
        self._orig = where.all_to_all_single

        def counted(output, input, *a, group=None, **kw):
            n = dist.get_world_size(group)
            self.sent += input.numel() * input.element_size() * (n - 1) // n
            return self._orig(output, input, *a, group=group, **kw)

        where.all_to_all_single = counted


VOCAB = 1024


def build_mixtral(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.ffn,
                        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=max(args.seq, 64), num_local_experts=args.experts,
                        num_experts_per_tok=args.k, output_router_logits=True, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def run(rt, layer_mod, args, ep: int, device, dense: bool = False) -> dict:
    import time

    autoep = args.autoep and not dense
    model = (build_mixtral(args) if args.autoep else build(layer_mod, args, ep, dense)).to(device)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    if autoep:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, *_ = rt.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    g = torch.Generator().manual_seed(1 + engine.global_rank if hasattr(engine, "global_rank") else 1)
    x = torch.randn(args.micro, args.seq, args.hidden, generator=g).to(device)
    y = torch.randn(args.micro, args.seq, args.hidden, generator=g).to(device)
    ids = torch.randint(0, VOCAB, (args.micro, args.seq), generator=g).to(device)
    counter = A2ACounter(rt)
    times, sent = [], []
    grads = 0
    for i in range(args.steps + 1):
        counter.sent = 0
        start = time.perf_counter()
        if args.autoep:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        else:
            out, aux = engine(x)
            engine.backward((out - y).pow(2).mean() + 0.01 * aux)
        grads = _bytes(p.grad for p in engine.module.parameters())
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
            sent.append(counter.sent)
    opt = engine.optimizer
    opt = getattr(opt, "optimizer", opt)
    state = _bytes(t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    return {"times": times, "a2a": max(sent), "tokens": args.micro * args.seq,
            "params": _bytes(engine.module.parameters()), "grads": grads, "optim": state}


def worker(rank: int, world: int, port: int, args, result_path: str) -> None:
    rt, device = start_rank(rank, world, port, args.as_peer, args.cuda)
    layer_mod = importlib.import_module("deepspeed.moe.layer" if args.as_peer else "dslaunch.runtime.moe.layer")
    out = {"moe": run(rt, layer_mod, args, world, device)}
    if args.dense:
        out["dense"] = run(rt, layer_mod, args, world, device, dense=True)
    write_result(result_path, rank, out)


def spawn(ep: int, args):
    return spawn_ranks(worker, ep, args)


def spawn_peer(ep: int, args):
    """spawn() under DeepSpeed's Python, importing deepspeed instead."""
    argv = ["--ep", str(ep)]
    for flag in ("experts", "hidden", "ffn", "layers", "seq", "micro", "k", "steps"):
        argv += [f"--{flag}", str(getattr(args, flag))]
    argv += (["--cuda"] if args.cuda else []) + (["--autoep"] if args.autoep else [])
    return run_peer(args.deepspeed_python, __file__, argv, "bench-moe-peer-ext")


def summary(ranks, key="moe") -> dict:
    rs = [r[key] for r in ranks]
    step = median(max(r["times"][i] for r in rs) for i in range(len(rs[0]["times"])))
    r0 = rs[0]
    return {"tokens/s": sum(r["tokens"] for r in rs) / step, "a2a": r0["a2a"], "params": r0["params"],
            "grads": r0["grads"], "optim": r0["optim"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--deepspeed-python", default="none",
                   help="a Python with DeepSpeed installed, to run its MoE beside ours ('none': ours only)")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--autoep", action="store_true", help="transformers' Mixtral with AutoEP instead of deepspeed.moe")
    p.add_argument("--as-peer", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dense = not args.as_peer
    for ep in args.ep:
        if ep < 1 or args.experts % ep:
            print(f"error: --ep {ep} must divide --experts {args.experts}", file=sys.stderr)
            sys.exit(2)
    if args.cuda and torch.cuda.device_count() < max(args.ep):
        print(f"error: --cuda needs {max(args.ep)} GPUs for --ep {max(args.ep)}; {torch.cuda.device_count()} "
              "visible", file=sys.stderr)
        sys.exit(2)
    if args.as_peer:  # the DeepSpeed side, one ep per call
        with open(args.as_peer, "w") as fh:
            json.dump(spawn(args.ep[0], args), fh)
        return
    peer = args.deepspeed_python not in ("", "none")
    ours, dense, theirs = {}, {}, {}
    for ep in args.ep:
        def ours_run():
            got = spawn(ep, args)
            return summary(got), summary(got, "dense")

        def peer_run():
            got = spawn_peer(ep, args)
            return got if isinstance(got, dict) else summary(got)

        (ours[ep], dense[ep]), theirs[ep] = take_turns(
            args.rounds, ours_run, peer_run if peer else None,
            lambda runs: max(runs, key=lambda r: r[0]["tokens/s"]), lambda runs: max(runs, key=lambda r: r["tokens/s"]))
    what = "Mixtral (AutoEP)" if args.autoep else "MoE"
    print(f"load average {os.getloadavg()[0]:.1f}; {args.layers} {what} layers, {args.experts} experts "
          f"{args.hidden}->{args.ffn}->{args.hidden}, k {args.k}, seq {args.seq}, micro {args.micro} per rank; "
          f"{'CUDA' if args.cuda else 'CPU'}; bytes are rank 0's, MiB")
    cols = ("params", "grads", "optim")
    print(f"{'ep':>3} {'side':>9} {'tokens/s':>10} {'a2a MiB':>8} " + " ".join(f"{c:>8}" for c in cols))
    for ep in args.ep:
        for side, r in (("dslaunch", ours[ep]), ("DeepSpeed", theirs.get(ep)),
                        ("no AutoEP" if args.autoep else "dense", dense[ep])):
            if r is None:
                continue
            if "error" in r:
                print(f"{ep:>3} {side:>9}  did not run: {r['error']}")
                continue
            print(f"{ep:>3} {side:>9} {r['tokens/s']:10.0f} {mib(r['a2a']):>8} " +
                  " ".join(f"{mib(r[c]):>8}" for c in cols))
        if theirs.get(ep) and "error" not in theirs[ep]:
            print(f"{ep:>3} {'ours/DS':>9} {ours[ep]['tokens/s'] / theirs[ep]['tokens/s']:10.2f} "
                  f"{(ours[ep]['a2a'] / theirs[ep]['a2a'] if theirs[ep]['a2a'] else float('nan')):8.2f}")


if __name__ == "__main__":
    main()
