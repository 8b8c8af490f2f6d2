"""The cases scripts/make_ds_dszero_fixtures.py runs with DeepSpeed 0.19.8 and
tests/compat/test_ds_unit_paths.py replays with dslaunch: the precision sections' models, the
leaf_module section and the leaf-marking calls, TiledLinear, and ignore_unused_parameters.
Plain data and a tiny model class: importable beside either package."""
from __future__ import annotations

import torch

# DeepSpeedFP16Config(**kwargs): accepted (its loss_scale, loss_scale_window and min_loss_scale
# read back) or refused (a ValidationError in both)
FP16_CASES = {
    "default": {},
    "dynamic_window_0": {"enabled": True, "loss_scale": 0, "loss_scale_window": 0},
    "dynamic_min_neg": {"enabled": True, "loss_scale": 0, "min_loss_scale": -1},
    "dynamic_window_1000": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000},
    "static_window_0": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0},
    "static_min_neg": {"enabled": True, "loss_scale": 128, "min_loss_scale": -1},
    "disabled_min_0": {"enabled": False, "loss_scale": 0, "min_loss_scale": 0},
    "window_bool": {"enabled": True, "loss_scale": 0, "loss_scale_window": True},
    "min_none": {"enabled": True, "loss_scale": 0, "min_loss_scale": None},
    "min_text": {"enabled": True, "loss_scale": 0, "min_loss_scale": "abc"},
    "loss_scale_neg": {"loss_scale": -1},
    "loss_scale_bool": {"loss_scale": True},
    "loss_scale_float": {"loss_scale": 2.0},
    "loss_scale_list": {"loss_scale": []},
}

# DeepSpeedZeroConfig(leaf_module=...): the parsed classes / names / name_suffixes, or refused
LEAF_CONFIG_CASES = {
    "absent": None,
    "custom": {"classes": ["custom.module.CustomClass"], "names": ["transformer.layer"], "name_suffixes": ["experts"]},
    "strings": {"classes": "my.Class", "names": "submodule", "name_suffixes": "tail"},
    "duplicates": {"names": ["a", "b", "a"]},
}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block()
        self.second = Block()
        self.head = torch.nn.Linear(2, 2)


# (call, argument): set_z3_leaf_modules_by_name / _by_suffix with raise_if_not_found False, and
# set_z3_leaf_modules by plain and module-qualified class name: the names of the marked modules
# and the missing ones
LEAF_CALL_CASES = {
    "by_name": ("by_name", ["first", "second.inner", "nope"]),
    "by_suffix": ("by_suffix", ["experts", "inner", "zzz"]),
    "by_suffix_overlap": ("by_suffix", ["experts", "s"]),
    "class_plain": ("classes", ["Block"]),
    "class_qualified": ("classes", [f"{__name__}.Block"]),
}

# TiledLinear(in, out, bias, in_splits, out_splits) from a seeded nn.Linear(in, out, bias)
TILED_CASES = {
    "1x1": (8, 6, True, 1, 1),
    "2x3_bias": (23, 29, True, 2, 3),
    "3x2_nobias": (29, 23, False, 3, 2),
    "5x5": (32, 40, True, 5, 5),
}
TILED_BAD = {"zero": (32, 32, 0, 0), "too_many": (32, 32, 33, 33)}


class TwoHeads(torch.nn.Module):
    """A linear whose second layer is never used in forward (ignore_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).pow(2).mean()


# zero_optimization for the ignore_unused_parameters runs (one step, world size 1)
UNUSED_CASES = {
    "s2_offload_false": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "ignore_unused_parameters": False},
    "s2_offload_true": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "ignore_unused_parameters": True},
    "s1_offload_false": {"stage": 1, "offload_optimizer": {"device": "cpu"}, "ignore_unused_parameters": False},
    "s2_false": {"stage": 2, "ignore_unused_parameters": False},
    "s2_contiguous_false": {"stage": 2, "contiguous_gradients": False},
}


class FineBlock(torch.nn.Module):
    def __init__(self, hidden, n):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class FineModel(torch.nn.Module):
    """Two coarse linears and a block of small ones (DeepSpeed's granularity test, tiny)."""

    def __init__(self, hidden=8, n=4):
        super().__init__()
        self.coarse1 = torch.nn.Linear(hidden, 4 * hidden)
        self.coarse2 = torch.nn.Linear(4 * hidden, hidden)
        self.fine = FineBlock(hidden, n)

    def forward(self, x):
        return self.fine(self.coarse2(self.coarse1(x))).pow(2).mean()


# stage3_module_granularity_threshold values: the modules marked as leaves, and the losses of
# three steps (the same as without a threshold)
GRANULARITY_THRESHOLDS = [0, 40, 100, 10_000_000]


# -- the runs both sides make, given the package (`deepspeed` or `dslaunch.runtime`) ------------
def leaf_call(utils, kind, arg, is_leaf):
    """One LEAF_CALL_CASES call on a fresh Net with `utils`' marking functions; `is_leaf` reads
    a module's mark (each package keeps its own)."""
    model = Net()
    names = {id(m): n for n, m in model.named_modules()}
    if kind == "by_name":
        found, missing = utils.set_z3_leaf_modules_by_name(model, arg, raise_if_not_found=False)
    elif kind == "by_suffix":
        found, missing = utils.set_z3_leaf_modules_by_suffix(model, arg, raise_if_not_found=False)
    else:
        found, missing = utils.set_z3_leaf_modules(model, arg, raise_if_not_found=False), []
    marked = sorted(n for n, m in model.named_modules() if is_leaf(m))
    return {"returned": [names[id(m)] for m in found], "missing": list(missing), "marked": marked}


def unused_engine(deepspeed, zero):
    """The one-step ignore_unused_parameters run: the engine, after its backward (the step is
    the caller's: that is where an unused parameter stops it)."""
    torch.manual_seed(0)
    model = TwoHeads()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.arange(8, dtype=torch.float32).view(2, 4) / 8
    engine.backward(engine(x))
    return engine


def granularity_run(deepspeed, threshold, is_leaf, input_grad=True):
    """Three stage-3 steps of FineModel under stage3_module_granularity_threshold: the modules
    marked as leaves and the losses. DeepSpeed's leaves need an input that requires a gradient
    (`input_grad`)."""
    torch.manual_seed(0)
    model = FineModel()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_module_granularity_threshold": threshold}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    marked = sorted(n for n, m in model.named_modules() if is_leaf(m))
    losses = []
    for step in range(3):
        x = (torch.arange(16, dtype=torch.float32).view(2, 8) / (8 + step)).requires_grad_(input_grad)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return {"marked": marked, "losses": losses}
