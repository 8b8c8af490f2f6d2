"""Which mesh an engine runs on, and the facts about it the engine needs.

A model that brings its own mesh (a PipelineModule, through its `parallel_mesh`), a user's
Megatron-style `mpu`, or a mesh built over the world from the config's degrees (tensor
parallelism). Duck-typed on `parallel_mesh`, so this module never imports the pipeline.
"""
from __future__ import annotations

from typing import Optional

from .dims import MeshDims, MeshError
from .layout import topology_for
from .mesh import PipelineParallelGrid, data_parallel_grid
from .mpu import MpuMesh, mpu_view


def mesh_for(model, mpu, global_rank: int, world_size: int, distributed: bool, *, tensor: int = 1,
             expert: int = 1, sequence: int = 1):
    """The mesh of an engine. `tensor` > 1: the config asked for tensor parallelism
    (`tensor_parallel.autotp_size`) on a model without its own mesh. `expert` > 1: the
    model's MoE layers spread their experts over groups of `expert` data-parallel ranks
    (the mesh's `expert` and `expert_data` axes). `sequence` > 1: Ulysses sequence
    parallelism (`sequence_parallel_size`). Raises MeshError."""
    if expert > 1 and sequence > 1:
        raise MeshError(f"MoE ep_size {expert} with sequence_parallel_size {sequence} is not supported; use one of them")
    if expert > 1:
        return _expert_mesh(model, mpu, world_size, distributed, tensor, expert)
    own = getattr(model, "parallel_mesh", None)
    if own is not None:
        if mpu is not None:
            raise MeshError("initialize: pass either mpu= or a PipelineModule (whose topology is the mpu), not both")
        if sequence > 1:
            raise MeshError(f"sequence_parallel_size {sequence} with a PipelineModule is not supported")
        if tensor > 1 and own.size("tensor") != tensor:
            raise MeshError(f"tensor_parallel.autotp_size {tensor} differs from the model's topology "
                            f"(tensor {own.size('tensor')}); give the PipelineModule a topology with "
                            f"num_mp={tensor}")
        return own
    if mpu is not None:
        mesh = MpuMesh(mpu_view(mpu), global_rank)
        if tensor > 1 and mesh.size("sequence") > 1 and mesh.size("tensor") == 1:
            raise MeshError(f"tensor_parallel.autotp_size {tensor} with the mpu's sequence-parallel size "
                            f"{mesh.size('sequence')} is not supported (an mpu from register_with_transformers has "
                            "no tensor axis); use sequence_parallel_size with DistributedAttention for tp x sp")
        if tensor > 1 and mesh.size("tensor") != tensor:
            raise MeshError(f"tensor_parallel.autotp_size {tensor} differs from the mpu's tensor-parallel size "
                            f"{mesh.size('tensor')}")
        if sequence > 1 and mesh.size("sequence") != sequence:
            raise MeshError(f"sequence_parallel_size {sequence} differs from the mpu's sequence-parallel size "
                            f"{mesh.size('sequence')}")
        if mesh.size("sequence") > 1 and (mesh.size("pipe") > 1 or mesh.size("tensor") > 1):
            raise MeshError(f"the mpu's sequence-parallel size {mesh.size('sequence')} with pipeline or tensor "
                            "parallelism is not supported")
        return mesh
    if not distributed:
        for axis, size in (("tensor", tensor), ("sequence", sequence)):
            if size > 1:
                raise MeshError(f"{axis} {size} does not divide world 1")
        return data_parallel_grid(rank=0, world_size=1, group_factory=lambda ranks: None)
    if tensor > 1 or sequence > 1:
        return PipelineParallelGrid(topology_for(MeshDims.for_world(world_size, tensor=tensor, sequence=sequence)))
    return data_parallel_grid()


def _expert_mesh(model, mpu, world_size: int, distributed: bool, tensor: int, expert: int):
    if getattr(model, "parallel_mesh", None) is not None or mpu is not None:
        raise MeshError(f"MoE ep_size {expert}: expert parallelism with a pipeline or an mpu is not supported; "
                        "use MoE layers in a plain module (data parallelism only)")
    if tensor > 1:
        raise MeshError(f"MoE ep_size {expert}: expert parallelism with tensor_parallel.autotp_size {tensor} is not "
                        "supported")
    world = world_size if distributed else 1
    if world % expert:
        raise MeshError(f"MoE ep_size {expert} does not divide the data-parallel size {world} (the world)")
    dims = MeshDims.for_world(world, expert=expert)
    return PipelineParallelGrid(topology_for(dims), expert=expert)


def gradient_axis(mesh) -> str:
    """The axis replicated parameters' gradients are averaged (and ZeRO state sharded) over:
    data x sequence when a sequence is split (each sequence rank saw a different slice of
    the same samples), the data axis otherwise."""
    return "data_sequence" if mesh.size("sequence") > 1 else "data"


def norm_axis(mesh) -> Optional[str]:
    """The axis a gradient norm complete over the gradient axis must still be summed over:
    the ranks holding other parameters (pipeline stages, tensor slices), None when there
    are none. Sequence ranks hold the same parameters, whose norm the data x sequence
    reduction already completed, so with a sequence axis it is the tensor axis alone (the
    replica axis would count every tensor slice once per sequence rank); a pipeline with a
    sequence axis is refused by mesh_for."""
    if mesh.size("sequence") > 1:
        return "tensor" if mesh.size("tensor") > 1 else None
    return "replica" if mesh.size("replica") > 1 else None


def batch_world_size(mesh, mpu, autotp_size: int) -> int:
    """The rank count the batch rule multiplies micro batch x accumulation by. DeepSpeed 0.19.8
    reads it when the config is parsed, before AutoTP builds its groups: without an mpu that
    is every rank, tensor-parallel ones included (runtime/config.py: dist.get_world_size()), so
    a config written for it names train_batch_size = micro x accumulation x world size. The
    training itself does not depend on it: each data-parallel rank still runs `accumulation`
    micro batches per step. With an mpu, or no AutoTP, it is the data-parallel size."""
    if mpu is None and autotp_size > 1:
        return mesh.size("data") * mesh.size("tensor")
    return mesh.size("data")


def dp_size_source(mesh, mpu, world_source: str, world_size: int, autotp_size: int = 1) -> str:
    """Where the data-parallel size came from, for the batch-size error."""
    if mpu is not None:
        return f"from mpu.get_data_parallel_world_size(); {world_source}"
    if autotp_size > 1:
        return (f"world size {world_size} ({world_source}), tensor-parallel ranks included as DeepSpeed counts them "
                "under tensor_parallel.autotp_size")
    parts = [f"{mesh.size(a)} {label}" for a, label in (("pipe", "pipeline stages"), ("sequence", "sequence slices"),
                                                        ("tensor", "tensor slices")) if mesh.size(a) > 1]
    if parts:
        return f"world size {world_size} ({world_source}) / " + " / ".join(parts)
    return world_source


def norm_exclude(model, mesh, mpu) -> frozenset:
    """Parameters whose gradient another rank already counts in the global norm: a weight
    tied across pipeline stages counts on the tie's first rank only; parameters not split
    by tensor parallelism (no `tensor_model_parallel`/`model_parallel` attribute set) count
    on tensor-parallel rank 0 only, as in DeepSpeed and Megatron. A split parameter is one a
    tensor-parallel layer lists in `param_shards()` with a split dim, or one carrying
    Megatron's attribute."""
    out = set()
    for c in getattr(model, "tied_comms", {}).values():
        if mesh.get_global_rank() != min(c["ranks"]):
            out.update(id(p) for p in c["module"].parameters())
    if mesh.size("tensor") > 1 and mesh.rank("tensor") > 0:
        sharded = set()
        for module in model.modules():
            shards = getattr(module, "param_shards", None)  # tensor_parallel layers say which are split
            if callable(shards):
                sharded.update(id(getattr(module, n)) for n, spec in shards().items() if spec.dim is not None)
        out.update(id(p) for p in model.parameters() if id(p) not in sharded
                   and not (getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)))
    return frozenset(out)
