#!/usr/bin/env python
"""CPU optimizer steps: dslaunch's ops against torch's, side by side in one run, against the
memory bound measured in the same run.

    .venv/bin/python scripts/bench_adam.py [--threads 2] [--sizes 10M,100M] [--tensors 1,200]
                                           [--optimizers adam,lion,adagrad] [--cuda]

Adam: dslaunch CPU Adam vs torch.optim.AdamW(fused=True) (and the default AdamW), also
with a bf16 copy of the new parameters. Lion: dslaunch CPU Lion vs the same maths in torch
foreach ops (torch has no Lion). Adagrad: dslaunch CPU Adagrad vs torch.optim.Adagrad
(fused=True and the default). The contenders take turns within every round (best of N),
so load from other processes on a shared machine hits all of them alike; each row gives
the wall time and the process CPU time per thread, and the load average is printed with
every configuration.

The bound: scripts/stream_probe.cpp, built like the kernels, streams the very same arrays
with the kernels' access pattern, thread split and prefetch but no arithmetic (Adam: read
p, g, m, v and write p, m, v; Lion/Adagrad: read 3, write 2). A step cannot beat it; "of
bound" is probe time / step time (the copy-out rows scale the probe by 30/28 bytes).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


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


def interleaved(fns, iters: int, threads: int, warmup: int = 2):
    """Best wall and CPU-per-thread time of each fn over `iters` rounds, taking turns."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall = {name: float("inf") for name in fns}
    cpu = dict(wall)
    for _ in range(iters):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], (time.process_time() - c0) / threads)
    return wall, cpu


class Probe:
    """The memory-bound probe (scripts/stream_probe.cpp), built through the ops builder."""

    def __init__(self, root: str):
        from dslaunch.kernels import builder

        spec = builder.cpu_op_spec("ds_stream_probe", str(HERE / "stream_probe.cpp"), ("ds_stream_probe",))
        self.lib = ctypes.CDLL(str(builder.build(spec, root).path))
        self.lib.ds_stream_probe.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                             ctypes.c_float, ctypes.c_int32]

    def runner(self, arrays, writes: int, threads: int):
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.data_ptr() for a in arrays])
        n = arrays[0].numel()
        return lambda: self.lib.ds_stream_probe(n, ptrs, len(arrays), writes, 0.0, threads)


def flat_params(total: int, sizes, grad_scale=1e-2):
    """Flat fp32 buffers with per-tensor parameters as views of them, so the probe streams
    exactly the memory the contenders step."""
    gen = torch.Generator().manual_seed(1)
    flat_p, flat_g = torch.randn(total, generator=gen), torch.randn(total, generator=gen) * grad_scale
    params, offset = [], 0
    for n in sizes:
        p = torch.nn.Parameter(flat_p[offset:offset + n])
        p.grad = flat_g[offset:offset + n]
        params.append(p)
        offset += n
    return flat_p, flat_g, params


def views(flat, sizes):
    out, offset = [], 0
    for n in sizes:
        out.append(flat[offset:offset + n])
        offset += n
    return out


def bench_adam(probe, total, pieces, iters, threads, do_default):
    from dslaunch.kernels.cpu_adam import cpu_adam_step

    sizes = split(total, pieces)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    flat_p, flat_g, params = flat_params(total, sizes)
    flat_m, flat_v = torch.zeros(total), torch.zeros(total)
    data, grads = [p.detach() for p in params], [p.grad for p in params]
    m, v = views(flat_m, sizes), views(flat_v, sizes)
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    counter = [0]

    def ours(copy_out=None):
        counter[0] += 1
        cpu_adam_step(data, grads, m, v, step=counter[0], copy_out=copy_out, **hp)

    fused = torch.optim.AdamW(params, fused=True, **hp)

    def fused_then_copy():
        fused.step()
        torch._foreach_copy_(outs, data)

    fns = {"bound": probe.runner([flat_p, flat_m, flat_v, flat_g], 3, threads),
           "dslaunch CPU Adam": ours,
           "torch AdamW(fused=True)": fused.step,
           "dslaunch CPU Adam + bf16 copy-out": lambda: ours(outs),
           "torch fused + separate bf16 copy": fused_then_copy}
    if do_default:
        default = torch.optim.AdamW(params, **hp)
        fns["torch AdamW() default (foreach)"] = default.step
    wall, cpu = interleaved(fns, iters, threads)
    ratios = {"ours vs torch fused": ("torch AdamW(fused=True)", "dslaunch CPU Adam"),
              "ours+copy vs fused then copy": ("torch fused + separate bf16 copy",
                                               "dslaunch CPU Adam + bf16 copy-out")}
    if do_default:
        ratios["ours vs torch default"] = ("torch AdamW() default (foreach)", "dslaunch CPU Adam")
    return wall, cpu, ratios


def bench_lion_adagrad(probe, total, pieces, iters, threads):
    from dslaunch.kernels.cpu_adagrad import cpu_adagrad_step
    from dslaunch.kernels.cpu_lion import cpu_lion_step
    from dslaunch.kernels.lion import lion_update

    sizes = split(total, pieces)
    flat_p, flat_g, params = flat_params(total, sizes)
    flat_s, flat_m = torch.zeros(total), torch.zeros(total)  # Adagrad's sum, Lion's exp_avg
    data, grads = [p.detach() for p in params], [p.grad for p in params]
    state, momentum = views(flat_s, sizes), views(flat_m, sizes)
    counter = [0]

    def ours_adagrad():
        counter[0] += 1
        cpu_adagrad_step(data, grads, state, step=counter[0], lr=1e-3, weight_decay=0.01)

    fused = torch.optim.Adagrad(params, lr=1e-3, weight_decay=0.01, fused=True)
    default = torch.optim.Adagrad(params, lr=1e-3, weight_decay=0.01)
    fns = {"bound": probe.runner([flat_p, flat_s, flat_g], 2, threads),
           "dslaunch CPU Lion": lambda: cpu_lion_step(data, grads, momentum, lr=1e-4, weight_decay=0.01),
           "torch Lion maths (foreach ops)": lambda: lion_update(data, grads, momentum, 1e-4, 0.9, 0.99, 0.01),
           "dslaunch CPU Adagrad": ours_adagrad,
           "torch Adagrad(fused=True)": fused.step,
           "torch Adagrad() default (foreach)": default.step}
    wall, cpu = interleaved(fns, iters, threads)
    ratios = {"Lion: ours vs torch foreach": ("torch Lion maths (foreach ops)", "dslaunch CPU Lion"),
              "Adagrad: ours vs torch fused": ("torch Adagrad(fused=True)", "dslaunch CPU Adagrad"),
              "Adagrad: ours vs torch default": ("torch Adagrad() default (foreach)", "dslaunch CPU Adagrad")}
    return wall, cpu, ratios


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

    wall, _ = interleaved({"probe": timed(lambda: probe.mul_(1.0000001)), "dslaunch FusedAdam": timed(ours.step),
                           "torch AdamW(fused=True)": timed(theirs.step)}, iters, 1)
    bw = 2 * probe.nbytes / wall.pop("probe")
    return wall, {k: 28 * total / bw for k in wall}, bw


def build_times():
    from dslaunch.kernels import builder

    with tempfile.TemporaryDirectory() as root:
        cold = builder.build(builder.cpu_adam_spec(), root)
        t0 = time.perf_counter()
        cached = builder.build(builder.cpu_adam_spec(), root)
        ctypes.CDLL(str(cached.path))
        warm = time.perf_counter() - t0
    return cold.isa, cold.extra["build_seconds"], cold.seconds, warm


def report(title, wall, cpu, ratios):
    bound_wall, bound_cpu = wall.pop("bound"), cpu.pop("bound")
    print(f"\n== {title}; load average {os.getloadavg()[0]:.1f}")
    print(f"   {'':38s} {'wall ms':>8s} {'of bound':>9s} {'cpu ms/thread':>14s} {'of bound':>9s}")
    print(f"   {'memory bound (stream probe)':38s} {bound_wall * 1e3:8.1f} {'':9s} {bound_cpu * 1e3:14.1f}")
    for name in wall:
        scale = 30 / 28 if "copy" in name else 1.0
        print(f"   {name:38s} {wall[name] * 1e3:8.1f} {100 * scale * bound_wall / wall[name]:8.0f}% "
              f"{cpu[name] * 1e3:14.1f} {100 * scale * bound_cpu / cpu[name]:8.0f}%")
    for label, (theirs, ours) in ratios.items():
        print(f"   {label + ':':38s} {wall[theirs] / wall[ours]:.2f}x wall, {cpu[theirs] / cpu[ours]:.2f}x cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="10M,100M")
    ap.add_argument("--tensors", default="1,200")
    ap.add_argument("--optimizers", default="adam,lion,adagrad")
    ap.add_argument("--iters", type=int, default=0, help="timed steps per measurement (default: by size)")
    ap.add_argument("--cuda", action="store_true", help="also benchmark FusedAdam on the GPU")
    ap.add_argument("--no-default", action="store_true", help="skip torch's slow default AdamW")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    which = set(args.optimizers.split(","))

    isa, build_s, cold_s, warm_s = build_times()
    print(f"CPU Adam op: instruction set {isa}; cold build {build_s:.2f} s (compile+link; {cold_s:.2f} s with "
          f"cache bookkeeping); cached load {warm_s * 1000:.0f} ms")
    print(f"threads={args.threads}  torch {torch.__version__}  load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as root:
        probe = Probe(root)
        for size in [parse_count(s) for s in args.sizes.split(",")]:
            iters = args.iters or (10 if size <= 20 * 10**6 else 5)
            for pieces in [int(x) for x in args.tensors.split(",")]:
                what = f"{size / 1e6:.0f}M parameters in {pieces} tensor(s), best of {iters}"
                if "adam" in which:
                    report(f"Adam, {what}", *bench_adam(probe, size, pieces, iters, args.threads,
                                                        not args.no_default))
                    gc.collect()
                if which & {"lion", "adagrad"}:
                    report(f"Lion and Adagrad, {what}", *bench_lion_adagrad(probe, size, pieces, iters, args.threads))
                    gc.collect()
                if args.cuda and torch.cuda.is_available():
                    rows, bound, bw = bench_cuda(size, pieces, 20)
                    print(f"   GPU ({torch.cuda.get_device_name()}), HBM read-write {bw / 1e9:.0f} GB/s:")
                    for name, t in rows.items():
                        print(f"   {name:38s} {t * 1000:8.2f} {100 * bound[name] / t:8.0f}%")
                    print(f"   ours vs torch fused: {rows['torch AdamW(fused=True)'] / rows['dslaunch FusedAdam']:.2f}x")


if __name__ == "__main__":
    main()
