#!/usr/bin/env python3
"""ZeRO++'s quantizer on a GPU, against DeepSpeed 0.19.8's own CUDA kernels, in one short run.

    python scripts/zeropp_gpu_check.py --ds-csrc DEEPSPEED/ops/csrc [--record tests/data/ds_zeropp/cuda_quantizer.pt]

1. builds dslaunch's CUDA op (kernels/quantizer.cu) and DeepSpeed's quantizer (its
   csrc/quantization sources compiled by torch.utils.cpp_extension with the flags DeepSpeed's
   CUDAOpBuilder passes: -O3 --use_fast_math, the half/bf16 operator macros, this GPU's arch);
2. on fixed fp16 inputs, runs DeepSpeed's quantize (8 and 4 bits, qwZ's block counts),
   dequantize, swizzle_quant and quantized_reduction, and compares every byte with
   - kernels/quantize_ref.py (the specification dslaunch's ops equal bit for bit),
   - dslaunch's CUDA op,
   - scripts/ds_cpu_quantizer.py (the CPU re-implementation the DeepSpeed fixtures ran with);
   counting equal bytes and scales, and the largest scale difference in float32 ulps (DeepSpeed's
   fast-math division may differ from IEEE division by up to 2);
3. with --record, saves the inputs and DeepSpeed's outputs, so that tests/kernels/test_quantizer.py
   replays dslaunch's CPU op against DeepSpeed's real bytes on any machine.
Prints one JSON line per comparison and a summary; exits 1 if a build fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def build_deepspeed(csrc: Path):
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    q = csrc / "quantization"
    return load(name="ds_quantizer_0198", sources=[str(q / f) for f in (
        "pt_binding.cpp", "quantize.cu", "quantize_intX.cu", "dequantize.cu", "swizzled_quantize.cu",
        "quant_reduce.cu")], extra_include_paths=[str(csrc / "includes")],
        extra_cflags=["-O3", "-std=c++20", "-Wno-reorder", "-DBF16_AVAILABLE"],
        extra_cuda_cflags=["-O3", "--use_fast_math", "-std=c++20", "-U__CUDA_NO_HALF_OPERATORS__",
                           "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__", "-DBF16_AVAILABLE",
                           "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__",
                           "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        verbose=False)


def _swizzle(x: torch.Tensor, hosts: int, local: int) -> torch.Tensor:
    """Rows for rank n * local + d moved to d * hosts + n (DeepSpeed's swizzled layout)."""
    return x.view(hosts * local, -1)[[n * local + d for d in range(local) for n in range(hosts)]]


def _inputs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-2, 1, n)[torch.randperm(n, generator=g)]
    x[::11] = 0
    return x.half()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.float().contiguous().view(torch.int32).long() - b.float().contiguous().view(torch.int32).long())
               .abs().max()) if a.numel() else 0


def compare(name: str, pairs: dict) -> dict:
    """pairs: {what: (theirs, ours)} -> counts of equal elements and the largest ulp gap of floats."""
    row = {"case": name}
    for what, (a, b) in pairs.items():
        a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
        same = int((a.view(torch.int8) == b.view(torch.int8)).sum()) if a.dtype == torch.int8 else \
            int((a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
                 == b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)).sum())
        row[what] = f"{same}/{a.numel()}"
        if a.is_floating_point():
            row[what] += f" (max {_ulps(a, b)} ulp)"
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ds-csrc", required=True, help="DeepSpeed 0.19.8's ops/csrc folder")
    ap.add_argument("--record", default="", help="save the inputs and DeepSpeed's outputs here (.pt)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: ds_cpu_quantizer stands in for DeepSpeed's kernels (checks this script only)")
    args = ap.parse_args()
    import ds_cpu_quantizer as dsq

    dev = "cpu" if args.cpu_dry_run else "cuda"
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device")
        return 1

    from dslaunch.kernels import quantize_ref as ref
    from dslaunch.kernels.quantizer import _CUDA_OP, dequantize, quantize, quantizer_available

    t0 = time.perf_counter()
    ok = quantizer_available(dev)
    print(json.dumps({"dslaunch CUDA op": "built" if ok else _CUDA_OP.error,
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    t0 = time.perf_counter()
    ds = dsq if args.cpu_dry_run else build_deepspeed(Path(args.ds_csrc))
    print(json.dumps({"DeepSpeed quantizer": "built", "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    sym = ds.Symmetric
    record, rows = [], []
    for bits in (8, 4):
        for n in (528, 2048, 8008, 24000, 1 << 16, 8 * 10007, 1 << 20):
            groups = ref.qwz_groups(n)
            x = _inputs(n, seed=n + bits)
            q, s = ds.quantize(x.to(dev), groups, bits, sym)
            back = ds.dequantize(q, s, groups, bits, sym)
            rq, rs = ref.quantize(x, groups, bits)
            oq, os_ = quantize(x.to(dev), groups, bits) if ok else (rq, rs)
            eq, es = dsq.quantize(x, groups, bits, dsq.Symmetric)
            rows.append(compare(f"quantize n={n} bits={bits} groups={groups}", {
                "q vs spec": (q, rq), "scales vs spec": (s, rs), "q vs dslaunch CUDA": (q, oq),
                "scales vs dslaunch CUDA": (s, os_), "q vs ds_cpu_quantizer": (q, eq),
                "dequantized vs spec": (back, ref.dequantize(q.cpu().reshape(-1), s.cpu().reshape(-1), bits,
                                                             torch.float16)),
                "dequantized vs dslaunch CUDA": (back, dequantize(q.reshape(-1), s.reshape(-1), bits, torch.float16)
                                                 if ok else back)}))
            if n <= 24000:
                record.append({"kind": "quantize", "bits": bits, "groups": groups, "x": x, "q": q.cpu().reshape(-1),
                               "scales": s.cpu().reshape(-1), "dequantized": back.cpu().reshape(-1)})
    hosts, local = 2, 2
    world = hosts * local
    for shape in ((64, 32), (48, 32), (128, 128), (256, 64)):
        n = shape[0] * shape[1]
        groups = max(shape[0], shape[1], world)
        xs = [_inputs(n, seed=7 * r + n).view(shape) for r in range(local)]
        outs = [ds.swizzle_quant(x.to(dev), groups, 4, sym, 1, hosts, local) for x in xs]
        for r, (x, (q, s)) in enumerate(zip(xs, outs)):
            rq, rs = ref.quantize(x, groups, 4)
            eq, es = dsq.swizzle_quant(x, groups, 4, dsq.Symmetric, 1, hosts, local)
            rows.append(compare(f"swizzle_quant {shape} rank {r}", {
                "q vs spec + swizzle": (q, _swizzle(rq, hosts, local)),
                "scales vs spec + swizzle": (s, _swizzle(rs, hosts, local)),
                "q vs ds_cpu_quantizer": (q, eq), "scales vs ds_cpu_quantizer": (s, es)}))
        # the intra-host all-to-all, then DeepSpeed's dequantize-sum-requantize on rank 0
        got_q = torch.cat([q.chunk(local)[0] for q, _ in outs])
        got_s = torch.cat([s.reshape(-1).chunk(local)[0] for _, s in outs])
        rq2, rs2 = ds.quantized_reduction(got_q, got_s.reshape(-1, 1), groups, groups // local, 4, sym, local)
        eq2, es2 = dsq.quantized_reduction(got_q.cpu(), got_s.cpu(), groups, groups // local, 4, dsq.Symmetric, local)
        rows.append(compare(f"quantized_reduction {shape}", {"q vs ds_cpu_quantizer": (rq2, eq2),
                                                             "scales vs ds_cpu_quantizer": (rs2, es2)}))
        record.append({"kind": "swizzle", "shape": shape, "groups": groups, "x": xs,
                       "q": [q.cpu() for q, _ in outs], "scales": [s.cpu().reshape(-1) for _, s in outs],
                       "reduced_q": rq2.cpu(), "reduced_scales": rs2.cpu().reshape(-1)})
    if args.record:
        gpu = "cpu dry run" if args.cpu_dry_run else torch.cuda.get_device_name()
        torch.save({"deepspeed": "0.19.8", "gpu": gpu, "cases": record}, args.record)
        print(json.dumps({"recorded": args.record, "cases": len(record)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
