"""`init_inference` arguments: DeepSpeed's names, parsed strictly into one dataclass.

`init_inference(model, config=None, **kwargs)` takes a dict or a JSON/YAML path plus keyword
arguments, merged as DeepSpeed merges them (a key given both ways must agree). Every key
DeepSpeed's inference config knows is either implemented or refused with one line naming
it; refused keys are still accepted at DeepSpeed's default value, so a config written out
with defaults loads. Nothing is accepted and then ignored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ..core.strict import load_file, parse_dataclass, suggest
from ..tensor_parallel.plan import InferenceConfigError  # defined with the planner, which raises it most

# DeepSpeed's DtypeEnum spellings.
_DTYPE_NAMES = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    torch.int8: ("torch.int8", "int8"),
}
SUPPORTED_DTYPES = tuple(_DTYPE_NAMES)


def parse_dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES:
            return value
        raise InferenceConfigError(f"init_inference: dtype {value} is not supported; "
                                   "use torch.float, torch.half, torch.bfloat16 or torch.int8")
    if isinstance(value, str):
        for dtype, names in _DTYPE_NAMES.items():
            if value in names:
                return dtype
        names = [n for ns in _DTYPE_NAMES.values() for n in ns]
        raise InferenceConfigError(f"init_inference: dtype {value!r} is not supported{suggest(value, names)} "
                                   "(fp32, fp16, bf16 or int8)")
    raise InferenceConfigError(f"init_inference: dtype must be a torch.dtype or a name like 'fp16', "
                               f"got {type(value).__name__}")


@dataclass
class TensorParallelConfig:
    """DeepSpeed's `tensor_parallel` section."""

    enabled: bool = True
    tp_size: int = 1
    tp_grain_size: int = 64
    mpu: Any = None  # an object with get_model_parallel_group() (Megatron/DeepSpeed mpu)
    tp_group: Any = None  # a torch.distributed ProcessGroup

    def validate(self, path: str) -> None:
        if self.tp_size < 1:
            raise InferenceConfigError(f"{path}.tp_size: must be >= 1, got {self.tp_size}")
        if self.tp_grain_size != 64:
            # DeepSpeed uses it to cut uneven MLP shards; every shard here is even or refused.
            raise InferenceConfigError(f"{path}.tp_grain_size: uneven shards are not supported, so only the "
                                       f"default 64 is accepted (got {self.tp_grain_size})")


@dataclass
class WeightQuantConfig:
    enabled: bool = True
    num_bits: int = 8
    q_type: str = "symmetric"
    # Scale groups per output row of the unsharded weight (DeepSpeed's q_groups). None: one
    # scale per 64 input columns (fewer where a shard is narrower), see quantize.group_size_for.
    q_groups: Optional[int] = None
    quantized_initialization: Dict[str, Any] = field(default_factory=dict)
    post_init_quant: Dict[str, Any] = field(default_factory=dict)

    def validate(self, path: str) -> None:
        if self.num_bits != 8:
            raise InferenceConfigError(f"{path}.num_bits: only 8-bit weights are supported, got {self.num_bits}")
        if self.q_type != "symmetric":
            raise InferenceConfigError(f"{path}.q_type: only 'symmetric' is supported, got {self.q_type!r}")
        if self.q_groups is not None and self.q_groups < 1:
            raise InferenceConfigError(f"{path}.q_groups: must be >= 1, got {self.q_groups}")
        for key in ("quantized_initialization", "post_init_quant"):
            if getattr(self, key):
                raise InferenceConfigError(f"{path}.{key}: not supported (weights are quantized after sharding)")


@dataclass
class _OffByDefault:
    enabled: bool = False


@dataclass
class QuantConfig:
    """DeepSpeed's `quant` section: weight-only int8 (used with dtype=torch.int8)."""

    enabled: bool = True
    weight: WeightQuantConfig = field(default_factory=WeightQuantConfig)
    activation: _OffByDefault = field(default_factory=_OffByDefault)
    qkv: Dict[str, Any] = field(default_factory=dict)

    def validate(self, path: str) -> None:
        if self.activation.enabled:
            raise InferenceConfigError(f"{path}.activation.enabled: activation quantization is not supported "
                                       "(weight-only int8)")


# DeepSpeed keys we do not implement, with the default at which they are harmless.
_REFUSED_UNLESS_DEFAULT = {
    "enable_cuda_graph": False, "use_triton": False, "triton_autotune": False, "zero": {},
    "triangular_masking": True, "moe": {}, "keep_module_on_host": False, "set_empty_params": False,
    "save_mp_checkpoint_path": None, "checkpoint_config": {}, "return_tuple": True, "training_mp_size": 1,
    "replace_method": "auto", "config": None, "transposed_mode": False, "ep_size": 1, "ep_group": None,
    "ep_mp_group": None, "moe_experts": [1], "moe_type": "standard",
}
_ALIASES = {"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject", "injection_dict":
            "injection_policy", "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens",
            "ckpt_config": "checkpoint_config", "tm": "triangular_masking", "args": "config",
            "expert_group": "ep_group", "expert_mp_group": "ep_mp_group"}


@dataclass
class InferenceConfig:
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    dtype: torch.dtype = torch.float16  # DeepSpeed's default
    checkpoint: Optional[Any] = None  # a DeepSpeed checkpoint json (path or dict) or a state_dict path
    base_dir: str = ""
    injection_policy: Optional[Dict[Any, Tuple[str, ...]]] = None
    replace_with_kernel_inject: bool = False
    max_out_tokens: int = 1024
    min_out_tokens: int = 1
    quant: QuantConfig = field(default_factory=QuantConfig)
    # (mlp_extra_grouping, groups) from the older `quantization_setting` argument.
    mlp_extra_grouping: bool = False

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def int8(self) -> bool:
        return self.dtype == torch.int8


def _quantization_setting(value, cfg: InferenceConfig) -> None:
    """DeepSpeed's older argument: an int (groups) or a pair of a bool (MLP extra grouping) and an int."""
    if isinstance(value, bool) or not isinstance(value, (int, tuple, list)):
        raise InferenceConfigError("init_inference: quantization_setting must be a group count or "
                                   f"(mlp_extra_grouping, groups), got {value!r}")
    if isinstance(value, int):
        groups, extra = value, False
    else:
        bools = [v for v in value if isinstance(v, bool)]
        ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
        if len(value) != 2 or len(bools) != 1 or len(ints) != 1:
            raise InferenceConfigError("init_inference: quantization_setting must be (mlp_extra_grouping: bool, "
                                       f"groups: int), got {value!r}")
        groups, extra = ints[0], bools[0]
    if groups < 1:
        raise InferenceConfigError(f"init_inference: quantization_setting groups must be >= 1, got {groups}")
    cfg.quant.weight.q_groups = groups
    cfg.mlp_extra_grouping = extra


def _injection_policy(value) -> Dict[Any, Tuple[str, ...]]:
    if not isinstance(value, dict) or not value:
        raise InferenceConfigError("init_inference: injection_policy must map a block class to the names of its "
                                   f"row-parallel layers, e.g. {{T5Block: ('SelfAttention.o', ...)}}; got {value!r}")
    policy = {}
    for block, names in value.items():
        if not (isinstance(block, str) or (isinstance(block, type) and issubclass(block, torch.nn.Module))):
            raise InferenceConfigError(f"init_inference: injection_policy key {block!r} is not an nn.Module class")
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise InferenceConfigError(f"injection_policy[{getattr(block, '__name__', block)}]: expected module "
                                       f"names like 'attn.o_proj', got {value[block]!r}")
        policy[block] = names
    return policy


def parse_inference_config(config=None, kwargs: Optional[Dict[str, Any]] = None) -> InferenceConfig:
    """Merge `config` (dict or JSON/YAML path) with keyword arguments into an InferenceConfig."""
    if config is None:
        data: Dict[str, Any] = {}
    elif isinstance(config, str):
        data = load_file(config)
    elif isinstance(config, dict):
        data = dict(config)
    else:
        raise InferenceConfigError(f"init_inference: config must be a dict or a path, got {type(config).__name__}")
    for key, value in (kwargs or {}).items():
        if key in data and data[key] is not value and data[key] != value:
            raise InferenceConfigError(f"init_inference: {key} is {data[key]!r} in config but {value!r} "
                                       "as an argument")
        data[key] = value

    cfg = InferenceConfig()
    mp_size = None
    for key, value in data.items():
        name = _ALIASES.get(key, key)
        if name == "mp_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InferenceConfigError(f"init_inference: mp_size must be a positive int, got {value!r}")
            mp_size = value
        elif name == "mpu":
            cfg.tensor_parallel.mpu = value
        elif name == "tensor_parallel":
            if isinstance(value, TensorParallelConfig):
                cfg.tensor_parallel = value
            elif isinstance(value, dict):
                cfg.tensor_parallel = parse_dataclass(TensorParallelConfig, value, "tensor_parallel")
            else:
                raise InferenceConfigError(f"tensor_parallel: expected a dict like {{'tp_size': 2}}, got {value!r}")
        elif name == "dtype":
            cfg.dtype = parse_dtype(value)
        elif name == "checkpoint":
            if value is not None and not isinstance(value, (str, dict)) and not hasattr(value, "__fspath__"):
                raise InferenceConfigError(f"checkpoint: expected a path or a checkpoint json dict, got {value!r}")
            cfg.checkpoint = str(value) if hasattr(value, "__fspath__") else value
        elif name == "base_dir":
            if not isinstance(value, str):
                raise InferenceConfigError(f"base_dir: expected a path, got {value!r}")
            cfg.base_dir = value
        elif name == "injection_policy":
            cfg.injection_policy = None if value is None else _injection_policy(value)
        elif name == "injection_policy_tuple":
            if value is not None:
                raise InferenceConfigError("injection_policy_tuple: set injection_policy instead")
        elif name == "replace_with_kernel_inject":
            if not isinstance(value, bool):
                raise InferenceConfigError(f"replace_with_kernel_inject: expected true or false, got {value!r}")
            cfg.replace_with_kernel_inject = value
        elif name in ("max_out_tokens", "min_out_tokens"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InferenceConfigError(f"{name}: must be a positive int, got {value!r}")
            setattr(cfg, name, value)
        elif name == "quant":
            cfg.quant = value if isinstance(value, QuantConfig) else parse_dataclass(QuantConfig, value or {}, "quant")
        elif name == "quantization_setting":
            if value is not None:
                _quantization_setting(value, cfg)
        elif name in _REFUSED_UNLESS_DEFAULT:
            if value != _REFUSED_UNLESS_DEFAULT[name] and not (name == "moe" and value is False):
                raise InferenceConfigError(f"init_inference: {key}={value!r} is not supported by dslaunch "
                                           f"(only its default, {_REFUSED_UNLESS_DEFAULT[name]!r})")
        else:
            known = [f.name for f in dataclasses.fields(InferenceConfig)] + list(_ALIASES) + \
                list(_REFUSED_UNLESS_DEFAULT) + ["mp_size", "mpu", "quantization_setting"]
            raise InferenceConfigError(f"init_inference: unknown argument {key!r}{suggest(key, known)}")

    if mp_size is not None:
        if "tensor_parallel" in data or "tp" in data:
            if cfg.tensor_parallel.tp_size not in (1, mp_size):
                raise InferenceConfigError(f"init_inference: mp_size={mp_size} disagrees with "
                                           f"tensor_parallel.tp_size={cfg.tensor_parallel.tp_size}")
        cfg.tensor_parallel.tp_size = mp_size
    if cfg.max_out_tokens < cfg.min_out_tokens:
        raise InferenceConfigError(f"init_inference: max_out_tokens={cfg.max_out_tokens} is below "
                                   f"min_out_tokens={cfg.min_out_tokens}")
    if cfg.int8 and not cfg.quant.enabled:
        raise InferenceConfigError("init_inference: dtype=torch.int8 needs quant.enabled (weight-only int8)")
    return cfg
