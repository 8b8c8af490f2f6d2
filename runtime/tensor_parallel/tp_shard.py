"""DeepSpeed's AutoTP shard sizes (`deepspeed.module_inject.tp_shard`): how many rows of a
dimension each tensor-parallel rank keeps when the split need not be even.

dslaunch's own training layers split evenly (shard.py); this module answers DeepSpeed's
sizing questions for scripts and checkpoint tools that ask them:

- a dimension made of kv heads (its size divides by the head count, and the layer is neither
  an MLP, an MoE expert projection nor the vocabulary head) is split by whole heads, the first
  `heads % tp` ranks taking one head more;
- anything else is split in grains of `tp_grain_size` rows, the first ranks taking one grain
  more, and the last rank also taking the tail that no whole grain covers (so the shards always
  tile the dimension); a dimension smaller than a grain is split row by row.

Two calling conventions are answered. DeepSpeed 0.19.8 passes the model's metadata, an
AutoTPMeta, as the third argument: `get_shard_size(total, tp, meta, name, rank, mp_group)`.
Earlier DeepSpeed (and the unit tests of its tree before 0.19.8) kept the head count and grain
in module settings (`set_num_kv_heads`, `set_tp_grain_size`) and passed the layer name third:
`get_shard_size(total, tp, name, rank, mp_group, num_kv_heads=None)`. The third argument's type
tells them apart; both give the same sizes for the same head count and grain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from ..core import comm as dist

# The module settings of the pre-0.19.8 convention (read by name: the setters rebind them).
num_kv_heads: Optional[int] = None
num_attention_heads: Optional[int] = None
n_embd: Optional[int] = None
tp_grain_size: int = 1

# Where a model config keeps its kv-head count, first match wins; the query-head names last
# (a model without grouped-query attention has as many kv heads as query heads).
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                 "num_attention_heads", "n_heads", "attention_heads")
ATTENTION_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
# Layers never split by heads: the vocabulary heads (exact names) and MLP / expert projections
# (substrings), which DeepSpeed splits near-evenly by grains.
_VOCAB_HEADS = ("lm_head", "embed_out")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _first(config: Any, names) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class AutoTPMeta:
    """One model's head counts and grain (DeepSpeed 0.19.8's per-model metadata)."""

    num_kv_heads: Optional[int] = None
    num_attention_heads: Optional[int] = None
    n_embd: Optional[int] = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config: Any, tp_grain_size: int = 1) -> "AutoTPMeta":
        """Read from a Hugging Face config (its text_config for a multimodal one); None gives
        an empty meta (plain grain splits)."""
        if model_config is None:
            return cls(tp_grain_size=tp_grain_size)
        text = getattr(model_config, "text_config", None)
        config = text if text is not None else model_config
        return cls(num_kv_heads=_first(config, KV_HEAD_ATTRS),
                   num_attention_heads=_first(config, ATTENTION_HEAD_ATTRS),
                   n_embd=_first(config, ("n_embd", "hidden_size")), tp_grain_size=tp_grain_size)


def set_num_kv_heads(num: Optional[int]) -> None:
    global num_kv_heads
    num_kv_heads = num


def set_num_attention_heads(num: Optional[int]) -> None:
    global num_attention_heads
    num_attention_heads = num


def set_n_embd(num: Optional[int]) -> None:
    global n_embd
    n_embd = num


def set_tp_grain_size(num: int) -> None:
    global tp_grain_size
    tp_grain_size = num


def get_num_kv_heads() -> Optional[int]:
    return num_kv_heads


def get_num_attention_heads() -> Optional[int]:
    return num_attention_heads


def get_n_embd() -> Optional[int]:
    return n_embd


def settings_meta() -> AutoTPMeta:
    """The module settings (pre-0.19.8 convention) as a meta, read now: a layer built without
    a meta freezes its split from this at construction."""
    return _settings_meta(None)


def _settings_meta(kv_heads: Optional[int]) -> AutoTPMeta:
    return AutoTPMeta(num_kv_heads=num_kv_heads if kv_heads is None else kv_heads,
                      num_attention_heads=num_attention_heads, n_embd=n_embd, tp_grain_size=tp_grain_size)


def _group_rank(mp_size: int, rank: Optional[int], mp_group: Any) -> int:
    if rank is not None:
        return rank
    if mp_group is not None:
        return dist.get_rank(group=mp_group)
    world = dist.get_world_size()
    if world != mp_size:
        # the global rank is not a rank of a smaller group: refuse to guess
        raise ValueError(f"get_shard_size requires a group-local rank or process group when mp_size ({mp_size}) "
                         f"differs from the distributed world size ({world}).")
    return dist.get_rank()


def shard_size(total_size: int, mp_size: int, meta: AutoTPMeta, name: Any, rank: int) -> int:
    """Rows of `total_size` that tensor-parallel rank `rank` of `mp_size` keeps."""
    heads = meta.num_kv_heads
    label = str(name)
    by_heads = heads is not None and total_size % heads == 0 and "mlp" not in label \
        and label not in _VOCAB_HEADS and not (name is not None and any(p in label for p in _MLP_PARTS))
    if by_heads:
        mine = heads // mp_size + (1 if rank < heads % mp_size else 0)
        return total_size * mine // heads
    grain = meta.tp_grain_size
    if total_size < grain:
        return total_size // mp_size + (1 if rank < total_size % mp_size else 0)
    grains, tail = divmod(total_size, grain)
    size = (grains // mp_size + (1 if rank < grains % mp_size else 0)) * grain
    return size + tail if rank == mp_size - 1 else size


_SIZE_ARGS = (("meta", "name", "rank", "mp_group"), ("name", "rank", "mp_group", "num_kv_heads"))
_LIST_ARGS = (("meta", "name"), ("name", "num_kv_heads"))


def bind_convention(what: str, conventions, args: tuple, kwargs: dict, fixed: int):
    """(whether the 0.19.8 convention was used, the arguments it names) for a helper that
    takes either calling convention (module docstring): the first names when the meta is
    given, else the second. `fixed` counts the leading arguments the helper binds itself, so
    the errors count positional arguments as Python would."""
    new = (args and isinstance(args[0], AutoTPMeta)) or isinstance(kwargs.get("meta"), AutoTPMeta)
    names = conventions[0] if new else conventions[1]
    if len(args) > len(names):
        raise TypeError(f"{what} takes at most {len(names) + fixed} positional arguments "
                        f"({len(args) + fixed} given)")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"{what} got an unexpected keyword argument {key!r}")
        if key in bound:
            raise TypeError(f"{what} got multiple values for argument {key!r}")
        bound[key] = value
    return bool(new), bound


def _bind(what: str, conventions, args: tuple, kwargs: dict):
    """(meta, name, rank, mp_group) for the shard-size helpers, which take two arguments of
    their own before either convention."""
    new, bound = bind_convention(what, conventions, args, kwargs, fixed=2)
    meta = bound["meta"] if new else _settings_meta(bound.get("num_kv_heads"))
    return meta, bound.get("name"), bound.get("rank"), bound.get("mp_group")


def get_shard_size(total_size: int, mp_size: int, *args: Any, **kwargs: Any) -> int:
    """DeepSpeed's get_shard_size: this rank's (or `rank`'s, a rank of the tensor-parallel
    group) rows of `total_size`. Without `rank` the group's rank is asked of `mp_group`, or the
    world's rank is used when the world is the group; anything else is a ValueError."""
    meta, name, rank, group = _bind("get_shard_size", _SIZE_ARGS, args, kwargs)
    return shard_size(total_size, mp_size, meta, name, _group_rank(mp_size, rank, group))


def get_shard_size_list(total_size: int, mp_size: int, *args: Any, **kwargs: Any) -> List[int]:
    """Every rank's rows, in rank order (they always sum to `total_size`)."""
    meta, name, _, _ = _bind("get_shard_size_list", _LIST_ARGS, args, kwargs)
    sizes = [shard_size(total_size, mp_size, meta, name, r) for r in range(mp_size)]
    assert sum(sizes) == total_size, (f"AutoTP shard sizes {sizes} for layer {name!r} do not sum to {total_size} "
                                      f"(tp_size={mp_size}, tp_grain_size={meta.tp_grain_size}, "
                                      f"num_kv_heads={meta.num_kv_heads})")
    return sizes
