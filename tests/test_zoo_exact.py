"""Layers halo used to refuse although their exact form is easy (issue 32 items 6 and 8), as the users' real classes:
timm's per-channel scales other than ``LayerScale`` (``metaformer.Scale``, ``StarReLU``, InceptionNeXt's ``gamma``),
ConvNeXt V2's ``GlobalResponseNorm`` (a norm over H x W: a domain reduction), diffusers' ``Downsample2D`` (its
``F.pad(x, (0, 1, 0, 1))`` of the global field), ``VectorQuantizer`` (per pixel, its commit loss a domain mean) and
``Timesteps``, smp's channel ``LayerNorm`` subclasses; and one small real model per family they unblock (PoolFormer,
InceptionNeXt, ConvNeXt V2, AutoencoderKL, VQModel, UNet2DModel with no declaration and with Fourier time
embeddings, UPerNet).

Each runs converted on 2 and 3 gloo ranks with uneven rows, float64, train mode (dropout rates 0), and is compared with
the unsharded model built from the same seed: every output, the input gradient and every parameter gradient (summed
over the ranks), within 1e-9 of the largest value of the quantity (sums in another order are ~1e-15; a layer that
computes per shard is off by 1e-3 .. 1). Where halo's form is not pointwise (the GRN's norm, the pad), the same model
with that one layer run *locally* on each shard (``LOCAL``: the real module under ``halo.guard.trusted``, as the
model would run unconverted) is run too, and must differ: the comparison sees the difference the exact form removes.
One launch per world size runs every case (``run_on_ranks``); each case is its own test.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import _thirdparty as tp
import pytest
import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

_MISSING = tp.missing()
pytestmark = [pytest.mark.skipif(bool(_MISSING), reason=f"the zoo's packages are not installed: {_MISSING}"),
              pytest.mark.timeout(600)]

RTOL = 1e-9  # relative to the largest value of the quantity compared (module docstring)
LOCAL_OFF = 1e-6  # a layer run per shard differs by more than this (1e-3 .. 1 in practice)


@dataclasses.dataclass(frozen=True)
class Case:
    """A small model of real classes: ``build()`` (seeded by the caller), its input ``(B, channels, rows[P], width)``,
    ``call(model, x)`` returning a tensor; ``local``: the class whose halo form the local run replaces (module
    docstring), as ``module.Class``."""

    build: Callable[[], nn.Module]
    width: int
    rows: dict[int, int]
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda m, x: m(x)
    channels: int = 3
    local: str | None = None


def _seq(make: Callable[[], list[nn.Module]]) -> Callable[[], nn.Module]:
    """A 3x3 conv (3 -> 8 channels: parameters upstream), the layers ``make()`` returns, a 3x3 conv."""
    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *make(), nn.Conv2d(8, 4, 3, padding=1))
    return build


def _scales() -> list[nn.Module]:
    from timm.models.metaformer import Scale, StarReLU

    a, b = Scale(8, init_value=0.7), Scale(8, use_nchw=True)
    with torch.no_grad():
        b.scale.copy_(torch.linspace(-1.0, 2.0, 8))
    return [a, StarReLU(scale_value=0.8, bias_value=0.1), nn.Conv2d(8, 8, 3, padding=1), b]


def _grn() -> list[nn.Module]:
    from timm.layers.grn import GlobalResponseNorm

    grn = GlobalResponseNorm(8, channels_last=False)
    with torch.no_grad():  # timm starts at zero (the identity): a weight that is not, so the norm counts
        grn.weight.copy_(torch.linspace(-1.0, 1.5, 8))
        grn.bias.copy_(torch.linspace(0.5, -0.5, 8))
    return [nn.GELU(), grn]


def _downsample() -> list[nn.Module]:
    from diffusers.models.downsampling import Downsample2D

    return [Downsample2D(8, use_conv=True, padding=0), nn.SiLU(),
            Downsample2D(8, use_conv=True, padding=0, norm_type="ln_norm", eps=1e-5, elementwise_affine=True),
            Downsample2D(8, use_conv=True, padding=0, norm_type="rms_norm", eps=1e-5, elementwise_affine=True)]


def _smp_norms() -> list[nn.Module]:
    from segmentation_models_pytorch.decoders.upernet.decoder import LayerNorm2d
    from segmentation_models_pytorch.encoders.mix_transformer import LayerNorm

    return [LayerNorm2d(8, eps=1e-6), nn.Conv2d(8, 8, 3, padding=1), LayerNorm(8)]


def _poolformer() -> nn.Module:
    from timm.models.metaformer import MetaFormer

    # PoolFormer v2 (timm's defaults): Pooling mixers, StarReLU, GroupNorm1NoBias, LayerNorm2dNoBias downsampling,
    # a layer scale and a res scale (metaformer.Scale), an MlpHead after the global pool
    return MetaFormer(depths=(1, 1), dims=(8, 8), num_classes=3, layer_scale_init_values=0.5,
                      res_scale_init_values=(None, 1.0))


def _inception_next() -> nn.Module:
    from timm.models.inception_next import MetaNeXt

    return MetaNeXt(depths=(1, 1), dims=(8, 8), num_classes=3, ls_init_value=0.5)  # MetaNeXtBlock.gamma


def _convnext_v2() -> nn.Module:
    from timm.models.convnext import ConvNeXt

    # convnextv2_atto's blocks (GRN in the channels-last MLP, no layer scale) at width 8
    return ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 8, 8), num_classes=3, use_grn=True, ls_init_value=None)


def _vae() -> nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         latent_channels=2, norm_num_groups=4, mid_block_add_attention=False)


def _unet(embedding: str = "positional") -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers import UNet2DModel

        return UNet2DModel(sample_size=None, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                           down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                           layers_per_block=1, norm_num_groups=4, add_attention=False,
                           time_embedding_type=embedding)
    return build


def _upernet() -> nn.Module:
    import segmentation_models_pytorch as smp

    model = smp.UPerNet(in_channels=3, classes=2, encoder_name="tu-resnet18", encoder_weights=None, encoder_depth=3,
                        layers=(1, 1, 1, 1), stem_width=8, channels=(8, 8, 8, 8), decoder_channels=8)
    model.requires_divisible_input_shape = False  # smp's own switch: a shard's rows need not divide
    return model


def _sample(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sample


def _vq() -> nn.Module:
    from diffusers import VQModel

    return VQModel(in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
                   down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                   latent_channels=2, norm_num_groups=4, num_vq_embeddings=16, mid_block_add_attention=False)


def _sample_and_loss(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x)
    return out.sample, out.commit_loss  # the commit loss: a loss (replicated on every rank, counted once)


def _unet_call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x, torch.tensor([3, 11], dtype=torch.long)).sample


CASES: dict[str, Case] = {
    "timm.metaformer.Scale+StarReLU": Case(_seq(_scales), 12, {2: 37, 3: 37}),
    "timm.GlobalResponseNorm(NCHW)": Case(_seq(_grn), 12, {2: 37, 3: 37}, local="timm.layers.grn.GlobalResponseNorm"),
    "diffusers.Downsample2D": Case(_seq(_downsample), 12, {2: 41, 3: 47},
                                   local="diffusers.models.downsampling.Downsample2D"),
    "smp.LayerNorm2d+MiT.LayerNorm": Case(_seq(_smp_norms), 12, {2: 37, 3: 37}),
    "timm.poolformer": Case(_poolformer, 16, {2: 37, 3: 40}),
    "timm.inception_next": Case(_inception_next, 16, {2: 37, 3: 40}),
    "timm.convnext_v2": Case(_convnext_v2, 32, {2: 69, 3: 101}, local="timm.layers.grn.GlobalResponseNorm"),
    "diffusers.AutoencoderKL": Case(_vae, 12, {2: 37, 3: 38}, _sample,
                                    local="diffusers.models.downsampling.Downsample2D"),
    "diffusers.VQModel": Case(_vq, 12, {2: 37, 3: 38}, _sample_and_loss,
                              local="diffusers.models.autoencoders.vae.VectorQuantizer"),
    "diffusers.UNet2DModel(Timesteps undeclared)": Case(_unet(), 12, {2: 38, 3: 40}, _unet_call),
    "diffusers.UNet2DModel(GaussianFourierProjection)": Case(_unet("fourier"), 12, {2: 38, 3: 40}, _unet_call),
    "smp.UPerNet": Case(_upernet, 16, {2: 37, 3: 40}),
}


def Local(m: nn.Module) -> nn.Module:  # noqa: N802 - stands for a class: the local form of m
    """The real module run on this rank's shard as it is (the guard told to trust it): the per-shard computation an
    unconverted model would make. A twin of ``m`` (same state and names) whose class runs ``m``'s forward trusted."""
    from halo.guard import trusted

    kind = type(m)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with trusted():
            return kind.forward(self, *args, **kwargs)

    twin = object.__new__(type(f"Local{kind.__name__}", (kind,), {"forward": forward}))
    twin.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in m.__dict__.items()})
    return twin


def _class(dotted: str) -> type:
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _build(case: Case) -> nn.Module:
    tp.load()
    torch.manual_seed(0)
    model = case.build().double().train()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model


def _input(case: Case, world: int) -> torch.Tensor:
    shape = (2, case.channels, case.rows[world], case.width)
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def _one(rank: int, world: int, name: str, local: bool) -> dict:
    import halo
    from halo.nn import convert_to_domain_parallel

    case = CASES[name]
    model = _build(case)
    custom = {_class(case.local): lambda m, ctx: Local(m)} if local else None
    try:
        convert_to_domain_parallel(model, custom_converters=custom)
        full = _input(case, world)
        offs = split_offsets(full.shape[-2], world)
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        out = case.call(model, x)
        out, extra = out if isinstance(out, tuple) else (out, None)
        if out.dim() >= 3:  # a field: this rank's rows
            whole = halo.gather(out.detach())
            mo = split_offsets(whole.shape[-2], world)
            loss = (out * _weights(whole.shape)[..., mo[rank]:mo[rank + 1], :]).sum()
        else:  # whole on every rank (a classifier after a global pool): rank 0 backpropagates the weights
            whole = out.detach().clone()
            loss = (out * _weights(out.shape)).sum() * (1.0 if rank == 0 else 0.0)
        if extra is not None:  # a loss the model returns (a domain mean): the same on every rank, counted once
            loss = loss + extra
        loss.backward()
        grad = halo.gather(x.grad)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent asserts on it (and on every rank alike)
        return {"refused": f"{type(exc).__name__}: {exc}"}
    params = {n: p.grad for n, p in model.named_parameters()}
    return {"out": whole, "extra": None if extra is None else extra.detach(), "grad": grad, "params": params}


def _all(rank: int, world: int) -> dict:
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"  # the kernels' torch reference (Triton's interpreter: test_kernels.py)
    tp.load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    out = {}
    for name, case in CASES.items():
        for local in (False, True) if case.local else (False,):
            out[name, local] = _one(rank, world, name, local)
            out[name, local, "check"] = _check(world, name, local)
    return out


def _check(world: int, name: str, local: bool) -> tuple[bool, str]:
    """``halo.check_equivalence`` of the case (its verdict must be the truth found above): ``(ok, report)``."""
    import halo

    case = CASES[name]
    custom = {_class(case.local): lambda m, ctx: Local(m)} if local else None
    args = (torch.tensor([3, 11], dtype=torch.long),) if case.call is _unet_call else ()
    try:
        report = halo.check_equivalence(lambda: _build(case), _input(case, world), args=args,
                                        convert_kwargs={"custom_converters": custom} if custom else None)
    except Exception as exc:  # noqa: BLE001 - a refusal (the same on every rank): the parent asserts on it
        return False, f"{type(exc).__name__}: {exc}"
    return report.ok, str(report)


_RUNS: dict[int, list[dict]] = {}


def _results(world: int, name: str, local: bool) -> list[dict]:
    if world not in _RUNS:
        _RUNS[world] = run_on_ranks(_all, world, timeout=560)
    return [r[name, local] for r in _RUNS[world]]


def _reference(name: str, world: int) -> dict:
    case = CASES[name]
    model = _build(case)
    x = _input(case, world).requires_grad_(True)
    out = case.call(model, x)
    out, extra = out if isinstance(out, tuple) else (out, None)
    ((out * _weights(out.shape)).sum() + (extra if extra is not None else 0.0)).backward()
    return {"out": out.detach(), "extra": None if extra is None else extra.detach(), "grad": x.grad,
            "params": dict(model.named_parameters())}


def _differences(results: list[dict], ref: dict) -> dict[str, float]:
    """``{quantity: error relative to its largest reference value}`` for each quantity off by more than RTOL."""
    bad: dict[str, float] = {}

    def check(label: str, got: torch.Tensor | None, want: torch.Tensor | None, scale: float) -> None:
        if got is None or want is None:
            if (got is None) != (want is None) and not (want is not None and not want.abs().max() > 0):
                bad[label] = float("inf")
            return
        if got.shape != want.shape:
            bad[f"{label} shape {tuple(got.shape)} != {tuple(want.shape)}"] = float("inf")
            return
        err = float((got - want).abs().max()) / max(scale, 1e-300)
        if not err <= RTOL:
            bad[label] = err

    for r, res in enumerate(results):
        check(f"output (rank {r})", res["out"], ref["out"], float(ref["out"].abs().max()))
        check(f"input grad (rank {r})", res["grad"], ref["grad"], float(ref["grad"].abs().max()))
        if ref["extra"] is not None:
            check(f"returned loss (rank {r})", res["extra"], ref["extra"], float(ref["extra"].abs().max()))
    pscale = max(float(p.grad.abs().max()) for p in ref["params"].values() if p.grad is not None)
    for n, p in ref["params"].items():
        grads = [res["params"][n] for res in results]
        got = None if all(g is None for g in grads) else sum(g for g in grads if g is not None)
        check(f"param grad {n}", got, p.grad, pscale)
    return bad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_exact_on_shards(name, world):
    results = _results(world, name, False)
    refused = [r.get("refused") for r in results]
    assert refused[0] is None, f"{name} at P={world} must be exact, got refused on every rank alike: " \
                               f"{len(set(refused)) == 1}: {refused[0]}"
    assert all(r is None for r in refused), refused
    bad = _differences(results, _reference(name, world))
    assert not bad, f"{name} at P={world} is SILENTLY different from the unsharded model: {bad}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.local])
def test_the_local_form_differs(name, world):
    """The same model with ``CASES[name].local`` run per shard differs from the unsharded model (or is refused on
    every rank): the exact form is what makes the model above pass."""
    results = _results(world, name, True)
    refused = [r.get("refused") for r in results]
    if refused[0] is not None:
        assert len(set(refused)) == 1, refused
        return
    bad = _differences(results, _reference(name, world))
    assert bad and max(bad.values()) > LOCAL_OFF, f"{name} at P={world}: the local form is not seen to differ: {bad}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_check_equivalence_agrees(name, world):
    """``halo.check_equivalence`` says what the comparison above found (issue 32 item 7): OK for every exact case
    (FuXi-like layouts inside halo's layers, a returned loss counted once), and a difference for every local form."""
    for local in (False, True) if CASES[name].local else (False,):
        verdicts = [r[name, local, "check"] for r in _RUNS[world]] if world in _RUNS else None
        if verdicts is None:
            _results(world, name, local)
            verdicts = [r[name, local, "check"] for r in _RUNS[world]]
        assert all(v == verdicts[0] for v in verdicts), f"{name} at P={world}: ranks disagree"
        ok, text = verdicts[0]
        assert ok is (not local), f"{name} at P={world} ({'local form' if local else 'exact'}): {text}"


def test_the_per_channel_rule_reads_what_a_module_holds():
    """timm's modules with per-channel (or scalar) Parameters only and no shape read are kept (their forward under
    the guard); one that reads a shape, holds a buffer, or a parameter with extent along another dim is not."""
    tp.load()
    from timm.layers import LayerScale2d
    from timm.models.metaformer import Scale, StarReLU

    from halo.nn.timm_layers import _reads_shape, _scaled

    assert _scaled(Scale(4)) and _scaled(StarReLU()) and _scaled(LayerScale2d(4))
    from timm.models.inception_next import MetaNeXtBlock

    assert _scaled(MetaNeXtBlock(8, ls_init_value=0.5))
    from timm.models.vision_transformer import Attention

    assert _reads_shape(Attention) and not _scaled(Attention(8, qkv_bias=True))
    s = Scale(4)
    s.register_buffer("mask", torch.ones(4))
    assert not _scaled(s)
    t = Scale(4)
    t.scale = nn.Parameter(torch.ones(4, 3))  # a (C, 3) table: not one value per channel
    assert not _scaled(t)
