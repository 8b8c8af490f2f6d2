"""Ulysses sequence parallelism (`sequence_parallel_size`): peak activation bytes per rank and
step time against sequence length, at sp = 1, 2, 4.

    python scripts/bench_sp.py [--sp 1 2 4] [--seq 256 512 1024] [--hidden 128] [--heads 8]
        [--layers 2] [--micro 1] [--steps 3] [--rounds 1]
        [--deepspeed-python /work/ds-venv/bin/python|none] [--cuda]

The model is a stack of `--layers` causal attention blocks (`--heads` query heads, half as
many key/value heads, an MLP of 4 x `--hidden`) with an LM head, its attention wrapped in
DistributedAttention. For each sp and sequence length, sp fresh ranks train it through
initialize() with `sequence_parallel_size` = sp, each on its 1/sp slice of the same batch,
torch's AdamW, ZeRO off; one warm-up step, then `--steps` timed ones. Printed per run:

* step: the median over steps of the slowest rank's forward + backward + step wall time;
* activations: the peak bytes autograd keeps for backward on rank 0 (saved-tensor hooks on
  the CPU; on CUDA torch.cuda.max_memory_allocated over the step, everything);
* each figure's ratio to sp = 1 at the same length: activations per rank should fall by sp
  (the attention's whole-sequence q, k, v come in 1/sp of the heads).

With `--deepspeed-python`, DeepSpeed's Ulysses trains the same model on the same slices in
turn with ours (the same file run by that Python, importing deepspeed and
deepspeed.sequence.layer.DistributedAttention, its parallel_state_sp groups as the mpu: in
0.19.8 `initialize(mesh_param=...)` never reduces gradients over the sequence ranks), each
side `--rounds` times, the fastest round kept; the table then adds DeepSpeed's step time and
activations and ours over DeepSpeed's.

On the CPU each rank runs one thread; sp ranks need sp free cores for the times to mean
anything, so say the load average with the figures. `--cuda` runs one GPU per rank (NCCL).

    python scripts/bench_sp.py --tiled [--seq 2048 8192] [--hidden 256] [--vocab 8192]
        [--shards N] [--steps 3] [--cuda]

`--tiled` measures tiled compute instead (one process): a Llama-style gated MLP (intermediate
4 x `--hidden`) and the LM head + cross-entropy over `--vocab` tokens, each forward + backward
over one sequence of each length, untiled against TiledMLP / tiled_causal_lm_loss with
`--shards` slices (default ceil(seq / hidden), DeepSpeed's example's rule). Printed: the peak
bytes allocated during forward + backward above what was alive before (inputs, weights), from
the allocator itself (the profiler's memory events on the CPU, torch.cuda.max_memory_allocated
on CUDA), and the median wall time of `--steps` runs (one CPU thread).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pipeline import SavedActivations  # noqa: E402  (the activation counter, shared)
from bench_ranks import run_peer, spawn as spawn_ranks, start_rank, take_turns, write_result  # noqa: E402
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

VOCAB = 1024


def build_model(args, attention_cls):
    torch.manual_seed(0)
    hd, kv = args.hidden // args.heads, max(1, args.heads // 2)

    def attention(q, k, v, *unused):  # [b, s, h, d], causal, GQA
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(args.hidden), torch.nn.LayerNorm(args.hidden)
            self.q = torch.nn.Linear(args.hidden, args.heads * hd)
            self.kv = torch.nn.Linear(args.hidden, 2 * kv * hd)
            self.o = torch.nn.Linear(args.heads * hd, args.hidden)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(args.hidden, 4 * args.hidden), torch.nn.GELU(),
                                           torch.nn.Linear(4 * args.hidden, args.hidden))
            self.attn = lambda q, k, v, batch_dim_idx: attention(q, k, v)  # sp = 1: the whole sequence here

        def forward(self, x):
            b, s, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).view(b, s, args.heads, hd)
            k, v = self.kv(h).view(b, s, 2, kv, hd).unbind(2)
            x = x + self.o(self.attn(q, k, v, 0).reshape(b, s, -1))
            return x + self.mlp(self.norm2(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, args.hidden)
            self.pos = torch.nn.Embedding(max(args.seq), args.hidden)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(args.layers))
            self.head = torch.nn.Linear(args.hidden, VOCAB)

        def forward(self, tokens, offset):
            x = self.emb(tokens) + self.pos(torch.arange(offset, offset + tokens.shape[1], device=tokens.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(x)

        def use_group(self, group):
            for blk in self.blocks:
                blk.attn = attention_cls(attention, group)

    return Net()


def run(rt, attention_cls, args, sp: int, seq: int, device) -> dict:
    import torch.distributed as dist

    net = build_model(args, attention_cls).to(device)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "steps_per_print": 10 ** 9}
    init = {}
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
        if rt.__name__ == "deepspeed":  # its own Ulysses groups as the mpu (see the module docstring)
            from deepspeed.runtime.sequence_parallel import parallel_state_sp

            if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:  # once per process (one run per --seq)
                parallel_state_sp.initialize_sequence_parallel(sp)
            init["mpu"] = parallel_state_sp
    engine, _, _, _ = rt.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4), config=cfg,
                                    **init)
    r, chunk = 0, seq // sp
    if sp > 1:
        net.use_group(engine.seq_parallel_group)
        r = dist.get_rank(engine.seq_parallel_group)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (args.micro, seq + 1), generator=g)
    x = tokens[:, r * chunk:(r + 1) * chunk].to(device)
    y = tokens[:, 1 + r * chunk:1 + (r + 1) * chunk].to(device)
    times, peak = [], 0
    for i in range(1 + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with SavedActivations(net) as saved:
            loss = torch.nn.functional.cross_entropy(engine(x, r * chunk).reshape(-1, VOCAB), y.reshape(-1))
            engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        # the benchmark's own reduce, on the world group by name, outside either engine
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        if i:  # the first step warms up
            times.append(float(took))
        peak = max(peak, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else saved.peak)
    return {"step_s": median(times), "activations": peak}


def worker(rank: int, world: int, port: int, args, result_path: str) -> None:
    import importlib

    rt, device = start_rank(rank, world, port, args.as_peer, args.cuda)
    layer = importlib.import_module("deepspeed.sequence.layer" if args.as_peer else "dslaunch.runtime.sequence")
    out = {seq: run(rt, layer.DistributedAttention, args, world, seq, device) for seq in args.seq}
    write_result(result_path, rank, out)


def spawn(sp: int, args) -> dict:
    """{seq: rank 0's result} for sp ranks of this side."""
    return {int(k): v for k, v in spawn_ranks(worker, sp, args)[0].items()}


def spawn_peer(sp: int, args) -> dict:
    """spawn() under DeepSpeed's Python; {seq: result}, or {"error": why}."""
    argv = ["--sp", str(sp), "--seq", *map(str, args.seq)]
    for flag in ("hidden", "heads", "layers", "micro", "steps"):
        argv += [f"--{flag}", str(getattr(args, flag))]
    got = run_peer(args.deepspeed_python, __file__, argv + (["--cuda"] if args.cuda else []), "bench-sp-peer-ext")
    return got if "error" in got else {int(k): v for k, v in got.items()}


def _peak_cpu(fn) -> int:
    """Peak bytes the CPU allocator held during fn() above its level at the start: the running
    sum of the profiler's signed allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def _peak(fn, device) -> int:
    if device.type != "cuda":
        return _peak_cpu(fn)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def tiled_rows(args, device) -> list:
    """Untiled against tiled, the MLP and the LM head + loss at each --seq: rows of (seq, what,
    how, shards, peak bytes, median step seconds)."""
    from dslaunch.runtime.sequence_parallel.ulysses_sp import TiledMLP, tiled_causal_lm_loss

    torch.manual_seed(0)
    h, inter = args.hidden, 4 * args.hidden

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(h, inter, bias=False)
            self.up_proj = torch.nn.Linear(h, inter, bias=False)
            self.down_proj = torch.nn.Linear(inter, h, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    mlp, head = MLP().to(device), torch.nn.Linear(h, args.vocab, bias=False).to(device)

    def untiled_loss(x, labels):
        logits = head(x).float()
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        return torch.nn.functional.cross_entropy(logits.view(-1, args.vocab), shift.reshape(-1))

    rows = []
    for seq in args.seq:
        shards = args.shards or -(-seq // h)
        x = torch.randn(1, seq, h, device=device, requires_grad=True)
        up = torch.randn(1, seq, h, device=device)
        labels = torch.randint(0, args.vocab, (1, seq), device=device)
        runs = {
            ("mlp", "untiled"): lambda: mlp(x).backward(up),
            ("mlp", "tiled"): lambda: TiledMLP.apply(lambda m, t: m(t), mlp, x, shards,
                                                     list(mlp.parameters())).backward(up),
            ("loss", "untiled"): lambda: untiled_loss(x, labels).backward(),
            ("loss", "tiled"): lambda: tiled_causal_lm_loss(x, head, shards, labels=labels).backward(),
        }
        for (what, how), step in runs.items():
            def clear():
                x.grad = None
                mlp.zero_grad(set_to_none=True)
                head.zero_grad(set_to_none=True)

            clear()
            step()  # warm-up
            clear()
            peak = _peak(step, device)
            times = []
            for _ in range(args.steps):
                clear()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            rows.append((seq, what, how, shards if how == "tiled" else 1, peak, median(times)))
    return rows


def tiled(args) -> None:
    device = torch.device("cuda") if args.cuda else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as each rank of the sp sweep
    rows = tiled_rows(args, device)
    h, inter = args.hidden, 4 * args.hidden
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"tiled compute: hidden {h}, MLP {inter}, vocab {args.vocab}, fp32; {'CUDA' if args.cuda else 'CPU'}; "
          f"load average {load:.1f}; peak = bytes allocated during forward + backward, MiB")
    print(f"{'seq':>6} {'what':>5} {'how':>8} {'shards':>6} {'peak MiB':>9} {'x untiled':>9} {'step s':>8}")
    base = {}
    for seq, what, how, shards, peak, t in rows:
        base.setdefault((seq, what), peak)
        print(f"{seq:>6} {what:>5} {how:>8} {shards:>6} {peak / 2 ** 20:>9.2f} {peak / base[(seq, what)]:>9.2f} "
              f"{t:>8.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="turns per side (the fastest is kept)")
    p.add_argument("--deepspeed-python", default="none",
                   help="a Python with DeepSpeed installed, to run its Ulysses beside ours ('none': ours only)")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--as-peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tiled", action="store_true", help="measure tiled compute (TiledMLP, the tiled loss) instead")
    p.add_argument("--vocab", type=int, default=8192, help="--tiled: the LM head's vocabulary")
    p.add_argument("--shards", type=int, default=0, help="--tiled: slices (default ceil(seq / hidden))")
    args = p.parse_args()
    if args.tiled:
        if args.cuda and not torch.cuda.is_available():
            p.exit(2, "error: --cuda: no GPU visible\n")
        if args.shards < 0 or args.vocab < 1 or args.hidden < 1 or min(args.seq) < 1:
            p.exit(2, "error: --tiled needs positive --seq, --hidden, --vocab and --shards\n")
        return tiled(args)
    for sp in args.sp:
        bad = [s for s in args.seq if s % sp]
        if sp < 1 or bad or max(1, args.heads // 2) < sp or args.hidden % args.heads:
            sys.exit(f"error: sp {sp} needs --seq multiples of it (not {bad}), at least {sp} key/value heads "
                     f"(--heads {args.heads} gives {max(1, args.heads // 2)}) and --hidden a multiple of --heads")
    if args.cuda and torch.cuda.device_count() < max(args.sp):
        sys.exit(f"error: --cuda needs {max(args.sp)} GPUs for --sp {max(args.sp)}; "
                 f"{torch.cuda.device_count()} visible")
    if args.as_peer:  # the DeepSpeed side, one sp per call
        with open(args.as_peer, "w") as fh:
            json.dump(spawn(args.sp[0], args), fh)
        return
    peer = args.deepspeed_python not in ("", "none")
    results, theirs = {}, {}
    for sp in args.sp:
        def fastest(runs):  # per --seq, the fastest round
            return {seq: min((r[seq] for r in runs), key=lambda v: v["step_s"]) for seq in args.seq}

        results[sp], other = take_turns(args.rounds, lambda: spawn(sp, args),
                                        (lambda: spawn_peer(sp, args)) if peer else None, fastest)
        if other is not None:
            theirs[sp] = other
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Ulysses: {args.layers} blocks of width {args.hidden}, {args.heads} heads, micro {args.micro}; "
          f"{'CUDA' if args.cuda else 'CPU'}; load average {load:.1f}; activations are rank 0's, MiB")
    head = f"{'seq':>6} {'sp':>3} {'step s':>8} {'x sp1':>6} {'activ MiB':>10} {'x sp1':>6}"
    if theirs:
        head += f" {'DS step s':>10} {'DS activ':>9} {'ours/DS step':>12} {'ours/DS activ':>13}"
    print(head)
    for seq in args.seq:
        base = results[args.sp[0]][seq]
        for sp in args.sp:
            r = results[sp][seq]
            line = (f"{seq:>6} {sp:>3} {r['step_s']:>8.3f} {r['step_s'] / base['step_s']:>6.2f} "
                    f"{r['activations'] / 2 ** 20:>10.2f} {r['activations'] / base['activations']:>6.2f}")
            other = theirs.get(sp)
            if other is not None and "error" in other:
                line += f"  DeepSpeed did not run: {other['error']}"
            elif other is not None:
                d = other[seq]
                line += (f" {d['step_s']:>10.3f} {d['activations'] / 2 ** 20:>9.2f} {r['step_s'] / d['step_s']:>12.2f} "
                         f"{r['activations'] / d['activations']:>13.2f}")
            print(line)


if __name__ == "__main__":
    main()
