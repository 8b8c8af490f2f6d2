"""One case of scripts/diff_compression.py: the training script both engines run. `rt` is
`deepspeed` (DeepSpeed 0.17.6, in its own environment) or `dslaunch.runtime`, and
`compress` its `init_compression` / `redundancy_clean` module; nothing else differs. Needs
only torch, so it runs unchanged under either Python.

What a run returns: the loss of every step, the learnt scores right after init_compression
(topk methods draw them at random: DeepSpeed's are recorded and our side loads them), and
after redundancy_clean the weights and biases of every layer (names, shapes, values). A
refusal is {"error": "Type: first line", "lines": how many lines the message has}.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import torch
from torch import nn

from compression_nets import CNN, Stack
from diff_compression_cases import STEPS, CompCase

BATCH = 8
OPTIMIZER = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}
# DeepSpeed 0.17.6's names of the learnt scores, and the kind of our technique that holds them
SCORES = {"sparse_mask_scores": "sparse", "row_mask_scores": "row", "head_pruning_scores": "head",
          "channel_mask_scores": "channel"}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build_model(case: CompCase, teacher: bool = False) -> nn.Module:
    """The model (the stack's teacher: 4 layers, another seed), its weights from a generator by
    sorted parameter name (batch norm: 1 and 0)."""
    if case.model == "stack":
        model = Stack(4 if teacher else case.student)
    else:
        model = MLP() if case.model == "mlp" else CNN()
    g = torch.Generator().manual_seed(1 if teacher else 0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.startswith("bn1."):
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def data(case: CompCase):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 8, generator=g) if case.model != "cnn" else torch.randn(BATCH, 3, 6, 6, generator=g)
    return x, torch.randn(BATCH, 4, generator=g)


def _technique(shared: dict, modules: List[str], params: dict, related=None) -> dict:
    group = {"params": params, "modules": modules}
    if related is not None:
        group["related_modules"] = related
    return {"shared_parameters": dict(shared, enabled=True), "different_groups": {"g1": group}}


def compression_section(case: CompCase) -> dict:
    mlp, stack = case.model == "mlp", case.model == "stack"
    out = {}
    if case.reduce != "none":
        out["layer_reduction"] = {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "layers",
                                  "teacher_layer": [int(t) for t in case.reduce.split(",")],
                                  "other_module_name": ["emb", "head"]}
    if case.sparse != "none":
        first, every = {"mlp": ("fc1", "fc"), "cnn": ("conv1", "conv"), "stack": ("layers.0", "layers.")}[case.model]
        out["sparse_pruning"] = _technique(
            {"method": case.sparse, "schedule_offset": case.sparse_at},
            [every if case.sparse_all else first], {"dense_ratio": case.sparse_ratio})
    if case.row != "none":
        out["row_pruning"] = _technique({"method": case.row, "schedule_offset": case.row_at}, ["fc2"],
                                        {"dense_ratio": case.row_ratio}, [["fc3"]] if case.row_rel else None)
    if case.head != "none":
        out["head_pruning"] = _technique({"method": case.head, "schedule_offset": case.head_at, "num_heads": 4},
                                         ["fc2"], {"dense_ratio": case.head_ratio},
                                         [["fc1"]] if case.head_rel else None)
    if case.channel != "none":
        out["channel_pruning"] = _technique({"method": case.channel, "schedule_offset": case.channel_at}, ["conv1"],
                                            {"dense_ratio": case.channel_ratio},
                                            [["bn1", "conv2"]] if case.channel_rel else None)
    if case.wq != "none":
        out["weight_quantization"] = _technique(
            {"quantize_weight_in_forward": True, "schedule_offset": case.wq_at, "quantize_groups": case.wq_groups,
             "quantization_type": "symmetric" if case.wq == "sym" else "asymmetric"},
            ["emb", "head"] if stack else ["fc"] if mlp or not case.wq_conv else ["conv", "fc"],
            {"start_bits": case.wq_start or case.wq_bits, "target_bits": case.wq_bits, "quantization_period": 1})
    if case.aq != "none":
        out["activation_quantization"] = _technique(
            {"quantization_type": "symmetric" if case.aq == "sym" else "asymmetric",
             "range_calibration": "static" if case.aq_static else "dynamic", "schedule_offset": case.aq_at},
            ["fc2", "fc3"] if mlp else ["layers.1", "head"] if stack else ["conv2", "fc"], {"bits": case.aq_bits})
    return out


def config(case: CompCase) -> dict:
    return {"train_batch_size": BATCH, "steps_per_print": 10 ** 6, "gradient_clipping": case.clip, "optimizer": copy.deepcopy(OPTIMIZER),
            "zero_optimization": {"stage": case.stage}, "compression_training": compression_section(case)}


def _scores(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] in SCORES}


def _load_scores(model: nn.Module, scores: Dict[str, torch.Tensor]) -> None:
    """DeepSpeed's learnt scores (drawn at random by its init_compression) into ours."""
    from dslaunch.runtime.compression import compression_schedule

    parts = {(p.target.name, getattr(p.technique, "kind", None)): p.technique
             for p in compression_schedule(model).parts}
    with torch.no_grad():
        for key, value in scores.items():
            module, _, name = key.rpartition(".")
            parts[(module, SCORES[name])].scores.copy_(value.reshape(parts[(module, SCORES[name])].scores.shape))


def run_case(rt, compress, case: CompCase, scores=None) -> dict:
    """The case under `rt`; `scores`: DeepSpeed's learnt scores to load (our side)."""
    cfg = config(case)
    model = build_model(case)
    torch.manual_seed(0)  # topk methods draw their scores at init_compression
    teacher = build_model(case, teacher=True) if case.model == "stack" else None
    compress.init_compression(model, cfg, teacher_model=teacher)
    if scores:
        _load_scores(model, scores)
    drawn = _scores(model)
    engine, *_ = rt.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                               config=cfg)
    if rt.__name__ == "deepspeed":
        # DeepSpeed 0.17.6's scheduler compares the step with schedule_offset_end for sparse pruning,
        # a key its config parser fills for snip_momentum only (a KeyError at the first step): the
        # documented default, schedule_offset, is what a user would write to get past it
        from deepspeed.compression.constants import SHARED_PARAMETERS, SPARSE_PRUNING

        methods = engine.compression_scheduler.different_compression_methods
        if SPARSE_PRUNING in methods:
            shared = methods[SPARSE_PRUNING][SHARED_PARAMETERS]
            shared.setdefault("schedule_offset_end", shared.get("schedule_offset"))
    x, y = data(case)
    losses = []
    try:
        for _ in range(STEPS):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        compress.redundancy_clean(model, config(case))
    finally:
        engine.destroy()
    weights, shapes = {}, {}
    for name, value in model.state_dict().items():
        if name.rsplit(".", 1)[-1] in ("weight", "bias"):
            weights[name] = value.detach().float().reshape(-1).clone()
            shapes[name] = list(value.shape)
    return {"losses": losses, "scores": drawn, "weights": weights, "shapes": shapes}
