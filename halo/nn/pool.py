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

Adaptive pools: output row ``o`` pools rows ``[floor(o*N/M), ceil((o+1)*N/M))``; each local output row runs the
torch adaptive op on exactly those rows with output height 1 (same window, same order: bitwise), in a loop over
the local output rows (fine for the small outputs adaptive pools make).

Every rank needs at least one output row: a layer whose output has fewer rows than the group has ranks raises
the same ``ValueError`` on every rank (the global extent comes from one all-gather, so all ranks agree).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

from ..comm import CommGroup
from ..exchange import exchange, exchanger_id
from ..mesh import group_attribute
from ..partition import split_offsets
from ..plans import Site, carry, resolve

__all__ = [
    "HaloAdaptiveAvgPool2d",
    "HaloAdaptiveMaxPool2d",
    "HaloAvgPool2d",
    "HaloMaxPool2d",
    "adaptive_pool",
    "halo_adaptive_avg_pool2d",
    "halo_adaptive_max_pool2d",
    "halo_pool",
    "window_plan",
]


# -- pure geometry (no process group: testable for thousands of configurations in one process) --------------

def window_plan(n: int, m: int, parts: int, kernel: int, stride: int, padding: int,
                dilation: int = 1) -> tuple[tuple[int, int, int, int], ...]:
    """Per rank ``(lo, hi, crop, rows)`` of a strided window op along one dim (see the module docstring).

    ``[lo, hi)`` are the global input rows the rank runs the local op on (inside ``[0, n)``, ``lo`` a multiple
    of ``stride``), ``crop`` the local outputs to drop before its ``rows`` output rows.
    """
    offs = split_offsets(m, parts)
    reach = dilation * (kernel - 1) + 1
    c_max = -(-padding // stride)
    plan = []
    for r in range(parts):
        o0, o1 = offs[r], offs[r + 1]
        crop = min(o0, c_max)
        lo = (o0 - crop) * stride
        hi = min(n, (o1 - 1) * stride - padding + reach) if o1 > o0 else lo
        plan.append((lo, hi, crop, o1 - o0))
    return tuple(plan)


def adaptive_starts_ends(n: int, m: int) -> tuple[list[int], list[int]]:
    """Torch's adaptive windows along one dim: ``[floor(o*n/m), ceil((o+1)*n/m))`` for ``o < m``."""
    return [(o * n) // m for o in range(m)], [-(-((o + 1) * n) // m) for o in range(m)]


def adaptive_plan(n: int, m: int, parts: int) -> tuple[tuple[int, int, int, int], ...]:
    """Per rank ``(lo, hi, o0, o1)``: the input rows ``[lo, hi)`` its adaptive output rows ``[o0, o1)`` read."""
    offs = split_offsets(m, parts)
    starts, ends = adaptive_starts_ends(n, m)
    return tuple((starts[offs[r]], ends[offs[r + 1] - 1], offs[r], offs[r + 1]) if offs[r + 1] > offs[r]
                 else (0, 0, offs[r], offs[r]) for r in range(parts))


def check_output_rows(op: str, m: int, n: int, parts: int, detail: str = "") -> None:
    """Every rank of the group needs at least one output row (the output is the balanced split of ``m``)."""
    if m < parts:
        raise ValueError(
            f"{op}: the output has {m} rows along H ({n} input rows{detail}) but the domain group has {parts} "
            f"ranks; every rank needs at least one output row: use at most {max(m, 1)} ranks for this layer"
            + ("; a global pool's result is needed whole on every rank, which halo does not convert yet (not "
               "halo.reduce.domain_mean: its backward counts a replicated loss once, wrong inside a model)"
               if m == 1 else ""))


_META_OPS = {"max": F.max_pool2d, "avg": F.avg_pool2d, "adaptive_avg": F.adaptive_avg_pool2d,
             "adaptive_max": F.adaptive_max_pool2d}


@functools.lru_cache(maxsize=512)
def _global_shape(op: str, shape: tuple[int, ...], args: tuple) -> tuple[int, ...]:
    """Output shape of pool ``op`` on a field of ``shape`` (a meta tensor: torch's size rule and checks)."""
    return tuple(_META_OPS[op](torch.empty(shape, device="meta"), *args).shape)


def _global_rows(shape: tuple[int, ...], n: int, op: str, args: tuple) -> tuple[int, ...]:
    return _global_shape(op, (*shape[:-2], n, shape[-1]), args)


class PoolPlan(NamedTuple):
    """A pool call as planned for this rank: the exchange of rows ``[lo, lo + rows)`` and the local outputs to keep
    (``crop`` dropped, then ``out`` rows); ``plain``: one rank, the torch op itself."""

    plain: bool
    ex: int = -1
    rows: int = 0
    lo: int = 0
    crop: int = 0
    out: int = 0


def _window_pool_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], op: str, kind: str, shape: tuple,
                      args: tuple, geometry: tuple[int, int, int, int], detail: str) -> PoolPlan:
    (sizes,) = extents
    if cg.size == 1:
        return PoolPlan(True)
    n = sum(sizes)
    m = _global_rows(shape, n, kind, args)[-2]
    check_output_rows(op, m, n, cg.size, detail)
    plan = window_plan(n, m, cg.size, *geometry)
    lo, hi, crop, rows = plan[cg.index]
    ex = exchanger_id(cg, len(shape) - 2, sizes, tuple((a, b) for a, b, _, _ in plan), "zeros", op)
    return PoolPlan(False, ex, hi - lo, lo, crop, rows)


def _run(x: torch.Tensor, plan: Any) -> torch.Tensor:
    """Rows ``[lo, lo + rows)`` of the global field, autograd-exact (the caller's op consumes them)."""
    return exchange(x, plan.ex, plan.rows, x.dim() - 2)


# -- max / average pooling --------------------------------------------------------------------------------

class HaloMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` on an H-sharded field; output = the balanced split of the global output rows.

    Built from an existing ``nn.MaxPool2d`` (same arguments, same ``repr``, no state). Every argument torch
    accepts is supported: kernel != stride, padding, dilation, ceil_mode, return_indices (indices are global
    flat indices ``h*W + w``, as the unsharded op returns).
    """

    group = group_attribute()

    def __init__(self, pool: nn.MaxPool2d, *, group: Any | None = None) -> None:
        if not isinstance(pool, nn.MaxPool2d):
            raise TypeError(f"HaloMaxPool2d wraps an nn.MaxPool2d, got {type(pool).__name__}"
                            + _adaptive_hint(pool))
        super().__init__(pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                         return_indices=pool.return_indices, ceil_mode=pool.ceil_mode)
        self.group = group
        self._halo_site = Site()

    def forward(self, x: torch.Tensor):
        op = "HaloMaxPool2d"
        k, s, p, d = (_pair(a)[0] for a in (self.kernel_size, self.stride, self.padding, self.dilation))
        args = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        detail = f", kernel {k}, stride {s}, padding {p}, dilation {d}, ceil_mode={self.ceil_mode}"
        plan = resolve(x, self.group, op, _window_pool_plan, (op, "max", tuple(x.shape), args, (k, s, p, d), detail),
                       site=self._halo_site)
        if plan.plain:
            return super().forward(x)
        out = F.max_pool2d(_run(x, plan), self.kernel_size, self.stride, self.padding, self.dilation,
                           ceil_mode=self.ceil_mode, return_indices=self.return_indices)
        if not self.return_indices:
            out = out.narrow(-2, plan.crop, plan.out)
        else:
            out, idx = out
            out = out.narrow(-2, plan.crop, plan.out), idx.narrow(-2, plan.crop, plan.out) + plan.lo * x.shape[-1]
        carry(out, x)
        return out


class HaloAvgPool2d(nn.AvgPool2d):
    """``nn.AvgPool2d`` on an H-sharded field; output = the balanced split of the global output rows.

    Every argument torch accepts is supported (padding, ceil_mode, count_include_pad, divisor_override): the
    local op is torch's with the same arguments, so the divisors are torch's own. Forward bitwise equal.
    """

    group = group_attribute()

    def __init__(self, pool: nn.AvgPool2d, *, group: Any | None = None) -> None:
        if not isinstance(pool, nn.AvgPool2d):
            raise TypeError(f"HaloAvgPool2d wraps an nn.AvgPool2d, got {type(pool).__name__}"
                            + _adaptive_hint(pool))
        super().__init__(pool.kernel_size, pool.stride, pool.padding, ceil_mode=pool.ceil_mode,
                         count_include_pad=pool.count_include_pad, divisor_override=pool.divisor_override)
        self.group = group
        self._halo_site = Site()

    def _pool(self, t: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(t, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "HaloAvgPool2d"
        k, s, p = (_pair(a)[0] for a in (self.kernel_size, self.stride, self.padding))
        args = (self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                self.divisor_override)
        detail = f", kernel {k}, stride {s}, padding {p}, ceil_mode={self.ceil_mode}"
        plan = resolve(x, self.group, op, _window_pool_plan, (op, "avg", tuple(x.shape), args, (k, s, p, 1), detail),
                       site=self._halo_site)
        if plan.plain:
            return super().forward(x)
        out = self._pool(_run(x, plan)).narrow(-2, plan.crop, plan.out)
        carry(out, x)
        return out


# -- adaptive pooling ---------------------------------------------------------------------------------------

class AdaptivePlan(NamedTuple):
    """An adaptive pool as planned for this rank: the exchange of rows ``[lo, lo + rows)``, and per local output
    row its window ``(start - lo, length)`` and global start (for indices)."""

    plain: bool
    ex: int = -1
    rows: int = 0
    windows: tuple[tuple[int, int, int], ...] = ()
    w_out: int = 0


def _adaptive_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], op: str, shape: tuple, output_size: Any,
                   is_max: bool) -> AdaptivePlan:
    (sizes,) = extents
    if cg.size == 1:
        return AdaptivePlan(True)
    n = sum(sizes)
    m, w_out = _global_rows(shape, n, "adaptive_max" if is_max else "adaptive_avg", (output_size,))[-2:]
    check_output_rows(op, m, n, cg.size, f", output_size {output_size}")
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


def halo_adaptive_avg_pool2d(x: torch.Tensor, output_size, *, group: Any | None = None) -> torch.Tensor:
    """``F.adaptive_avg_pool2d`` of the global field, on its H-shards (output: balanced split of its rows)."""
    return adaptive_pool(x, output_size, group, "halo_adaptive_avg_pool2d", False, False)


def halo_adaptive_max_pool2d(x: torch.Tensor, output_size, return_indices: bool = False, *,
                             group: Any | None = None):
    """``F.adaptive_max_pool2d`` of the global field on its H-shards; indices are global flat ``h*W + w``."""
    return adaptive_pool(x, output_size, group, "halo_adaptive_max_pool2d", True, return_indices)


class HaloAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` on an H-sharded field (windows depend on the global extent: computed from it).

    A global average (``output_size`` 1 along H) has one output row and so cannot be split over several
    ranks: it raises; reduce over the domain group instead (``halo.reduce``).
    """

    group = group_attribute()

    def __init__(self, pool: nn.AdaptiveAvgPool2d, *, group: Any | None = None) -> None:
        if not isinstance(pool, nn.AdaptiveAvgPool2d):
            raise TypeError(f"HaloAdaptiveAvgPool2d wraps an nn.AdaptiveAvgPool2d, got {type(pool).__name__}")
        super().__init__(pool.output_size)
        self.group = group
        self._halo_site = Site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return adaptive_pool(x, self.output_size, self.group, "HaloAdaptiveAvgPool2d", False, False, self._halo_site)


class HaloAdaptiveMaxPool2d(nn.AdaptiveMaxPool2d):
    """``nn.AdaptiveMaxPool2d`` on an H-sharded field; indices (``return_indices``) are global flat ``h*W + w``."""

    group = group_attribute()

    def __init__(self, pool: nn.AdaptiveMaxPool2d, *, group: Any | None = None) -> None:
        if not isinstance(pool, nn.AdaptiveMaxPool2d):
            raise TypeError(f"HaloAdaptiveMaxPool2d wraps an nn.AdaptiveMaxPool2d, got {type(pool).__name__}")
        super().__init__(pool.output_size, pool.return_indices)
        self.group = group
        self._halo_site = Site()

    def forward(self, x: torch.Tensor):
        return adaptive_pool(x, self.output_size, self.group, "HaloAdaptiveMaxPool2d", True, self.return_indices,
                         self._halo_site)


# -- conversion ---------------------------------------------------------------------------------------------

_POOLS = ((nn.MaxPool2d, HaloMaxPool2d), (nn.AvgPool2d, HaloAvgPool2d),
          (nn.AdaptiveAvgPool2d, HaloAdaptiveAvgPool2d), (nn.AdaptiveMaxPool2d, HaloAdaptiveMaxPool2d))


def halo_pool(pool: nn.Module, *, group: Any | None = None) -> nn.Module:
    """The domain-parallel twin of a 2-d pooling module; ``NotImplementedError`` naming why for the others."""
    for cls, halo_cls in _POOLS:
        if type(pool) is cls:
            return halo_cls(pool, group=group)
    raise NotImplementedError(
        f"no domain-parallel version of {type(pool).__name__}: supported are "
        f"{', '.join(c.__name__ for c, _ in _POOLS)} (2-d pools over (B, C, H, W) sharded along H); "
        f"LPPool2d and FractionalMaxPool2d (random windows) and 1-d / 3-d pools are not implemented")


def _adaptive_hint(pool: Any) -> str:
    if isinstance(pool, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        return (f"; adaptive pools have windows that depend on the global size: use "
                f"Halo{type(pool).__name__} (or halo_pool(module))")
    return ""
