"""The @triton.jit sources of the halo kernels, each built twice: compiled and interpreted.

``triton_kernels.py`` launches them; ``layout.py`` folds the index space they walk. A kernel sees its
index space as five axes (sizes ``S0..S4``) and each tensor through five strides (``o*`` output, ...).
A program owns one ``[BM, BN]`` tile of axes 3 x 4 at one point of axes 0..2; the 1-D grid enumerates tiles
with axis 4 (the output's fastest) fastest. Program ids are cast to int64 before any arithmetic, so every
offset is int64 (tensors > 2**31 elements). Ranges come as scalar arguments, ``MAX_RANGES`` per launch,
unrolled by the constexpr ``NR``; element shifts (``D*``, ``XS``, ``HS``, ``OG``) are int64 from the host.

Why two builds: ``triton.jit`` picks compiled or interpreted once, from ``TRITON_INTERPRET`` at import time.
Building both from the same function lets CUDA tensors always run compiled code and CPU tensors the
interpreter in one process (the test suite does both). The price: no @jit helpers (and no @jit stdlib
functions such as ``tl.cdiv``) — one global name cannot be both builds — so the 10-line prologue repeats.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - a triton without the interpreter: CPU tensors use the reference
    InterpretedFunction = None

__all__ = ["MAX_RANGES", "PACK", "PACK_ADJOINT", "PHILOX", "UNPACK"]

MAX_RANGES = 8  # ranges per launch (scalar kernel arguments)


# Prologue of every kernel: unravel the program id into a point of axes 0..2 and a tile of axes 3 x 4, and
# pick the index ``d`` along the packed dim (axis DA).


def _pack_kernel(out_ptr, x_ptr, S0, S1, S2, S3, S4, o0, o1, o2, o3, o4, x0, x1, x2, x3, x4,
                 C1, C2, C3, C4, C5, C6, C7, D0, D1, D2, D3, D4, D5, D6, D7,
                 NR: tl.constexpr, DA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n4 = (S4 + BN - 1) // BN
    n3 = (S3 + BM - 1) // BM
    rest = pid // n4 // n3
    i0, i1, i2 = rest // S2 // S1, rest // S2 % S1, rest % S2
    i3 = (pid // n4 % n3) * BM + tl.arange(0, BM)[:, None]
    i4 = (pid % n4) * BN + tl.arange(0, BN)[None, :]
    tile = (i3 < S3) & (i4 < S4)  # guards the ragged last tile of axes 3 and 4
    if DA == 0:
        d = i0
    elif DA == 1:
        d = i1
    elif DA == 2:
        d = i2
    elif DA == 3:
        d = i3
    else:
        d = i4
    # Buffer row d belongs to the last range k whose first buffer row C_k <= d; D_k (elements, int64 on the
    # host) moves x's pointer from row d to that range's source row.
    shift = D0
    if NR > 1:
        shift = tl.where(d >= C1, D1, shift)
    if NR > 2:
        shift = tl.where(d >= C2, D2, shift)
    if NR > 3:
        shift = tl.where(d >= C3, D3, shift)
    if NR > 4:
        shift = tl.where(d >= C4, D4, shift)
    if NR > 5:
        shift = tl.where(d >= C5, D5, shift)
    if NR > 6:
        shift = tl.where(d >= C6, D6, shift)
    if NR > 7:
        shift = tl.where(d >= C7, D7, shift)
    off_x = i0 * x0 + i1 * x1 + i2 * x2 + i3 * x3 + i4 * x4 + shift
    v = tl.load(x_ptr + off_x, mask=tile)
    tl.store(out_ptr + (i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3 + i4 * o4), v, mask=tile)


def _unpack_kernel(out_ptr, mid_ptr, x_ptr, lo_ptr, hi_ptr, PA,
                   P0, P1, P2, P3, P4, p0, p1, p2, p3, p4, q0, q1, q2, q3, q4,
                   S0, S1, S2, S3, S4, o0, o1, o2, o3, o4, l0, l1, l2, l3, l4, h0, h1, h2, h3, h4, L, HS, OG,
                   AM: tl.constexpr, AN: tl.constexpr, DA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # Two index spaces in one launch. Programs [0, PA): the interior, mid (= out.narrow(dim, L, n)) <- x, a
    # plain strided copy whose axes fold as far as out and x allow (H.W.C is one axis for either layout).
    # Programs [PA, ...): the L + R halo rows, read from the dim-major lo / hi (names b_* in this branch).
    pid = tl.program_id(0).to(tl.int64)
    if pid < PA:
        n4 = (P4 + AN - 1) // AN
        n3 = (P3 + AM - 1) // AM
        rest = pid // n4 // n3
        i0, i1, i2 = rest // P2 // P1, rest // P2 % P1, rest % P2
        i3 = (pid // n4 % n3) * AM + tl.arange(0, AM)[:, None]
        i4 = (pid % n4) * AN + tl.arange(0, AN)[None, :]
        tile = (i3 < P3) & (i4 < P4)  # guards the ragged last tile of axes 3 and 4
        v = tl.load(x_ptr + (i0 * q0 + i1 * q1 + i2 * q2 + i3 * q3 + i4 * q4), mask=tile)
        tl.store(mid_ptr + (i0 * p0 + i1 * p1 + i2 * p2 + i3 * p3 + i4 * p4), v, mask=tile)
    else:
        b_pid = pid - PA
        b_n4 = (S4 + BN - 1) // BN
        b_n3 = (S3 + BM - 1) // BM
        b_rest = b_pid // b_n4 // b_n3
        j0, j1, j2 = b_rest // S2 // S1, b_rest // S2 % S1, b_rest % S2
        j3 = (b_pid // b_n4 % b_n3) * BM + tl.arange(0, BM)[:, None]
        j4 = (b_pid % b_n4) * BN + tl.arange(0, BN)[None, :]
        b_tile = (j3 < S3) & (j4 < S4)  # guards the ragged last tile of axes 3 and 4
        if DA == 0:
            d = j0
        elif DA == 1:
            d = j1
        elif DA == 2:
            d = j2
        elif DA == 3:
            d = j3
        else:
            d = j4
        # As a full tile even where d is a scalar (DA < 3): masks stay int1 blocks on every Triton version.
        d = d + 0 * (j3 + j4)
        is_lo = d < L  # halo row d < L is lo's row d; else hi's row d - L (HS) and out's row d + n (OG)
        b_v = tl.load(lo_ptr + (j0 * l0 + j1 * l1 + j2 * l2 + j3 * l3 + j4 * l4), mask=b_tile & is_lo)
        b_v = tl.where(is_lo, b_v, tl.load(hi_ptr + (j0 * h0 + j1 * h1 + j2 * h2 + j3 * h3 + j4 * h4 + HS),
                                           mask=b_tile & ~is_lo))
        off_o = j0 * o0 + j1 * o1 + j2 * o2 + j3 * o3 + j4 * o4 + tl.where(is_lo, 0, OG)
        tl.store(out_ptr + off_o, b_v, mask=b_tile)


def _pack_adjoint_kernel(out_ptr, g_ptr, b_ptr, S0, S1, S2, S3, S4, o0, o1, o2, o3, o4,
                         g0, g1, g2, g3, g4, b0, b1, b2, b3, b4,
                         A0, A1, A2, A3, A4, A5, A6, A7, E0, E1, E2, E3, E4, E5, E6, E7,
                         D0, D1, D2, D3, D4, D5, D6, D7,
                         NR: tl.constexpr, F64: tl.constexpr, DA: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n4 = (S4 + BN - 1) // BN
    n3 = (S3 + BM - 1) // BM
    rest = pid // n4 // n3
    i0, i1, i2 = rest // S2 // S1, rest // S2 % S1, rest % S2
    i3 = (pid // n4 % n3) * BM + tl.arange(0, BM)[:, None]
    i4 = (pid % n4) * BN + tl.arange(0, BN)[None, :]
    tile = (i3 < S3) & (i4 < S4)  # guards the ragged last tile of axes 3 and 4
    if DA == 0:
        d = i0
    elif DA == 1:
        d = i1
    elif DA == 2:
        d = i2
    elif DA == 3:
        d = i3
    else:
        d = i4
    d = d + 0 * (i3 + i4)  # a full tile even where d is a scalar: masks stay int1 blocks on every Triton
    acc = tl.load(g_ptr + (i0 * g0 + i1 * g1 + i2 * g2 + i3 * g3 + i4 * g4), mask=tile)
    if F64:
        acc = acc.to(tl.float64)
    else:
        acc = acc.to(tl.float32)  # fp16/bf16 sum in fp32 and round once (invariant 5)
    # Range k covers rows [A_k, E_k); D_k (elements) moves buf's pointer from row d to the block's row.
    # Each mask guards the rows outside range k.
    b = b_ptr + (i0 * b0 + i1 * b1 + i2 * b2 + i3 * b3 + i4 * b4)
    if NR > 0:
        acc += tl.load(b + D0, mask=tile & (d >= A0) & (d < E0), other=0).to(acc.dtype)
    if NR > 1:
        acc += tl.load(b + D1, mask=tile & (d >= A1) & (d < E1), other=0).to(acc.dtype)
    if NR > 2:
        acc += tl.load(b + D2, mask=tile & (d >= A2) & (d < E2), other=0).to(acc.dtype)
    if NR > 3:
        acc += tl.load(b + D3, mask=tile & (d >= A3) & (d < E3), other=0).to(acc.dtype)
    if NR > 4:
        acc += tl.load(b + D4, mask=tile & (d >= A4) & (d < E4), other=0).to(acc.dtype)
    if NR > 5:
        acc += tl.load(b + D5, mask=tile & (d >= A5) & (d < E5), other=0).to(acc.dtype)
    if NR > 6:
        acc += tl.load(b + D6, mask=tile & (d >= A6) & (d < E6), other=0).to(acc.dtype)
    if NR > 7:
        acc += tl.load(b + D7, mask=tile & (d >= A7) & (d < E7), other=0).to(acc.dtype)
    tl.store(out_ptr + (i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3 + i4 * o4),
             acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=tile)


def _build(fn, dynamic: Sequence[str]) -> tuple:
    """(compiled, interpreted) versions of ``fn``; range arguments are not specialised (no recompiles)."""
    compiled = triton.runtime.jit.JITFunction(fn, do_not_specialize=list(dynamic))
    interpreted = InterpretedFunction(fn) if InterpretedFunction is not None else None
    return compiled, interpreted


def _names(prefixes: str, first: int = 0) -> list[str]:
    return [f"{p}{k}" for p in prefixes for k in range(first, MAX_RANGES)]


PACK = _build(_pack_kernel, _names("C", 1))
UNPACK = _build(_unpack_kernel, [])
PACK_ADJOINT = _build(_pack_adjoint_kernel, _names("AE"))


def _philox_kernel(out_ptr, x_ptr, key_ptr, N, RUN, STRIDE, OFFSET, STREAM, TAG, THRESHOLD, SCALE_BITS,
                   MODE: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    """Philox-4x32-10 on global indices (``philox.py`` says which): MODE 0 writes the 24-bit draws (int32),
    MODE 1 a dropout of x: ``x * scale`` where the draw is ``>= THRESHOLD``, else 0. ``SCALE_BITS``: the float64
    scale's bits (a float argument would arrive as float32)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = i < N
    g = (i // RUN) * STRIDE + OFFSET + i % RUN
    ctr = g >> 2
    key = tl.load(key_ptr)
    k0 = key.to(tl.uint32)
    k1 = (key >> 32).to(tl.uint32)
    c0 = ctr.to(tl.uint32)
    c1 = (ctr >> 32).to(tl.uint32)
    c2 = (ctr * 0 + STREAM).to(tl.uint32)
    c3 = (ctr * 0 + TAG).to(tl.uint32)
    for _ in tl.static_range(10):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_c2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, 0xD2511F53) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    j = g & 3
    word = tl.where(j == 0, c0, tl.where(j == 1, c1, tl.where(j == 2, c2, c3)))
    u = (word >> 8).to(tl.int32)
    if MODE == 0:
        tl.store(out_ptr + i, u, mask=inside)
    else:
        # ``i * 0``, not ``tl.zeros``: tl.zeros is a @jit stdlib function, built interpreted in a process that
        # imported triton with TRITON_INTERPRET=1 (pytest's conftest), and the compiled build cannot call it.
        scale = (i * 0 + SCALE_BITS).to(tl.float64, bitcast=True)
        x = tl.load(x_ptr + i, mask=inside, other=0)
        if F64:
            y = x.to(tl.float64) * scale
        else:
            y = x.to(tl.float32) * scale.to(tl.float32)
        y = tl.where(u >= THRESHOLD, y, 0.0)
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


PHILOX = _build(_philox_kernel, ["N", "RUN", "STRIDE", "OFFSET", "STREAM", "TAG", "THRESHOLD", "SCALE_BITS"])
