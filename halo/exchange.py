"""Halo exchange: extend a shard by rows of its neighbours, with the exact adjoint as its backward.

Layers (primitive -> autograd.Function -> public function)::

    shard_sizes(x, dim, group)      all ranks' extents along dim, checked once per new shape (a collective)
    Exchanger                       one plan on one rank: start (pack + post isend/irecv), finish, adjoint
    _ExchangeFn                     autograd: forward = finish(start(x)), backward = Exchanger.adjoint
    halo_exchange / _async / _2d    validation, group resolution, halo -> per-rank need ranges

Forward on rank r::   ext = [ before halo | x[interior] | after halo ]     (along dim)
Adjoint::             grad_x = grad_ext[interior] + (halo gradients sent back by the ranks that received
                      rows of x, added at those rows; boundary copies fold back onto their source rows)

Messages are dim-major buffers (``kernels.pack``): rows along ``dim`` outermost, so every message and every
received piece is a contiguous slice. Peers are addressed by their index in the group (``group_peer``),
never by assuming the group starts at global rank 0.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import kernels
from .mesh import DomainMesh, get_domain_parallel_manager, resolve_group
from .partition import POLE_MODES, RankPlan, check_boundary, plan_exchange

__all__ = [
    "HaloHandle",
    "Exchanger",
    "exchange",
    "halo_exchange",
    "halo_exchange_2d",
    "halo_exchange_async",
    "clear_shape_cache",
    "set_validation",
    "shard_sizes",
    "static_shapes",
]

VALIDATION_MODES = ("first", "always")
_validation = "first"


def set_validation(mode: str) -> None:
    """How often ranks cross-check shapes inside :func:`static_shapes`: ``"first"`` (default) or ``"always"``.

    Outside ``static_shapes`` every exchange that has to learn its peers' extents does one small all-gather
    (which also checks that B, C, W, dtype and device agree). Inside it, ``"first"`` does that only the first
    time each position of the call sequence is met; ``"always"`` keeps gathering (a debugging aid).
    """
    global _validation
    if mode not in VALIDATION_MODES:
        raise ValueError(f"unknown validation mode {mode!r}; expected one of {', '.join(VALIDATION_MODES)}")
    _validation = mode


_epochs: list[list] = []  # stack of [tag, position in the call sequence]
_static_cache: dict[tuple, tuple[tuple, tuple[int, ...]]] = {}


@contextlib.contextmanager
def static_shapes(tag: Hashable = "default") -> Iterator[None]:
    """Promise that the code inside makes the same sequence of exchanges, with the same global shapes,
    every time it runs under this ``tag`` (a training step at fixed resolution), so ranks need not re-learn
    each other's extents: after the first run, no collective is spent on shapes.

    Why a promise and not a cache keyed on the local shape: when a global extent changes, some ranks' shards
    can keep their shape (45 rows over 2 ranks is 23 + 22, 44 is 22 + 22), so a per-rank cache would make
    one rank skip the check its peers run, and the group would hang. Keyed on the position in a call sequence
    that every rank walks identically, all ranks hit or miss together. A rank that sees its own shape change
    under a used tag raises an error naming the tag; use a new tag per resolution.
    """
    _epochs.append([tag, 0])
    try:
        yield
    finally:
        _epochs.pop()


def clear_shape_cache() -> None:
    """Forget everything learned under :func:`static_shapes` (call on every rank)."""
    _static_cache.clear()


# -- group bookkeeping ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupInfo:
    group: Any
    size: int
    index: int  # this rank's position in the group
    ranks: tuple[int, ...]  # global ranks in group order


_group_infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_info(group: Any | None) -> GroupInfo:
    """Size and position in ``group`` (default: the manager's domain group; no process group: one rank)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return GroupInfo(None, 1, 0, (0,))
    group = resolve_group(group)
    info = _group_infos.get(group)
    if info is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        info = GroupInfo(group, len(ranks), ranks.index(dist.get_rank()), ranks)
        _group_infos[group] = info
    return info


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_DEVICES = ["cpu", "cuda", "xpu", "mps", "meta"]
_MAX_NDIM = 8


def _describe(meta: list[int], dim: int) -> str:
    ndim = meta[0]
    dims = [str(meta[2 + i]) if i != dim else f"[{meta[2 + i]}]" for i in range(ndim)]
    dtype = _DTYPES[meta[10]] if 0 <= meta[10] < len(_DTYPES) else "other dtype"
    device = _DEVICES[meta[11]] if 0 <= meta[11] < len(_DEVICES) else "other device"
    return f"shape ({', '.join(dims)}) {dtype} on {device}"


def shard_sizes(x: torch.Tensor, dim: int, group: Any | None = None, *, op: str = "halo_exchange",
                allow_empty: bool = False) -> tuple[int, ...]:
    """Every rank's extent of ``x`` along ``dim``, in group order; checks that the ranks agree.

    All other dims, the dtype and the device type must be equal across the group; otherwise every rank
    raises the same ``ValueError`` naming the ranks and shapes. Costs one small all-gather per new local shape
    (or per call with ``set_validation("always")``).
    """
    info = group_info(group)
    ndim = x.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim {dim} is out of range for a {ndim}-d tensor of shape {tuple(x.shape)}")
    dim = dim % ndim
    if info.size == 1:
        if x.shape[dim] == 0 and not allow_empty:
            raise ValueError(f"{op}: the tensor has no rows along dim {dim} (shape {tuple(x.shape)})")
        return (x.shape[dim],)
    if ndim > _MAX_NDIM:
        raise ValueError(f"{op}: at most {_MAX_NDIM} dims are supported, got {ndim}")
    signature = (tuple(x.shape), x.dtype, x.device.type, dim)
    key = None
    if _epochs:
        epoch = _epochs[-1]
        key = (epoch[0], epoch[1], id(info.group))
        epoch[1] += 1
        hit = _static_cache.get(key)
        if hit is not None and _validation == "first":
            if hit[0] != signature:
                raise RuntimeError(
                    f"{op}: under halo.static_shapes({epoch[0]!r}) call {epoch[1] - 1} met shape "
                    f"{tuple(x.shape)} {x.dtype} (dim {dim}) where the first run met {hit[0][0]} {hit[0][1]} "
                    f"(dim {hit[0][3]}); shapes must repeat under one tag: use a new tag per resolution")
            return hit[1]
    dtype_code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    device_code = _DEVICES.index(x.device.type) if x.device.type in _DEVICES else len(_DEVICES)
    meta = [ndim, dim] + list(x.shape) + [0] * (_MAX_NDIM - ndim) + [dtype_code, device_code]
    comm_device = x.device if dist.get_backend(info.group) == "nccl" else torch.device("cpu")
    local = torch.tensor(meta, dtype=torch.int64, device=comm_device)
    gathered = [torch.empty_like(local) for _ in range(info.size)]
    dist.all_gather(gathered, local, group=info.group)
    metas = [g.tolist() for g in gathered]
    ref = metas[0]
    for r, m in enumerate(metas):
        same = m[0] == ref[0] and m[1] == ref[1] and m[10:] == ref[10:] and all(
            m[2 + i] == ref[2 + i] for i in range(m[0]) if i != m[1])
        if not same:
            raise ValueError(
                f"{op}: the ranks of the group disagree: group rank 0 (global {info.ranks[0]}) has "
                f"{_describe(ref, ref[1])}, group rank {r} (global {info.ranks[r]}) has {_describe(m, m[1])}; "
                f"only the extent along the sharded dim [{ref[1]}] may differ")
    sizes = tuple(m[2 + dim] for m in metas)
    if not allow_empty and min(sizes) == 0:
        empty = [r for r, s in enumerate(sizes) if s == 0]
        raise ValueError(
            f"{op}: group ranks {empty} hold no rows along dim {dim} ({sum(sizes)} rows over {info.size} "
            f"ranks, sizes {list(sizes)}); use at most {max(1, sum(sizes))} ranks for this dim")
    if key is not None:
        _static_cache[key] = (signature, sizes)
    return sizes


@functools.lru_cache(maxsize=1024)
def _plan(sizes: tuple[int, ...], needs: tuple[tuple[int, int], ...], boundary: str):
    return plan_exchange(sizes, needs, boundary)


# -- the primitive -----------------------------------------------------------------------------------------

class Exchanger:
    """One rank's part of one exchange plan: pack, post, finish; and the adjoint. No autograd here."""

    def __init__(self, plan: RankPlan, info: GroupInfo, dim: int, boundary: str) -> None:
        self.plan, self.info, self.dim, self.boundary = plan, info, dim, boundary
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
        works = self._post(send, self.send_counts, recv, self.recv_counts)
        return {"send": send, "recv": recv, "works": works}

    def finish(self, x: torch.Tensor, pending: dict) -> torch.Tensor:
        """Wait for the messages and write ``[before | interior | after]`` in one pass."""
        for w in pending["works"]:
            w.wait()
        recv = pending["recv"]
        before = self._assemble(recv, self.plan.before, x)
        after = self._assemble(recv, self.plan.after, x)
        interior = x.narrow(self.dim, *self.plan.interior)
        return kernels.unpack(interior, before, after, self.dim)

    def _post(self, send: torch.Tensor, send_list, recv: torch.Tensor, recv_list) -> list:
        """Post messages (slices of ``send`` to send_list peers, into slices of ``recv``); self-copies inline."""
        me = self.info.index
        ops = []
        sends = _slices(send, [n for _, n in send_list])
        recvs = _slices(recv, [n for _, n in recv_list])
        own = None
        for (peer, _), buf in zip(send_list, sends, strict=True):
            if peer == me:
                own = buf
            elif buf.numel():
                ops.append(dist.P2POp(dist.isend, buf, group=self.info.group, group_peer=peer))
        for (peer, _), buf in zip(recv_list, recvs, strict=True):
            if peer == me:
                buf.copy_(own)
            elif buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, group=self.info.group, group_peer=peer))
        return dist.batch_isend_irecv(ops) if ops else []

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
        works = self._post(grad_recv, self.recv_counts, grad_send, self.send_counts)
        interior = grad_ext.narrow(dim, nb, ni)
        if (i0, ni) != (0, x_shape[dim]):
            full = grad_ext.new_zeros(x_shape)
            full.narrow(dim, i0, ni).copy_(interior)
            interior = full
        for w in works:
            w.wait()
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

def _halo_pair(halo: int | Sequence[int], op: str) -> tuple[int, int]:
    if isinstance(halo, int):
        pair = (halo, halo)
    else:
        pair = tuple(halo)
        if len(pair) != 2 or not all(isinstance(h, int) for h in pair):
            raise ValueError(f"{op}: halo must be an int or a (before, after) pair of ints, got {halo!r}")
    if min(pair) < 0:
        raise ValueError(f"{op}: halo must be non-negative, got {pair}")
    return pair


def make_exchanger(x: torch.Tensor, dim: int, group: Any | None, boundary: str,
                   needs: Sequence[tuple[int, int]] | None = None,
                   halo: tuple[int, int] | None = None, op: str = "halo_exchange",
                   sizes: Sequence[int] | None = None) -> Exchanger:
    """Plan an exchange for ``x``: either per-rank ``needs`` (global virtual rows) or a uniform ``halo``.

    ``sizes``: every rank's extent along ``dim`` if the caller already has them from :func:`shard_sizes`
    (layers do: they need them to compute ``needs``), so shapes are not gathered twice.
    """
    boundary = check_boundary(boundary)
    info = group_info(group)
    ndim = x.dim()
    sizes = tuple(sizes) if sizes is not None else shard_sizes(x, dim, info.group, op=op)
    dim = dim % ndim
    total = sum(sizes)
    if boundary in POLE_MODES:
        if dim == ndim - 1:
            raise ValueError(f"{op}: pole boundary exchanges latitude and rolls the last dim (longitude); "
                             f"it cannot exchange the last dim itself (dim={dim})")
        if x.shape[-1] % 2:
            raise ValueError(f"{op}: pole boundary needs an even number of longitudes to roll by W/2, "
                             f"got W={x.shape[-1]}")
    if needs is None:
        before, after = halo
        if max(before, after) > total:
            raise ValueError(f"{op}: a halo of {max(before, after)} rows is wider than the whole domain "
                             f"({total} rows along dim {dim} over {info.size} ranks)")
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        needs = tuple((offs[r] - before, offs[r + 1] + after) for r in range(info.size))
    plan = _plan(sizes, tuple(tuple(n) for n in needs), boundary)
    return Exchanger(plan.ranks[info.index], info, dim, boundary)


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
    return to the rank owning those rows and are added there.
    """
    pair = _halo_pair(halo, "halo_exchange")
    return exchange(x, make_exchanger(x, dim, group, boundary, halo=pair))


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
    pair = _halo_pair(halo, "halo_exchange_async")
    return HaloHandle(x, make_exchanger(x, dim, group, boundary, halo=pair, op="halo_exchange_async"))


def halo_exchange_2d(x: torch.Tensor, halo_h: int | Sequence[int], halo_w: int | Sequence[int], *,
                     mesh: DomainMesh | None = None, boundary_h: str = "zeros",
                     boundary_w: str | None = None) -> torch.Tensor:
    """Exchange along H over the mesh's first domain axis, then along W over the second, so corners are right.

    ``boundary_w`` defaults to ``circular`` when the mesh's W axis is periodic, else ``zeros``. Pole
    boundaries need the whole longitude circle on each rank, so they are refused when W is sharded.
    """
    if mesh is None:
        manager = get_domain_parallel_manager()
        if manager is None:
            raise RuntimeError("halo_exchange_2d needs mesh=DomainMesh((ph, pw)) or an initialised manager")
        mesh = manager.mesh
    if len(mesh.domain_shape) != 2:
        raise ValueError(f"halo_exchange_2d needs a mesh with two domain axes, got {mesh.domain_shape}")
    if check_boundary(boundary_h) in POLE_MODES and mesh.domain_shape[1] > 1:
        raise ValueError(f"pole boundary needs the full longitude circle on every rank, but W is sharded over "
                         f"{mesh.domain_shape[1]} ranks; use a mesh with one W rank or another boundary")
    if boundary_w is None:
        boundary_w = "circular" if mesh.periodic[1] else "zeros"
    dim_h, dim_w = mesh.shard_dims
    x = halo_exchange(x, halo_h, dim_h, group=mesh.axis_group(0), boundary=boundary_h)
    return halo_exchange(x, halo_w, dim_w, group=mesh.axis_group(1), boundary=boundary_w)
