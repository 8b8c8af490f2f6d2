"""The numbers of `optimizer.params` and `scheduler.params`, checked where the config is read.

Both sections are free-form (each optimizer and schedule takes its own arguments), so the
schema's types cannot check them. Left alone, Python's JSON reader hands on NaN, Infinity
and -Infinity, a quoted "0.01" reaches the optimizer's kernel as a string, and `true`
counts as 1: an lr of NaN makes every weight non-finite after one step without a word, and
a negative lr or a beta of 1.5 fails inside the optimizer with a traceback. So every
argument of every optimizer and schedule built by name has a rule here (tests/runtime/core/test_config_numbers.py
holds the table to the builders' signatures), and a value that breaks it is one line
naming the key: `optimizer.params.lr: must be finite, got NaN`.

DeepSpeed 0.19.8 refuses NaN and Infinity in a config file only because its reader (hjson)
cannot parse them, and accepts a negative lr, betas outside [0, 1) and a boolean lr; the
checks here are stricter on purpose.

Pure logic: no torch.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..strict import ConfigError

_MAX_FLOAT = sys.float_info.max


def _shown(value) -> str:
    try:
        return json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        return repr(value)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Num:
    """A real number (a whole one with `whole`), finite, within the bounds given."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False  # must be > low (else >= low)
    high_open: bool = False  # must be < high (else <= high)
    whole: bool = False
    optional: bool = False  # null (None) accepted: the argument's default

    def kind(self) -> str:
        return "a whole number" if self.whole else "a number"

    def bounds(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts)

    def __call__(self, where: str, value) -> None:
        if value is None and self.optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = " (a string: write the number without quotes)" if isinstance(value, str) and \
                _looks_numeric(value) else ""
            raise ConfigError(f"{where}: expected {self.kind()}, got {_shown(value)}{hint}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite, got {_shown(value)}")
        if isinstance(value, int) and abs(value) > _MAX_FLOAT:
            raise ConfigError(f"{where}: {value} is out of range")
        if self.whole and not isinstance(value, int):
            raise ConfigError(f"{where}: expected a whole number, got {_shown(value)}")
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)) or \
                self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            raise ConfigError(f"{where}: must be {self.bounds()}, got {_shown(value)}")


@dataclass(frozen=True)
class Flag:
    """true or false (null too with `optional`)."""

    optional: bool = False

    def __call__(self, where: str, value) -> None:
        if isinstance(value, bool) or (value is None and self.optional):
            return
        raise ConfigError(f"{where}: expected true or false, got {_shown(value)}")


@dataclass(frozen=True)
class Pair:
    """A list of two values, each with its own rule (betas, etas, step sizes)."""

    first: Any
    second: Any
    optional: bool = False  # null (None) accepted: the argument's default

    def __call__(self, where: str, value) -> None:
        if value is None and self.optional:
            return
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"{where}: expected a list of 2 numbers, got {_shown(value)}")
        self.first(f"{where}[0]", value[0])
        self.second(f"{where}[1]", value[1])


@dataclass(frozen=True)
class PerGroup:
    """A number, or a list of them with one per parameter group (the schedules' bounds)."""

    item: Num

    def __call__(self, where: str, value) -> None:
        if value is None and self.item.optional:
            return
        if isinstance(value, (list, tuple)):
            if not value:
                raise ConfigError(f"{where}: expected a number or one per parameter group, got []")
            for i, v in enumerate(value):
                self.item(f"{where}[{i}]", v)
            return
        self.item(where, value)


@dataclass(frozen=True)
class OneOf:
    """One of a few strings."""

    choices: Tuple[str, ...]
    optional: bool = False  # null (None) accepted: the argument's default

    def __call__(self, where: str, value) -> None:
        if value is None and self.optional:
            return
        if value not in self.choices:
            raise ConfigError(f"{where}: must be one of {', '.join(json.dumps(c) for c in self.choices)}, "
                              f"got {_shown(value)}")


NON_NEGATIVE = Num(low=0)
FINITE = Num()
BETA = Num(low=0, high=1, high_open=True)  # a moving-average decay: 1 would never move
FLAG = Flag()

# Every argument of the optimizers built by name (runtime/optim.py: DeepSpeed's and torch.optim's).
OPTIMIZER_PARAMS: Dict[str, Any] = {
    "lr": NON_NEGATIVE,
    "weight_decay": Num(low=0, optional=True),  # null: the class's own default (Adam with torch_adam)
    "eps": NON_NEGATIVE,
    "betas": Pair(BETA, BETA),
    "momentum": NON_NEGATIVE,  # SGD, RMSprop
    "dampening": FINITE,  # SGD
    "alpha": NON_NEGATIVE,  # RMSprop's smoothing constant, ASGD's power
    "centered": FLAG,
    "nesterov": FLAG,
    "lr_decay": NON_NEGATIVE,  # Adagrad
    "initial_accumulator_value": NON_NEGATIVE,
    "rho": Num(low=0, high=1),  # Adadelta
    "momentum_decay": NON_NEGATIVE,  # NAdam
    "lambd": NON_NEGATIVE,  # ASGD
    "t0": NON_NEGATIVE,
    "etas": Pair(Num(low=0, high=1, low_open=True, high_open=True), Num(low=1, low_open=True)),  # Rprop
    "step_sizes": Pair(NON_NEGATIVE, NON_NEGATIVE),
    "beta2_decay": Num(high=0),  # Adafactor
    "d": Num(low=1),
    "max_coeff": NON_NEGATIVE,  # Lamb's trust-ratio clamp
    "min_coeff": NON_NEGATIVE,
    "eps_inside_sqrt": FLAG,
    "adam_w_mode": FLAG,
    "adamw_mode": FLAG,
    "bias_correction": FLAG,
    "amsgrad": FLAG,
    "torch_adam": FLAG,
    "fp32_optimizer_states": FLAG,
    "set_grad_none": FLAG,
    "decoupled_weight_decay": FLAG,
    "maximize": FLAG,
    "capturable": FLAG,
    "differentiable": FLAG,
    "foreach": Flag(optional=True),
    "fused": Flag(optional=True),
}
# where one optimizer reads an argument of the same name differently
OPTIMIZER_OVERRIDES: Dict[str, Dict[str, Any]] = {
    # torch's Adafactor: (eps1 or null for the dtype's own, eps2)
    "adafactor": {"eps": Pair(Num(low=0, optional=True), NON_NEGATIVE)},
    # Muon (DeepSpeed's MuonWithAuxAdam): null is "not given", each half's DeepSpeed default
    "muon": {"lr": Num(low=0, optional=True), "muon_lr": Num(low=0, optional=True),
             "adam_lr": Num(low=0, optional=True), "momentum": Num(low=0, optional=True),
             "eps": Num(low=0, optional=True), "betas": Pair(BETA, BETA, optional=True),
             "ns_method": OneOf(("gram", "standard"), optional=True), "per_head_muon": FLAG},
}

LR = PerGroup(NON_NEGATIVE)
STEPS = Num(low=0, whole=True)
# Every argument of the schedules built by name (runtime/lr_schedules.py).
SCHEDULER_PARAMS: Dict[str, Any] = {
    "warmup_min_lr": LR,
    "warmup_max_lr": PerGroup(Num(low=0, optional=True)),
    "warmup_num_steps": STEPS,
    "warmup_type": OneOf(("log", "linear")),
    "warmup_min_ratio": Num(low=0, high=1),
    "cos_min_ratio": Num(low=0, high=1),
    "total_num_steps": STEPS,
    "last_batch_iteration": Num(low=-1, whole=True),
    "cycle_min_lr": LR,
    "cycle_max_lr": LR,
    "decay_lr_rate": NON_NEGATIVE,
    "cycle_first_step_size": Num(low=0, low_open=True),
    "cycle_second_step_size": Num(low=0, optional=True),
    "cycle_first_stair_count": STEPS,
    "cycle_second_stair_count": Num(low=0, whole=True, optional=True),
    "decay_step_size": NON_NEGATIVE,
    "cycle_momentum": FLAG,
    "cycle_min_mom": PerGroup(BETA),  # the momentum becomes the first beta
    "cycle_max_mom": PerGroup(BETA),
    "decay_mom_rate": NON_NEGATIVE,
    "lr_range_test_min_lr": LR,
    "lr_range_test_step_size": Num(low=1, whole=True),
    "lr_range_test_step_rate": NON_NEGATIVE,
    "lr_range_test_staircase": FLAG,
}


def optimizer_rules(type_name: str) -> Dict[str, Any]:
    return {**OPTIMIZER_PARAMS, **OPTIMIZER_OVERRIDES.get(str(type_name).lower(), {})}


def check_optimizer_params(path: str, type_name: str, params: Dict[str, Any]) -> None:
    """Each known argument against its rule; a name no optimizer takes is left to the builder,
    which names the optimizer's own arguments in its error."""
    rules = optimizer_rules(type_name)
    for key, value in params.items():
        rule = rules.get(key)
        if rule is not None:
            rule(f"{path}.params.{key}", value)


def check_scheduler_params(path: str, params: Dict[str, Any]) -> None:
    for key, value in params.items():
        rule = SCHEDULER_PARAMS.get(key)
        if rule is not None:
            rule(f"{path}.params.{key}", value)
