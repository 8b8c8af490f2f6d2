#!/usr/bin/env python
"""CPU Adam step: dslaunch's op vs torch.optim.AdamW(fused=True) vs the default AdamW,
side by side in one run, against the memory-bandwidth bound measured in the same run.

    .venv/bin/python scripts/bench_adam.py [--threads 2] [--sizes 10M,100M] [--tensors 1,200]

The bound: bytes an Adam step must move per parameter (fp32: read p, g, m, v and write
p, m, v = 28 B; with a bf16 copy-out 2 B more) divided by the in-place read-write
bandwidth of this machine, measured as x.mul_(s) over a buffer as large as the Adam
state. Also reports the op's cold build time (in a temporary cache) and cached load time.
Configurations run one at a time: 100M parameters with their states take ~1.6 GB each.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch


def parse_count(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def split(total: int, pieces: int):
    """~`pieces` tensors of uneven sizes (as a model's layers are) summing to `total`."""
    if pieces == 1:
        return [total]
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(pieces, generator=gen) + 0.2
    sizes = (weights / weights.sum() * total).long().tolist()
    sizes[-1] += total - sum(sizes)
    return sizes


def interleaved(fns, iters: int, warmup: int = 2):
    """Best time of each fn over `iters` rounds, the fns taking turns within a round, so
    that load from other processes on a shared machine hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def make_params(sizes, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(grad_dtype) * 1e-2
    return params


def bench_config(total: int, pieces: int, iters: int, do_default: bool):
    """ms/step of every contender and of the bandwidth probe, on the same parameters."""
    from dslaunch.kernels.cpu_adam import cpu_adam_step

    sizes = split(total, pieces)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    params = make_params(sizes)
    data = [p.detach() for p in params]
    grads = [p.grad for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    counter = [0]

    def ours(copy_out=None):
        counter[0] += 1
        cpu_adam_step(data, grads, m, v, step=counter[0], copy_out=copy_out, **hp)

    fused = torch.optim.AdamW(params, fused=True, **hp)

    def fused_then_copy():
        fused.step()
        torch._foreach_copy_(outs, data)

    # The probe buffer is as large as p, g, m, v together, so it meets the same caches.
    probe = torch.ones(4 * total)
    fns = {
        "bandwidth probe (x.mul_)": lambda: probe.mul_(1.0000001),
        "dslaunch CPU Adam": ours,
        "torch AdamW(fused=True)": fused.step,
        "dslaunch CPU Adam + bf16 copy-out": lambda: ours(outs),
        "torch fused + separate bf16 copy": fused_then_copy,
    }
    if do_default:
        default = torch.optim.AdamW([torch.nn.Parameter(d) for d in data], **hp)
        for q, p in zip(default.param_groups[0]["params"], params):
            q.grad = p.grad
        fns["torch AdamW() default"] = default.step
    best = interleaved(fns, iters)
    bw = 2 * probe.nbytes / best.pop("bandwidth probe (x.mul_)")
    del probe, fused, params, data, grads, m, v, outs, fns
    gc.collect()
    bound = {k: (30 if "copy" in k else 28) * total / bw for k in best}
    return best, bound, bw


def bench_cuda(total: int, pieces: int, iters: int):
    """GPU: FusedAdam vs torch AdamW(fused=True), with the HBM bound from x.mul_ on the device."""
    from dslaunch.kernels import FusedAdam

    sizes = split(total, pieces)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for q, p in zip(clones, params):
        q.grad = p.grad
    ours, theirs = FusedAdam(params, lr=1e-3), torch.optim.AdamW(clones, lr=1e-3, fused=True)
    probe = torch.ones(4 * total, device="cuda")

    def timed(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    best = interleaved({"probe": timed(lambda: probe.mul_(1.0000001)), "dslaunch FusedAdam": timed(ours.step),
                        "torch AdamW(fused=True)": timed(theirs.step)}, iters)
    bw = 2 * probe.nbytes / best.pop("probe")
    return best, {k: 28 * total / bw for k in best}, bw


def build_times():
    from dslaunch.kernels import builder

    with tempfile.TemporaryDirectory() as root:
        cold = builder.build(builder.cpu_adam_spec(), root)
        t0 = time.perf_counter()
        cached = builder.build(builder.cpu_adam_spec(), root)
        import ctypes

        ctypes.CDLL(str(cached.path))
        warm = time.perf_counter() - t0
    return cold.isa, cold.extra["build_seconds"], cold.seconds, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="10M,100M")
    ap.add_argument("--tensors", default="1,200")
    ap.add_argument("--iters", type=int, default=0, help="timed steps per measurement (default: by size)")
    ap.add_argument("--cuda", action="store_true", help="also benchmark FusedAdam on the GPU")
    ap.add_argument("--no-default", action="store_true", help="skip torch's slow default AdamW")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    isa, build_s, cold_s, warm_s = build_times()
    print(f"CPU Adam op: instruction set {isa}; cold build {build_s:.2f} s (compile+link; {cold_s:.2f} s with "
          f"cache bookkeeping); cached load {warm_s * 1000:.0f} ms")
    print(f"threads={args.threads}  torch {torch.__version__}")
    for size in [parse_count(s) for s in args.sizes.split(",")]:
        iters = args.iters or (10 if size <= 20 * 10**6 else 5)
        for pieces in [int(x) for x in args.tensors.split(",")]:
            rows, bound, bw = bench_config(size, pieces, iters, not args.no_default)
            print(f"\n== {size / 1e6:.0f}M parameters in {pieces} tensor(s); in-place read-write bandwidth "
                  f"{bw / 1e9:.1f} GB/s; bound 28 B/param (30 B with a bf16 copy-out); best of {iters}")
            print(f"   {'':36s} {'ms/step':>9s} {'of bound':>9s}")
            for name, t in rows.items():
                print(f"   {name:36s} {t * 1000:9.1f} {100 * bound[name] / t:8.0f}%")
            fused = rows["torch AdamW(fused=True)"]
            print(f"   ours vs torch fused:                 {fused / rows['dslaunch CPU Adam']:.2f}x")
            print(f"   ours+copy vs torch fused then copy:  "
                  f"{rows['torch fused + separate bf16 copy'] / rows['dslaunch CPU Adam + bf16 copy-out']:.2f}x")
            if "torch AdamW() default" in rows:
                print(f"   ours vs torch default:               {rows['torch AdamW() default'] / rows['dslaunch CPU Adam']:.2f}x")

            if args.cuda and torch.cuda.is_available():
                rows, bound, bw = bench_cuda(size, pieces, 20)
                print(f"   GPU ({torch.cuda.get_device_name()}), HBM read-write {bw / 1e9:.0f} GB/s:")
                for name, t in rows.items():
                    print(f"   {name:36s} {t * 1000:9.2f} {100 * bound[name] / t:8.0f}%")
                print(f"   ours vs torch fused:                 {rows['torch AdamW(fused=True)'] / rows['dslaunch FusedAdam']:.2f}x")


if __name__ == "__main__":
    main()
