"""Third-party layers halo converts, recognised by name: the converter's table for classes it cannot import.

The registry (``halo.nn.registry``) maps torch's own classes, which halo imports, to their halo forms. timm,
torchvision, NATTEN, segmentation_models_pytorch and NCAR CREDIT are optional: halo never imports them, so their
layers are recognised here by class name, defining module and the attributes the halo form reads (a look-alike
without them is not taken for the real one and goes through the converter's usual refusals). :func:`adapter`
returns the converter ``fn(module, ctx)`` (``ctx`` a :class:`halo.nn.target.ConvertContext`) or ``None``. The larger
families keep their recognisers beside their layers (``swinv2_adapter``, ``swin_adapter``, ``timm_adapter``,
``smp_adapter``); this module asks each in turn.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from . import dropout, norm
from .credit_padding import CROSSFORMER_MODULES
from .longrange import DomainCrossFormerAttention
from .neighborhood import DomainNeighborhoodAttention2D
from .smp_layers import smp_adapter  # smp's U-Net decoder: resizes to global level sizes
from .spectral_layers import spectral_adapter  # torch-harmonics SHTs and SFNO's SpectralConvS2; neuralop SpectralConv
from .swinv2 import swinv2_adapter  # timm's SwinTransformerV2Block; CREDIT's Swin (V2 Cr) and FuXi
from .target import ConvertContext
from .timm_layers import timm_adapter  # timm's channel norms, activations, layer scale, Conv2dSame, heads, ...
from .window import swin_adapter  # timm's SwinTransformerBlock, PatchMerging (v1), PatchEmbed

__all__ = ["adapter"]

#: what a converter is: ``fn(module, ctx)`` returning the replacement
Converter = Callable[[nn.Module, ConvertContext], nn.Module]


def adapter(module: nn.Module) -> Converter | None:
    """The converter of a third-party layer recognised by name (timm, torchvision, NATTEN, CREDIT, smp), else None."""
    kind = type(module)
    if kind.__name__ == "BatchNormAct2d" and isinstance(module, nn.BatchNorm2d) \
            and {"drop", "act"} <= set(module._modules):  # timm.layers.BatchNormAct2d: batch norm, drop, act
        return lambda m, ctx: norm.DomainBatchNormAct2d(m, group=ctx.group, dp_group=ctx.dp_group, mesh=ctx.mesh)
    stateless = not module._parameters and not module._buffers and not module._modules
    if stateless and kind.__name__ == "DropPath" and hasattr(module, "drop_prob"):  # timm's and its copies
        return lambda m, ctx: dropout.DomainDropPath.adopt(m, group=ctx.group, mesh=ctx.mesh)
    if stateless and kind.__name__ == "StochasticDepth" and hasattr(module, "p") and hasattr(module, "mode"):
        return lambda m, ctx: dropout.DomainDropPath.adopt(m, group=ctx.group, mesh=ctx.mesh)  # torchvision.ops
    if kind.__name__ == "NeighborhoodAttention2D" and all(  # natten.NeighborhoodAttention2D (any version)
            hasattr(module, a) for a in ("qkv", "proj", "rpb", "num_heads", "kernel_size", "dilation", "scale")):
        return lambda m, ctx: DomainNeighborhoodAttention2D(m, group=ctx.group)
    if kind.__module__.startswith(CROSSFORMER_MODULES):
        made = _crossformer_layer(module)
        if made is not None:
            return made
    made = spectral_adapter(module)  # spectral transforms (halo.nn.spectral_layers): by distributed transposes
    if made is not None:
        return made
    return swinv2_adapter(module) or swin_adapter(module) or timm_adapter(module) or smp_adapter(module)


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
