"""The layer base: what every halo layer does alike, written once.

A halo layer is a torch layer plus four things: the domain group it runs on (``group=``, held in a
:class:`halo.dist.mesh.GroupRef` so a deep copy or a pickle does not copy a process group), its site in the planner's
records (a :class:`halo.plan.plans.Site`), an optional latitude x longitude mesh (``mesh=``), and the torch module's
state it adopted (its Parameters shared, so ``state_dict`` keys stay). :class:`DomainLayer` owns all four, and the
three steps of a forward that every layer repeated:

* :meth:`DomainLayer.axis_plans` — the plan of the call, *per axis*: one entry on latitude rows (the group), two on a
  latitude x longitude mesh (H then W), learned in one agreement either way (:func:`halo.plan.plans.resolve` over the
  group, or over the mesh's domain group with both extents and the mesh coordinates). The layer writes one geometry
  function ``make(axis_group, sizes, dim, *per_axis[a], *extra)`` — which rows of ``dim`` this rank needs, given
  every rank's ``sizes`` along that axis — and never a ``*_2d`` twin of it: an axis of a mesh is a line of ranks
  like latitude rows are (its W line is periodic or not as the exchange's boundary says).
* :meth:`DomainLayer.exchange_axes` — each axis's planned exchange in turn (rows, then columns: the corners are
  right because the second exchange moves rows that already hold the first one's halo).
* :meth:`DomainLayer.finish` — the output in the input's memory format (``like_format``) and carrying the input's
  epoch (``carry``): a layer that forgets ``carry`` makes the next call outside a model agree again (one host
  all-gather per call, silently), so it is the default path, not a line each layer must remember.

A per-axis plan is an :class:`AxisPlan` (a frozen dataclass: plain ints and strings, constants under
``torch.compile``) or a subclass adding the layer's own fields.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..context import made
from ..dist.comm import CommGroup, comm_group
from ..dist.mesh import DomainMesh, group_attribute, mesh_2d, mesh_coords
from ..exchange import exchange, like_format, pole_step
from ..plan.plans import Site, carry, resolve

__all__ = ["AxisPlan", "DomainLayer", "adopt", "mesh_layout", "mesh_of", "run_axes", "set_mesh"]


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


@dataclasses.dataclass(frozen=True)
class AxisPlan:
    """One axis of a call as planned for this rank: ``plain`` (one rank along the axis: nothing to exchange), or
    exchange ``ex`` giving ``rows`` rows along ``dim``."""

    plain: bool
    ex: int = -1
    rows: int = 0
    dim: int = -2
    #: The exchange is a :func:`halo.exchange.pole_step` (set by :func:`run_axes`): the rows across the pole arrive
    #: by a second exchange on the W group (a :class:`~halo.exchange.PoleExchanger`, whose ``halos`` hold them),
    #: so a layer that posts other messages on the W group must post them in one order on every rank.
    rolled: bool = dataclasses.field(default=False, kw_only=True)


def _one_axis(cg: CommGroup, extents: tuple[tuple[int, ...], ...], make: Callable, dim: int,
              per_axis: tuple, extra: tuple) -> tuple:
    """Latitude rows: the layer's geometry on the group (a plan function of :func:`halo.plan.plans.resolve`)."""
    return (make(cg, tuple(extents[0]), dim, *(per_axis[0] if per_axis else ()), *extra),)


def _mesh_axes(cg: CommGroup, extents: tuple[tuple[int, ...], ...], groups: tuple, make: Callable,
               dims: tuple[int, int], per_axis: tuple, extra: tuple) -> tuple:
    """A latitude x longitude mesh: the layer's geometry on the H line of this rank, then on its W line; across a
    pole the H exchange gains its roll along W (:func:`halo.exchange.pole_step`), for every layer alike."""
    plans = [make(comm_group(g), tuple(sizes), d, *(per_axis[a] if per_axis else ()), *extra)
             for a, (g, sizes, d) in enumerate(zip(groups, extents, dims, strict=True))]
    h = plans[0]
    if isinstance(h, AxisPlan) and not h.plain and h.ex >= 0:
        ex = pole_step(h.ex, groups[1], tuple(extents[1]), plans[1].dim if isinstance(plans[1], AxisPlan) else dims[1])
        if ex != h.ex:
            plans[0] = dataclasses.replace(h, ex=ex, rolled=True)
    return tuple(plans)


def run_axes(x: torch.Tensor, op: str, make: Callable, extra: tuple = (), *, group: Any | None = None,
             mesh: DomainMesh | None = None, site: Site | None = None, per_axis: tuple = ()) -> tuple:
    """The per-axis plans of a call on ``x`` (:meth:`DomainLayer.axis_plans`, for the functional forms that have no
    module: ``halo_pad``, ``halo_interpolate``). ``mesh`` a two-axis mesh, or ``None`` for latitude rows of
    ``group``; ``per_axis[a]``: arguments of axis ``a`` alone (a padding's top/bottom, then left/right)."""
    h = x.dim() - 2
    if mesh is None:
        return resolve(x, group, op, _one_axis, (make, h, per_axis[:1], extra), site=site)
    domain_group, groups, coords, _ = mesh_layout(mesh)
    return resolve(x, domain_group, op, _mesh_axes, (groups, make, (h, h + 1), per_axis, extra), site=site,
                   spec=((-2,), (-1,)), coords=coords)


def exchange_axes(x: torch.Tensor, plans: tuple) -> torch.Tensor:
    """Each axis's planned exchange in turn (an axis that is ``plain`` is skipped)."""
    for plan in plans:
        if not plan.plain:
            x = exchange(x, plan.ex, plan.rows, plan.dim)
    return x


def finish(out: Any, x: torch.Tensor) -> Any:
    """``out`` in ``x``'s memory format, carrying ``x``'s epoch (module docstring: why this is the default), told
    to a watching guard as a layer's field (:func:`halo.context.made`)."""
    if isinstance(out, torch.Tensor):
        out = like_format(out, x)
        made(out)
    carry(out, x)
    return out


def adopt(self: nn.Module, module: nn.Module, base: type | None = None, name: str | None = None) -> None:
    """Make ``self`` a copy of ``module``'s module state that shares its Parameters (the same objects).

    Copying the instance dictionary (each container shallowly, on its own, of its own type: hooks' dicts are
    OrderedDicts a handle refers to weakly) keeps parameter and buffer names, so ``state_dict`` keys stay identical
    after ``model.layer = DomainConv2d(model.layer)``, and keeps hooks. With ``base``: ``module`` must be one, must not
    override its ``forward`` (only the standard computation can be made halo-aware), must not be parametrized (wrap
    the plain layer, then parametrize the halo one) nor lazy and uninitialised.
    """
    name = name or type(self).__name__
    if base is not None:
        if not isinstance(module, base):
            raise TypeError(f"{name} wraps a torch.nn.{base.__name__}, got {type(module).__name__}")
        if type(module).forward is not base.forward and not isinstance(module, DomainLayer):
            raise TypeError(f"{name}: {type(module).__name__} overrides forward(); only the standard "
                            f"nn.{base.__name__} computation can be made halo-aware")
        if parametrize.is_parametrized(module):
            raise TypeError(f"{name}: the {base.__name__} is parametrized; wrap the plain layer, then register the "
                            f"parametrization on the {name}")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
            raise ValueError(f"{name}: the lazy layer is not initialised yet; run it once (or build a "
                             f"{base.__name__})")
    nn.Module.__init__(self)
    for key, value in module.__dict__.items():
        self.__dict__[key] = copy.copy(value) if isinstance(value, dict | set | list) else value


class DomainLayer:
    """Mixin of every halo layer (module docstring): its group, site and mesh, its per-axis plans, its exchanges
    and the end of its forward. Put it first among the bases: ``class DomainPixelShuffle(DomainLayer, nn.PixelShuffle)``
    and call :meth:`halo_init` at the end of ``__init__`` (after the torch layer's own)."""

    group = group_attribute()

    def halo_init(self, group: Any | None = None, mesh: DomainMesh | None = None, name: str | None = None) -> None:
        """Set the group, a fresh site and the mesh (checked: a two-axis mesh must shard dims (-2, -1))."""
        name = name or type(self).__name__
        self.group = group
        self._halo_site = Site()
        set_mesh(self, mesh, name)
        mesh2 = mesh_of(self)
        if mesh2 is not None and group is not None and group is not mesh2.domain_group:
            raise ValueError(f"{name}: group= and mesh= name different groups; with a mesh leave group unset")

    @property
    def halo_mesh(self) -> DomainMesh | None:
        """The layer's latitude x longitude mesh, or ``None`` (latitude rows of :attr:`group`)."""
        return mesh_of(self)

    @property
    def halo_axes(self) -> int:
        """How many axes of the field are sharded: 1 (latitude rows) or 2 (a latitude x longitude mesh)."""
        mesh = mesh_of(self)
        return 1 if mesh is None else len(mesh.domain_shape)

    @property
    def domain_group(self) -> Any | None:
        """The group of the whole domain: every rank of the mesh, or :attr:`group` on latitude rows. What a layer
        whose result depends on every grid point (a norm's statistics, a global pool) reduces over, on either
        decomposition, so that it never asks which one it is on."""
        mesh = mesh_of(self)
        return self.group if mesh is None else mesh.domain_group

    def axis_plans(self, x: torch.Tensor, op: str, make: Callable, extra: tuple = (), per_axis: tuple = ()) -> tuple:
        """This call's plan per axis: ``(make(group, H sizes, H dim, *per_axis[0], *extra),)`` on latitude rows,
        ``(that on the H line, make(W line, W sizes, W dim, *per_axis[1], *extra))`` on a mesh — agreed once either
        way, or recalled under the call's epoch. ``make`` must be a module-level pure function (it is part of the
        record's key) that raises alike on every rank. Check ``x``'s shape *after* this call: the agreement makes
        every rank raise alike, a check before it would leave a rank's peers waiting."""
        return run_axes(x, op, make, extra, group=self.group, mesh=mesh_of(self), site=self._halo_site,
                        per_axis=per_axis)

    def exchange_axes(self, x: torch.Tensor, plans: tuple) -> torch.Tensor:
        """Each axis's planned exchange in turn (:func:`exchange_axes`)."""
        return exchange_axes(x, plans)

    def finish(self, out: Any, x: torch.Tensor) -> Any:
        """The output in the input's memory format, carrying its epoch (:func:`finish`)."""
        return finish(out, x)


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloLayer = DomainLayer
