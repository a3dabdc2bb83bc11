"""Pure-torch reference for the halo pack/unpack kernels, and the argument checks both paths share.

Every function here has the same signature and semantics as its Triton twin in ``triton_kernels.py``; the
tests hold the two against each other, and this module against plain ``torch.cat``/``narrow`` formulas. It is
also the production path on CPU (gloo) and for dtypes the kernels do not cover.

Layout convention: a *dim-major* buffer of ``x`` for ``dim`` and ``rows`` rows is a contiguous tensor of shape
``(rows, *[x.shape[i] for i != dim])`` — ``x.narrow(dim, a, rows).movedim(dim, 0).contiguous()``. Halo
messages travel in it because every slice along its dim 0 is contiguous and can be sent or received as is.

=============  =========================================  =================================================
op             forward                                    adjoint
=============  =========================================  =================================================
pack           ``buf = cat_k x.narrow(dim, s_k, n_k)``    ``pack_adjoint``: scatter-add blocks back
unpack         ``out = cat(lo, x, hi)`` along ``dim``     narrow ``out`` into (lo, x, hi) — a pack
pack_adjoint   ``grad + scatter_add(buf)``                (itself the adjoint of pack, fused with a copy)
=============  =========================================  =================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "pack", "unpack", "pack_adjoint",
    "alloc_like", "check_buffer", "check_out", "check_ranges", "check_unpack", "normalize_dim", "rest_shape",
]

# Dtypes whose pack_adjoint sums are carried out in float32 (invariant 5: reductions accumulate in fp32).
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def normalize_dim(x: Tensor, dim: int) -> int:
    """Map a possibly negative ``dim`` into ``[0, x.dim())``; raise ``ValueError`` naming the valid range."""
    nd = x.dim()
    if not -nd <= dim < nd or nd == 0:
        raise ValueError(f"dim {dim} is out of range for a {nd}-D tensor (valid: -{nd}..{nd - 1})")
    return dim % x.dim()


def check_ranges(ranges: Sequence[tuple[int, int]], extent: int) -> tuple[tuple[int, int], ...]:
    """Validate ``(start, length)`` pairs against an extent of ``extent`` rows; return them as a tuple."""
    checked = []
    for k, rng in enumerate(ranges):
        start, length = (int(v) for v in rng)
        if length < 0 or start < 0 or start + length > extent:
            raise ValueError(
                f"range {k} = (start {start}, length {length}) must lie within the {extent} rows of the "
                f"packed dim (need 0 <= start and start + length <= {extent}, length >= 0)"
            )
        checked.append((start, length))
    return tuple(checked)


def alloc_like(x: Tensor, shape: Sequence[int]) -> Tensor:
    """``torch.empty(shape)`` in ``x``'s memory format, so a channels_last activation stays channels_last."""
    fmt = torch.contiguous_format
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            fmt = torch.channels_last
        elif x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            fmt = torch.channels_last_3d
    return torch.empty(tuple(shape), dtype=x.dtype, device=x.device, memory_format=fmt)


def rest_shape(x: Tensor, dim: int) -> tuple[int, ...]:
    """The shape of ``x`` without ``dim``: the trailing shape of a dim-major buffer of ``x``."""
    return tuple(s for i, s in enumerate(x.shape) if i != dim)


def check_out(out: Tensor, shape: Sequence[int], like: Tensor, what: str) -> None:
    """Raise ``ValueError`` unless ``out`` has ``shape`` and ``like``'s dtype and device."""
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{what}: expected a {like.dtype} tensor of shape {tuple(shape)} on {like.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )


def check_buffer(buf: Tensor, rows: int, x: Tensor, dim: int, what: str) -> None:
    """Raise ``ValueError`` unless ``buf`` is a dim-major buffer of ``x`` with ``rows`` rows."""
    check_out(buf, (rows, *rest_shape(x, dim)), x, what)


def pack(
    x: Tensor, dim: int, ranges: Sequence[tuple[int, int]], *, out: Tensor | None = None
) -> Tensor:
    """Gather rows ``[s_k, s_k + n_k)`` of ``x`` along ``dim``, for every range in order, into one buffer.

    Returns the dim-major buffer ``torch.cat([x.narrow(dim, s, n).movedim(dim, 0) for s, n in ranges])`` of
    shape ``(sum n_k, *rest)``; ranges may overlap or be empty. ``out`` (optional, any strides) receives it.
    Adjoint: ``pack_adjoint(zeros_like(x), dim, ranges, buf)``, each block added back onto its source rows.
    """
    dim = normalize_dim(x, dim)
    ranges = check_ranges(ranges, x.shape[dim])
    rows = sum(n for _, n in ranges)
    if out is None:
        out = torch.empty((rows, *rest_shape(x, dim)), dtype=x.dtype, device=x.device)
    else:
        check_buffer(out, rows, x, dim, "pack out")
    row = 0
    for start, length in ranges:
        if length:
            out.narrow(0, row, length).copy_(x.narrow(dim, start, length).movedim(dim, 0))
        row += length
    return out


def unpack(x: Tensor, lo: Tensor, hi: Tensor, dim: int, out: Tensor | None = None) -> Tensor:
    """Write ``cat([lo, x, hi], dim)`` into ``out``, where ``lo`` and ``hi`` are dim-major halo buffers.

    ``out.narrow(dim, 0, L) = lo.movedim(0, dim)``, ``out.narrow(dim, L, n) = x``,
    ``out.narrow(dim, L + n, R) = hi.movedim(0, dim)``; ``L`` or ``R`` may be 0. ``out`` defaults to a
    fresh tensor in ``x``'s memory format; a given ``out`` may have any (non-overlapping) strides. If ``x``
    already is ``out``'s interior view, only the halo rows are written. Adjoint: a pure split, no sums —
    ``grad_x = grad_out.narrow(dim, L, n)`` and ``(grad_lo, grad_hi)`` = blocks of
    ``pack(grad_out, dim, [(0, L), (L + n, R)])``.
    """
    dim, rows_lo, rows_hi, shape = check_unpack(x, lo, hi, dim, out)
    if out is None:
        out = alloc_like(x, shape)
    n = x.shape[dim]
    if rows_lo:
        out.narrow(dim, 0, rows_lo).copy_(lo.movedim(0, dim))
    mid = out.narrow(dim, rows_lo, n)
    if x.data_ptr() != mid.data_ptr() or x.stride() != mid.stride():  # else x already sits in out
        mid.copy_(x)
    if rows_hi:
        out.narrow(dim, rows_lo + n, rows_hi).copy_(hi.movedim(0, dim))
    return out


def check_unpack(
    x: Tensor, lo: Tensor, hi: Tensor, dim: int, out: Tensor | None
) -> tuple[int, int, int, tuple[int, ...]]:
    """Validate unpack arguments; return ``(dim, L, R, out_shape)`` with ``dim`` normalised."""
    dim = normalize_dim(x, dim)
    rest = rest_shape(x, dim)
    for name, buf in (("lo", lo), ("hi", hi)):
        if buf.dim() != x.dim() or tuple(buf.shape[1:]) != rest:
            raise ValueError(
                f"unpack {name}: expected a dim-major buffer of shape (rows, *{rest}), got {tuple(buf.shape)}"
            )
        check_out(buf, buf.shape, x, f"unpack {name}")
    shape = list(x.shape)
    shape[dim] += lo.shape[0] + hi.shape[0]
    if out is not None:
        check_out(out, shape, x, "unpack out")
    return dim, lo.shape[0], hi.shape[0], tuple(shape)


def pack_adjoint(
    grad: Tensor, dim: int, ranges: Sequence[tuple[int, int]], buf: Tensor, *, out: Tensor | None = None
) -> Tensor:
    """Return ``grad`` plus the adjoint of ``pack`` applied to ``buf``: the fused backward of a halo pack.

    For each range ``k`` in order, rows ``[s_k, s_k + n_k)`` along ``dim`` receive the ``k``-th block of the
    dim-major ``buf``; overlapping ranges add up, in range order (deterministic). float16/bfloat16 sums are
    carried in float32 and rounded once. ``out`` defaults to a fresh tensor in ``grad``'s memory format;
    ``out=grad`` accumulates in place. This is the exact adjoint: ``<pack(x), b> = <x, pack_adjoint(0, b)>``.
    """
    dim = normalize_dim(grad, dim)
    ranges = check_ranges(ranges, grad.shape[dim])
    check_buffer(buf, sum(n for _, n in ranges), grad, dim, "pack_adjoint buf")
    if out is None:
        out = alloc_like(grad, grad.shape)
    else:
        check_out(out, grad.shape, grad, "pack_adjoint out")
    if out is not grad:
        out.copy_(grad)
    blocks = []  # (start, length, first buffer row) of the non-empty ranges
    row = 0
    for start, length in ranges:
        if length:
            blocks.append((start, length, row))
        row += length
    for cluster in _overlap_clusters(blocks) if grad.dtype in _LOW_PRECISION else [blocks]:
        if len(cluster) == 1 or grad.dtype not in _LOW_PRECISION:
            # One addend per element, or a dtype summed natively: each add_ rounds once, like the kernel.
            for start, length, row in cluster:
                out.narrow(dim, start, length).add_(buf.narrow(0, row, length).movedim(0, dim))
            continue
        # Overlapping fp16/bf16 ranges: sum over their span in float32 and round once, as the kernel does.
        lo = min(s for s, _, _ in cluster)
        hi = max(s + n for s, n, _ in cluster)
        acc = out.narrow(dim, lo, hi - lo).float()
        for start, length, row in cluster:
            acc.narrow(dim, start - lo, length).add_(buf.narrow(0, row, length).movedim(0, dim))
        out.narrow(dim, lo, hi - lo).copy_(acc)
    return out


def _overlap_clusters(blocks: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Group ``(start, length, row)`` blocks whose row spans overlap (transitively), each in range order."""
    clusters: list[list[tuple[int, int, int]]] = []
    spans: list[list[int]] = []
    for block in sorted(blocks, key=lambda b: b[0]):
        if spans and block[0] < spans[-1][1]:
            clusters[-1].append(block)
            spans[-1][1] = max(spans[-1][1], block[0] + block[1])
        else:
            clusters.append([block])
            spans.append([block[0], block[0] + block[1]])
    order = {b: i for i, b in enumerate(blocks)}
    return [sorted(c, key=order.__getitem__) for c in clusters]
