"""Triton pack / unpack / pack_adjoint: the same signatures and semantics as ``reference.py``.

These functions validate, allocate, fold the index space (``layout.plan``) and launch the kernels of
``triton_jit.py``: the compiled build for CUDA tensors, the interpreter for CPU tensors (what the tests run
on a machine without a GPU). Importing this module needs ``triton``; ``dispatch.py`` guards the import.

==============  =============================================================================================
op              launches
==============  =============================================================================================
pack            one per ``MAX_RANGES`` non-empty ranges (one in practice); empty ranges are skipped
unpack          one: programs ``[0, PA)`` copy x into out's interior, the rest write the halo rows. If ``x``
                already is that interior view, only the halo rows are written
pack_adjoint    one per ``MAX_RANGES`` non-empty ranges; later chunks add into ``out`` in place. With
                ``out=grad`` only the rows between the first and last range are visited
==============  =============================================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
from torch import Tensor

from . import philox
from . import reference as ref
from .layout import UnsupportedLayout, plan
from .triton_jit import MAX_RANGES, PACK, PACK_ADJOINT, PHILOX, UNPACK

__all__ = ["MAX_RANGES", "UnsupportedLayout", "bits", "dropout", "pack", "pack_adjoint", "supports", "unpack"]

_TILE_BYTES = 16384  # bytes per program on a GPU: 4096 fp32 / 8192 bf16 elements, 16 B vectors per thread
_TILE_INTERPRET = 16384  # elements per program under the interpreter, where each program costs milliseconds

COPY_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                         torch.int16, torch.int32, torch.int64, torch.bool})
SUM_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def supports(op: str, dtype: torch.dtype) -> bool:
    """Whether the kernel of ``op`` takes ``dtype``: copies any 1-8 byte real type, sums floats only."""
    return dtype in (SUM_DTYPES if op == "pack_adjoint" else COPY_DTYPES)


def _check_dtype(op: str, t: Tensor) -> None:
    if not supports(op, t.dtype):
        names = sorted(str(d) for d in (SUM_DTYPES if op == "pack_adjoint" else COPY_DTYPES))
        raise TypeError(f"triton {op} takes {names}, got {t.dtype}; use the reference path")


def _kernel(pair: tuple, t: Tensor):
    """The compiled kernel for CUDA tensors, the interpreted one for CPU tensors."""
    if t.is_cuda:
        return pair[0]
    if t.device.type == "cpu" and pair[1] is not None:
        return pair[1]
    raise ValueError(f"the Triton kernels take CUDA tensors (or CPU ones, interpreted), got {t.device}")


def _plan(t: Tensor, shape: Sequence[int], dim: int, tensors: Sequence[Tensor], main: int):
    """``layout.plan`` for ``tensors`` (output first) over ``shape``, with the tile for ``t``'s device."""
    on_cpu = t.device.type == "cpu"
    tile = _TILE_INTERPRET if on_cpu else max(1024, _TILE_BYTES // t.element_size())
    return plan(tuple(shape), dim, tuple(tuple(u.stride()) for u in tensors), main, tile, not on_cpu)


def _check_writable(out: Tensor) -> None:
    if any(st == 0 and sz > 1 for st, sz in zip(out.stride(), out.shape, strict=True)):
        raise ValueError(f"out must not have overlapping elements (a stride 0), got strides {out.stride()}")


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _pad(values: list[int], n: int = MAX_RANGES) -> list[int]:
    return values + [0] * (n - len(values))


def _blocks(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(start, length, first buffer row)`` of the non-empty ranges, in order."""
    blocks, row = [], 0
    for start, length in ranges:
        if length:
            blocks.append((start, length, row))
        row += length
    return blocks


def pack(x: Tensor, dim: int, ranges: Sequence[tuple[int, int]], *, out: Tensor | None = None) -> Tensor:
    """Triton twin of :func:`reference.pack`: ``cat_k x.narrow(dim, s_k, n_k).movedim(dim, 0)``."""
    _check_dtype("pack", x)
    dim = ref.normalize_dim(x, dim)
    ranges = ref.check_ranges(ranges, x.shape[dim])
    rows = sum(n for _, n in ranges)
    if out is None:
        out = torch.empty((rows, *ref.rest_shape(x, dim)), dtype=x.dtype, device=x.device)
    else:
        ref.check_buffer(out, rows, x, dim, "pack out")
        _check_writable(out)
    blocks = _blocks(ranges)
    if out.numel() == 0:
        return out
    kernel = _kernel(PACK, x)
    for i in range(0, len(blocks), MAX_RANGES):
        chunk = blocks[i : i + MAX_RANGES]
        first = chunk[0][2]
        view = out.narrow(0, first, sum(n for _, n, _ in chunk)).movedim(0, dim)  # x's logical axis order
        p = _plan(x, view.shape, dim, (view, x), 1)
        # Row d of the view is in range k when d >= C_k; it reads x's row d + s_k - c_k (D_k in elements).
        firsts = [c - first for _, _, c in chunk[1:]]
        shifts = [(s - (c - first)) * x.stride(dim) for s, _, c in chunk]
        with _device(x):
            kernel[(p.grid,)](view, x, *p.sizes, *p.strides[0], *p.strides[1], *_pad(firsts, MAX_RANGES - 1),
                              *_pad(shifts), NR=len(chunk), DA=p.dim_axis, BM=p.bm, BN=p.bn,
                              num_warps=p.num_warps)
    return out


def unpack(x: Tensor, lo: Tensor, hi: Tensor, dim: int, out: Tensor | None = None) -> Tensor:
    """Triton twin of :func:`reference.unpack`: ``out = cat([lo, x, hi], dim)`` in one launch."""
    _check_dtype("unpack", x)
    dim, rows_lo, rows_hi, shape = ref.check_unpack(x, lo, hi, dim, out)
    if out is None:
        out = ref.alloc_like(x, shape)
    else:
        _check_writable(out)
    if out.numel() == 0:
        return out
    n = x.shape[dim]
    mid = out.narrow(dim, rows_lo, n)
    in_place = x.numel() > 0 and x.data_ptr() == mid.data_ptr() and x.stride() == mid.stride()
    # Segment A, the interior: mid <- x, a plain copy (no packed dim: every axis may fold).
    a = _plan(out, x.shape, -1, (mid, x), 1)
    programs_a = 0 if in_place else a.grid
    # Segment B, the halo rows: index space out.narrow(dim, 0, L + R); row d >= L lands on out's row d + n.
    # Empty operands are never read (their masks are all false): out stands in for pointer and strides.
    halo = out.narrow(dim, 0, rows_lo + rows_hi)
    lo_v, hi_v = (t.movedim(0, dim) if t.numel() else halo for t in (lo, hi))
    b = _plan(out, halo.shape, dim, (halo, lo_v, hi_v), 0)
    if programs_a + b.grid == 0:
        return out
    x_arg = x if x.numel() else out
    with _device(out):
        _kernel(UNPACK, out)[(programs_a + b.grid,)](
            out, mid, x_arg, lo_v, hi_v, programs_a, *a.sizes, *a.strides[0], *a.strides[1],
            *b.sizes, *b.strides[0], *b.strides[1], *b.strides[2],
            rows_lo, -rows_lo * hi_v.stride(dim), n * out.stride(dim),
            AM=a.bm, AN=a.bn, DA=b.dim_axis, BM=b.bm, BN=b.bn, num_warps=max(a.num_warps, b.num_warps))
    return out


def pack_adjoint(grad: Tensor, dim: int, ranges: Sequence[tuple[int, int]], buf: Tensor, *,
                 out: Tensor | None = None) -> Tensor:
    """Triton twin of :func:`reference.pack_adjoint`: ``grad`` plus each block of ``buf`` on its rows.

    Sums run in fp32 (fp64 for fp64) in range order and round once per launch — once overall unless there
    are more than ``MAX_RANGES`` non-empty ranges.
    """
    _check_dtype("pack_adjoint", grad)
    dim = ref.normalize_dim(grad, dim)
    ranges = ref.check_ranges(ranges, grad.shape[dim])
    ref.check_buffer(buf, sum(n for _, n in ranges), grad, dim, "pack_adjoint buf")
    if out is None:
        out = ref.alloc_like(grad, grad.shape)
    else:
        ref.check_out(out, grad.shape, grad, "pack_adjoint out")
        _check_writable(out)
    blocks = _blocks(ranges)
    if out.numel() == 0:
        return out
    span = 0, grad.shape[dim]
    if out.data_ptr() == grad.data_ptr() and out.stride() == grad.stride():  # in place: rows outside stay
        if not blocks:
            return out
        span = min(s for s, _, _ in blocks), max(s + n for s, n, _ in blocks)
    dst = out.narrow(dim, span[0], span[1] - span[0])
    src = grad.narrow(dim, span[0], span[1] - span[0])
    buf_v = buf.movedim(0, dim) if buf.numel() else src
    kernel = _kernel(PACK_ADJOINT, grad)
    for i in range(0, max(1, len(blocks)), MAX_RANGES):
        chunk = blocks[i : i + MAX_RANGES]
        p = _plan(grad, dst.shape, dim, (dst, src, buf_v), 1)
        starts = [s - span[0] for s, _, _ in chunk]
        ends = [s + n - span[0] for s, n, _ in chunk]
        shifts = [(c - s + span[0]) * buf.stride(0) for s, _, c in chunk]  # view row d -> buffer row
        with _device(grad):
            kernel[(p.grid,)](dst, src, buf_v, *p.sizes, *p.strides[0], *p.strides[1], *p.strides[2],
                              *_pad(starts), *_pad(ends), *_pad(shifts), NR=len(chunk),
                              F64=grad.dtype == torch.float64, DA=p.dim_axis, BM=p.bm, BN=p.bn,
                              num_warps=p.num_warps)
        src = dst  # later chunks add into out in place
    return out


# -- counter-based random numbers (philox.py holds the reference and says what is drawn) --------------------------

_PHILOX_BLOCK = 1024  # elements per program on a GPU


def _philox_block(t: Tensor, n: int) -> int:
    if t.device.type == "cpu":  # the interpreter: as few programs as possible
        return max(16, min(1 << 16, 1 << (max(n, 1) - 1).bit_length()))
    return _PHILOX_BLOCK


def _scale_bits(scale: float) -> int:
    import struct

    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def bits(key: Tensor, n: int, run: int, stride: int, offset: int, stream: int, tag: int) -> Tensor:
    """Triton twin of :func:`philox.bits`: one launch."""
    philox.check_space(n, run, stride, offset)
    out = torch.empty(n, dtype=torch.int32, device=key.device)
    if n == 0:
        return out
    block = _philox_block(key, n)
    with _device(key):
        _kernel(PHILOX, key)[(triton.cdiv(n, block),)](out, out, key, n, run, stride, offset, stream, tag, 0, 0,
                                                        MODE=0, F64=False, BLOCK=block, num_warps=4)
    return out


def dropout(x: Tensor, key: Tensor, run: int, stride: int, offset: int, stream: int, threshold: int,
            scale: float) -> Tensor:
    """Triton twin of :func:`philox.dropout`: one launch, nothing but ``x`` read and the result written."""
    if x.dtype not in SUM_DTYPES:
        raise TypeError(f"triton dropout takes {sorted(str(d) for d in SUM_DTYPES)}, got {x.dtype}")
    philox.check_space(x.numel(), run, stride, offset)
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.numel()
    if n == 0:
        return out
    block = _philox_block(x, n)
    with _device(x):
        _kernel(PHILOX, x)[(triton.cdiv(n, block),)](out, x, key, n, run, stride, offset, stream, 0, threshold,
                                                      _scale_bits(scale), MODE=1, F64=x.dtype == torch.float64,
                                                      BLOCK=block, num_warps=4)
    return out
