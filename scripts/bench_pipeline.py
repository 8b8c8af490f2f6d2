"""Pipeline parallelism: step time, bubble fraction against the 1F1B theory, memory per
rank against the same model without a pipeline, in one run.

    python scripts/bench_pipeline.py [--stages 2] [--micro 4 8 16] [--layers 8] [--dim 256]
                                     [--rows 32] [--batches 5] [--cuda]

The model is a stack of `--layers` residual MLP blocks (width `--dim`, 4x hidden), cut into
p equal stages (partition_method="uniform"); a micro-batch is `--rows` rows. For each p and
each m micro-batches per batch, p ranks train `--batches` timed batches (after one warm-up)
with engine.train_batch(), and one rank trains the same model without a pipeline on the same
global batch (m micro-batches, gradient accumulation) for the reference. Printed per (p, m):

* step time: the median over batches of the slowest stage's train_batch() time, beside the
  unpipelined step time and the ratio;
* bubble: per stage, the part of train_batch() not spent in its own forward and backward
  passes (waiting for a neighbour, transfers, the optimizer step), from the engine's
  step_timings, averaged over stages; beside it the 1F1B theory (p-1)/(m+p-1), which
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
import socket
import statistics
import sys

import torch
import torch.multiprocessing as mp


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def config(m: int, rows: int) -> dict:
    return {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": m, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "wall_clock_breakdown": False}


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


def run_pipeline(args, p: int, m: int, device) -> dict:
    import dslaunch.runtime as deepspeed

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    net = deepspeed.pipe.PipelineModule(layers=[Block(args.dim) for _ in range(args.layers)], num_stages=p,
                                        loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=net, config=config(m, args.rows))
    data = batch_data(m, args.rows, args.dim, device)
    totals, spans = [], []
    with SavedActivations(engine.module) as saved:
        for i in range(args.batches + 1):
            engine.train_batch(iter(data))
            t = engine.step_timings
            if i:  # the first batch warms up (allocations)
                totals.append(t["total"])
                spans.append((t["start"], t["compute_end"], t["compute"]))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else saved.peak
    out = {"stage": engine.stage_id, "totals": totals, "spans": spans, "state": state_bytes(engine), "peak": peak}
    engine.destroy()
    return out


def run_plain(args, m: int, device) -> dict:
    """The same blocks on one rank, no pipeline: m micro-batches accumulated per step."""
    import time

    import dslaunch.runtime as deepspeed

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(args.dim) for _ in range(args.layers)])
    engine, *_ = deepspeed.initialize(model=model, config=config(m, args.rows))
    data = batch_data(m, args.rows, args.dim, device)
    totals = []
    with SavedActivations(engine.module) as saved:
        for i in range(args.batches + 1):
            start = time.perf_counter()
            for x, y in data:
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                totals.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else saved.peak
    out = {"totals": totals, "state": state_bytes(engine), "peak": peak}
    engine.destroy()
    return out


def worker(rank: int, world: int, port: int, args, result_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import dslaunch.runtime as deepspeed

    device = torch.device("cuda", rank) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed("nccl" if args.cuda else "gloo")
    rows = []
    for m in args.micro:
        rows.append(run_plain(args, m, device) if world == 1 and args.plain else run_pipeline(args, world, m, device))
    with open(f"{result_path}.{rank}", "w") as fh:
        json.dump(rows, fh)


def spawn(world: int, args, plain: bool = False):
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.plain = plain
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result")
        mp.spawn(worker, args=(world, port, args, path), nprocs=world, join=True)
        return [json.load(open(f"{path}.{r}")) for r in range(world)]


def mib(n: float) -> str:
    return f"{n / 2 ** 20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()
    if args.cuda and torch.cuda.device_count() < max(args.stages):
        sys.exit(f"error: --cuda needs {max(args.stages)} CUDA devices, found {torch.cuda.device_count()}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}, "
          f"{os.cpu_count()} cores; {args.layers} blocks of width {args.dim}, micro-batch {args.rows} rows, "
          f"{'CUDA' if args.cuda else 'CPU'}", flush=True)
    plain = spawn(1, args, plain=True)[0]
    peak = "peak allocated" if args.cuda else "activations"
    print(f"p   m   step ms  unpiped ms  ratio  bubble  theory  state MiB/rank (unpiped)  {peak} MiB/rank (unpiped)")
    for p in args.stages:
        ranks = spawn(p, args)
        for i, m in enumerate(args.micro):
            rows = [r[i] for r in ranks]
            step = statistics.median(max(vals) for vals in zip(*(r["totals"] for r in rows)))
            base = statistics.median(plain[i]["totals"])
            # per batch: the pipeline's span (first stage start to the last forward/backward
            # to end, on any stage), and each stage's idle share of it
            idle = []
            for batch in zip(*(r["spans"] for r in rows)):
                span = max(end for _, end, _ in batch) - min(start for start, _, _ in batch)
                idle.append(statistics.mean(1.0 - compute / span for _, _, compute in batch))
            bubble = statistics.median(idle)
            theory = (p - 1) / (m + p - 1)
            state = "/".join(mib(r["state"]) for r in rows)
            peak = "/".join(mib(r["peak"]) for r in rows)
            print(f"{p:<3d} {m:<3d} {step * 1e3:7.1f}  {base * 1e3:10.1f}  {step / base:5.2f}  {bubble:6.3f}  "
                  f"{theory:6.3f}  {state} ({mib(plain[i]['state'])})  {peak} ({mib(plain[i]['peak'])})", flush=True)


if __name__ == "__main__":
    main()
