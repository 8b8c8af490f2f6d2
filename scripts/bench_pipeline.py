"""Pipeline parallelism: step time, bubble fraction against the 1F1B theory, memory per
rank against the same model without a pipeline, and DeepSpeed's pipeline beside ours, for
each of our schedules.

    python scripts/bench_pipeline.py [--stages 2 4] [--micro 4 8 16] [--layers 8] [--dim 256]
        [--rows 32] [--batches 5] [--rounds 2] [--schedules 1f1b zb-h1 interleaved-1f1b]
        [--peer-python /work/ds-venv/bin/python|none] [--cuda]

Each schedule is chosen by name (the config's pipeline.schedule); interleaved-1f1b cuts the
blocks into 2 model chunks per stage (PipelineModule(virtual_stages=2): --layers must be at
least 2p). DeepSpeed runs its one schedule, 1F1B.

The model is a stack of `--layers` residual MLP blocks (width `--dim`, 4x hidden), cut into
p equal stages (partition_method="uniform"), trained with torch's AdamW on every side; a
micro-batch is `--rows` rows. For each p and each m micro-batches per batch, p fresh ranks
train `--batches` timed batches (after one warm-up) with engine.train_batch(); the same p
ranks under DeepSpeed (the same file run by `--peer-python`, importing deepspeed) run in
turn with ours, `--rounds` times each, so that load from elsewhere falls on both; one rank
trains the same model without a pipeline (m micro-batches of gradient accumulation) for the
reference. Printed per (p, m):

* step time: the median over batches of the slowest rank's train_batch() wall time, beside
  the unpipelined step time, DeepSpeed's, and the ratios;
* clock: the schedule's bubble on a unit clock (passes of equal time, free transfers:
  pipe/schedule.py's simulate()), what the schedule achieves when nothing else interferes;
* bubble (ours): per batch, the span from the earliest stage's start to the last forward
  or backward pass to end on any stage, and each stage's share of it not spent in its own
  forward and backward passes (the engine's step_timings clocks: waiting for a neighbour
  and transfers), averaged over stages; beside it the 1F1B theory (p-1)/(m+p-1), which
  assumes equal stages and free transfers;
* memory per rank: bytes of model state (parameters, gradients, optimizer state) held by
  each stage's rank, counted from the tensors; and on the CPU the peak bytes of activations
  autograd keeps for backward (counted by saved-tensor hooks: 1F1B keeps up to p - s
  micro-batches in flight on stage s, the unpipelined model one), on CUDA the peak of
  torch.cuda.max_memory_allocated() (everything).

On the CPU each rank runs one thread (OMP_NUM_THREADS=1); p ranks need p free cores for
the times to mean anything, so say the load average with the figures. `--cuda` runs one
GPU per rank over NCCL.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ranks import mib as fmt_mib, run_peer, spawn as spawn_ranks, start_rank, write_result  # noqa: E402
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def config(m: int, rows: int) -> dict:
    return {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": m, "steps_per_print": 10 ** 6,
            "wall_clock_breakdown": False}


def batch_data(m: int, rows: int, dim: int, device):
    g = torch.Generator().manual_seed(m)
    return [(torch.randn(rows, dim, generator=g).to(device), torch.randn(rows, dim, generator=g).to(device))
            for _ in range(m)]


class SavedActivations:
    """The peak bytes of tensors autograd keeps for backward (activations: the module's
    parameters left out), counted by storage while they are alive: what 1F1B's in-flight
    micro-batches cost a stage, where the CPU has no allocator statistics."""

    def __init__(self, module: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.refs, self.live, self.peak = {}, 0, 0

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.params or not st.nbytes():
            return t
        if key not in self.refs:
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(self, t, key, st.nbytes())

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda h: h.t if isinstance(h, _Held) else h)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class _Held:
    def __init__(self, owner: SavedActivations, t: torch.Tensor, key: int, nbytes: int):
        self.owner, self.t, self.key, self.nbytes = owner, t, key, nbytes

    def __del__(self):
        refs = self.owner.refs
        refs[self.key] -= 1
        if not refs[self.key]:
            del refs[self.key]
            self.owner.live -= self.nbytes


def state_bytes(engine) -> int:
    seen = {}
    for p in engine.module.parameters():
        for t in (p, p.grad):
            if t is not None:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for st in engine.optimizer.state.values():
        for t in st.values():
            if torch.is_tensor(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def train_timed(engine, run_batch, args, device, saved_for) -> tuple:
    """(seconds of each timed batch, engine clocks of each, activation peak). The batches
    are timed without the counting hooks (they cost Python calls per saved tensor); one
    more batch then runs under them for the activation peak."""
    import time

    totals, spans = [], []
    for i in range(args.batches + 1):
        start = time.perf_counter()
        run_batch()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first batch warms up (allocations)
            totals.append(time.perf_counter() - start)
            t = getattr(engine, "step_timings", None)  # dslaunch's; DeepSpeed has none
            if t:
                spans.append((t["start"], t["compute_end"], t["compute"]))
    with SavedActivations(saved_for) as saved:
        run_batch()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else saved.peak
    return totals, spans, peak


def build(rt, args, m: int, device, p: int = 0, schedule: str = "1f1b"):
    """An engine over the blocks: a p-stage PipelineModule, or (p = 0) the plain stack.
    The optimizer is torch's AdamW on both sides (no kernel build on either)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    blocks = [Block(args.dim) for _ in range(args.layers)]
    cfg = config(m, args.rows)
    if p:
        chunked = {} if args.as_peer else {"virtual_stages": 2 if schedule == "interleaved-1f1b" else 1}
        model = rt.pipe.PipelineModule(layers=blocks, num_stages=p, loss_fn=torch.nn.MSELoss(),
                                       partition_method="uniform", **chunked)
        if not args.as_peer:
            cfg["pipeline"] = {"schedule": schedule}
    else:
        model = torch.nn.Sequential(*blocks)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = rt.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def run_pipeline(rt, args, p: int, m: int, device, schedule: str = "1f1b") -> dict:
    engine = build(rt, args, m, device, p, schedule)
    data = batch_data(m, args.rows, args.dim, device)
    totals, spans, peak = train_timed(engine, lambda: engine.train_batch(iter(data)), args, device, engine.module)
    out = {"totals": totals, "spans": spans, "state": state_bytes(engine), "peak": peak}
    getattr(engine, "destroy", lambda: None)()
    return out


def run_plain(rt, args, m: int, device) -> dict:
    """The same blocks on one rank, no pipeline: m micro-batches accumulated per step."""
    engine = build(rt, args, m, device)
    data = batch_data(m, args.rows, args.dim, device)

    def batch():
        for x, y in data:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()

    totals, _, peak = train_timed(engine, batch, args, device, engine.module)
    out = {"totals": totals, "state": state_bytes(engine), "peak": peak}
    getattr(engine, "destroy", lambda: None)()
    return out


def worker(rank: int, world: int, port: int, args, result_path: str) -> None:
    rt, device = start_rank(rank, world, port, args.as_peer, args.cuda)
    if args.plain:
        rows = [run_plain(rt, args, m, device) for m in args.micro]
    else:  # [schedule][micro index]; DeepSpeed runs 1F1B only
        rows = [[run_pipeline(rt, args, world, m, device, name) for m in args.micro]
                for name in (["1f1b"] if args.as_peer else args.schedules)]
    write_result(result_path, rank, rows)


def spawn(world: int, args, plain: bool = False):
    """[rank][micro index] -> result, from `world` fresh processes."""
    args.plain = plain
    return spawn_ranks(worker, world, args)


def spawn_peer(world: int, args):
    """spawn() run by DeepSpeed's Python (`--peer-python`), importing deepspeed instead."""
    argv = ["--stages", str(world), "--micro", *map(str, args.micro), "--layers", str(args.layers), "--dim",
            str(args.dim), "--rows", str(args.rows), "--batches", str(args.batches)] + (["--cuda"] if args.cuda else [])
    got = run_peer(args.peer_python, __file__, argv, "bench-pipeline-peer-ext")
    if isinstance(got, dict) and "error" in got:
        sys.exit(f"error: the DeepSpeed run failed ({args.peer_python}): {got['error']}")
    return got


def mib(n: float) -> str:
    return fmt_mib(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side per p, alternating")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1", "interleaved-1f1b"],
                    help="our schedules to run (pipeline.schedule names)")
    ap.add_argument("--peer-python", default="/work/ds-venv/bin/python",
                    help="a Python with DeepSpeed installed; 'none' to run dslaunch alone")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--as-peer", default=None, help=argparse.SUPPRESS)  # the DeepSpeed side writes JSON here
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.as_peer:
        with open(args.as_peer, "w") as fh:
            json.dump(spawn(args.stages[0], args), fh)
        return
    from dslaunch.runtime.pipe import schedule as S

    for name in args.schedules:
        if S.unknown_schedule(name):
            usage_error(f"--schedules: {S.unknown_schedule(name)}")
    if "interleaved-1f1b" in args.schedules and args.layers < 2 * max(args.stages):
        usage_error(f"--layers {args.layers}: interleaved-1f1b cuts 2 chunks per stage, so it needs at least "
                    f"{2 * max(args.stages)} blocks at {max(args.stages)} stages")
    if args.cuda and torch.cuda.device_count() < max(args.stages):
        sys.exit(f"error: --cuda needs {max(args.stages)} CUDA devices, found {torch.cuda.device_count()}")
    peer = args.peer_python != "none"
    if peer and not os.path.exists(args.peer_python):
        sys.exit(f"error: --peer-python {args.peer_python}: no such file; give DeepSpeed's Python or 'none'")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load}, {os.cpu_count()} cores; {args.layers} blocks of width {args.dim}, micro-batch "
          f"{args.rows} rows, {'CUDA' if args.cuda else 'CPU'}", flush=True)
    plain = spawn(1, args, plain=True)[0]
    peak = "peak allocated" if args.cuda else "activations"
    print(f"p   m   schedule          step ms  unpiped ms  ratio  bubble  theory  clock  "
          f"{'DeepSpeed ms  ours/DS  ' if peer else ''}"
          f"state MiB/rank (unpiped)  {peak} MiB/rank (unpiped; DeepSpeed)", flush=True)
    for p in args.stages:
        ours, theirs = [], []
        for _ in range(args.rounds):  # alternating, so that a change of load falls on both sides
            ours.append(spawn(p, args))
            if peer:
                theirs.append(spawn_peer(p, args))
        for i, m in enumerate(args.micro):
            for k, name in enumerate(args.schedules):
                mine = [[rank[k] for rank in run] for run in ours]  # [run][rank][micro index]
                rows = [r[i] for r in mine[0]]
                step = median_step(mine, i)
                base = median(plain[i]["totals"])
                # per batch: the pipeline's span (first stage start to the last forward/backward
                # to end, on any stage), and each stage's idle share of it
                idle = []
                for run in mine:
                    for batch in zip(*(r[i]["spans"] for r in run)):
                        span = max(end for _, end, _ in batch) - min(start for start, _, _ in batch)
                        idle.append(statistics.mean(1.0 - compute / span for _, _, compute in batch))
                bubble = median(idle)
                theory = (p - 1) / (m + p - 1)
                clock = scheduled_bubble(name, m, p)
                state = "/".join(mib(r["state"]) for r in rows)
                acts = "/".join(mib(r["peak"]) for r in rows)
                ds = ""
                if peer:
                    ds_runs = [[rank[0] for rank in run] for run in theirs]
                    ds_step = median_step(ds_runs, i)
                    ds = f"{ds_step * 1e3:12.1f}  {step / ds_step:7.2f}  "
                    acts += "; " + "/".join(mib(r[i]["peak"]) for r in ds_runs[0])
                print(f"{p:<3d} {m:<3d} {name:<16s}  {step * 1e3:7.1f}  {base * 1e3:10.1f}  {step / base:5.2f}  "
                      f"{bubble:6.3f}  {theory:6.3f}  {clock:5.3f}  {ds}{state} ({mib(plain[i]['state'])})  "
                      f"{acts} ({mib(plain[i]['peak'])})",
                      flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end", flush=True)


def usage_error(text: str) -> None:
    print(f"error: {text}", file=sys.stderr)
    sys.exit(2)


def scheduled_bubble(name: str, m: int, p: int) -> float:
    """The schedule's own bubble on a unit clock (forward, input-gradient and weight-gradient
    halves of equal time, free transfers; schedule.simulate), beside the measured one."""
    from dslaunch.runtime.pipe import schedule as S

    return S.simulate([S.train_schedule(name, m, p, s, chunks=2) for s in range(p)]).bubble()


def median_step(runs, i: int) -> float:
    """Median over every timed batch of every run of the slowest rank's batch time."""
    return median(max(vals) for run in runs for vals in zip(*(r[i]["totals"] for r in run)))


if __name__ == "__main__":
    main()
