"""The checks of every CPU optimizer op's arguments, in Python: the op checks the same in C++
before it touches a tensor, so on the fast path these run only once the op has refused
(run_checked), to word the refusal as the TypeError/ValueError naming the argument and index
that callers have always had; they run up front for the torch fallbacks, and they are the
ops' fake implementations under torch.compile.

The ops step lists of flat, contiguous fp32 CPU tensors in place: parameters and their
per-element states, gradients of one dtype (fp32, bf16 or fp16), and optionally a bf16 or
fp16 copy-out that receives the new parameters. A wrong tensor is refused with an error
naming the argument and index; a silent `.contiguous()` copy would receive the update and
be thrown away, so it is never made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
OUT_CODES = {None: -1, torch.bfloat16: 1, torch.float16: 2}

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
# The step count including this update: one int for every tensor, or one float32 step
# tensor per tensor (an optimizer's state["step"], already incremented).
StepCount = Union[int, Sequence[torch.Tensor]]


def as_list(x: Optional[TensorOrList]) -> Optional[List[torch.Tensor]]:
    if x is None:
        return None
    return [x] if isinstance(x, torch.Tensor) else list(x)


def run_checked(call: Callable[[], None], check: Callable[[], object]) -> None:
    """`call()` (the compiled op, which refuses a wrong tensor before touching any); if it
    refuses, `check()` raises the same refusal as this API's TypeError/ValueError, and the
    op's own error goes on when the checks find nothing. Checking only then saves a pass over
    every list each step: 0.1 ms for a 94-tensor model, a quarter of its Adam update."""
    try:
        call()
    except RuntimeError:
        check()
        raise


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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


def check_steps(op: str, steps: Sequence[torch.Tensor], n: int) -> None:
    if len(steps) != n:
        raise ValueError(f"{op}: {n} params but {len(steps)} steps")
    for i, s in enumerate(steps):
        if not (isinstance(s, torch.Tensor) and s.is_cpu and s.dtype == torch.float32 and s.numel() == 1):
            raise TypeError(f"{op}: steps[{i}] must be a one-element float32 CPU tensor")


def step_args(op: str, step: StepCount, n: int):
    """(count, step tensors) for a torch op: an int count and no tensors, or 0 and the tensors."""
    if isinstance(step, int):
        if step < 1:
            raise ValueError(f"{op}: step must be >= 1 (the count after this update), got {step}")
        return step, []
    steps = list(step)
    check_steps(op, steps, n)
    return 0, steps


# The mark torch.compiler.assume_constant_result sets. That decorator imports torch._dynamo
# first, which costs seconds (2.4 s idle on the 2-core CI machine, 8 s loaded) in every process
# that builds a CPU optimizer, torch.compile or not; setting the mark directly costs nothing, and
# dynamo reads it when it meets the function. tests/kernels/test_kernel_torch_ops.py checks the name
# against torch's decorator and that a fullgraph compile of step() still traces through it.
DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"


def default_threads() -> int:
    """torch's intra-op thread count, the ops' default (a constant to torch.compile, which
    cannot trace torch.get_num_threads())."""
    return torch.get_num_threads()


setattr(default_threads, DYNAMO_CONSTANT_MARK, True)
