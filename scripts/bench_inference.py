"""Tensor-parallel inference: tokens/s and memory per rank for tp = 1, 2, 4 against the plain model.

    python scripts/bench_inference.py                 # CPU, gloo, GPT-2-small-shaped model (6 layers)
    python scripts/bench_inference.py --cuda          # one process per GPU (NCCL), fp16, GPT-2-medium shape

The plain Hugging Face model is timed in this process. Each tp size then runs under
`dslaunch --num_gpus N` the way a user serves a model too large for one rank: the model is
built on the meta device (deepspeed.OnDevice) and init_inference loads a checkpoint written
here, each rank reading only its slices. Every run does greedy decoding (batch 1, a 16-token
prompt, 32 new tokens, KV cache on), best of --repeat, in fp32 (fp16 on CUDA) and int8
(weight-only: our C++ kernel for decode steps on the CPU, the torch dequantisation op for
the prompt and on GPUs). Memory per rank: the weight
bytes the rank holds, its peak resident set (CPU) or torch.cuda.max_memory_allocated (CUDA).
The int8 paths are also timed alone on one MLP projection (decode shape).
Needs the [hf] extra (transformers). Figures carry the load average they were taken at.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # GPT-2 small's width and vocabulary, fewer layers to fit the 2-core CI box; medium on GPU
    "cpu": dict(n_embd=768, n_layer=6, n_head=12, vocab_size=50257, n_positions=1024),
    "cuda": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024),
}
PROMPT, NEW = 16, 32


def build(shape):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**shape, bos_token_id=0, eos_token_id=0)).eval()


def decode_rate(model, device, repeat):
    """Best tokens/s over `repeat` greedy generations of NEW tokens (batch 1)."""
    ids = torch.randint(1, 50000, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                  pad_token_id=0, use_cache=True)
    times = []
    with torch.no_grad():
        model.generate(ids, **dict(kwargs, max_new_tokens=4, min_new_tokens=4))  # warm-up
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    assert out.shape[1] == PROMPT + NEW
    return NEW / min(times), out[0, PROMPT:].tolist()


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dequant_cost(device, dtype, width, repeat=200):
    """Microseconds per call (best of 5 rounds): one decode-shaped MLP projection, dense vs int8 through
    the torch dequantisation op vs int8 through our C++ kernel (CPU only)."""
    import torch.nn.functional as F

    from dslaunch.runtime.inference.int8_kernel import _kernel, kernel_isa
    from dslaunch.runtime.inference.quantize import dequantize_int8, quantize_int8

    w = torch.randn(4 * width, width, device=device, dtype=dtype)
    x = torch.randn(1, 1, width, device=device, dtype=dtype)
    q, s = quantize_int8(w, 64)
    s = s.to(dtype)

    def timed(fn):
        for _ in range(10):
            fn()
        best = float("inf")
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / repeat * 1e6)
        return best

    cost = {"dense_us": timed(lambda: F.linear(x, w)),
            "torch_op_us": timed(lambda: F.linear(x, dequantize_int8(q, s, dtype)))}
    if device.type == "cpu" and dtype == torch.float32 and kernel_isa():
        cost["kernel_us"] = timed(lambda: _kernel(x, q, s, 64))
        cost["isa"] = kernel_isa()
    return cost


def worker(args):
    """One rank of `dslaunch --num_gpus N`: meta-device model, checkpoint loaded into the shards."""
    import dslaunch.runtime as deepspeed

    cuda = args.cuda
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dense = torch.float16 if cuda else torch.float32
    with deepspeed.OnDevice(dtype=dense, device="meta"):
        skeleton = build(SHAPES["cuda" if cuda else "cpu"])
    engine = deepspeed.init_inference(skeleton, mp_size=world, checkpoint=args.checkpoint,
                                      dtype=torch.int8 if args.mode == "int8" else dense,
                                      replace_with_kernel_inject=True)
    rate, tokens = decode_rate(engine, device, args.repeat)
    results = {"tokens_per_s": rate, "weight_bytes": engine.weight_bytes(), "peak_bytes": peak_memory(device),
               "tokens": tokens}
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(results), flush=True)


def launch(n, mode, args, checkpoint):
    """One tp size and mode in fresh processes (so each peak memory figure is its own)."""
    cmd = [sys.executable, "-m", "dslaunch.launcher.main", "--master_port", "0", "--num_gpus", str(n),
           os.path.abspath(__file__), "--worker", "--mode", mode, "--checkpoint", checkpoint,
           "--repeat", str(args.repeat)]
    if args.cuda:
        cmd.append("--cuda")
    env = dict(os.environ)
    if not args.cuda:
        env["OMP_NUM_THREADS"] = str(args.threads or max(1, (os.cpu_count() or 1) // n))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode != 0:
        sys.exit(f"bench_inference: tp={n} {mode} failed:\n{run.stderr[-3000:]}")
    line = next(ln for ln in run.stdout.splitlines() if "RESULT " in ln)
    return json.loads(line.split("RESULT ", 1)[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="one process per GPU, NCCL, fp16")
    parser.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes (default 1,2,4; capped at the GPUs)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for the plain model and for each rank (default: all cores for the plain "
                             "model, cores/tp per rank); 1 keeps a loaded machine's figures comparable")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("dense", "int8"), help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    device = torch.device("cuda") if args.cuda else torch.device("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.tp.split(",")]
    if args.cuda:
        sizes = [s for s in sizes if s <= torch.cuda.device_count()]
    shape = SHAPES["cuda" if args.cuda else "cpu"]
    dense = torch.float16 if args.cuda else torch.float32
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f}; {os.cpu_count()} cores; "
          f"{torch.cuda.get_device_name() if args.cuda else 'CPU'}; model {shape}", flush=True)
    model = build(shape).to(device=device, dtype=dense)
    params = sum(p.numel() for p in model.parameters())
    if args.cuda:
        torch.cuda.reset_peak_memory_stats()
    plain_rate, plain_tokens = decode_rate(model, device, args.repeat)
    plain = {"tokens_per_s": plain_rate, "weight_bytes": params * model.transformer.wte.weight.element_size(),
             "peak_bytes": peak_memory(device)}
    with tempfile.TemporaryDirectory(prefix="bench-inference-") as tmp:
        checkpoint = os.path.join(tmp, "model.pt")
        torch.save(model.state_dict(), checkpoint)
        del model
        runs = {n: {mode: launch(n, mode, args, checkpoint) for mode in ("dense", "int8")} for n in sizes}
    cost = dequant_cost(device, dense, shape["n_embd"])
    mib = 2 ** 20
    print(f"\n{params / 1e6:.1f}M parameters, greedy batch 1, prompt {PROMPT}, {NEW} new tokens, best of {args.repeat}")
    print("| run | tokens/s | vs plain | weight MiB/rank | x 1/tp of tp=1 | peak MiB/rank | same tokens* |")
    print("|---|---|---|---|---|---|---|")
    print(f"| plain HF model ({str(dense).split('.')[-1]}) | {plain['tokens_per_s']:.1f} | 1.00 | "
          f"{plain['weight_bytes'] / mib:.1f} | | {plain['peak_bytes'] / mib:.0f} | |")
    for mode in ("dense", "int8"):
        base = runs[sizes[0]][mode]["weight_bytes"] * sizes[0]
        for n in sizes:
            r = runs[n][mode]
            share = r["weight_bytes"] / (base / n)
            # dense runs must decode the plain model's tokens; int8 ones those of int8 on tp=1
            same = "yes" if r["tokens"] == (plain_tokens if mode == "dense" else runs[sizes[0]]["int8"]["tokens"]) \
                else "no"
            label = f"tp={n} {'int8' if mode == 'int8' else str(dense).split('.')[-1]}"
            print(f"| {label} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / plain['tokens_per_s']:.2f} | "
                  f"{r['weight_bytes'] / mib:.1f} | {share:.2f} | {r['peak_bytes'] / mib:.0f} | {same} |")
    print("* dense rows: the plain model's tokens; int8 rows: int8 on tp=1's tokens")
    line = (f"\none {4 * shape['n_embd']}x{shape['n_embd']} projection, decode shape ({torch.get_num_threads()} "
            f"threads): dense {cost['dense_us']:.0f} us; int8 through the torch op {cost['torch_op_us']:.0f} us")
    if "kernel_us" in cost:
        line += f"; int8 through our C++ kernel ({cost['isa']}) {cost['kernel_us']:.0f} us"
    print(line)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
