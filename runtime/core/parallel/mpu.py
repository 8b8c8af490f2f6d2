"""A user's Megatron-style `mpu` object seen as a process mesh.

`initialize(mpu=...)` hands the engine an object with get_model_parallel_rank/world_size/
group and get_data_parallel_rank/world_size/group (optionally get_pipe_parallel_*,
get_tensor_model_parallel_* / get_slice_parallel_*, get_sequence_parallel_*). `MpuMesh`
answers the mesh's questions (`size/rank/group(axis)`) from those getters and keeps the
mpu's own groups as they are; it also keeps DeepSpeed's getters, so code written against a
grid works with it unchanged. Axes the mpu does not describe have size 1.
"""
from __future__ import annotations

from typing import List, Optional

from .dims import MeshDims, MeshError


class MpuMesh:
    REQUIRED = ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group",
                "get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_group")

    def __init__(self, mpu, global_rank: int = 0):
        missing = [m for m in self.REQUIRED if not callable(getattr(mpu, m, None))]
        if missing:
            raise MeshError(f"initialize(mpu=...): the mpu object lacks {', '.join(missing)}")
        self.mpu = mpu
        self.global_rank = global_rank
        self.data_parallel_size = int(mpu.get_data_parallel_world_size())
        self.data_parallel_id = int(mpu.get_data_parallel_rank())
        self.model_parallel_size = int(mpu.get_model_parallel_world_size())
        self.pipe_parallel_size = self._optional("get_pipe_parallel_world_size", 1)
        self.stage_id = self._optional("get_pipe_parallel_rank", 0)
        self.dims = MeshDims(pipe=self.pipe_parallel_size, data=self.data_parallel_size,
                             sequence=self._optional("get_sequence_parallel_world_size", 1),
                             tensor=self.get_slice_parallel_world_size())

    def _optional(self, name: str, default: int) -> int:
        fn = getattr(self.mpu, name, None)
        return int(fn()) if callable(fn) else default

    def _first(self, *names):
        for name in names:
            fn = getattr(self.mpu, name, None)
            if callable(fn):
                return fn
        return None

    # -- the mesh by axis name ---------------------------------------------------------------
    _GETTERS = {
        "data": ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank"),
        "replica": ("get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank"),
        "pipe": ("get_pipe_parallel_group", "get_pipe_parallel_world_size", "get_pipe_parallel_rank"),
        "sequence": ("get_sequence_parallel_group", "get_sequence_parallel_world_size",
                     "get_sequence_parallel_rank"),
        "data_sequence": ("get_sequence_data_parallel_group", "get_sequence_data_parallel_world_size",
                          "get_sequence_data_parallel_rank"),
    }

    def _axis(self, axis: str, which: int):
        if axis == "tensor":
            return (self.get_slice_parallel_group, self.get_slice_parallel_world_size,
                    self.get_slice_parallel_rank)[which]()
        if axis == "world":
            import torch.distributed as dist

            return (dist.group.WORLD, dist.get_world_size(), dist.get_rank())[which]
        if axis in ("expert", "expert_data"):
            raise MeshError(f"mesh axis {axis!r}: an mpu object does not describe expert parallelism")
        if axis not in self._GETTERS:
            raise MeshError(f"mesh axis {axis!r} does not exist")
        fn = getattr(self.mpu, self._GETTERS[axis][which], None)
        if callable(fn):
            return fn()
        if axis == "data_sequence" and self.dims.sequence == 1:
            return self._axis("data", which)
        return (None, 1, 0)[which]  # the mpu has no such axis: size 1

    def describes(self, axis: str) -> bool:
        """Whether the mpu object answers for `axis` (it describes no expert parallelism)."""
        return axis in ("tensor", "world") or axis in self._GETTERS

    def group(self, axis: str):
        return self._axis(axis, 0)

    def size(self, axis: str) -> int:
        return int(self._axis(axis, 1))

    def rank(self, axis: str) -> int:
        return int(self._axis(axis, 2))

    def ranks(self, axis: str) -> List[int]:
        import torch.distributed as dist

        group = self.group(axis)
        if group is None:
            return [self.global_rank]
        return dist.get_process_group_ranks(group)

    # -- DeepSpeed's getters -----------------------------------------------------------------
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.mpu.get_data_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return int(self.mpu.get_model_parallel_rank())

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self):
        return self.mpu.get_model_parallel_group()

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        fn = getattr(self.mpu, "get_pipe_parallel_group", None)
        return fn() if callable(fn) else None

    def get_slice_parallel_rank(self) -> int:
        fn = self._first("get_slice_parallel_rank", "get_tensor_model_parallel_rank")
        return int(fn()) if fn else self.get_model_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        fn = self._first("get_slice_parallel_world_size", "get_tensor_model_parallel_world_size")
        return int(fn()) if fn else self.model_parallel_size

    def get_slice_parallel_group(self):
        fn = self._first("get_slice_parallel_group", "get_tensor_model_parallel_group")
        return fn() if fn else self.get_model_parallel_group()

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group


# DeepSpeed-era name, kept for scripts and tests that import it
MpuGrid = MpuMesh


class SequenceOnlyMpu:
    """DeepSpeed's reading of a sequence-parallel mpu, one with `initialize_sequence_parallel`
    (its parallel_state_sp module, ours in runtime/sequence/parallel_state_sp.py): it aliases the
    model-parallel getters to the sequence group, yet DeepSpeed's engine counts no model
    parallelism for it (utils/groups.py: model-parallel size 1, so checkpoints are mp_rank 00).
    This view answers model and tensor parallelism as size 1 and passes everything else on."""

    def __init__(self, mpu):
        self.mpu = mpu

    def __getattr__(self, name):
        return getattr(self.mpu, name)

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return None

    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group


def mpu_view(mpu):
    """The mpu as the mesh reads it (SequenceOnlyMpu for a sequence-parallel mpu)."""
    return SequenceOnlyMpu(mpu) if callable(getattr(mpu, "initialize_sequence_parallel", None)) else mpu
