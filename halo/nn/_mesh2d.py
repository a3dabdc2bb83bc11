"""Layers on a latitude x longitude mesh: H sharded over the mesh's first domain axis, W over the second.

A halo layer given ``mesh=`` a :class:`halo.DomainMesh` with two domain axes learns both extents of every rank in
its H line and its W line in one agreement over the domain group (``halo.plans.resolve`` with two specs and the
mesh coordinates), exchanges along H and then along W (:func:`halo.exchange.exchange_2d`: corners right, poles
rolled across the W ranks), and runs the torch op with no padding: the exchange's boundary modes are the padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mesh import DomainMesh, mesh_2d, mesh_coords
from ..plans import Site, resolve

__all__ = ["mesh_of", "resolve_2d", "set_mesh"]


def set_mesh(module: nn.Module, mesh: DomainMesh | None, name: str) -> None:
    """Store ``mesh`` on ``module`` (not a parameter, buffer or submodule: the ``state_dict`` is unchanged)."""
    if mesh is not None and not isinstance(mesh, DomainMesh):
        raise TypeError(f"{name}: mesh= takes a halo.DomainMesh, got {type(mesh).__name__}")
    if mesh is not None and len(mesh.domain_shape) == 2:
        if tuple(mesh.shard_dims) not in ((-2, -1), (2, 3)):
            raise ValueError(f"{name}: a latitude x longitude mesh must shard dims (-2, -1), got {mesh.shard_dims}")
        mesh_layout(mesh)  # its groups looked up now, outside any traced forward
    module.__dict__["_halo_mesh"] = mesh


def mesh_layout(mesh: DomainMesh) -> tuple[Any, tuple[Any, Any], tuple[tuple[int, int], ...], int]:
    """The domain group, the axis groups, the coordinates and the W size of a mesh, looked up once per mesh (not in a
    traced forward: ``torch.compile`` sees constants)."""
    cached = mesh.__dict__.get("_halo_layout")
    if cached is None:
        cached = (mesh.domain_group, (mesh.axis_group(0), mesh.axis_group(1)),
                  mesh_coords(tuple(mesh.domain_shape)), mesh.domain_shape[1])
        mesh.__dict__["_halo_layout"] = cached
    return cached


def mesh_of(module: nn.Module) -> DomainMesh | None:
    """The module's latitude x longitude mesh, or ``None`` (latitude only)."""
    return mesh_2d(module.__dict__.get("_halo_mesh"))


def resolve_2d(x: torch.Tensor, mesh: DomainMesh, op: str, make: Any, extra: tuple, site: Site | None) -> Any:
    """``make(domain CommGroup, (H extents of this rank's H line, W extents of its W line), (H group, W group),
    *extra)``, agreed over the domain group (or recalled under the call's epoch)."""
    domain_group, groups, coords, _ = mesh_layout(mesh)
    return resolve(x, domain_group, op, make, (groups, *extra), site=site, spec=((-2,), (-1,)), coords=coords)
