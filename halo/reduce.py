"""Domain reductions, latitude-weighted losses and gradient sync: autograd-aware, exact, fp32 accumulation.

Two kinds of reduction, two adjoints (invariant 3). The dot-product tests in ``tests/test_reduce.py`` measure
a value with the inner product of its kind: *per-rank* ``<S, y> = sum_r <S_r, y_r>``, *replicated*
``<S, y> = mean_r <S_r, y_r>`` (the copies are one value), *sharded* ``<x, y> = sum_r <x_r, y_r>``::

    op                      output (every rank)            kind         backward on rank r (the exact adjoint)
    all_reduce(x, "sum")    S = sum_q x_q                  per-rank     sum_q g_q
    all_reduce(x, "mean")   S / P                          per-rank     sum_q g_q / P
    all_reduce(x, "max")    max_q x_q (elementwise)        per-rank     [x_r == max] / (#ties) * sum_q g_q
    domain_sum(x)           sum of the global field        replicated   mean_q g_q
    domain_mean(x)          that / N (global count)        replicated   mean_q g_q / N
    latitude_weighted_*     domain_mean(w(lat) * ...)      replicated   the same, times w(lat)

``all_reduce`` is the primitive used *inside* layers (norm statistics): every rank uses the result in its own
downstream computation, so the gradients arriving on the ranks differ and all of them flow back (plain adjoint).
``domain_*`` and the latitude-weighted losses return one value *replicated* on every rank of the domain group
and count it once: the training objective is the global loss, held P times. Their backward is the adjoint
under the inner product that counts replicated copies once, i.e. the mean over ranks of the incoming
gradients (one all-reduce of a few numbers), which is the incoming gradient itself when, as usual, every rank
calls ``loss.backward()`` on the same loss. With that, each rank's parameter gradient is its own part of the
global gradient, and

    loss = latitude_weighted_mse(pred, target); loss.backward(); sync_domain_gradients(model)

(sum over the domain group, mean over the data-parallel group) gives exactly the unsharded gradient of the
mean loss over the full batch. A term that is *not* a domain reduction (a weight penalty computed on every
rank) is summed P times by the sync: divide it by the domain size, or add its gradient after the sync.

Precision (invariant 5): bf16/fp16 values are summed in fp32 (float64 for cross-rank sums of a few numbers);
``domain_*`` and the losses return fp32 for half inputs, the input dtype otherwise; ``all_reduce`` returns the
input dtype. Collectives must be called by every rank of the group in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import context
from .comm import CommGroup, all_gather_object, comm_group, gather_words, group_by_id, group_id
from .comm import all_reduce as bounded_all_reduce
from .mesh import DomainParallelManager, get_domain_parallel_manager, mesh_2d, mesh_coords
from .partition import local_range
from .plans import resolve, shard_sizes

__all__ = [
    "accumulation_dtype",
    "all_reduce",
    "domain_sum",
    "domain_mean",
    "grid_latitudes",
    "latitude_weights",
    "local_latitude_weights",
    "latitude_weighted_mean",
    "latitude_weighted_mse",
    "sync_domain_gradients",
    "grad_norm",
    "clip_grad_norm_",
]

REDUCE_OPS = ("sum", "mean", "max", "min")
_HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 (invariant 5), the dtype itself otherwise."""
    return torch.float32 if dtype in _HALF else dtype


# -- all_reduce: the plain-adjoint primitive -------------------------------------------------------------------

class _AllReduceFn(torch.autograd.Function):
    """Forward: sum/mean/max/min over ranks. Backward: the transposed Jacobian, ``sum_q g_q`` (scaled by
    ``1/P`` for mean, routed to the maxima — split evenly over ties, as ``torch.amax`` — for max/min)."""

    @staticmethod
    def forward(ctx, x, op, info):
        acc = accumulation_dtype(x.dtype)
        buf = x.detach().to(acc, copy=True)
        reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM)
        bounded_all_reduce(buf, info, "all_reduce", reduce_op)
        if op == "mean":
            buf.div_(info.size)
        if op in ("max", "min") and ctx.needs_input_grad[0]:
            ctx.save_for_backward(x.detach().to(acc) == buf)
        ctx.op, ctx.info, ctx.acc = op, info, acc
        return buf.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        info = ctx.info
        buf = grad.to(ctx.acc, copy=True)
        bounded_all_reduce(buf, info, "all_reduce (backward)")
        if ctx.op == "mean":
            buf.div_(info.size)
        elif ctx.op in ("max", "min"):
            (hit,) = ctx.saved_tensors
            ties = hit.to(ctx.acc)
            bounded_all_reduce(ties, info, "all_reduce (backward)")
            buf = torch.where(hit, buf / ties, torch.zeros_like(buf))
        return buf.to(grad.dtype), None, None


def all_reduce(x: torch.Tensor, op: str = "sum", group: Any | None = None) -> torch.Tensor:
    """All-reduce ``x`` over ``group`` (default: the manager's domain group), out of place, autograd-aware.

    Backward is the plain adjoint (every rank's gradient flows back to every rank): use this inside layers,
    where each rank uses the result differently. For a loss, use :func:`domain_sum` / :func:`domain_mean`.
    bf16/fp16 are reduced in fp32 and returned in their own dtype. With one rank, returns ``x`` itself.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    if torch.compiler.is_compiling():  # a custom op, ordered: one node of the graph
        gid, size, _ = _group_of(group)
        return x if size == 1 else _ordered_all_reduce(x, op, gid)
    info = comm_group(group)
    if info.size == 1:
        return x
    return _AllReduceFn.apply(x, op, info)


@torch._dynamo.assume_constant_result
def _group_of(group: Any | None) -> tuple[int, int, int]:
    """``(group id, size, this rank's index)`` of ``group``, outside the trace: dynamo must not trace
    :func:`halo.comm.comm_group` (it would cache a group under the trace's stand-in for the process group). Pass
    the caller's own ``group`` argument (``None`` or a group object), never one a traced call returned."""
    cg = comm_group(group)
    return group_id(cg), cg.size, cg.index


def _ordered_all_reduce(x: torch.Tensor, op: str, gid: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """``halo::all_reduce`` sequenced by the device's order token (:func:`halo.exchange.order_after`)."""
    from .exchange import order_after, order_token

    order = order_token(x.device) if order is None else order
    out = _all_reduce_op(x, order, op, gid)
    order_after(order, out)
    return out


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


@torch.library.custom_op("halo::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, order: torch.Tensor, op: str, gid: int) -> torch.Tensor:
    """:func:`all_reduce` (sum, mean, max or min) under ``torch.compile``: the same bounded all-reduce, accumulated
    in fp32 or wider (a max or min of widened values is exact); its backward is the plain adjoint (sum, mean: the
    same op on the gradient; max, min: the summed gradient split over the ranks' ties). ``order``: the device's
    order token."""
    info = group_by_id(gid)
    acc = accumulation_dtype(x.dtype)
    buf = torch.empty_like(x, dtype=acc)  # the strides the fake kernel gives (any layout of x, exactly)
    buf.copy_(x.detach())
    bounded_all_reduce(buf, info, "all_reduce", _REDUCE_OPS[op])
    if op == "mean":
        buf.div_(info.size)
    return buf if acc == x.dtype else torch.empty_like(x).copy_(buf)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, order: torch.Tensor, op: str, gid: int) -> torch.Tensor:
    return torch.empty_like(x)


def _all_reduce_setup(ctx, inputs, output) -> None:
    ctx.order, ctx.op, ctx.gid = inputs[1], inputs[2], inputs[3]
    if ctx.op in ("max", "min"):
        ctx.save_for_backward(inputs[0], output)


def _all_reduce_backward(ctx, grad: torch.Tensor):
    from .exchange import backward_order_token

    order = backward_order_token(ctx.order, grad)
    if ctx.op in ("sum", "mean"):
        return _ordered_all_reduce(grad, ctx.op, ctx.gid, order), None, None, None
    # max / min: as _AllReduceFn's backward, with the gradient's and the ties' sums in one all-reduce.
    x, out = ctx.saved_tensors
    acc = accumulation_dtype(x.dtype)
    hit = x.to(acc) == out.to(acc)  # out is the exact extremum (widening is exact, so is the cast back)
    both = _ordered_all_reduce(torch.stack([grad.to(acc), hit.to(acc)]), "sum", ctx.gid, order)
    gx = torch.where(hit, both[0] / both[1], torch.zeros_like(both[0]))
    return gx.to(grad.dtype), None, None, None


_all_reduce_op.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


@torch.library.custom_op("halo::replicated_sum", mutates_args=())
def _replicated_sum_op(buf: torch.Tensor, order: torch.Tensor, gid: int) -> torch.Tensor:
    """The sum over ranks of ``buf`` (float64, 1-d: a domain reduction's local sums and count) under
    ``torch.compile``, replicated on every rank and counted once: its backward is the mean over ranks of the
    incoming gradients (:class:`_ReplicatedSumFn`), not the plain adjoint of ``halo::all_reduce``. ``order``: the
    device's order token. Output: a fresh tensor with ``buf``'s strides (as the fake kernel says)."""
    out = torch.empty_like(buf).copy_(buf)
    bounded_all_reduce(out, group_by_id(gid), "domain reduction")
    return out


@_replicated_sum_op.register_fake
def _(buf: torch.Tensor, order: torch.Tensor, gid: int) -> torch.Tensor:
    return torch.empty_like(buf)


def _replicated_setup(ctx, inputs, output) -> None:
    ctx.order, ctx.gid = inputs[1], inputs[2]


def _replicated_backward(ctx, grad: torch.Tensor):
    from .exchange import backward_order_token

    return _ordered_all_reduce(grad, "mean", ctx.gid, backward_order_token(ctx.order, grad)), None, None


_replicated_sum_op.register_autograd(_replicated_backward, setup_context=_replicated_setup)


def _ordered_replicated_sum(local: torch.Tensor, count: int | None, gid: int) -> torch.Tensor:
    """:class:`_ReplicatedSumFn` under ``torch.compile``: ``halo::replicated_sum`` of the local sums (and the count,
    riding along), sequenced by the device's order token; the division by the global count is traced (autograd
    gives the same adjoint as the Function's)."""
    from .exchange import order_after, order_token

    flat = local.reshape(-1).to(torch.float64)
    if count is not None:
        flat = torch.cat([flat, flat.new_full((1,), float(count))])
    order = order_token(local.device)
    total = _replicated_sum_op(flat, order, gid)
    order_after(order, total)
    n = local.numel()
    out = total[:n] / total[n] if count is not None else total
    return out.to(local.dtype).view(local.shape)


def _order_all_reduce() -> None:
    """``halo::all_reduce`` and ``halo::replicated_sum`` communicate: ordered effects under torch.compile (see
    :func:`halo.exchange.order_communication`)."""
    from .exchange import order_communication

    order_communication(_all_reduce_op, _replicated_sum_op)


_order_all_reduce()


# -- replicated reductions (a loss counted once) ---------------------------------------------------------------

class _ReplicatedSumFn(torch.autograd.Function):
    """Forward: ``sum_r s_r`` (divided by ``sum_r n_r`` when counts are given), on every rank.
    Backward: ``mean_q g_q`` (divided by the same count): the adjoint when replicated copies count once."""

    @staticmethod
    def forward(ctx, local, count, info):
        n = local.numel()
        buf = torch.empty(n + (count is not None), dtype=torch.float64, device=local.device)
        buf[:n].copy_(local.detach().reshape(-1))
        if count is not None:
            buf[n:].fill_(float(count))  # the count rides along in the same all-reduce (no host read)
        bounded_all_reduce(buf, info, "domain reduction")
        total = None
        if count is not None:
            buf, total = buf[:n] / buf[n], buf[n]
        ctx.info, ctx.total, ctx.shape, ctx.dtype = info, total, local.shape, local.dtype
        return buf.to(local.dtype).view(local.shape)

    @staticmethod
    def backward(ctx, grad):
        buf = grad.reshape(-1).to(torch.float64, copy=True)
        bounded_all_reduce(buf, ctx.info, "domain reduction (backward)")
        buf.div_(ctx.info.size)
        if ctx.total is not None:
            buf.div_(ctx.total)
        return buf.to(ctx.dtype).view(ctx.shape), None, None


def _dims(x: torch.Tensor, dim: int | Sequence[int] | None, op: str, w_sharded: bool = False) -> tuple[int, ...]:
    if dim is None:  # everything: any shape, the shards need not even agree
        return tuple(range(x.dim()))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -x.dim() <= d < x.dim():
            raise ValueError(f"{op}: dim {d} is out of range for a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    dims = tuple(sorted({d % x.dim() for d in dims}))
    if x.dim() < 2 or x.dim() - 2 not in dims:  # kept rows would mix different rows of the ranks
        raise ValueError(f"{op}: dim={dim} must include the sharded latitude dim -2 (a domain reduction); "
                         f"got a {x.dim()}-d tensor")
    if w_sharded and x.dim() - 1 not in dims:  # kept columns would mix different columns of the ranks
        raise ValueError(f"{op}: dim={dim} must include the sharded longitude dim -1 too on a latitude x "
                         f"longitude mesh")
    return dims


def _reduce(x: torch.Tensor, dim, keepdim: bool, group: Any | None, mean: bool, op: str,
            validated: bool = False, mesh: Any | None = None) -> torch.Tensor:
    if mesh is not None:
        group = mesh.domain_group
        if dim is not None and not validated:
            _mesh_rows(x, mesh, op)  # kept dims must agree on every rank, else all raise
    compiling = torch.compiler.is_compiling()
    if compiling:  # the group as plain ints, outside the trace (_group_of)
        gid, size, _ = _group_of(group)
    else:
        info = comm_group(group)
        group, size = info.group, info.size
    if dim is not None and size > 1 and not validated and mesh is None:
        shard_sizes(x, -2, group, op=op)  # kept dims must agree on every rank, else all raise
    dims = _dims(x, dim, op, mesh is not None)
    acc = accumulation_dtype(x.dtype)
    local = x.sum(dim=dims, keepdim=keepdim, dtype=acc)
    count = math.prod([x.shape[d] for d in dims])  # a list: torch.compile traces no generators
    if size == 1:
        return local / count if mean else local
    if compiling:
        return _ordered_replicated_sum(local, count if mean else None, gid)
    return _ReplicatedSumFn.apply(local, count if mean else None, info)


def domain_sum(x: torch.Tensor, group: Any | None = None, *, dim: int | Sequence[int] | None = None,
               keepdim: bool = False, mesh: Any | None = None) -> torch.Tensor:
    """Sum of the global field whose shard is ``x``, replicated on every rank of ``group`` (counted once).

    ``dim``: reduce only these dims (they must include the sharded dim -2; the others, kept, must agree on every
    rank and are checked): e.g. ``dim=(0, 2, 3)`` gives per-channel sums. Default: everything, a scalar.
    ``mesh``: a latitude x longitude ``DomainMesh`` (``x`` a block; ``dim`` must then include -1 too).
    """
    return _reduce(x, dim, keepdim, group, False, "domain_sum", mesh=_mesh_arg(mesh, "domain_sum"))


def domain_mean(x: torch.Tensor, group: Any | None = None, *, dim: int | Sequence[int] | None = None,
                keepdim: bool = False, mesh: Any | None = None) -> torch.Tensor:
    """Mean of the global field: local sum, all-reduce, divided by the *global* element count (uneven shards
    weigh by their size). Replicated on every rank, counted once in backward. ``dim``, ``mesh`` as in
    :func:`domain_sum`."""
    return _reduce(x, dim, keepdim, group, True, "domain_mean", mesh=_mesh_arg(mesh, "domain_mean"))


def _mesh_arg(mesh: Any | None, op: str) -> Any | None:
    if mesh is None:
        return None
    if mesh_2d(mesh) is None:
        raise ValueError(f"{op}: mesh= takes a DomainMesh with two domain axes (latitude x longitude), got {mesh!r}; "
                         f"for latitude only pass group=")
    return mesh


def _rows_2d(cg: CommGroup, extents: tuple[tuple[int, ...], ...], width: int) -> tuple[int, int, int]:
    sizes_h = extents[0]
    h = cg.index // width
    return sum(sizes_h), sum(sizes_h[:h]), sizes_h[h]


def _mesh_rows(x: torch.Tensor, mesh: Any, op: str) -> tuple[int, int, int]:
    """``(global latitude rows, this rank's first row, its rows)`` of a block on a latitude x longitude mesh."""
    shape = tuple(mesh.domain_shape)
    return resolve(x, mesh.domain_group, op, _rows_2d, (shape[1],), spec=((-2,), (-1,)), coords=mesh_coords(shape))


# -- latitude weights ------------------------------------------------------------------------------------------

LAT_METHODS = ("cos", "area")


def _weights_of(lat: torch.Tensor, method: str) -> torch.Tensor:
    """Mean-1 weights (float64) of rows at latitudes ``lat`` (degrees)."""
    if method == "cos":
        w = torch.cos(torch.deg2rad(lat)).clamp_min(0)
    else:  # cell area: |sin(upper) - sin(lower)| between midpoints, outer bounds half a spacing out (<= 90)
        if lat.numel() < 2:
            raise ValueError(f"area weights need at least 2 latitudes, got {lat.numel()}")
        mid = (lat[1:] + lat[:-1]) / 2
        first = (lat[0] + (lat[0] - lat[1]) / 2).clamp(-90, 90)
        last = (lat[-1] + (lat[-1] - lat[-2]) / 2).clamp(-90, 90)
        bounds = torch.deg2rad(torch.cat([first.view(1), mid, last.view(1)]))
        w = (torch.sin(bounds[1:]) - torch.sin(bounds[:-1])).abs()
    if not w.sum() > 0:
        raise ValueError(f"latitude weights sum to zero for {lat.numel()} rows from {lat[0]:g} to {lat[-1]:g}")
    return w / w.mean()


@functools.lru_cache(maxsize=64)
def _grid_weights(n_lat: int, lat_range: tuple[float, float], poles_included: bool | None, method: str,
                  device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Cached (never mutate): the weights of a generated grid on ``device`` (no host copy per step)."""
    lat = grid_latitudes(n_lat, lat_range=lat_range, poles_included=poles_included)
    return _weights_of(lat, method).to(device=device, dtype=dtype)


@torch._dynamo.assume_constant_result
def _grid_weights_constant(n_lat: int, lat_range: tuple[float, float], poles_included: bool | None, method: str,
                           device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_grid_weights` under ``torch.compile``: made (and cached) outside the trace, a constant of the graph.
    Traced, dynamo would skip the cache and recompute the weights every call, and break the graph at their
    data-dependent check (a loss inside a ``fullgraph=True`` model would not compile)."""
    return _grid_weights(n_lat, lat_range, poles_included, method, device, dtype)


def grid_latitudes(n_lat: int, *, lat_range: tuple[float, float] = (90.0, -90.0),
                   poles_included: bool | None = None) -> torch.Tensor:
    """Latitudes (degrees, float64) of ``n_lat`` equally spaced rows spanning ``lat_range``.

    ``poles_included=True``: rows on both ends of the range (721 rows: 90, 89.75, ..., -90). ``False``:
    cell-centred rows half a spacing inside (720 rows: 89.875, ..., -89.875). ``None`` (default): ``True``
    for odd ``n_lat`` (721, 181, 121: grids with both poles), ``False`` for even (720, 64, 32: cell-centred).
    Exactly antisymmetric for a symmetric range (integer row offsets, divided once).
    """
    if n_lat <= 0:
        raise ValueError(f"n_lat must be positive, got {n_lat}")
    if poles_included is None:
        poles_included = bool(n_lat % 2)
    a, b = (float(v) for v in lat_range)
    i = torch.arange(n_lat, dtype=torch.float64)
    if poles_included:
        if n_lat == 1:
            raise ValueError("a grid with both ends of lat_range on it needs at least 2 rows")
        return a + (i * (b - a)) / (n_lat - 1)
    return a + ((2 * i + 1) * (b - a)) / (2 * n_lat)


def latitude_weights(n_lat: int | None = None, *, latitudes: Sequence[float] | torch.Tensor | None = None,
                     lat_range: tuple[float, float] = (90.0, -90.0), poles_included: bool | None = None,
                     method: str = "cos", dtype: torch.dtype = torch.float64,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Per-row latitude weights of the global grid, normalised to mean 1 over the rows (WeatherBench).

    Either ``n_lat`` equally spaced rows (``lat_range``, ``poles_included``: see :func:`grid_latitudes`; the
    default takes odd ``n_lat`` to include both poles, even ``n_lat`` to be cell-centred) or explicit
    ``latitudes`` in degrees (then ``lat_range``/``poles_included`` are unused). ``method="cos"``: ``cos(lat)``
    (WeatherBench 1; 0 on a pole row); ``"area"``: the cell area between midpoints (WeatherBench 2; a pole row
    gets its polar cap). Returns a fresh tensor.
    """
    if method not in LAT_METHODS:
        raise ValueError(f"unknown latitude weight method {method!r}; expected one of {', '.join(LAT_METHODS)}")
    if latitudes is not None:
        lat = torch.as_tensor(latitudes, dtype=torch.float64).flatten().cpu()
        if n_lat is not None and lat.numel() != n_lat:
            raise ValueError(f"n_lat={n_lat} but {lat.numel()} latitudes were given")
        return _weights_of(lat, method).to(device=device, dtype=dtype)
    if n_lat is None:
        raise ValueError("latitude_weights needs n_lat or latitudes")
    lat_range = (float(lat_range[0]), float(lat_range[1]))
    w = _grid_weights(int(n_lat), lat_range, poles_included, method, torch.device("cpu"), torch.float64)
    return w.to(device=device, dtype=dtype, copy=True)


def local_latitude_weights(n_lat: int, group: Any | None = None, **kwargs: Any) -> torch.Tensor:
    """This rank's rows of :func:`latitude_weights` under the balanced split of ``n_lat`` over ``group``."""
    info = comm_group(group)
    if n_lat < info.size:
        raise ValueError(f"{n_lat} latitude rows cannot be split over {info.size} ranks (a rank would get none)")
    start, stop = local_range(n_lat, info.size, info.index)
    return latitude_weights(n_lat, **kwargs)[start:stop]


def latitude_weighted_mean(x: torch.Tensor, group: Any | None = None, *, dim: int | Sequence[int] | None = None,
                           keepdim: bool = False, weights: torch.Tensor | None = None, mesh: Any | None = None,
                           **weight_kwargs: Any) -> torch.Tensor:
    """Mean over the global field of ``w(lat) * x``, replicated on every rank (counted once in backward).

    ``x``: ``(..., H_local, W)`` sharded along -2; the rank's rows follow from every rank's extent (agreed on by all
    ranks once per epoch: ``halo.plans``). ``weights``: the global per-row weights (length H; a tensor on ``x``'s
    device costs no copy per call); default :func:`latitude_weights` of the global H with ``weight_kwargs``
    (``poles_included``, ``lat_range``, ``latitudes``, ``method``), made once per grid and device. ``dim`` as in
    :func:`domain_sum`. ``mesh``: a latitude x longitude ``DomainMesh`` (``x`` a block of it).
    """
    return _latitude_weighted(x, x, group, dim, keepdim, weights, weight_kwargs, "latitude_weighted_mean",
                              _mesh_arg(mesh, "latitude_weighted_mean"))


def _latitude_weighted(x: torch.Tensor, values: torch.Tensor, group: Any | None, dim: Any, keepdim: bool,
                       weights: torch.Tensor | None, weight_kwargs: dict, op: str, mesh: Any | None = None
                       ) -> torch.Tensor:
    """The weighted mean of ``values``, whose rows are those of the shard ``x`` (its extents name the rows)."""
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be (..., H, W), got shape {tuple(x.shape)}")
    if mesh is not None:
        n_lat, start, rows = _mesh_rows(x, mesh, op)
    else:
        if torch.compiler.is_compiling():  # the group's ints outside the trace (_group_of)
            index = _group_of(group)[2]
        else:
            info = comm_group(group)
            group, index = info.group, info.index
        sizes = shard_sizes(x, -2, group, op=op)
        n_lat, start, rows = sum(sizes), sum(sizes[:index]), sizes[index]
    acc = accumulation_dtype(values.dtype)
    if weights is not None:
        if weight_kwargs:
            raise TypeError(f"pass either weights or {sorted(weight_kwargs)}, not both")
        weights = torch.as_tensor(weights)
    elif set(weight_kwargs) <= {"lat_range", "poles_included", "method"}:  # a generated grid: cached on device
        lat_range = tuple(float(v) for v in weight_kwargs.get("lat_range", (90.0, -90.0)))
        method = weight_kwargs.get("method", "cos")
        if method not in LAT_METHODS:
            raise ValueError(f"unknown latitude weight method {method!r}; expected one of {', '.join(LAT_METHODS)}")
        grid = _grid_weights_constant if torch.compiler.is_compiling() else _grid_weights
        weights = grid(n_lat, lat_range, weight_kwargs.get("poles_included"), method, values.device, acc)
    else:
        weights = latitude_weights(n_lat, **weight_kwargs)
    if weights.dim() != 1 or weights.numel() != n_lat:
        raise ValueError(f"weights must be one per global latitude row ({n_lat}), got shape {tuple(weights.shape)}")
    w = weights.narrow(0, start, rows).to(device=values.device, dtype=acc).unsqueeze(-1)
    return _reduce(values.to(acc) * w, dim, keepdim, group, True, op, validated=True, mesh=mesh)


def latitude_weighted_mse(pred: torch.Tensor, target: torch.Tensor, group: Any | None = None,
                          **kwargs: Any) -> torch.Tensor:
    """WeatherBench-style loss: mean over all dims of ``w(lat) * (pred - target)**2`` over the global field
    (``dim``/``weights``/grid options as in :func:`latitude_weighted_mean`). fp32 for half inputs."""
    if pred.shape != target.shape:
        raise ValueError(f"latitude_weighted_mse: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    acc = accumulation_dtype(torch.promote_types(pred.dtype, target.dtype))
    err = (pred.to(acc) - target.to(acc)).square()
    dim, keepdim, weights = kwargs.pop("dim", None), kwargs.pop("keepdim", False), kwargs.pop("weights", None)
    mesh = _mesh_arg(kwargs.pop("mesh", None), "latitude_weighted_mse")
    return _latitude_weighted(pred, err, group, dim, keepdim, weights, kwargs, "latitude_weighted_mse", mesh)


# -- gradients ------------------------------------------------------------------------------------------------

def _params(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    seen, out = set(), []
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _live(group: Any | None) -> CommGroup | None:
    if group is None:
        return None
    info = comm_group(group)
    return info if info.size > 1 else None


@torch._dynamo.disable  # host bookkeeping (version counters, weak references) and collectives: always eager
def sync_domain_gradients(model: nn.Module | Iterable[torch.Tensor], manager: DomainParallelManager | None = None,
                          *, domain_group: Any | None = None, dp_group: Any | None = None,
                          bucket_mb: float = 128.0) -> None:
    """Sum parameter gradients over the domain group, then average them over the data-parallel group.

    After a replicated loss's ``backward()`` each rank holds its own part of the gradient (its rows of the
    field; a :class:`~halo.nn.norm.DomainLayerNorm` weight only its H-slice); the sum is the global gradient
    and the dp mean that of the mean loss over the full batch. Afterwards gradients are identical on every
    rank of both groups.

    Groups: ``domain_group`` / ``dp_group`` if given (either may be ``None``: skipped), else ``manager``'s (default
    the initialised manager); without a manager and without torch.distributed this is a no-op. With DDP or
    FSDP2 averaging over the dp axis, pass ``domain_group=manager.domain_group`` alone (sum and mean commute).
    FSDP2 / HSDP gradients (DTensors sharded over ``manager.device_mesh["dp"]``) are summed as their local shards,
    which are the same slice of each parameter on every rank of a domain group (tested against one process on
    uneven shards); a mesh that includes other domain ranks, or a second dp mean of DTensor gradients, raises.
    A model set up by :func:`halo.parallelize` is handled as its mode needs (``sync_domain_gradients(model)``).

    Parameters that require grad but have none on some ranks (used only on the edge ranks) are agreed on, once
    per pattern of which parameters have a gradient (one small all-gather of host data per group, the first time
    a rank's pattern is met; none in a steady step): ranks without a gradient contribute zeros and receive the
    sum; a parameter with no gradient anywhere stays ``None``. A pattern that changes on some ranks only (a
    parameter used depending on the data on one rank) makes the ranks that changed agree alone: the others
    raise :class:`halo.HaloCommError` within the timeout. Gradients go in flat buckets of at most ``bucket_mb``
    MB per (device, dtype), one all-reduce per bucket and group; bf16/fp16 gradients are bucketed in fp32.

    Checked, with no message: a second call for one backward (a gradient exactly as the previous sync left it, by
    its tensor and version counter: summing it again would multiply it by the domain size) raises
    ``RuntimeError``; for a converted model (or a wrapper of one), a ``domain_group`` other than the one it was
    converted for (swapped domain and dp groups, the world group) or a ``dp_group`` that shares other ranks with it
    raises ``ValueError``. A forgotten sync lets the weights diverge: the converted model's periodic check
    (:func:`halo.replicated.check_every`) names the tensor within that many forwards.
    """
    mode = model.__dict__.get("_halo_data_parallel") if isinstance(model, nn.Module) else None
    if mode == "fsdp-all":  # FSDP's reduce-scatter over every rank, divided by the dp size: done already
        scale = model.__dict__.get("_halo_grad_scale")
        if scale is not None:  # gloo: FSDP divided by every rank; the domain's part of that is undone here
            scaled = [p for p in model.parameters() if p.grad is not None]
            _refuse_second_sync(scaled)
            with torch.no_grad():
                for p in scaled:
                    local_grad(p.grad).mul_(scale)
            _mark_synced(scaled)
        return
    groups = model.__dict__.get("_halo_groups") if isinstance(model, nn.Module) else None
    if mode in ("ddp", "fsdp", "hsdp") and domain_group is None and dp_group is None:
        if groups is not None and manager is None:
            domain_group = groups[0]  # the groups halo.parallelize set it up with (a manager's or a mesh's)
        else:
            manager = manager if manager is not None else get_domain_parallel_manager()
            domain_group, manager = manager.domain_group, None  # the wrapper averaged over dp already
    elif mode == "none" and domain_group is None and dp_group is None and manager is None and groups is not None:
        domain_group, dp_group = groups
    if domain_group is None and dp_group is None:
        manager = manager if manager is not None else get_domain_parallel_manager()
        if manager is None:
            if dist.is_available() and dist.is_initialized():
                raise RuntimeError("sync_domain_gradients: pass manager=, domain_group= or dp_group=, or call "
                                   "halo.initialize_domain_parallel(world_size, domain_parallel_size) first")
            return
        domain_group, dp_group = manager.domain_group, manager.data_parallel_group
    elif manager is not None:
        raise ValueError("sync_domain_gradients: pass either manager or domain_group/dp_group, not both")
    _check_groups(model, domain_group, dp_group)
    infos = [(info, op) for info, op in ((_live(domain_group), "sum"), (_live(dp_group), "mean")) if info]
    params = [p for p in _params(model) if p.requires_grad]
    if not infos or not params:
        return
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError("sync_domain_gradients: sparse gradients are not supported")
    _refuse_second_sync(params)

    _check_sharded_grads(params, infos)
    pattern = tuple(p.grad is not None for p in params)
    live_mask = pattern
    for info, _ in infos:
        live_mask = _agreed_pattern(live_mask, info)
    live = [p for p, h in zip(params, live_mask, strict=True) if h]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # a DTensor parameter gives a DTensor of zeros

    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}
    cap = max(1, int(bucket_mb * 2 ** 20))
    for p in live:  # same order and sizes on every rank, so the buckets match
        g = local_grad(p.grad)
        key = (g.device, accumulation_dtype(g.dtype))
        lists = buckets.setdefault(key, [[]])
        nbytes = g.numel() * key[1].itemsize
        if lists[-1] and filled[key] + nbytes > cap:
            lists.append([])
            filled[key] = 0
        lists[-1].append(g)
        filled[key] = filled.get(key, 0) + nbytes
    for (_, acc), lists in buckets.items():
        for grads in lists:
            flat = torch.cat([g.reshape(-1).to(acc) for g in grads])
            for info, op in infos:
                bounded_all_reduce(flat, info, "sync_domain_gradients")
                if op == "mean":
                    flat.div_(info.size)
            for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(piece.view_as(g))
    _mark_synced(live)


#: The most sync patterns remembered (:func:`_agreed_pattern`; all dropped at once past it).
MAX_PATTERNS = 256


@dataclasses.dataclass
class _ReduceState:
    """What the reductions remember (the :mod:`halo.context` slot ``"reduce"``). ``synced``: each parameter's
    gradient as the last sync left it, id(param) -> (weak references to the parameter and to the gradient tensor,
    the gradient's version counter then); pruned of dead parameters past ``4 x max(params, 1024)`` entries.
    ``patterns``: (group ranks, which parameters have a gradient here) -> the union agreed over the group."""

    synced: dict = dataclasses.field(default_factory=dict)
    patterns: dict = dataclasses.field(default_factory=dict)


def _state() -> _ReduceState:
    return context.state("reduce", _ReduceState)


def _mark_synced(params: list[torch.Tensor]) -> None:
    """Remember every synced gradient (the tensor and its version counter, which any later write bumps)."""
    import weakref

    synced = _state().synced
    if len(synced) > 4 * max(len(params), 1024):  # forget parameters that are gone
        for key in [k for k, (p, _, _) in synced.items() if p() is None]:
            del synced[key]
    for p in params:
        if p.grad is not None:
            g = local_grad(p.grad)
            synced[id(p)] = (weakref.ref(p), weakref.ref(g), g._version)


def _refuse_second_sync(params: list[torch.Tensor]) -> None:
    """Raise if a gradient is exactly as the last sync left it (not written by a backward or zeroed since): summing
    it again would multiply it by the domain size. A backward (new gradients, or accumulation into them) and
    ``zero_grad`` clear the mark; no communication, a Python loop over the parameters."""
    synced = _state().synced
    if not synced:
        return
    stale = 0
    for p in params:
        if p.grad is None:
            continue
        mark = synced.get(id(p))
        if mark is not None and mark[0]() is p:
            g = local_grad(p.grad)
            if mark[1]() is g and g._version == mark[2]:
                stale += 1
    if stale:
        raise RuntimeError(
            f"sync_domain_gradients: {stale} of {len(params)} gradients are exactly as the previous "
            f"sync_domain_gradients left them (no backward and no zero_grad since): it was called twice for one "
            f"backward, which would sum the summed gradients again (x the domain size). Call it once per step, after "
            f"the backward (with a data-parallel wrapper, once in all: the wrapper's own averaging is not a sync)")


def _root(model: Any) -> Any:
    """The converted model inside ``model`` (through DDP / FSDP wrappers), or ``None``."""
    m = model
    for _ in range(8):
        if not isinstance(m, nn.Module):
            return None
        if "_halo_root" in m.__dict__:
            return m
        m = getattr(m, "module", None)
    return None


def _check_groups(model: Any, domain_group: Any | None, dp_group: Any | None) -> None:
    """The groups of a sync must be the model's: its domain group the one it was converted for, its dp group one
    that meets that domain group in this rank alone (swapped groups, or the world as either, raise)."""
    root = _root(model)
    if root is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        converted = comm_group(root.__dict__["_halo_root"].group)
    except (RuntimeError, ValueError):
        return
    if converted.size == 1:
        return
    me = dist.get_rank()
    if domain_group is not None:
        got = comm_group(domain_group)
        if got.ranks != converted.ranks:
            raise ValueError(
                f"sync_domain_gradients: domain_group holds global ranks {list(got.ranks)}, but the model was "
                f"converted for the domain group of global ranks {list(converted.ranks)} (on global rank {me}): "
                f"summing over another group gives wrong gradients (swapped domain and data-parallel groups, or "
                f"the world group as the domain group); pass the group the model was converted with "
                f"(manager.domain_group)")
    if dp_group is not None:
        got = comm_group(dp_group)
        shared = sorted(set(got.ranks) & set(converted.ranks))
        if shared != [me]:
            raise ValueError(
                f"sync_domain_gradients: dp_group holds global ranks {list(got.ranks)}, which share global ranks "
                f"{shared} with the model's domain group {list(converted.ranks)} (on global rank {me}): a "
                f"data-parallel group holds one rank of each domain group (this one); pass "
                f"manager.data_parallel_group")


def local_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient's tensor on this rank: the local shard of a DTensor (FSDP2, HSDP), written in place."""
    return g._local_tensor if hasattr(g, "_local_tensor") and hasattr(g, "device_mesh") else g


def _check_sharded_grads(params: list[torch.Tensor], infos: list[tuple[CommGroup, str]]) -> None:
    """DTensor gradients (FSDP2 / HSDP): their mesh must lie within the data-parallel ranks, so that the ranks of a
    domain group hold the same slice of each parameter (their local shards add up), and FSDP already averaged them
    over that mesh (a dp mean here would mix different slices)."""
    for p in params:
        g = p.grad
        if g is None or not (hasattr(g, "device_mesh") and hasattr(g, "_local_tensor")):
            continue
        mesh_ranks = {int(r) for r in g.device_mesh.mesh.flatten().tolist()}
        me = dist.get_rank()
        for info, op in infos:
            shared = mesh_ranks & set(info.ranks)
            if op == "sum" and shared != {me}:
                raise ValueError(
                    f"sync_domain_gradients: a gradient is sharded over a mesh of global ranks {sorted(mesh_ranks)} "
                    f"that includes other ranks of the domain group {list(info.ranks)} (a flattened dp x domain "
                    f"mesh): its local shards are different slices and cannot be summed. Shard over the "
                    f"data-parallel mesh (manager.device_mesh['dp']), or, sharding over all ranks, set FSDP's "
                    f"gradient divide factor to the data-parallel size and do not call sync_domain_gradients")
            if op == "mean" and len(shared) > 1:
                raise ValueError(
                    "sync_domain_gradients: the gradients are DTensors sharded over the data-parallel ranks (FSDP2 "
                    "on device_mesh['dp']), which FSDP already averaged; a second dp mean would mix different "
                    "slices: pass domain_group=manager.domain_group alone")
        return  # one gradient tells the mesh (a model is sharded over one mesh)


def _agreed_pattern(mask: tuple[bool, ...], info: CommGroup) -> tuple[bool, ...]:
    """The union over ``info``'s ranks of which parameters have a gradient, agreed once per local ``mask``."""
    key = (info.ranks, mask)
    patterns = _state().patterns
    union = patterns.get(key)
    if union is None:
        digest = hashlib.blake2b(bytes(mask), digest_size=8).digest()
        words = [len(mask), sum(mask), int.from_bytes(digest, "little", signed=True)]
        table = gather_words(words, info, "sync_domain_gradients")
        if (table == table[info.index]).all():
            union = mask
        else:  # the ranks differ: gather the masks themselves (every rank takes this path) and check the count
            masks = all_gather_object(mask, info)
            if len({len(m) for m in masks}) != 1:
                raise ValueError(f"sync_domain_gradients: the ranks pass different numbers of parameters that "
                                 f"require grad: {[len(m) for m in masks]} (group ranks 0..{info.size - 1}); pass "
                                 f"the same model on every rank")
            union = tuple(any(col) for col in zip(*masks, strict=True))
        if len(patterns) > MAX_PATTERNS:
            patterns.clear()
        patterns[key] = union
    return union


def grad_norm(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0, *,
              verify_group: Any | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients together, each gradient counted once; fp32 for half grads.

    Call it *after* :func:`sync_domain_gradients`: gradients are then replicated on every rank of the domain
    group, so the local norm is the global one, with no communication, identical on every rank. Before the
    sync each rank holds only its part of the gradient, whose norm is not that of the sum (there is no cheap
    correct answer: sync first). ``verify_group``: check with one scalar all-reduce that every rank of that
    group got the same norm, and raise ``RuntimeError`` on all of them otherwise (a debugging aid).
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    grads = [p.grad for p in _params(parameters) if p.grad is not None]
    if not grads:
        total = torch.zeros((), dtype=torch.float32)
    else:
        out_dtype = functools.reduce(torch.promote_types, (accumulation_dtype(g.dtype) for g in grads))
        device = grads[0].device
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=accumulation_dtype(g.dtype)).to(device, out_dtype)
                 for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if verify_group is not None:
        _verify_norm(total, verify_group)
    return total


@torch._dynamo.disable  # a collective and a host read: eager, a graph break in a compiled step
def _verify_norm(total: torch.Tensor, verify_group: Any) -> None:
    """Raise on every rank of ``verify_group`` unless all of them hold the same ``total``."""
    info = comm_group(verify_group)
    if info.size > 1:
        spread = torch.stack([total, -total]).to(torch.float64)
        bounded_all_reduce(spread, info, "grad_norm", dist.ReduceOp.MAX)
        hi, lo = spread[0].item(), -spread[1].item()
        if hi != lo:
            raise RuntimeError(f"grad_norm: the ranks disagree on the gradient norm (from {lo:.6g} to {hi:.6g}); "
                               f"call sync_domain_gradients first")


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                    verify_group: Any | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with :func:`grad_norm` (each gradient once, fp32 for half grads).

    Call after :func:`sync_domain_gradients`; every rank then scales identically. Returns the total norm.
    """
    params = [p for p in _params(parameters) if p.grad is not None]
    total = grad_norm(params, norm_type, verify_group=verify_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
                           f"set error_if_nonfinite=False to clip anyway")
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
