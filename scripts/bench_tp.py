"""Tensor-parallel training (AutoTP, `tensor_parallel.autotp_size`): step time and bytes per
rank at tp = 1, 2, 4, and DeepSpeed's AutoTP beside ours.

    python scripts/bench_tp.py [--tp 1 2 4] [--hidden 256] [--layers 4] [--heads 8] [--seq 64]
        [--micro 4] [--steps 5] [--rounds 2] [--deepspeed-python /work/ds-venv/bin/python|none] [--cuda]

The model is a Hugging Face Llama built from a config (no download): `--layers` decoder
layers of width `--hidden`, `--heads` heads (half as many key/value heads), vocabulary 4096.
For each tp, tp fresh ranks train it through initialize() with `tensor_parallel.autotp_size`
= tp (tp = 1: no tensor parallelism), torch's AdamW on every side, ZeRO off; one warm-up
step, then `--steps` timed ones. Under DeepSpeed (the same file run by `--deepspeed-python`,
importing deepspeed) the same ranks run in turn with ours, `--rounds` times each, so load from
elsewhere falls on both. Printed per tp and side:

* step: the median over steps of the slowest rank's forward + backward + step wall time;
* bytes per rank, counted from the tensors rank 0 holds: parameters, gradients (after
  backward), optimizer state, and the peak bytes of activations autograd keeps for backward
  (saved-tensor hooks on the CPU; on CUDA torch.cuda.max_memory_allocated, everything);
* each figure's ratio to tp = 1 on the same side, and ours over DeepSpeed's.

On the CPU each rank runs one thread; tp ranks need tp free cores for the times to mean
anything, so say the load average with the figures. `--cuda` runs one GPU per rank (NCCL).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ranks import mib, run_peer, spawn as spawn_ranks, start_rank, take_turns, write_result  # noqa: E402
from bench_pipeline import SavedActivations  # noqa: E402  (the activation counter, shared)
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

VOCAB = 4096


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None and torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def run(rt, args, tp: int, device) -> dict:
    import time

    model = build_model(args).to(device)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 0}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = rt.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, VOCAB, (args.micro, args.seq), generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        grads = _bytes(p.grad for p in engine.module.parameters())
        engine.step()
        return grads

    times = []
    grads = 0
    for i in range(args.steps + 1):
        start = time.perf_counter()
        grads = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    with SavedActivations(engine.module) as saved:
        engine.backward(engine(input_ids=batch, labels=batch).loss)  # one more micro-step, never stepped
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else saved.peak
    opt = engine.optimizer
    state = _bytes(t for st in opt.state.values() for t in st.values())
    return {"times": times, "params": _bytes(engine.module.parameters()), "grads": grads, "optim": state,
            "activations": peak}


def worker(rank: int, world: int, port: int, args, result_path: str) -> None:
    rt, device = start_rank(rank, world, port, args.as_peer, args.cuda)
    write_result(result_path, rank, run(rt, args, world, device))


def spawn(tp: int, args):
    return spawn_ranks(worker, tp, args)


def spawn_peer(tp: int, args):
    """spawn() under DeepSpeed's Python, importing deepspeed instead."""
    argv = ["--tp", str(tp), "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
            "--seq", str(args.seq), "--micro", str(args.micro), "--steps", str(args.steps)]
    return run_peer(args.deepspeed_python, __file__, argv + (["--cuda"] if args.cuda else []), "bench-tp-peer-ext")


def summary(ranks) -> dict:
    steps = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    r0 = ranks[0]
    return {"step": median(steps), "params": r0["params"], "grads": r0["grads"], "optim": r0["optim"],
            "activations": r0["activations"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--deepspeed-python", default="none",
                   help="a Python with DeepSpeed installed, to run its AutoTP beside ours ('none': ours only)")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--as-peer", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cuda and torch.cuda.device_count() < max(args.tp):
        sys.exit(f"error: --cuda needs {max(args.tp)} GPUs for --tp {max(args.tp)}; "
                 f"{torch.cuda.device_count()} visible")
    if args.as_peer:  # the DeepSpeed side, one tp per call
        with open(args.as_peer, "w") as fh:
            json.dump(spawn(args.tp[0], args), fh)
        return
    peer = args.deepspeed_python not in ("", "none")
    ours, theirs = {}, {}
    for tp in args.tp:
        def peer_run():
            got = spawn_peer(tp, args)
            return got if isinstance(got, dict) else summary(got)

        ours[tp], theirs[tp] = take_turns(args.rounds, lambda: summary(spawn(tp, args)), peer_run if peer else None,
                                          lambda runs: min(runs, key=lambda r: r["step"]))
    base = ours[args.tp[0]]
    print(f"load average {os.getloadavg()[0]:.1f}; Llama {args.layers}x{args.hidden}, {args.heads} heads, "
          f"seq {args.seq}, micro {args.micro}; {'CUDA' if args.cuda else 'CPU'}; bytes are rank 0's, MiB")
    cols = ("params", "grads", "optim", "activations")
    print(f"{'tp':>3} {'side':>9} {'step s':>8} " + " ".join(f"{c:>11}" for c in cols) + "   ratios to tp 1")
    for tp in args.tp:
        for side, rows, first in (("dslaunch", ours, base), ("DeepSpeed", theirs, theirs.get(args.tp[0]))):
            r = rows.get(tp)
            if r is None:
                continue
            if "error" in r:
                print(f"{tp:>3} {side:>9}  did not run: {r['error']}")
                continue
            ratios = ""
            if first and "error" not in first:
                ratios = "step {:.2f}, ".format(r["step"] / first["step"]) + ", ".join(
                    f"{c} {r[c] / first[c]:.2f}" for c in cols if first[c])
            print(f"{tp:>3} {side:>9} {r['step']:8.3f} " + " ".join(f"{mib(r[c]):>11}" for c in cols) + "   " + ratios)
        if theirs.get(tp) and "error" not in theirs[tp]:
            t, o = theirs[tp], ours[tp]
            print(f"{tp:>3} {'ours/DS':>9} {o['step'] / t['step']:8.2f} " +
                  " ".join(f"{(o[c] / t[c] if t[c] else float('nan')):>11.2f}" for c in cols))


if __name__ == "__main__":
    main()
