"""Third-party layers halo converts, recognised by name: the converter's table for classes it cannot import.

The registry (``halo.nn.registry``) maps torch's own classes, which halo imports, to their halo forms. timm,
torchvision, NATTEN, segmentation_models_pytorch, diffusers, MONAI and NCAR CREDIT are optional: halo never imports
them, so their layers are recognised here by class name, defining module and the attributes the halo form reads (a
look-alike without them is not taken for the real one and goes through the converter's usual refusals). :func:`adapter`
returns the converter ``fn(module, ctx)`` (``ctx`` a :class:`halo.nn.target.ConvertContext`) or ``None``. The larger
families keep their recognisers beside their layers (``swinv2_adapter``, ``swin_adapter``, ``timm_adapter``,
``smp_adapter``, ``diffusers_adapter``, ``monai_adapter``, ``sr_attention_adapter``); this module asks each in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..plan.plans import resolve
from . import dropout, norm
from .attention_layers import attention_adapter  # timm's and diffusers' Attention: ring attention
from .base import DomainLayer
from .credit_padding import CROSSFORMER_MODULES
from .diffusers_layers import diffusers_adapter  # diffusers' Downsample2D (a pad of the global field), Timesteps
from .longrange import DomainCrossFormerAttention
from .mobilevit import mobilevit_adapter  # timm's MobileVitBlock: whole patches, ring attention over the tokens
from .monai_layers import monai_adapter  # MONAI's ViT patch embedding, SABlock and UNETR's proj_feat
from .neighborhood import DomainNeighborhoodAttention2D
from .smp_layers import smp_adapter  # smp's U-Net decoder: resizes to global level sizes
from .spectral_layers import spectral_adapter  # torch-harmonics SHTs and SFNO's SpectralConvS2; neuralop SpectralConv
from .sr_attention import sr_attention_adapter  # PVT-v2's and SegFormer's spatial-reduction attention
from .swinv2 import swinv2_adapter  # timm's SwinTransformerV2Block; CREDIT's Swin (V2 Cr) and FuXi
from .target import ConvertContext
from .timm_layers import timm_adapter  # timm's channel norms, activations, layer scale, Conv2dSame, heads, ...
from .window import swin_adapter  # timm's SwinTransformerBlock, PatchMerging (v1), PatchEmbed

__all__ = ["DomainGridEmbedding2D", "adapter"]

#: what a converter is: ``fn(module, ctx)`` returning the replacement
Converter = Callable[[nn.Module, ConvertContext], nn.Module]


def adapter(module: nn.Module) -> Converter | None:
    """The converter of a third-party layer recognised by name (timm, torchvision, NATTEN, CREDIT, smp, diffusers),
    else None."""
    kind = type(module)
    if kind.__name__ == "BatchNormAct2d" and isinstance(module, nn.BatchNorm2d) \
            and {"drop", "act"} <= set(module._modules):  # timm.layers.BatchNormAct2d: batch norm, drop, act
        made = _checked(module, lambda m, ctx: norm.DomainBatchNormAct2d(m, group=ctx.group, dp_group=ctx.dp_group,
                                                                         mesh=ctx.mesh),
                        (2, module.num_features, 4, 5), "timm's BatchNormAct2d")
        if made is not None:
            return made
    stateless = not module._parameters and not module._buffers and not module._modules
    if stateless and (kind.__name__ == "DropPath" and hasattr(module, "drop_prob")  # timm's and its copies
                      or kind.__name__ == "StochasticDepth" and hasattr(module, "p") and hasattr(module, "mode")):
        made = _checked(module, lambda m, ctx: dropout.DomainDropPath.adopt(m, group=ctx.group, mesh=ctx.mesh),
                        (2, 3, 4, 5), f"timm's or torchvision's {kind.__name__}")  # (torchvision.ops.StochasticDepth)
        if made is not None:
            return made
    if kind.__name__.startswith("NeighborhoodAttention") and kind.__module__.split(".")[0] == "natten":
        return _natten(module)
    if kind.__name__ == "NeighborhoodAttention2D" and all(  # a copy of NATTEN < 0.20's class (with its rpb)
            hasattr(module, a) for a in ("qkv", "proj", "rpb", "num_heads", "kernel_size", "dilation", "scale")):
        side = _int(module.kernel_size) * _int(module.dilation) + 1
        made = _checked(module, lambda m, ctx: DomainNeighborhoodAttention2D(m, group=ctx.group),
                        (1, side, side, module.qkv.in_features), "NATTEN's NeighborhoodAttention2D")
        if made is not None:
            return made
    if kind.__name__ == "GridEmbedding2D" and kind.__module__.split(".")[0] == "neuralop" \
            and hasattr(module, "grid_boundaries") and callable(getattr(kind, "grid", None)):
        return _grid_embedding
    if kind.__module__.startswith(CROSSFORMER_MODULES):
        made = _crossformer_layer(module)
        if made is not None:
            return made
    made = spectral_adapter(module)  # spectral transforms (halo.nn.spectral_layers): by distributed transposes
    if made is not None:
        return made
    made = swinv2_adapter(module)
    if made is not None and kind.__name__ in ("SwinTransformerV2Block", "SwinTransformerV2CrBlock"):
        made = _checked(module, made, _block_probe(module), f"timm's {kind.__name__}")
    if made is not None:
        return made
    made = swin_adapter(module)
    if made is not None and kind.__name__ in ("PatchMerging", "PatchEmbed"):  # names many repositories use
        made = _checked(module, made, _swin_probe(module), f"timm's {kind.__name__}")
    elif made is not None and kind.__name__ == "SwinTransformerBlock":
        made = _checked(module, made, _block_probe(module), f"timm's {kind.__name__}")
    if made is not None:
        return made
    return (mobilevit_adapter(module) or timm_adapter(module)
            or smp_adapter(module)
            or diffusers_adapter(module) or monai_adapter(module) or sr_attention_adapter(module)
            or attention_adapter(module))  # attention over all tokens (halo.nn.attention_layers): ring attention


#: the packages whose classes halo's by-name recognisers were written from (and are tested on)
_HOMES = ("timm", "torchvision")
#: the context a probe converts in: this process alone (``halo.dist.comm.unsharded``)
_ALONE = ConvertContext(group=None, dp_group=None, boundary=None)


def _checked(module: nn.Module, make: Converter, shapes: tuple[int, ...] | list[tuple[int, ...]],
             what: str) -> Converter | None:
    """``make`` for a layer recognised by name, if it is what its name says. A class of timm or torchvision is
    taken as it is (halo's forms are tested on them). A class of that name defined elsewhere (a copy in a user's or
    another library's repository, or another layer that shares the name) must compute what halo's form computes:
    both run in this process on a random float64 input (the first of ``shapes``, a shape or a list of layouts to
    try, that the layer's own forward takes), in eval mode and, where the layer draws nothing, in train mode (on
    copies: the model is untouched). If they differ or either fails, it is not taken for the real one (``None``:
    its forward is then converted by the usual rules and watched by the guard, exact or refused) and halo says so:
    a look-alike replaced by halo's form would compute halo's forward, not its own, silently."""
    kind = type(module)
    if kind.__module__.split(".")[0] in _HOMES or "_halo_swapped_from" in kind.__dict__:
        return make
    import copy
    import warnings

    from ..dist.comm import unsharded

    modes = ("eval", "train") if not any(isinstance(m, nn.modules.dropout._DropoutNd) or
                                         type(m).__name__ in ("DropPath", "StochasticDepth")
                                         for m in module.modules()) else ("eval",)
    device = next(iter((*module.parameters(), *module.buffers())), torch.empty(0)).device  # (the layer's own)

    def run(m: nn.Module, x: torch.Tensor, mode: str) -> Any:
        return m.double().train(mode == "train")(x.clone())

    why = None
    try:
        with torch.no_grad(), unsharded():
            layouts = [shapes] if isinstance(shapes, tuple) else list(shapes)
            for shape in layouts:  # the first layout the layer's own forward takes
                x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
                try:
                    run(copy.deepcopy(module), x, "eval")
                    break
                except Exception:  # noqa: BLE001 - not this layout: the next (the last one's error is said)
                    if shape is layouts[-1]:
                        raise
            for mode in modes:
                a = run(copy.deepcopy(module), x, mode)
                b = run(make(copy.deepcopy(module), _ALONE), x, mode)
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                        and torch.allclose(a, b, rtol=1e-9, atol=1e-12)):
                    why = f"its forward computes otherwise (in {mode} mode, on a random input of shape {shape})"
                    break
    except Exception as exc:  # noqa: BLE001 - any failure: not the real one
        why = f"its forward or halo's form failed on a random input ({type(exc).__name__}: {exc})"
    if why is None:
        return make
    warnings.warn(f"halo: {kind.__module__}.{kind.__qualname__} has the name and attributes of {what}, but {why}; "
                  f"halo does not convert it as {what} (it converts its children and watches its forward)",
                  stacklevel=4)
    return None


def _int(v: Any) -> int:
    return int(v[0]) if isinstance(v, tuple | list) else int(v)


def _block_probe(module: nn.Module) -> list[tuple[int, ...]]:
    """Inputs of a look-alike of a Swin block at its declared resolution, channels last or first."""
    res = tuple(getattr(module, "input_resolution", None) or getattr(module, "feat_size", None) or (8, 8))
    dim = module._modules["norm1"].normalized_shape[0]
    return [(1, *res, dim), (1, dim, *res)]


def _swin_probe(module: nn.Module) -> tuple[int, ...]:
    """A small input of a look-alike of timm's ``PatchMerging`` ((B, H, W, C), C a quarter of the reduction's
    input) or ``PatchEmbed`` ((B, C, H, W): its declared size where it checks it, else two patches a side)."""
    mods = module._modules
    if type(module).__name__ == "PatchMerging":
        return (2, 4, 4, mods["reduction"].in_features // 4)
    proj = mods["proj"]
    size = getattr(module, "img_size", None)
    if size is None or not getattr(module, "strict_img_size", True):
        size = tuple(2 * k for k in proj.kernel_size)
    return (1, proj.in_channels, *size)


def _crossformer_layer(module: nn.Module) -> Converter | None:
    """NCAR CREDIT's CrossFormer / WXFormer layers: its attention (short or long distance) becomes halo's; its
    channel LayerNorm and its position-bias MLP are pointwise in latitude and kept."""
    kind = type(module)
    if kind.__name__ == "Attention" and all(hasattr(module, a) for a in (
            "attn_type", "window_size", "heads", "scale", "norm", "to_qkv", "to_out", "dpb", "rel_pos_indices")):
        return lambda m, ctx: DomainCrossFormerAttention(m, group=ctx.group)
    if kind.__name__ == "LayerNorm" and set(module._parameters) == {"g", "b"} \
            and tuple(module.g.shape[2:]) == (1, 1):  # over channels (dim 1): pointwise in latitude
        return lambda m, ctx: m
    if kind.__name__ == "DynamicPositionBias" and hasattr(module, "layers"):  # an MLP of relative positions
        return lambda m, ctx: m
    return None


def _natten(module: nn.Module) -> Converter:
    """NATTEN's own classes, every version (0.14-0.21): ``NeighborhoodAttention2D`` becomes halo's
    :class:`DomainNeighborhoodAttention2D` (exact: NATTEN's clamped windows, with its ``rpb`` before 0.20 and without
    it from 0.20 on, where NATTEN dropped relative position biases); what halo has no form of is refused by name at
    conversion (the same on every rank): 1-D and 3-D neighbourhoods, strided (0.20's ``stride``) and causal ones."""
    kind = type(module)
    name = f"{kind.__module__}.{kind.__name__}"
    problem = None
    if kind.__name__ != "NeighborhoodAttention2D":
        problem = (f"halo converts NATTEN's 2-D neighbourhood attention over (B, H, W, C) only; {kind.__name__} "
                   f"(a {kind.__name__[-2:]} neighbourhood) has no domain-parallel form in halo")
    elif not all(hasattr(module, a) for a in ("qkv", "proj", "num_heads", "kernel_size", "dilation", "scale")):
        problem = ("this NATTEN version's class lacks the attributes halo reads (qkv, proj, num_heads, kernel_size, "
                   "dilation, scale)")
    else:
        stride = getattr(module, "stride", 1)
        causal = getattr(module, "is_causal", False)
        if any(s != 1 for s in (stride if isinstance(stride, (tuple, list)) else (stride,))):
            problem = f"strided neighbourhoods (stride={tuple(stride) if isinstance(stride, list) else stride}) " \
                      f"have no domain-parallel form in halo"
        elif any(causal) if isinstance(causal, (tuple, list)) else causal:
            problem = f"causal neighbourhoods (is_causal={causal}) have no domain-parallel form in halo"
    if problem is None:
        return lambda m, ctx: DomainNeighborhoodAttention2D(m, group=ctx.group)

    def refuse(m: nn.Module, ctx: ConvertContext) -> nn.Module:
        raise ValueError(f"{name}: {problem}; run on each shard it would attend within the shard's rows only "
                         f"(silently different from the unsharded model). Gather before it (halo.gather), or give "
                         f"custom_converters={{{kind.__name__}: fn}} returning a module that computes the same on an "
                         f"H-shard")

    return refuse


def _grid_embedding(module: nn.Module, ctx: ConvertContext) -> nn.Module:
    if ctx.mesh is not None and len(getattr(ctx.mesh, "domain_shape", (1,))) == 2:
        raise ValueError(f"{type(module).__module__}.{type(module).__name__}: halo converts it on latitude rows "
                         f"only (its grid along a sharded W would be the shard's); shard latitude only")
    return DomainGridEmbedding2D(module, group=ctx.group)


def _rows(cg: Any, extents: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
    """This rank's first row and the global rows (agreed extents)."""
    (sizes,) = extents
    return sum(sizes[:cg.index]), sum(sizes)


class DomainGridEmbedding2D(DomainLayer, nn.Module):
    """neuraloperator's ``GridEmbedding2D`` on an H-shard: the coordinate channels of the *global* grid's rows this
    rank holds. The original builds its grid from its input's shape, which on a shard is the shard's (each rank's
    coordinates would run 0..1 over its own rows: silently wrong, and invisible to the guard, which sees only the
    ints); here the grid is neuraloperator's own (``GridEmbedding2D.grid``) of the global extent, agreed on every
    rank, cut to this rank's rows. No parameters: the state dict is unchanged."""

    def __init__(self, embedding: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        self.in_channels = embedding.in_channels
        self.grid_boundaries = embedding.grid_boundaries
        self._grid, self._res = None, None
        self._make_grid = type(embedding).grid  # neuraloperator's grid of a whole (h, w) field
        self.halo_init(group)

    @property
    def out_channels(self) -> int:
        return self.in_channels + 2

    def forward(self, data: torch.Tensor, batched: bool = True) -> torch.Tensor:
        if not batched and data.ndim == 3:
            data = data.unsqueeze(0)
        first, rows = resolve(data, self.group, type(self).__name__, _rows, site=self._halo_site, spec=(-2,))
        batch = data.shape[0]
        x, y = self._make_grid(self, (rows, data.shape[-1]), data.device, data.dtype)
        x, y = (g.narrow(-2, first, data.shape[-2]) for g in (x, y))
        out = torch.cat((data, x.expand(batch, -1, -1, -1), y.expand(batch, -1, -1, -1)), dim=1)
        return out.squeeze(0) if not batched and batch == 1 else out
