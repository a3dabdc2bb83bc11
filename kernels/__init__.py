"""halo.kernels — pack and unpack halo rows: Triton kernels, a torch reference, one dispatch point.

A halo message travels *dim-major*: for tensor ``x`` and dim ``d`` a contiguous buffer of shape
``(rows, *[x.shape[i] for i != d])``, equal to ``x.narrow(d, a, rows).movedim(d, 0).contiguous()``, so any
slice along its dim 0 is contiguous and can be sent or received directly.

===============================================  =============================================================
``pack(x, dim, ranges)``                         rows ``[s, s + n)`` of every range, in order, one buffer
``unpack(x, lo, hi, dim, out=None)``             ``cat([lo, x, hi], dim)``, optionally into a given ``out``
``pack_adjoint(grad, dim, ranges, buf)``         ``grad`` + the blocks of ``buf`` added back onto their rows
``bits(key, n, run, stride, offset, ...)``       counter-based random draws keyed on global indices (``philox``)
``dropout(x, key, run, stride, offset, ...)``    a dropout with those draws, fused (no mask in memory)
``backend_for(tensor, op)``                      ``"triton"`` or ``"reference"``: what ``impl="auto"`` runs
===============================================  =============================================================

Each op takes ``impl="auto" | "triton" | "reference"``; the submodules ``reference`` and (with triton)
``triton_kernels`` hold the two implementations with identical signatures. Triton is optional.
"""

from . import philox, reference
from .dispatch import HAS_TRITON, TRITON_IMPORT_ERROR, Impl, backend_for, bits, dropout, pack, pack_adjoint, unpack

__all__ = [
    "HAS_TRITON",
    "TRITON_IMPORT_ERROR",
    "Impl",
    "backend_for",
    "bits",
    "dropout",
    "pack",
    "pack_adjoint",
    "philox",
    "reference",
    "unpack",
]
