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
  with the same arguments, in the input's compute precision, shaped so that torch picks the kernel the global
  call picks: see ``_channels_last_kernel``), so it is torch's map to the last rounding; the
  local output is ``F.interpolate`` along W (H unchanged) and a row gather. Bitwise equal, forward; the
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
- *area*: adaptive average pooling (:func:`halo.nn.pool.halo_adaptive_avg_pool2d`), bitwise.

Not supported (``NotImplementedError``): ``antialias=True``, ``lanczos``, and the 1-d / 3-d modes.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import reroute
from ..comm import CommGroup
from ..exchange import exchange, exchanger_id, like_format
from ..partition import split_offsets
from ..plans import Site, carry, device_tensor, resolve
from ._mesh2d import mesh_layout, mesh_of
from .base import HaloLayer
from .pool import adaptive_pool, check_output_rows
from .registry import converts

__all__ = ["HaloUpsample", "halo_interpolate", "interpolate_2d", "kernel_scales", "row_taps"]

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

    The ramp is shaped so that torch picks the kernel the global call picks (they round differently).
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


def _w_step(t: torch.Tensor, mode: str, align_corners, scale_w: float | None, w_out: int) -> torch.Tensor:
    """Torch's interpolation along W only (H kept: an exact identity in every mode), as in the global op."""
    ac = align_corners if mode in ("bilinear", "bicubic") else None
    if scale_w is None:
        return F.interpolate(t, size=(t.shape[-2], w_out), mode=mode, align_corners=ac)
    return F.interpolate(t, scale_factor=(1.0, scale_w), mode=mode, align_corners=ac,
                         recompute_scale_factor=False)


def _power_of_two_up(ratio: float) -> int:
    """``k`` when ``ratio == 2**-k`` with ``k >= 1`` (upsampling by a power of two), else 0."""
    mant, exp = Fraction(ratio).numerator, Fraction(ratio).denominator
    if mant == 1 and exp > 1 and exp & (exp - 1) == 0:
        return exp.bit_length() - 1
    return 0


def _output_size(n: int, w: int, size, scale_factor, mode: str, align_corners, recompute_scale_factor,
                 op: str) -> tuple[int, int]:
    """``F.interpolate``'s output ``(H, W)`` for an ``n x w`` input, with its argument checks."""
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
    if size is not None:
        out = (int(pair[0]), int(pair[1]))
    else:
        out = (math.floor(n * float(pair[0])), math.floor(w * float(pair[1])))
    if min(out) <= 0:
        raise ValueError(f"{op}: input ({n}, {w}) and output {out} sizes should be greater than 0")
    return out


class InterpPlan(NamedTuple):
    """An interpolation as planned for this rank (see :func:`_interp_plan`); every map is plain data."""

    kind: str  # "plain", "area", "nearest", "pow2" or "taps"
    ex: int = -1
    rows: int = 0  # extended rows received
    m: int = 0
    w_out: int = 0
    scale_h: float | None = None
    scale_w: float | None = None
    out: int = 0  # this rank's output rows
    local: tuple = ()  # nearest: local row map; taps: per tap, the local rows
    weights: tuple = ()  # taps: per tap, the weights of this rank's output rows
    gather_first: bool = False  # nearest: select rows before the W step (fewer rows than received)
    k: int = 0  # pow2: upsampling by 2**k
    pad: int = 0  # pow2: zero rows added so that torch picks the global call's kernel (< 0: before the rows)
    start: int = 0  # pow2: first kept output row of the local op


def _interp_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], shape: tuple[int, ...], size: Any,
                 scale_factor: Any, mode: str, align_corners: Any, recompute_scale_factor: Any, dtype: torch.dtype,
                 device_type: str, layout: tuple[int, bool, bool], op: str) -> InterpPlan:
    """Everything an interpolation call needs, from the agreed extents: output size, the rows to receive, the row
    maps and weights (read off torch once per plan, on the input's device type: no scalar reads per call)."""
    if len(shape) != 4:  # here, after the agreement (the number of dims is agreed): on every rank alike
        raise ValueError(f"{op}: expected a (B, C, H, W) shard sharded along H, got shape {shape}")
    (sizes,) = extents
    if cg.size == 1:
        return InterpPlan("plain")
    n = sum(sizes)
    m, w_out = _output_size(n, shape[-1], size, scale_factor, mode, align_corners, recompute_scale_factor, op)
    check_output_rows(op, m, n, cg.size, f", mode {mode!r}, size {size}, scale_factor {scale_factor}")
    if mode == "area":
        return InterpPlan("area", m=m, w_out=w_out)
    scale_h, scale_w = kernel_scales(size, scale_factor, recompute_scale_factor)
    offs = split_offsets(m, cg.size)
    o0, o1 = offs[cg.index], offs[cg.index + 1]
    opmath = _opmath(dtype)
    global_cl = _channels_last_kernel(mode, layout, m, w_out)

    def plan(kind: str, needs: list[tuple[int, int]], **fields: Any) -> InterpPlan:
        lo, hi = needs[cg.index]
        ex = exchanger_id(cg, len(shape) - 2, sizes, needs, "zeros", op)
        return InterpPlan(kind, ex, hi - lo, m, w_out, scale_h, scale_w, o1 - o0, **fields)

    if mode in ("nearest", "nearest-exact"):
        size_kwargs = ((("size", (m, 1)),) if scale_h is None
                       else (("scale_factor", (scale_h, 1.0)), ("recompute_scale_factor", False)))
        rows = _nearest_rows(n, m, size_kwargs, mode, global_cl, opmath, torch.device(device_type)).tolist()
        needs = [(rows[offs[r]], rows[offs[r + 1] - 1] + 1) for r in range(cg.size)]
        local = tuple(r - rows[o0] for r in rows[o0:o1])
        return plan("nearest", needs, local=local, gather_first=needs[cg.index][1] - needs[cg.index][0] > o1 - o0)

    ac = bool(align_corners)
    k = 0 if ac or mode != "bilinear" else _power_of_two_up(_kernel_ratio(n, m, scale_h, False, opmath))
    if k and m == n << k:
        # Bilinear upsampling by 2**k (align_corners=False): torch's op on the received rows, then a crop. Output
        # row o reads rows i0(o) = max(0, floor((2o + 1 - 2**k) / 2**(k+1))) and i0 + 1; every step of
        # (o + 0.5) * 2**-k - 0.5 is exact, so on rows starting at lo local output j is global output j + lo * 2**k
        # with the same rows, weights and arithmetic (the clamps at 0 and N - 1 only act where lo = 0 or hi = N,
        # i.e. where the local edge is the global one).
        def first(o: int) -> int:
            return max(0, (2 * o + 1 - (1 << k)) >> (k + 1))

        needs = [(first(offs[r]), min(n, first(offs[r + 1] - 1) + 2)) for r in range(cg.size)]
        lo, hi = needs[cg.index]
        shift, rows_out, pad = lo << k, (hi - lo) << k, 0
        if not global_cl and _channels_last_kernel("bilinear", layout, rows_out, w_out) and (lo, hi) != (0, n):
            # A short local output would get torch's other kernel (another rounding): add zero rows on a side
            # no kept output reads (below the shard on the first rank, above it elsewhere) until it is not.
            extra = max(1, -(-(129 - w_out - rows_out) >> k))
            pad = extra if lo == 0 else -extra
            shift = shift if lo == 0 else shift - (extra << k)
        return plan("pow2", needs, k=k, pad=pad, start=o0 - shift)

    rows_t, weights_t = row_taps(n, m, scale_h, mode, ac, dtype)
    rows, weights = rows_t.tolist(), weights_t.tolist()  # plain data (floats hold every dtype's values exactly)
    needs = [(min(min(r) for r in rows[offs[q]:offs[q + 1]]), max(max(r) for r in rows[offs[q]:offs[q + 1]]) + 1)
             for q in range(cg.size)]
    lo = needs[cg.index][0]
    taps = len(rows[0])
    local = tuple(tuple(rows[o][j] - lo for o in range(o0, o1)) for j in range(taps))
    wts = tuple(tuple(weights[o][j] for o in range(o0, o1)) for j in range(taps))
    return plan("taps", needs, local=local, weights=wts)


def halo_interpolate(x: torch.Tensor, size=None, scale_factor=None, mode: str = "nearest",
                     align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                     antialias: bool = False, *, group: Any | None = None, site: Site | None = None) -> torch.Tensor:
    """``F.interpolate`` of the global field, computed on its H-shards (see the module docstring).

    Args are ``F.interpolate``'s, for a ``(B, C, H, W)`` shard; ``group``: the domain group along H (default:
    the initialised manager's). Returns this rank's rows of the output: the balanced split of its height.
    """
    op = "halo_interpolate"
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(f"{op}: mode {mode!r} is not implemented for (B, C, H, W) fields sharded "
                                  f"along H; supported: {', '.join(SUPPORTED_MODES)}")
    if antialias:
        raise NotImplementedError(f"{op}: antialias=True is not implemented (its windows widen with the "
                                  f"downsampling factor); use antialias=False")
    size_arg = tuple(size) if isinstance(size, list) else size
    scale_arg = tuple(scale_factor) if isinstance(scale_factor, list) else scale_factor
    layout = (int(x.shape[1]) if x.dim() > 1 else 0, x.dim() == 4 and _is_channels_last(x), _one_thread())
    p = resolve(x, group, op, _interp_plan, (tuple(x.shape), size_arg, scale_arg, mode, align_corners,
                                              recompute_scale_factor, x.dtype, x.device.type, layout, op), site=site)
    if p.kind == "plain":
        return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    if p.kind == "area":
        return adaptive_pool(x, (p.m, p.w_out), group, op, False, False, site)
    ext = exchange(x, p.ex, p.rows, 2)
    if _is_channels_last(x):
        ext = ext.contiguous(memory_format=torch.channels_last)
    if p.kind == "nearest":
        local = device_tensor(p.local, torch.int64, x.device)
        if p.gather_first:
            out = _w_step(ext.index_select(-2, local), mode, None, p.scale_w, p.w_out)
        else:
            out = _w_step(ext, mode, None, p.scale_w, p.w_out).index_select(-2, local)
    elif p.kind == "pow2":
        if p.pad:
            zeros = ext.new_zeros((*ext.shape[:-2], abs(p.pad), ext.shape[-1]))
            ext = torch.cat([ext, zeros] if p.pad > 0 else [zeros, ext], dim=-2)
        if p.scale_h is None:
            up = F.interpolate(ext, size=(ext.shape[-2] << p.k, p.w_out), mode="bilinear", align_corners=False)
        else:
            up = F.interpolate(ext, scale_factor=(p.scale_h, p.scale_w), mode="bilinear", align_corners=False,
                               recompute_scale_factor=False)
        out = up.narrow(-2, p.start, p.out)
    else:
        opmath = _opmath(x.dtype)
        t = _w_step(ext, mode, bool(align_corners), p.scale_w, p.w_out)
        if t.dtype != opmath:
            t = t.to(opmath)
        out = None
        for rows, wts in zip(p.local, p.weights, strict=True):
            term = t.index_select(-2, device_tensor(rows, torch.int64, x.device)) \
                * device_tensor(wts, opmath, x.device).unsqueeze(-1)
            out = term if out is None else out + term
        out = out.to(x.dtype)
    out = like_format(out, x)  # channels_last in, channels_last out (as F.interpolate)
    carry(out, x)
    return out


def _per_axis(v: Any) -> tuple[Any, Any]:
    if v is None:
        return None, None
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"interpolate_2d: expected one value or two (H, W), got {v!r}")
        return v[0], v[1]
    return v, v


def interpolate_2d(x: torch.Tensor, mesh: Any, size=None, scale_factor=None, mode: str = "nearest",
                   align_corners: bool | None = None, recompute_scale_factor: bool | None = None, *,
                   sites: tuple[Site | None, Site | None] = (None, None)) -> torch.Tensor:
    """``F.interpolate`` of a field sharded over a latitude x longitude mesh, as two one-axis passes.

    The modes are separable: H is resized first (over the mesh's H group, W kept: scale 1 along W is torch's
    identity map), then W (the transposed block, over the W group). Each pass is :func:`halo_interpolate`, exact
    on its axis; the result equals the one-call 2-d interpolation but for the order of the weighted sums (nearest:
    bitwise; bilinear / bicubic / area: within a few ulps).
    """
    if x.dim() != 4:
        raise ValueError(f"interpolate_2d: expected a (B, C, H, W) block, got shape {tuple(x.shape)}")
    (size_h, size_w), (scale_h, scale_w) = _per_axis(size), _per_axis(scale_factor)
    groups = mesh_layout(mesh)[1]

    def one_pass(t: torch.Tensor, n_out: Any, scale: Any, group: Any, site: Site | None) -> torch.Tensor:
        if n_out is not None:
            return halo_interpolate(t, (int(n_out), t.shape[-1]), None, mode, align_corners, recompute_scale_factor,
                                    group=group, site=site)
        return halo_interpolate(t, None, (float(scale), 1.0), mode, align_corners, recompute_scale_factor,
                                group=group, site=site)

    y = one_pass(x, size_h, scale_h, groups[0], sites[0])
    y = one_pass(y.transpose(-1, -2).contiguous(), size_w, scale_w, groups[1], sites[1])
    return y.transpose(-1, -2)


@converts(nn.Upsample, axes=2, mesh_ok=lambda m: m.mode in ("nearest", "nearest-exact", "bilinear", "bicubic", "area"))
class HaloUpsample(HaloLayer, nn.Upsample):
    """``nn.Upsample`` on an H-sharded field (same arguments and ``repr``; no state): see :func:`halo_interpolate`.

    On a latitude x longitude mesh the resize is two one-axis passes (H, then W on the transposed block), each with
    a site of its own: the W pass's input is the H pass's output, so its plan cannot be agreed with the H one."""

    def __init__(self, up: nn.Upsample, *, group: Any | None = None, mesh: Any | None = None) -> None:
        if not isinstance(up, nn.Upsample):
            raise TypeError(f"HaloUpsample wraps an nn.Upsample, got {type(up).__name__}")
        super().__init__(up.size, up.scale_factor, up.mode, up.align_corners, up.recompute_scale_factor)
        self.halo_init(group, mesh)
        self._halo_site_w = Site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = mesh_of(self)
        if mesh is not None:
            return interpolate_2d(x, mesh, self.size, self.scale_factor, self.mode, self.align_corners,
                                  self.recompute_scale_factor, sites=(self._halo_site, self._halo_site_w))
        return halo_interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                                self.recompute_scale_factor, group=self.group, site=self._halo_site)


reroute.provide(interpolate=halo_interpolate, interpolate_modes=SUPPORTED_MODES)  # F.interpolate in users' forward
