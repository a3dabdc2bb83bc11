"""The one place that picks the Triton or the torch-reference path for the halo pack/unpack ops.

=========================================================  ======================================
tensor                                                      path (``impl="auto"``)
=========================================================  ======================================
CUDA, triton importable, dtype and layout supported         ``"triton"`` (compiled)
CPU, triton importable, ``TRITON_INTERPRET=1`` now set      ``"triton"`` (Triton's interpreter)
anything else (no triton, other devices, complex, ...)      ``"reference"``
=========================================================  ======================================

Triton is optional: without it (or with a broken install) everything runs on the reference and
``TRITON_IMPORT_ERROR`` says why. Dtypes: the Triton copies (pack, unpack) take float16/bfloat16/float32/
float64 and 1-8 byte integers and bool; pack_adjoint's Triton kernel takes the four float types and the
rest go to the reference (integers add with wrap-around, bool as logical or). A layout whose strides do
not fold into five axes (rare: > 5-D and permuted) also goes to the reference. ``impl="triton"`` or
``impl="reference"`` forces a path (tests); forced Triton on CPU tensors runs the interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

from torch import Tensor

from . import philox, reference

try:
    from . import triton_kernels
except (ImportError, OSError, RuntimeError) as exc:  # triton missing or unusable: reference only
    triton_kernels = None
    TRITON_IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    TRITON_IMPORT_ERROR = None

__all__ = ["HAS_TRITON", "TRITON_IMPORT_ERROR", "Impl", "backend_for", "bits", "dropout", "pack", "pack_adjoint",
           "unpack"]

HAS_TRITON = triton_kernels is not None
Impl = Literal["auto", "triton", "reference"]


def backend_for(tensor: Tensor, op: str = "unpack") -> str:
    """``"triton"`` or ``"reference"``: the path ``op`` takes for ``tensor`` under ``impl="auto"``.

    The environment is read on every call, so a test may set ``TRITON_INTERPRET`` at any time.
    """
    if triton_kernels is None or (op != "bits" and not triton_kernels.supports(op, tensor.dtype)):
        return "reference"
    if tensor.is_cuda:
        return "triton"
    if tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "triton"
    return "reference"


def _module(impl: Impl, tensor: Tensor, op: str):
    if impl == "reference":
        return reference
    if impl == "triton":
        if triton_kernels is None:
            raise RuntimeError(f"impl='triton' needs triton, which did not import ({TRITON_IMPORT_ERROR})")
        return triton_kernels
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    return triton_kernels if backend_for(tensor, op) == "triton" else reference


def pack(x: Tensor, dim: int, ranges: Sequence[tuple[int, int]], *, out: Tensor | None = None,
         impl: Impl = "auto") -> Tensor:
    """Pack rows ``[s_k, s_k + n_k)`` of ``x`` along ``dim`` into one dim-major buffer (one launch).

    Returns ``torch.cat([x.narrow(dim, s, n).movedim(dim, 0) for s, n in ranges])``, contiguous, shape
    ``(sum n_k, *rest)``; ranges may overlap, be empty, or be none. ``x`` may have any strides. The buffer's
    dim-0 slices are contiguous, so each range's block can be sent as is. ``out``: a preallocated buffer.
    Adjoint: :func:`pack_adjoint` (scatter-add of the blocks back onto their rows).
    """
    mod = _module(impl, x, "pack")
    if mod is reference:
        return reference.pack(x, dim, ranges, out=out)
    try:
        return mod.pack(x, dim, ranges, out=out)
    except triton_kernels.UnsupportedLayout:
        return reference.pack(x, dim, ranges, out=out)


def unpack(x: Tensor, lo: Tensor, hi: Tensor, dim: int, out: Tensor | None = None, *,
           impl: Impl = "auto") -> Tensor:
    """Assemble ``cat([lo, x, hi], dim)`` from dim-major halo buffers ``lo``, ``hi`` (one launch).

    ``out`` defaults to a fresh tensor in ``x``'s memory format (channels_last stays channels_last); a given
    ``out`` — e.g. the caller's padded buffer — may have any non-overlapping strides and receives every
    element; if ``x`` already is ``out.narrow(dim, L, n)`` only the halo rows are written. Adjoint: a split of
    ``grad_out`` into ``narrow(dim, L, n)`` and the pack of rows ``(0, L)`` and ``(L + n, R)`` — no sums.
    """
    mod = _module(impl, x, "unpack")
    if mod is reference:
        return reference.unpack(x, lo, hi, dim, out)
    try:
        return mod.unpack(x, lo, hi, dim, out)
    except triton_kernels.UnsupportedLayout:
        return reference.unpack(x, lo, hi, dim, out)


def pack_adjoint(grad: Tensor, dim: int, ranges: Sequence[tuple[int, int]], buf: Tensor, *,
                 out: Tensor | None = None, impl: Impl = "auto") -> Tensor:
    """``grad`` plus the adjoint of :func:`pack` applied to ``buf`` — the fused backward of a halo pack.

    For each range ``k`` in order, rows ``[s_k, s_k + n_k)`` of ``grad`` along ``dim`` receive block ``k``
    of ``buf``; overlapping ranges add, in range order, deterministically; fp16/bf16 sum in fp32. Returns a
    new tensor in ``grad``'s memory format (``out=grad``: in place, touching only the ranges' rows). Adjoint
    identity (tested): ``<pack(x, dim, r), b> == <x, pack_adjoint(zeros_like(x), dim, r, b)>``.
    """
    mod = _module(impl, grad, "pack_adjoint")
    if mod is reference:
        return reference.pack_adjoint(grad, dim, ranges, buf, out=out)
    try:
        return mod.pack_adjoint(grad, dim, ranges, buf, out=out)
    except triton_kernels.UnsupportedLayout:
        return reference.pack_adjoint(grad, dim, ranges, buf, out=out)


def bits(key: Tensor, n: int, run: int, stride: int, offset: int, stream: int, tag: int, *,
         impl: Impl = "auto") -> Tensor:
    """24-bit counter-based draws for ``n`` elements at global indices ``(i // run) * stride + offset + i % run``
    (``philox.py``), int32 on ``key``'s device; the same bits on every path."""
    if _module(impl, key, "bits") is reference:
        return philox.bits(key, n, run, stride, offset, stream, tag)
    return triton_kernels.bits(key, n, run, stride, offset, stream, tag)


def dropout(x: Tensor, key: Tensor, run: int, stride: int, offset: int, stream: int, threshold: int, scale: float,
            *, impl: Impl = "auto") -> Tensor:
    """``x * scale`` where the element's draw (as :func:`bits`, tag 0) is ``>= threshold``, else 0: one fused
    launch on the Triton path (no mask in memory); the same numbers on every path."""
    if _module(impl, x, "dropout") is reference:
        return philox.dropout(x, key, run, stride, offset, stream, threshold, scale)
    return triton_kernels.dropout(x, key, run, stride, offset, stream, threshold, scale)
