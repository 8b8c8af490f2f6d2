"""What compression_training buys, measured on CPU in one process (issue #26).

    python scripts/bench_compression.py [--steps 300] [--seed 0]

A classification task on synthetic data (64 features, 8 classes given by a random teacher
network; 8192 training rows, 2048 held out), an MLP 64-512-512-8 trained with Adam through
deepspeed.initialize, batch 128. Each run prints one line; the final loss is the mean of the
last 20 steps' training losses, accuracy is on the held-out rows after redundancy_clean.

* dense                 no compression
* sparse 50%            sparse_pruning l1, dense_ratio 0.5, in 5 equal steps from step 50 to 150
* weight int8 QAT       weight_quantization 8 bits symmetric, fake-quant in forward from step 0
* row 50%               row_pruning l1 of the two hidden layers (dense_ratio 0.5), each with the
                        next layer as related module, from step 50
For every run: parameters and forward time (median of 30 runs on the 2048 held-out rows, one
thread) before and after redundancy_clean, and the largest output difference between the two.
* heads 50%             head_pruning topk of a 8-head attention block (width 64): q/k/v/o shapes
                        before and after, and the output difference masked vs cleaned
* layers 4 -> 2         layer_reduction of a 4-layer residual stack to teacher layers [1, 3]:
                        the student's output equals the teacher network without layers 0 and 2
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import dslaunch.runtime as deepspeed  # noqa: E402
from dslaunch.runtime.compression import compression_schedule, init_compression, redundancy_clean  # noqa: E402
from bench_timing import median_ms, repeat  # noqa: E402  (scripts/: the timing helpers every benchmark shares)


def task(seed):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 8, generator=g)
    x = torch.randn(10240, 64, generator=g)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)
    return (x[:8192], y[:8192]), (x[8192:], y[8192:])


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))


def group(params, modules, related=None):
    out = {"params": params, "modules": modules}
    if related is not None:
        out["related_modules"] = related
    return out


def technique(shared, **groups):
    return {"shared_parameters": dict(shared, enabled=True), "different_groups": groups}


RUNS = {
    "dense": None,
    "sparse 50%": {"sparse_pruning": technique(
        {"method": "l1", "schedule_offset": 50, "schedule_offset_end": 150, "schedule_offset_stride": 25},
        g=group({"dense_ratio": 0.5}, ["^0$", "^2$", "^4$"]))},
    "weight int8 QAT": {"weight_quantization": technique(
        {"quantize_weight_in_forward": True, "schedule_offset": 0, "quantize_groups": 8},
        g=group({"start_bits": 8, "target_bits": 8}, ["^0$", "^2$", "^4$"]))},
    "row 50%": {"row_pruning": technique(
        {"method": "l1", "schedule_offset": 50},
        g=group({"dense_ratio": 0.5}, ["^0$", "^2$"], [["^2$"], ["^4$"]]))},
}


def train(name, section, data, steps, seed):
    (x, y), (xt, yt) = data
    model = mlp(seed)
    config = {"train_batch_size": 128, "steps_per_print": 10 ** 9, "optimizer": {"type": "Adam",
                                                                                "params": {"lr": 1e-3}}}
    if section is not None:
        config["compression_training"] = section
        init_compression(model, config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(x), (128,), generator=g)
        loss = nn.functional.cross_entropy(engine(x[idx]), y[idx])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    model = engine.module
    with torch.no_grad():
        masked_out = model(xt)
    # timed here, not on a deepcopy: redundancy_clean removes the parametrizations' properties
    # from their class, which a copy shares
    masked = {"forward_ms": forward_ms(model, xt), "params": sum(p.numel() for n, p in model.named_parameters()
                                                                 if not n.endswith("scores"))}
    if section is not None:
        redundancy_clean(model, config)
    with torch.no_grad():
        out = model(xt)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    row = {"run": name, "final_loss": sum(losses[-20:]) / 20,
           "heldout_accuracy": (out.argmax(dim=1) == yt).float().mean().item(),
           "params": sum(p.numel() for p in model.parameters()),
           "zeros": sum(int((m.weight == 0).sum()) for m in linears),
           "weights": sum(m.weight.numel() for m in linears),
           "max_abs_diff_cleaned_vs_masked": (out - masked_out).abs().max().item(),
           "max_abs_output": out.abs().max().item()}
    return row, masked, model


def forward_ms(model, x, runs=30):
    with torch.no_grad():
        return median_ms(repeat(lambda: model(x), runs, warmup=3))


def heads(seed):
    import compression_models as cm

    torch.manual_seed(seed)
    block = cm.Attention(64)  # head_dim 4: 16 heads
    section = {"head_pruning": technique({"method": "topk", "schedule_offset": 0, "num_heads": 16},
                                         g=group({"dense_ratio": 0.5}, ["^o$"], [["^q$", "^k$", "^v$"]]))}
    config = {"train_batch_size": 1, "compression_training": section}
    init_compression(block, config)
    compression_schedule(block).update(0)
    x = torch.randn(4, 12, 64)
    before = {n: tuple(getattr(block, n).weight.shape) for n in "qkvo"}
    with torch.no_grad():
        masked = block(x)
    redundancy_clean(block, config)
    with torch.no_grad():
        out = block(x)
    after = {n: tuple(block.__getattr__(n).weight.shape) for n in "qkvo"}
    return {"run": "heads 50%", "shapes_before": before, "shapes_after": after,
            "max_abs_diff_cleaned_vs_masked": (out - masked).abs().max().item()}


def layers(seed):
    import compression_models as cm

    torch.manual_seed(seed)
    teacher = cm.Stack(4)
    student = cm.Stack(4)
    config = {"train_batch_size": 1, "compression_training": {"layer_reduction": {
        "enabled": True, "keep_number_layer": 2, "module_name_prefix": "layers", "teacher_layer": [1, 3],
        "other_module_name": ["emb", "head"]}}}
    init_compression(student, config, teacher_model=teacher)
    expected = copy.deepcopy(teacher)
    expected.layers = nn.ModuleList([expected.layers[1], expected.layers[3]])
    x = torch.randn(16, 8)
    with torch.no_grad():
        diff = (student(x) - expected(x)).abs().max().item()
    return {"run": "layers 4 -> 2", "layers": len(student.layers),
            "params": sum(p.numel() for p in student.parameters()),
            "teacher_params": sum(p.numel() for p in teacher.parameters()),
            "max_abs_diff_vs_teacher_layers_1_3": diff}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = task(args.seed)
    rows = {}
    for name, section in RUNS.items():
        row, masked, cleaned = train(name, section, data, args.steps, args.seed)
        row["forward_ms_before_clean"] = masked["forward_ms"]
        row["forward_ms_cleaned"] = forward_ms(cleaned, data[1][0])
        row["params_before_clean"] = masked["params"]
        rows[name] = row
        print(row, flush=True)
    dense = rows["dense"]["final_loss"]
    for name in ("sparse 50%", "weight int8 QAT"):
        print(f"{name}: final loss {rows[name]['final_loss']:.4f} vs dense {dense:.4f} "
              f"({rows[name]['final_loss'] - dense:+.4f}); sparsity "
              f"{rows[name]['zeros'] / rows[name]['weights']:.3f}", flush=True)
    print(heads(args.seed), flush=True)
    print(layers(args.seed), flush=True)


if __name__ == "__main__":
    main()
