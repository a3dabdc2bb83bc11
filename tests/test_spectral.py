"""Spectral transforms on H-shards (``halo.nn.spectral``, ``halo.nn.spectral_layers``), exact by distributed transposes.

- ``to_columns`` / ``to_rows`` (``halo.nn.transpose``: slabs; complex fields as their real view): bitwise the column
  split of the global field and back, the same as ``longrange.rows_to_columns``'s regroup, and the dot-product
  test of the adjoint in float64 (complex).
- ``rfft2`` / ``irfft2`` / ``fft2`` / ``ifft2`` and ``fft`` / ``ifft`` / ``rfft`` / ``irfft`` along H on 2 and 3
  gloo ranks, H = 33 / 37 (odd, uneven shards), W even and odd, both layouts, a truncated spectrum (``modes_w``):
  forward and input gradient equal ``torch.fft`` on the whole field (float64; 1e-12: FFT rounding only, no sum
  across ranks other than the transform's own).
- torch-harmonics 0.8 ``RealSHT`` / ``InverseRealSHT`` in a model with a 1x1 conv, converted by
  ``convert_to_domain_parallel``; SFNO's ``SpectralConvS2`` (diagonal, driscoll-healy) alone and inside
  ``SphericalFourierNeuralOperatorBlock``; neuraloperator 2.0 ``SpectralConv``: forward, input and parameter
  gradients (summed over the domain group) against the unsharded module in the same test, equiangular nlat odd,
  ``state_dict`` keys unchanged. A run of the unconverted module on each shard is checked to differ (so the
  comparisons would fail if the exact path were the local one).
- Memory: no tensor autograd saves in the converted SHT model is larger than ~1/P of the whole field's.
- The guard on the columns layout (``rows_to_cols`` places its output along W, and the guard follows it through the
  transform): per-mode work along the whole frequency rows in user code passes and is exact; a reduction over the
  sharded modes is refused on every rank.
- torch.compile (aot_eager) of a converted SHT model equals eager (the transposes are graph breaks).
- Arguments and configurations halo does not convert (``s=``, layouts, dims; neuraloperator's 1-d / 3-d / half /
  rescaling / ``output_shape``; SFNO's mismatched modes or transforms) raise naming what was expected.
- Refusals, the same on every rank: one rank's wrong longitude count; every rank's wrong longitude or latitude
  count; fewer modes (or columns for the transpose
  itself) than ranks; SFNO's
  block-diagonal operator; neuraloperator's complex data.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks, run_on_ranks_outcomes

TOL = 1e-12  # float64 FFT/Legendre rounding: the transforms are the same sums in another order
TOL32 = 2e-5  # SFNO's SpectralConvS2 computes in float32 (x.float()), neuralop's SpectralConv in complex64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _shard(t: torch.Tensor, rank: int, world: int, dim: int = -2) -> torch.Tensor:
    o = split_offsets(t.shape[dim], world)
    return t.narrow(dim, o[rank], o[rank + 1] - o[rank])


def _cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return _shard(t, rank, world, -1)


# -- the functional transforms -------------------------------------------------------------------------------------

def _functional(rank: int, world: int, h: int, w: int) -> dict[str, float]:
    import torch.distributed as dist

    import halo
    from halo.nn import spectral as S

    halo.initialize_domain_parallel(world, world)
    gen = torch.Generator().manual_seed(h * w)
    full = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
    errs: dict[str, float] = {}

    def check(name, ref_fn, got_fn, out_shard, complex_in=False):
        src = full if not complex_in else torch.complex(full, full.flip(-1))
        xf = src.clone().requires_grad_(True)
        xs = _shard(src, rank, world).clone().requires_grad_(True)
        ref, got = ref_fn(xf), got_fn(xs)
        y = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
        (ref * y.conj()).real.sum().backward() if ref.is_complex() else (ref * y).sum().backward()
        ys = out_shard(y)
        (got * ys.conj()).real.sum().backward() if got.is_complex() else (got * ys).sum().backward()
        errs[name] = max(rel(got.detach(), out_shard(ref.detach())), rel(xs.grad, _shard(xf.grad, rank, world)))

    rows = lambda t: _shard(t, rank, world)  # noqa: E731
    cols = lambda t: _cols(t, rank, world)  # noqa: E731
    for norm in (None, "ortho", "forward"):
        check(f"rfft2 {norm}", lambda x, norm=norm: torch.fft.rfft2(x, norm=norm),
              lambda x, norm=norm: S.rfft2(x, norm=norm), rows)
        check(f"rfft2 columns {norm}", lambda x, norm=norm: torch.fft.rfft2(x, norm=norm),
              lambda x, norm=norm: S.rfft2(x, norm=norm, layout="columns"), cols)
        check(f"irfft2 {norm}", lambda x, norm=norm: torch.fft.irfft2(torch.fft.rfft2(x), s=(h, w), norm=norm),
              lambda x, norm=norm: S.irfft2(S.rfft2(x, layout="columns"), s=(h, w), norm=norm, layout="columns"), rows)
    m = w // 2  # a truncated spectrum: the first m modes travel, irfft2 zero-pads the rest
    check("rfft2 -> keep m -> irfft2",
          lambda x: torch.fft.irfft2(torch.fft.rfft2(x)[..., :m], s=(h, w)),
          lambda x: S.irfft2(S.rfft2(x, modes_w=m, layout="columns"), s=(h, w), layout="columns"), rows)
    check("rfft2 modes_w rows", lambda x: torch.fft.rfft2(x)[..., :m], lambda x: S.rfft2(x, modes_w=m), rows)
    check("irfft2 rows", lambda x: torch.fft.irfft2(torch.fft.rfft2(x), s=(h, w)),
          lambda x: S.irfft2(S.rfft2(x), s=(h, w)), rows)
    check("fft2 complex", lambda x: torch.fft.fft2(x, norm="ortho"), lambda x: S.fft2(x, norm="ortho"), rows, True)
    check("fft2 -> ifft2", lambda x: torch.fft.ifft2(torch.fft.fft2(x)),
          lambda x: S.ifft2(S.fft2(x, layout="columns"), layout="columns"), rows, True)
    check("ifft2 rows", lambda x: torch.fft.ifft2(x), lambda x: S.ifft2(x), rows, True)
    check("fft over H", lambda x: torch.fft.fft(x, dim=-2), lambda x: S.fft(x, dim=-2), rows, True)
    check("ifft over H", lambda x: torch.fft.ifft(x, dim=-2, norm="ortho"),
          lambda x: S.ifft(x, dim=-2, norm="ortho"), rows, True)
    check("rfft over H", lambda x: torch.fft.rfft(x, dim=-2), lambda x: S.rfft(x, dim=-2), rows)
    check("irfft over H", lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=-2), n=h, dim=-2),
          lambda x: S.irfft(S.rfft(x, dim=-2), n=h, dim=-2), rows)
    check("rfft over W", lambda x: torch.fft.rfft(x, dim=-1), lambda x: S.rfft(x, dim=-1), rows)
    # the complex transpose: bitwise the column split, and the dot-product test of its adjoint
    z = torch.complex(full, torch.randn(full.shape, generator=gen, dtype=torch.float64))
    zy = torch.complex(torch.randn(full.shape, generator=gen, dtype=torch.float64), full)
    xs = rows(z).clone().requires_grad_(True)
    c = S.to_columns(xs)
    same = torch.equal(c.detach(), cols(z)) and torch.equal(S.to_rows(c.detach()), rows(z)) \
        and torch.equal(S.to_columns_regroup(rows(z)), cols(z))  # the slabs move what longrange's regroup moves
    (c * cols(zy).conj()).real.sum().backward()
    dots = torch.tensor([(c.detach() * cols(zy).conj()).real.sum().item(),
                         (xs.detach() * xs.grad.conj()).real.sum().item()], dtype=torch.float64)
    dist.all_reduce(dots)
    errs["transpose bitwise"] = 0.0 if same else 1.0
    errs["transpose adjoint"] = abs(dots[0] - dots[1]).item() / max(1.0, abs(dots[0]).item())
    return errs


@pytest.mark.parametrize("world,h,w", [(2, 37, 10), (3, 33, 9)])
def test_transforms_equal_torch_fft_forward_and_backward(world, h, w):
    for errs in run_on_ranks(_functional, world, h, w, timeout=240):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, bad


# -- the converted layers ------------------------------------------------------------------------------------------

class SHTModel(nn.Module):
    """A 1x1 conv (parameter gradients), the forward SHT, a spectral scale (pointwise in the modes), the inverse."""

    def __init__(self, nlat: int, nlon: int, c: int = 3, grid: str = "equiangular") -> None:
        super().__init__()
        from torch_harmonics import InverseRealSHT, RealSHT

        self.lift = nn.Conv2d(c, c, 1)
        self.sht = RealSHT(nlat, nlon, grid=grid)
        self.isht = InverseRealSHT(nlat, nlon, grid=grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.sht(self.lift(x))
        return self.isht(spec * 0.5 + spec.abs() * 0.25) + x


class First(nn.Module):
    """SpectralConvS2 returns ``(x, residual)``: use both."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, r = self.conv(x)
        return y + r


def _sfno_conv(nlat: int, nlon: int, c: int, operator: str, fft: bool = False) -> nn.Module:
    from torch_harmonics import InverseRealSHT, RealSHT
    from torch_harmonics.examples.models._layers import InverseRealFFT2, RealFFT2, SpectralConvS2

    modes = (nlat // 2 + 1, nlon // 4 + 1)
    fwd, inv = (RealFFT2, InverseRealFFT2) if fft else (RealSHT, InverseRealSHT)
    return SpectralConvS2(fwd(nlat, nlon, *modes), inv(nlat, nlon, *modes), c, c, operator_type=operator, bias=True)


def _sfno_block(nlat: int, nlon: int, c: int) -> nn.Module:
    from torch_harmonics import InverseRealSHT, RealSHT
    from torch_harmonics.examples.models.sfno import SphericalFourierNeuralOperatorBlock

    modes = (nlat // 2 + 1, nlon // 4 + 1)
    return SphericalFourierNeuralOperatorBlock(RealSHT(nlat, nlon, *modes), InverseRealSHT(nlat, nlon, *modes), c, c,
                                               norm_layer="instance_norm", inner_skip="linear", outer_skip="identity")


class ChannelsLast(nn.Module):
    """FourCastNet's blocks run on ``(B, H, W, C)``: the model permutes (followed by halo's guard), as AFNONet does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _afno(c: int, block: bool, fraction: float) -> nn.Module:
    import _thirdparty

    _thirdparty.load()  # timm (which afnonet imports) imports torchvision
    from ai_models_fourcastnet.afnonet import AFNO2D, Block

    if block:
        blk = Block(c, num_blocks=2, hard_thresholding_fraction=fraction)
        return ChannelsLast(blk)
    return ChannelsLast(AFNO2D(c, num_blocks=2, hard_thresholding_fraction=fraction, sparsity_threshold=0.002))


def _spectral_conv(c: int) -> nn.Module:
    from neuralop.layers.spectral_convolution import SpectralConv

    return nn.Sequential(nn.Conv2d(c, c, 1), SpectralConv(c, c + 1, n_modes=(8, 7)))


def _build(kind: str, h: int, w: int, c: int) -> tuple[nn.Module, torch.dtype, float]:
    torch.manual_seed(7)
    if kind == "sht":
        return SHTModel(h, w, c).double(), torch.float64, TOL
    if kind in ("diagonal", "driscoll-healy"):
        return First(_sfno_conv(h, w, c, kind)), torch.float32, TOL32
    if kind.startswith("fno "):  # torch-harmonics' FNO: SpectralConvS2 on RealFFT2 / InverseRealFFT2
        return First(_sfno_conv(h, w, c, kind[4:], fft=True)), torch.float32, TOL32
    if kind == "fft2":
        from torch_harmonics.examples.models._layers import InverseRealFFT2, RealFFT2

        return nn.Sequential(nn.Conv2d(c, c, 1), RealFFT2(h, w, h // 2, w // 3), InverseRealFFT2(h, w, h // 2, w // 3)
                             ).double(), torch.float64, TOL
    if kind == "sfno block":
        return _sfno_block(h, w, c), torch.float32, TOL32
    if kind == "neuralop":
        return _spectral_conv(c), torch.float32, TOL32
    if kind.startswith("afno"):  # AFNO2D computes in float32 (x.float())
        return _afno(4, kind == "afno block", 0.5 if "half" in kind else 1.0), torch.float32, TOL32
    raise ValueError(kind)


def _layers(rank: int, world: int, kind: str, h: int, w: int) -> dict[str, Any]:
    import copy

    import torch.distributed as dist

    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    c = 4 if kind.startswith("afno") else 3
    ref, dtype, _ = _build(kind, h, w, c)
    model = copy.deepcopy(ref)
    local = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    convert_to_domain_parallel(model)
    gen = torch.Generator().manual_seed(h + w)
    full = torch.randn(2, c, h, w, generator=gen, dtype=dtype)
    xf = full.clone().requires_grad_(True)
    out_ref = ref(xf)
    y = torch.randn(out_ref.shape, generator=gen, dtype=dtype)
    (out_ref * y).sum().backward()
    xs = _shard(full, rank, world).clone().requires_grad_(True)
    biggest = [0]
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def pack(t: torch.Tensor) -> torch.Tensor:  # the field's tensors (not the module's constants, held whole)
        if t.untyped_storage().data_ptr() not in state:
            biggest[0] = max(biggest[0], t.numel() * (2 if t.is_complex() else 1))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(xs)
    (out * _shard(y, rank, world)).sum().backward()
    errs = {"forward": rel(out.detach(), _shard(out_ref.detach(), rank, world)),
            "input grad": rel(xs.grad, _shard(xf.grad, rank, world))}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g)
        errs[f"grad {name}"] = rel(g, q.grad)
    with torch.no_grad():  # the unconverted module on each shard: what the exact path replaces
        try:
            wrong = rel(local(_shard(full, rank, world)), _shard(out_ref.detach(), rank, world))
        except Exception:  # noqa: BLE001 - a module that cannot even run on a shard differs too
            wrong = float("inf")
    kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Domain")})
    return {"errs": errs, "keys": list(model.state_dict()) == keys, "wrong": wrong, "kinds": kinds,
            "saved": biggest[0], "field": full.numel()}


CASES = [("sht", 2, 33, 16), ("sht", 3, 37, 16), ("sht", 7, 37, 16), ("diagonal", 2, 33, 16),
         ("driscoll-healy", 3, 33, 16), ("sfno block", 3, 37, 16), ("fno diagonal", 3, 33, 16),
         ("fno driscoll-healy", 2, 37, 14), ("fft2", 3, 33, 16), ("neuralop", 2, 37, 14), ("neuralop", 3, 33, 15),
         ("afno", 2, 33, 12), ("afno half", 3, 37, 13), ("afno block", 3, 33, 12)]


def _package(kind: str) -> str:
    if kind.startswith("afno"):
        return "ai_models_fourcastnet"
    return "neuralop.layers.spectral_convolution" if kind == "neuralop" else "torch_harmonics"


@pytest.mark.parametrize("kind,world,h,w", CASES)
def test_converted_spectral_layers_equal_unsharded(kind, world, h, w):
    pytest.importorskip(_package(kind))
    tol = _build_tol(kind)
    for res in run_on_ranks(_layers, world, kind, h, w, timeout=300):
        bad = {k: v for k, v in res["errs"].items() if not v < tol}
        assert not bad, (res["kinds"], bad)
        assert res["keys"], "state_dict keys changed"
        assert res["wrong"] > 1e3 * tol, res["wrong"]  # the local path would fail the comparisons above
        assert res["kinds"], res
        if kind == "sht":  # ~1/P of the field (the spectrum and the transposed columns); 1.5x: uneven shards
            assert res["saved"] <= 1.5 * res["field"] / world, (res["saved"], res["field"], world)


def _build_tol(kind: str) -> float:
    return TOL if kind in ("sht", "fft2") else TOL32


# -- torch.compile ---------------------------------------------------------------------------------------------------

def _compiled(rank: int, world: int) -> dict[str, float]:
    import copy

    import torch._dynamo

    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    torch.manual_seed(3)
    model = convert_to_domain_parallel(SHTModel(33, 16, 2).double())
    compiled = torch.compile(copy.deepcopy(model), backend="aot_eager")
    full = torch.randn(2, 2, 33, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    errs = {}
    outs = []
    for m in (model, compiled):
        x = _shard(full, rank, world).clone().requires_grad_(True)
        for _ in range(2):  # the second call runs the recorded plans
            x.grad = None
            out = m(x)
            out.square().sum().backward()
        outs.append((out.detach(), x.grad, m.lift.weight.grad if hasattr(m, "lift") else m._orig_mod.lift.weight.grad))
    for name, a, b in zip(("forward", "input grad", "weight grad"), outs[0], outs[1], strict=True):
        errs[name] = rel(b, a)
    torch._dynamo.reset()
    return errs


def test_compiled_sht_model_equals_eager():
    """aot_eager: the transposes' messages are graph breaks (``halo.dist.transport.post`` is ``dynamo.disable``d)."""
    for errs in run_on_ranks(_compiled, 2, timeout=400):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, bad


# -- the guard and the columns layout ------------------------------------------------------------------------------

class ModeFilter(nn.Module):
    """User code between the transforms, as FNO-style models write it: per-mode work on the columns layout (whole
    frequency rows, this rank's modes), or (``reduce``) a reduction over the sharded modes: a sum, which the guard
    computes over the domain (whole on every rank), or a maximum, which it refuses."""

    def __init__(self, reduce: str | None) -> None:
        super().__init__()
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from halo.nn import spectral as S

        spec = S.rfft2(x, layout="columns")
        h, w = spec.shape[-2], x.shape[-1]  # the global H: whole in the columns layout (x.shape[-2] is a shard's)
        if self.reduce == "sum":
            return spec.abs().sum(-1, keepdim=True)  # over the modes: sharded in this layout
        if self.reduce == "amax":
            return spec.abs().amax(-1, keepdim=True)
        keep = torch.ones_like(spec.real)
        keep[..., h // 4: h - h // 4, :] = 0  # latitudinal truncation: whole rows here, so local
        return S.irfft2(spec * keep, s=(h, w), layout="columns")


def _guarded(rank: int, world: int, reduce: str | None) -> float:
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    halo.initialize_domain_parallel(world, world)
    full = torch.randn(1, 2, 37, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = convert_to_domain_parallel(ModeFilter(reduce), custom_converters={ModeFilter: INSIDE})
    out = model(_shard(full, rank, world))
    spec = torch.fft.rfft2(full)
    if reduce == "sum":  # whole on every rank
        return rel(out, spec.abs().sum(-1, keepdim=True))
    spec[..., 37 // 4: 37 - 37 // 4, :] = 0
    return rel(out, _shard(torch.fft.irfft2(spec, s=(37, 8)), rank, world))


def test_guard_passes_per_mode_work_on_columns_and_refuses_a_reduction_over_the_sharded_modes():
    for reduce in (None, "sum"):
        for err in run_on_ranks(_guarded, 2, reduce, timeout=120):
            assert err < TOL, (reduce, err)
    outs = run_on_ranks_outcomes(_guarded, 2, "amax", timeout=120, pg_timeout=60)
    assert all(kind == "error" for kind, _ in outs), outs
    firsts = {msg.splitlines()[0] for _, msg in outs}
    assert len(firsts) == 1 and "amax" in firsts.pop(), outs


# -- refusals: the same error on every rank -------------------------------------------------------------------------

def _refusal(rank: int, world: int, case: str) -> str:
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own rows (alike on every rank: a whole field)
    if case == "nlon":  # rank 1 alone holds a field of the wrong width: agreed before the transpose
        model = nn.Sequential(SHTModel(9, 8, 2))
        convert_to_domain_parallel(model)
        w = 10 if rank == 1 else 8
        x = torch.randn(1, 2, split_offsets(9, world)[rank + 1] - split_offsets(9, world)[rank], w, generator=gen)
        model(x)
    elif case in ("nlon all", "nlat"):  # every rank alike, but not the grid the SHT was built for (9 x 8)
        from torch_harmonics import RealSHT

        model = nn.Sequential(RealSHT(9, 8))
        convert_to_domain_parallel(model)
        h = 10 if case == "nlat" else 9
        o = split_offsets(h, world)
        model(torch.randn(1, 2, o[rank + 1] - o[rank], 10 if case == "nlon all" else 8, generator=gen))
    elif case == "modes":  # 2 modes over 3 ranks
        from torch_harmonics import RealSHT

        model = nn.Sequential(RealSHT(9, 8, mmax=2))
        convert_to_domain_parallel(model)
        o = split_offsets(9, world)
        model(torch.randn(1, 2, o[rank + 1] - o[rank], 8, generator=gen))
    elif case == "columns":  # the transpose itself: 2 columns over 3 ranks
        from halo.nn import spectral as S

        o = split_offsets(9, world)
        S.to_columns(torch.randn(1, 2, o[rank + 1] - o[rank], 2, dtype=torch.complex128))
    elif case == "block-diagonal":
        convert_to_domain_parallel(First(_sfno_conv(9, 8, 2, "block-diagonal")))
    elif case == "complex":
        from neuralop.layers.spectral_convolution import SpectralConv

        convert_to_domain_parallel(nn.Sequential(SpectralConv(2, 2, n_modes=(4, 4), complex_data=True)))
    return "no error"


@pytest.mark.parametrize("case,match", [
    ("nlon", "8"), ("nlon all", "expected 8 along the last dim, got 10"),
    ("nlat", "expected 9 rows along dim -2 over the domain group, got 10"),
    ("modes", "2 modes cannot be split over 3 ranks"),
    ("columns", "2 columns cannot be split over 3 ranks"),
    ("block-diagonal", "block-diagonal"), ("complex", "complex_data")])
def test_refusals_are_the_same_on_every_rank(case, match):
    pytest.importorskip("torch_harmonics" if case != "complex" else "neuralop.layers.spectral_convolution")
    outs = run_on_ranks_outcomes(_refusal, 3, case, timeout=120, pg_timeout=60)
    assert all(kind == "error" for kind, _ in outs), outs
    firsts = {msg.splitlines()[0] for _, msg in outs}
    assert len(firsts) == 1, firsts
    assert match in firsts.pop()



def test_argument_and_configuration_refusals_name_what_was_expected():
    """Refusals decided by the call's own arguments or the module's configuration (alike on every rank by
    construction), checked in one process."""
    pytest.importorskip("neuralop.layers.spectral_convolution")
    from neuralop.layers.spectral_convolution import SpectralConv
    from torch_harmonics import InverseRealSHT, RealSHT
    from torch_harmonics.examples.models._layers import SpectralConvS2

    from halo.nn import DomainSpectralConv, DomainSpectralConvS2
    from halo.nn import spectral as S

    x = torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match="s= .* not supported on H-shards, got s=\\(9, 8\\)"):
        S.rfft2(x, s=(9, 8))
    with pytest.raises(ValueError, match="layout must be one of \\('rows', 'columns'\\), got 'cols'"):
        S.irfft2(x, s=(9, 8), layout="cols")
    with pytest.raises(ValueError, match="runs over \\(H, W\\) = dims \\(-2, -1\\), got dim=\\(1, 2\\)"):
        S.fft2(x, dim=(1, 2))
    with pytest.raises(ValueError, match="along H \\(dim -2\\) or W \\(dim -1\\), got dim=1"):
        S.fft(x, dim=1)
    for kwargs, why in (({"n_modes": (4,)}, "a 1-d transform"), ({"n_modes": (4, 4, 4)}, "a 3-d transform"),
                        ({"n_modes": (4, 4), "fno_block_precision": "half"}, "fno_block_precision='half'"),
                        ({"n_modes": (4, 4), "resolution_scaling_factor": 2}, "resolution_scaling_factor")):
        with pytest.raises(ValueError, match=why):
            DomainSpectralConv(SpectralConv(2, 2, **kwargs))
    with pytest.raises(ValueError, match="output_shape= is not supported on H-shards, got \\(9, 8\\)"):
        DomainSpectralConv(SpectralConv(2, 2, n_modes=(4, 4)))(x, output_shape=(9, 8))
    with pytest.raises(ValueError, match="keep different modes \\(forward lmax, mmax = 9, 5; inverse 5, 3"):
        DomainSpectralConvS2(SpectralConvS2(RealSHT(9, 8), InverseRealSHT(9, 8, 5, 3), 2, 2))
    with pytest.raises(ValueError, match="Identity / InverseRealSHT have no columns form"):
        conv = SpectralConvS2(RealSHT(9, 8), InverseRealSHT(9, 8), 2, 2)
        conv.forward_transform = nn.Identity()
        DomainSpectralConvS2(conv)
