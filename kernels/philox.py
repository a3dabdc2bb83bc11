"""Counter-based random numbers (Philox-4x32-10) keyed on *global* element indices: the torch reference.

One call draws for an index space that is a set of equal runs: element ``i`` of a tensor of ``n`` elements has the
global index ``g(i) = (i // run) * stride + offset + i % run``. For an H-shard ``(A, h, W)`` of a field ``(A, H, W)``
starting at row ``h0`` that is ``run = h * W``, ``stride = H * W``, ``offset = h0 * W``: every element gets the index
it has in the whole field, so a draw does not depend on how the field is split. ``run = stride = 1``, ``offset = 0``
indexes a plain vector (one draw per sample or per channel).

Element ``g`` takes word ``g % 4`` of ``philox4x32_10(counter=(g // 4 low, g // 4 high, stream, tag), key)``
(Random123's Philox-4x32 with 10 rounds, the generator of cuRAND, torch's CUDA RNG and ``tl.rand``): ``key`` (a
one-element int64 tensor, so nothing is read back to the host) is drawn per call, ``stream`` separates
data-parallel replicas, ``tag`` separates draws of one call. The value kept is the top 24 bits, ``word >> 8``: an
integer in ``[0, 2**24)`` that a threshold compares exactly on every backend. ``triton_jit.PHILOX`` computes the
same bits in one kernel (tested bitwise against this file).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BITS", "bits", "dropout", "masked", "philox4x32"]

BITS = 24  # bits kept per draw
_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of ``a * b`` (``a`` a 32-bit constant, ``b`` int64 holding 32-bit values): the product
    is below 2**64, and int64 multiplication keeps its low 64 bits (two's complement wrap-around, as every torch
    backend computes it; the known-answer tests would see otherwise)."""
    p = b * a
    return (p >> 32) & _MASK, p & _MASK


def philox4x32(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor,
               rounds: int = 10) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox-4x32 on int64 tensors holding unsigned 32-bit words (broadcasting); returns the four output words."""
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


_CHUNK = 1 << 14  # counters per pass: the round's temporaries stay in cache (3x faster than one pass on a CPU)


def check_space(n: int, run: int, stride: int, offset: int) -> None:
    if run <= 0 or n % run or stride < run or not 0 <= offset <= stride - run:
        raise ValueError(f"index space: n={n} must be a multiple of run={run} > 0, and run + offset={offset} must "
                         f"fit in stride={stride}")


def bits(key: Tensor, n: int, run: int, stride: int, offset: int, stream: int, tag: int) -> Tensor:
    """The 24-bit draws of elements ``0..n-1`` (module docstring) as int32 on ``key``'s device."""
    check_space(n, run, stride, offset)
    dev = key.device
    if n == 0:
        return torch.empty(0, dtype=torch.int32, device=dev)
    key = key.reshape(()).to(torch.int64)
    runs = n // run
    first = torch.arange(runs, dtype=torch.int64, device=dev) * stride + offset  # global index of each run's start
    width = (run + 3) // 4 + 1  # counters that a run's elements can touch
    ctr = ((first >> 2)[:, None] + torch.arange(width, dtype=torch.int64, device=dev)).reshape(-1)
    k0, k1 = key & _MASK, (key >> 32) & _MASK
    c2 = torch.full((), stream, dtype=torch.int64, device=dev)
    c3 = torch.full((), tag, dtype=torch.int64, device=dev)
    draws = torch.empty(ctr.numel(), 4, dtype=torch.int32, device=dev)  # draw 4 c + j is global index 4 c + j
    chunk = ctr.numel() if dev.type != "cpu" else _CHUNK
    for i in range(0, ctr.numel(), chunk):
        c = ctr[i:i + chunk]
        words = philox4x32(c & _MASK, c >> 32, c2, c3, k0, k1)
        draws[i:i + chunk] = torch.stack(words, dim=1) >> (32 - BITS)
    take = (first & 3)[:, None] + torch.arange(run, dtype=torch.int64, device=dev)
    return torch.gather(draws.view(runs, 4 * width), 1, take).reshape(n)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where a dropout multiplies: float64 for float64, else float32 (rounded once to the input's dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dropout(x: Tensor, key: Tensor, run: int, stride: int, offset: int, stream: int, threshold: int,
            scale: float) -> Tensor:
    """``x * scale`` where the element's draw is ``>= threshold``, else 0 (``x`` read in row-major order)."""
    u = bits(key, x.numel(), run, stride, offset, stream, 0).reshape(x.shape)
    return masked(x, u >= threshold, scale)


def masked(x: Tensor, keep: Tensor, scale: float) -> Tensor:
    """``x * scale`` (the scale rounded to the accumulation dtype once, the product to ``x``'s) where ``keep``,
    else 0: what every dropout path computes, so that they agree bitwise."""
    y = (x.to(acc_dtype(x.dtype)) * scale).to(x.dtype)
    return torch.where(keep, y, torch.zeros((), dtype=x.dtype, device=x.device))
