"""Data and domain parallelism together: losses and reductions over the domain, gradient sync, and
:func:`parallelize` (convert + wrap for DDP / FSDP2 / HSDP in one call).

=================  ===============================================================================================
``reduce``         domain sums and means (autograd-exact), latitude weights, losses, gradient sync and clipping
``marks``          provenance of a backward's gradients (what the sync accepts, what it refuses)
``layout``         how a domain group sits in the world (which ranks reduce what)
``wrap``           :func:`parallelize` and the data-parallel mesh beside the domain mesh
=================  ===============================================================================================
"""

from .reduce import (
    LAT_METHODS,
    accumulation_dtype,
    all_reduce,
    clip_grad_norm_,
    domain_mean,
    domain_sum,
    grad_norm,
    grid_latitudes,
    latitude_weighted_mean,
    latitude_weighted_mse,
    latitude_weights,
    local_grad,
    local_latitude_weights,
    local_share,
    no_sync,
    replicated_loss,
    sync_domain_gradients,
)
from .wrap import DATA_PARALLEL, data_parallel_mesh, parallelize

__all__ = [
    "DATA_PARALLEL",
    "LAT_METHODS",
    "accumulation_dtype",
    "all_reduce",
    "clip_grad_norm_",
    "data_parallel_mesh",
    "domain_mean",
    "domain_sum",
    "grad_norm",
    "grid_latitudes",
    "latitude_weighted_mean",
    "latitude_weighted_mse",
    "latitude_weights",
    "local_grad",
    "local_latitude_weights",
    "local_share",
    "no_sync",
    "parallelize",
    "replicated_loss",
    "sync_domain_gradients",
]
