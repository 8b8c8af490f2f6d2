"""ZeRO memory and speed, side by side with stage 0 and torch FSDP2, in one run.

    python scripts/bench_zero.py [--nprocs 2] [--steps 8] [--dim 256] [--layers 6]

Every rank builds the same model (a stack of MLP blocks) under each configuration in
turn: stages 0-3 in bf16 with AdamW, stages 1-3 with offload_optimizer cpu, stage 2
with NVMe offload (a temporary directory), and FSDP2 (`fully_shard` per block, bf16
parameters, fp32 reduction). Per configuration it prints:

* bytes of model state held by rank 0 after backward (gradients alive, before the step),
  counted from the live tensors themselves: every tensor the garbage collector can see,
  deduplicated by storage, minus what existed before the engine was built. The split
  into parameters (module parameters and their stage-3 shards) and optimizer (the
  optimizer's param groups and state) is by reachability; the rest is gradients and
  communication buffers. Beside it, ZeRO's formula for mixed-precision Adam:
  16P (stage 0), 4P + 12P/N (1), 2P + 14P/N (2), 16P/N (3).
* median step time and its ratio to stage 0 and to FSDP2. All runs are alive at once
  for the timing and are stepped round-robin, so load from other processes on the
  machine falls on every configuration alike (memory is measured first, one run alone).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_timing import free_port, median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)


def build_model(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks.append(torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)))
    return torch.nn.Sequential(*blocks)


def storages(extra=()):
    """{storage pointer: bytes} over every tensor the GC tracks (plus `extra`), dslaunch's
    shared-memory communication segments aside (transport buffers, runtime/core/comm/shm.py)."""
    shm = sys.modules.get("dslaunch.runtime.core.comm.shm")
    skip = shm.buffer_pointers() if shm is not None else {}
    out = {}
    for obj in list(gc.get_objects()) + list(extra):
        try:
            if not torch.is_tensor(obj):
                continue
            if type(obj).__name__ == "DTensor":
                obj = obj.to_local()
            st = obj.untyped_storage()
            if st.nbytes() and st.data_ptr() not in skip:
                out[st.data_ptr()] = st.nbytes()
        except Exception:
            continue
    return out


def reach(tensors):
    out = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if type(t).__name__ == "DTensor":
            t = t.to_local()
        st = t.untyped_storage()
        if st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return out


def measure(module, optimizer, baseline):
    gc.collect()
    # .grad tensors made by autograd have no Python object until touched, so the GC walk
    # misses them; name them explicitly
    grads = [p.grad for p in module.parameters()] + [p.grad for g in optimizer.param_groups for p in g["params"]]
    live = {k: v for k, v in storages(grads).items() if k not in baseline}
    params = [p for p in module.parameters()] + [p._zero.shard for p in module.parameters() if hasattr(p, "_zero")]
    opt = [p for g in optimizer.param_groups for p in g["params"]]
    opt += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    pb = {k: v for k, v in reach(params).items() if k in live}
    ob = {k: v for k, v in reach(opt).items() if k in live and k not in pb}
    total = sum(live.values())
    return {"params": sum(pb.values()), "optim": sum(ob.values()), "rest": total - sum(pb.values()) - sum(ob.values()),
            "total": total}


def data(dim, micro, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(micro, dim, generator=g).to(torch.bfloat16)
    return x, torch.tanh(x)


class EngineRun:
    """One configuration under dslaunch.runtime."""

    def __init__(self, args, stage, offload, nvme_dir):
        import dslaunch.runtime as deepspeed

        model = build_model(args.dim, args.layers)
        cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
               "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket,
                                     "allgather_bucket_size": args.bucket, "stage3_prefetch_bucket_size": args.bucket,
                                     "stage3_param_persistence_threshold": 0, "sub_group_size": args.bucket}}
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": nvme_dir}
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        self.module, self.optimizer, self.args = self.engine.module, self.engine.optimizer, args

    def forward_backward(self, step):
        x, y = data(self.args.dim, self.args.micro, dist.get_rank(), step)
        loss = torch.nn.functional.mse_loss(self.engine(x).float(), y.float())
        self.engine.backward(loss)

    def optimizer_step(self):
        self.engine.step()

    def close(self):
        self.engine.destroy()


class FSDP2Run:
    """The same model under torch's fully_shard (per block, then the root)."""

    def __init__(self, args):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.module = build_model(args.dim, args.layers)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.module:
            fully_shard(block, mp_policy=policy)
        fully_shard(self.module, mp_policy=policy)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-3, weight_decay=0.01)
        self.args = args

    def forward_backward(self, step):
        x, y = data(self.args.dim, self.args.micro, dist.get_rank(), step)
        torch.nn.functional.mse_loss(self.module(x).float(), y.float()).backward()

    def optimizer_step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self):
        pass


def memory_of(make, args):
    """Bytes after backward of one run built and stepped alone (nothing else alive)."""
    gc.collect()
    baseline = storages()
    run = make()
    for step in range(args.warmup):
        run.forward_backward(step)
        if step == args.warmup - 1:
            mem = measure(run.module, run.optimizer, baseline)
        run.optimizer_step()
    run.close()
    del run
    gc.collect()
    return mem


def interleaved_times(makers, args):
    """Median step time of every run, stepping them round-robin so that load from other
    processes on the machine falls on all of them alike."""
    runs = [make() for make in makers]
    times = [[] for _ in runs]
    for step in range(args.warmup + args.steps):
        for i, run in enumerate(runs):
            dist.barrier()
            t0 = time.perf_counter()
            run.forward_backward(step)
            run.optimizer_step()
            dist.barrier()
            if step >= args.warmup:
                times[i].append(time.perf_counter() - t0)
    for run in runs:
        run.close()
    return [median(t) for t in times]


def worker(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.nprocs))
    torch.set_num_threads(max(1, args.threads))
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=args.nprocs)
    nvme = tempfile.mkdtemp(prefix="bench-zero-nvme-")
    configs = [("stage 0", 0, None), ("stage 1", 1, None), ("stage 2", 2, None), ("stage 3", 3, None),
               ("stage 1 + cpu offload", 1, "cpu"), ("stage 2 + cpu offload", 2, "cpu"),
               ("stage 3 + cpu offload", 3, "cpu"), ("stage 2 + nvme offload", 2, "nvme")]
    makers = [(lambda st=st, off=off: EngineRun(args, st, off, nvme)) for _, st, off in configs]
    names = [c[0] for c in configs]
    stages = [c[1] for c in configs]
    try:
        FSDP2Run(args)  # probe: FSDP2 may not run on this torch/backend; say so instead of failing
        makers.append(lambda: FSDP2Run(args))
        names.append("FSDP2 fully_shard")
        stages.append(3)
    except Exception as exc:
        if rank == 0:
            print(f"FSDP2 unavailable: {type(exc).__name__}: {exc}")
    mems = [memory_of(m, args) for m in makers]
    times = interleaved_times(makers, args)
    if rank == 0:
        report(args, list(zip(names, stages, mems, times)))
    dist.destroy_process_group()


def report(args, results):
    model = build_model(args.dim, args.layers)
    P = sum(p.numel() for p in model.parameters())
    N = args.nprocs
    formula = {0: 16 * P, 1: 4 * P + 12 * P / N, 2: 2 * P + 14 * P / N, 3: 16 * P / N}
    t0 = results[0][3]
    fsdp = next((r[3] for r in results if r[0] == "FSDP2 fully_shard"), float("nan"))
    mb = 1 / 2 ** 20
    print(f"model: {args.layers} MLP blocks, dim {args.dim}, {P:,} parameters; {N} gloo ranks on CPU; bf16 + AdamW; "
          f"micro batch {args.micro}; median of {args.steps} steps after {args.warmup} warm-up; bucket {args.bucket:,}")
    print(f"{'config':28} {'params':>8} {'optim':>8} {'grads+':>8} {'total':>8} {'formula':>8} {'tot/form':>8} "
          f"{'step s':>8} {'vs st0':>7} {'vs FSDP2':>8}")
    for name, stage, mem, t in results:
        if mem is None:
            print(f"{name}")
            continue
        f = formula[stage]
        print(f"{name:28} {mem['params'] * mb:8.2f} {mem['optim'] * mb:8.2f} {mem['rest'] * mb:8.2f} "
              f"{mem['total'] * mb:8.2f} {f * mb:8.2f} {mem['total'] / f:8.2f} {t:8.4f} {t / t0:7.2f} {t / fsdp:8.2f}")
    print("bytes in MiB held by rank 0 after backward; formula = ZeRO's mixed-precision Adam bytes for the stage "
          "(offload rows: the same formula, though the optimizer part lives in host memory or on disk)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=2_000_000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    port = free_port()
    mp.spawn(worker, args=(args, port), nprocs=args.nprocs)


if __name__ == "__main__":
    sys.exit(main())
