"""Domain-parallel layers: each equals its torch twin on the full field, forward and backward.

Which torch class becomes which of these, and on which axes, is :func:`converts` (``halo.nn.registry``), beside each
layer's class; the exports below stay explicit (functions and adapter-made layers are not in the registry)."""

from . import attention_layers  # noqa: F401 - registers nn.MultiheadAttention (@converts)
from .conv import HaloConv2d, HaloConv3d, HaloConvTranspose2d, HaloConvTranspose3d
from .convert import convert_to_domain_parallel, revert_domain_parallel
from .dropout import (
    DomainAlphaDropout,
    DomainDropout,
    DomainDropout1d,
    DomainDropout2d,
    DomainDropout3d,
    DomainDropPath,
    DomainFeatureAlphaDropout,
)
from .longrange import DomainCrossFormerAttention, columns_to_rows, regroup, rows_to_columns
from .neighborhood import DomainNeighborhoodAttention2D, neighborhood_attention, neighborhood_attention_reference
from .norm import DomainBatchNorm2d, DomainBatchNormAct2d, DomainGroupNorm, DomainInstanceNorm2d, DomainLayerNorm
from .pad import HaloPad2d, halo_pad, pad_like
from .pool import (
    HaloAdaptiveAvgPool2d,
    HaloAdaptiveMaxPool2d,
    HaloAvgPool2d,
    HaloAvgPool3d,
    HaloLPPool2d,
    HaloMaxPool2d,
    HaloMaxPool3d,
)
from .registry import converts
from .shuffle import HaloPixelShuffle, HaloPixelUnshuffle
from .softmax import DomainLogSoftmax, DomainSoftmax
from .spectral_layers import (
    DomainAFNO2D,
    DomainInverseRealFFT2,
    DomainInverseRealSHT,
    DomainRealFFT2,
    DomainRealSHT,
    DomainSpectralConv,
    DomainSpectralConvS2,
)
from .swinv2 import HaloCreditPatchEmbed, HaloCubeEmbedding, HaloSwinV2Block, HaloUTransformer, HaloWindowAttentionV2
from .timm_layers import DomainBlurPool2d, DomainSelectAdaptivePool2d, DomainSqueezeExcite, HaloConv2dSame
from .upsample import HaloUpsample, halo_interpolate
from .window import (
    HaloPatchEmbed,
    HaloPatchMerging,
    HaloSwinTransformerBlock,
    HaloWindowAttention,
    halo_roll,
    window_attention_mask,
    window_partition,
    window_reverse,
)

__all__ = [
    "DomainAFNO2D",
    "DomainAlphaDropout",
    "DomainBatchNorm2d",
    "DomainBatchNormAct2d",
    "DomainBlurPool2d",
    "DomainCrossFormerAttention",
    "DomainDropPath",
    "DomainDropout",
    "DomainDropout1d",
    "DomainDropout2d",
    "DomainDropout3d",
    "DomainFeatureAlphaDropout",
    "DomainGroupNorm",
    "DomainInstanceNorm2d",
    "DomainInverseRealFFT2",
    "DomainInverseRealSHT",
    "DomainLayerNorm",
    "DomainLogSoftmax",
    "DomainNeighborhoodAttention2D",
    "DomainRealFFT2",
    "DomainRealSHT",
    "DomainSelectAdaptivePool2d",
    "DomainSoftmax",
    "DomainSpectralConv",
    "DomainSpectralConvS2",
    "DomainSqueezeExcite",
    "HaloAdaptiveAvgPool2d",
    "HaloAdaptiveMaxPool2d",
    "HaloAvgPool2d",
    "HaloAvgPool3d",
    "HaloLPPool2d",
    "HaloConv2d",
    "HaloConv2dSame",
    "HaloConv3d",
    "HaloConvTranspose2d",
    "HaloConvTranspose3d",
    "HaloCreditPatchEmbed",
    "HaloCubeEmbedding",
    "HaloMaxPool2d",
    "HaloMaxPool3d",
    "HaloPad2d",
    "HaloPatchEmbed",
    "HaloPatchMerging",
    "HaloPixelShuffle",
    "HaloPixelUnshuffle",
    "HaloSwinTransformerBlock",
    "HaloSwinV2Block",
    "HaloUTransformer",
    "HaloUpsample",
    "HaloWindowAttention",
    "HaloWindowAttentionV2",
    "columns_to_rows",
    "convert_to_domain_parallel",
    "converts",
    "halo_interpolate",
    "halo_pad",
    "halo_roll",
    "neighborhood_attention",
    "neighborhood_attention_reference",
    "pad_like",
    "regroup",
    "revert_domain_parallel",
    "rows_to_columns",
    "window_attention_mask",
    "window_partition",
    "window_reverse",
]
