"""Muon's Newton-Schulz on a model's hidden matrices: batched by shape against one matrix at a time.

    python scripts/bench_muon_ns.py [--n-embd 256] [--n-layer 4] [--n-head 4] [--repeats 20] [--cuda]

The matrices are GPT-lite's (scripts/bench_gptlite.py: per layer n_head x 3 head projections,
the output projection and the two MLP weights), orthogonalised as the Muon optimizer does it
(dslaunch.runtime.core.muon.newton_schulz.orthogonalize): "batched" passes them all in one call,
which stacks same-shaped matrices into one B x n x m iteration; "looped" calls it once per
matrix, the way a per-parameter loop runs. Both give the same matrices (checked). Prints the
median seconds of each over --repeats calls (after 3 warm-up calls) and their ratio, for
ns_method gram and standard, with OMP_NUM_THREADS as set in the environment.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

from dslaunch.runtime.core.muon import newton_schulz as ns


def shapes(n_embd: int, n_layer: int, n_head: int):
    head = n_embd // n_head
    per_layer = [(head, n_embd)] * (3 * n_head) + [(n_embd, n_embd), (4 * n_embd, n_embd), (n_embd, 4 * n_embd)]
    return per_layer * n_layer


def timed(fn, repeats: int, sync) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.cuda else "cpu")
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    shp = shapes(args.n_embd, args.n_layer, args.n_head)
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(s, generator=g).to(device) for s in shp]
    print(f"bench_muon_ns: {len(shp)} matrices of {len(set(shp))} shapes ({sum(a * b for a, b in shp)} elements), "
          f"GPT-lite n_embd {args.n_embd} x {args.n_layer} layers, {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for method in ("gram", "standard"):
        batched = ns.orthogonalize(mats, shp, method, torch.float32)
        looped = [ns.orthogonalize([m], [s], method, torch.float32)[0] for m, s in zip(mats, shp)]
        worst = max(float((a - b).abs().max()) for a, b in zip(batched, looped))
        t_b = timed(lambda: ns.orthogonalize(mats, shp, method, torch.float32), args.repeats, sync)
        t_l = timed(lambda: [ns.orthogonalize([m], [s], method, torch.float32) for m, s in zip(mats, shp)],
                    args.repeats, sync)
        print(f"  {method:8} (in {ns.compute_dtype(method, device)}): batched {t_b * 1e3:.2f} ms, looped "
              f"{t_l * 1e3:.2f} ms, batched/looped {t_b / t_l:.2f}; max |difference| {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
