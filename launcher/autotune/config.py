"""The `autotuning` section of a DeepSpeed config, parsed strictly and without torch.

Keys are DeepSpeed's, with DeepSpeed's defaults. A key this tuner does not honour is
refused with the reason rather than accepted and ignored; an unknown key is refused with
the nearest valid one.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional

from dslaunch.launcher.bounded_read import read_bounded
from dslaunch.launcher.errors import LaunchConfigError

CONFIG_FILE_LIMIT = 64 << 20  # as the runtime's config reader (runtime/strict.py)
METRICS = ("throughput", "latency")
TUNERS = ("gridsearch", "random", "model_based")
# DeepSpeed keys refused here: key -> why
REFUSED = {
    "metric_path": "written by dslaunch for each trial (results_dir/<exp>/metrics.json); remove it",
    "model_info_path": "the model profile is measured by dslaunch's first trial; remove it",
    "model_info": "the model profile is measured by dslaunch's first trial; remove it",
    "mp_size": "the tensor degree is tuned through tensor_parallel.autotp_size (AutoTP); remove it",
}


@dataclass
class AutotuningConfig:
    enabled: bool = True  # the section may be absent: --autotuning asks for it
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    metric: str = "throughput"
    start_profile_step: int = 3
    end_profile_step: int = 5
    fast: bool = True
    max_train_batch_size: Optional[int] = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    tuner_type: str = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    arg_mappings: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        def bad(key, why):
            raise LaunchConfigError(f"autotuning.{key}: {why}")

        if self.metric not in METRICS:
            why = "flops is not measured by dslaunch's trials" if self.metric == "flops" else "unknown metric"
            bad("metric", f"{self.metric!r}: {why}; use one of {', '.join(METRICS)}")
        if self.tuner_type not in TUNERS:
            bad("tuner_type", f"{self.tuner_type!r}: use one of {', '.join(TUNERS)}")
        if not 0 <= self.start_profile_step < self.end_profile_step:
            bad("end_profile_step", f"{self.end_profile_step} must be greater than start_profile_step "
                                    f"{self.start_profile_step} (0 or more): the steps between are measured")
        for key in ("tuner_early_stopping", "tuner_num_trials", "num_tuning_micro_batch_sizes",
                    "min_train_batch_size", "min_train_micro_batch_size_per_gpu",
                    "max_train_micro_batch_size_per_gpu"):
            if getattr(self, key) < 1:
                bad(key, f"must be 1 or more, got {getattr(self, key)}")
        if self.max_train_batch_size is not None and self.max_train_batch_size < self.min_train_batch_size:
            bad("max_train_batch_size", f"{self.max_train_batch_size} is below min_train_batch_size "
                                        f"{self.min_train_batch_size}")
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            bad("min_train_micro_batch_size_per_gpu", "is above max_train_micro_batch_size_per_gpu")
        for key, arg in self.arg_mappings.items():
            if not isinstance(arg, str) or not arg.startswith("-"):
                bad(f"arg_mappings.{key}", f"{arg!r} is not a script option (e.g. --per_device_train_batch_size)")

    @classmethod
    def from_dict(cls, section: Optional[Mapping[str, Any]]) -> "AutotuningConfig":
        section = dict(section or {})
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in section.items():
            if key in REFUSED:
                raise LaunchConfigError(f"autotuning.{key}: {REFUSED[key]}")
            if key not in known:
                near = difflib.get_close_matches(key, list(known), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise LaunchConfigError(f"autotuning.{key}: unknown key{hint}")
            kwargs[key] = _typed(key, value, known[key].type)
        return cls(**kwargs)


def _typed(key: str, value: Any, annotation: str) -> Any:
    want = {"bool": bool, "str": str, "int": int, "Optional[int]": (int, type(None)),
            "Dict[str, str]": dict}[annotation]
    ok = isinstance(value, want) and not (annotation != "bool" and isinstance(value, bool))
    if not ok:
        raise LaunchConfigError(f"autotuning.{key}: expected {annotation}, got {value!r}")
    return value


def _refuse_duplicates(pairs) -> Dict[str, Any]:
    """A JSON object whose keys are all different: DeepSpeed refuses a key given twice, and so
    does the runtime (runtime/strict.py), rather than keep the last one."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise LaunchConfigError(f"{key}: the key is given more than once; DeepSpeed refuses duplicate keys too: "
                                "keep one")
    return obj


def load_user_config(path: str) -> Dict[str, Any]:
    """The user's DeepSpeed config file as a dict (JSON, or YAML by its suffix)."""
    try:
        text = read_bounded(path, CONFIG_FILE_LIMIT, "config file", LaunchConfigError).decode("utf-8")
    except OSError as exc:
        raise LaunchConfigError(f"{path}: cannot read the DeepSpeed config: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise LaunchConfigError(f"{path}: config is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text, object_pairs_hook=_refuse_duplicates)
    except LaunchConfigError as exc:
        raise LaunchConfigError(f"{path}: {exc}") from None
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError: one line either way
        raise LaunchConfigError(f"{path}: not a valid config: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{path}: the config must be a mapping of keys to values")
    return data
