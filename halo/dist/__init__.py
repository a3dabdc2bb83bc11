"""The distributed layer: one transport for every message, process groups, the domain mesh and the ColossalAI
initializers.

=================  ===============================================================================================
``transport``      the one path every halo message takes (``isend``/``irecv`` batches, host collectives, timeouts)
``comm``           groups as :class:`CommGroup` (ranks, peers, ids), the errors and the timeout every op obeys
``mesh``           :class:`DomainMesh` / the CREDIT :class:`DomainParallelManager` (data x domain) on ``DeviceMesh``
``groups``         ColossalAI's process-group initializers (data, pipeline, tensor 1D/2D/2.5D/3D, sequence, model)
=================  ===============================================================================================
"""

from .comm import CommGroup, HaloCollectiveMismatch, HaloCommError, comm_group, get_timeout, set_timeout
from .groups import ParallelMode, ProcessGroupInitializer
from .mesh import (
    DomainAxis,
    DomainMesh,
    DomainParallelManager,
    destroy_domain_parallel,
    get_domain_parallel_manager,
    initialize_domain_parallel,
    mesh_2d,
)

__all__ = [
    "CommGroup",
    "DomainAxis",
    "DomainMesh",
    "DomainParallelManager",
    "HaloCollectiveMismatch",
    "HaloCommError",
    "ParallelMode",
    "ProcessGroupInitializer",
    "comm_group",
    "destroy_domain_parallel",
    "get_domain_parallel_manager",
    "get_timeout",
    "initialize_domain_parallel",
    "mesh_2d",
    "set_timeout",
]
