"""Halo exchange: extend a shard by rows of its neighbours, with the exact adjoint as its backward.

Layers (primitive -> autograd.Function / custom op -> public function)::

    Exchanger                   one plan on one rank: start (pack + post isend/irecv), finish, adjoint. Made once
                                per plan and cached; its message buffers and extended outputs are reused
                                (halo.exchange.exchanger)
    exchanger ids               plans by small int (never reused; an id's spec lives as long as what holds it:
                                the plan's record, its live exchanger, a compiled graph), and the pole step of
                                a latitude axis with longitude sharded, a PoleExchanger behind the same id
                                (halo.exchange._registry)
    _ExchangeFn                 eager autograd: forward = finish(start(x)), backward = Exchanger.adjoint
    halo::exchange (custom op)  the same under torch.compile: opaque to dynamo, extended shape from the plan
                                (halo.exchange._ops, with the order tokens every communicating op reads);
    halo::exchange_halos        the halo rows alone (compute-then-patch under torch.compile: exchange_halos)
    halo::exchange_halos_2d     a block's rows, columns and corners at once (the 2-d compute-then-patch under
                                torch.compile: exchange_halos_2d)
    halo_exchange / _ / _async / _2d    group resolution, agreed validation (halo.plan.plans), halo -> needs

This module is the one import users and layers need: it re-exports the names of the three below it.

Forward on rank r::   ext = [ before halo | x[interior] | after halo ]     (along dim)
Adjoint::             grad_x = grad_ext[interior] + (halo gradients sent back by the ranks that received
                      rows of x, added at those rows; boundary copies fold back onto their source rows)

Messages are dim-major buffers (``kernels.pack``): rows along ``dim`` outermost, so every message and every
received piece is a contiguous slice. Peers are addressed by their index in the group (``group_peer``),
never by assuming the group starts at global rank 0.

Costs of a steady call: no metadata collective (``halo.plan.plans``), no tensor built from Python data (index maps
are made once per plan and device), no fresh buffer when the last one is free (reused when nothing else holds
it), one copy of the shard into the extended output (its floor), and, in a layer's backward, no copy of the
gradient at all (the halo rows' gradients are added into the interior of the incoming gradient in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..dist.comm import CommGroup, HaloCommError, comm_group, get_timeout, set_timeout
from ..dist.mesh import DomainMesh, mesh_coords
from ..dist.transport import BufferPool
from ..plan.partition import POLE_MODES, check_boundary, offsets
from ..plan.plans import carry, resolve, set_validation
from ._ops import (
    backward_order_token,
    communicating,
    exchange_halos_2d_op,
    exchange_halos_op,
    exchange_op,
    order_after,
    order_communication,
    order_devices,
    order_token,
)
from ._registry import (
    LIVE_CAP,
    SPECS_CAP,
    ExchangeRef,
    ExchangeSpec,
    PoleExchanger,
    PoleSpec,
    exchange_ref,
    exchange_spec,
    exchanger_id,
    get_exchanger,
    pole_step,
)
from .exchanger import Exchanger, like_format, memory_format, post_messages

__all__ = [
    "BufferPool",
    "ExchangeRef",
    "ExchangeSpec",
    "LIVE_CAP",
    "backward_order_token",
    "get_exchanger",
    "like_format",
    "memory_format",
    "order_after",
    "order_communication",
    "order_devices",
    "order_token",
    "post_messages",
    "Exchanger",
    "HaloCommError",
    "SPECS_CAP",
    "HaloHandle",
    "PoleExchanger",
    "PoleSpec",
    "communicating",
    "exchange",
    "exchange_halos",
    "exchange_halos_2d",
    "exchange_ref",
    "exchange_spec",
    "exchanger_id",
    "get_timeout",
    "halo_exchange",
    "halo_exchange_",
    "halo_exchange_2d",
    "halo_exchange_async",
    "pole_step",
    "set_timeout",
    "set_validation",
    "static_shapes",
]


# -- autograd ------------------------------------------------------------------------------------------------

class _ExchangeFn(torch.autograd.Function):
    """Forward: the extended shard. Backward: its exact adjoint (``Exchanger.adjoint``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchanger: Exchanger, pending: dict | None) -> torch.Tensor:
        ctx.exchanger, ctx.x_shape = exchanger, x.shape
        if pending is None:
            pending = exchanger.start(x)
        return exchanger.finish(x, pending)

    @staticmethod
    def backward(ctx, grad_ext: torch.Tensor):
        return ctx.exchanger.adjoint(grad_ext, ctx.x_shape), None, None


def exchange(x: torch.Tensor, ex_id: int, rows: int, dim: int = -2) -> torch.Tensor:
    """Run planned exchange ``ex_id`` with autograd; the result has ``rows`` rows along ``dim``.

    Under ``torch.compile`` this is the ``halo::exchange`` custom op.
    """
    if torch.compiler.is_compiling():
        order = order_token(x.device)
        out = exchange_op(x, order, ex_id, dim % x.dim(), rows)
        order_after(order, out)
        return out
    return _ExchangeFn.apply(x, get_exchanger(ex_id), None)


def exchange_halos(x: torch.Tensor, ex_id: int, halos: tuple[int, int], dim: int = -2) -> torch.Tensor:
    """The halo rows alone of planned exchange ``ex_id`` (``halos``: its rows before and after ``x`` along ``dim``),
    ``[before | after]`` along ``dim``, with autograd: compute-then-patch's exchange as a compile-visible op.

    The ``halo::exchange_halos`` custom op (its adjoint ``halo::exchange_halos_adjoint`` sends the halo rows'
    gradients back and returns those of the rows this rank sent, which plain ops add onto ``x``'s gradient), ordered
    as every communicating op (:func:`order_after`). Eager layers use their own ``autograd.Function``
    (``DomainConv2d``'s compute-then-patch posts before its conv and waits after it); this is the form a compiled
    graph holds.
    """
    order = order_token(x.device)
    out = exchange_halos_op(x, order, ex_id, dim % x.dim(), int(halos[0]), int(halos[1]))
    if torch.compiler.is_compiling():
        order_after(order, out)
    return out


def exchange_halos_2d(x: torch.Tensor, ex_h: int, ex_w: int, ex_c: int,
                      pads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The halos of a latitude x longitude block ``x`` (``(B, C, h, w)``) on both axes, with autograd: ``(rows,
    cols, corners)``, the ``p_h`` rows before and after it along H (exchange ``ex_h``, a :func:`pole_step` across a
    pole), the ``p_w`` columns before and after it along W (``ex_w``), and the corners, the W exchange ``ex_c`` of
    the rows (``pads = (p_h, p_w)``). The ``halo::exchange_halos_2d`` custom op: the 2-d compute-then-patch's
    exchange as one compile-visible op (two sync points each way, as eager's), ordered as every communicating op."""
    order = order_token(x.device)
    out = exchange_halos_2d_op(x, order, int(ex_h), int(ex_w), int(ex_c), int(pads[0]), int(pads[1]))
    if torch.compiler.is_compiling():
        order_after(order, out[2])
    return out


# -- public API -------------------------------------------------------------------------------------------------

class HaloPlan(NamedTuple):
    """A uniform-halo exchange as planned for this rank: exchanger id and the extended extent."""

    ex: int
    dim: int
    rows: int


def _uniform_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], dim: int, halo: Any, boundary: str,
                  ndim: int, width: int, op: str) -> HaloPlan:
    """The plan of ``halo_exchange``: checks that depend on agreed values only, so they fail on every rank alike."""
    (sizes,) = extents
    boundary = check_boundary(boundary)
    dim = dim % ndim
    before, after = (halo, halo) if isinstance(halo, int) else halo
    total = sum(sizes)
    if boundary in POLE_MODES:
        if dim == ndim - 1:
            raise ValueError(f"{op}: pole boundary exchanges latitude and rolls the last dim (longitude); "
                             f"it cannot exchange the last dim itself (dim={dim})")
        if width % 2:
            raise ValueError(f"{op}: pole boundary needs an even number of longitudes to roll by W/2, "
                             f"got W={width}")
    if max(before, after) > total:
        raise ValueError(f"{op}: a halo of {max(before, after)} rows is wider than the whole domain "
                         f"({total} rows along dim {dim} over {cg.size} ranks); expected at most {total}")
    offs = offsets(sizes)
    needs = tuple((offs[r] - before, offs[r + 1] + after) for r in range(cg.size))
    ex_id = exchanger_id(cg, dim, sizes, needs, boundary, op)
    return HaloPlan(ex_id, dim, needs[cg.index][1] - needs[cg.index][0])


def _halo_arg(halo: Any) -> Any:
    return tuple(halo) if isinstance(halo, list) else halo


def _plan_uniform(x: torch.Tensor, halo: Any, dim: Any, group: Any, boundary: Any, op: str,
                  source: torch.Tensor | None = None) -> HaloPlan:
    halo = _halo_arg(halo)
    width = x.shape[-1] if x.dim() else 0
    return resolve(x, group, op, _uniform_plan, (dim, halo, boundary, x.dim(), width, op),
                   spec=(dim, halo, boundary), source=source)


def halo_exchange(x: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *, group: Any | None = None,
                  boundary: str = "zeros") -> torch.Tensor:
    """Return the local shard extended by ``halo`` rows of its neighbours along ``dim``.

    Args:
        x: this rank's shard; ranks of ``group`` (in group order) hold consecutive slabs along ``dim``.
        halo: rows on both sides, or ``(before, after)``; may exceed a neighbour's shard (rows then come from
            further ranks) but not the whole domain.
        group: the domain group along ``dim``; default the initialised manager's domain group.
        boundary: what fills rows beyond the first and last rank: ``zeros``, ``replicate``, ``reflect``,
            ``circular`` (= ``periodic``), ``pole`` / ``pole_centered`` (across the pole, rolled by W/2).

    With one rank this is ``F.pad`` (and the pole construction). Backward is the exact adjoint: halo gradients
    return to the rank owning those rows and are added there. The first call under an epoch (``halo.plan.plans``)
    agrees on every rank's arguments, so a wrong argument on any rank raises the same error on every rank; waits
    are bounded (:func:`halo.set_timeout`).
    """
    plan = _plan_uniform(x, halo, dim, group, boundary, "halo_exchange")
    out = exchange(x, plan.ex, plan.rows, plan.dim)
    carry(out, x)
    return out


@torch._dynamo.disable  # in place, from Python (no custom op): eager, a graph break under torch.compile
def halo_exchange_(ext: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *, group: Any | None = None,
                   boundary: str = "zeros") -> torch.Tensor:
    """In place: fill the halo rows of an extended buffer whose middle rows hold this rank's shard.

    ``ext`` has ``before + n + after`` rows along ``dim``, the shard in rows ``[before, before + n)``; the
    ``before`` first and ``after`` last rows are overwritten with the neighbours' rows (or the boundary fill)
    and ``ext`` is returned. No copy of the shard is made, so the wire is this form's floor (the out-of-place
    :func:`halo_exchange` also pays one copy of the shard). Not differentiable: for inference and rollouts,
    or a layer that owns its buffer; use :func:`halo_exchange` under autograd.

    A buffer made by :func:`halo_exchange` of a shard halo made (``ext = halo_exchange(halo.shard(x), 1)``, then
    ``ext`` refilled in place step after step) keeps that shard's epoch: after its first call, no agreement.
    """
    # Form the shard view locally where the arguments allow; otherwise hand the agreement something it will
    # refuse on every rank (a malformed halo or dim is named by it; a buffer thinner than its halo shows up as a
    # rank with no rows), so that no rank raises alone.
    x = ext
    halo = _halo_arg(halo)
    pair = (halo, halo) if isinstance(halo, int) else halo if isinstance(halo, tuple) else None
    if pair is not None and len(pair) == 2 and all(isinstance(h, int) and h >= 0 for h in pair) \
            and isinstance(dim, int) and -ext.dim() <= dim < ext.dim():
        n = ext.shape[dim] - pair[0] - pair[1]
        x = ext.narrow(dim, pair[0], n) if n >= 0 else ext.narrow(dim, 0, 0)
    plan = _plan_uniform(x, halo, dim, group, boundary, "halo_exchange_", source=ext)
    if torch.is_grad_enabled() and ext.requires_grad:  # after the agreement: the same verdict on every rank
        raise RuntimeError("halo_exchange_ writes in place and is not differentiable; use halo_exchange (which "
                           "returns a new tensor) under autograd, or call this under torch.no_grad()")
    ex = get_exchanger(plan.ex)
    with torch.no_grad():
        ex.finish(x, ex.start(x), out=ext)
    return ext


class HaloHandle:
    """An exchange in flight: ``wait()`` returns the extended shard (differentiable w.r.t. ``x``).

    Under ``torch.compile`` its start and its wait are graph breaks (run eagerly, in program order on every rank:
    Python posting and waiting is never traced into a graph, where nothing would order it); for an exchange inside
    a compiled graph use :func:`halo_exchange` (the ordered ``halo::exchange`` custom op)."""

    @torch._dynamo.disable  # posts from Python (no custom op): eager, a graph break under torch.compile
    def __init__(self, x: torch.Tensor, ex_id: int) -> None:
        self._x, self._exchanger = x, get_exchanger(ex_id)
        self._pending: dict | None = self._exchanger.start(x.detach())
        self._result: torch.Tensor | None = None

    @torch._dynamo.disable  # waits from Python: eager, a graph break under torch.compile
    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = _ExchangeFn.apply(self._x, self._exchanger, self._pending)
            self._pending = None
            carry(self._result, self._x)
        return self._result


def halo_exchange_async(x: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *,
                        group: Any | None = None, boundary: str = "zeros") -> HaloHandle:
    """Start :func:`halo_exchange` now and return a handle; compute on ``x`` meanwhile, then ``wait()``."""
    plan = _plan_uniform(x, halo, dim, group, boundary, "halo_exchange_async")
    return HaloHandle(x, plan.ex)


class Exchange2d(NamedTuple):
    """An exchange of a latitude x longitude block as planned for this rank (:func:`plan_exchange_2d`): along H over
    the mesh's H group (exchanger id, a :func:`pole_step` across a pole; extended rows), then along W over the W
    group (exchanger id, extended columns)."""

    h: int
    h_rows: int
    w: int
    w_rows: int
    dims: tuple[int, int]


def plan_exchange_2d(groups: tuple[Any, Any], sizes: tuple[tuple[int, ...], tuple[int, ...]],
                     needs: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]], boundaries: tuple[str, str],
                     dims: tuple[int, int], op: str) -> Exchange2d:
    """Plan an exchange along H then W of a 2-D mesh (pure in its agreed arguments: raises alike on every rank).

    ``groups``: the H and W axis groups; ``sizes[k]`` / ``needs[k]``: the extents of the ranks of this rank's line
    along axis ``k`` and the virtual rows each needs (as :func:`exchanger_id`); ``dims``: the tensor dims of H and
    W (non-negative). Exchanging H first and then W of the H-extended block fills the corners right; a pole
    boundary in H is the latitude step of :func:`pole_step`.
    """
    cg_h, cg_w = comm_group(groups[0]), comm_group(groups[1])
    h = exchanger_id(cg_h, dims[0], sizes[0], needs[0], boundaries[0], op)
    h = pole_step(h, groups[1], sizes[1], dims[1])
    lo_h, hi_h = needs[0][cg_h.index]
    lo_w, hi_w = needs[1][cg_w.index]
    return Exchange2d(h, hi_h - lo_h, exchanger_id(cg_w, dims[1], sizes[1], needs[1], boundaries[1], op),
                      hi_w - lo_w, dims)


def exchange_2d(x: torch.Tensor, plan: Exchange2d) -> torch.Tensor:
    """Run a planned :class:`Exchange2d` with autograd (each step an exact-adjoint exchange)."""
    dh, dw = plan.dims
    return exchange(exchange(x, plan.h, plan.h_rows, dh), plan.w, plan.w_rows, dw)


def _plan_2d(cg: CommGroup, extents: tuple, groups: tuple, dims: tuple, halos: tuple, boundaries: tuple,
             ndim: int, op: str) -> Exchange2d:
    needs = []
    for sizes, d, halo in zip(extents, dims, halos, strict=True):
        before, after = (halo, halo) if isinstance(halo, int) else halo
        total = sum(sizes)
        if max(before, after) > total:
            raise ValueError(f"{op}: a halo of {max(before, after)} rows is wider than the whole domain "
                             f"({total} rows along dim {d} over {len(sizes)} ranks); expected at most {total}")
        offs = offsets(sizes)
        needs.append(tuple((offs[r] - before, offs[r + 1] + after) for r in range(len(sizes))))
    return plan_exchange_2d(groups, extents, tuple(needs), boundaries, tuple(d % ndim for d in dims), op)


def halo_exchange_2d(x: torch.Tensor, halo_h: int | Sequence[int], halo_w: int | Sequence[int], *,
                     mesh: DomainMesh | None = None, boundary_h: str = "zeros",
                     boundary_w: str | None = None) -> torch.Tensor:
    """Exchange along H over the mesh's first domain axis, then along W over the second, so corners are right.

    ``boundary_w`` defaults to ``circular`` when the mesh's W axis is periodic, else ``zeros``. A pole boundary
    in H works with W sharded too: the rows across the pole are rolled by W/2 around the whole circle by one more
    exchange along W (:func:`plan_exchange_2d`). Both exchanges are validated by one agreement over the whole
    domain group, so every rank of the domain raises the same error.
    """
    op = "halo_exchange_2d"
    if mesh is None:  # (the domain-parallel manager's mesh has one domain axis: never a fallback)
        raise RuntimeError(f"{op} needs mesh=halo.DomainMesh((ph, pw)), built on every rank after "
                           f"torch.distributed.init_process_group()")
    if len(mesh.domain_shape) != 2:
        raise ValueError(f"{op} needs a mesh with two domain axes, got {mesh.domain_shape}; build one with "
                         f"halo.DomainMesh((ph, pw))")
    if boundary_w is None:
        boundary_w = "circular" if mesh.periodic[1] else "zeros"
    halo_h, halo_w = _halo_arg(halo_h), _halo_arg(halo_w)
    coords = mesh_coords(tuple(mesh.domain_shape))
    dims = mesh.shard_dims
    specs = ((dims[0], halo_h, boundary_h), (dims[1], halo_w, boundary_w))
    extra = ((mesh.axis_group(0), mesh.axis_group(1)), dims, (halo_h, halo_w), (boundary_h, boundary_w), x.dim(), op)
    plan = resolve(x, mesh.domain_group, op, _plan_2d, extra, spec=specs, coords=coords)
    out = exchange_2d(x, plan)
    carry(out, x)
    return out


# -- kept for old callers -----------------------------------------------------------------------------------------

class static_shapes:  # noqa: N801 - the name of the context manager it replaces
    """No longer needed, kept as a harmless no-op: every halo op learns its peers' extents once per epoch on its
    own (``halo.plan.plans``). ``with halo.static_shapes(tag):`` runs its body unchanged."""

    def __init__(self, tag: Any = "default") -> None:
        self.tag = tag

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
