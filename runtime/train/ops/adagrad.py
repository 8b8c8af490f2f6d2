"""`deepspeed.ops.adagrad`: DeepSpeedCPUAdagrad (the C++ SIMD CPU kernel)."""
from __future__ import annotations

from typing import List

import torch

from dslaunch.kernels.cpu_adagrad import CPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(CPUAdagrad):
    """torch.optim.Adagrad's update on CPU parameters, DeepSpeed's signature.

    As DeepSpeed's op does: bf16/fp16 parameters are stepped with fp32 maths and rounded
    back (the sum fp32 unless fp32_optimizer_states=False keeps it in the parameter's dtype),
    and a sparse gradient (nn.Embedding(sparse=True)) updates only the rows it names: their
    parameter and sum rows are gathered, stepped by the same op, and scattered back. That is
    torch.optim.Adagrad's sparse update; weight decay, which torch refuses with sparse
    gradients, applies to the named rows only, as in DeepSpeed."""

    low_precision_params = True
    sparse_gradients = True

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad: Adagrad has no AMSGrad variant (amsgrad must be False)")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)

    def _step_aside(self, group: dict, params: List[torch.Tensor]) -> None:
        dense = [p for p in params if not p.grad.is_sparse]
        if dense:
            self._step_converted(group, [(p, p) for p in dense])
        for p in params:
            if p.grad.is_sparse:
                self._step_sparse(group, p)

    def _step_sparse(self, group: dict, p: torch.Tensor) -> None:
        grad = p.grad.coalesce()  # one value per index, so the scatter below writes each row once
        if p.device.type != "cpu" or not p.is_contiguous():
            raise ValueError(f"DeepSpeedCPUAdagrad: a parameter with a sparse gradient must be a contiguous CPU "
                             f"tensor (got one on {p.device}, contiguous={p.is_contiguous()})")
        state = self.state[p]
        if not state:
            state.update(self._new_state(p, group))
        state["step"] += 1
        sparse_dims = grad.sparse_dim()
        rows_shape, row = p.shape[:sparse_dims], p.shape[sparse_dims:]
        index = grad.indices()
        flat = index[0]
        for d in range(1, sparse_dims):
            flat = flat * rows_shape[d] + index[d]
        nrows = 1
        for n in rows_shape:
            nrows *= n
        param_rows, sum_rows = p.detach().view(nrows, *row), state["sum"].view(nrows, *row)
        work = param_rows.index_select(0, flat).to(torch.float32)
        sums = sum_rows.index_select(0, flat).to(torch.float32)
        self._update([work], [grad.values().contiguous()], {"sum": [sums]}, [state["step"]], group)
        param_rows.index_copy_(0, flat, work.to(p.dtype))
        sum_rows.index_copy_(0, flat, sums.to(sum_rows.dtype))
