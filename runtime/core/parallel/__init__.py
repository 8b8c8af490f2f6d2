"""Where every rank sits: the named-axis process mesh (pipe, data, sequence, tensor, expert).

    dims.py    the degrees, validated against the world in one place (pure)
    layout.py  ranks <-> coordinates, DeepSpeed's row-major order (pure)
    mesh.py    ProcessMesh: the process group, rank and size of any axis by name;
               PipelineParallelGrid: the same through DeepSpeed's getters
    mpu.py     a user's Megatron-style mpu object as a mesh
    select.py  which mesh an engine runs on (a model's own, an mpu's, or one built from
               the config's degrees over the world)

Nothing here imports the engine, the pipeline or the strategies: they ask the mesh.
"""
from .dims import MeshDims, MeshError
from .layout import (PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology, TopologyError,
                     default_topology, topology_for)
from .mesh import AXES, PipelineParallelGrid, ProcessMesh, data_parallel_grid, new_group
from .mpu import MpuGrid, MpuMesh

__all__ = ["AXES", "MeshDims", "MeshError", "MpuGrid", "MpuMesh", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessMesh", "ProcessTopology",
           "TopologyError", "data_parallel_grid", "default_topology", "new_group", "topology_for"]
