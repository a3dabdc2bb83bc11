"""halo.plan.geometry in one process: the rows each rank needs equal the rows the unsharded op reads (brute force).

For every small field (n <= 13 rows), every group size P <= 5 and the layer geometries below, the unsharded op's
reads are enumerated output row by output row (virtual rows: padding rows outside ``[0, n)`` included) and compared
with what the pure function plans for each rank's part of the balanced split of the output. Pools are also run: the
local op on the planned rows, cropped, must equal the unsharded op bitwise (the plan's ``lo``/``crop`` arithmetic).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from halo.plan.geometry import (
    adaptive_plan,
    check_output_rows,
    conv_row_plan,
    conv_transpose_row_plan,
    pad_needs,
    shuffle_needs,
    widen_plan,
    window_plan,
)
from halo.plan.partition import split_offsets, split_sizes

NS = range(1, 14)
PARTS = range(1, 6)


def _span(rows):
    """``(min, max + 1)`` of a non-empty set of rows."""
    return min(rows), max(rows) + 1


def test_conv_rows_are_the_rows_the_conv_reads():
    """Output row o of a conv reads virtual rows o*s - before + j*d for j < k: the plan's needs are their span."""
    count = 0
    for n, parts, k, s, d, before, after in itertools.product(NS, PARTS, (1, 2, 3, 5), (1, 2, 3), (1, 2),
                                                              (0, 1, 2), (0, 1, 2)):
        m = (n + before + after - d * (k - 1) - 1) // s + 1
        if m < parts:
            continue
        sizes = tuple(split_sizes(n, parts))
        out_sizes, needs = conv_row_plan(sizes, k, s, d, (before, after))
        if k == s > 1 and (before, after) == (0, 0) and all(z % s == 0 for z in sizes):
            continue  # a patch embedding keeps the block split (tested below)
        assert out_sizes == tuple(split_sizes(m, parts))
        offs = split_offsets(m, parts)
        for r in range(parts):
            reads = {o * s - before + j * d for o in range(offs[r], offs[r + 1]) for j in range(k)}
            assert needs[r] == _span(reads), (n, parts, k, s, d, before, after, r)
            count += 1
    assert count > 5000


def test_patch_embedding_keeps_the_block_split():
    for parts, s, blocks in itertools.product(PARTS, (2, 3, 4), range(1, 4)):
        sizes = tuple(s * b for b in split_sizes(blocks * parts + 1, parts))
        out_sizes, needs = conv_row_plan(sizes, s, s, 1, (0, 0))
        assert out_sizes == tuple(z // s for z in sizes)
        starts = [0, *itertools.accumulate(sizes)]
        assert needs == tuple((starts[r], starts[r + 1]) for r in range(parts))


def test_transposed_conv_rows_are_the_rows_that_reach_the_outputs():
    """Input row i of a transposed conv adds into output rows i*s - p + j*d: the plan's needs are the span of the
    rows that reach the rank's outputs (widened to one row where none does)."""
    count = 0
    for n, parts, k, s, d, p, op in itertools.product(NS, PARTS, (1, 2, 3, 4), (1, 2, 3), (1, 2), (0, 1), (0, 1)):
        if op >= max(s, d):
            continue
        m = (n - 1) * s - 2 * p + d * (k - 1) + op + 1
        if m < parts:
            continue
        out_sizes, needs = conv_transpose_row_plan(tuple(split_sizes(n, parts)), k, s, d, p, op)
        assert out_sizes == tuple(split_sizes(m, parts))
        offs = split_offsets(m, parts)
        for r in range(parts):
            o0, o1 = offs[r], offs[r + 1]
            reach = {i for i in range(-k * d - 2, n + k * d + 2) for j in range(k) if o0 <= i * s - p + j * d < o1}
            if reach:
                assert needs[r] == _span(reach), (n, parts, k, s, d, p, op, r)
            else:
                assert needs[r][1] - needs[r][0] == 1
            count += 1
    assert count > 3000


def _pool_m(n, k, s, p, d, ceil):
    return F.max_pool1d(torch.zeros(1, 1, n), k, s, p, d, ceil_mode=ceil).shape[-1]


def test_pool_windows_cover_the_reads_and_reproduce_the_pool():
    """Each rank's rows [lo, hi) hold every row its kept windows read; the local max and average pools on them,
    cropped, are bitwise the unsharded pools' rows (padding and divisors included)."""
    gen = torch.Generator().manual_seed(0)
    count = 0
    for n, parts, k, s, p, d, ceil in itertools.product(NS, PARTS, (1, 2, 3, 4), (1, 2, 3), (0, 1, 2), (1, 2),
                                                        (False, True)):
        if p > k // 2 or n + 2 * p < d * (k - 1) + 1:
            continue
        m = _pool_m(n, k, s, p, d, ceil)
        if m < parts:
            continue
        x = torch.randn(1, 1, n, generator=gen, dtype=torch.float64)
        ref_max = F.max_pool1d(x, k, s, p, d, ceil_mode=ceil)
        ref_avg = F.avg_pool1d(x, k, s, p, ceil, False) if d == 1 else None
        offs = split_offsets(m, parts)
        for r, (lo, hi, crop, rows) in enumerate(window_plan(n, m, parts, k, s, p, d)):
            assert rows == offs[r + 1] - offs[r] and lo % s == 0 and 0 <= lo <= hi <= n
            reads = {o * s - p + j * d for o in range(offs[r], offs[r + 1]) for j in range(k)}
            inside = {v for v in reads if 0 <= v < n}
            assert not inside or (lo <= min(inside) and max(inside) < hi), (n, parts, k, s, p, d, ceil, r)
            got = F.max_pool1d(x[..., lo:hi], k, s, p, d, ceil_mode=ceil)[..., crop:crop + rows]
            assert torch.equal(got, ref_max[..., offs[r]:offs[r + 1]]), (n, parts, k, s, p, d, ceil, r)
            if ref_avg is not None:
                got = F.avg_pool1d(x[..., lo:hi], k, s, p, ceil, False)[..., crop:crop + rows]
                assert torch.equal(got, ref_avg[..., offs[r]:offs[r + 1]]), (n, parts, k, s, p, ceil, r)
            count += 1
    assert count > 3000


def test_widened_windows_keep_lo_on_the_stride_and_hold_the_kernel():
    for n, parts, k, s, p in itertools.product(NS, PARTS, (2, 3, 4), (1, 2, 3), (0, 1, 2)):
        if p > k // 2 or n < k:
            continue
        m = _pool_m(n, k, s, p, 1, False)
        if m < parts:
            continue
        plan = window_plan(n, m, parts, k, s, p)
        for (lo, hi, crop, _), (lo0, hi0, crop0, _) in zip(widen_plan(plan, n, k, s), plan, strict=True):
            assert lo % s == 0 and hi - lo >= k and hi >= hi0 and (lo0 - lo) // s == crop - crop0


def test_adaptive_windows_are_torchs():
    for n, m, parts in itertools.product(NS, NS, PARTS):
        if m < parts:
            continue
        starts = [(o * n) // m for o in range(m)]
        ends = [-(-((o + 1) * n) // m) for o in range(m)]
        for r, (lo, hi, o0, o1) in enumerate(adaptive_plan(n, m, parts)):
            offs = split_offsets(m, parts)
            assert (o0, o1) == (offs[r], offs[r + 1])
            assert (lo, hi) == (min(starts[o0:o1]), max(ends[o0:o1]))


def test_padding_rows_are_the_shifted_output_rows():
    for n, parts, before, after in itertools.product(NS, PARTS, range(-2, 4), range(-2, 4)):
        m = n + before + after
        if m < parts:
            continue
        offs = split_offsets(m, parts)
        for r, need in enumerate(pad_needs(n, parts, before, after)):
            # output row o of F.pad is input (virtual) row o - before
            assert need == (offs[r] - before, offs[r + 1] - before)


@pytest.mark.parametrize("up", [True, False])
def test_pixel_shuffle_rows_are_the_rows_the_shuffle_reads(up):
    count = 0
    for n, parts, f in itertools.product(NS, PARTS, (2, 3)):
        if not up and n % f:
            continue
        m = n * f if up else n // f
        if m < parts:
            continue
        blocks = tuple(split_sizes(n, parts, f)) if n % f == 0 and n // f >= parts else ()
        for sizes in {tuple(split_sizes(n, parts)), blocks}:
            if not sizes or 0 in sizes:
                continue
            offs, needs, crops = shuffle_needs(sizes, f, up)
            assert offs[0] == 0 and offs[-1] == m
            for r in range(parts):
                outs = range(offs[r], offs[r + 1])
                reads = {o // f for o in outs} if up else {o * f + j for o in outs for j in range(f)}
                assert needs[r] == _span(reads), (n, parts, f, up, sizes, r)
                assert crops[r] == (offs[r] - needs[r][0] * f if up else 0)
                count += 1
    assert count > 50


def test_too_few_output_rows_names_the_cure():
    check_output_rows("op", 3, 9, 3)
    with pytest.raises(ValueError, match="use at most 2 ranks"):
        check_output_rows("op", 2, 9, 3)
    with pytest.raises(ValueError, match="global pool"):
        check_output_rows("op", 1, 9, 3)
