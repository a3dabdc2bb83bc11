"""halo: exact spatial (domain) parallelism for weather and climate models in PyTorch.

``import halo`` gives the process-group manager, the halo exchange and the shard/gather ops; layers live in
``halo.nn``, losses and gradient sync in ``halo.parallel.reduce``, sharding-invariant randomness in ``halo.random``, the
ColossalAI initializers in ``halo.dist.groups``.
"""

from . import _moved  # noqa: F401  (old module paths, one release: halo._moved.MOVED)

# halo.io and halo.checkpoint as attributes (not in __all__: a star import must not shadow the stdlib's io)
from . import checkpoint as checkpoint
from . import context as context  # halo.context.reset() / use(): the one state object
from . import io as io
from .check import check_equivalence
from .dist import (
    DomainMesh,
    DomainParallelManager,
    HaloCollectiveMismatch,
    HaloCommError,
    destroy_domain_parallel,
    get_domain_parallel_manager,
    get_timeout,
    initialize_domain_parallel,
    set_timeout,
)
from .exchange import halo_exchange, halo_exchange_, halo_exchange_2d, halo_exchange_async, static_shapes
from .io import DomainSampler, data_parallel_sampler_args
from .parallel import parallelize
from .plan import set_validation
from .random import manual_seed
from .shard import gather, gather_2d, local_rows, scatter, scatter_2d, shard, shard_2d

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``halo.guard`` on first use (``halo.guard.trusted()`` after a plain ``import halo``): the guard imports the
    layers whose exact functionals it computes, and ``import halo`` loads no layer."""
    if name == "guard":
        import importlib

        return importlib.import_module("halo.guard")
    raise AttributeError(f"module 'halo' has no attribute {name!r}")

__all__ = [
    "DomainMesh",
    "HaloCollectiveMismatch",
    "HaloCommError",
    "check_equivalence",
    "DomainParallelManager",
    "DomainSampler",
    "data_parallel_sampler_args",
    "destroy_domain_parallel",
    "gather",
    "gather_2d",
    "local_rows",
    "get_domain_parallel_manager",
    "get_timeout",
    "halo_exchange",
    "halo_exchange_",
    "halo_exchange_2d",
    "halo_exchange_async",
    "initialize_domain_parallel",
    "manual_seed",
    "parallelize",
    "scatter",
    "scatter_2d",
    "set_timeout",
    "set_validation",
    "shard",
    "shard_2d",
    "static_shapes",
]
