"""What the per-file checksum costs on a ~1 GB checkpoint.

    .venv/bin/python scripts/bench_checkpoint.py [--gb 1.0] [--rounds 3] [--dir DIR]

Builds a stage-0 fp32 engine with Adam (12 bytes per parameter in the checkpoint: weights
and two Adam moments) sized to --gb, takes one step, then per round:
  - torch.save of the model-states object to a plain file (+fsync) vs our checksumming
    write of the same object (files.write_torch: XXH3-64 computed as torch.save streams);
  - save_checkpoint and load_checkpoint end to end (load verifies every file it reads);
  - the verification pass alone over every file of the tag (from the page cache, as on a
    load right after a save): XXH3-64, which we use, and zlib's CRC-32 for comparison.
Prints medians and the load average. Run it on an otherwise idle machine for clean figures.
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint.files import file_record, write_torch
    from dslaunch.runtime.checkpoint.saving import _model_states

    width = 2048
    n_params = int(args.gb * (1 << 30) / 12)
    layers = max(1, round(n_params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 1000})[0]
    engine.backward(engine(torch.randn(1, width)).sum())
    engine.step()

    root = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    save_dir = os.path.join(root, "ckpt")
    plain, ours, saves, loads, verifies, crcs = [], [], [], [], [], []
    state = _model_states(engine._checkpoint_run(), engine.strategy.module_state_dict(), engine.strategy.shard_state(),
                          {})
    size = 0
    try:
        for r in range(args.rounds):
            path = os.path.join(root, "plain.pt")
            t = time.perf_counter()
            with open(path, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            plain.append(time.perf_counter() - t)
            os.remove(path)
            t = time.perf_counter()
            write_torch(path, state)
            ours.append(time.perf_counter() - t)
            os.remove(path)

            t = time.perf_counter()
            engine.save_checkpoint(save_dir, tag=f"r{r}")
            saves.append(time.perf_counter() - t)
            tag_dir = os.path.join(save_dir, f"r{r}")
            files = [os.path.join(tag_dir, f) for f in os.listdir(tag_dir)]
            size = sum(os.path.getsize(f) for f in files)
            t = time.perf_counter()
            for f in files:
                file_record(f)
            verifies.append(time.perf_counter() - t)
            t = time.perf_counter()
            for f in files:  # the same memory-mapped pass as file_record, with CRC-32
                with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm, \
                        memoryview(mm) as view:
                    zlib.crc32(view)
            crcs.append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.load_checkpoint(save_dir, tag=f"r{r}")
            loads.append(time.perf_counter() - t)
            shutil.rmtree(tag_dir)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    med = median
    gb = size / (1 << 30)
    print(f"checkpoint: {gb:.2f} GiB ({layers} x Linear({width},{width}), stage 0 fp32 + AdamW), "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print(f"model-states write: torch.save+fsync {med(plain):.2f} s, with inline XXH3-64 {med(ours):.2f} s "
          f"(+{100 * (med(ours) / med(plain) - 1):.0f}%)")
    print(f"save_checkpoint {med(saves):.2f} s; load_checkpoint {med(loads):.2f} s, of which XXH3-64 verification "
          f"{med(verifies):.2f} s ({100 * med(verifies) / med(loads):.0f}%, {gb / med(verifies):.2f} GiB/s); "
          f"zlib CRC-32 over the same files {med(crcs):.2f} s ({gb / med(crcs):.2f} GiB/s)")


if __name__ == "__main__":
    main()
