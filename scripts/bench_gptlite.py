"""GPT-lite trained the way the seed's DeepSpeed post trains it: the one script that every
contender of scripts/bench_vs_deepspeed.py runs.

    --impl deepspeed   `import deepspeed` (real DeepSpeed, run with its own environment's python)
    --impl dslaunch    `import dslaunch.runtime as deepspeed` (the only line that differs)
    --impl ddp         torch DistributedDataParallel + torch.optim.AdamW: the numerics reference
    --impl fsdp2       torch fully_shard per block + AdamW
    --impl floor       forward + backward alone on each rank, no communication, no optimizer:
                       the compute that every stage 0-2 step repeats (a lower bound on its time)

It needs only torch (and the impl's package), so it runs unchanged in another environment.
Rank, world and rendezvous come from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT, as any launcher sets them. Run alone it trains --steps steps and prints rank
0's losses. Under the benchmark (BENCH_FD set) it steps only when a line arrives on stdin
("step" or "stop") and answers each with one JSON line on file descriptor BENCH_FD, so the
driver can step several contenders in turn while the others wait (load from the rest of
the machine then falls on all of them alike).

Every impl sees the same data: step s on rank r trains on windows drawn by a generator
seeded with (s, r) from the corpus file (bytes), and every model starts from
torch.manual_seed(0). DeepSpeed's config "Adam" is AdamW (adam_w_mode), so the DDP and
FSDP2 references use torch.optim.AdamW with the config's hyperparameters and clip the
global norm at the config's gradient_clipping.

Memory: at --measure-step, bytes are counted from the live tensors themselves: every
tensor the garbage collector can reach, plus the .grad of every leaf among them and of the
module's parameters (autograd's gradients have no Python object until touched),
deduplicated by storage, minus what existed before the model was built, at three points:
at the end of the last micro-step's forward (plus the activations autograd saved for
backward, seen through saved_tensors_hooks: forward's peak, transient temporaries aside),
after its backward (before the optimizer step), and after the step (between steps: what
the next forward starts from). On CUDA also torch.cuda.max_memory_allocated() over that
forward, memory_allocated() after backward and after the step, and max_memory_allocated()
over the run. Also the peak resident set growth.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import resource
import signal
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self, n_embd, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        k, q, v = self.key(x), self.query(x), self.value(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        # the causal mask is built per call (the seed keeps it as a buffer per head): the
        # model's only state is its parameters, so the memory formula covers all of it
        tril = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        wei = F.softmax(wei.masked_fill(~tril, float("-inf")), dim=-1)
        return wei @ v


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.heads = nn.ModuleList([Head(n_embd, n_embd // n_head) for _ in range(n_head)])
        self.proj = nn.Linear(n_embd, n_embd)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.proj(torch.cat([head(h) for head in self.heads], dim=-1))
        return x + self.ffwd(self.ln2(x))


class GPTlite(nn.Module):
    def __init__(self, vocab, block, n_embd, n_head, n_layer):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab, n_embd)
        self.position_embedding_table = nn.Embedding(block, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab)

    def forward(self, idx):
        B, T = idx.shape
        x = self.token_embedding_table(idx) + self.position_embedding_table(torch.arange(T, device=idx.device))
        return torch.swapaxes(self.lm_head(self.ln(self.blocks(x))), 1, 2)  # (B, vocab, T) for CrossEntropyLoss


def batch(corpus: torch.Tensor, step: int, rank: int, micro: int, block: int, device):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    ix = torch.randint(len(corpus) - block - 1, (micro,), generator=g)
    x = torch.stack([corpus[i:i + block] for i in ix])
    y = torch.stack([corpus[i + 1:i + 1 + block] for i in ix])
    return x.to(device), y.to(device)


# -- memory ---------------------------------------------------------------------------------
def _storage(t):
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), st.nbytes()) if st.nbytes() and st.device.type != "meta" else None
    except Exception:  # tensors without storage (sparse, functional wrappers)
        return None


def live_storages(extra=()) -> dict:
    """{storage pointer: bytes} of every tensor the GC reaches, their leaves' .grad, and `extra`."""
    out = {}
    seen = list(extra)
    # isinstance() on torch.distributed's deprecated module attributes warns; nothing to say here
    warnings.filterwarnings("ignore", category=FutureWarning)
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            seen.append(obj)
    for t in list(seen):
        try:
            if t.is_leaf and t.grad is not None:
                seen.append(t.grad)
        except Exception:
            pass
    for t in seen:
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            if s:
                out[s[0]] = s[1]
    return out


class SavedActivations:
    """Within it, every tensor autograd saves for backward is kept in a list (they stay alive
    until backward anyway; the list is cleared before backward runs): at the end of forward,
    their storages plus the live tensors are what the process holds at forward's peak
    (transient temporaries aside), which the garbage collector alone cannot see."""

    def __init__(self):
        self.saved = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.saved.append(t)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def comm_segments() -> dict:
    """{storage pointer: bytes} of dslaunch's shared-memory communication segments (one per
    same-host group, runtime/core/comm/shm.py): transport buffers, like gloo's and NCCL's own,
    which no tensor shows; they are counted on their own, not as the engine's bytes."""
    shm = sys.modules.get("dslaunch.runtime.core.comm.shm")
    return shm.buffer_pointers() if shm is not None else {}


def held(baseline, run, extra=()) -> int:
    """Bytes of live tensor storages (the module's parameters and their .grad included) not
    in `baseline`, communication segments aside (comm_segments)."""
    gc.collect()
    live = live_storages(list(run.module.parameters()) + list(extra))
    skip = comm_segments()
    return sum(v for k, v in live.items() if k not in baseline and k not in skip)


# -- the contenders -----------------------------------------------------------------------------
class EngineRun:
    """deepspeed.initialize + engine(x) / engine.backward(loss) / engine.step(), as the seed."""

    def __init__(self, impl, model, cfg_path, device):
        if impl == "deepspeed":
            import deepspeed
            from deepspeed.accelerator import get_accelerator

            with open(cfg_path) as fh:
                fp16 = json.load(fh).get("fp16", {}).get("enabled", False)
            if device.type == "cpu" and fp16:
                # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels; torch
                # computes fp16 on any CPU, so it is told it may (make_ds_pystyle_fixtures.py does too)
                type(get_accelerator()).is_fp16_supported = lambda self: True
        else:
            import dslaunch.runtime as deepspeed
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=cfg_path)
        self.module = self.engine.module

    def forward(self, x, y, criterion):
        return criterion(self.engine(x).float(), y)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()


class TorchRun:
    """DDP (or FSDP2) with torch.optim.AdamW and the config's clipping."""

    def __init__(self, impl, model, cfg, device):
        opt = cfg["optimizer"]["params"]
        bf16 = cfg.get("bf16", {}).get("enabled", False)
        self.clip = float(cfg.get("gradient_clipping", 0.0))
        if impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = model.to(device)
            if bf16:
                model = model.to(torch.bfloat16)
            self.module = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            model = model.to(device)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
                else MixedPrecisionPolicy()
            for blk in model.blocks:
                fully_shard(blk, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            self.module = model
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]),
                                           eps=opt["eps"], weight_decay=opt["weight_decay"])

    def forward(self, x, y, criterion):
        return criterion(self.module(x).float(), y)

    def backward(self, loss):
        loss.backward()

    def step(self):
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class ComputeFloor:
    """The model in the config's dtype, forward and backward only; the step drops the gradients.
    Every data-parallel rank at stages 0-2 runs exactly this compute with the same torch kernels,
    so no engine's step time can go below it (communication and the optimizer come on top)."""

    def __init__(self, model, cfg, device):
        model = model.to(device)
        self.module = model.to(torch.bfloat16) if cfg.get("bf16", {}).get("enabled", False) else \
            model.to(torch.float16) if cfg.get("fp16", {}).get("enabled", False) else model

    forward, backward = TorchRun.forward, TorchRun.backward

    def step(self):
        for p in self.module.parameters():
            p.grad = None


def init_distributed(impl, device):
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    elif impl == "dslaunch":
        import dslaunch.runtime as deepspeed

        deepspeed.init_distributed()
    else:
        dist.init_process_group(backend)


def main(argv=None):
    spawned = float(os.environ.get("BENCH_SPAWNED", time.time()))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks before it gives up
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("deepspeed", "dslaunch", "ddp", "fsdp2", "floor"), required=True)
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--corpus", required=True, help="a file of bytes to train on")
    ap.add_argument("--local_rank", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=20, help="without the benchmark protocol: steps to train")
    ap.add_argument("--measure-step", type=int, default=2)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--summary-json", default="",
                    help="without the benchmark protocol: also write every step's seconds and loss, the parameter "
                         "count and the peak memories (GPU allocator, host resident set) to this file")
    args = ap.parse_args(argv)
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = torch.device("cuda", local_rank) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    with open(args.deepspeed_config) as fh:
        cfg = json.load(fh)
    micro = int(cfg["train_micro_batch_size_per_gpu"])
    gas = int(cfg.get("gradient_accumulation_steps", 1))
    with open(args.corpus, "rb") as fh:
        corpus = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8).long()
    init_distributed(args.impl, device)

    gc.collect()
    baseline = live_storages()
    rss0 = rss_bytes()
    torch.manual_seed(0)
    model = GPTlite(256, args.block, args.n_embd, args.n_head, args.n_layer)
    numels = [p.numel() for p in model.parameters()]
    n_params = sum(numels)
    # the elements a Muon config steps with Muon (DeepSpeed's rule: 2-D and up, not an embedding or the head)
    muon_numel = sum(p.numel() for n, p in model.named_parameters()
                     if p.dim() >= 2 and "embed" not in n.lower() and "lm_head" not in n.lower())
    if args.impl in ("deepspeed", "dslaunch"):
        run = EngineRun(args.impl, model, args.deepspeed_config, device)
    elif args.impl == "floor":
        run = ComputeFloor(model, cfg, device)
    else:
        run = TorchRun(args.impl, model, cfg, device)
    criterion = torch.nn.CrossEntropyLoss()
    del model

    bench = os.environ.get("BENCH_FD")
    report = os.fdopen(int(bench), "w", buffering=1) if bench else None
    step = 0
    losses, step_seconds = [], []
    while True:
        if report is not None:
            cmd = sys.stdin.readline().strip()
            if cmd != "step":
                break
        elif step >= args.steps:
            break
        msg = {"step": step}
        if args.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for i in range(gas):
            x, y = batch(corpus, step * gas + i, rank, micro, args.block, device)
            measure = step == args.measure_step and i == gas - 1
            if measure:
                if args.cuda:
                    torch.cuda.reset_peak_memory_stats()
                with SavedActivations() as acts:
                    loss = run.forward(x, y, criterion)
                msg["bytes_after_forward"] = held(baseline, run, acts.saved)
                acts.saved.clear()
                if args.cuda:
                    msg["cuda_forward_peak"] = torch.cuda.max_memory_allocated()
            else:
                loss = run.forward(x, y, criterion)
            run.backward(loss)
            loss_sum += loss.item()  # as the seed's loop does (running_loss += loss.item())
            if measure:
                msg["bytes_after_backward"] = held(baseline, run)
                if args.cuda:
                    msg["cuda_allocated_after_backward"] = torch.cuda.memory_allocated()
            run.step()
        if step == args.measure_step:
            del x, y, loss
            msg["bytes_between_steps"] = held(baseline, run)
            msg["comm_segment_bytes"] = sum(comm_segments().values())
            if args.cuda:
                msg["cuda_between_steps"] = torch.cuda.memory_allocated()
        if args.cuda:
            torch.cuda.synchronize()
        msg["seconds"] = time.perf_counter() - t0
        msg["loss"] = loss_sum / gas
        losses.append(msg["loss"])
        step_seconds.append(msg["seconds"])
        if step == 0:
            msg["first_step_done_s"] = time.time() - spawned
            msg["params"], msg["param_numels"], msg["muon_numel"] = n_params, numels, muon_numel
        if report is not None:
            report.write(json.dumps(msg) + "\n")
        step += 1
    final = {"final": True, "peak_rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0}
    if args.cuda:
        final["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    if report is not None:
        report.write(json.dumps(final) + "\n")
        report.close()
    elif rank == 0:
        print(f"{args.impl}: losses " + " ".join(f"{v:.4f}" for v in losses), flush=True)
        if args.summary_json:
            summary = dict(final, impl=args.impl, params=n_params, losses=losses, step_seconds=step_seconds,
                           tokens_per_step=micro * gas * args.block * int(os.environ.get("WORLD_SIZE", "1")),
                           peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            with open(args.summary_json, "w") as fh:
                json.dump(summary, fh)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
