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
    local_share(l)          l (this rank's share)          per-rank     g (declared: the sum over ranks is the loss)
    replicated_loss(l)      l (the same on every rank)     replicated   g / P (whole values: counted once)

``all_reduce`` is the primitive used *inside* layers (norm statistics): every rank uses the result in its own
downstream computation, so the gradients arriving on the ranks differ and all of them flow back (plain adjoint).
``domain_*`` and the latitude-weighted losses return one value *replicated* on every rank of the domain group
and count it once: the training objective is the global loss, held P times. Their backward is the adjoint
under the inner product that counts replicated copies once, i.e. the mean over ranks of the incoming
gradients (one all-reduce of a few numbers), which is the incoming gradient itself when, as usual, every rank
calls ``loss.backward()`` on the same loss. With that, each rank's parameter gradient is its own part of the
global gradient, which :func:`sync_domain_gradients` sums (:mod:`halo.parallel._grads`, re-exported here with the
norms; the latitude grid's rows and weights: :mod:`halo.parallel._weights`).

Each of these losses' backward marks the backward it runs in as a domain loss's (:mod:`halo.parallel.marks`), and the
sync refuses gradients of a backward without one: a loss computed on the shard alone (``F.mse_loss`` of the shard,
each rank's mean over its own rows) cannot be told from a share of the global loss by its gradients, and is off by
about the domain size after the sum. A loss that *is* this rank's share of a global sum is declared with
:func:`local_share`; one computed alike on every rank from whole values (a global pool's result) with
:func:`replicated_loss`. ``latitude_weighted_mse`` agrees on both tensors' extents before comparing them, so a
target that differs on one rank only is the same ``ValueError`` on every rank.

Precision (invariant 5): bf16/fp16 values are summed in fp32 (float64 for cross-rank sums of a few numbers);
``domain_*`` and the losses return fp32 for half inputs, the input dtype otherwise; ``all_reduce`` returns the
input dtype. Collectives must be called by every rank of the group in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..dist.comm import all_reduce as bounded_all_reduce
from ..dist.comm import comm_group, group_by_id, group_id
from ..dist.transport import eager_only
from ..plan.plans import shard_sizes
from ._grads import accumulation_dtype, clip_grad_norm_, grad_norm, local_grad, sync_domain_gradients
from ._weights import (
    LAT_METHODS,
    check_mesh,
    grid_latitudes,
    latitude_weights,
    local_latitude_weights,
    mesh_rows,
    row_weights,
)
from .marks import mark_domain_backward, no_sync

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
    "local_grad",
    "local_share",
    "no_sync",
    "replicated_loss",
    "LAT_METHODS",
]

REDUCE_OPS = ("sum", "mean", "max", "min")


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
    :func:`halo.dist.comm.comm_group` (it would cache a group under the trace's stand-in for the process group). Pass
    the caller's own ``group`` argument (``None`` or a group object), never one a traced call returned."""
    cg = comm_group(group)
    return group_id(cg), cg.size, cg.index


def _ordered_all_reduce(x: torch.Tensor, op: str, gid: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """``halo::all_reduce`` sequenced by the device's order token (:func:`halo.exchange.order_after`)."""
    from ..exchange import order_after, order_token

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
    from ..exchange import backward_order_token

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


@torch.library.custom_op("halo::replicated_grad", mutates_args=())
def _replicated_grad_op(grad: torch.Tensor, order: torch.Tensor, gid: int) -> torch.Tensor:
    """The backward of ``halo::replicated_sum``: the mean over ranks of the incoming gradients (as
    ``halo::all_reduce`` with ``"mean"``), which also marks the running backward as a domain loss's
    (:mod:`halo.parallel.marks`: the sync checks it) when the compiled backward runs."""
    mark_domain_backward()
    info = group_by_id(gid)
    buf = torch.empty_like(grad, dtype=accumulation_dtype(grad.dtype))
    buf.copy_(grad.detach())
    bounded_all_reduce(buf, info, "all_reduce")  # the label halo::all_reduce gave this backward before
    buf.div_(info.size)
    return buf if buf.dtype == grad.dtype else torch.empty_like(grad).copy_(buf)


@_replicated_grad_op.register_fake
def _(grad: torch.Tensor, order: torch.Tensor, gid: int) -> torch.Tensor:
    return torch.empty_like(grad)


def _replicated_backward(ctx, grad: torch.Tensor):
    from ..exchange import backward_order_token, order_after

    order = backward_order_token(ctx.order, grad)
    out = _replicated_grad_op(grad, order, ctx.gid)
    order_after(order, out)
    return out, None, None


_replicated_sum_op.register_autograd(_replicated_backward, setup_context=_replicated_setup)


def _ordered_replicated_sum(local: torch.Tensor, count: int | None, gid: int) -> torch.Tensor:
    """:class:`_ReplicatedSumFn` under ``torch.compile``: ``halo::replicated_sum`` of the local sums (and the count,
    riding along), sequenced by the device's order token; the division by the global count is traced (autograd
    gives the same adjoint as the Function's)."""
    from ..exchange import order_after, order_token

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
    from ..exchange import order_communication

    order_communication(_all_reduce_op, _replicated_sum_op, _replicated_grad_op)


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
        mark_domain_backward()  # the gradients of this backward are a domain loss's (halo.parallel.marks)
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
            mesh_rows(x, mesh, op)  # kept dims must agree on every rank, else all raise
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
    return _reduce(x, dim, keepdim, group, False, "domain_sum", mesh=check_mesh(mesh, "domain_sum"))


def domain_mean(x: torch.Tensor, group: Any | None = None, *, dim: int | Sequence[int] | None = None,
                keepdim: bool = False, mesh: Any | None = None) -> torch.Tensor:
    """Mean of the global field: local sum, all-reduce, divided by the *global* element count (uneven shards
    weigh by their size). Replicated on every rank, counted once in backward. ``dim``, ``mesh`` as in
    :func:`domain_sum`."""
    return _reduce(x, dim, keepdim, group, True, "domain_mean", mesh=check_mesh(mesh, "domain_mean"))


def latitude_weighted_mean(x: torch.Tensor, group: Any | None = None, *, dim: int | Sequence[int] | None = None,
                           keepdim: bool = False, weights: torch.Tensor | None = None, mesh: Any | None = None,
                           **weight_kwargs: Any) -> torch.Tensor:
    """Mean over the global field of ``w(lat) * x``, replicated on every rank (counted once in backward).

    ``x``: ``(..., H_local, W)`` sharded along -2; the rank's rows follow from every rank's extent (agreed on by all
    ranks once per epoch: ``halo.plan.plans``). ``weights``: the global per-row weights (length H; a tensor on ``x``'s
    device costs no copy per call); default :func:`latitude_weights` of the global H with ``weight_kwargs``
    (``poles_included``, ``lat_range``, ``latitudes``, ``method``), made once per grid and device. ``dim`` as in
    :func:`domain_sum`. ``mesh``: a latitude x longitude ``DomainMesh`` (``x`` a block of it).
    """
    return _latitude_weighted(x, x, group, dim, keepdim, weights, weight_kwargs, "latitude_weighted_mean",
                              check_mesh(mesh, "latitude_weighted_mean"))


def _latitude_weighted(x: torch.Tensor, values: torch.Tensor, group: Any | None, dim: Any, keepdim: bool,
                       weights: torch.Tensor | None, weight_kwargs: dict, op: str, mesh: Any | None = None,
                       sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """The weighted mean of ``values``, whose rows are those of the shard ``x`` (its extents name the rows;
    ``sizes``: every rank's rows of ``x`` when the caller agreed them already)."""
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be (..., H, W), got shape {tuple(x.shape)}")
    if mesh is not None:
        n_lat, start, rows = mesh_rows(x, mesh, op)
    else:
        if torch.compiler.is_compiling():  # the group's ints outside the trace (_group_of)
            index = _group_of(group)[2]
        else:
            info = comm_group(group)
            group, index = info.group, info.index
        sizes = shard_sizes(x, -2, group, op=op) if sizes is None else sizes
        n_lat, start, rows = sum(sizes), sum(sizes[:index]), sizes[index]
    acc = accumulation_dtype(values.dtype)
    weights = row_weights(n_lat, weights, weight_kwargs, values.device, acc)
    w = weights.narrow(0, start, rows).to(device=values.device, dtype=acc).unsqueeze(-1)
    return _reduce(values.to(acc) * w, dim, keepdim, group, True, op, validated=True, mesh=mesh)


def latitude_weighted_mse(pred: torch.Tensor, target: torch.Tensor, group: Any | None = None,
                          **kwargs: Any) -> torch.Tensor:
    """WeatherBench-style loss: mean over all dims of ``w(lat) * (pred - target)**2`` over the global field
    (``dim``/``weights``/grid options as in :func:`latitude_weighted_mean`). fp32 for half inputs."""
    mesh = check_mesh(kwargs.pop("mesh", None), "latitude_weighted_mse")
    sizes = _agree_pair(pred, target, group, mesh, "latitude_weighted_mse")
    acc = accumulation_dtype(torch.promote_types(pred.dtype, target.dtype))
    err = (pred.to(acc) - target.to(acc)).square()
    dim, keepdim, weights = kwargs.pop("dim", None), kwargs.pop("keepdim", False), kwargs.pop("weights", None)
    return _latitude_weighted(pred, err, group, dim, keepdim, weights, kwargs, "latitude_weighted_mse", mesh, sizes)


def _agree_pair(pred: torch.Tensor, target: torch.Tensor, group: Any | None, mesh: Any | None, op: str
                ) -> tuple[int, ...] | None:
    """``pred`` and ``target`` must be shards of fields of one shape; checked so that every rank raises the same
    ``ValueError`` (invariant 4) when they differ on some ranks only (a target one row shorter: before, that rank
    raised alone and its peers waited in the next agreement until it exited). Both tensors' extents are agreed
    over the domain group first (recorded per step for a model's output and a ``halo.shard`` result: no message in
    a steady step), which also checks every other dim, the dtype and the device alike across ranks for each; then
    what is compared is the same on every rank. Returns pred's rows per rank (``None`` on a mesh)."""
    if pred.dim() < 2 or target.dim() < 2:
        if pred.shape != target.shape:  # every rank sees it: shard_sizes would refuse them alike anyway
            raise ValueError(f"{op}: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
        return None
    if mesh is not None:  # the global rows are agreed; a block's columns are checked on this rank only
        p_rows, t_rows = mesh_rows(pred, mesh, op)[0], mesh_rows(target, mesh, op)[0]
        if p_rows != t_rows or pred.shape != target.shape:
            raise ValueError(f"{op}: pred is a block of a field of {p_rows} rows (local shape {tuple(pred.shape)}), "
                             f"target of {t_rows} rows (local shape {tuple(target.shape)}): expected blocks of fields "
                             f"of one shape")
        return None
    sp = shard_sizes(pred, -2, group, op=op)
    st = shard_sizes(target, -2, group, op=f"{op} (target)")
    if sp != st or pred.dim() != target.dim() or pred.shape[:-2] != target.shape[:-2] \
            or pred.shape[-1] != target.shape[-1]:
        def field(x: torch.Tensor, sizes: tuple[int, ...]) -> str:
            dims = list(x.shape)
            dims[-2] = sum(sizes)
            return f"{tuple(dims)} (rows per rank {list(sizes)})"
        raise ValueError(f"{op}: pred and target must be shards of fields of one shape; pred is {field(pred, sp)}, "
                         f"target is {field(target, st)}")
    if pred.dtype != target.dtype and not (pred.dtype.is_floating_point and target.dtype.is_floating_point):
        raise ValueError(f"{op}: pred is {pred.dtype} and target {target.dtype}: expected floating-point tensors")
    return sp


class _ShareFn(torch.autograd.Function):
    """Forward: the loss itself. Backward: the incoming gradient times ``scale`` (1: a share; 1/P: a replicated
    loss counted once), marking the backward as a domain loss's (:mod:`halo.parallel.marks`)."""

    @staticmethod
    def forward(ctx, loss, scale):
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        mark_domain_backward()
        return (grad if ctx.scale == 1.0 else grad * ctx.scale), None


@eager_only  # a host mark in backward: eager
def local_share(loss: torch.Tensor) -> torch.Tensor:
    """Declare ``loss`` this rank's *share* of the global loss: the sum over the domain group of every rank's
    ``loss`` is the objective (e.g. ``(pred * w_shard).sum()``, or ``((pred - t) ** 2).sum() / global_count``).

    Its value and gradient are unchanged; the backward is marked as a domain loss's, so
    :func:`sync_domain_gradients` (which sums the ranks' parts) accepts it. Without a domain reduction or this
    declaration the sync refuses the gradients: a per-shard *mean* (``F.mse_loss`` of the shard) is off by about
    the domain size after the sum, and from the gradients alone the two cannot be told apart."""
    return _ShareFn.apply(loss, 1.0)


@eager_only  # a host mark in backward: eager
def replicated_loss(loss: torch.Tensor, group: Any | None = None) -> torch.Tensor:
    """Declare ``loss`` computed alike on every rank of the domain group (default: the manager's) from whole values
    (a global pool's result and the layers after it, a head on a gathered field), counted once.

    Each rank's backward of such a loss holds the whole gradient of the replicated part (the head's weights) and
    the layers before the whole value send every rank's copy back (a global pool's plain adjoint): summed over the
    ranks by :func:`sync_domain_gradients`, that is P times the gradient (measured: x2.000 on 2 ranks). This
    divides the incoming gradient by P (the value is unchanged), so the sum is exact, and marks the backward as a
    domain loss's."""
    info = comm_group(group)
    return _ShareFn.apply(loss, 1.0 / info.size) if info.size > 1 else _ShareFn.apply(loss, 1.0)
