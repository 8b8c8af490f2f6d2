"""The tiny models and runs of the compression fixtures, shared by
scripts/make_ds_compression_fixtures.py (under DeepSpeed 0.17.6) and tests/runtime/train/test_compression.py
(under dslaunch): plain torch only, so either side imports it. The CNN and the layer stack are
scripts/compression_nets.py's, which the generated differential cases train too."""
from __future__ import annotations

import copy

import torch
from torch import nn

from script_modules import load_script

_nets = load_script("compression_nets")
CNN, Stack = _nets.CNN, _nets.Stack

STEPS = 3
LR = 0.1


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 12)
        self.out = nn.Linear(12, 4)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Attention(nn.Module):
    """Self-attention whose head count follows q's width (head_dim fixed), so that it still runs
    after head pruning cuts q/k/v/o."""

    head_dim = 4

    def __init__(self, width=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.q.weight.shape[0] // self.head_dim

        def split(y):
            return y.view(b, t, heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, heads * self.head_dim)
        return self.head(self.o(y))


LAYER_REDUCTION = {"layer_reduction": {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "layers",
                                       "teacher_layer": [1, 3], "other_module_name": ["emb", "head"]}}


def group(params, modules, related=None):
    out = {"params": params, "modules": modules}
    if related is not None:
        out["related_modules"] = related
    return out


def technique(shared, **groups):
    return {"shared_parameters": dict(shared, enabled=True), "different_groups": groups}


# name -> (model class, compression_training section). Not here: channel pruning by l1, which
# DeepSpeed 0.17.6 cannot run (its torch.linalg.norm call over three dimensions raises).
CASES = {
    "sparse_l1": (MLP, {"sparse_pruning": technique(
        {"method": "l1", "schedule_offset": 0, "schedule_offset_end": 0},
        g=group({"dense_ratio": 0.5}, ["fc1", "fc2"]))}),
    "sparse_topk": (MLP, {"sparse_pruning": technique(
        {"method": "topk", "schedule_offset": 1, "schedule_offset_end": 1},
        g=group({"dense_ratio": 0.3}, ["fc"]))}),
    "row_l1": (MLP, {"row_pruning": technique(
        {"method": "l1", "schedule_offset": 0},
        g=group({"dense_ratio": 0.5}, ["fc1"], [["fc2"]]))}),
    "row_topk": (MLP, {"row_pruning": technique(
        {"method": "topk", "schedule_offset": 0},
        g=group({"dense_ratio": 0.5}, ["fc2"], [["out"]]))}),
    "head_topk": (Attention, {"head_pruning": technique(
        {"method": "topk", "schedule_offset": 0, "num_heads": 4},
        g=group({"dense_ratio": 0.5}, ["o"], [["q", "k", "v"]]))}),
    "quant_sym8": (MLP, {"weight_quantization": technique(
        {"quantize_weight_in_forward": True, "schedule_offset": 0, "quantize_groups": 4,
         "quantization_type": "symmetric"},
        g=group({"start_bits": 8, "target_bits": 8}, ["fc1", "fc2", "out"]))}),
    "quant_asym4": (MLP, {"weight_quantization": technique(
        {"quantize_weight_in_forward": True, "schedule_offset": 1, "quantize_groups": 2,
         "quantization_type": "asymmetric"},
        g=group({"start_bits": 4, "target_bits": 4}, ["fc2"]))}),
    "sparse_and_quant": (MLP, {
        "sparse_pruning": technique({"method": "l1", "schedule_offset": 0, "schedule_offset_end": 0},
                                    g=group({"dense_ratio": 0.5}, ["fc2"])),
        "weight_quantization": technique({"quantize_weight_in_forward": True, "schedule_offset": 0},
                                         g=group({"start_bits": 8, "target_bits": 8}, ["fc2"]))}),
    "act_sym8_dynamic": (MLP, {"activation_quantization": technique(
        {"quantization_type": "symmetric", "range_calibration": "dynamic", "schedule_offset": 0},
        g=group({"bits": 8}, ["fc2", "out"]))}),
    "act_asym4_static": (MLP, {"activation_quantization": technique(
        {"quantization_type": "asymmetric", "range_calibration": "static", "schedule_offset": 1},
        g=group({"bits": 4}, ["fc2"]))}),
    "act_conv_dynamic": (CNN, {"activation_quantization": technique(
        {"quantization_type": "symmetric", "range_calibration": "dynamic", "schedule_offset": 0},
        g=group({"bits": 4}, ["conv2"]))}),
    "channel_topk": (CNN, {"channel_pruning": technique(
        {"method": "topk", "schedule_offset": 1},
        g=group({"dense_ratio": 0.5}, ["conv1"], [["bn1", "conv2"]]))}),
}


def data(cls):
    g = torch.Generator().manual_seed(1)
    if cls is Attention:
        return torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 4, generator=g)
    if cls is CNN:
        return torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 4, generator=g)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def fresh(cls):
    torch.manual_seed(0)
    return cls()


def train(model, x, y, on_step):
    """STEPS steps of SGD on an MSE loss; on_step(k) runs before the forward of step k (k=0..),
    as the engines update the compression schedule. Returns the losses."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for k in range(STEPS):
        on_step(k)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# The engine cases: a 3-layer MLP trained through init_compression and deepspeed.initialize
# (1 process, ZeRO stages ENGINE_STAGES) for ENGINE_STEPS steps of Adam, then redundancy_clean.
ENGINE_STEPS = 12
ENGINE_STAGES = (0, 2)
# torch's AdamW on both sides ("torch_adam": DeepSpeed's default FusedAdam is an op build on the
# CPU). weight_decay is given: DeepSpeed hands torch's AdamW only the params in the config, so
# torch's own default (0.01) would apply without it.
ENGINE_OPTIMIZER = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}


class MLP3(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _row_l1(offset):
    return technique({"method": "l1", "schedule_offset": offset},
                     g=group({"dense_ratio": 0.5}, ["fc2"], [["fc3"]]))


# name -> (compression_training section, whether fc1/fc2 are rounded to multiples of 1/16 so
# that many weights and row norms are equal: the l1 rankings then hinge on how ties break)
ENGINE_CASES = {
    # rows of fc2 masked from step 2 on, fc3's inputs cut with them at the clean
    "row_l1_offset2": ({"row_pruning": _row_l1(2)}, False),
    # with single weights of fc1 (from step 1) and heads of fc2's inputs (from step 3; fc1's
    # rows are the heads' outputs) on the same layers
    "row_sparse_head": ({
        "sparse_pruning": technique({"method": "l1", "schedule_offset": 1},
                                    g=group({"dense_ratio": 0.5}, ["fc1"])),
        "row_pruning": _row_l1(2),
        "head_pruning": technique({"method": "topk", "schedule_offset": 3, "num_heads": 4},
                                  g=group({"dense_ratio": 0.5}, ["fc2"], [["fc1"]]))}, False),
    "row_sparse_ties": ({
        "sparse_pruning": technique({"method": "l1", "schedule_offset": 1},
                                    g=group({"dense_ratio": 0.5}, ["fc1"])),
        "row_pruning": _row_l1(2)}, True),
}


def engine_model(case):
    """The engine case's model, from a fixed seed."""
    model = fresh(MLP3)
    if ENGINE_CASES[case][1]:
        with torch.no_grad():
            for layer in (model.fc1, model.fc2):
                layer.weight.mul_(16).round_().div_(16)
    return model


def engine_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)


def engine_config(case, stage):
    return {"train_batch_size": 16, "steps_per_print": 1000, "optimizer": ENGINE_OPTIMIZER,
            "zero_optimization": {"stage": stage},
            # a copy: DeepSpeed's config parser adds the sections it did not find to the dict
            "compression_training": copy.deepcopy(ENGINE_CASES[case][0])}


def engine_train(engine, x, y):
    """ENGINE_STEPS steps of cross-entropy through the engine; returns the losses."""
    losses = []
    for _ in range(ENGINE_STEPS):
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
