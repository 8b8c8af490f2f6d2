"""DeepSpeed's LR schedules by name: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Each schedule is a pure function of the step count (`lr_at(step)`), wrapped in a small
stateful object with the torch scheduler surface the engine and users touch: step(),
get_lr(), get_last_lr(), state_dict(), load_state_dict(). The engine steps the schedule
once per optimizer step (and not on a skipped fp16 step).

Counting follows DeepSpeed's: a new schedule stands at `last_batch_iteration == -1`
(the lr before any step: warmup_min_lr, or ratio 0 for WarmupCosineLR), and the first
optimizer step is taken with that lr; the engine's first scheduler step then moves it to
iteration 0. So a DeepSpeed script sees the same lr at every step, and a scheduler state
saved by DeepSpeed resumes here at the same point.
"""
from __future__ import annotations

import inspect
import math
from typing import Dict, List, Type

import torch

from ..core.strict import ConfigError, suggest


def _per_group(optimizer, value, name: str) -> List[float]:
    """A scalar for every param group, or a list with one value per group (DeepSpeed's
    "float or list" parameters)."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"scheduler.params.{name}: expected {groups} values (one per param group), "
                              f"got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * groups


def _set_lr(group: Dict, lr: float) -> None:
    """A tensor lr (torch optimizers accept one) is filled in place, so a caller holding it
    sees the schedule, as DeepSpeed's update_lr does; a number is replaced."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def _warmup_steps(value) -> int:
    """DeepSpeed 0.19.8 refuses 0 too; it stays accepted here (as DeepSpeed before 0.19.8, a
    warmup of at most 2 steps) because the Hugging Face Trainer fills "auto" with 0 when no
    warmup is asked for."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"scheduler.params.warmup_num_steps: must be a whole number of steps, got {value!r}")
    return value


def _warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    if step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


class _Schedule:
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.last_batch_iteration = -1
        self._apply()

    def lr_at(self, step: int, group_index: int) -> float:
        raise NotImplementedError

    def _apply(self) -> None:
        self._last_lr = []
        for i, group in enumerate(self.optimizer.param_groups):
            lr = self.lr_at(self.last_batch_iteration, i)
            _set_lr(group, lr)
            self._last_lr.append(lr)

    def step(self, last_batch_iteration=None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._apply()

    def get_lr(self) -> List[float]:
        return list(self._last_lr)

    def get_last_lr(self) -> List[float]:
        return list(self._last_lr)

    def state_dict(self) -> Dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in ("log", "linear"):
        raise ConfigError(f"scheduler.params.warmup_type: must be \"log\" or \"linear\", got {warmup_type!r}")
    return warmup_type


class WarmupLR(_Schedule):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps (log or linear), then flat. Each
    bound is a number or one per param group; warmup_max_lr defaults to each group's own lr
    (as DeepSpeed 0.19)."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _warmup_steps(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(optimizer)
        if last_batch_iteration >= 0:
            self.step(last_batch_iteration)

    def gamma(self, step: int) -> float:
        return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)

    def lr_at(self, step: int, group_index: int) -> float:
        if step < 0:
            return self.min_lrs[group_index]  # before the first step
        return self.min_lrs[group_index] + self.delta_lrs[group_index] * self.gamma(step)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = int(total_num_steps)
        if isinstance(warmup_num_steps, int) and self.total_num_steps < warmup_num_steps:
            raise ConfigError(f"scheduler.params.total_num_steps: {total_num_steps} is less than "
                              f"warmup_num_steps {warmup_num_steps}")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return super().gamma(step)
        span = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - step) / span)


class WarmupCosineLR(_Schedule):
    """Ratios of each group's initial lr: warmup from warmup_min_ratio to 1, then cosine to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.warmup_num_steps = max(2, _warmup_steps(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        for g, lr in zip(optimizer.param_groups, self.base_lrs):
            g.setdefault("initial_lr", lr)
        super().__init__(optimizer)
        if last_batch_iteration >= 0:
            self.step(last_batch_iteration)

    def ratio(self, step: int) -> float:
        if step < 0:
            return 0.0  # before the first step, as DeepSpeed's WarmupCosineLR
        if step < self.warmup_num_steps:
            g = _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * g
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / span)  # DeepSpeed counts the decay from 1
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr_at(self, step: int, group_index: int) -> float:
        return self.base_lrs[group_index] * self.ratio(step)

    def get_lr_ratio(self) -> float:
        """The ratio of each group's initial lr in effect now (DeepSpeed's name)."""
        return self.ratio(self.last_batch_iteration)


class OneCycle(_Schedule):
    """Linear rise cycle_min_lr -> cycle_max_lr over cycle_first_step_size steps, fall back over
    cycle_second_step_size, then decay (decay_lr_rate per decay_step_size steps); momentum
    cycles inversely. A stair count holds lr and momentum flat on that many stairs across its
    half of the cycle (0: continuous). Bounds are a number or one per param group.
    Unlike DeepSpeed's, cycling the momentum keeps each group's second beta (DeepSpeed's
    OneCycle sets it to 0.99) and starts from cycle_max_mom (DeepSpeed's from cycle_min_mom
    for the first step only)."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count=None, decay_step_size=0, cycle_momentum: bool = True,
                 cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_lr_rate, self.decay_mom_rate = float(decay_lr_rate), float(decay_mom_rate)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size) if cycle_second_step_size is not None
                                 else self.first_step_size)
        if not self.first_step_size > 0:
            raise ConfigError("scheduler.params.cycle_first_step_size: must be positive, got "
                              f"{cycle_first_step_size!r}")
        if not self.second_step_size >= 0:
            raise ConfigError("scheduler.params.cycle_second_step_size: must be 0 or more, got "
                              f"{cycle_second_step_size!r}")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = self._stairs("cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else self._stairs("cycle_second_stair_count", cycle_second_stair_count))
        self.decay_step_size = float(decay_step_size)
        if self.decay_step_size < 0:
            raise ConfigError(f"scheduler.params.decay_step_size: must be 0 (no decay) or more, got {decay_step_size!r}")
        self.cycle_momentum = cycle_momentum
        super().__init__(optimizer)
        if last_batch_iteration >= 0:
            self.step(last_batch_iteration)

    @staticmethod
    def _stairs(name: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"scheduler.params.{name}: must be a whole number of stairs (0: continuous), "
                              f"got {value!r}")
        return value

    def _phase(self, step: int):
        """(fraction of the way from min to max, decay intervals after the cycle). DeepSpeed's
        OneCycle places iteration k at point k + 1 of the cycle; the cycle's last point is its
        start again. A stair count floors the fraction to its stairs, from the whole-step
        position (not from the fraction, which may land a rounding error under a stair)."""
        at = step + 1
        if at > self.total_size:
            after = at - self.total_size
            return 0.0, (after / self.decay_step_size if self.decay_step_size else 0.0)
        if at == self.total_size:
            return 0.0, 0.0
        if at <= self.first_step_size:
            pos, size, stairs = at, self.first_step_size, self.first_stair_count
        else:
            pos, size, stairs = self.total_size - at, self.second_step_size, self.second_stair_count
        if stairs:
            return math.floor(pos * stairs / size) / stairs, 0.0
        return pos / size, 0.0

    def lr_at(self, step: int, group_index: int) -> float:
        frac, decay = self._phase(step)
        lo, hi = self.min_lrs[group_index], self.max_lrs[group_index]
        if decay:
            return lo / (1.0 + self.decay_lr_rate * decay)
        return lo + (hi - lo) * frac

    def mom_at(self, step: int, group_index: int = 0) -> float:
        frac, decay = self._phase(step)
        lo, hi = self.min_moms[group_index], self.max_moms[group_index]
        if decay:
            return hi * (1.0 + self.decay_mom_rate * decay)
        return hi - (hi - lo) * frac

    def get_mom(self):
        """DeepSpeed's reading of the momentum now: (first beta, second beta) per param group
        (the second as the group keeps it; None for a group with a plain momentum), or None
        when the momentum does not cycle."""
        if not self.cycle_momentum:
            return None
        return [(self.mom_at(self.last_batch_iteration, i), group["betas"][1] if "betas" in group else None)
                for i, group in enumerate(self.optimizer.param_groups)]

    def _apply(self) -> None:
        super()._apply()
        if not self.cycle_momentum:
            return
        for i, group in enumerate(self.optimizer.param_groups):
            mom = self.mom_at(self.last_batch_iteration, i)
            if "betas" in group:
                group["betas"] = (mom, group["betas"][1])
            elif "momentum" in group:
                group["momentum"] = mom


class LRRangeTest(_Schedule):
    """The learning-rate range test: lr grows from lr_range_test_min_lr by step_rate per
    step_size steps, continuously or in stairs (lr = min_lr * (1 + rate * interval), the
    interval counting from the first step, as DeepSpeed's)."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        groups = len(optimizer.param_groups)
        if isinstance(lr_range_test_min_lr, (list, tuple)):
            if len(lr_range_test_min_lr) != groups:
                raise ConfigError(f"scheduler.params.lr_range_test_min_lr: expected {groups} values (one per param "
                                  f"group), got {len(lr_range_test_min_lr)}")
            self.min_lr = [float(x) for x in lr_range_test_min_lr]
        else:
            self.min_lr = [float(lr_range_test_min_lr)] * groups
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int) \
                or lr_range_test_step_size <= 0:
            raise ConfigError("scheduler.params.lr_range_test_step_size: must be a positive integer, got "
                              f"{lr_range_test_step_size!r}")
        self.step_size, self.step_rate = lr_range_test_step_size, float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer)
        if last_batch_iteration >= 0:
            self.step(last_batch_iteration)

    def lr_at(self, step: int, group_index: int) -> float:
        interval = (step + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return self.min_lr[group_index] * (1 + self.step_rate * interval)


SCHEDULES: Dict[str, Type[_Schedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest}
# DeepSpeed's names for the schedule types and their parameters (scripts and DeepSpeed's own
# tests build scheduler sections with them).
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

# DeepSpeed's name for the list; Accelerate tests `type(scheduler).__name__ in VALID_LR_SCHEDULES`.
VALID_LR_SCHEDULES = list(SCHEDULES)


def build_scheduler(sched_cfg, optimizer):
    cls = SCHEDULES.get(sched_cfg.type)
    if cls is None:
        raise ConfigError(f"scheduler.type: unknown scheduler {sched_cfg.type!r}{suggest(sched_cfg.type, SCHEDULES)} "
                          f"(known: {', '.join(SCHEDULES)})")
    check_params("scheduler", sched_cfg.type, cls.__init__, sched_cfg.params, skip=("self", "optimizer"))
    return cls(optimizer, **sched_cfg.params)


def check_params(section: str, name: str, fn, params: Dict, skip=("self", "params")) -> None:
    sig = inspect.signature(fn)
    accepted = [p for p in sig.parameters if p not in skip]
    for key in params:
        if key not in accepted:
            raise ConfigError(f"{section}.params.{key}: not a parameter of {name}{suggest(key, accepted)}")
    missing = [p.name for p in sig.parameters.values()
               if p.name not in skip and p.default is inspect.Parameter.empty and p.name not in params
               and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if missing:
        raise ConfigError(f"{section}.params: {name} needs {', '.join(missing)}")
