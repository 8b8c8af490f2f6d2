"""The checks every CPU optimizer op runs before a pointer reaches C++, and the ctypes
arrays it then hands over.

The ops step lists of flat, contiguous fp32 CPU tensors in place: parameters and their
per-element states, gradients of one dtype (fp32, bf16 or fp16), and optionally a bf16 or
fp16 copy-out that receives the new parameters. A wrong tensor is refused with an error
naming the argument and index; a silent `.contiguous()` copy would receive the update and
be thrown away, so it is never made.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch

GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
OUT_CODES = {None: -1, torch.bfloat16: 1, torch.float16: 2}

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


def as_list(x: Optional[TensorOrList]) -> Optional[List[torch.Tensor]]:
    if x is None:
        return None
    return [x] if isinstance(x, torch.Tensor) else list(x)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def pointers(ts: Optional[List[torch.Tensor]]):
    if ts is None:
        return None
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


@dataclass
class FlatArgs:
    """Checked arguments of one op call."""

    params: List[torch.Tensor]
    grads: List[torch.Tensor]
    states: Dict[str, List[torch.Tensor]]
    outs: Optional[List[torch.Tensor]]
    numels: List[int]
    grad_dtype: torch.dtype
    out_dtype: Optional[torch.dtype]

    @property
    def n(self) -> int:
        return len(self.params)

    def c_numels(self):
        return (ctypes.c_int64 * self.n)(*self.numels)

    def c_codes(self):
        return GRAD_CODES[self.grad_dtype], OUT_CODES[self.out_dtype]

    def call(self, op: str, fn, states: Sequence[Optional[List[torch.Tensor]]], hyper,
             num_threads: Optional[int]) -> None:
        """Run the C step `fn` over these tensors with the ops' common signature: (n, numels,
        params, grads, *states, copy-outs, grad dtype code, copy-out code, &hyper, threads)."""
        grad_code, out_code = self.c_codes()
        rc = fn(self.n, self.c_numels(), pointers(self.params), pointers(self.grads), *map(pointers, states),
                pointers(self.outs), grad_code, out_code, ctypes.byref(hyper), num_threads or torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"{op}: the op rejected grad dtype {self.grad_dtype} / copy-out {self.out_dtype}")


def _check(op: str, name: str, ts: List[torch.Tensor], numels: List[int], dtypes) -> None:
    """One fast pass over a list; the slow path only runs to word the error."""
    for i, t in enumerate(ts):
        if t.dtype in dtypes and t.is_cpu and t.numel() == numels[i] and t.is_contiguous():
            continue
        if not t.is_cpu:
            raise ValueError(f"{op}: {name}[{i}] is on {t.device}; the CPU op needs CPU tensors")
        if t.dtype not in dtypes:
            allowed = ", ".join(dtype_name(d) for d in dtypes)
            raise TypeError(f"{op}: {name}[{i}] has dtype {dtype_name(t.dtype)}; expected {allowed}")
        if t.numel() != numels[i]:
            raise ValueError(f"{op}: {name}[{i}] has {t.numel()} elements, the parameter has {numels[i]}")
        raise ValueError(f"{op}: {name}[{i}] is not contiguous; the update would be lost in a copy")


def check_flat_args(op: str, params: TensorOrList, grads: TensorOrList,
                    states: Dict[str, Optional[TensorOrList]], copy_out: Optional[TensorOrList]) -> FlatArgs:
    """Lists of equal length; fp32 params and states, one grad dtype, one copy-out dtype."""
    ps, gs, outs = as_list(params), as_list(grads), as_list(copy_out)
    lists = {k: as_list(v) for k, v in states.items() if v is not None}
    n = len(ps)
    for name, lst in (("grads", gs), *lists.items(), ("copy_out", outs)):
        if lst is not None and len(lst) != n:
            raise ValueError(f"{op}: {n} params but {len(lst)} {name}")
    grad_dtype = gs[0].dtype if n else torch.float32
    out_dtype = outs[0].dtype if outs else None
    if grad_dtype not in GRAD_CODES:
        raise TypeError(f"{op}: grads[0] has dtype {dtype_name(grad_dtype)}; expected float32, bfloat16 or float16")
    if outs and out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: copy_out[0] has dtype {dtype_name(out_dtype)}; expected bfloat16 or float16")
    numels = [p.numel() for p in ps]
    _check(op, "params", ps, numels, (torch.float32,))
    _check(op, "grads", gs, numels, (grad_dtype,))
    for name, lst in lists.items():
        _check(op, name, lst, numels, (torch.float32,))
    if outs:
        _check(op, "copy_out", outs, numels, (out_dtype,))
    return FlatArgs(ps, gs, lists, outs, numels, grad_dtype, out_dtype)


def fp32_views(args: FlatArgs):
    """For the torch fallbacks: fp32 gradients and state views shaped like each parameter."""
    grads = [g if g.dtype == torch.float32 else g.float() for g in args.grads]
    grads = [g.view_as(p) for g, p in zip(grads, args.params)]
    states = {k: [t.view_as(p) for t, p in zip(lst, args.params)] for k, lst in args.states.items()}
    return grads, states


def copy_out_after_fallback(args: FlatArgs) -> None:
    if args.outs:
        for o, p in zip(args.outs, args.params):
            o.view_as(p).copy_(p)
