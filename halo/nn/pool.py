"""Domain-parallel pooling of an H-sharded field: the same numbers as the unsharded pool, forward and backward.

Geometry along H (the sharded dim) of a pool with kernel ``k``, stride ``s``, padding ``p``, dilation ``d``::

    output row o reads       input rows o*s - p + d*j, j = 0..k-1    (outside [0, N): padding)
    output extent M          torch's rule, taken from torch itself (a meta-tensor call on the global shape)
    rank r's output rows     [o0, o1): the balanced split of M (invariant 1 of docs/design.md)
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

3-d pools (``DomainMaxPool3d``, ``DomainAvgPool3d``) of ``(B, C, D, H, W)`` fields sharded along H (dim -2, the middle
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
whole (``halo.plan.plans.mark_whole``): the converter keeps the modules after the pool in its ``nn.Sequential`` as
torch's own (they compute on the whole tensor: an ASPP branch's BatchNorm gets the unsharded statistics) and makes
a halo layer that is handed a whole tensor elsewhere raise instead of taking the copies for shards.

That global pool is one path on either decomposition: the per-axis plans (one agreement) give, along each axis,
this rank's part of every window (its block's offset and the global extent; latitude rows are a mesh whose W is
whole on every rank: offset 0, extent local), torch's op runs on each block of a window's parts, and the shares
are reduced over the layer's domain group (every rank of a mesh). So a latitude x longitude mesh pools blocks to
1 x 1 (the form the converter gives it: a windowed adaptive pool there is refused, on every rank alike) with the
same numbers and winners as latitude rows.

A window pool (max, average) whose output has fewer rows than ranks raises the same ``ValueError`` on every rank
(the global extent comes from one all-gather, so all ranks agree).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair, _triple

from ..autocast import cast_as_torch
from ..dist.comm import CommGroup, comm_group
from ..dist.transport import all_reduce as bounded_all_reduce
from ..dist.transport import eager_only
from ..exchange import exchanger_id, like_format
from ..parallel.reduce import all_reduce
from ..plan.geometry import adaptive_plan, adaptive_starts_ends, check_output_rows, widen_plan, window_plan
from ..plan.plans import Site, mark_whole
from .base import AxisPlan, DomainLayer, exchange_axes, finish, run_axes
from .registry import converts, entries

__all__ = [
    "DomainAdaptiveAvgPool2d",
    "DomainAdaptiveMaxPool2d",
    "DomainAvgPool2d",
    "DomainAvgPool3d",
    "DomainLPPool2d",
    "DomainMaxPool2d",
    "DomainMaxPool3d",
    "adaptive_pool",
    "halo_adaptive_avg_pool2d",
    "halo_adaptive_max_pool2d",
    "halo_pool",
    "pools",
    "window_plan",
]


def _formatted(out: Any, x: torch.Tensor) -> Any:
    """A pooled output (or ``(values, indices)``) in ``x``'s memory format, as torch's pooling returns it."""
    if isinstance(out, tuple):
        return tuple(like_format(t, x) for t in out)
    return like_format(out, x)


# -- pure geometry (no process group: testable for thousands of configurations in one process) --------------

# (window_plan, widen_plan, adaptive_plan, check_output_rows: halo.plan.geometry, re-exported here)


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


def _window_plans(module: DomainLayer, x: torch.Tensor, op: str, kind: str, args: tuple, geometry: tuple,
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


def _global_index(idx: torch.Tensor, plans: tuple[PoolPlan, ...], width: int) -> torch.Tensor:
    """A 2-d max pool's local flat index ``h*cols + w`` over the exchanged block as the unsharded op's ``h*W + w``."""
    h = plans[0]
    if len(plans) == 1 or plans[1].plain:  # W whole: cols == W
        return idx + h.lo * width if not h.plain else idx
    w = plans[1]
    return (idx // w.rows + h.lo) * w.n + idx % w.rows + w.lo


# -- max / average pooling --------------------------------------------------------------------------------

@converts(nn.MaxPool2d, axes=2, functional=(F.max_pool2d, torch.max_pool2d),
          example=lambda kind: (kind(3, 2, 1), (2, 3, 23, 7)))
class DomainMaxPool2d(DomainLayer, nn.MaxPool2d):
    """``nn.MaxPool2d`` on an H-sharded field; output = the balanced split of the global output rows.

    Built from an existing ``nn.MaxPool2d`` (same arguments, same ``repr``, no state). Every argument torch
    accepts is supported: kernel != stride, padding, dilation, ceil_mode, return_indices (indices are global
    flat indices ``h*W + w``, as the unsharded op returns).
    """

    def __init__(self, pool: nn.MaxPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.MaxPool2d):
            raise TypeError(f"DomainMaxPool2d wraps an nn.MaxPool2d, got {type(pool).__name__}"
                            + _adaptive_hint(pool))
        super().__init__(pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                         return_indices=pool.return_indices, ceil_mode=pool.ceil_mode)
        self.halo_init(group, mesh)

    def forward(self, x: torch.Tensor):
        op = "DomainMaxPool2d"
        x = cast_as_torch("max_pool2d", x)  # torch's dtype under autocast (halo.autocast)
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


@converts(nn.AvgPool2d, axes=2, functional=(F.avg_pool2d,), example=lambda kind: (kind(3, 2, 1), (2, 3, 23, 7)))
class DomainAvgPool2d(DomainLayer, nn.AvgPool2d):
    """``nn.AvgPool2d`` on an H-sharded field; output = the balanced split of the global output rows.

    Every argument torch accepts is supported (padding, ceil_mode, count_include_pad, divisor_override): the
    local op is torch's with the same arguments, so the divisors are torch's own. Forward bitwise equal.
    """

    def __init__(self, pool: nn.AvgPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AvgPool2d):
            raise TypeError(f"DomainAvgPool2d wraps an nn.AvgPool2d, got {type(pool).__name__}"
                            + _adaptive_hint(pool))
        super().__init__(pool.kernel_size, pool.stride, pool.padding, ceil_mode=pool.ceil_mode,
                         count_include_pad=pool.count_include_pad, divisor_override=pool.divisor_override)
        self.halo_init(group, mesh)

    def _pool(self, t: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(t, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "DomainAvgPool2d"
        x = cast_as_torch("avg_pool2d", x)  # torch's dtype under autocast (halo.autocast)
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

def _no_mesh_3d(module: DomainLayer, name: str) -> None:
    """3-d pools plan along H alone: a mesh that also shards W is refused when the layer is made."""
    if module.halo_axes > 1:
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


@converts(nn.MaxPool3d, functional=(F.max_pool3d, torch.max_pool3d),
          example=lambda kind: (kind(3, 2, 1), (2, 2, 5, 23, 7)))
class DomainMaxPool3d(DomainLayer, nn.MaxPool3d):
    """``nn.MaxPool3d`` on a ``(B, C, D, H, W)`` field sharded along H (dim -2); output = the balanced split of the
    global output rows.

    The 2-d machinery along H (exchange the rows the kept windows read, run torch's op with the module's own
    arguments, drop the first ``crop`` outputs: module docstring), D and W untouched. Every argument torch accepts is
    supported: kernel != stride, padding, dilation, ceil_mode, return_indices (indices are the unsharded op's global
    flat indices ``d*H*W + h*W + w``). Latitude rows only: a latitude x longitude mesh is refused.
    """

    def __init__(self, pool: nn.MaxPool3d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.MaxPool3d):
            raise TypeError(f"DomainMaxPool3d wraps an nn.MaxPool3d, got {type(pool).__name__}")
        super().__init__(pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                         return_indices=pool.return_indices, ceil_mode=pool.ceil_mode)
        self.halo_init(group, mesh)
        _no_mesh_3d(self, "DomainMaxPool3d")

    def forward(self, x: torch.Tensor):
        op = "DomainMaxPool3d"
        x = cast_as_torch("max_pool3d", x)  # torch's dtype under autocast (halo.autocast)
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


@converts(nn.AvgPool3d, functional=(F.avg_pool3d,), example=lambda kind: (kind(3, 2, 1), (2, 2, 5, 23, 7)))
class DomainAvgPool3d(DomainLayer, nn.AvgPool3d):
    """``nn.AvgPool3d`` on a ``(B, C, D, H, W)`` field sharded along H (dim -2); output = the balanced split of the
    global output rows.

    Every argument torch accepts is supported (padding, ceil_mode, count_include_pad, divisor_override): the local op
    is torch's with the same arguments on the rows the kept windows read, so the divisors are torch's own. Forward
    bitwise equal. Latitude rows only: a latitude x longitude mesh is refused.
    """

    def __init__(self, pool: nn.AvgPool3d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AvgPool3d):
            raise TypeError(f"DomainAvgPool3d wraps an nn.AvgPool3d, got {type(pool).__name__}")
        super().__init__(pool.kernel_size, pool.stride, pool.padding, ceil_mode=pool.ceil_mode,
                         count_include_pad=pool.count_include_pad, divisor_override=pool.divisor_override)
        self.halo_init(group, mesh)
        _no_mesh_3d(self, "DomainAvgPool3d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "DomainAvgPool3d"
        x = cast_as_torch("avg_pool3d", x)  # torch's dtype under autocast (halo.autocast)
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

#: ``(local start, length, global start, window length)``: the rows of one window along an axis that a rank pools.
Part = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class AdaptivePlan(AxisPlan):
    """One axis of an adaptive pool as planned for this rank: ``out`` outputs along the axis, of a global extent
    ``n`` whose first ``first`` indices are on the ranks before this one. ``plain``: one rank along the axis (torch's
    op over all of it, ``rows == n``). ``whole``: fewer outputs than ranks (a global pool along the axis): ``parts``
    holds this rank's part of every window (empty parts included) and the result is reduced over the domain. Else
    windowed: the exchange ``ex`` of ``rows`` rows and, in ``parts``, the window of each local output (its start in
    the exchanged rows)."""

    whole: bool = False
    parts: tuple[Part, ...] = ()
    out: int = 0
    first: int = 0
    n: int = 0


def _adaptive_axis_plan(cg: CommGroup, sizes: tuple[int, ...], dim: int, op: str, kind: str, shape: tuple,
                        output_size: Any) -> AdaptivePlan:
    """The geometry of an adaptive pool along one axis (H; W too on a mesh: ``dim`` names it). Output ``o`` pools
    the rows ``[floor(o*n/m), ceil((o+1)*n/m))`` of the axis (:func:`halo.plan.geometry.adaptive_starts_ends`)."""
    n = sum(sizes)
    probe = list(shape)
    probe[dim] = n  # torch's size rule and checks; the other dims are this rank's (only ``dim``'s output is read)
    m = _global_shape(kind, tuple(probe), (output_size,))[dim]
    if cg.size == 1:
        return AdaptivePlan(True, rows=n, dim=dim, out=m, n=n)
    first = sum(sizes[:cg.index])
    starts, ends = adaptive_starts_ends(n, m)
    if m < cg.size:  # a global pool along the axis (squeeze-excitation, ASPP, PSP): the result whole on every rank
        last = first + sizes[cg.index]
        parts = tuple((max(a, first) - first, max(0, min(b, last) - max(a, first)), max(a, first), b - a)
                      for a, b in zip(starts, ends, strict=True))
        return AdaptivePlan(False, dim=dim, whole=True, parts=parts, out=m, first=first, n=n)
    plan = adaptive_plan(n, m, cg.size)
    lo, hi, o0, o1 = plan[cg.index]
    ex = exchanger_id(cg, dim, sizes, tuple((a, b) for a, b, _, _ in plan), "zeros", op)
    parts = tuple((starts[o] - lo, ends[o] - starts[o], starts[o], ends[o] - starts[o]) for o in range(o0, o1))
    return AdaptivePlan(False, ex, hi - lo, dim, parts=parts, out=m, first=first, n=n)


def _adaptive_path(plans: tuple[AdaptivePlan, ...], op: str, output_size: Any) -> str:
    """How a call runs, from its per-axis plans (agreed: the same answer, or the same error, on every rank):
    ``"plain"`` (every axis on this rank alone: torch's op), ``"whole"`` (every sharded axis a global pool: the result
    whole on every rank), ``"rows"`` (H windowed, every other axis on this rank alone: the balanced split of H)."""
    if all(p.plain for p in plans):
        return "plain"
    if all(p.plain or p.whole for p in plans):
        return "whole"
    if all(p.plain for p in plans[1:]):
        return "rows"
    raise ValueError(f"{op}: on a latitude x longitude mesh an adaptive pool has a form here only as a global pool "
                     f"(fewer outputs than ranks along every sharded axis: output 1 x 1); output_size={output_size} "
                     f"gives {' x '.join(str(p.out) for p in plans)} of a {' x '.join(str(p.n) for p in plans)} "
                     f"field: shard latitude only (a manager), or pool to 1 x 1")


def _w_out(output_size: Any, width: int) -> int:
    """The output extent along W of an adaptive pool of ``width`` columns (torch's rule: ``None`` keeps the size)."""
    w = output_size if isinstance(output_size, int) else output_size[-1]
    return width if w is None else int(w)


#: One axis as :func:`_pool_blocks` reads it: its parts, each part's output extent along the axis, this rank's first
#: global index along it, its global extent.
Axis = tuple[tuple[Part, ...], int, int, int]


def _block_axes(plans: tuple[AdaptivePlan, ...], width: int, w_out: int) -> tuple[Axis, Axis]:
    """H and W of a call as blocks: a plain axis is one part (all of it, torch's ``out`` outputs), a whole or
    windowed one its parts (one output each). On latitude rows W is whole on every rank: offset 0, extent local."""
    axes = tuple((((0, p.rows, 0, p.rows),), p.out, 0, p.n) if p.plain else (p.parts, 1, p.first, p.n)
                 for p in plans)
    if len(axes) < 2:
        axes += ((((0, width, 0, width),), w_out, 0, width),)
    return axes  # type: ignore[return-value]


def _cat(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)


def _pool_blocks(t: torch.Tensor, axes: tuple[Axis, Axis], is_max: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's adaptive op on each block of ``t`` (the rows of an H part x the columns of a W part, with that axis's
    output extent), the results side by side; a max's indices as the global flat ``h*W + w``. The average of a part
    of a window is weighted by its share of the window: the shares of all ranks sum to the window's mean."""
    (hparts, oh, _, _), (wparts, ow, _, width) = axes
    lead = t.shape[:-2]
    rows_v, rows_i = [], []
    for hs, hl, hg, hn in hparts:
        vals, idxs = [], []
        for ws, wl, wg, wn in wparts:
            if not (hl and wl):  # no rows of this window here
                vals.append(t.new_full((*lead, oh, ow), float("-inf") if is_max else 0.0))
                if is_max:
                    idxs.append(torch.full((*lead, oh, ow), _NO_INDEX, dtype=torch.int64, device=t.device))
                continue
            block = t.narrow(-2, hs, hl)
            if (ws, wl) != (0, t.shape[-1]):
                block = block.narrow(-1, ws, wl)
            if is_max:  # the same window in the same order as on the full field: torch's winner within the block
                v, i = F.adaptive_max_pool2d(block, (oh, ow), True)
                idxs.append(i + hg * width if (wg, wl) == (0, width) else (i // wl + hg) * width + i % wl + wg)
            else:  # the aten op itself: F.adaptive_avg_pool2d turns a (1, 1) output into a mean (another sum order)
                v = torch.ops.aten._adaptive_avg_pool2d(block, [oh, ow])
                if hl * wl != hn * wn:
                    v = v * (hl * wl / (hn * wn))
            vals.append(v)
        rows_v.append(_cat(vals, -1))
        if is_max:
            rows_i.append(_cat(idxs, -1))
    return _cat(rows_v, -2), (_cat(rows_i, -2) if is_max else None)


class _GlobalMaxFn(torch.autograd.Function):
    """A global max pool: every rank's maxima of its parts of the windows, the maximum over the domain, and the
    winner of each window as torch picks it (the first maximum in row-major order: the smallest global flat index
    among the ranks that hold the maximum). Backward: each window's gradient, summed over the ranks (each rank's
    consumers contributed their part), goes to the winner's element on the rank that holds it."""

    @staticmethod
    def forward(ctx, x, axes, info):
        vals, idxs = _pool_blocks(x, axes, True)
        best, winner, mine = _max_winner(vals, idxs, info)
        ctx.save_for_backward(winner, mine)
        ctx.info, ctx.shape = info, x.shape
        ctx.origin = (axes[0][2], axes[1][2], axes[1][3])  # this rank's first row and column, the global width
        ctx.mark_non_differentiable(winner)
        return best.to(x.dtype), winner

    @staticmethod
    def backward(ctx, grad, _gidx):
        winner, mine = ctx.saved_tensors
        row0, col0, width = ctx.origin
        rows, cols = ctx.shape[-2:]
        local = ((winner // width - row0) * cols + winner % width - col0).clamp(0, rows * cols - 1)
        return _max_grad(grad, ctx.info, local, mine, ctx.shape), None, None


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


@eager_only  # collectives with bounded waits: run eagerly (a graph break under torch.compile)
def _global_pool(x: torch.Tensor, axes: tuple[Axis, Axis], group: Any | None, is_max: bool,
                 return_indices: bool) -> Any:
    """A global pool, whole on every rank, on either decomposition (module docstring): this rank's part of every
    window, reduced over the domain ``group`` (averages weighted by their share and summed; maxima:
    :class:`_GlobalMaxFn`)."""
    if is_max:
        out, index = _GlobalMaxFn.apply(x, axes, comm_group(group))
        return (out, index) if return_indices else out
    return all_reduce(_pool_blocks(x, axes, False)[0], "sum", group)


def _adaptive(x: torch.Tensor, plans: tuple[AdaptivePlan, ...], group: Any | None, output_size: Any, op: str,
              is_max: bool, return_indices: bool) -> Any:
    """An adaptive pool of ``x`` by its per-axis ``plans`` (``group``: the domain group a global pool reduces over)."""
    path = _adaptive_path(plans, op, output_size)
    if path == "plain":
        if is_max:
            return F.adaptive_max_pool2d(x, output_size, return_indices)
        return F.adaptive_avg_pool2d(x, output_size)
    axes = _block_axes(plans, x.shape[-1], _w_out(output_size, x.shape[-1]))
    if path == "whole":
        result = _global_pool(x, axes, group, is_max, return_indices)
        for t in result if isinstance(result, tuple) else (result,):
            mark_whole(t, op)
        return result
    # Output row o pools exactly rows [starts[o], ends[o]) of the exchanged rows: torch's op on them with output
    # height 1 is the same window, summed (or compared) in the same order as on the full field.
    out, index = _pool_blocks(exchange_axes(x, plans), axes, is_max)
    return finish(_formatted((out, index) if is_max and return_indices else out, x), x)


def _size_arg(output_size: Any) -> Any:
    return tuple(output_size) if isinstance(output_size, list) else output_size


def adaptive_pool(x: torch.Tensor, output_size, group: Any | None, op: str, is_max: bool, return_indices: bool,
                  site: Site | None = None):
    """An adaptive average or max pool of the global field on its H-shards (the functions below, area upsampling)."""
    kind = "adaptive_max" if is_max else "adaptive_avg"
    x = cast_as_torch(f"{kind}_pool2d", x)  # torch's dtype under autocast (halo.autocast)
    plans = run_axes(x, op, _adaptive_axis_plan, (op, kind, tuple(x.shape), _size_arg(output_size)), group=group,
                     site=site)
    return _adaptive(x, plans, group, output_size, op, is_max, return_indices)


def halo_adaptive_avg_pool2d(x: torch.Tensor, output_size, *, group: Any | None = None) -> torch.Tensor:
    """``F.adaptive_avg_pool2d`` of the global field, on its H-shards (output: balanced split of its rows)."""
    return adaptive_pool(x, output_size, group, "halo_adaptive_avg_pool2d", False, False)


def halo_adaptive_max_pool2d(x: torch.Tensor, output_size, return_indices: bool = False, *,
                             group: Any | None = None):
    """``F.adaptive_max_pool2d`` of the global field on its H-shards; indices are global flat ``h*W + w``."""
    return adaptive_pool(x, output_size, group, "halo_adaptive_max_pool2d", True, return_indices)


def _global_only(pool: nn.Module) -> bool:
    """``mesh_ok``: a latitude x longitude mesh converts a global adaptive pool (output 1 x 1) only."""
    return pool.output_size in (1, (1, 1))


class _AdaptivePool(DomainLayer):
    """What the two adaptive pool modules share: the per-axis plans of a call and the one path of either
    decomposition (``_is_max``: which of torch's ops)."""

    _is_max = False

    def forward(self, x: torch.Tensor):
        op = type(self).__name__
        kind = "adaptive_max" if self._is_max else "adaptive_avg"
        x = cast_as_torch(f"{kind}_pool2d", x)  # torch's dtype under autocast (halo.autocast)
        plans = self.axis_plans(x, op, _adaptive_axis_plan, (op, kind, tuple(x.shape), _size_arg(self.output_size)))
        return _adaptive(x, plans, self.domain_group, self.output_size, op, self._is_max,
                         getattr(self, "return_indices", False))


@converts(nn.AdaptiveAvgPool2d, axes=2, mesh_ok=_global_only, functional=(F.adaptive_avg_pool2d,),
          example=lambda kind: (kind((5, 4)), (2, 3, 23, 7)))
class DomainAdaptiveAvgPool2d(_AdaptivePool, nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` on an H-sharded field (windows depend on the global extent: computed from it).

    With fewer output rows than ranks (a global average, ``output_size=1``) the result is whole on every rank
    (module docstring); on a latitude x longitude mesh, that global pool only.
    """

    def __init__(self, pool: nn.AdaptiveAvgPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AdaptiveAvgPool2d):
            raise TypeError(f"DomainAdaptiveAvgPool2d wraps an nn.AdaptiveAvgPool2d, got {type(pool).__name__}")
        super().__init__(pool.output_size)
        self.halo_init(group, mesh)


@converts(nn.AdaptiveMaxPool2d, axes=2, mesh_ok=_global_only, functional=(F.adaptive_max_pool2d,),
          example=lambda kind: (kind((5, 4)), (2, 3, 23, 7)))
class DomainAdaptiveMaxPool2d(_AdaptivePool, nn.AdaptiveMaxPool2d):
    """``nn.AdaptiveMaxPool2d`` on an H-sharded field; indices (``return_indices``) are global flat ``h*W + w``."""

    _is_max = True

    def __init__(self, pool: nn.AdaptiveMaxPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.AdaptiveMaxPool2d):
            raise TypeError(f"DomainAdaptiveMaxPool2d wraps an nn.AdaptiveMaxPool2d, got {type(pool).__name__}")
        super().__init__(pool.output_size, pool.return_indices)
        self.halo_init(group, mesh)


# -- conversion ---------------------------------------------------------------------------------------------

@converts(nn.LPPool2d, axes=2, functional=(F.lp_pool2d,), example=lambda kind: (kind(2, 3, 2), (2, 3, 23, 7)))
class DomainLPPool2d(nn.LPPool2d):
    """``nn.LPPool2d`` on an H-sharded field (and on a latitude x longitude mesh), computed as torch computes it:
    ``(avg_pool2d(x ** p) * kh * kw) ** (1 / p)`` (a max pool of ``|x|`` for ``p = ±inf``), with the pool a
    :class:`DomainAvgPool2d` (:class:`DomainMaxPool2d`) of the same kernel, stride and ceil_mode: the pointwise steps
    before and after it act on each row, so the result is torch's, forward and backward, on any split."""

    def __init__(self, pool: nn.LPPool2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(pool, nn.LPPool2d):
            raise TypeError(f"DomainLPPool2d wraps an nn.LPPool2d, got {type(pool).__name__}")
        super().__init__(pool.norm_type, pool.kernel_size, pool.stride, pool.ceil_mode)
        p = float(pool.norm_type)
        if abs(p) == math.inf:
            maxpool = nn.MaxPool2d(pool.kernel_size, pool.stride, 0, 1, ceil_mode=pool.ceil_mode)
            inner: nn.Module = DomainMaxPool2d(maxpool, group=group, mesh=mesh)
        else:
            stride = pool.stride if pool.stride is not None else pool.kernel_size
            inner = DomainAvgPool2d(nn.AvgPool2d(pool.kernel_size, stride, 0, ceil_mode=pool.ceil_mode),
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
        x = cast_as_torch("lp_pool2d", x, norm_type=p)  # float32 under CUDA autocast (its pow), as torch's
        if p == math.inf:
            return self._halo_inner(x.abs())
        if p == -math.inf:
            return -self._halo_inner(-x.abs())
        kh, kw = _pair(self.kernel_size)
        out = self._halo_inner(x.pow(self.norm_type))
        return (torch.sign(out) * F.relu(torch.abs(out))).mul(kw * kh).pow(1.0 / self.norm_type)


def pools() -> dict[type, type]:
    """The torch pooling classes halo converts -> their halo classes: the registry's entries of this module (a pool
    registered here with ``@converts`` is known to :func:`halo_pool` with no other edit)."""
    return {kind: e.halo_class for kind, e in entries().items() if e.halo_class.__module__ == __name__}


def halo_pool(pool: nn.Module, *, group: Any | None = None) -> nn.Module:
    """The domain-parallel twin of a 2-d pooling module; ``NotImplementedError`` naming why for the others."""
    known = pools()
    halo_cls = known.get(type(pool))
    if halo_cls is not None:
        return halo_cls(pool, group=group)
    raise NotImplementedError(
        f"no domain-parallel version of {type(pool).__name__}: supported are "
        f"{', '.join(c.__name__ for c in known)} (over (B, C, H, W) or (B, C, D, H, W) sharded along H, "
        f"dim -2); FractionalMaxPool2d (random windows), 1-d pools and adaptive 3-d pools are not "
        f"implemented")


def _adaptive_hint(pool: Any) -> str:
    if isinstance(pool, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        return (f"; adaptive pools have windows that depend on the global size: use "
                f"Domain{type(pool).__name__} (or halo_pool(module))")
    return ""


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloMaxPool2d = DomainMaxPool2d
HaloAvgPool2d = DomainAvgPool2d
HaloMaxPool3d = DomainMaxPool3d
HaloAvgPool3d = DomainAvgPool3d
HaloAdaptiveAvgPool2d = DomainAdaptiveAvgPool2d
HaloAdaptiveMaxPool2d = DomainAdaptiveMaxPool2d
HaloLPPool2d = DomainLPPool2d
