"""The distributed transpose: H-shards ``(..., H_r, W)`` <-> W-shards ``(..., H, W_s)``, by slabs.

Rank ``r`` holds rows ``[r0, r1)`` of every column before and columns ``[c0, c1)`` of every row after (both the
balanced split, invariant 1, uneven sizes welcome). What rank ``r`` sends rank ``s`` is the block of its rows and
``s``'s columns, ``x[..., :, cs0:cs1]``: one contiguous copy per peer (together one pass over the shard), one
point-to-point message per pair through ``halo.dist.transport`` (gloo's ``all_to_all`` wants equal sizes; the P2P
transport takes any, and its waits are bounded by ``halo.set_timeout``, naming the peers), and each received block
lands in its rows ``[r0, r1)`` of the output: one pass over the output. A complex field travels as its real view
(no copy). The plan is the ``P`` row and column offsets, learned once per global shape (``halo.plan.plans.resolve``).

:func:`halo.nn.longrange.rows_to_columns` does the same permutation as a general *regroup* (index maps over the
flattened ``H * W`` positions: an ``H_r * W`` int64 index per rank, made in Python once per shape, ~50 ms at
91 x 181, and gathered element by element at every call); a transpose needs only slabs, so the spectral transforms
use this one.

Adjoint: a permutation's is its inverse, so the backward of :func:`rows_to_cols` is :func:`cols_to_rows` of the
gradient and vice versa (one ``autograd.Function``, dot-product tested in float64 in ``tests/test_spectral.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..context import place
from ..dist.comm import CommGroup, comm_group
from ..dist.transport import post, wait
from ..plan.partition import offsets, split_sizes
from ..plan.plans import carry, resolve

__all__ = ["TransposePlan", "cols_to_rows", "rows_to_cols"]


@dataclasses.dataclass(frozen=True)
class TransposePlan:
    """Every rank's rows ``row_off[r]:row_off[r + 1]`` of the global ``H`` and columns ``col_off[s]:col_off[s + 1]``
    of the global ``W``; ``me`` this rank's index in the group (``None``: one process)."""

    group: Any
    row_off: tuple[int, ...]
    col_off: tuple[int, ...]
    me: int
    op: str


def _plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], other: int, by_rows: bool, op: str) -> TransposePlan:
    """Pure (agreed: every rank raises alike). ``by_rows``: ``extents`` are the row sizes and ``other`` the width
    (rows -> columns); else the column sizes and the height."""
    (sizes,) = extents
    if by_rows:
        rows, width = tuple(sizes), other
        if width < cg.size:
            raise ValueError(f"{op}: {width} columns cannot be split over {cg.size} ranks (a rank would get none); "
                             f"keep at least {cg.size} columns or use fewer ranks")
        cols = tuple(split_sizes(width, cg.size))
    else:
        cols, rows = tuple(sizes), tuple(split_sizes(other, cg.size))
    return TransposePlan(cg.group, tuple(offsets(rows)), tuple(offsets(cols)), cg.index, op)


def _move(x: torch.Tensor, plan: TransposePlan, to_cols: bool) -> torch.Tensor:
    """The permutation (no autograd): rows -> columns where ``to_cols``, else columns -> rows."""
    with torch._C.DisableTorchFunction():  # a layout move the guard must not follow as ops on H (longrange: why)
        me, ro, co = plan.me, plan.row_off, plan.col_off
        lead = tuple(x.shape[:-2])
        if to_cols:  # send x[..., :, cols of s]; receive (..., rows of r, my cols) into out[..., rows of r, :]
            out = x.new_empty((*lead, ro[-1], co[me + 1] - co[me]))
            piece = lambda t, q: t[..., co[q]:co[q + 1]]  # noqa: E731 - what goes to peer q
            slot = lambda t, q: t[..., ro[q]:ro[q + 1], :]  # noqa: E731 - where peer q's block lands
            shape = lambda q: (*lead, ro[q + 1] - ro[q], co[me + 1] - co[me])  # noqa: E731
        else:  # send y[..., rows of r, :]; receive (..., my rows, cols of s) into out[..., cols of s]
            out = x.new_empty((*lead, ro[me + 1] - ro[me], co[-1]))
            piece = lambda t, q: t[..., ro[q]:ro[q + 1], :]  # noqa: E731
            slot = lambda t, q: t[..., co[q]:co[q + 1]]  # noqa: E731
            shape = lambda q: (*lead, ro[me + 1] - ro[me], co[q + 1] - co[q])  # noqa: E731
        size = len(co) - 1
        if plan.group is None or size == 1:
            slot(out, me).copy_(piece(x, me))
            return out
        sends = [(q, piece(x, q).contiguous()) for q in range(size) if q != me]
        recvs = [(q, x.new_empty(shape(q))) for q in range(size) if q != me]
        real = lambda t: torch.view_as_real(t) if t.is_complex() else t  # noqa: E731 - gloo sends real buffers
        posted = post(comm_group(plan.group), plan.op, [(q, real(t)) for q, t in sends],
                      [(q, real(t)) for q, t in recvs])
        slot(out, me).copy_(piece(x, me))  # own block while the messages travel
        wait(posted)
        for q, t in recvs:
            slot(out, q).copy_(t)
        return out


class _TransposeFn(torch.autograd.Function):
    """Forward: rows -> columns (or back). Backward: the opposite move (the permutation's exact adjoint)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: TransposePlan, to_cols: bool) -> torch.Tensor:
        ctx.plan, ctx.to_cols = plan, to_cols
        return _move(x, plan, to_cols)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _move(grad, ctx.plan, not ctx.to_cols), None, None


def rows_to_cols(x: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """From the balanced H-shards ``(..., H_r, W)`` to the balanced W-shards ``(..., H, W_s)``, real or complex,
    with autograd (backward: :func:`cols_to_rows`). Every rank of ``group`` must call it; a width smaller than the
    group, or shapes that differ across ranks other than in ``H_r``, raise the same error on every rank."""
    op = "halo.nn.transpose.rows_to_cols"
    width = int(x.shape[-1]) if x.dim() >= 2 else 0
    plan = resolve(x, group, op, _plan, (width, True, op), spec=(-2,))
    out = _TransposeFn.apply(x, plan, True)
    place(out, -1)  # sharded along W now
    carry(out, x)
    return out


def cols_to_rows(y: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """The inverse of :func:`rows_to_cols`: from W-shards ``(..., H, W_s)`` to the balanced H-shards."""
    op = "halo.nn.transpose.cols_to_rows"
    height = int(y.shape[-2]) if y.dim() >= 2 else 0
    plan = resolve(y, group, op, _plan, (height, False, op), spec=(-1,))
    out = _TransposeFn.apply(y, plan, False)
    place(out, -2)
    carry(out, y)
    return out
