"""Which rows each rank needs: the row arithmetic of halo's layers, pure functions of integers.

A layer on a shard computes its rank's part of the balanced split of its global output (invariant 1) and reads the
rows of the global (virtual: padding rows outside ``[0, n)`` included) input that those outputs read. Each function
here says which, from every rank's extent along the axis and the layer's geometry; it knows no process group, no
tensor and no torch, so one process checks it against the unsharded op's own reads for thousands of configurations
(tests/test_geometry.py). The layers' per-axis plans (:mod:`halo.nn.base`) call these and add the exchange.
"""

from __future__ import annotations

from collections.abc import Sequence

from .partition import offsets, split_offsets, split_sizes

__all__ = [
    "adaptive_plan",
    "adaptive_starts_ends",
    "check_output_rows",
    "conv_row_plan",
    "conv_transpose_row_plan",
    "pad_needs",
    "shuffle_needs",
    "widen_plan",
    "window_plan",
]


# -- windows (pools) -------------------------------------------------------------------------------------------

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


def widen_plan(plan: tuple[tuple[int, int, int, int], ...], n: int, min_rows: int,
               stride: int) -> tuple[tuple[int, int, int, int], ...]:
    """``plan`` (of :func:`window_plan`) with every rank's rows ``[lo, hi)`` widened to at least ``min_rows``
    (``torch.nn.functional.avg_pool3d`` refuses an input with fewer rows than its kernel, even where padding or
    ``ceil_mode`` give it an output). First down to ``n``: rows after ``hi`` only add local outputs after the kept
    ones, and leave the kept windows (which end at or before ``hi``) and their divisors as they were. Then up by whole
    strides: ``lo`` stays a multiple of ``stride``, and each stride adds one local output in front, dropped
    (``crop + 1``). ``n >= min_rows`` (torch checks the global op so), so every rank gets there."""
    out = []
    for lo, hi, crop, rows in plan:
        if rows and hi - lo < min_rows:
            hi = min(n, lo + min_rows)
            up = min(lo // stride, -(-(min_rows - (hi - lo)) // stride))
            lo, crop = lo - up * stride, crop + up
        out.append((lo, hi, crop, rows))
    return tuple(out)


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
            + ("; for a global pool use nn.AdaptiveAvgPool2d(1) / AdaptiveMaxPool2d(1), whose result halo makes "
               "whole on every rank" if m == 1 else ""))


# -- copies of rows (padding, pixel shuffle) ---------------------------------------------------------------------

def pad_needs(n: int, parts: int, before: int, after: int) -> tuple[tuple[int, int], ...]:
    """Per rank the virtual input rows ``[o0 - before, o1 - before)`` of its rows ``[o0, o1)`` of the padded field
    (``n + before + after`` rows, balanced split; negative amounts crop)."""
    offs = split_offsets(n + before + after, parts)
    return tuple((offs[r] - before, offs[r + 1] - before) for r in range(parts))


def shuffle_needs(sizes: Sequence[int], factor: int, up: bool
                  ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
    """A pixel shuffle (``up``) or unshuffle by ``factor`` along one axis: per rank its output offsets (``parts +
    1``), the input rows ``(lo, hi)`` its output rows read and the output rows to drop before its own.

    Output row ``o`` of a shuffle is made from input row ``o // factor``; of an unshuffle from rows ``[o * factor,
    (o + 1) * factor)``. The output is the balanced split of its extent, except that a split made of whole blocks
    stays one (an unshuffle of shards that are multiples of ``factor`` gives ``sizes // factor``, a shuffle of a split
    that is not the balanced one ``sizes * factor``): every rank then reads its own rows alone."""
    parts, n = len(sizes), sum(sizes)
    m = n * factor if up else n // factor
    offs = split_offsets(m, parts)
    if min(sizes) > 0 and (not up and all(s % factor == 0 for s in sizes)
                           or up and list(sizes) != split_sizes(n, parts)):
        offs = offsets([s * factor if up else s // factor for s in sizes])
    needs, crops = [], []
    for r in range(parts):
        o0, o1 = offs[r], offs[r + 1]
        lo, hi = (o0 // factor, (o1 - 1) // factor + 1) if up else (o0 * factor, o1 * factor)
        needs.append((lo, hi))
        crops.append(o0 - lo * factor if up else 0)
    return tuple(offs), tuple(needs), tuple(crops)


# -- convolutions ----------------------------------------------------------------------------------------------

def _check_out_sizes(out_sizes: Sequence[int], m: int, n: int, what: str, op: str) -> None:
    empty = [r for r, s in enumerate(out_sizes) if s == 0]
    if empty:
        raise ValueError(f"{op}: the output has {m} rows along H ({what}, from {n} input rows) but the domain "
                         f"group has {len(out_sizes)} ranks; ranks {empty} would get no rows. Use at most {m} "
                         f"ranks for this layer, or a larger field")


def conv_row_plan(sizes: Sequence[int], kernel: int, stride: int, dilation: int, pad: tuple[int, int],
                  op: str = "conv") -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Output shard sizes and every rank's needed input rows for a conv along the sharded dim.

    ``sizes``: every rank's input rows (group order); ``pad``: ``(before, after)`` padding. Returns the
    balanced split of ``M = (N + before + after - d(k-1) - 1) // s + 1`` and, per rank, the virtual input rows
    ``(lo, hi)`` its output rows ``[o0, o1)`` read: ``[o0*s - before, (o1-1)*s - before + d(k-1) + 1)``.

    A patch embedding (kernel == stride, no padding along H, undilated) whose input shards are all non-empty
    multiples of the stride keeps its split instead: output ``sizes // stride``, each rank reading its own rows
    (no message), so a block split (``halo.plan.partition.split_sizes(..., granularity=)``) stays one. For a balanced
    input this is the balanced split of ``M`` as well (shards that differ by at most one row and are multiples of
    ``s`` are equal).
    """
    if (kernel == stride > 1 and tuple(pad) == (0, 0) and (dilation == 1 or kernel == 1) and sizes
            and all(s > 0 and s % stride == 0 for s in sizes)):
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)
        return (tuple(s // stride for s in sizes),
                tuple((starts[r], starts[r + 1]) for r in range(len(sizes))))
    n, span = sum(sizes), dilation * (kernel - 1)
    m = (n + pad[0] + pad[1] - span - 1) // stride + 1
    if m < 1:
        raise ValueError(f"{op}: {n} input rows along H with padding {pad} are fewer than the dilated kernel "
                         f"({span + 1} rows: kernel {kernel}, dilation {dilation})")
    out_sizes = tuple(split_sizes(m, len(sizes)))
    _check_out_sizes(out_sizes, m, n, f"kernel {kernel}, stride {stride}, dilation {dilation}, padding {pad}", op)
    offs = split_offsets(m, len(sizes))
    needs = tuple((offs[r] * stride - pad[0], (offs[r + 1] - 1) * stride - pad[0] + span + 1)
                  for r in range(len(sizes)))
    return out_sizes, needs


def conv_transpose_row_plan(sizes: Sequence[int], kernel: int, stride: int, dilation: int, padding: int,
                            output_padding: int, op: str = "conv_transpose"
                            ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Output shard sizes and needed input rows for a transposed conv along the sharded dim.

    Input row ``i`` adds into output rows ``i*s - p + j*d`` (``0 <= j < k``), so output rows ``[o0, o1)`` read
    ``i`` in ``[ceil((o0 + p - d(k-1)) / s), floor((o1 - 1 + p) / s)]`` (rows outside ``[0, N)`` are zeros).
    An empty range (rows only reached by ``output_padding`` or between strided taps) is widened to one row,
    whose contributions land outside ``[o0, o1)``, so that every rank still takes part in the exchange.
    """
    n, span = sum(sizes), dilation * (kernel - 1)
    m = (n - 1) * stride - 2 * padding + span + output_padding + 1
    if m < 1:
        raise ValueError(f"{op}: the output would have {m} rows along H (input {n}, kernel {kernel}, stride "
                         f"{stride}, padding {padding}, dilation {dilation}, output_padding {output_padding})")
    out_sizes = tuple(split_sizes(m, len(sizes)))
    _check_out_sizes(out_sizes, m, n, f"kernel {kernel}, stride {stride}, dilation {dilation}, padding "
                     f"{padding}, output_padding {output_padding}", op)
    offs = split_offsets(m, len(sizes))

    def reaches(i: int, o0: int, o1: int) -> bool:  # some tap j < k lands in [o0, o1)
        first = max(0, -((i * stride - padding - o0) // dilation))  # ceil((o0 - i*s + p) / d)
        return first < kernel and i * stride - padding + first * dilation < o1

    needs = []
    for r in range(len(sizes)):
        o0, o1 = offs[r], offs[r + 1]
        lo = -((span - o0 - padding) // stride)  # ceil((o0 + p - span) / s)
        hi = (o1 - 1 + padding) // stride + 1
        # With d > 1 the end rows of that range may fall between the taps: drop them (a few at most).
        while lo < hi and not reaches(lo, o0, o1):
            lo += 1
        while hi > lo and not reaches(hi - 1, o0, o1):
            hi -= 1
        needs.append((lo, max(hi, lo + 1)))
    return out_sizes, tuple(needs)
