"""segmentation_models_pytorch's U-Net decoder and channel LayerNorms on H-shards (recognised by name and attributes;
smp is not imported).

smp's ``UnetDecoder.forward`` reads the *local* spatial shapes of the encoder's features and hands them to each
``UnetDecoderBlock``, whose ``forward`` resizes with ``F.interpolate(size=(height, width))`` before concatenating
the skip. On an unevenly split level that size is a shard's, not the field's: the guard refuses it. The sizes it
means are global ones, which halo knows, so the two classes are computed exactly instead:

- ``UnetDecoder`` → :class:`DomainUnetDecoder`: the same children and state; its forward passes every level's
  *global* (height, width) (each feature's rows summed over the domain group, agreed once per shape).
- ``UnetDecoderBlock`` → :class:`DomainUnetDecoderBlock`: the same children and state; it resizes with
  :func:`halo.nn.halo_interpolate` to the skip's global size (or the global size its decoder passed), so its output
  is the balanced split of that size and lines up row for row with the skip. A block called with a shard's size and
  no skip (outside a converted decoder) is refused: the global size is unknown there.

smp's ``SegformerDecoder`` resizes every stage to ``[dim // 4 for dim in features[0].shape[2:]]``: a quarter of the
*input's* rows, on a shard the rank's own (their sum is not the field's quarter unless every rank's rows divide by 4;
the guard refuses the resize where they do not). :class:`DomainSegformerDecoder` (the same children and state) resizes
with :func:`halo.nn.halo_interpolate` to a quarter of the input's global rows, so odd heights are exact as well.

smp PAN's ``FPABlock`` resizes its pyramid to ``height // 4`` and ``height // 2`` of the *shard's* rows:
:class:`DomainFPABlock` resizes to those fractions of the global rows (what the pools' outputs hold).

smp's ``nn.LayerNorm`` subclasses over channels (UPerNet's ``LayerNorm2d``: permute, ``F.layer_norm``, permute
back; MiT's ``LayerNorm``: flatten H x W into tokens, ``F.layer_norm``, back) have a forward of their own, which the
converter refuses for a subclass of a layer it converts; both normalise each grid point's channels, nothing across
rows, so :class:`ChannelLayerNorm` computes that per pixel (their state, their output strides).

The blocks' children (``Conv2dReLU``, scSE attention) are converted as usual. NCAR CREDIT's U-Net
(``credit.models.unet``) is smp's ``Unet``. Latitude rows only: on a latitude x longitude mesh both are refused.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..dist.mesh import GroupRef
from ..plan.plans import shard_sizes
from .upsample import halo_interpolate

__all__ = ["ChannelLayerNorm", "DomainFPABlock", "DomainSegformerDecoder", "DomainUnetDecoder",
           "DomainUnetDecoderBlock", "smp_adapter"]

_SMP_UNET = "segmentation_models_pytorch.decoders.unet.decoder"
_SMP_SEGFORMER = "segmentation_models_pytorch.decoders.segformer.decoder"
_SMP_PAN = "segmentation_models_pytorch.decoders.pan.decoder"
#: smp's LayerNorm subclasses over channels: defining module -> class name
_SMP_LAYER_NORMS = {"segmentation_models_pytorch.decoders.upernet.decoder": "LayerNorm2d",
                    "segmentation_models_pytorch.encoders.mix_transformer": "LayerNorm"}


class GlobalExtent(int):
    """An int that is a *global* extent (a converted decoder's level height): blocks trust it as the target."""


def _global_hw(t: torch.Tensor, group: Any, op: str) -> tuple[GlobalExtent, GlobalExtent]:
    return GlobalExtent(sum(shard_sizes(t, -2, group, op=op))), GlobalExtent(int(t.shape[-1]))


def _twin_as(cls: type, m: nn.Module, group: Any) -> nn.Module:
    """An instance of ``cls`` holding ``m``'s state and children (same Parameters and buffers; own containers), so
    ``state_dict`` keys are unchanged and ``revert_domain_parallel`` puts ``m`` back. Not a
    :class:`halo.nn.base.DomainLayer`: the converter must still walk into its children (a layer of halo's own it
    leaves as it is)."""
    t = object.__new__(cls)
    for key, value in m.__dict__.items():
        # a copy of its own type: hooks' dicts are OrderedDicts (a hook handle keeps a weak reference to them)
        t.__dict__[key] = copy.copy(value) if isinstance(value, dict) else value
    t.__dict__["_halo_group"] = GroupRef(group)  # by reference: a deep copy or a pickle of the model shares it
    return t


class DomainUnetDecoder(nn.Module):
    """smp's ``UnetDecoder`` on H-shards: its forward with global level sizes (module docstring)."""

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        op = "smp UnetDecoder"
        spatial_shapes = [_global_hw(f, self._halo_group.group, op) for f in features][::-1]
        features = features[1:][::-1]  # drop the first skip (the input's resolution); from the head of the encoder
        head, skip_connections = features[0], features[1:]
        x = self.center(head)
        for i, decoder_block in enumerate(self.blocks):
            height, width = spatial_shapes[i + 1]
            skip_connection = skip_connections[i] if i < len(skip_connections) else None
            x = decoder_block(x, height, width, skip_connection=skip_connection)
        return x


class DomainUnetDecoderBlock(nn.Module):
    """smp's ``UnetDecoderBlock`` on H-shards: resize to the global size, then its own layers (module docstring)."""

    def forward(self, feature_map: torch.Tensor, target_height: int, target_width: int,
                skip_connection: torch.Tensor | None = None) -> torch.Tensor:
        op = "smp UnetDecoderBlock"
        if skip_connection is not None:
            size = _global_hw(skip_connection, self._halo_group.group, op)
        elif isinstance(target_height, GlobalExtent):
            size = (target_height, target_width)
        else:
            raise ValueError(
                f"{op}: called with a target height of {target_height} rows and no skip connection outside a "
                f"converted UnetDecoder: on a shard that height is this rank's, and halo cannot tell the field's; "
                f"convert the whole decoder (halo.nn.convert_to_domain_parallel of the model), or pass a skip")
        feature_map = halo_interpolate(feature_map, size=tuple(size), mode=self.interpolation_mode,
                                       group=self._halo_group.group)
        if skip_connection is not None:
            feature_map = torch.cat([feature_map, skip_connection], dim=1)
            feature_map = self.attention1(feature_map)
        feature_map = self.conv1(feature_map)
        feature_map = self.conv2(feature_map)
        return self.attention2(feature_map)


class DomainSegformerDecoder(nn.Module):
    """smp's ``SegformerDecoder`` on H-shards: every stage resized to a quarter of the input's *global* size
    (module docstring), then its own fuse stage."""

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        op = "smp SegformerDecoder"
        group = self._halo_group.group
        rows, cols = _global_hw(features[0], group, op)
        target = (rows // 4, cols // 4)
        features = features[2:] if features[1].size(1) == 0 else features[1:]
        features = features[::-1]  # from the head of the encoder
        resized = [halo_interpolate(mlp(features[i]), size=target, mode="bilinear", align_corners=False, group=group)
                   for i, mlp in enumerate(self.mlp_stage)]
        return self.fuse_stage(torch.cat(resized, dim=1))


class DomainFPABlock(nn.Module):
    """smp PAN's ``FPABlock`` on H-shards: its pyramid (three max pools of the input, each level's conv) resized
    back to a quarter, a half and all of the input's *global* size (its own forward takes ``height // 4`` of the
    shard's rows, which the guard refuses), with :func:`halo.nn.halo_interpolate`; every level is the balanced
    split of its global rows, as the pools' outputs are, so the sums pair the same rows. The global pooling
    branch's ``1 x 1`` map (whole on every rank) is resized to the shard: a constant, equal to the field's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._halo_group.group
        height, width = _global_hw(x, group, "smp FPABlock")
        kw = {"mode": self.upscale_mode, "align_corners": self.align_corners}
        branch1_output = F.interpolate(self.branch1(x), size=tuple(x.shape[-2:]), **kw)
        middle_output = self.mid(x)
        x1 = self.down1(x)
        x2 = self.down2(x1)
        x3 = halo_interpolate(self.down3(x2), size=(height // 4, width // 4), group=group, **kw)
        y = halo_interpolate(self.conv2(x2) + x3, size=(height // 2, width // 2), group=group, **kw)
        y = halo_interpolate(y + self.conv1(x1), size=(height, width), group=group, **kw)
        return torch.mul(y, middle_output) + branch1_output


def _is(module: nn.Module, name: str, children: set[str], attrs: tuple[str, ...] = (), home: str = _SMP_UNET
        ) -> bool:
    kind = type(module)
    return (kind.__name__ == name and kind.__module__ == home and children <= set(module._modules)
            and all(hasattr(module, a) for a in attrs))


def _refuse_mesh(ctx: Any, what: str) -> None:
    if getattr(ctx, "mesh", None) is not None:
        raise ValueError(f"{what} (segmentation_models_pytorch) has no latitude x longitude form in halo yet; "
                         f"convert it with a latitude-only group (manager or group=)")


class ChannelLayerNorm(nn.LayerNorm):
    """smp PAN's ``FPABlock`` resizes its pyramid to ``height // 4`` and ``height // 2`` of the *shard's* rows:
:class:`DomainFPABlock` resizes to those fractions of the global rows (what the pools' outputs hold).

smp's ``nn.LayerNorm`` subclasses over channels (UPerNet's ``LayerNorm2d``, MiT's ``LayerNorm``) on an H-shard:
    ``F.layer_norm`` over the channels of each grid point of a ``(B, C, H, W)`` field (computed channels-last, as
    both do, so the output has their channels-last strides), which nothing of another row enters; MiT's on another
    input (``(B, N, C)`` tokens), over the last dim as its own. The same Parameters (``state_dict`` unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            y = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
            return y.permute(0, 3, 1, 2)
        if self._halo_channels_first:  # UPerNet's LayerNorm2d permutes a 4-d field only
            raise ValueError(f"{self._halo_kind}: expected a (B, C, H, W) field, got {tuple(x.shape)}")
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def _channel_layer_norm(module: nn.Module) -> bool:
    """One of smp's ``nn.LayerNorm`` subclasses with a forward of its own that normalises over channels only."""
    kind = type(module)
    return (kind.__module__ in _SMP_LAYER_NORMS and kind.__name__ == _SMP_LAYER_NORMS[kind.__module__]
            and isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1 and not module._modules
            and set(_own(module)) <= {"weight", "bias"})


def _own(m: nn.Module) -> list[str]:
    return [n for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None]


def _norm_twin(m: nn.Module, ctx: Any) -> nn.Module:
    t = object.__new__(ChannelLayerNorm)
    for key, value in m.__dict__.items():
        t.__dict__[key] = copy.copy(value) if isinstance(value, dict) else value
    t.__dict__["_halo_channels_first"] = type(m).__name__ == "LayerNorm2d"
    t.__dict__["_halo_kind"] = f"{type(m).__module__}.{type(m).__name__}"
    return t


def smp_adapter(module: nn.Module) -> Any:
    """The converter of an smp layer halo knows (module docstring), or ``None``."""
    if _channel_layer_norm(module):
        return _norm_twin
    if _is(module, "UnetDecoder", {"center", "blocks"}):
        def convert(m: nn.Module, ctx: Any) -> nn.Module:
            _refuse_mesh(ctx, "UnetDecoder")
            return _twin_as(DomainUnetDecoder, m, ctx.group)
        return convert
    if _is(module, "UnetDecoderBlock", {"conv1", "attention1", "conv2", "attention2"}, ("interpolation_mode",)):
        def convert_block(m: nn.Module, ctx: Any) -> nn.Module:
            _refuse_mesh(ctx, "UnetDecoderBlock")
            return _twin_as(DomainUnetDecoderBlock, m, ctx.group)
        return convert_block
    if _is(module, "SegformerDecoder", {"mlp_stage", "fuse_stage"}, home=_SMP_SEGFORMER):
        def convert_segformer(m: nn.Module, ctx: Any) -> nn.Module:
            _refuse_mesh(ctx, "SegformerDecoder")
            return _twin_as(DomainSegformerDecoder, m, ctx.group)
        return convert_segformer
    if _is(module, "FPABlock", {"branch1", "mid", "down1", "down2", "down3", "conv1", "conv2"},
           ("upscale_mode", "align_corners"), home=_SMP_PAN):
        def convert_fpa(m: nn.Module, ctx: Any) -> nn.Module:
            _refuse_mesh(ctx, "FPABlock")
            return _twin_as(DomainFPABlock, m, ctx.group)
        return convert_fpa
    return None


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloUnetDecoder = DomainUnetDecoder
HaloUnetDecoderBlock = DomainUnetDecoderBlock
HaloSegformerDecoder = DomainSegformerDecoder
HaloFPABlock = DomainFPABlock
