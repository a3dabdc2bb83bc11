"""What a model is converted onto: a manager, a mesh or a process group, in one position, as a ConvertContext.

``convert_to_domain_parallel(model, X)`` takes CREDIT's :class:`halo.DomainParallelManager` (latitude rows), a
:class:`halo.DomainMesh` (one domain axis: latitude rows; two: latitude x longitude) or a
``torch.distributed.ProcessGroup`` (latitude rows over its ranks) in the same place (issue 22, item 3);
:func:`convert_context` checks it (an error naming what is wrong, the same on every rank: it reads only the mesh's
layout) and turns it into the :class:`ConvertContext` every converter ``fn(module, ctx)`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..dist.mesh import DomainMesh, DomainParallelManager, get_domain_parallel_manager

__all__ = ["ConvertContext", "convert_context"]


@dataclass(frozen=True)
class ConvertContext:
    """What a converter needs: the domain group, the data-parallel group, the latitude boundary override."""

    group: Any
    dp_group: Any
    boundary: str | None
    mesh: Any = None  # a latitude x longitude DomainMesh (W sharded too), else None


def convert_context(target: Any, boundary: str | None) -> tuple[ConvertContext, int]:
    """What the layers are converted onto, from a manager, a :class:`halo.DomainMesh` (one axis: latitude rows; two:
    latitude x longitude) or a process group (latitude rows over it); ``None``: the initialised manager."""
    op = "convert_to_domain_parallel"
    if target is None:
        target = get_domain_parallel_manager()
        if target is None:
            raise RuntimeError(f"{op} needs a manager, a mesh or a group: call halo.initialize_domain_parallel("
                               f"world_size, domain_parallel_size) first or pass one")
    if isinstance(target, DomainParallelManager):
        if target.shard_dim not in (-2,):
            raise ValueError(f"the domain-parallel layers shard latitude (shard_dim=-2); the manager has "
                             f"shard_dim={target.shard_dim}")
        target = target.mesh
    if isinstance(target, DomainMesh):
        if len(target.domain_shape) > 2:
            raise ValueError(f"{op}: halo's layers take a mesh of one domain axis (latitude) or two (latitude x "
                             f"longitude), got {len(target.domain_shape)}: {target.domain_shape}")
        rows = len(target.domain_shape) == 1
        if tuple(target.shard_dims) not in (((-2,), (2,)) if rows else ((-2, -1), (2, 3))):
            raise ValueError(f"{op}: a mesh must shard latitude (dim -2){'' if rows else ' then longitude (-1)'}, "
                             f"got shard_dims={target.shard_dims}")
        dp_group = target.dp_group if target.dp_size > 1 else None
        return ConvertContext(target.domain_group, dp_group, boundary, None if rows else target), target.domain_size
    if isinstance(target, dist.ProcessGroup):
        return ConvertContext(target, None, boundary), dist.get_world_size(target)
    raise TypeError(f"{op}(model, X): X is a halo.DomainParallelManager, a halo.DomainMesh or a "
                    f"torch.distributed.ProcessGroup, got {type(target).__module__}.{type(target).__qualname__}")
