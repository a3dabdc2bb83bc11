"""halo: exact spatial (domain) parallelism for weather and climate models in PyTorch."""

from .mesh import (
    DomainMesh,
    DomainParallelManager,
    destroy_domain_parallel,
    get_domain_parallel_manager,
    initialize_domain_parallel,
)

__version__ = "0.1.0"

__all__ = [
    "DomainMesh",
    "DomainParallelManager",
    "destroy_domain_parallel",
    "get_domain_parallel_manager",
    "initialize_domain_parallel",
]
