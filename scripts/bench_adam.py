#!/usr/bin/env python
"""CPU optimizer steps: dslaunch's ops at every instruction set this CPU runs against torch's,
side by side in one run, against the memory bound measured in the same run.

    .venv/bin/python scripts/bench_adam.py [--threads 2] [--sizes 10M,100M] [--tensors 1,200]
                                           [--rounds 15] [--isas avx512,avx2] [--no-default] [--cuda]
    .venv/bin/python scripts/bench_adam.py --cuda-only [--dtypes fp32,bf16] [--deepspeed] [--json FILE]

The bound: scripts/stream_probe.cpp, compiled by the same builder (torch.utils.cpp_extension,
the best instruction set's flags), streams the very same arrays with the kernels' threads and
thread split (kernels/cpu_simd.h) but no arithmetic: Adam's pattern reads p, g, m, v and writes p,
m, v (28 bytes per parameter); Lion's and Adagrad's read p, g and one state and write p and the
state (20 bytes). A step cannot beat the probe of its pattern by more than noise.

Contenders: dslaunch CPU Adam, Lion and Adagrad (one row per instruction set), torch's
AdamW(fused=True), its Adagrad(fused=True), the Lion maths in torch foreach ops (torch has no
Lion) and torch's default AdamW, plus Adam writing a bf16 copy of the new parameters in the
same pass against torch's fused step followed by a copy. Every round runs each contender
once, in turn, so load from other processes falls on all of them alike. Printed per row: the
median wall time, "of bound" (the median over rounds of bound time / row time, pairing each
row with its own pattern's probe in the same round) and "vs fused AdamW" (the same paired
median of torch AdamW(fused=True) / row: above 1 is faster than torch), from wall time and
again from process CPU time per thread (which load from other processes disturbs far less).
Lion and Adagrad move 20 bytes per parameter against AdamW's 28, so their "vs fused AdamW" is
expected near 1.4 at the bound; "of bound" says how close a kernel is to the machine's limit.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from bench_timing import median, paired  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

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


def interleaved(fns, rounds: int, threads: int, warmup: int = 2):
    """Every fn's wall and CPU-per-thread time in each of `rounds` rounds, taking turns."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append((time.process_time() - c0) / threads)
    return wall, cpu


class Probe:
    """The memory-bound probe (scripts/stream_probe.cpp), built through the ops builder."""

    def __init__(self, root: str):
        from dslaunch.kernels import builder

        spec = builder.cpu_op_spec("ds_stream_probe", str(HERE / "stream_probe.cpp"), ("ds_stream_probe",))
        self.lib = ctypes.CDLL(str(builder.build(spec, root).path))
        self.lib.ds_stream_probe.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                             ctypes.c_float, ctypes.c_int32]

    def runner(self, arrays, writes: int, threads: int, scale: float = 0.0):
        """A call that reads every array and writes the first `writes` back, each element
        plus scale * (the sum of the arrays' elements): unchanged at scale 0."""
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.data_ptr() for a in arrays])
        n = arrays[0].numel()

        def run():
            if self.lib.ds_stream_probe(n, ptrs, len(arrays), writes, scale, threads) != 0:
                raise ValueError(f"stream probe: {writes} writes of {len(arrays)} arrays")
        return run


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


ADAM_HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
FUSED = "torch AdamW(fused=True)"


def bench_cpu(probe, total, pieces, rounds, threads, isas, slow):
    """All CPU contenders on `total` parameters in `pieces` tensors; rows -> (times, bound row)."""
    from dslaunch.kernels.cpu_adagrad import CpuAdagradOp, cpu_adagrad_step
    from dslaunch.kernels.cpu_adam import CpuAdamOp, cpu_adam_step
    from dslaunch.kernels.cpu_lion import CpuLionOp, cpu_lion_step
    from dslaunch.kernels.lion import lion_update

    sizes = split(total, pieces)
    flat_p, flat_g, params = flat_params(total, sizes)
    flat_m, flat_v, flat_s = torch.zeros(total), torch.zeros(total), torch.zeros(total)
    data, grads = [p.detach() for p in params], [p.grad for p in params]
    m, v, state = views(flat_m, sizes), views(flat_v, sizes), views(flat_s, sizes)
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    counter = [0]

    def adam(op, copy_out=None):
        counter[0] += 1
        cpu_adam_step(data, grads, m, v, step=counter[0], copy_out=copy_out, op=op, **ADAM_HP)

    fused = torch.optim.AdamW(params, fused=True, **ADAM_HP)
    adagrad_fused = torch.optim.Adagrad(params, lr=1e-3, weight_decay=0.01, fused=True)

    def fused_then_copy():
        fused.step()
        torch._foreach_copy_(outs, data)

    adam28, lion20 = "memory bound, Adam's pattern (probe)", "memory bound, Lion/Adagrad's (probe)"
    fns = {adam28: probe.runner([flat_p, flat_m, flat_v, flat_g], 3, threads),
           lion20: probe.runner([flat_p, flat_s, flat_g], 2, threads),
           FUSED: fused.step}
    bound = {FUSED: adam28}
    for isa in isas:
        ops = CpuAdamOp(isa), CpuLionOp(isa), CpuAdagradOp(isa)
        for op in ops:
            if not op.load():
                raise SystemExit(f"bench_adam: cannot build the {isa} ops: {op.error}")
        fns[f"dslaunch CPU Adam ({isa})"] = lambda op=ops[0]: adam(op)
        fns[f"dslaunch CPU Lion ({isa})"] = lambda op=ops[1]: cpu_lion_step(data, grads, state, lr=1e-4,
                                                                             weight_decay=0.01, op=op)
        fns[f"dslaunch CPU Adagrad ({isa})"] = lambda op=ops[2]: cpu_adagrad_step(
            data, grads, state, step=counter[0] + 1, lr=1e-3, weight_decay=0.01, op=op)
        bound.update({f"dslaunch CPU Adam ({isa})": adam28, f"dslaunch CPU Lion ({isa})": lion20,
                      f"dslaunch CPU Adagrad ({isa})": lion20})
    fns["torch Adagrad(fused=True)"] = adagrad_fused.step
    bound["torch Adagrad(fused=True)"] = lion20
    best = CpuAdamOp(isas[0])
    fns[f"dslaunch CPU Adam ({isas[0]}) + bf16 copy-out"] = lambda: adam(best, outs)
    fns["torch fused AdamW, then bf16 copy"] = fused_then_copy
    bound.update({f"dslaunch CPU Adam ({isas[0]}) + bf16 copy-out": adam28, "torch fused AdamW, then bf16 copy": adam28})
    if slow:
        default = torch.optim.AdamW(params, **ADAM_HP)
        fns["torch AdamW() default (foreach)"] = default.step
        fns["torch Lion maths (foreach ops)"] = lambda: lion_update(data, grads, state, 1e-4, 0.9, 0.99, 0.01)
        bound.update({"torch AdamW() default (foreach)": adam28, "torch Lion maths (foreach ops)": lion20})
    wall, cpu = interleaved(fns, rounds, threads)
    return wall, cpu, bound


def deepspeed_fused_adam():
    """DeepSpeed's FusedAdam class when a real DeepSpeed is importable (not dslaunch's
    compatibility package), else None; it JIT-builds its CUDA op on first use."""
    try:
        import deepspeed
        from deepspeed.ops.adam import FusedAdam as DSFusedAdam
    except Exception:
        return None
    return None if hasattr(deepspeed, "_aliases") else DSFusedAdam


def bench_cuda(total: int, pieces: int, iters: int, dtype=torch.float32, with_deepspeed: bool = False):
    """GPU: FusedAdam vs torch AdamW(fused=True) (and DeepSpeed's FusedAdam when asked and
    importable), parameters and gradients in `dtype`, fp32 states; each round steps every
    contender once, in turn. The HBM bound comes from x.mul_ on the device in the same rounds;
    Adam moves 2 (dtype bytes) x 2 (p read+write) + grad read + 16 bytes of fp32 states."""
    from dslaunch.kernels import FusedAdam

    sizes = split(total, pieces)
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(n, device="cuda", generator=gen).to(dtype) for n in sizes]
    grads = [(torch.randn(n, device="cuda", generator=gen) * 1e-2).to(dtype) for n in sizes]

    def fresh():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads):
            p.grad = g
        return ps

    fns = {}
    ours = FusedAdam(fresh(), lr=1e-3, weight_decay=1e-2)
    theirs = torch.optim.AdamW(fresh(), lr=1e-3, weight_decay=1e-2, fused=True)
    fns["dslaunch FusedAdam"] = ours.step
    fns["torch AdamW(fused=True)"] = theirs.step
    DS = deepspeed_fused_adam() if with_deepspeed else None
    if DS is not None:
        fns["DeepSpeed FusedAdam"] = DS(fresh(), lr=1e-3, weight_decay=1e-2, adam_w_mode=True).step
    probe = torch.ones(4 * total, device="cuda")
    fns["probe"] = lambda: probe.mul_(1.0000001)

    def timed(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    times, _ = interleaved({k: timed(f) for k, f in fns.items()}, iters, 1)
    wall = {name: median(t) for name, t in times.items()}
    bw = 2 * probe.nbytes / wall.pop("probe")
    per_param = 2 * (torch.finfo(dtype).bits // 8) + torch.finfo(dtype).bits // 8 + 16
    return wall, {k: per_param * total / bw for k in wall}, bw


def cuda_rows(sizes, tensors, dtypes, rounds, with_deepspeed):
    """Every (size, tensors, dtype) case on the GPU: printed, and returned as JSON-ready rows."""
    out = []
    for size in sizes:
        for pieces in tensors:
            for dtype in dtypes:
                rows, bound, bw = bench_cuda(size, pieces, rounds, dtype, with_deepspeed)
                print(f"\n== GPU ({torch.cuda.get_device_name()}): {size:,} {str(dtype)[6:]} parameters in {pieces} "
                      f"tensor(s), median of {rounds} rounds; HBM read-write {bw / 1e9:.0f} GB/s")
                for name, t in rows.items():
                    print(f"   {name:38s} {t * 1000:8.3f} ms {100 * bound[name] / t:6.0f}% of bound")
                ratio = rows["torch AdamW(fused=True)"] / rows["dslaunch FusedAdam"]
                print(f"   ours vs torch fused: {ratio:.2f}x (above 1: faster)")
                rec = {"params": size, "tensors": pieces, "dtype": str(dtype)[6:], "rounds": rounds,
                       "hbm_gbps": bw / 1e9, "ms": {k: v * 1e3 for k, v in rows.items()},
                       "of_bound": {k: bound[k] / v for k, v in rows.items()}, "ours_vs_torch_fused": ratio}
                if "DeepSpeed FusedAdam" in rows:
                    rec["ours_vs_deepspeed"] = rows["DeepSpeed FusedAdam"] / rows["dslaunch FusedAdam"]
                    print(f"   ours vs DeepSpeed FusedAdam: {rec['ours_vs_deepspeed']:.2f}x")
                out.append(rec)
                gc.collect()
                torch.cuda.empty_cache()
    return out


def build_times():
    from dslaunch.kernels import builder

    with tempfile.TemporaryDirectory() as root:
        cold = builder.build(builder.cpu_adam_spec(), root)
        t0 = time.perf_counter()
        cached = builder.build(builder.cpu_adam_spec(), root)
        ctypes.CDLL(str(cached.path))
        warm = time.perf_counter() - t0
    return cold.isa, cold.extra["build_seconds"], cold.seconds, warm


def report(title, wall, cpu, bound):
    """Wall figures, then the same from process CPU time per thread: under load from other
    processes the wall time mostly measures scheduling, CPU time much less so."""
    print(f"\n== {title}; load average {os.getloadavg()[0]:.1f}")
    print(f"   {'':44s} {'wall ms':>8s} {'of bound':>9s} {'vs fused AdamW':>15s} {'cpu ms':>7s} {'of bound':>9s} "
          f"{'vs fused AdamW':>15s}")
    for name in wall:
        row = f"   {name:44s}"
        for t in (wall, cpu):
            row += f" {median(t[name]) * 1e3:{8 if t is wall else 7}.1f}"
            if name in bound:
                # a copy-out row moves 30 bytes per parameter against its probe's 28
                scale = 30 / 28 if "copy" in name else 1.0
                row += f" {100 * scale * paired(t[bound[name]], t[name]):8.0f}% {paired(t[FUSED], t[name]):14.2f}x"
            else:
                row += f" {'':9s} {'':15s}"
        print(row.rstrip())


def main() -> None:
    from dslaunch.kernels import builder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="10M,100M")
    ap.add_argument("--tensors", default="1,200")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds per configuration (default: by size)")
    ap.add_argument("--isas", default="", help="instruction sets of our ops (default: all this CPU runs but scalar)")
    ap.add_argument("--cuda", action="store_true", help="also benchmark FusedAdam on the GPU")
    ap.add_argument("--no-default", action="store_true", help="skip torch's slow default AdamW and foreach Lion")
    ap.add_argument("--cuda-only", action="store_true", help="only the GPU rows (implies --cuda)")
    ap.add_argument("--dtypes", default="fp32", help="parameter dtypes of the GPU rows: fp32,bf16,fp16")
    ap.add_argument("--deepspeed", action="store_true",
                    help="GPU rows also step DeepSpeed's FusedAdam, when a real DeepSpeed is importable")
    ap.add_argument("--json", default="", help="write the GPU rows to this file")
    args = ap.parse_args()
    if args.cuda_only:
        dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.dtypes.split(",")]
        if not torch.cuda.is_available():
            raise SystemExit("bench_adam: --cuda-only: torch sees no CUDA device")
        rows = cuda_rows([parse_count(s) for s in args.sizes.split(",")], [int(x) for x in args.tensors.split(",")],
                         dtypes, args.rounds or 20, args.deepspeed)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "deepspeed": bool(args.deepspeed and deepspeed_fused_adam()), "rows": rows}, fh, indent=1)
        return
    runs = [level for level in builder.ISA_LEVELS if builder._ISA_NEEDS[level] <= builder.cpu_flags()]
    isas = [i for i in args.isas.split(",") if i] or [level for level in runs if level != "scalar"] or ["scalar"]
    for isa in isas:
        if isa not in runs:
            raise SystemExit(f"bench_adam: --isas {isa}: this CPU runs {', '.join(runs)}")
    torch.set_num_threads(args.threads)

    isa, build_s, cold_s, warm_s = build_times()
    flags = builder.cpu_flags()
    print(f"CPU Adam op: instruction set {isa}; cold build {build_s:.2f} s (compile+link; {cold_s:.2f} s with "
          f"cache bookkeeping); cached load {warm_s * 1000:.0f} ms")
    print(f"CPU {_cpu_model()}; avx2 {'avx2' in flags}, avx512f {'avx512f' in flags}, "
          f"avx512_bf16 {'avx512_bf16' in flags}; torch's kernels: {torch.backends.cpu.get_cpu_capability()}")
    print(f"threads={args.threads}  torch {torch.__version__}  load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as root:
        probe = Probe(root)
        for size in [parse_count(s) for s in args.sizes.split(",")]:
            rounds = args.rounds or (21 if size <= 20 * 10**6 else 11)
            for pieces in [int(x) for x in args.tensors.split(",")]:
                what = f"{size:,} parameters in {pieces} tensor(s), median of {rounds} rounds"
                report(what, *bench_cpu(probe, size, pieces, rounds, args.threads, isas, not args.no_default))
                gc.collect()
                if args.cuda and torch.cuda.is_available():
                    cuda_rows([size], [pieces], [torch.float32], 20, args.deepspeed)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
