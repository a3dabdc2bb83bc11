"""The real third-party model zoo for ``tests/test_zoo_real.py``: timm, segmentation_models_pytorch, diffusers and
NCAR CREDIT (``miles-credit``), the users' own classes at tiny widths (never a transcription).

``missing()`` says which packages are not installed (the zoo test is skipped with that reason). Everything else
imports them lazily, so collecting the tests costs nothing without them.

The one stand-in: PyPI's ``torchvision`` wheel is a CUDA build whose compiled ops (``torchvision::nms``, ...) do not
load beside a CPU torch, and ``import torchvision`` then fails registering fake kernels for ops that do not exist
("operator torchvision::nms does not exist"). timm, smp and diffusers import torchvision, but none of the models
here calls a detection op: :func:`_torchvision_schemas` defines the schemas of the two ops torchvision registers
unconditionally (``nms``, ``qnms``; no kernels) before the import, so torchvision's Python side loads. A call of
either op would raise torch's "no kernel" error, never compute anything. Where torchvision's ops load (a matching
CPU build), nothing is defined.

Install (about 35 s and 170 MB; ``--no-deps`` keeps pip from replacing the CPU torch with torchvision's pinned CUDA
build, and from pulling miles-credit's data-side stack)::

    pip install --no-deps timm==1.0.31 segmentation-models-pytorch==0.6.0 torchvision==0.28.0 diffusers==0.42.1 \
        miles-credit==2026.2.0 torch-harmonics==0.8.0 cftime==1.6.6.1
    pip install huggingface_hub safetensors tqdm einops regex requests importlib_metadata

(``credit.models`` also imports xarray and pandas, which the ``test`` extra brings; torch-harmonics 0.8.0 is an
sdist that builds without its C++ extension in pip's isolated build.)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PACKAGES = {"timm": "timm", "segmentation_models_pytorch": "segmentation-models-pytorch",
            "diffusers": "diffusers", "credit": "miles-credit", "torchvision": "torchvision", "monai": "monai"}

_LIB: list[Any] = []  # the stand-in's torch.library.Library (kept alive: dropping it removes the schemas)


def missing() -> list[str]:
    """The PyPI names of the zoo's packages that are not installed."""
    return [pip for mod, pip in PACKAGES.items() if importlib.util.find_spec(mod) is None]


def _torchvision_schemas() -> None:
    if _LIB:
        return
    try:
        torch.ops.load_library(_torchvision_so())  # a torchvision whose ops match this torch: use them
        return
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.append(lib)


def _torchvision_so() -> str:
    import os

    spec = importlib.util.find_spec("torchvision")
    return os.path.join(os.path.dirname(spec.origin), "_C.so")


def load() -> None:
    """Import the zoo's packages (after the torchvision stand-in)."""
    _torchvision_schemas()
    import diffusers  # noqa: F401
    import segmentation_models_pytorch  # noqa: F401
    import timm  # noqa: F401
    import torchvision  # noqa: F401


@dataclass(frozen=True)
class Spec:
    """One zoo model: ``build()`` (seeded by the caller), its input ``(B, C, H, W)`` or ``(B, C, T, H, W)`` with
    the rows per world size, and ``call(model, x)`` returning a tensor or a list of tensors."""

    build: Callable[[], nn.Module]
    channels: int
    width: int
    rows: dict[int, int]  # world size -> global rows (uneven over the ranks)
    call: Callable[[nn.Module, torch.Tensor], Any] = lambda m, x: m(x)
    frames: int = 0  # > 0: a 5-d (B, C, T, H, W) input (CREDIT)
    dropout: bool = False  # keep the model's dropout rates (a refusal test, or a draw halo makes exact); else 0
    #: what the unsharded reference changes in its model (its head's dropout drawing as halo's does in one process)
    reference: Callable[[nn.Module], None] | None = None
    #: what a user declares (README): dotted class names of layers that act pointwise on fields -> None
    custom: tuple[str, ...] = ()

    def converters(self) -> dict[type, None]:
        import importlib

        out = {}
        for dotted in self.custom:
            module, _, name = dotted.rpartition(".")
            out[getattr(importlib.import_module(module), name)] = None
        return out


# -- timm ----------------------------------------------------------------------------------------------------------

def _efficientnet(variant: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from timm.models.efficientnet import _gen_efficientnet

        return _gen_efficientnet(variant, channel_multiplier=0.1, depth_multiplier=0.1, num_classes=3, **kw)
    return build


def _mobilenetv3() -> nn.Module:
    from timm.models.mobilenetv3 import _gen_mobilenet_v3

    return _gen_mobilenet_v3("mobilenetv3_small_100", channel_multiplier=0.25, num_classes=3)


def _timm_resnet() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=3, stem_width=8, channels=(8, 8, 12, 12))


def _timm_convnext() -> nn.Module:
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(in_chans=3, num_classes=3, depths=(1, 1, 1, 1), dims=(8, 8, 8, 8), ls_init_value=0.5)


def _timm_regnet() -> nn.Module:
    from timm.models.regnet import RegNet, RegNetCfg

    cfg = RegNetCfg(depth=4, w0=8, wa=12.0, wm=1.5, group_size=4, se_ratio=0.25)
    return RegNet(cfg, in_chans=3, num_classes=3)


def _timm_swinv2() -> nn.Module:
    """timm's ``SwinTransformerV2`` at one stage (windows of 2 x 2 patches of 2; 48 rows keep whole windows on 2 and 3
    ranks); its ``PatchMerging`` (norm after the reduction) is not converted, so no second stage. Its head pools
    channels-last features (``FastAdaptiveAvgPool`` over dims 1, 2)."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    return SwinTransformerV2(img_size=(48, 16), patch_size=2, in_chans=3, num_classes=3, embed_dim=8, depths=(2,),
                             num_heads=(2,), window_size=2, mlp_ratio=2.0)


def _timm_fastvit() -> nn.Module:
    from timm.models.fastvit import FastVit

    return FastVit(in_chans=3, num_classes=3, layers=(1, 1, 1, 1), embed_dims=(8, 8, 16, 32), mlp_ratios=(2, 2, 2, 2),
                   token_mixers=("repmixer", "repmixer", "repmixer", "attention"), pos_embs=(None, None, None, None))


def _timm_repvit() -> nn.Module:
    """RepViT at two stages (stride 16): its distillation head's ``NormLinear`` (a BatchNorm1d on the model's mean
    over H x W, then a linear layer) is :class:`halo.nn.timm_layers.WholeBatchNorm1d`'s case."""
    from timm.models.repvit import RepVit

    return RepVit(in_chans=3, embed_dim=(8, 16), depth=(1, 1), num_classes=3, distillation=True)


def _timm_coat() -> nn.Module:
    """CoaT-Lite, tiny: a class token per stage beside the patch tokens (refused: it belongs to no rank's rows)."""
    import timm

    return timm.create_model("coat_lite_tiny", pretrained=False, num_classes=4, embed_dims=[8, 8, 8, 8],
                             serial_depths=[1, 1, 1, 1], num_heads=2, mlp_ratios=[2, 2, 2, 2], img_size=64)


def _timm_mixer(kind: str) -> Callable[[], nn.Module]:
    """MLP-Mixer, ResMLP and gMLP (timm's ``MlpMixer`` with their blocks), tiny: an ``nn.Linear`` over the tokens
    (token mixing, gMLP's spatial gating) that must be refused, not run on a shard's tokens."""
    def build() -> nn.Module:
        from timm.layers import GatedMlp
        from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock, SpatialGatingBlock

        blocks = {"mixer": {}, "resmlp": {"block_layer": ResBlock, "norm_layer": Affine, "mlp_ratio": 4},
                  "gmlp": {"block_layer": SpatialGatingBlock, "mlp_layer": GatedMlp, "mlp_ratio": 6}}[kind]
        return MlpMixer(num_classes=4, img_size=64, patch_size=16, num_blocks=1, embed_dim=16, **blocks)
    return build


def _lite_mla_attn(self: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """EfficientViT's ``LiteMLA._attn`` in its inputs' dtype: timm's casts to float32 (``q.float()``), whose
    rounding would hide a difference of 1e-7 from the float64 comparison."""
    kv = k.transpose(-1, -2) @ v
    out = q @ kv
    return out[..., :-1] / (out[..., -1:] + self.eps)


def _timm_efficientvit() -> nn.Module:
    """MIT's EfficientViT-B0 (timm ``efficientvit_mit``): linear attention over all tokens (``k^T @ v``, contracting
    them: the guard's domain sum), multi-scale aggregation convs, a ``ClassifierHead`` whose conv and BatchNorm run on
    the field before its pool. Its attention kept in float64 (``_lite_mla_attn``)."""
    import types

    import timm

    model = timm.create_model("efficientvit_b0", pretrained=False, num_classes=4)
    for m in model.modules():
        if type(m).__name__ == "LiteMLA":
            m._attn = types.MethodType(_lite_mla_attn, m)
    return model


def _timm(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=4, **kw)
    return build


def _timm_focalnet() -> nn.Module:
    """FocalNet, tiny: one block a stage, 16 channels (its focal modulation's global context: a mean over H, W)."""
    from timm.models.focalnet import FocalNet

    return FocalNet(depths=(1, 1, 1, 1), embed_dim=16, num_classes=4)


def _timm_mobilevit() -> nn.Module:
    """MobileViT at two MobileViT blocks (patches of 2 x 2 at 1/4 and 1/8): their attention over all patches is
    ring attention, their patch rows regrouped whole where a split cuts a patch (``halo.nn.mobilevit``)."""
    from timm.models.byobnet import ByobNet, ByoModelCfg
    from timm.models.mobilevit import _inverted_residual_block, _mobilevit_block

    cfg = ByoModelCfg(blocks=(_inverted_residual_block(d=1, c=8, s=1, br=2.0),
                              _mobilevit_block(d=1, c=8, s=2, transformer_dim=8, transformer_depth=1, patch_size=2,
                                               br=2.0),
                              _mobilevit_block(d=1, c=16, s=2, transformer_dim=16, transformer_depth=1, patch_size=2,
                                               br=2.0)),
                      stem_chs=8, stem_type="3x3", stem_pool="", downsample="", act_layer="silu", num_features=32)
    return ByobNet(cfg, num_classes=3, in_chans=3)


def _timm_mobilevitv2() -> nn.Module:
    """MobileViT V2 at two blocks: linear self-attention (a softmax over all patches and a sum over them, which the
    guard computes over the domain), ``GroupNorm1`` over the patches (``halo.nn.mobilevit``)."""
    from timm.models.byobnet import ByobNet, ByoModelCfg
    from timm.models.mobilevit import _inverted_residual_block, _mobilevitv2_block

    cfg = ByoModelCfg(blocks=(_inverted_residual_block(d=1, c=8, s=1, br=2.0),
                              _mobilevitv2_block(d=1, c=16, s=2, transformer_depth=1),
                              _mobilevitv2_block(d=1, c=16, s=2, transformer_depth=1)),
                      stem_chs=8, stem_type="3x3", stem_pool="", downsample="", act_layer="silu")
    return ByobNet(cfg, num_classes=3, in_chans=3)


# -- smp -----------------------------------------------------------------------------------------------------------

_ENCODER = {"encoder_name": "tu-resnet18", "encoder_weights": None, "encoder_depth": 3,
            "layers": (1, 1, 1, 1), "stem_width": 8, "channels": (8, 8, 8, 8)}


def _smp_dpt() -> nn.Module:
    """smp's DPT on timm's ViT-Tiny (class token and position table: refused)."""
    import segmentation_models_pytorch as smp

    return smp.DPT(encoder_name="tu-vit_tiny_patch16_224", encoder_weights=None, encoder_depth=4,
                   decoder_intermediate_channels=(8, 8, 8, 8), decoder_fusion_channels=8, classes=2,
                   dynamic_img_size=True)


def _smp(kind: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        model = getattr(smp, kind)(in_channels=3, classes=2, **{**_ENCODER, **kw})
        model.requires_divisible_input_shape = False  # smp's own switch: the local shard's rows need not divide
        return model
    return build


# -- diffusers -----------------------------------------------------------------------------------------------------

def _unet2d(attention: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers import UNet2DModel

        return UNet2DModel(sample_size=None, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                           down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                           layers_per_block=1, norm_num_groups=4, attention_head_dim=4,
                           add_attention=attention, resnet_time_scale_shift="scale_shift")
    return build


def _unet2d_call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    t = torch.tensor([3, 11], dtype=torch.long)[: x.shape[0]]
    return model(x, t).sample


def _unet2d_cond() -> nn.Module:
    """Stable Diffusion's U-Net class, tiny: self- and cross-attention (``Transformer2DModel``) at the full-size level,
    in the mid block and on the way up."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(sample_size=None, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                                norm_num_groups=4, attention_head_dim=4, cross_attention_dim=8)


def _unet2d_cond_call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The timesteps and a text context (5 tokens), the same on every rank."""
    t = torch.tensor([3, 11], dtype=torch.long)[: x.shape[0]]
    context = torch.randn(x.shape[0], 5, 8, dtype=x.dtype, generator=torch.Generator().manual_seed(7))
    return model(x, t, encoder_hidden_states=context).sample


# -- MONAI ---------------------------------------------------------------------------------------------------------

def _monai(kind: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import monai.networks.nets as nets

        return getattr(nets, kind)(spatial_dims=2, in_channels=3, out_channels=2, **kw)
    return build


def _unetr() -> nn.Module:
    """A 2-d UNETR for an 80 x 32 grid: 16 x 16 patches, 5 x 2 of them, a 12-block ViT (its 3rd, 6th, 9th hidden
    states feed the decoder)."""
    from monai.networks.nets import UNETR

    return UNETR(in_channels=3, out_channels=2, img_size=(80, 32), spatial_dims=2, feature_size=4, hidden_size=16,
                 mlp_dim=32, num_heads=2, proj_type="conv")


# -- NCAR CREDIT ---------------------------------------------------------------------------------------------------

def _credit_crossformer() -> nn.Module:
    from credit.models.wxformer.crossformer import CrossFormer

    return CrossFormer(image_height=64, image_width=32, frames=1, channels=1, surface_channels=2,
                       input_only_channels=0, levels=1, dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4,
                       global_window_size=(2, 1, 1, 1), local_window_size=2,
                       cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
                       use_spectral_norm=False, interp=False)


def _credit_unet() -> nn.Module:
    from credit.models.unet import SegmentationModel

    arch = {"name": "unet", **_ENCODER, "decoder_channels": (16, 16, 16)}
    model = SegmentationModel(image_height=40, image_width=16, frames=1, channels=1, surface_channels=2,
                              input_only_channels=0, levels=1, architecture=arch)
    model.model.requires_divisible_input_shape = False
    return model


def credit_swin(height: int = 48) -> nn.Module:
    """CREDIT's Swin (``SwinTransformerV2Cr``, timm's V2 ``cr`` blocks): patch 2, windows of 4 x 4 patches, one stage
    of 2 blocks (the second shifted), width 8. Windows stay whole on P ranks when ``height / 2`` splits into whole
    windows of 4 rows."""
    from credit.models.swin import SwinTransformerV2Cr

    return SwinTransformerV2Cr(img_size=(height, 16), patch_size=2, window_size=4, channels=1, levels=1,
                               surface_channels=2, input_only_channels=0, frames=1, embed_dim=8, depths=(2,),
                               num_heads=(2,), mlp_ratio=2.0)


def credit_fuxi(height: int = 48, pad: bool = False) -> nn.Module:
    """CREDIT's FuXi (cube embedding of 2 frames, a 2x down block, timm's ``SwinTransformerV2Stage`` of 2 blocks,
    up block), patch 2, width 8, windows of 2 rows (``pad``: of 4, so that a level of ``height / 4`` rows that is not
    a window multiple is padded by FuXi above and below). No spectral norm, no final interpolation (CREDIT's
    switches)."""
    from credit.models.fuxi import Fuxi

    return Fuxi(image_height=height, patch_height=2, image_width=16, patch_width=2, levels=1, frames=2,
                frame_patch_size=2, dim=8, num_groups=2, channels=1, surface_channels=2, input_only_channels=0,
                num_heads=2, depth=2, window_size=4 if pad else 2, use_spectral_norm=False, interp=False)


#: diffusers' sinusoidal embedding of the timesteps (B,): no field goes through it
_TIMESTEPS = ("diffusers.models.embeddings.Timesteps",)

W = 16
WT = 32  # timm classifiers reduce 32x
TIMM_ROWS = {2: 69, 3: 101}  # >= 2 rows a rank at 1/32 (uneven splits at every level)

ZOO: dict[str, Spec] = {
    "timm.resnet": Spec(_timm_resnet, 3, WT, TIMM_ROWS),
    "timm.convnext": Spec(_timm_convnext, 3, WT, TIMM_ROWS),
    "timm.efficientnet": Spec(_efficientnet("efficientnet_b0"), 3, WT, TIMM_ROWS),
    "timm.tf_efficientnet": Spec(_efficientnet("tf_efficientnet_b0", bn_eps=1e-3, pad_type="same"), 3, WT,
                                 TIMM_ROWS),
    "timm.mobilenetv3": Spec(_mobilenetv3, 3, WT, TIMM_ROWS),
    "timm.fastvit": Spec(_timm_fastvit, 3, WT, TIMM_ROWS),
    "timm.regnet": Spec(_timm_regnet, 3, WT, TIMM_ROWS),
    "timm.repvit": Spec(_timm_repvit, 3, W, {2: 37, 3: 53}),  # >= 1 row a rank at 1/16
    # even rows at 1/4 and 1/8 (whole patches of 2 globally), split so that a rank's patch rows are cut: 48 rows are
    # 3 + 3 at 1/8 on 2 ranks, 80 are 7 + 7 + 6 at 1/4 on 3
    "timm.mobilevit": Spec(_timm_mobilevit, 3, W, {2: 48, 3: 80}),
    "timm.mobilevitv2": Spec(_timm_mobilevitv2, 3, W, {2: 48, 3: 80}),
    "timm.swinv2": Spec(_timm_swinv2, 3, W, {2: 48, 3: 48}),
    "timm.coat": Spec(_timm_coat, 3, 64, {2: 64, 3: 64}),  # refused at conversion: its class tokens
    # 64 rows halve five times: 1 row a rank at 1/32 on 2 ranks; 96 on 3 (the head's BatchNorm over 1-row shards)
    "timm.efficientvit": Spec(_timm_efficientvit, 3, 64, {2: 64, 3: 96}),
    # ECA's Conv1d over the channels of the global mean (halo.nn.timm_layers._eca); FocalNet's global context (a mean
    # over H and W in its modulation); VoVNet's eSE; MixNet's mixed kernel sizes
    "timm.eca_resnet": Spec(_timm("eca_resnet33ts"), 3, WT, TIMM_ROWS),
    "timm.focalnet": Spec(_timm_focalnet, 3, WT, {2: 64, 3: 96}),
    "timm.vovnet": Spec(_timm("ese_vovnet19b_dw"), 3, WT, TIMM_ROWS),
    "timm.mixnet": Spec(_timm("mixnet_s"), 3, WT, TIMM_ROWS),
    "timm.mixer": Spec(_timm_mixer("mixer"), 3, 64, {2: 64, 3: 64}),  # refused: a Linear over the tokens
    "timm.gmlp": Spec(_timm_mixer("gmlp"), 3, 64, {2: 64, 3: 64}),
    "timm.resmlp": Spec(_timm_mixer("resmlp"), 3, 64, {2: 64, 3: 64}),
    "smp.Unet": Spec(_smp("Unet", decoder_channels=(16, 16, 16), decoder_attention_type="scse"), 3, W,
                     {2: 37, 3: 40}),
    # 40 rows at P=2 too: at 37 the unsharded model itself fails (levels 19 -> 10, upsampled to 20 against 19)
    "smp.UnetPlusPlus": Spec(_smp("UnetPlusPlus", decoder_channels=(8, 8, 8)), 3, W, {2: 40, 3: 40}),
    "smp.FPN": Spec(_smp("FPN", decoder_pyramid_channels=8, decoder_segmentation_channels=32), 3, W, {2: 40, 3: 40},
                    custom=("segmentation_models_pytorch.decoders.fpn.decoder.MergeBlock",)),  # a sum or a cat
    "smp.DeepLabV3Plus": Spec(_smp("DeepLabV3Plus", decoder_channels=8, encoder_output_stride=8), 3, W,
                              {2: 37, 3: 40}),
    "smp.MAnet": Spec(_smp("MAnet", decoder_channels=(8, 8, 8), decoder_pab_channels=8), 3, W, {2: 37, 3: 40}),
    "smp.PSPNet": Spec(_smp("PSPNet", psp_out_channels=8), 3, W, {2: 37, 3: 40}),
    # its FPA block pools the 1/8 map three more times: at least one row a rank at 1/64, 8 columns at 1/8
    "smp.PAN": Spec(_smp("PAN", decoder_channels=8, encoder_output_stride=16), 3, 64, {2: 136, 3: 200}),
    "smp.Linknet": Spec(_smp("Linknet"), 3, W, {2: 40, 3: 40}),
    "smp.DPT": Spec(_smp_dpt, 3, 64, {2: 64, 3: 64}),  # refused at conversion: its ViT's class token
    # an even H: the U-Net halves it once and doubles it back, so an odd H (37 -> 19 -> 38) fails the skip's cat in
    # the unsharded model itself; 38 rows are 19 + 19, then 10 + 9 at the halved level (uneven), 40 are 14 + 13 + 13
    "diffusers.UNet2DModel": Spec(_unet2d(False), 3, W, {2: 38, 3: 40}, _unet2d_call,
                                  custom=_TIMESTEPS),
    "diffusers.UNet2DModel+attention": Spec(_unet2d(True), 3, W, {2: 38, 3: 40}, _unet2d_call,
                                  custom=_TIMESTEPS),
    # 40 rows on 3 ranks are 14 + 13 + 13: its forward passes the upsamplers a size on the odd shards only (it tests
    # sample.shape % 2); halo makes every rank pass it (halo.nn.diffusers_layers)
    "diffusers.UNet2DConditionModel": Spec(_unet2d_cond, 3, W, {2: 38, 3: 40}, _unet2d_cond_call,
                                           custom=_TIMESTEPS),
    # MONAI's 2-d nets; 36 and 40 rows halve twice (the unsharded models need that), unevenly split at each level
    "monai.UNet": Spec(_monai("UNet", channels=(8, 16, 32), strides=(2, 2), num_res_units=1), 3, W, {2: 36, 3: 40}),
    "monai.BasicUNet": Spec(_monai("BasicUNet", features=(4, 4, 8, 8, 8, 4)), 3, 32, {2: 48, 3: 48}),
    "monai.DynUNet": Spec(_monai("DynUNet", kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                                 filters=[4, 8, 8]), 3, W, {2: 36, 3: 40}),
    "monai.SegResNet": Spec(_monai("SegResNet", init_filters=4, blocks_down=(1, 1, 1), blocks_up=(1, 1),
                                   norm=("GROUP", {"num_groups": 2})), 3, W, {2: 36, 3: 40}),
    # 5 patch rows: 3 + 2 on 2 ranks, 2 + 2 + 1 on 3, each cut by the split of the 80 image rows (40 + 40, 27 + 27 + 26)
    "monai.UNETR": Spec(_unetr, 3, 32, {2: 80, 3: 80}),
    "monai.BasicUNetPlusPlus": Spec(_monai("BasicUNetPlusPlus", features=(4, 4, 8, 8, 8, 4)), 3, 32, {2: 48, 3: 48}),
    "monai.HighResNet": Spec(_monai("HighResNet"), 3, W, {2: 37, 3: 40}),  # dilated convs, ChannelPad
    "monai.AttentionUnet": Spec(_monai("AttentionUnet", channels=(4, 8, 8), strides=(2, 2)), 3, W, {2: 36, 3: 40}),
    "credit.crossformer": Spec(_credit_crossformer, 3, 32, {2: 64, 3: 96}, frames=1),
    "credit.unet": Spec(_credit_unet, 3, W, {2: 37, 3: 40}, frames=1),
    # Swin V2 windows must stay whole on each rank: 48 rows split evenly into whole windows on 2 and 3 ranks
    "credit.swin": Spec(credit_swin, 3, W, {2: 48, 3: 48}, frames=1),
    "credit.fuxi": Spec(credit_fuxi, 3, W, {2: 48, 3: 48}, frames=2),
    # as built: the position-bias MLP of CREDIT's window attention has a dropout of 0.125 (refused in training)
    "credit.swin(bias dropout)": Spec(credit_swin, 3, W, {2: 48, 3: 48}, frames=1, dropout=True),
}


# -- timm layers halo converts (halo/nn/timm_layers.py), each in a small model ---------------------------------------

def _layer(make: Callable[[], list[nn.Module]]) -> Callable[[], nn.Module]:
    """A 3x3 conv (3 -> 8 channels: a parameter upstream of the layer), then the layers ``make()`` returns."""
    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *make())
    return build


def _activations() -> list[nn.Module]:
    from timm.layers import activations as a

    return [a.Swish(), a.HardSwish(), a.Mish(), a.GELU(), a.QuickGELU(), a.GELUTanh(), a.HardMish(), a.Tanh(),
            a.PReLU(8), a.HardSigmoid(), a.Sigmoid()]


def _channel_norms() -> list[nn.Module]:
    from timm.layers import LayerNorm2d, LayerNormAct2d, LayerScale2d, RmsNorm2d

    return [LayerNorm2d(8), nn.Conv2d(8, 8, 3, padding=1), LayerScale2d(8, 0.3), RmsNorm2d(8),
            LayerNormAct2d(8, act_layer=nn.GELU)]


def _group_norms() -> list[nn.Module]:
    from timm.layers import GroupNorm, GroupNorm1, GroupNorm1Act, GroupNormAct

    return [GroupNorm(8, 4), nn.Conv2d(8, 8, 3, padding=1), GroupNorm1(8), GroupNormAct(8, 2, act_layer=nn.SiLU),
            GroupNorm1Act(8, act_layer=nn.GELU)]


def _convnext_block() -> list[nn.Module]:
    from timm.models.convnext import ConvNeXtBlock

    return [ConvNeXtBlock(8, ls_init_value=0.5), ConvNeXtBlock(8, ls_init_value=0.5, conv_mlp=True)]


def _conv_same() -> list[nn.Module]:
    from timm.layers import Conv2dSame

    return [Conv2dSame(8, 8, 3, stride=2), Conv2dSame(8, 8, 4, stride=1), Conv2dSame(8, 8, 3, stride=1, dilation=2),
            Conv2dSame(8, 8, 5, stride=3, groups=8, bias=False)]


def _blur_pool() -> list[nn.Module]:
    from timm.layers import BlurPool2d

    return [BlurPool2d(8, filt_size=3, stride=2), nn.Conv2d(8, 8, 3, padding=1),
            BlurPool2d(None, filt_size=5, stride=1)]


def _squeeze_excite() -> list[nn.Module]:
    from timm.layers.squeeze_excite import SEModule
    from timm.models._efficientnet_blocks import SqueezeExcite

    return [SqueezeExcite(8, rd_ratio=0.5), SEModule(8, rd_ratio=0.5, add_maxpool=True), nn.Conv2d(8, 8, 3, padding=1)]


def _classifier(kind: str, pool: str, drop: float = 0.0) -> Callable[[], list[nn.Module]]:
    def make() -> list[nn.Module]:
        from timm.layers import classifier

        if kind == "norm_mlp":
            return [classifier.NormMlpClassifierHead(8, 3, hidden_size=6, pool_type=pool, drop_rate=drop)]
        return [classifier.ClassifierHead(8, 3, pool_type=pool, drop_rate=drop)]
    return make


def _whole_field_head(model: nn.Module) -> None:
    """The reference of a head with a dropout: its ``nn.Dropout`` draws what halo's draws for the whole tensor in
    one process (``tests/_modes.py``'s ``WholeFieldDropout``), the mask the converted head draws on every rank."""
    from _modes import whole_field_dropouts

    for m in list(model.modules()):
        whole_field_dropouts(m)


def _whole_field_pool_dropout(model: nn.Module) -> None:
    """The reference of a timm model whose ``forward_head`` calls ``F.dropout(self.global_pool(x), drop_rate)``
    (ResNet, EfficientNet): that dropout drawing what halo draws for the whole pooled tensor in one process."""
    from _modes import WholeFieldDropout

    model.global_pool = nn.Sequential(model.global_pool, WholeFieldDropout(model.drop_rate))
    model.drop_rate = 0.0


def _timm_resnet_dropout() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=3, stem_width=8, channels=(8, 8, 12, 12), drop_rate=0.2)


def _seeded(model: nn.Module, x: torch.Tensor) -> Any:
    """The call, torch's generator seeded first (the key of the dropout's draws: alike on the ranks and in the
    reference)."""
    torch.manual_seed(7)
    return model(x)


LAYERS: dict[str, Spec] = {
    "timm.layers.activations": Spec(_layer(_activations), 3, 12, {2: 37, 3: 37}),
    "timm.layers.channel_norms+layer_scale": Spec(_layer(_channel_norms), 3, 12, {2: 37, 3: 37}),
    "timm.group_norms": Spec(_layer(_group_norms), 3, 12, {2: 37, 3: 37}),
    "timm.ConvNeXtBlock(gamma)": Spec(_layer(_convnext_block), 3, 12, {2: 37, 3: 37}),
    "timm.Conv2dSame": Spec(_layer(_conv_same), 3, 12, {2: 37, 3: 38}),
    "timm.BlurPool2d": Spec(_layer(_blur_pool), 3, 12, {2: 37, 3: 37}),
    "timm.squeeze_excite": Spec(_layer(_squeeze_excite), 3, 12, {2: 37, 3: 37}),
    "timm.ClassifierHead(avg)": Spec(_layer(_classifier("plain", "avg")), 3, 12, {2: 37, 3: 37}),
    "timm.ClassifierHead(catavgmax)": Spec(_layer(_classifier("plain", "catavgmax")), 3, 12, {2: 37, 3: 37}),
    "timm.ClassifierHead(fast)": Spec(_layer(_classifier("plain", "fast")), 3, 12, {2: 37, 3: 37}),
    "timm.NormMlpClassifierHead(max)": Spec(_layer(_classifier("norm_mlp", "max")), 3, 12, {2: 37, 3: 37}),
    # the head's dropout draws the whole tensor's one-process mask on every rank (halo.nn.timm_layers.WholeDropout):
    # right after the pool (ClassifierHead), and after the norm and pre-logits MLP on its result (NormMlpClassifierHead)
    "timm.ClassifierHead(drop_rate=0.2)": Spec(_layer(_classifier("plain", "avg", 0.2)), 3, 12, {2: 37, 3: 37},
                                               _seeded, dropout=True, reference=_whole_field_head),
    "timm.NormMlpClassifierHead(drop_rate=0.2)": Spec(_layer(_classifier("norm_mlp", "avg", 0.2)), 3, 12,
                                                      {2: 37, 3: 37}, _seeded, dropout=True,
                                                      reference=_whole_field_head),
    # its forward_head's F.dropout of the pool's result: drawn whole by the guard's reroute (halo.guard.reroute)
    "timm.resnet(drop_rate=0.2)": Spec(_timm_resnet_dropout, 3, WT, TIMM_ROWS, _seeded, dropout=True,
                                       reference=_whole_field_pool_dropout),
}

SPECS: dict[str, Spec] = {**ZOO, **LAYERS}
