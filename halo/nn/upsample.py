"""Domain-parallel interpolation of an H-sharded field: ``F.interpolate`` of the global field, on its shards.

Output height ``M`` is torch's (``size``, or ``floor(N * scale)``, with ``F.interpolate``'s argument checks);
rank ``r`` produces rows ``[o0, o1)``, the balanced split of ``M``. Output row ``o`` reads
input rows through torch's coordinate map (``UpSample.h``), with ``r`` the kernel scale: ``1/scale_factor``
when a scale factor reaches the kernel (given and ``recompute_scale_factor`` falsy), else ``N/M``::

    nearest          i = min(floor(o * r), N-1)                 (M == N: o;  M == 2N: o >> 1)
    nearest-exact    i = min(floor((o + 0.5) * r), N-1)
    bilinear         src = max(0, (o + 0.5) * r - 0.5)  or  o * (N-1)/(M-1) (align_corners)
                     rows i0 = min(floor(src), N-1), i0 + (i0 < N-1);  weights 1 - l, l = src - i0
    bicubic          src as bilinear without the clamp at 0; rows i-1 .. i+2 clamped to [0, N-1]

Each rank receives the input rows its outputs read (rows of the global field only: the maps clamp at the
edges), then, by mode:

- *nearest, nearest-exact*: the row map is read off torch itself (``F.interpolate`` of a ``0..N-1`` ramp
  with the same arguments, in the input's compute precision, once shaped for each of torch's two CPU kernels,
  which round apart; the forward takes the map of the kernel the global call picks: see
  ``_channels_last_kernel``), so it is torch's map to the last rounding; the local output is ``F.interpolate``
  along W (H unchanged) and a row gather. Bitwise equal, forward; the
  backward adds the gradients of repeated rows in another order than torch's kernel (float64 ~1e-16).
- *bilinear, upsampling by 2**k, align_corners=False*: torch's op on the received rows, then a crop. The map
  is shift-invariant in exact binary arithmetic (``r = 2**-k``): the local op computes the same rows, weights
  and arithmetic as the global one (a short local output gets a few zero rows that no kept output reads, so
  that torch picks the same kernel as for the global output). Bitwise equal, forward.
- *bilinear otherwise, bicubic*: torch's op along W (H unchanged, exact), then the rows combined with torch's
  weights, computed here as torch computes them (compute precision, ``floorf``, and ``(o + 0.5) * r - 0.5``
  as one fused multiply-add, which is how torch's CPU kernels are compiled). Bilinear weights agree with
  torch's bitwise, bicubic ones within a few ulps (torch's kernel fuses the cubic polynomials its own way);
  the combination ``t0*w0 + t1*w1 (+ ...)`` is rounded once more per term than torch's fused, vectorised
  kernel, so results differ from the unsharded op by a few ulps (measured: float64 < 2e-15 relative,
  float32 < 1e-6; bf16 / fp16 1-2 ulps, as the W pass is rounded to the dtype where torch keeps float).
  Bitwise here would need torch's kernel itself on global coordinates.
- *area*: adaptive average pooling: each output row is torch's op on exactly its window of rows, bitwise.

The plan is one :class:`InterpPlan` per sharded axis (:func:`halo.nn.base.run_axes`: H on latitude rows; H and W
on a latitude x longitude mesh), learned in one agreement: a separable resize's plan along an axis depends only on
that axis's input extents (the W extents of the H step's output are the input's). The forward loops over the
plans: exchange along the axis, interpolate along it alone (the other axis's scale 1 / size unchanged, torch's
identity map), crop. W whole on every rank (latitude rows) is resized in the H step's own torch call, as above; on
a mesh the two steps differ from the one-call 2-d op by the order of the weighted sums (nearest: bitwise; the
linear modes and area: a few ulps).

Not supported (``NotImplementedError``): ``antialias=True``, ``lanczos``, and the 1-d / 3-d modes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import cast_as_torch
from ..dist.comm import CommGroup
from ..dist.mesh import DomainMesh
from ..exchange import exchanger_id
from ..plan.geometry import adaptive_plan, adaptive_starts_ends, check_output_rows
from ..plan.partition import split_offsets
from ..plan.plans import Site, device_tensor
from .base import AxisPlan, DomainLayer, exchange_axes, finish, run_axes
from .registry import converts, public

__all__ = ["DomainUpsample", "halo_interpolate", "interpolate_2d", "kernel_scales", "row_taps"]

SUPPORTED_MODES = ("nearest", "nearest-exact", "bilinear", "bicubic", "area")


def kernel_scales(size, scale_factor, recompute_scale_factor) -> tuple[float | None, float | None]:
    """The ``(H, W)`` scale factors ``F.interpolate`` hands to the kernel (``None``: the kernel uses sizes)."""
    if size is not None or scale_factor is None or recompute_scale_factor:
        return None, None
    if isinstance(scale_factor, (list, tuple)):
        return float(scale_factor[0]), float(scale_factor[1])
    return float(scale_factor), float(scale_factor)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kernel_ratio(n: int, m: int, scale: float | None, align_corners: bool, opmath: torch.dtype) -> float:
    """``area_pixel_compute_scale`` in the compute precision (returned as a Python float holding that value)."""
    if align_corners:
        value = (torch.tensor(float(n - 1), dtype=opmath) / (m - 1)) if m > 1 else torch.zeros((), dtype=opmath)
    elif scale is not None and scale > 0:
        value = torch.tensor(1.0 / scale, dtype=torch.float64).to(opmath)
    else:
        value = torch.tensor(float(n), dtype=opmath) / m
    return float(value)


def _half_pixel_source(m: int, ratio: float, opmath: torch.dtype) -> torch.Tensor:
    """``(o + 0.5) * ratio - 0.5`` for ``o < m`` as one fused multiply-add, rounded once to ``opmath``."""
    if opmath == torch.float32:
        # A product of two floats is exact in double, and so is adding -0.5 unless the product is below
        # 2**-5 (then src < 0: clamped to 0 for bilinear): one rounding to float, as the fused op does.
        half = torch.arange(m, dtype=torch.float32) + 0.5
        return (half.double() * ratio - 0.5).float()
    r = Fraction(ratio)
    return torch.tensor([float((Fraction(2 * o + 1, 2)) * r - Fraction(1, 2)) for o in range(m)],
                        dtype=torch.float64)


@functools.lru_cache(maxsize=256)
def row_taps(n: int, m: int, scale: float | None, mode: str, align_corners: bool,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's H map of a linear or cubic mode: ``(rows (m, T) int64, weights (m, T) in dtype)``, CPU."""
    opmath = _opmath(dtype)
    cubic = mode == "bicubic"
    o = torch.arange(m, dtype=opmath)
    if not cubic and m == n:  # compute_source_index_and_lambda: "scale_factor = 1, simply copy"
        rows = torch.arange(m).unsqueeze(1).repeat(1, 2)
        weights = torch.stack([torch.ones(m, dtype=dtype), torch.zeros(m, dtype=dtype)], dim=1)
        return rows, weights
    ratio = _kernel_ratio(n, m, scale, align_corners, opmath)
    if align_corners:
        src = torch.tensor(ratio, dtype=opmath) * o
    else:
        src = _half_pixel_source(m, ratio, opmath)
        if not cubic:
            src = torch.where(src < 0, torch.zeros_like(src), src)
    # guard_index_and_lambda: floorf (the source index goes through float), then the clamped remainder.
    i0 = torch.clamp(src.float().floor().to(torch.int64), max=n - 1)
    lam = torch.clamp(src - i0.to(opmath), 0, 1)
    if not cubic:
        lam1 = lam.to(dtype)
        lam0 = 1 - lam1
        rows = torch.stack([i0, i0 + (i0 < n - 1).to(torch.int64)], dim=1)
        return rows, torch.stack([lam0, lam1], dim=1)
    a = -0.75

    def conv1(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def conv2(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    x2 = 1.0 - lam
    weights = torch.stack([conv2(lam + 1.0), conv1(lam), conv1(x2), conv2(x2 + 1.0)], dim=1).to(dtype)
    rows = torch.clamp(i0.unsqueeze(1) + torch.arange(-1, 3), 0, n - 1)
    return rows, weights


def _channels_last_kernel(mode: str, layout: tuple[int, bool, bool], rows_out: int, w_out: int) -> bool:
    """Whether torch's CPU kernel for an output of ``rows_out x w_out`` is its channels-last one.

    ``layout``: the input's ``(channels, is channels_last, torch runs one thread)``. ``UpSampleKernel.cpp``
    (``_use_channels_last_kernel_2d``) picks that kernel for channels-last inputs with more than 3 channels, for
    outputs with ``H + W <= 128``, and for bilinear with one thread and 3 channels. The two kernels compute the
    same map with different roundings (the nearest one even with another precision), so a local call is made to
    pick the kernel the global call picks.
    """
    channels, channels_last, one_thread = layout
    return ((channels_last and channels > 3) or rows_out + w_out <= 128
            or (mode == "bilinear" and channels == 3 and one_thread))


@torch._dynamo.assume_constant_result
def _one_thread() -> bool:
    """Whether torch runs one intra-op thread (read at trace time under ``torch.compile``)."""
    return torch.get_num_threads() == 1


def _is_channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


@functools.lru_cache(maxsize=256)
def _nearest_rows(n: int, m: int, size_kwargs: tuple, mode: str, channels_last_kernel: bool,
                  opmath: torch.dtype, device: torch.device) -> torch.Tensor:
    """Torch's nearest row map, read off torch: the interpolated ramp ``0..n-1`` holds the source rows.

    The ramp is shaped so that torch runs the kernel asked for (``channels_last_kernel``: they round differently;
    the forward uses the map of the kernel the global call runs).
    """
    ramp = torch.arange(n, dtype=opmath, device=device)
    if channels_last_kernel:  # 4 channels, channels-last: that kernel whatever the output size
        ramp = ramp.view(1, 1, n, 1).expand(1, 4, n, 1).contiguous(memory_format=torch.channels_last)
        width = 1
    else:  # one channel, wide enough that H + W > 128: the generic kernel
        width = max(1, 129 - m)
        ramp = ramp.view(1, 1, n, 1).expand(1, 1, n, width).contiguous()
    kwargs = dict(size_kwargs)
    if "size" in kwargs:
        kwargs["size"] = (m, width)
    out = F.interpolate(ramp, mode=mode, **kwargs)
    if out.shape[-2] != m:
        raise RuntimeError(f"nearest row map: expected {m} rows, torch made {out.shape[-2]}")
    return out[0, 0, :, 0].to(torch.int64)


def _along(t: torch.Tensor, dim: int, m: int, scale: float | None, mode: str, align_corners: Any) -> torch.Tensor:
    """Torch's interpolation along ``dim`` alone, to ``m`` (the other axis kept: an exact identity in every mode), as
    the global op calls it: by ``scale`` when one reaches the kernel, else by size."""
    ac = align_corners if mode in ("bilinear", "bicubic") else None
    h = t.dim() - 2
    if scale is None:
        size = (m, t.shape[-1]) if dim == h else (t.shape[-2], m)
        return F.interpolate(t, size=size, mode=mode, align_corners=ac)
    return F.interpolate(t, scale_factor=(scale, 1.0) if dim == h else (1.0, scale), mode=mode, align_corners=ac,
                         recompute_scale_factor=False)


def _power_of_two_up(ratio: float) -> int:
    """``k`` when ``ratio == 2**-k`` with ``k >= 1`` (upsampling by a power of two), else 0."""
    mant, exp = Fraction(ratio).numerator, Fraction(ratio).denominator
    if mant == 1 and exp > 1 and exp & (exp - 1) == 0:
        return exp.bit_length() - 1
    return 0


def _axis_output(n: int, axis: int, size: Any, scale_factor: Any, mode: str, align_corners: Any,
                 recompute_scale_factor: Any, op: str) -> tuple[int, float | None]:
    """``F.interpolate``'s output extent along ``axis`` (0: H, 1: W) of an input with ``n`` along it, and the scale
    its kernel uses along it (``None``: sizes), with ``F.interpolate``'s argument checks."""
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{op}: exactly one of size or scale_factor should be defined, got size={size}, "
                         f"scale_factor={scale_factor}")
    if size is not None and recompute_scale_factor:
        raise ValueError(f"{op}: recompute_scale_factor is not meaningful with an explicit size")
    if align_corners is not None and mode in ("nearest", "nearest-exact", "area"):
        raise ValueError(f"{op}: align_corners option can only be set with the interpolating modes: "
                         f"linear | bilinear | bicubic | trilinear")
    given = size if size is not None else scale_factor
    pair = tuple(given) if isinstance(given, (list, tuple)) else (given, given)
    if len(pair) != 2:
        raise ValueError(f"{op}: a (B, C, H, W) input needs 2 output sizes or scale factors, got {given}")
    m = int(pair[axis]) if size is not None else math.floor(n * float(pair[axis]))
    if m <= 0:
        raise ValueError(f"{op}: input and output sizes should be greater than 0, got {n} -> {m} along "
                         f"{'HW'[axis]} (size {size}, scale_factor {scale_factor})")
    return m, kernel_scales(size, scale_factor, recompute_scale_factor)[axis]


@dataclasses.dataclass(frozen=True)
class InterpPlan(AxisPlan):
    """One axis of an interpolation as planned for this rank (:func:`_interp_axis`); every map is plain data.

    ``kind``: ``"plain"`` (one rank along the axis: torch's op along it), ``"area"``, ``"nearest"``, ``"pow2"`` or
    ``"taps"``. ``n`` / ``m``: the global input / output extents along the axis; ``scale``: the kernel's scale along
    it (``None``: the kernel uses sizes); ``out``: this rank's output rows along it."""

    kind: str = "plain"
    n: int = 0
    m: int = 0
    scale: float | None = None
    out: int = 0
    local: tuple = ()  # nearest: the local row map (torch's generic kernel); taps: per tap, the local rows;
    #                    area: per output row, its window (local start, length)
    local_cl: tuple = ()  # nearest: the local row map of torch's channels-last kernel (the kernels round apart)
    weights: tuple = ()  # taps: per tap, the weights of this rank's output rows
    k: int = 0  # pow2: upsampling by 2**k
    lo: int = 0  # pow2: the first input row received
    o0: int = 0  # pow2: this rank's first output row


def _interp_axis(cg: CommGroup, sizes: tuple[int, ...], dim: int, axis: int, size: Any, scale_factor: Any, mode: str,
                 align_corners: Any, recompute_scale_factor: Any, dtype: torch.dtype, device_type: str,
                 op: str) -> InterpPlan:
    """The geometry of one axis (H rows, or W columns on a mesh: ``axis`` 0 or 1, ``dim`` its tensor dim), from the
    agreed extents ``sizes`` of the ranks along it: output extent, the rows each rank receives, the row maps and
    weights (read off torch once per plan, on the input's device type: no scalar reads per call). A separable
    resize along an axis depends on that axis's extents alone, so both axes of a mesh are planned in one agreement.
    """
    if dim != 2 + axis:  # here, after the agreement (the number of dims is agreed): on every rank alike
        raise ValueError(f"{op}: expected a (B, C, H, W) shard sharded along H, got a {dim + 2 - axis}-d one")
    n = sum(sizes)
    m, scale = _axis_output(n, axis, size, scale_factor, mode, align_corners, recompute_scale_factor, op)
    if cg.size == 1:
        return InterpPlan(True, dim=dim, n=n, m=m, scale=scale)
    check_output_rows(op, m, n, cg.size, f", mode {mode!r}, size {size}, scale_factor {scale_factor}")
    offs = split_offsets(m, cg.size)
    o0, o1 = offs[cg.index], offs[cg.index + 1]
    opmath = _opmath(dtype)

    def plan(kind: str, needs: Any, **fields: Any) -> InterpPlan:
        lo, hi = needs[cg.index]
        ex = exchanger_id(cg, dim, sizes, tuple(needs), "zeros", op)
        return InterpPlan(False, ex, hi - lo, dim, kind=kind, n=n, m=m, scale=scale, out=o1 - o0, **fields)

    if mode == "area":  # adaptive average pooling: output row o averages rows [floor(o n / m), ceil((o + 1) n / m))
        per_rank = adaptive_plan(n, m, cg.size)
        starts, ends = adaptive_starts_ends(n, m)
        lo = per_rank[cg.index][0]
        return plan("area", [(a, b) for a, b, _, _ in per_rank],
                    local=tuple((starts[o] - lo, ends[o] - starts[o]) for o in range(o0, o1)))

    if mode in ("nearest", "nearest-exact"):
        # Torch's two kernels may round the map apart; which one the global call runs depends on both axes' output
        # extents, so both maps are kept and the forward picks (the rows received cover both).
        size_kwargs = ((("size", (m, 1)),) if scale is None
                       else (("scale_factor", (scale, 1.0)), ("recompute_scale_factor", False)))
        maps = [_nearest_rows(n, m, size_kwargs, mode, cl, opmath, torch.device(device_type)).tolist()
                for cl in (False, True)]
        needs = [(min(mp[offs[r]] for mp in maps), max(mp[offs[r + 1] - 1] for mp in maps) + 1)
                 for r in range(cg.size)]
        lo = needs[cg.index][0]
        local, local_cl = (tuple(i - lo for i in mp[o0:o1]) for mp in maps)
        return plan("nearest", needs, local=local, local_cl=local_cl)

    ac = bool(align_corners)
    k = 0 if ac or mode != "bilinear" else _power_of_two_up(_kernel_ratio(n, m, scale, False, opmath))
    if k and m == n << k:
        # Bilinear upsampling by 2**k (align_corners=False): torch's op on the received rows, then a crop. Output
        # row o reads rows i0(o) = max(0, floor((2o + 1 - 2**k) / 2**(k+1))) and i0 + 1; every step of
        # (o + 0.5) * 2**-k - 0.5 is exact, so on rows starting at lo local output j is global output j + lo * 2**k
        # with the same rows, weights and arithmetic (the clamps at 0 and N - 1 only act where lo = 0 or hi = N,
        # i.e. where the local edge is the global one).
        def first(o: int) -> int:
            return max(0, (2 * o + 1 - (1 << k)) >> (k + 1))

        needs = [(first(offs[r]), min(n, first(offs[r + 1] - 1) + 2)) for r in range(cg.size)]
        return plan("pow2", needs, k=k, lo=needs[cg.index][0], o0=o0)

    rows_t, weights_t = row_taps(n, m, scale, mode, ac, dtype)
    rows, weights = rows_t.tolist(), weights_t.tolist()  # plain data (floats hold every dtype's values exactly)
    needs = [(min(min(r) for r in rows[offs[q]:offs[q + 1]]), max(max(r) for r in rows[offs[q]:offs[q + 1]]) + 1)
             for q in range(cg.size)]
    lo = needs[cg.index][0]
    taps = len(rows[0])
    local = tuple(tuple(rows[o][j] - lo for o in range(o0, o1)) for j in range(taps))
    wts = tuple(tuple(weights[o][j] for o in range(o0, o1)) for j in range(taps))
    return plan("taps", needs, local=local, weights=wts)


def _pow2_pad(p: InterpPlan, global_cl: bool, layout: tuple[int, bool, bool], other: int) -> tuple[int, int]:
    """A pow2 step's zero rows (``> 0`` after the received rows, ``< 0`` before) and its first kept output row.

    A short local output would get torch's other kernel (another rounding) than the global call: zero rows are
    added on a side no kept output reads (below the shard on the first rank, above it elsewhere) until it does not.
    ``other``: the local op's output extent along the other axis."""
    shift, rows_out = p.lo << p.k, p.rows << p.k
    if global_cl or not _channels_last_kernel("bilinear", layout, rows_out, other) or (p.lo, p.lo + p.rows) == (0, p.n):
        return 0, p.o0 - shift
    extra = max(1, -(-(129 - other - rows_out) >> p.k))
    if p.lo == 0:
        return extra, p.o0 - shift
    return -extra, p.o0 - shift + (extra << p.k)


def _nearest_step(ext: torch.Tensor, p: InterpPlan, whole: tuple, mode: str, global_cl: bool) -> torch.Tensor:
    """Torch's rows (the map of the kernel the global call runs) gathered; a whole W resized by torch."""
    local = device_tensor(p.local_cl if global_cl else p.local, torch.int64, ext.device)
    if not whole:
        return ext.index_select(p.dim, local)
    ((m, scale),) = whole
    if p.out < p.rows:  # fewer rows kept than received: select them before the W step
        return _along(ext.index_select(p.dim, local), ext.dim() - 1, m, scale, mode, None)
    return _along(ext, ext.dim() - 1, m, scale, mode, None).index_select(p.dim, local)


def _pow2_step(ext: torch.Tensor, p: InterpPlan, whole: tuple, global_cl: bool,
               layout: tuple[int, bool, bool]) -> torch.Tensor:
    """Torch's bilinear op on the received rows (and a whole W in the same call), then this rank's rows."""
    h = ext.dim() - 2
    axis = p.dim - h
    sizes, scales = [int(ext.shape[-2]), int(ext.shape[-1])], [1.0, 1.0]
    for m, scale in whole:  # W whole on every rank: resized in the same call, as the global op does
        sizes[1], scales[1] = m, scale
    pad, start = _pow2_pad(p, global_cl, layout, sizes[1 - axis])
    if pad:
        shape = list(ext.shape)
        shape[p.dim] = abs(pad)
        zeros = ext.new_zeros(shape)
        ext = torch.cat([ext, zeros] if pad > 0 else [zeros, ext], dim=p.dim)
    if p.scale is None:
        sizes[axis] = int(ext.shape[p.dim]) << p.k
        up = F.interpolate(ext, size=tuple(sizes), mode="bilinear", align_corners=False)
    else:
        scales[axis] = p.scale
        up = F.interpolate(ext, scale_factor=tuple(scales), mode="bilinear", align_corners=False,
                           recompute_scale_factor=False)
    return up.narrow(p.dim, start, p.out)


def _taps_step(ext: torch.Tensor, p: InterpPlan, whole: tuple, mode: str, align_corners: Any,
               dtype: torch.dtype) -> torch.Tensor:
    """A whole W resized by torch (exact), then the received rows combined with torch's weights, in the compute
    precision (module docstring)."""
    opmath = _opmath(dtype)
    t = ext
    for m, scale in whole:
        t = _along(t, t.dim() - 1, m, scale, mode, bool(align_corners))
    if t.dtype != opmath:
        t = t.to(opmath)
    shape = (-1,) + (1,) * (t.dim() - 1 - p.dim)  # the weights broadcast along the axis
    out = None
    for rows, wts in zip(p.local, p.weights, strict=True):
        term = t.index_select(p.dim, device_tensor(rows, torch.int64, t.device)) \
            * device_tensor(wts, opmath, t.device).view(shape)
        out = term if out is None else out + term
    return out.to(dtype)


def _area_step(ext: torch.Tensor, p: InterpPlan, whole: tuple) -> torch.Tensor:
    """Each output row pools exactly its window of the received rows: torch's op on it with output extent 1 along
    the axis (a whole W pooled in the same call, the other axis kept otherwise) is the same window, summed in the
    same order as on the full field. The aten op itself: ``F.adaptive_avg_pool2d`` turns a (1, 1) output into a
    mean (another sum order)."""
    out_hw = [int(ext.shape[-2]), int(ext.shape[-1])]
    out_hw[p.dim - (ext.dim() - 2)] = 1
    for m, _ in whole:
        out_hw[1] = m
    parts = [torch.ops.aten._adaptive_avg_pool2d(ext.narrow(p.dim, start, length), out_hw)
             for start, length in p.local]
    return torch.cat(parts, dim=p.dim)


def _axis_step(t: torch.Tensor, p: InterpPlan, whole: tuple, mode: str, align_corners: Any, global_cl: bool,
               layout: tuple[int, bool, bool]) -> torch.Tensor:
    """One axis of the resize: its rows exchanged, resized along it alone (``whole``: the axes no plan covers, W on
    latitude rows, resized in the same torch call), this rank's rows kept. One rank along the axis: torch's op."""
    if p.plain:  # on a mesh (on latitude rows one rank along H is the op itself): ``whole`` is empty
        return _along(t, p.dim, p.m, p.scale, mode, align_corners)
    ext = exchange_axes(t, (p,))
    if p.kind == "area":
        return _area_step(ext, p, whole)
    if layout[1]:
        ext = ext.contiguous(memory_format=torch.channels_last)
    if p.kind == "nearest":
        return _nearest_step(ext, p, whole, mode, global_cl)
    if p.kind == "pow2":
        return _pow2_step(ext, p, whole, global_cl, layout)
    return _taps_step(ext, p, whole, mode, align_corners, t.dtype)


def _resize(x: torch.Tensor, size: Any, scale_factor: Any, mode: str, align_corners: Any, recompute_scale_factor: Any,
            antialias: bool, group: Any | None, mesh: DomainMesh | None, site: Site | None, op: str) -> torch.Tensor:
    """The interpolation on latitude rows of ``group`` or on a block of ``mesh``: one agreement plans every axis
    (:func:`halo.nn.base.run_axes`), then each axis in turn is exchanged, resized along it and cropped."""
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(f"{op}: mode {mode!r} is not implemented for (B, C, H, W) fields sharded "
                                  f"along H; supported: {', '.join(SUPPORTED_MODES)}")
    if antialias:
        raise NotImplementedError(f"{op}: antialias=True is not implemented (its windows widen with the "
                                  f"downsampling factor); use antialias=False")
    x = cast_as_torch("interpolate", x, mode=mode)  # float32 under CUDA autocast but for 'area' (halo.autocast)
    size_arg = tuple(size) if isinstance(size, list) else size
    scale_arg = tuple(scale_factor) if isinstance(scale_factor, list) else scale_factor
    args = (size_arg, scale_arg, mode, align_corners, recompute_scale_factor)
    plans = run_axes(x, op, _interp_axis, (*args, x.dtype, x.device.type, op), group=group, mesh=mesh, site=site,
                     per_axis=((0,), (1,)))
    if all(p.plain for p in plans):  # one rank along every axis: the op itself
        return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    # The axes no plan covers (W on latitude rows) are whole on every rank: the first step resizes them in its own
    # torch call, as the global op does (which keeps bilinear by 2**k and area bitwise).
    whole = tuple(_axis_output(int(x.shape[2 + a]), a, *args, op) for a in range(len(plans), 2))
    layout = (int(x.shape[1]), _is_channels_last(x), _one_thread())
    global_cl = _channels_last_kernel(mode, layout, *(p.m for p in plans), *(m for m, _ in whole))
    out = x
    for i, p in enumerate(plans):
        out = _axis_step(out, p, whole if i == 0 else (), mode, align_corners, global_cl, layout)
    return finish(out, x)  # channels_last in, channels_last out (as F.interpolate); carrying x's epoch


@public
def halo_interpolate(x: torch.Tensor, size=None, scale_factor=None, mode: str = "nearest",
                     align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                     antialias: bool = False, *, group: Any | None = None, site: Site | None = None) -> torch.Tensor:
    """``F.interpolate`` of the global field, computed on its H-shards (see the module docstring).

    Args are ``F.interpolate``'s, for a ``(B, C, H, W)`` shard; ``group``: the domain group along H (default:
    the initialised manager's). Returns this rank's rows of the output: the balanced split of its height.
    """
    return _resize(x, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias, group, None, site,
                   "halo_interpolate")


def interpolate_2d(x: torch.Tensor, mesh: Any, size=None, scale_factor=None, mode: str = "nearest",
                   align_corners: bool | None = None, recompute_scale_factor: bool | None = None, *,
                   sites: tuple[Site | None, Site | None] = (None, None)) -> torch.Tensor:
    """``F.interpolate`` of a field sharded over a latitude x longitude mesh: :func:`halo_interpolate`'s per-axis
    steps with ``mesh=`` (H resized with W kept, then W with H kept; scale 1 along an axis is torch's identity map),
    planned in one agreement. The result equals the one-call 2-d interpolation but for the order of the weighted
    sums (nearest: bitwise; bilinear / bicubic / area: within a few ulps). ``sites``: the call's site is the first
    (the second, once the W pass's own, is unused: one plan for both axes)."""
    return _resize(x, size, scale_factor, mode, align_corners, recompute_scale_factor, False, None, mesh, sites[0],
                   "interpolate_2d")


@converts(nn.Upsample, axes=2, functional=(F.interpolate,),
          example=lambda kind: (kind(scale_factor=2, mode="bilinear"), (2, 3, 23, 7)),
          mesh_ok=lambda m: m.mode in ("nearest", "nearest-exact", "bilinear", "bicubic", "area"))
class DomainUpsample(DomainLayer, nn.Upsample):
    """``nn.Upsample`` on an H-sharded field (same arguments and ``repr``; no state): see :func:`halo_interpolate`.

    On a latitude x longitude mesh the resize is one step per axis (H with W kept, then W with H kept), both planned
    in one agreement: a separable resize's plan along an axis depends only on that axis's input extents."""

    def __init__(self, up: nn.Upsample, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(up, nn.Upsample):
            raise TypeError(f"DomainUpsample wraps an nn.Upsample, got {type(up).__name__}")
        super().__init__(up.size, up.scale_factor, up.mode, up.align_corners, up.recompute_scale_factor)
        self.halo_init(group, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _resize(x, self.size, self.scale_factor, self.mode, self.align_corners, self.recompute_scale_factor,
                       False, self.group, self.halo_mesh, self._halo_site, "halo_interpolate")


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloUpsample = DomainUpsample
