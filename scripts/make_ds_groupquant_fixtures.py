"""Make the group-wise weight quantization fixture tests/data/ds_groupquant/expected.pt with real DeepSpeed.

    .venv/bin/python scripts/make_ds_groupquant_fixtures.py --ds-python /work/ds-venv/bin/python

DeepSpeed 0.19.8 (CPU accelerator, one process) answers every case of CASES with its
deepspeed.inference.quantization: Quantizer.quantize (the packed integers, per-group scales
and minimums) and DeQuantizer.dequantize for 4 and 8 bits, group_dim 0 and 1, float32 and
float16 weights; and QuantizedLinear / QuantizedEmbedding built from seeded layers, with
their forward outputs. The inputs are stored beside the answers, so
tests/runtime/inference/test_groupwise_quant.py replays dslaunch on exactly them without
DeepSpeed. (DeepSpeed's model walk, _init_group_wise_weight_quantization, imports
transformers, which the reference environment lacks; the layers it builds are recorded
here directly.) DeepSpeed is run, never imported by the project.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_groupquant", "expected.pt")

# name: (num_bits, group_size, group_dim, dtype name, weight shape)
CASES = {f"{bits}bit_dim{dim}_{dtype}": (bits, 8, dim, dtype, (16, 24) if dim == 0 else (12, 32))
         for bits in (4, 8) for dim in (0, 1) for dtype in ("float32", "float16")}


# DeepSpeed's DeQuantizer sends a float16 weight grouped along its last dimension to its CUDA
# quantizer op whenever the accelerator's device is the tensor's, so on the CPU accelerator it
# stops with "This op had not been implemented on CPU backend": those cases record that line
# as their dequantized answer (dslaunch dequantizes them with torch), and the layers are
# grouped along dimension 0, which DeepSpeed dequantizes on the CPU.
NO_CPU_KERNEL = "This op had not been implemented on CPU backend."


def inputs():
    import torch

    g = torch.Generator().manual_seed(7)
    weights = {name: (torch.randn(*shape, generator=g) * 0.5).to(getattr(torch, dtype))
               for name, (_, _, _, dtype, shape) in CASES.items()}
    layers = {"linear_w": (torch.randn(24, 32, generator=g) * 0.2).half(), "linear_b": torch.randn(24, generator=g).half(),
              "x": torch.randn(5, 32, generator=g).half(),
              "embed_w": (torch.randn(16, 12, generator=g)).half(), "ids": torch.tensor([[0, 3, 15], [4, 4, 1]])}
    return {"weights": weights, "layers": layers}


def config(bits: int, size: int, dim: int) -> dict:
    return {"num_bits": bits, "group_size": size, "group_dim": dim, "symmetric": False}


def answer(utils, layers_mod, data: dict) -> dict:
    """Every case's answer from the modules given (DeepSpeed's or dslaunch's)."""
    import torch
    from torch import nn

    out = {"quantize": {}, "layers": {}}
    for name, (bits, size, dim, _, _) in CASES.items():
        w = data["weights"][name]
        q, scale, low = utils.Quantizer(config(bits, size, dim)).quantize(w)
        try:
            back = utils.DeQuantizer(config(bits, size, dim), w.dtype).dequantize(q, scale, low)
        except ValueError as err:  # see NO_CPU_KERNEL
            back = str(err)
        out["quantize"][name] = {"q": q, "scale": scale, "min": low, "dequantized": back}
    lay = data["layers"]
    for bits in (4, 8):
        linear = nn.Linear(32, 24, dtype=torch.float16)
        with torch.no_grad():
            linear.weight.copy_(lay["linear_w"])
            linear.bias.copy_(lay["linear_b"])
        embed = nn.Embedding(16, 12, dtype=torch.float16)
        with torch.no_grad():
            embed.weight.copy_(lay["embed_w"])
        with torch.no_grad():
            ql = layers_mod.QuantizedLinear(config(bits, 8, 0), linear)  # group_dim 0: see NO_CPU_KERNEL
            qe = layers_mod.QuantizedEmbedding(config(bits, 8, 0), embed)
            out["layers"][f"{bits}bit"] = {"linear": ql(lay["x"]).float(), "embedding": qe(lay["ids"]).float()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-python", help="a Python with deepspeed 0.19.8 installed")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    if args.job:  # inside DeepSpeed's Python: read the inputs, write the answers
        from deepspeed.inference.quantization import layers, utils

        data = torch.load(args.job)
        torch.save({"deepspeed": "0.19.8", "inputs": data, "expected": answer(utils, layers, data)}, OUT)
        return
    if not args.ds_python:
        sys.exit("error: give --ds-python, a Python with deepspeed installed")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inputs.pt")
        torch.save(inputs(), path)
        subprocess.run([args.ds_python, os.path.abspath(__file__), "--job", path], check=True, cwd="/",
                       env=dict(os.environ, DS_ACCELERATOR="cpu"))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
