"""Step time of the dslaunch engine (ZeRO stage 0) against torch DDP, side by side in one run.

Same GPT-lite model (scripts/train_gpt.py), same batch, same optimizer (AdamW), same number
of processes, gloo on CPU (NCCL on GPUs). The two are timed in alternating rounds so
that noise from other load on the machine hits both; the median step time of each is
reported with their ratio (target: engine within 5% of DDP).

    python scripts/bench_engine.py [--nprocs 2] [--steps 30] [--rounds 3] [--micro 16]

Run it without a launcher: it starts its own worker processes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from bench_timing import free_port, median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro", type=int, default=16, help="micro batch per process")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return p.parse_args(argv)


def _batches(n, micro, rank, corpus, block):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        ix = torch.randint(len(corpus) - block, (micro,), generator=g)
        x = torch.stack([corpus[i:i + block] for i in ix])
        y = torch.stack([corpus[i + 1:i + 1 + block] for i in ix])
        yield x, y


def _time_engine(args, corpus, gpt):
    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = gpt.GPTlite()
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           # DDP's default bucket is 25 MB; use the same for a like-for-like overlap
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 25 * 2 ** 20 // 4, "overlap_comm": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    times = []
    for i, (x, y) in enumerate(_batches(args.warmup + args.steps, args.micro, engine.global_rank, corpus,
                                        gpt.block_size)):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    engine.destroy()
    return times, loss.item()


def _time_ddp(args, corpus, gpt):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(gpt.GPTlite())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    rank = torch.distributed.get_rank()
    for i, (x, y) in enumerate(_batches(args.warmup + args.steps, args.micro, rank, corpus, gpt.block_size)):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if i >= args.warmup:
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times, loss.item()


def worker(args):
    import torch
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed

    torch.set_num_threads(args.threads)
    sys.path.insert(0, HERE)
    import train_gpt as gpt

    deepspeed.init_distributed()
    corpus = gpt.load_corpus(1_000_000)
    result = {"engine": [], "ddp": [], "loss": {}}
    for _ in range(args.rounds):
        for name, fn in (("engine", _time_engine), ("ddp", _time_ddp)):
            dist.barrier()
            times, loss = fn(args, corpus, gpt)
            result[name].extend(times)
            result["loss"][name] = loss
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main(argv=None):
    args = parse(argv)
    if "RANK" in os.environ:
        return worker(args)
    port = free_port()
    procs = []
    for r in range(args.nprocs):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nprocs), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + (argv or sys.argv[1:]), env=env,
                                      stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True))
    out, _ = procs[0].communicate()
    codes = [procs[0].returncode] + [p.wait() for p in procs[1:]]
    if any(codes):
        print(f"bench_engine: a worker failed (exit codes {codes})", file=sys.stderr)
        return 1
    res = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])
    def med(name, k):
        return median(t[k] for t in res[name]) * 1000

    print(f"GPT-lite, {args.nprocs} processes x {args.threads} thread(s), micro batch {args.micro}, "
          f"{args.rounds} alternating rounds of {args.steps} timed steps (rank 0)")
    print(f"{'':10}{'median step':>14}{'mean step':>12}{'median CPU':>13}{'final loss':>12}")
    for name in ("engine", "ddp"):
        label = "dslaunch" if name == "engine" else "torch DDP"
        mean = statistics.mean(t[0] for t in res[name]) * 1000
        print(f"{label:10}{med(name, 0):>11.1f} ms{mean:>9.1f} ms{med(name, 1):>10.1f} ms{res['loss'][name]:>12.4f}")
    print(f"ratio dslaunch/DDP, median step time: {med('engine', 0) / med('ddp', 0):.3f} (target <= 1.05); "
          f"median CPU time per step: {med('engine', 1) / med('ddp', 1):.3f}")
    print("(CPU time per step is robust to other load on the machine; wall time is what the target is about)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
