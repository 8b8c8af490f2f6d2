"""DeepSpeed's stage-3 optimizer attributes for the averaged gradient partitions.

Code written against DeepSpeed, its own ZeRO tests first, reads the gradients its stage-3
optimizer will step with: `optimizer.averaged_gradients` ({group: [partition per
parameter]}) and `optimizer.get_fp32_grad_partitions()` ({group: {parameter index:
partition}}). Here the optimizer is the plain torch optimizer and the partitions live in the
strategy (ZeroStage3.grad_partitions); these read them from there on every access, so they
never go stale when a step or zero_grad frees the buffers.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict


class AveragedGradients(Mapping):
    """`optimizer.averaged_gradients`, read live from the strategy."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __getitem__(self, group: int):
        return self._strategy.grad_partitions()[group]

    def __iter__(self):
        return iter(self._strategy.grad_partitions())

    def __len__(self) -> int:
        return len(self._strategy.grad_partitions())

    def __repr__(self) -> str:
        return f"AveragedGradients({dict(self)!r})"


def publish_grad_partitions(optimizer, strategy) -> None:
    """Give the engine's optimizer DeepSpeed's stage-3 names for the gradient partitions."""
    optimizer.averaged_gradients = AveragedGradients(strategy)

    def get_fp32_grad_partitions() -> Dict[int, Dict[int, object]]:
        # in fp32 whatever the partitions' dtype (data_types.grad_accum_dtype), as DeepSpeed's .float()
        return {group: {i: part.float() for i, part in enumerate(parts)}
                for group, parts in strategy.grad_partitions().items()}

    optimizer.get_fp32_grad_partitions = get_fp32_grad_partitions
