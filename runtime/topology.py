"""DeepSpeed's topology module (`deepspeed.runtime.pipe.topology`'s names), kept at its old
path for scripts and tests that import it. The mesh lives in runtime/parallel/."""
from .core.parallel.dims import MeshError  # noqa: F401
from .core.parallel.layout import (GroupFactory, PipeDataParallelTopology, PipeModelDataParallelTopology,  # noqa: F401
                              ProcessTopology, TopologyError, default_topology, prime_factors, topology_for)
from .core.parallel.mesh import PipelineParallelGrid, ProcessMesh, data_parallel_grid, new_group  # noqa: F401
from .core.parallel.mpu import MpuGrid, MpuMesh  # noqa: F401

_prime_factors = prime_factors  # DeepSpeed's private name, which its tests import
