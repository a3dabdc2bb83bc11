"""Halo exchange: extend a shard by rows of its neighbours, with the exact adjoint as its backward.

Layers (primitive -> autograd.Function -> public function)::

    shard_sizes(x, dim, group)      all ranks' extents along dim, agreed on by one small all-gather
    Exchanger                       one plan on one rank: start (pack + post isend/irecv), finish, adjoint
    _ExchangeFn                     autograd: forward = finish(start(x)), backward = Exchanger.adjoint
    halo_exchange / _async / _2d    group resolution, agreed validation, halo -> per-rank need ranges

Forward on rank r::   ext = [ before halo | x[interior] | after halo ]     (along dim)
Adjoint::             grad_x = grad_ext[interior] + (halo gradients sent back by the ranks that received
                      rows of x, added at those rows; boundary copies fold back onto their source rows)

Messages are dim-major buffers (``kernels.pack``): rows along ``dim`` outermost, so every message and every
received piece is a contiguous slice. Peers are addressed by their index in the group (``group_peer``),
never by assuming the group starts at global rank 0.

Faults: every argument is agreed on by all ranks before any message, and every wait is bounded
(``halo.agree``, whose names are re-exported here).
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import kernels
from .agree import (
    GroupInfo,
    HaloCommError,
    _abandoned,
    _agree,
    _comm_error,
    _local_problem,
    _Meta,
    _needs_grad,
    _Spec,
    _timeout,
    _wait,
    clear_shape_cache,
    get_timeout,
    group_info,
    set_timeout,
    set_validation,
    shard_sizes,
    static_shapes,
)
from .mesh import DomainMesh, get_domain_parallel_manager
from .partition import POLE_MODES, RankPlan, check_boundary, plan_exchange

__all__ = [
    "HaloCommError",
    "HaloHandle",
    "Exchanger",
    "exchange",
    "get_timeout",
    "halo_exchange",
    "halo_exchange_",
    "halo_exchange_2d",
    "halo_exchange_async",
    "clear_shape_cache",
    "set_timeout",
    "set_validation",
    "shard_sizes",
    "static_shapes",
]

@functools.lru_cache(maxsize=1024)
def _plan(sizes: tuple[int, ...], needs: tuple[tuple[int, int], ...], boundary: str):
    return plan_exchange(sizes, needs, boundary)


# -- the primitive -----------------------------------------------------------------------------------------

class Exchanger:
    """One rank's part of one exchange plan: pack, post, finish; and the adjoint. No autograd here.

    Every wait is bounded (:func:`set_timeout`) and a failed or late message raises :class:`HaloCommError`
    naming the peer; the buffers of a message given up on are kept alive (a late peer may still write).
    """

    def __init__(self, plan: RankPlan, info: GroupInfo, dim: int, boundary: str,
                 op: str = "halo_exchange") -> None:
        self.plan, self.info, self.dim, self.boundary, self.op = plan, info, dim, boundary, op
        # (peer, rows) of every message, both directions; the adjoint swaps them.
        self.send_counts = tuple((q, sum(n for _, n in runs)) for q, runs in plan.sends)
        self.recv_counts = plan.recvs

    # forward ------------------------------------------------------------------------------------------
    def start(self, x: torch.Tensor) -> dict:
        """Pack every outgoing message in one pass and post all sends and receives; do not wait."""
        p = self.plan
        rest = [s for i, s in enumerate(x.shape) if i != self.dim]
        send = kernels.pack(x, self.dim, p.send_ranges)
        recv = x.new_empty((p.recv_rows, *rest))
        works, labels = self._post(send, self.send_counts, recv, self.recv_counts)
        return {"send": send, "recv": recv, "works": works, "labels": labels, "posted": time.monotonic()}

    def finish(self, x: torch.Tensor, pending: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        """Wait for the messages and write ``[before | interior | after]`` in one pass (into ``out`` if given;
        if ``x`` is ``out``'s middle already, only the halo rows are written)."""
        _wait(pending["works"], pending["labels"], self.info, self.op, pending["posted"], pending)
        pending["works"] = ()  # finished requests are not kept
        recv = pending["recv"]
        before = self._assemble(recv, self.plan.before, x)
        after = self._assemble(recv, self.plan.after, x)
        interior = x.narrow(self.dim, *self.plan.interior)
        return kernels.unpack(interior, before, after, self.dim, out)

    def _post(self, send: torch.Tensor, send_list, recv: torch.Tensor, recv_list) -> tuple[list, list[str]]:
        """Post messages (slices of ``send`` to send_list peers, into slices of ``recv``); self-copies inline.

        Returns the requests and, per request, who it talks to (global ranks, for error messages).
        """
        me, ranks = self.info.index, self.info.ranks
        ops, labels = [], []
        sends = _slices(send, [n for _, n in send_list])
        recvs = _slices(recv, [n for _, n in recv_list])
        own = None
        for (peer, _), buf in zip(send_list, sends, strict=True):
            if peer == me:
                own = buf
            elif buf.numel():
                ops.append(dist.P2POp(dist.isend, buf, group=self.info.group, group_peer=peer))
                labels.append(f"send to global rank {ranks[peer]}")
        for (peer, _), buf in zip(recv_list, recvs, strict=True):
            if peer == me:
                buf.copy_(own)
            elif buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, group=self.info.group, group_peer=peer))
                labels.append(f"recv from global rank {ranks[peer]}")
        if not ops:
            return [], []
        posted = time.monotonic()
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001 - a peer already gone can fail the post itself
            _abandoned.append((send, recv))
            raise _comm_error([" and ".join(labels)], 0, self.info, f"{self.op} (posting)", posted, posted, _timeout,
                              exc) from exc
        if len(works) != len(ops):  # coalesced (NCCL): one request for the whole batch
            labels = [" and ".join(labels)] * len(works)
        return works, labels

    def _assemble(self, recv: torch.Tensor, rows, x: torch.Tensor) -> torch.Tensor:
        """Halo rows (dim-major) from the receive buffer: a slice when they are in order, else a gather."""
        n = len(rows)
        idx = [i for i, _ in rows]
        rolled = [r for _, r in rows]
        if n and idx[0] >= 0 and idx == list(range(idx[0], idx[0] + n)) and not any(rolled):
            return recv[idx[0]:idx[0] + n]
        if all(i < 0 for i in idx):
            return recv.new_zeros((n, *recv.shape[1:]))
        index = torch.tensor([max(i, 0) for i in idx], device=recv.device)
        out = recv.index_select(0, index)
        zero = [k for k, i in enumerate(idx) if i < 0]
        if zero:
            out[zero] = 0
        if any(rolled):
            k = torch.tensor([k for k, r in enumerate(rolled) if r], device=recv.device)
            out[k] = out[k].roll(out.shape[-1] // 2, dims=-1)
        return out

    # adjoint ------------------------------------------------------------------------------------------
    def adjoint(self, grad_ext: torch.Tensor, x_shape: torch.Size) -> torch.Tensor:
        """``grad_x``: the interior gradient plus the halo gradients sent back to the rows' owners."""
        p, dim = self.plan, self.dim
        nb, (i0, ni) = len(p.before), p.interior
        rest = [s for i, s in enumerate(grad_ext.shape) if i != dim]
        grad_recv = grad_ext.new_zeros((p.recv_rows, *rest))
        for rows, start in ((p.before, 0), (p.after, nb + ni)):
            if rows:
                g = kernels.pack(grad_ext, dim, [(start, len(rows))])
                self._assemble_adjoint(g, rows, grad_recv)
        grad_send = grad_ext.new_empty((sum(n for _, n in p.send_ranges), *rest))
        # Reverse traffic: what this rank received goes back to the sender and vice versa.
        posted = time.monotonic()
        works, labels = self._post(grad_recv, self.recv_counts, grad_send, self.send_counts)
        interior = grad_ext.narrow(dim, nb, ni)
        if (i0, ni) != (0, x_shape[dim]):
            full = grad_ext.new_zeros(x_shape)
            full.narrow(dim, i0, ni).copy_(interior)
            interior = full
        _wait(works, labels, self.info, f"{self.op} (backward)", posted, (grad_recv, grad_send, works))
        if not p.send_ranges:
            return interior
        return kernels.pack_adjoint(interior, dim, p.send_ranges, grad_send)

    @staticmethod
    def _assemble_adjoint(g: torch.Tensor, rows, grad_recv: torch.Tensor) -> None:
        idx = [i for i, _ in rows]
        rolled = [r for _, r in rows]
        if any(rolled):
            k = torch.tensor([k for k, r in enumerate(rolled) if r], device=g.device)
            g[k] = g[k].roll(-(g.shape[-1] // 2), dims=-1)
        keep = [k for k, i in enumerate(idx) if i >= 0]
        if keep:
            grad_recv.index_add_(0, torch.tensor([idx[k] for k in keep], device=g.device),
                                 g[keep] if len(keep) < len(idx) else g)


def _slices(buf: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    out, at = [], 0
    for n in counts:
        out.append(buf[at:at + n])
        at += n
    return out


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


# -- public API ---------------------------------------------------------------------------------------------

def make_exchanger(x: torch.Tensor, dim: int, group: Any | None, boundary: str,
                   needs: Sequence[tuple[int, int]] | None = None,
                   halo: int | Sequence[int] | None = None, op: str = "halo_exchange",
                   sizes: Sequence[int] | None = None) -> Exchanger:
    """Plan an exchange for ``x``: either per-rank ``needs`` (global virtual rows) or a uniform ``halo``.

    Without ``sizes``, one all-gather (see :func:`static_shapes`) makes every rank agree on the shapes and on
    ``dim``, ``halo`` / ``needs``, ``boundary`` and whether a backward is recorded, so a bad or mismatched
    argument raises the same error on every rank. ``sizes``: every rank's extent along ``dim`` if the caller
    already has them from :func:`shard_sizes` (layers do: they need them to compute ``needs``), so shapes are
    not gathered twice; the caller then vouches that the other arguments are the same on every rank.
    """
    if needs is None and halo is None:
        raise ValueError(f"{op}: pass halo=... or needs=... to plan an exchange")
    info = group_info(group)
    if sizes is None:
        spec = _Spec.of(dim, halo=halo if needs is None else None, boundary=boundary, needs=needs)
        (sizes,) = _agree(x, info, (spec,), op, grad=_needs_grad(x))
    else:
        spec = _Spec.of(dim, halo=halo if needs is None else None, boundary=boundary)
        problem = _local_problem(_Meta.of(x, (spec,), -1), math.inf)
        if problem:
            raise ValueError(f"{op}: on global rank {info.ranks[info.index]}, {problem}")
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != info.size:
            raise ValueError(f"{op}: sizes has {len(sizes)} entries for a group of {info.size} ranks")
    boundary = check_boundary(boundary)
    ndim = x.dim()
    dim = dim % ndim
    total = sum(sizes)
    # Everything below depends only on agreed values: it fails identically on every rank.
    if boundary in POLE_MODES:
        if dim == ndim - 1:
            raise ValueError(f"{op}: pole boundary exchanges latitude and rolls the last dim (longitude); "
                             f"it cannot exchange the last dim itself (dim={dim})")
        if x.shape[-1] % 2:
            raise ValueError(f"{op}: pole boundary needs an even number of longitudes to roll by W/2, "
                             f"got W={x.shape[-1]}")
    if needs is None:
        before, after = spec.before, spec.after
        if max(before, after) > total:
            raise ValueError(f"{op}: a halo of {max(before, after)} rows is wider than the whole domain "
                             f"({total} rows along dim {dim} over {info.size} ranks); expected at most {total}")
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        needs = tuple((offs[r] - before, offs[r + 1] + after) for r in range(info.size))
    try:
        plan = _plan(sizes, tuple((int(lo), int(hi)) for lo, hi in needs), boundary)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    return Exchanger(plan.ranks[info.index], info, dim, boundary, op)


def exchange(x: torch.Tensor, exchanger: Exchanger) -> torch.Tensor:
    """Run a planned exchange with autograd (used by the layers, which compute their own needs)."""
    return _ExchangeFn.apply(x, exchanger, None)


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
    return to the rank owning those rows and are added there. Arguments are validated after one all-gather,
    so a wrong argument on any rank raises the same error on every rank; waits are bounded
    (:func:`set_timeout`).
    """
    return exchange(x, make_exchanger(x, dim, group, boundary, halo=halo))


def halo_exchange_(ext: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *, group: Any | None = None,
                   boundary: str = "zeros") -> torch.Tensor:
    """In place: fill the halo rows of an extended buffer whose middle rows hold this rank's shard.

    ``ext`` has ``before + n + after`` rows along ``dim``, the shard in rows ``[before, before + n)``; the
    ``before`` first and ``after`` last rows are overwritten with the neighbours' rows (or the boundary fill)
    and ``ext`` is returned. No copy of the shard is made, so the wire is this form's floor (the out-of-place
    :func:`halo_exchange` also pays one copy of the shard). Not differentiable: for inference and rollouts,
    or a layer that owns its buffer; use :func:`halo_exchange` under autograd.
    """
    # Form the shard view locally where the arguments allow; otherwise hand the agreement something it will
    # refuse on every rank (a malformed halo or dim is named by it; a buffer thinner than its halo shows up as a
    # rank with no rows), so that no rank raises alone.
    x = ext
    pair = (halo, halo) if isinstance(halo, int) else tuple(halo) if isinstance(halo, (tuple, list)) else None
    if pair is not None and len(pair) == 2 and all(isinstance(h, int) and h >= 0 for h in pair) \
            and -ext.dim() <= dim < ext.dim():
        n = ext.shape[dim] - pair[0] - pair[1]
        x = ext.narrow(dim, pair[0], n) if n >= 0 else ext.narrow(dim, 0, 0)
    exchanger = make_exchanger(x, dim, group, boundary, halo=halo, op="halo_exchange_")
    if torch.is_grad_enabled() and ext.requires_grad:  # after the agreement: the same verdict on every rank
        raise RuntimeError("halo_exchange_ writes in place and is not differentiable; use halo_exchange (which "
                           "returns a new tensor) under autograd, or call this under torch.no_grad()")
    with torch.no_grad():
        exchanger.finish(x, exchanger.start(x), out=ext)
    return ext


class HaloHandle:
    """An exchange in flight: ``wait()`` returns the extended shard (differentiable w.r.t. ``x``)."""

    def __init__(self, x: torch.Tensor, exchanger: Exchanger) -> None:
        self._x, self._exchanger = x, exchanger
        self._pending: dict | None = exchanger.start(x.detach())
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = _ExchangeFn.apply(self._x, self._exchanger, self._pending)
            self._pending = None
        return self._result


def halo_exchange_async(x: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *,
                        group: Any | None = None, boundary: str = "zeros") -> HaloHandle:
    """Start :func:`halo_exchange` now and return a handle; compute on ``x`` meanwhile, then ``wait()``."""
    return HaloHandle(x, make_exchanger(x, dim, group, boundary, halo=halo, op="halo_exchange_async"))


_mesh_coords_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mesh_coords(mesh: DomainMesh, info: GroupInfo) -> list[tuple[int, int]]:
    """``(h, w)`` of every member of the mesh's domain group, in group order."""
    coords = _mesh_coords_cache.get(mesh)
    if coords is None:
        where = {g: (h, w) for block in mesh.layout.tolist() for h, row in enumerate(block)
                 for w, g in enumerate(row)}
        coords = [where[g] for g in info.ranks]
        _mesh_coords_cache[mesh] = coords
    return coords


def halo_exchange_2d(x: torch.Tensor, halo_h: int | Sequence[int], halo_w: int | Sequence[int], *,
                     mesh: DomainMesh | None = None, boundary_h: str = "zeros",
                     boundary_w: str | None = None) -> torch.Tensor:
    """Exchange along H over the mesh's first domain axis, then along W over the second, so corners are right.

    ``boundary_w`` defaults to ``circular`` when the mesh's W axis is periodic, else ``zeros``. Pole
    boundaries need the whole longitude circle on each rank, so they are refused when W is sharded. Both
    exchanges are validated by one all-gather over the whole domain group, so every rank of the domain
    raises the same error.
    """
    op = "halo_exchange_2d"
    if mesh is None:
        manager = get_domain_parallel_manager()
        if manager is None:
            raise RuntimeError(f"{op}: no mesh given and no domain-parallel manager initialised: pass "
                               f"mesh=halo.DomainMesh((ph, pw)), built on every rank after "
                               f"torch.distributed.init_process_group()")
        mesh = manager.mesh
    if len(mesh.domain_shape) != 2:
        raise ValueError(f"{op} needs a mesh with two domain axes, got {mesh.domain_shape}; build one with "
                         f"halo.DomainMesh((ph, pw))")
    if boundary_w is None:
        boundary_w = "circular" if mesh.periodic[1] else "zeros"
    dim_h, dim_w = mesh.shard_dims
    info = group_info(mesh.domain_group)
    specs = (_Spec.of(dim_h, halo_h, boundary_h), _Spec.of(dim_w, halo_w, boundary_w))
    sizes_h, sizes_w = _agree(x, info, specs, op, grad=_needs_grad(x), coords=_mesh_coords(mesh, info))
    if check_boundary(boundary_h) in POLE_MODES and mesh.domain_shape[1] > 1:
        raise ValueError(f"{op}: pole boundary needs the full longitude circle on every rank, but W is sharded "
                         f"over {mesh.domain_shape[1]} ranks; use a mesh with one W rank or another boundary")
    x = exchange(x, make_exchanger(x, dim_h, mesh.axis_group(0), boundary_h, halo=halo_h, op=op, sizes=sizes_h))
    return exchange(x, make_exchanger(x, dim_w, mesh.axis_group(1), boundary_w, halo=halo_w, op=op, sizes=sizes_w))
