"""The parallel degrees of a job, checked against its world size in one place.

Pure arithmetic: no processes. Every degree a config, a PipelineModule or a script asks for
(pipeline stages, tensor slices, sequence slices, expert-parallel size) is validated here,
so a bad combination is one line naming the offending value:

    MeshDims.for_world(8, tensor=3)  ->  MeshError("tensor 3 does not divide world 8")

The data-parallel degree is what the others leave: world / (pipe x sequence x tensor).
Experts split the data axis further (expert x expert_data = data), as DeepSpeed's MoE does.
"""
from __future__ import annotations

from dataclasses import dataclass


class MeshError(ValueError):
    """Degrees that cannot lay out this job (one line, naming the value)."""


@dataclass(frozen=True)
class MeshDims:
    """The size of every named axis. `data` is derived; the product pipe x data x
    sequence x tensor is the world."""

    pipe: int = 1
    data: int = 1
    sequence: int = 1
    tensor: int = 1
    expert: int = 1  # a factor of `data`: experts are spread over data-parallel ranks

    @property
    def world(self) -> int:
        return self.pipe * self.data * self.sequence * self.tensor

    @property
    def expert_data(self) -> int:
        """Replicas of one expert: the data-parallel degree of expert parameters."""
        return self.data // self.expert

    @classmethod
    def for_world(cls, world: int, *, pipe: int = 1, tensor: int = 1, sequence: int = 1,
                  expert: int = 1) -> "MeshDims":
        """The layout of `world` ranks with these degrees; data takes the rest."""
        world = int(world)
        named = {"pipe": pipe, "tensor": tensor, "sequence": sequence, "expert": expert}
        for axis, size in named.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(f"{axis} {size!r} must be a positive integer")
        if world < 1:
            raise MeshError(f"world {world} must be at least 1")
        for axis in ("pipe", "tensor", "sequence"):
            if world % named[axis]:
                raise MeshError(f"{axis} {named[axis]} does not divide world {world}")
        model = pipe * tensor * sequence
        if world % model:
            raise MeshError(f"pipe {pipe} x sequence {sequence} x tensor {tensor} = {model} does not divide "
                            f"world {world}")
        data = world // model
        if data % expert:
            raise MeshError(f"expert {expert} does not divide data {data} (world {world} / pipe {pipe} / "
                            f"sequence {sequence} / tensor {tensor})")
        return cls(pipe=pipe, data=data, sequence=sequence, tensor=tensor, expert=expert)

    def __str__(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in ("pipe", "data", "sequence", "tensor", "expert")
                 if getattr(self, a) > 1 or a == "data"]
        return " x ".join(parts)
