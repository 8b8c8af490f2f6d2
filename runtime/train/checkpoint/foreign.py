"""DeepSpeed's pickled objects, read and written without DeepSpeed and without running code.

DeepSpeed's checkpoints pickle a few of its own classes (the ZeRO optimizer's loss scaler,
the ZeroStageEnum, the fragment_address records of param_slice_mappings) and whatever a
script put in client_state (Megatron's argparse.Namespace). torch.load(weights_only=True)
refuses every such GLOBAL, and weights_only=False would run whatever a crafted file asks.

Reading: an allow-list for torch's own weights_only unpickler, mapping exactly these
names to inert stand-ins (`read_globals`). A stand-in is a plain record: the unpickler
creates it with object.__new__ and fills its __dict__ from the pickled state; nothing
else is called. Any other GLOBAL is still refused, so a crafted file runs no code (test:
tests/runtime/train/checkpoint/test_checkpoint_safety.py and test_checkpoint_deepspeed.py).

Writing: DeepSpeed's ZeRO-3 loader requires its loss-scaler object in the optimizer
states (state_dict["loss_scaler"].cur_scale ...). `save_with_deepspeed_globals` pickles our
stand-ins under DeepSpeed's class names (pure-Python pickler whose save_global writes the
recorded name), so DeepSpeed unpickles its real class, while we never import DeepSpeed.
"""
from __future__ import annotations

import argparse
import contextlib
import pickle
from typing import Any, Dict, Iterator, Tuple

import torch

_FP16 = "deepspeed.runtime.fp16.loss_scaler"


class PickledRecord:
    """An object DeepSpeed pickled, as data: its attributes and nothing else."""

    ds_global: Tuple[str, str] = ("", "")

    def __init__(self, **state: Any):
        self.__dict__.update(state)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __repr__(self) -> str:
        return f"{self.ds_global[1]}({self.__dict__})"


class LossScaler(PickledRecord):
    ds_global = (_FP16, "LossScaler")


class DynamicLossScaler(PickledRecord):
    ds_global = (_FP16, "DynamicLossScaler")


class FragmentAddress(PickledRecord):
    ds_global = ("deepspeed.utils.tensor_fragment", "fragment_address")


class SubparamShape(PickledRecord):
    """How a fused parameter's sub-parameters sit (DeepSpeed's universal_checkpoint.SubparamShape):
    the name patterns it covers, its view spec (at `partition_dim` a sub-parameter count or
    their sizes) and the dimension they are side by side along. A universal checkpoint's
    merged files carry one under "sub_param_shape"; tp_merge.py writes it."""

    ds_global = ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape")

    def __init__(self, patterns, shape, partition_dim):
        super().__init__(patterns=patterns, shape=shape, partition_dim=partition_dim)


def _zero_stage(value: int) -> int:
    """ZeroStageEnum(value): an IntEnum in DeepSpeed; its int here."""
    return int(value)


def read_globals():
    """The allow-list: DeepSpeed's names -> inert stand-ins (and argparse.Namespace, which
    unpickles as a plain attribute bag)."""
    out = [(cls, ".".join(cls.ds_global)) for cls in (LossScaler, DynamicLossScaler, FragmentAddress,
                                                          SubparamShape)]
    out.append((_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"))
    out.append(argparse.Namespace)
    return out


@contextlib.contextmanager
def deepspeed_globals() -> Iterator[None]:
    with torch.serialization.safe_globals(read_globals()):
        yield


class _Pickler(pickle._Pickler):
    """Writes a stand-in class as the DeepSpeed class it stands for."""

    def save_global(self, obj, name=None):
        ref = getattr(obj, "ds_global", None) if isinstance(obj, type) else None
        if not ref or not issubclass(obj, PickledRecord):
            return super().save_global(obj, name)
        module, qualname = ref
        self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")
        self.memoize(obj)


class _TrustingUnpickler(pickle.Unpickler):
    """For trust_pickle=True: anything may be unpickled (the user vouched for the source),
    and DeepSpeed's classes still resolve to the stand-ins when DeepSpeed is not installed."""

    def find_class(self, module, name):
        for obj in read_globals():
            if isinstance(obj, tuple) and obj[1] == f"{module}.{name}":
                return obj[0]
        return super().find_class(module, name)


class _PickleModule:
    Pickler = _Pickler
    Unpickler = _TrustingUnpickler
    load = pickle.load
    __name__ = "dslaunch_deepspeed_pickle"


def save_with_deepspeed_globals(obj: Any, f) -> None:
    torch.save(obj, f, pickle_module=_PickleModule)


def load_trusting(path: str, mmap: bool = False) -> Any:
    """torch.load(weights_only=False), the explicit opt-in, with DeepSpeed's names resolved."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_PickleModule)


def loss_scaler_record(state: Dict[str, Any] = None, dynamic: Dict[str, Any] = None) -> PickledRecord:
    """DeepSpeed's loss scaler for a ZeRO optimizer state: static 1.0 (fp32/bf16), or the
    dynamic scaler from our fp16 scaler's state and settings."""
    if not state:
        return LossScaler(cur_scale=1.0, dynamic=False)
    if not dynamic:
        return LossScaler(cur_scale=float(state["scale"]), dynamic=False)
    return DynamicLossScaler(cur_scale=float(state["scale"]), dynamic=True, cur_iter=int(state["iteration"]),
                             last_overflow_iter=int(state["last_overflow_iter"]),
                             scale_factor=float(dynamic["factor"]), scale_window=int(dynamic["window"]),
                             min_scale=float(dynamic["min_scale"]), delayed_shift=int(dynamic["hysteresis"]),
                             cur_hysteresis=int(state["hysteresis_left"]),
                             consecutive_hysteresis=bool(dynamic["consecutive_hysteresis"]),
                             raise_error_at_min_scale=True, dtype=torch.float16)
