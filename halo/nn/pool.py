"""Domain-parallel pooling of an H-sharded field: the same numbers as the unsharded pool, forward and backward.

Geometry along H (the sharded dim) of a pool with kernel ``k``, stride ``s``, padding ``p``, dilation ``d``::

    output row o reads       input rows o*s - p + d*j, j = 0..k-1    (outside [0, N): padding)
    output extent M          torch's rule, taken from torch itself (a meta-tensor call on the global shape)
    rank r's output rows     [o0, o1): the balanced split of M (invariant 1 of DESIGN.md)
    rank r's input rows      [lo, hi) = [(o0 - c)*s, min(N, (o1-1)*s - p + d*(k-1) + 1)),  c = min(o0, ceil(p/s))

The local op is the torch op itself with the module's own arguments (kernel, stride, padding, dilation,
ceil_mode, count_include_pad, divisor_override) on the rows ``[lo, hi)``; it yields local outputs
``[0, c + o1 - o0)`` of which the first ``c`` are dropped. Why that is the unsharded op, not a look-alike:

- ``lo`` is a multiple of ``s``: local output ``j`` is global output ``lo/s + j``, window for window.
- Above a kept window there are ``c*s >= p`` real rows, or ``lo = 0`` (the real top edge): torch's own top
  padding only reaches dropped outputs, or it *is* the global padding.
- ``hi = N`` (the real bottom edge: torch's bottom padding and ceil_mode rule, shifted by ``lo``, are the global
  ones), or every kept window ends at or before ``hi``.

So a max pool sees the same candidates in the same order (ties, NaN, all ``-inf`` windows and indices agree:
global flat index = local index + ``lo*W``), an average pool the same sums and divisors (``count_include_pad``
and ``divisor_override`` included): the forward is bitwise equal. The backward is the torch op's backward
followed by the exchange adjoint; where windows of two ranks overlap, the two partial gradients of a row are
added in a different order than on one device (float64: ~1e-16 relative).

3-d pools (``HaloMaxPool3d``, ``HaloAvgPool3d``) of ``(B, C, D, H, W)`` fields sharded along H (dim -2, the middle
of the ``(D, H, W)`` triples) use the same plan along H; D and W are whole on every rank and pooled by torch's op as
given. Max-pool indices are the global flat indices ``d*H*W + h*W + w``. ``F.avg_pool3d`` refuses an input with fewer
rows than its kernel even where padding or ceil_mode give an output, so its rows are widened to a kernel
(:func:`widen_plan`: below into rows whose outputs are dropped, or above by whole strides). Latitude rows only.

Adaptive pools: output row ``o`` pools rows ``[floor(o*N/M), ceil((o+1)*N/M))``; each local output row runs the
torch adaptive op on exactly those rows with output height 1 (same window, same order: bitwise), in a loop over
the local output rows (fine for the small outputs adaptive pools make).

An adaptive pool whose output has fewer rows than the group has ranks (a global pool: squeeze-excitation, scSE,
ASPP, CBAM; PSP's small grids) returns its result *whole on every rank*: each rank pools its rows of every window
(the torch op on them), and the shares are reduced over the group — averages weighted by their rows and summed,
maxima compared, the winner being torch's (the first maximum in row-major order, so indices and the gradient's
destination agree with torch, ties across ranks included). The backward sums the ranks' partial gradients of the
result (each rank's consumers used it on its own rows) and routes them to the input rows. The result is marked
whole (``halo.plans.mark_whole``): the converter keeps the modules after the pool in its ``nn.Sequential`` as
torch's own (they compute on the whole tensor: an ASPP branch's BatchNorm gets the unsharded statistics) and makes
a halo layer that is handed a whole tensor elsewhere raise instead of taking the copies for shards.

A window pool (max, average) whose output has fewer rows than ranks raises the same ``ValueError`` on every rank
(the global extent comes from one all-gather, so all ranks agree).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair, _triple

from ..comm import CommGroup
from ..exchange import exchange, exchanger_id, like_format
from ..geometry import adaptive_plan, adaptive_starts_ends, check_output_rows, widen_plan, window_plan
from ..mesh import group_attribute
from ..plans import Site, carry, mark_whole, resolve
from ..reduce import all_reduce
from ..transport import all_reduce as bounded_all_reduce
from ._mesh2d import mesh_of, resolve_2d, set_mesh
from .base import AxisPlan, HaloLayer
from .registry import converts

__all__ = [
    "HaloAdaptiveAvgPool2d",
    "HaloAdaptiveMaxPool2d",
    "HaloAvgPool2d",
    "HaloAvgPool3d",
    "HaloLPPool2d",
    "HaloMaxPool2d",
    "HaloMaxPool3d",
    "adaptive_pool",
    "halo_adaptive_avg_pool2d",
    "halo_adaptive_max_pool2d",
    "halo_pool",
    "window_plan",
]


def _formatted(out: Any, x: torch.Tensor) -> Any:
    """A pooled output (or ``(values, indices)``) in ``x``'s memory format, as torch's pooling returns it."""
    if isinstance(out, tuple):
        return tuple(like_format(t, x) for t in out)
    return like_format(out, x)


# -- pure geometry (no process group: testable for thousands of configurations in one process) --------------

# (window_plan, widen_plan, adaptive_plan, check_output_rows: halo.geometry, re-exported here)


_META_OPS = {"max": F.max_pool2d, "avg": F.avg_pool2d, "adaptive_avg": F.adaptive_avg_pool2d,
             "adaptive_max": F.adaptive_max_pool2d, "max3d": F.max_pool3d, "avg3d": F.avg_pool3d}


@functools.lru_cache(maxsize=512)
def _global_shape(op: str, shape: tuple[int, ...], args: tuple) -> tuple[int, ...]:
    """Output shape of pool ``op`` on a field of ``shape`` (a meta tensor: torch's size rule and checks)."""
    return tuple(_META_OPS[op](torch.empty(shape, device="meta"), *args).shape)


def _global_rows(shape: tuple[int, ...], n: int, op: str, args: tuple) -> tuple[int, ...]:
    return _global_shape(op, (*shape[:-2], n, shape[-1]), args)


#: A size along the dims a per-axis plan does not shard, for torch's size rule on meta tensors: large enough for any
#: window (the output along the planned dim does not depend on it; the dim's own checks run where it is planned,
#: or in torch's local op where it is whole on every rank alike).
_ANY_SIZE = 1 << 20


@dataclasses.dataclass(frozen=True)
class PoolPlan(AxisPlan):
    """One axis of a pool call as planned for this rank: the exchange of rows ``[lo, lo + rows)`` and the local
    outputs to keep (``crop`` dropped, then ``out`` rows); ``plain``: one rank along the axis (all of it, no crop)."""

    lo: int = 0
    crop: int = 0
    out: int = 0
    n: int = 0  # the global extent (max-pool indices are global flat indices: d*H*W + h*W + w)


def _window_pool_plan(cg: CommGroup, sizes: tuple[int, ...], dim: int, geometry: tuple[int, int, int, int], op: str,
                      kind: str, shape: tuple, args: tuple, detail: str) -> PoolPlan:
    """The geometry of a windowed pool along one axis (H, or W on a mesh; ``dim`` names it)."""
    n = sum(sizes)
    if cg.size == 1:
        return PoolPlan(True, rows=n, dim=dim, n=n)
    if dim == len(shape) - 1:
        op = f"{op} (W)"
    probe = [s if d == dim or d < len(shape) - 2 else _ANY_SIZE for d, s in enumerate(shape)]
    probe[dim] = n
    m = _global_shape(kind, tuple(probe), args)[dim]
    check_output_rows(op, m, n, cg.size, detail)
    plan = window_plan(n, m, cg.size, *geometry)
    if kind == "avg3d":  # torch's avg_pool3d wants at least a kernel of input rows, padding not counted
        plan = widen_plan(plan, n, geometry[0], geometry[1])
    lo, hi, crop, rows = plan[cg.index]
    ex = exchanger_id(cg, dim, sizes, tuple((a, b) for a, b, _, _ in plan), "zeros", op)
    return PoolPlan(False, ex, hi - lo, dim, lo, crop, rows, n)


def _window_plans(module: HaloLayer, x: torch.Tensor, op: str, kind: str, args: tuple, geometry: tuple,
                  detail: str) -> tuple[PoolPlan, ...] | None:
    """The per-axis plans of a windowed pool (``geometry[a]``: ``(kernel, stride, padding, dilation)`` along axis
    ``a``), or ``None`` where every axis is whole (one rank: the torch op itself)."""
    plans = module.axis_plans(x, op, _window_pool_plan, (op, kind, tuple(x.shape), args, detail),
                             per_axis=tuple((g,) for g in geometry))
    return None if all(p.plain for p in plans) else plans


def _crop(t: torch.Tensor, plans: tuple[PoolPlan, ...]) -> torch.Tensor:
    """This rank's outputs of the local op on the exchanged rows: ``crop`` dropped, then ``out`` kept, per axis."""
    for p in plans:
        if not p.plain:
            t = t.narrow(p.dim, p.crop, p.out)
    return t


def _run(x: torch.Tensor, plan: Any) -> torch.Tensor:
    """Rows ``[lo, lo + rows)`` of the global field along H, autograd-exact (an adaptive pool consumes them)."""
    return exchange(x, plan.ex, plan.rows, x.dim() - 2)


def _global_index(idx: torch.Tensor, plans: tuple[PoolPlan, ...], width: int) -> torch.Tensor:
    """A 2-d max pool's local flat index ``h*cols + w`` over the exchanged block as the unsharded op's ``h*W + w``."""
    h = plans[0]
    if len(plans) == 1 or plans[1].plain:  # W whole: cols == W
        return idx + h.lo * width if not h.plain else idx
    w = plans[1]
    return (idx // w.rows + h.lo) * w.n + idx % w.rows + w.lo


# -- max / average pooling --------------------------------------------------------------------------------

@converts(nn.MaxPool2d, axes=2)
class HaloMaxPool2d(HaloLayer, nn.MaxPool2d):
    """``nn.MaxPool2d`` on an H-sharded field; output = the balanced split of the global output rows.

    Built from an existing ``nn.MaxPool2d`` (same arguments, same ``repr``, no state). Every argument torch
    accepts is supported: kernel != stride, padding, dilation, ceil_mode, return_indices (indices are global
    flat indices ``h*W + w``, as the unsharded op returns).
    """

    def __init__(self, pool: nn.MaxPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.MaxPool2d):
            raise TypeError(f"HaloMaxPool2d wraps an nn.MaxPool2d, got {type(pool).__name__}"
                            + _adaptive_hint(pool))
        super().__init__(pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                         return_indices=pool.return_indices, ceil_mode=pool.ceil_mode)
        self.halo_init(group, mesh)

    def forward(self, x: torch.Tensor):
        op = "HaloMaxPool2d"
        k, s, p, d = (_pair(a)[0] for a in (self.kernel_size, self.stride, self.padding, self.dilation))
        args = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        detail = f", kernel {k}, stride {s}, padding {p}, dilation {d}, ceil_mode={self.ceil_mode}"
        k2, s2, p2, d2 = _pair(self.kernel_size), _pair(self.stride), _pair(self.padding), _pair(self.dilation)
        geometry = ((k2[0], s2[0], p2[0], d2[0]), (k2[1], s2[1], p2[1], d2[1]))
        plans = _window_plans(self, x, op, "max", args, geometry, detail)
        if plans is None:
            return nn.MaxPool2d.forward(self, x)
        out = F.max_pool2d(self.exchange_axes(x, plans), self.kernel_size, self.stride, self.padding, self.dilation,
                           ceil_mode=self.ceil_mode, return_indices=self.return_indices)
        if self.return_indices:
            out, idx = out
            out = _crop(out, plans), _global_index(_crop(idx, plans), plans, x.shape[-1])
        else:
            out = _crop(out, plans)
        return self.finish(_formatted(out, x), x)


@converts(nn.AvgPool2d, axes=2)
class HaloAvgPool2d(HaloLayer, nn.AvgPool2d):
    """``nn.AvgPool2d`` on an H-sharded field; output = the balanced split of the global output rows.

    Every argument torch accepts is supported (padding, ceil_mode, count_include_pad, divisor_override): the
    local op is torch's with the same arguments, so the divisors are torch's own. Forward bitwise equal.
    """

    def __init__(self, pool: nn.AvgPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AvgPool2d):
            raise TypeError(f"HaloAvgPool2d wraps an nn.AvgPool2d, got {type(pool).__name__}"
                            + _adaptive_hint(pool))
        super().__init__(pool.kernel_size, pool.stride, pool.padding, ceil_mode=pool.ceil_mode,
                         count_include_pad=pool.count_include_pad, divisor_override=pool.divisor_override)
        self.halo_init(group, mesh)

    def _pool(self, t: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(t, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "HaloAvgPool2d"
        k, s, p = (_pair(a)[0] for a in (self.kernel_size, self.stride, self.padding))
        args = (self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                self.divisor_override)
        detail = f", kernel {k}, stride {s}, padding {p}, ceil_mode={self.ceil_mode}"
        k2, s2, p2 = _pair(self.kernel_size), _pair(self.stride), _pair(self.padding)
        geometry = ((k2[0], s2[0], p2[0], 1), (k2[1], s2[1], p2[1], 1))
        plans = _window_plans(self, x, op, "avg", args, geometry, detail)
        if plans is None:
            return nn.AvgPool2d.forward(self, x)
        return self.finish(_crop(self._pool(self.exchange_axes(x, plans)), plans), x)


# -- 3-d max / average pooling: (B, C, D, H, W) fields, H (dim -2) sharded ------------------------------------

def _no_mesh_3d(module: nn.Module, name: str) -> None:
    if mesh_of(module) is not None:
        raise ValueError(f"{name}: a latitude x longitude mesh is supported by the 2-d layers only; shard only "
                         f"latitude (a one-axis mesh) for 3-d pools")


def _h_geometry(kernel: Any, stride: Any, padding: Any, dilation: Any = 1) -> tuple[int, int, int, int]:
    """``(kernel, stride, padding, dilation)`` along H, the middle of a 3-d pool's ``(D, H, W)`` triples."""
    return tuple(_triple(a)[1] for a in (kernel, stride, padding, dilation))  # type: ignore[return-value]


def _global_index_3d(idx: torch.Tensor, plan: PoolPlan, width: int) -> torch.Tensor:
    """A local 3-d flat index ``d*rows*W + h*W + w`` over the exchanged rows ``[lo, lo + rows)`` as the unsharded
    op's global one ``d*H*W + (lo + h)*W + w``."""
    plane = plan.rows * width
    return idx // plane * (plan.n * width) + idx % plane + plan.lo * width


@converts(nn.MaxPool3d)
class HaloMaxPool3d(HaloLayer, nn.MaxPool3d):
    """``nn.MaxPool3d`` on a ``(B, C, D, H, W)`` field sharded along H (dim -2); output = the balanced split of the
    global output rows.

    The 2-d machinery along H (exchange the rows the kept windows read, run torch's op with the module's own
    arguments, drop the first ``crop`` outputs: module docstring), D and W untouched. Every argument torch accepts is
    supported: kernel != stride, padding, dilation, ceil_mode, return_indices (indices are the unsharded op's global
    flat indices ``d*H*W + h*W + w``). Latitude rows only: a latitude x longitude mesh is refused.
    """

    def __init__(self, pool: nn.MaxPool3d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.MaxPool3d):
            raise TypeError(f"HaloMaxPool3d wraps an nn.MaxPool3d, got {type(pool).__name__}")
        super().__init__(pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                         return_indices=pool.return_indices, ceil_mode=pool.ceil_mode)
        self.halo_init(group, mesh)
        _no_mesh_3d(self, "HaloMaxPool3d")

    def forward(self, x: torch.Tensor):
        op = "HaloMaxPool3d"
        k, s, p, d = geometry = _h_geometry(self.kernel_size, self.stride, self.padding, self.dilation)
        args = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        detail = f", kernel {k}, stride {s}, padding {p}, dilation {d} along H, ceil_mode={self.ceil_mode}"
        plans = _window_plans(self, x, op, "max3d", args, (geometry,), detail)
        if plans is None:
            return nn.MaxPool3d.forward(self, x)
        out = F.max_pool3d(self.exchange_axes(x, plans), self.kernel_size, self.stride, self.padding, self.dilation,
                           ceil_mode=self.ceil_mode, return_indices=self.return_indices)
        if self.return_indices:
            out, idx = out
            out = _crop(out, plans), _global_index_3d(_crop(idx, plans), plans[0], x.shape[-1])
        else:
            out = _crop(out, plans)
        return self.finish(_formatted(out, x), x)


@converts(nn.AvgPool3d)
class HaloAvgPool3d(HaloLayer, nn.AvgPool3d):
    """``nn.AvgPool3d`` on a ``(B, C, D, H, W)`` field sharded along H (dim -2); output = the balanced split of the
    global output rows.

    Every argument torch accepts is supported (padding, ceil_mode, count_include_pad, divisor_override): the local op
    is torch's with the same arguments on the rows the kept windows read, so the divisors are torch's own. Forward
    bitwise equal. Latitude rows only: a latitude x longitude mesh is refused.
    """

    def __init__(self, pool: nn.AvgPool3d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AvgPool3d):
            raise TypeError(f"HaloAvgPool3d wraps an nn.AvgPool3d, got {type(pool).__name__}")
        super().__init__(pool.kernel_size, pool.stride, pool.padding, ceil_mode=pool.ceil_mode,
                         count_include_pad=pool.count_include_pad, divisor_override=pool.divisor_override)
        self.halo_init(group, mesh)
        _no_mesh_3d(self, "HaloAvgPool3d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "HaloAvgPool3d"
        k, s, p, _ = geometry = _h_geometry(self.kernel_size, self.stride, self.padding)
        args = (self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                self.divisor_override)
        detail = f", kernel {k}, stride {s}, padding {p} along H, ceil_mode={self.ceil_mode}"
        plans = _window_plans(self, x, op, "avg3d", args, (geometry,), detail)
        if plans is None:
            return nn.AvgPool3d.forward(self, x)
        out = F.avg_pool3d(self.exchange_axes(x, plans), self.kernel_size, self.stride, self.padding, self.ceil_mode,
                           self.count_include_pad, self.divisor_override)
        return self.finish(_crop(out, plans), x)


# -- adaptive pooling ---------------------------------------------------------------------------------------

class AdaptivePlan(NamedTuple):
    """An adaptive pool as planned for this rank: the exchange of rows ``[lo, lo + rows)``, and per local output
    row its window ``(start - lo, length)`` and global start (for indices). ``whole``: fewer output rows than
    ranks, so every rank computes its share of *every* output row (``windows``: the part of each window on this
    rank, ``(local start, length, global start)``; ``sizes``: each window's length) and the shares are reduced."""

    plain: bool
    ex: int = -1
    rows: int = 0
    windows: tuple[tuple[int, int, int], ...] = ()
    w_out: int = 0
    whole: bool = False
    sizes: tuple[int, ...] = ()


def _adaptive_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], op: str, shape: tuple, output_size: Any,
                   is_max: bool) -> AdaptivePlan:
    (sizes,) = extents
    if cg.size == 1:
        return AdaptivePlan(True)
    n = sum(sizes)
    m, w_out = _global_rows(shape, n, "adaptive_max" if is_max else "adaptive_avg", (output_size,))[-2:]
    if m < cg.size:  # a global pool (squeeze-excitation, ASPP, PSP): the result whole on every rank
        first = sum(sizes[:cg.index])
        last = first + sizes[cg.index]
        starts, ends = adaptive_starts_ends(n, m)
        parts = tuple((max(a, first) - first, max(0, min(b, last) - max(a, first)), max(a, first))
                      for a, b in zip(starts, ends, strict=True))
        return AdaptivePlan(False, windows=parts, w_out=w_out, whole=True,
                            sizes=tuple(b - a for a, b in zip(starts, ends, strict=True)))
    plan = adaptive_plan(n, m, cg.size)
    lo, hi, o0, o1 = plan[cg.index]
    starts, ends = adaptive_starts_ends(n, m)
    ex = exchanger_id(cg, len(shape) - 2, sizes, tuple((a, b) for a, b, _, _ in plan), "zeros", op)
    windows = tuple((starts[o] - lo, ends[o] - starts[o], starts[o]) for o in range(o0, o1))
    return AdaptivePlan(False, ex, hi - lo, windows, w_out)


def adaptive_pool(x: torch.Tensor, output_size, group: Any | None, op: str, is_max: bool, return_indices: bool,
                  site: Site | None = None):
    """An adaptive average or max pool of the global field on its H-shards (the modules and functions below)."""
    fn = F.adaptive_max_pool2d if is_max else F.adaptive_avg_pool2d
    plan = resolve(x, group, op, _adaptive_plan, (op, tuple(x.shape), output_size, is_max), site=site)
    if plan.plain:
        return fn(x, output_size, return_indices) if is_max else fn(x, output_size)
    if plan.whole:
        result = _whole_pool(x, plan, group, is_max, return_indices)
        for t in result if isinstance(result, tuple) else (result,):
            mark_whole(t, op)
        return result
    ext = _run(x, plan)
    outs, idxs = [], []
    for start, length, global_start in plan.windows:
        # Output row o pools exactly rows [starts[o], ends[o]): torch's op on them with output height 1 is
        # the same window, summed (or compared) in the same order as on the full field.
        window = ext.narrow(-2, start, length)
        if is_max:
            out, idx = fn(window, (1, plan.w_out), True)
            outs.append(out)
            idxs.append(idx + global_start * x.shape[-1])
        else:
            # The aten op itself: F.adaptive_avg_pool2d turns a (1, 1) output into a mean (another sum order).
            outs.append(torch.ops.aten._adaptive_avg_pool2d(window, [1, plan.w_out]))
    out = torch.cat(outs, dim=-2)
    result = (out, torch.cat(idxs, dim=-2)) if is_max and return_indices else out
    carry(result, x)
    return result


class _WholeMaxFn(torch.autograd.Function):
    """An adaptive max pool with fewer output rows than ranks: every rank's window maxima, the maximum over ranks,
    and the winner of each window as torch picks it (the first maximum in row-major order: the smallest global
    flat index among the ranks that hold the maximum). Backward: each window's gradient, summed over the ranks
    (each rank's consumers contributed their part), goes to the winner's element on the rank that holds it."""

    @staticmethod
    def forward(ctx, x, plan, info, width):
        b, c = x.shape[:2]
        vals, idxs = [], []
        for start, length, global_start in plan.windows:
            if length:
                v, i = F.adaptive_max_pool2d(x.narrow(-2, start, length), (1, plan.w_out), True)
                vals.append(v)
                idxs.append(i + global_start * width)
            else:  # no rows of this window here
                vals.append(x.new_full((b, c, 1, plan.w_out), float("-inf")))
                idxs.append(torch.full((b, c, 1, plan.w_out), _NO_INDEX, dtype=torch.int64, device=x.device))
        best, winner, mine = _max_winner(torch.cat(vals, dim=-2), torch.cat(idxs, dim=-2), info)
        ctx.save_for_backward(winner, mine)
        ctx.info, ctx.shape, ctx.row0 = info, x.shape, _row0(plan)
        ctx.mark_non_differentiable(winner)
        return best.to(x.dtype), winner

    @staticmethod
    def backward(ctx, grad, _gidx):
        winner, mine = ctx.saved_tensors
        width = ctx.shape[-1]
        local = (winner - ctx.row0 * width).clamp(0, ctx.shape[-2] * width - 1)
        return _max_grad(grad, ctx.info, local, mine, ctx.shape), None, None, None


_NO_INDEX = torch.iinfo(torch.int64).max


def _max_winner(values: torch.Tensor, index: torch.Tensor, info: CommGroup
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A max over the ranks and its winner as torch picks it: ``(maximum, the smallest global index among the ranks
    holding it, whether this rank holds the winner)``; ``index``: each local maximum's global flat index."""
    acc = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else values.dtype  # exact widening
    local = values.to(acc)
    best = bounded_all_reduce(local.clone(), info, "global max pool", dist.ReduceOp.MAX)
    winner = torch.where(local == best, index, torch.full_like(index, _NO_INDEX))
    bounded_all_reduce(winner, info, "global max pool", dist.ReduceOp.MIN)
    return best, winner, (index == winner) & (local == best)


def _max_grad(grad: torch.Tensor, info: CommGroup, positions: torch.Tensor, mine: torch.Tensor,
              shape: torch.Size) -> torch.Tensor:
    """The adjoint of :func:`_max_winner`: the gradient summed over the ranks (each rank's consumers contributed
    their part) lands on the winner's local flat ``positions`` on the rank that holds it (``mine``)."""
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    g = bounded_all_reduce(grad.to(acc, copy=True), info, "global max pool (backward)")
    gx = torch.zeros(shape, dtype=acc, device=grad.device).flatten(-2)
    gx.scatter_add_(-1, positions.flatten(-2), torch.where(mine, g, torch.zeros_like(g)).flatten(-2))
    return gx.view(shape).to(grad.dtype)


def _row0(plan: AdaptivePlan) -> int:
    """This rank's first global row: the global start of its part of a window minus its local start."""
    for start, length, global_start in plan.windows:
        if length:
            return global_start - start
    return 0


@torch._dynamo.disable  # collectives with bounded waits: run eagerly (a graph break under torch.compile)
def _whole_pool(x: torch.Tensor, plan: AdaptivePlan, group: Any | None, is_max: bool, return_indices: bool):
    """An adaptive pool with fewer output rows than ranks, whole on every rank: each rank pools its rows of each
    window, and the shares are reduced over the group (average: means weighted by rows, summed; max: above)."""
    from ..comm import comm_group

    info = comm_group(group)
    if is_max:
        out, index = _WholeMaxFn.apply(x, plan, info, x.shape[-1])
        return (out, index) if return_indices else out
    b, c = x.shape[:2]
    parts = []
    for (start, length, _), size in zip(plan.windows, plan.sizes, strict=True):
        if length:  # the window's mean over this rank's rows, weighted by their share of the window
            mean = torch.ops.aten._adaptive_avg_pool2d(x.narrow(-2, start, length), [1, plan.w_out])
            parts.append(mean * (length / size))
        else:
            parts.append(x.new_zeros((b, c, 1, plan.w_out)))
    return all_reduce(torch.cat(parts, dim=-2), "sum", group)


# -- global pools on a latitude x longitude mesh -------------------------------------------------------------------

class MeshPoolPlan(NamedTuple):
    """A global pool (output 1 x 1) of a block: its first row and column, the global extents, the domain group."""

    h0: int
    w0: int
    height: int
    width: int
    gid: int


def _mesh_pool_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], groups: tuple, op: str, kind: str,
                    shape: tuple, output_size: Any, pw: int) -> MeshPoolPlan:
    from ..comm import group_id

    if len(shape) != 4:  # checked here, after the agreement (the number of dims is agreed): on every rank alike
        raise ValueError(f"{op}: expected a (B, C, H, W) block, got shape {shape}")
    height, width = sum(extents[0]), sum(extents[1])
    out = _global_shape(kind, (*shape[:-2], height, width), (output_size,))[-2:]
    if tuple(out) != (1, 1):
        raise ValueError(f"{op}: on a latitude x longitude mesh only a global pool (output 1 x 1) has a form here; "
                         f"output_size={output_size} gives {tuple(out)} of a {height} x {width} field: shard latitude "
                         f"only (a manager), or pool to 1 x 1")
    i, j = divmod(cg.index, pw)
    return MeshPoolPlan(sum(extents[0][:i]), sum(extents[1][:j]), height, width, group_id(cg))


class _MeshMaxFn(torch.autograd.Function):
    """A global max pool of blocks: each block's maximum and its global flat index ``h*W + w``, the maximum over the
    domain, the winner as torch picks it (the smallest global index among the maxima); backward: the gradient, summed
    over the ranks (each rank's consumers contributed their part), goes to the winner's element on its rank."""

    @staticmethod
    def forward(ctx, x, plan, info):
        w = x.shape[-1]
        v, i = F.adaptive_max_pool2d(x, 1, True)
        best, winner, mine = _max_winner(v, (i // w + plan.h0) * plan.width + i % w + plan.w0, info)
        ctx.save_for_backward(i, mine)
        ctx.info, ctx.shape = info, x.shape
        ctx.mark_non_differentiable(winner)
        return best.to(x.dtype), winner

    @staticmethod
    def backward(ctx, grad, _gidx):
        i, mine = ctx.saved_tensors
        return _max_grad(grad, ctx.info, i, mine, ctx.shape), None, None


@torch._dynamo.disable  # collectives with bounded waits: run eagerly (a graph break under torch.compile)
def _mesh_pool(x: torch.Tensor, plan: MeshPoolPlan, is_max: bool, return_indices: bool) -> Any:
    from ..comm import group_by_id

    info = group_by_id(plan.gid)
    if is_max:
        out, index = _MeshMaxFn.apply(x, plan, info)
        return (out, index) if return_indices else out
    share = x.shape[-2] * x.shape[-1] / (plan.height * plan.width)  # the block's share of the global mean
    return all_reduce(torch.ops.aten._adaptive_avg_pool2d(x, [1, 1]) * share, "sum", info.group)


def mesh_global_pool(x: torch.Tensor, output_size: Any, mesh: Any, is_max: bool, return_indices: bool, op: str,
                     site: Site | None = None) -> Any:
    """A global adaptive pool (output 1 x 1: squeeze-excitation, scSE, CBAM) of a field sharded in blocks of a
    latitude x longitude mesh; the result is whole on every rank, as on latitude rows."""
    kind = "adaptive_max" if is_max else "adaptive_avg"
    plan = resolve_2d(x, mesh, op, _mesh_pool_plan, (op, kind, tuple(x.shape), output_size, mesh.domain_shape[1]),
                      site)
    result = _mesh_pool(x, plan, is_max, return_indices)
    for t in result if isinstance(result, tuple) else (result,):
        mark_whole(t, op)
    return result


def halo_adaptive_avg_pool2d(x: torch.Tensor, output_size, *, group: Any | None = None) -> torch.Tensor:
    """``F.adaptive_avg_pool2d`` of the global field, on its H-shards (output: balanced split of its rows)."""
    return adaptive_pool(x, output_size, group, "halo_adaptive_avg_pool2d", False, False)


def halo_adaptive_max_pool2d(x: torch.Tensor, output_size, return_indices: bool = False, *,
                             group: Any | None = None):
    """``F.adaptive_max_pool2d`` of the global field on its H-shards; indices are global flat ``h*W + w``."""
    return adaptive_pool(x, output_size, group, "halo_adaptive_max_pool2d", True, return_indices)


@converts(nn.AdaptiveAvgPool2d, axes=2, mesh_ok=lambda m: m.output_size in (1, (1, 1)))
class HaloAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` on an H-sharded field (windows depend on the global extent: computed from it).

    With fewer output rows than ranks (a global average, ``output_size=1``) the result is whole on every rank
    (module docstring).
    """

    group = group_attribute()

    def __init__(self, pool: nn.AdaptiveAvgPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AdaptiveAvgPool2d):
            raise TypeError(f"HaloAdaptiveAvgPool2d wraps an nn.AdaptiveAvgPool2d, got {type(pool).__name__}")
        super().__init__(pool.output_size)
        self.group = group
        self._halo_site = Site()
        set_mesh(self, mesh, "HaloAdaptiveAvgPool2d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = mesh_of(self)
        if mesh is not None:
            return mesh_global_pool(x, self.output_size, mesh, False, False, "HaloAdaptiveAvgPool2d", self._halo_site)
        return adaptive_pool(x, self.output_size, self.group, "HaloAdaptiveAvgPool2d", False, False, self._halo_site)


@converts(nn.AdaptiveMaxPool2d, axes=2, mesh_ok=lambda m: m.output_size in (1, (1, 1)))
class HaloAdaptiveMaxPool2d(nn.AdaptiveMaxPool2d):
    """``nn.AdaptiveMaxPool2d`` on an H-sharded field; indices (``return_indices``) are global flat ``h*W + w``."""

    group = group_attribute()

    def __init__(self, pool: nn.AdaptiveMaxPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AdaptiveMaxPool2d):
            raise TypeError(f"HaloAdaptiveMaxPool2d wraps an nn.AdaptiveMaxPool2d, got {type(pool).__name__}")
        super().__init__(pool.output_size, pool.return_indices)
        self.group = group
        self._halo_site = Site()
        set_mesh(self, mesh, "HaloAdaptiveMaxPool2d")

    def forward(self, x: torch.Tensor):
        mesh = mesh_of(self)
        if mesh is not None:
            return mesh_global_pool(x, self.output_size, mesh, True, self.return_indices, "HaloAdaptiveMaxPool2d",
                                    self._halo_site)
        return adaptive_pool(x, self.output_size, self.group, "HaloAdaptiveMaxPool2d", True, self.return_indices,
                         self._halo_site)


# -- conversion ---------------------------------------------------------------------------------------------

@converts(nn.LPPool2d, axes=2)
class HaloLPPool2d(nn.LPPool2d):
    """``nn.LPPool2d`` on an H-sharded field (and on a latitude x longitude mesh), computed as torch computes it:
    ``(avg_pool2d(x ** p) * kh * kw) ** (1 / p)`` (a max pool of ``|x|`` for ``p = ±inf``), with the pool a
    :class:`HaloAvgPool2d` (:class:`HaloMaxPool2d`) of the same kernel, stride and ceil_mode: the pointwise steps
    before and after it act on each row, so the result is torch's, forward and backward, on any split."""

    def __init__(self, pool: nn.LPPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.LPPool2d):
            raise TypeError(f"HaloLPPool2d wraps an nn.LPPool2d, got {type(pool).__name__}")
        super().__init__(pool.norm_type, pool.kernel_size, pool.stride, pool.ceil_mode)
        p = float(pool.norm_type)
        if abs(p) == math.inf:
            maxpool = nn.MaxPool2d(pool.kernel_size, pool.stride, 0, 1, ceil_mode=pool.ceil_mode)
            inner: nn.Module = HaloMaxPool2d(maxpool, group=group, mesh=mesh)
        else:
            stride = pool.stride if pool.stride is not None else pool.kernel_size
            inner = HaloAvgPool2d(nn.AvgPool2d(pool.kernel_size, stride, 0, ceil_mode=pool.ceil_mode),
                                  group=group, mesh=mesh)
        object.__setattr__(self, "_halo_inner", inner)  # not a child: the module tree (and state_dict) is torch's

    @property
    def group(self) -> Any | None:
        return self._halo_inner.group

    @group.setter
    def group(self, group: Any | None) -> None:
        self._halo_inner.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = float(self.norm_type)
        if p == math.inf:
            return self._halo_inner(x.abs())
        if p == -math.inf:
            return -self._halo_inner(-x.abs())
        kh, kw = _pair(self.kernel_size)
        out = self._halo_inner(x.pow(self.norm_type))
        return (torch.sign(out) * F.relu(torch.abs(out))).mul(kw * kh).pow(1.0 / self.norm_type)


_POOLS = ((nn.MaxPool2d, HaloMaxPool2d), (nn.AvgPool2d, HaloAvgPool2d),
          (nn.AdaptiveAvgPool2d, HaloAdaptiveAvgPool2d), (nn.AdaptiveMaxPool2d, HaloAdaptiveMaxPool2d),
          (nn.MaxPool3d, HaloMaxPool3d), (nn.AvgPool3d, HaloAvgPool3d), (nn.LPPool2d, HaloLPPool2d))


def halo_pool(pool: nn.Module, *, group: Any | None = None) -> nn.Module:
    """The domain-parallel twin of a 2-d pooling module; ``NotImplementedError`` naming why for the others."""
    for cls, halo_cls in _POOLS:
        if type(pool) is cls:
            return halo_cls(pool, group=group)
    raise NotImplementedError(
        f"no domain-parallel version of {type(pool).__name__}: supported are "
        f"{', '.join(c.__name__ for c, _ in _POOLS)} (over (B, C, H, W) or (B, C, D, H, W) sharded along H, "
        f"dim -2); FractionalMaxPool2d (random windows), 1-d pools and adaptive 3-d pools are not "
        f"implemented")


def _adaptive_hint(pool: Any) -> str:
    if isinstance(pool, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        return (f"; adaptive pools have windows that depend on the global size: use "
                f"Halo{type(pool).__name__} (or halo_pool(module))")
    return ""
