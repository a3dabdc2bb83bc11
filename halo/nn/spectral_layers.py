"""The users' spectral layers on H-shards, exact: torch-harmonics' SHTs, FFT2s and SFNO spectral conv,
neuraloperator's ``SpectralConv``, FourCastNet's ``AFNO2D``. Each is the third-party module's state adopted (same
attributes and Parameters: ``state_dict`` keys unchanged) with a forward written on the transposes of
:mod:`halo.nn.spectral`.

=============================  ===============================================================================
torch-harmonics ``RealSHT``    ``rfft`` along W on the shard (local), its first ``mmax`` modes to the columns
                               layout ``(..., nlat, m_s)``, the Legendre quadrature over the whole latitude there
                               (this rank's ``m`` slice of the weights), back to the balanced split of the
                               degrees: ``(..., l_r, mmax)`` (a field split along dim -2 like any other).
``InverseRealSHT``             ``(..., l_r, mmax)`` to columns, the Legendre synthesis there, back to the balanced
                               latitude rows, ``irfft`` along W (local).
SFNO ``SpectralConvS2``        SHT to the columns layout, the per-mode contraction there (its ``weight`` sliced
                               to this rank's modes for ``"diagonal"``; whole for ``"driscoll-healy"``: it has no
                               ``m``), inverse SHT from the columns layout: two transposes per call, not four.
torch-harmonics ``RealFFT2``   (its FNO) ``rfft`` along W, the first ``mmax`` modes to columns, ``fft`` along H,
/ ``InverseRealFFT2``          the kept ``lmax`` frequency rows cut there; the inverse likewise backwards.
neuraloperator ``SpectralConv``  2-d, real data: ``rfft`` along W, the kept modes to columns, ``fft`` + ``fftshift``
                               along H there, the module's own contraction (``_contract``) on this rank's modes,
                               its ``fftshift`` and ``ifft`` along H, back to rows, ``irfft`` along W, bias.
FourCastNet ``AFNO2D``         channels-last ``(B, H_r, W, C)``: the kept modes to columns, the block MLP and
                               softshrink per mode there, back (module below).
=============================  ===============================================================================

Parameter gradients are each rank's modes' contribution: summed over the domain group (the gradient sync) they are
the unsharded gradient. What is not covered is refused at conversion or at the first call, on every rank alike:
SFNO's ``"block-diagonal"`` operator (it mixes the ``m`` modes), neuraloperator's 1-d / 3-d forms, complex data,
``output_shape`` / resolution scaling and half precision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..context import place, trusted
from ..dist.comm import CommGroup
from ..plan.partition import split_offsets
from ..plan.plans import carry, resolve
from .base import DomainLayer, adopt
from .registry import public
from .spectral import to_columns, to_rows

__all__ = ["DomainAFNO2D", "DomainInverseRealFFT2", "DomainInverseRealSHT", "DomainRealFFT2", "DomainRealSHT",
           "DomainSpectralConv", "DomainSpectralConvS2", "spectral_adapter"]


@dataclasses.dataclass(frozen=True)
class ModePlan:
    """This rank's columns ``[c0, c1)`` of the ``width`` modes in the columns layout; ``height``: the global rows."""

    height: int
    c0: int
    c1: int


def _mode_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], rows: int, got_w: int, want_w: int,
               width: int, op: str) -> ModePlan:
    """Pure and agreed (every rank raises alike): the global rows and the last dim must be the module's, and the
    ``width`` modes must give every rank at least one column."""
    (sizes,) = extents
    if rows >= 0 and sum(sizes) != rows:
        raise ValueError(f"{op}: expected {rows} rows along dim -2 over the domain group, got {sum(sizes)} "
                         f"(shards {list(sizes)})")
    if got_w != want_w:
        raise ValueError(f"{op}: expected {want_w} along the last dim, got {got_w}")
    if width < cg.size:
        raise ValueError(f"{op}: {width} modes cannot be split over {cg.size} ranks (a rank would hold none); keep "
                         f"at least {cg.size} modes along the last dim or use fewer ranks")
    offs = split_offsets(width, cg.size)
    return ModePlan(sum(sizes), offs[cg.index], offs[cg.index + 1])


class _Spectral(DomainLayer, nn.Module):
    """Common part: adopt the module's state, agree on the call's plan."""

    #: the converter leaves the children alone: they are this layer's own (neuralop's weight is a tltorch module,
    #: SFNO's transforms are converted here), computed in its forward on the columns layout
    halo_owns_children = True

    def __init__(self, module: nn.Module, *, group: Any | None = None) -> None:
        adopt(self, module)
        self.halo_init(group)

    def plan(self, x: torch.Tensor, rows: int, want_w: int, width: int) -> ModePlan:
        op = type(self).__name__
        got_w = int(x.shape[-1]) if x.dim() >= 2 else -1
        return resolve(x, self.group, op, _mode_plan, (rows, got_w, want_w, width, op), site=self._halo_site)


# -- torch-harmonics: RealSHT / InverseRealSHT --------------------------------------------------------------------

@public
class DomainRealSHT(_Spectral):
    """torch-harmonics' ``RealSHT`` on latitude rows: ``(..., nlat_r, nlon)`` -> ``(..., lmax_r, mmax)``, the balanced
    split of the degrees of the unsharded ``RealSHT``'s output (module docstring)."""

    def columns(self, x: torch.Tensor) -> tuple[torch.Tensor, ModePlan]:
        """The spectrum in the columns layout ``(..., lmax, m_s)`` (what a per-mode layer works on locally) and the
        plan of the call (this rank's modes)."""
        p = self.plan(x, self.nlat, self.nlon, self.mmax)
        spec = 2.0 * torch.pi * torch.fft.rfft(x, dim=-1, norm="forward")
        spec = torch.view_as_real(to_columns(spec[..., : self.mmax], group=self.group))  # (..., nlat, m_s, 2)
        w = self.weights[p.c0:p.c1].to(spec.dtype)
        out = torch.stack([torch.einsum("...km,mlk->...lm", spec[..., 0], w),
                           torch.einsum("...km,mlk->...lm", spec[..., 1], w)], dim=-1)
        return torch.view_as_complex(out.contiguous()), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = to_rows(self.columns(x)[0], group=self.group)
        carry(out, x)
        return out


@public
class DomainInverseRealSHT(_Spectral):
    """torch-harmonics' ``InverseRealSHT`` on latitude rows: ``(..., lmax_r, mmax)`` -> ``(..., nlat_r, nlon)``."""

    def from_columns(self, spec: torch.Tensor, p: ModePlan) -> torch.Tensor:
        """The field's balanced latitude rows from a spectrum in the columns layout ``(..., lmax, m_s)``."""
        xr = torch.view_as_real(spec)
        xs = torch.einsum("...lmr,mlk->...kmr", xr, self.pct[p.c0:p.c1].to(xr.dtype)).contiguous()
        x = to_rows(torch.view_as_complex(xs), group=self.group).clone()  # (..., nlat_r, mmax)
        x[..., 0].imag = 0.0  # as torch-harmonics does: the DC and Nyquist modes are real
        if (self.nlon % 2 == 0) and (self.nlon // 2 < self.mmax):
            x[..., self.nlon // 2].imag = 0.0
        return torch.fft.irfft(x, n=self.nlon, dim=-1, norm="forward")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.plan(x, self.lmax, self.mmax, self.mmax)
        out = self.from_columns(to_columns(x, group=self.group), p)
        carry(out, x)
        return out


# -- torch-harmonics SFNO/FNO: RealFFT2 / InverseRealFFT2 (the FFT in place of the SHT) ------------------------------

@public
class DomainRealFFT2(_Spectral):
    """torch-harmonics' ``RealFFT2`` (``examples.models._layers``: the FNO form of its SFNO) on latitude rows:
    ``rfft2(norm="ortho")``, its first ``ceil(lmax / 2)`` and last ``floor(lmax / 2)`` frequency rows (cut on the
    columns layout, where they are whole) and first ``mmax`` modes (cut before the transpose)."""

    def columns(self, x: torch.Tensor) -> tuple[torch.Tensor, ModePlan]:
        """The kept spectrum in the columns layout ``(..., lmax, m_s)`` and the plan of the call."""
        p = self.plan(x, self.nlat, self.nlon, min(self.mmax, self.nlon // 2 + 1))
        spec = torch.fft.rfft(x, dim=-1, norm="ortho")[..., : self.mmax]
        y = torch.fft.fft(to_columns(spec, group=self.group), dim=-2, norm="ortho")
        lo, hi = math.ceil(self.lmax / 2), math.floor(self.lmax / 2)
        return torch.cat((y[..., :lo, :], y[..., -hi:, :]), dim=-2), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = to_rows(self.columns(x)[0], group=self.group)
        carry(out, x)
        return out


@public
class DomainInverseRealFFT2(_Spectral):
    """torch-harmonics' ``InverseRealFFT2``: ``irfft2(x, s=(nlat, nlon), norm="ortho")`` of the H-sharded spectrum
    (its frequency rows zero-padded or trimmed at the end to ``nlat``, as torch does, on the columns layout)."""

    def from_columns(self, spec: torch.Tensor, p: ModePlan | None = None) -> torch.Tensor:
        """The field's balanced latitude rows from a spectrum in the columns layout."""
        cols = torch.fft.ifft(spec, n=self.nlat, dim=-2, norm="ortho")
        return torch.fft.irfft(to_rows(cols, group=self.group), n=self.nlon, dim=-1, norm="ortho")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = int(x.shape[-1]) if x.dim() >= 2 else -1
        self.plan(x, -1, width, width)  # agreed: every rank's shape alike, enough modes for every rank
        out = self.from_columns(to_columns(x, group=self.group))
        carry(out, x)
        return out


# -- torch-harmonics SFNO: SpectralConvS2 -------------------------------------------------------------------------

_PAIRS = {(a + f, a + i) for a in ("", "Domain") for f, i in (("RealSHT", "InverseRealSHT"),
                                                                ("RealFFT2", "InverseRealFFT2"))}


@public
class DomainSpectralConvS2(_Spectral):
    """torch-harmonics' SFNO ``SpectralConvS2`` (``examples.models._layers``) with SHT transforms, on latitude rows:
    returns ``(x, residual)`` as the module does."""

    def __init__(self, module: nn.Module, *, group: Any | None = None) -> None:
        op = type(module).__name__
        if module.operator_type not in ("diagonal", "driscoll-healy"):
            raise ValueError(f"{op}: operator_type={module.operator_type!r} mixes the m modes of each degree (the "
                             f"columns layout splits them); halo converts 'diagonal' and 'driscoll-healy'")
        pair = (type(module.forward_transform).__name__, type(module.inverse_transform).__name__)
        if pair not in _PAIRS:
            raise ValueError(f"{op}: its transforms {pair[0]} / {pair[1]} have no columns form in halo (expected "
                             f"torch-harmonics RealSHT / InverseRealSHT or RealFFT2 / InverseRealFFT2)")
        fwd, inv = module.forward_transform, module.inverse_transform
        if (fwd.lmax, fwd.mmax) != (inv.lmax, inv.mmax) or fwd.nlon // 2 + 1 < fwd.mmax:  # mmax: their weight's
            raise ValueError(f"{op}: its transforms keep different modes (forward lmax, mmax = {fwd.lmax}, "
                             f"{fwd.mmax}; inverse {inv.lmax}, {inv.mmax}; at most nlon // 2 + 1 = "
                             f"{fwd.nlon // 2 + 1} longitudinal modes); halo expects the same, within that bound")
        super().__init__(module, group=group)
        fft = pair[0].endswith("RealFFT2")
        fwd_kind, inv_kind = (DomainRealFFT2, DomainInverseRealFFT2) if fft else (DomainRealSHT, DomainInverseRealSHT)
        self._modules["forward_transform"] = fwd if isinstance(fwd, fwd_kind) else fwd_kind(fwd, group=group)
        self._modules["inverse_transform"] = inv if isinstance(inv, inv_kind) else inv_kind(inv, group=group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fwd, inv = self.forward_transform, self.inverse_transform
        dtype = x.dtype
        x = x.float()
        residual = x
        spec, p = fwd.columns(x)  # (..., lmax, m_s), this rank's modes [p.c0, p.c1) of both transforms
        if self.scale_residual:
            residual = inv.from_columns(spec, p)
        w = self.weight[..., p.c0:p.c1] if self.operator_type == "diagonal" else self.weight
        spec = torch.einsum(self.contract_func, spec, w)
        out = inv.from_columns(spec, p)
        if hasattr(self, "bias"):
            out = out + self.bias
        out = out.type(dtype)
        carry(out, x)
        return out, residual


# -- neuraloperator: SpectralConv ---------------------------------------------------------------------------------

@public
class DomainSpectralConv(_Spectral):
    """neuraloperator's ``SpectralConv`` (2-d, real data) on latitude rows (module docstring)."""

    def __init__(self, module: nn.Module, *, group: Any | None = None) -> None:
        op = type(module).__name__
        why = None
        if module.order != 2:
            why = f"a {module.order}-d transform (halo converts the 2-d form over (H, W))"
        elif module.complex_data:
            why = "complex_data=True"
        elif module.fno_block_precision != "full":
            why = f"fno_block_precision={module.fno_block_precision!r} (halo converts 'full')"
        elif module.resolution_scaling_factor is not None:
            why = "resolution_scaling_factor (an output of another size)"
        if why is not None:
            raise ValueError(f"{op}: {why} has no domain-parallel form in halo; gather before it or keep it unsharded")
        super().__init__(module, group=group)

    def forward(self, x: torch.Tensor, output_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        op = type(self).__name__
        if output_shape is not None:
            raise ValueError(f"{op}: output_shape= is not supported on H-shards, got {output_shape}")
        width = x.shape[-1] // 2 + 1 if x.dim() >= 2 else 0
        kept_w = min(width, self._n_modes[-1], self.max_n_modes[-1]) if width else 0
        p = self.plan(x, -1, x.shape[-1] if x.dim() >= 2 else -1, kept_w)
        h, w = p.height, x.shape[-1]
        fft_size = [h, width]
        starts = [mx - min(size, n) for size, n, mx in zip(fft_size, self._n_modes, self.max_n_modes, strict=True)]
        slices_w = [slice(None)] if self.separable else [slice(None), slice(None)]
        slices_w.append(slice(starts[0] // 2, -starts[0] // 2) if starts[0] else slice(starts[0], None))
        slices_w.append(slice(None, -starts[1]) if starts[1] else slice(None))
        weight = self.weight[tuple(slices_w)]
        kept_h, kept_w = weight.shape[-2], weight.shape[-1]
        center = h // 2
        rows = slice(center - kept_h // 2, center + kept_h // 2 + kept_h % 2)
        norm = self.fft_norm
        spec = torch.fft.rfft(x, dim=-1, norm=norm)[..., :kept_w]  # the kept modes only travel
        cols = torch.fft.fftshift(torch.fft.fft(to_columns(spec, group=self.group), dim=-2, norm=norm), dim=-2)
        with trusted():  # the module's own per-mode contraction, on this rank's whole modes
            part = self._contract(cols[:, :, rows], weight[..., p.c0:p.c1], separable=self.separable)
        out = torch.zeros([x.shape[0], self.out_channels, h, p.c1 - p.c0], device=x.device, dtype=torch.cfloat)
        out[:, :, rows] = part
        out = torch.fft.ifft(torch.fft.fftshift(out, dim=-2), n=h, dim=-2, norm=norm)
        y = torch.fft.irfft(to_rows(out, group=self.group), n=w, dim=-1, norm=norm)
        if self.bias is not None:
            y = y + self.bias
        carry(y, x)
        return y


# -- FourCastNet: AFNO2D ----------------------------------------------------------------------------------------

@public
class DomainAFNO2D(_Spectral):
    """FourCastNet's ``AFNO2D`` (its ``networks/afnonet.py``, as ``ai_models_fourcastnet.afnonet`` ships it) on
    latitude rows of its channels-last input ``(B, H_r, W, C)``: ``rfft`` along W, its first ``kept_modes`` modes
    to the columns layout, ``fft`` along H, the block-diagonal two-layer MLP on the kept modes (per mode: local),
    softshrink, ``ifft`` along H, back to rows, ``irfft`` along W (the modes past ``kept_modes`` are zero, as the
    module leaves them), plus the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = type(self).__name__
        got_w = int(x.shape[2]) if x.dim() == 4 else -1
        p = resolve(x, self.group, op, _afno_plan, (got_w, self.hard_thresholding_fraction, op), site=self._halo_site,
                    spec=(1,), split=True)
        bias, dtype = x, x.dtype
        x = x.float()
        b, w, c = x.shape[0], x.shape[2], x.shape[3]
        h, nb, bs = p.height, self.num_blocks, self.block_size
        total = h // 2 + 1
        kept = int(total * self.hard_thresholding_fraction)
        spec = torch.fft.rfft(x.permute(0, 3, 1, 2), dim=-1, norm="ortho")[..., :min(kept, w // 2 + 1)]
        cols = torch.fft.fft(to_columns(spec, group=self.group), dim=-2, norm="ortho")  # (B, C, H, m_s)
        z = cols.permute(0, 2, 3, 1).reshape(b, h, p.c1 - p.c0, nb, bs)[:, total - kept: total + kept]
        w1, b1, w2, b2 = self.w1, self.b1, self.w2, self.b2
        o1_real = torch.relu(torch.einsum("...bi,bio->...bo", z.real, w1[0])
                             - torch.einsum("...bi,bio->...bo", z.imag, w1[1]) + b1[0])
        o1_imag = torch.relu(torch.einsum("...bi,bio->...bo", z.imag, w1[0])
                             + torch.einsum("...bi,bio->...bo", z.real, w1[1]) + b1[1])
        o2_real = torch.einsum("...bi,bio->...bo", o1_real, w2[0]) \
            - torch.einsum("...bi,bio->...bo", o1_imag, w2[1]) + b2[0]
        o2_imag = torch.einsum("...bi,bio->...bo", o1_imag, w2[0]) \
            + torch.einsum("...bi,bio->...bo", o1_real, w2[1]) + b2[1]
        o2 = torch.zeros((b, h, p.c1 - p.c0, nb, bs, 2), device=x.device)  # float32, as the module's buffers
        o2[:, total - kept: total + kept] = torch.stack([o2_real, o2_imag], dim=-1)
        z = torch.view_as_complex(torch.nn.functional.softshrink(o2, lambd=self.sparsity_threshold))
        z = torch.fft.ifft(z.reshape(b, h, p.c1 - p.c0, c).permute(0, 3, 1, 2), n=h, dim=-2, norm="ortho")
        y = torch.fft.irfft(to_rows(z, group=self.group), n=w, dim=-1, norm="ortho").permute(0, 2, 3, 1)
        out = y.type(dtype) + bias
        place(out, 1)
        carry(out, bias)
        return out


def _afno_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], got_w: int, fraction: float,
               op: str) -> ModePlan:
    """The kept longitudinal modes split over the ranks (``AFNO2D`` keeps ``int((H // 2 + 1) * fraction)``)."""
    if got_w < 0:
        raise ValueError(f"{op}: expected a channels-last field (B, H, W, C), got a tensor of another rank")
    kept = min(int((sum(extents[0]) // 2 + 1) * fraction), got_w // 2 + 1)
    return _mode_plan(cg, extents, -1, got_w, got_w, kept, op)


# -- recognised by name (halo.nn.adapters asks here) ---------------------------------------------------------------

def spectral_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The converter of torch-harmonics' ``RealSHT`` / ``InverseRealSHT`` / SFNO ``SpectralConvS2`` and
    neuraloperator's ``SpectralConv``, recognised by class name, defining package and the attributes read."""
    kind = type(module)
    name, where = kind.__name__, kind.__module__
    if where.startswith("torch_harmonics"):
        if name == "RealSHT" and all(hasattr(module, a) for a in ("nlat", "nlon", "lmax", "mmax", "weights")):
            return lambda m, ctx: DomainRealSHT(m, group=ctx.group)
        if name == "InverseRealSHT" and all(hasattr(module, a) for a in ("nlat", "nlon", "lmax", "mmax", "pct")):
            return lambda m, ctx: DomainInverseRealSHT(m, group=ctx.group)
        if name == "RealFFT2" and all(hasattr(module, a) for a in ("nlat", "nlon", "lmax", "mmax")):
            return lambda m, ctx: DomainRealFFT2(m, group=ctx.group)
        if name == "InverseRealFFT2" and all(hasattr(module, a) for a in ("nlat", "nlon", "lmax", "mmax")):
            return lambda m, ctx: DomainInverseRealFFT2(m, group=ctx.group)
        if name == "SpectralConvS2" and all(hasattr(module, a) for a in (
                "forward_transform", "inverse_transform", "weight", "contract_func", "operator_type")):
            return lambda m, ctx: DomainSpectralConvS2(m, group=ctx.group)
    if name == "AFNO2D" and where.endswith("afnonet") and all(  # FourCastNet's networks/afnonet.py, ai-models' copy
            hasattr(module, a) for a in ("w1", "b1", "w2", "b2", "num_blocks", "block_size",
                                         "hard_thresholding_fraction", "sparsity_threshold")):
        return lambda m, ctx: DomainAFNO2D(m, group=ctx.group)
    if where.startswith("neuralop") and name == "SpectralConv" and all(hasattr(module, a) for a in (
            "n_modes", "max_n_modes", "order", "fft_norm", "separable", "_contract", "complex_data")):
        return lambda m, ctx: DomainSpectralConv(m, group=ctx.group)
    return None
