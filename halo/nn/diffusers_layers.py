"""halo forms of diffusers' layers, recognised by class name and attributes (diffusers is not imported here).

``convert_to_domain_parallel`` asks :func:`diffusers_adapter` about every module it does not know. What it
recognises, and why each is exact on an H-shard:

- **``Downsample2D`` with a conv and ``padding=0``** (every ``AutoencoderKL`` / ``VQModel`` encoder): diffusers pads
  the field by ``F.pad(x, (0, 1, 0, 1))`` — one zero row after the *last* row of the field and one zero column —
  then runs a stride-2 conv without padding. On a shard that pad would put a zero row after every rank's rows (the
  guard refuses it). :class:`DomainDownsample2D` keeps diffusers' state and children and pads the global field
  (:func:`halo.nn.halo_pad`: only the last rank's last row gets the zero row, and the output is the balanced split
  of the padded field), then its ``conv`` (converted to a ``DomainConv2d``: the rows the stride-2 window reads across
  a rank's edge come by the halo exchange). Its optional channel norm (``norm_type="ln_norm"`` / ``"rms_norm"``,
  over channels per pixel; diffusers' ``RMSNorm`` over one trailing dim is kept, its mean over that dim watched by
  the guard) is pointwise. A ``Downsample2D`` with padding (or an average pool) holds nothing of its
  own that crosses rows: the converter's usual rules convert its children.
- **``VectorQuantizer``** (``VQModel``'s ``quantize``): diffusers flattens the pixels into rows of a matrix (the
  guard refuses the view that merges H) and takes the mean of the commit loss over the field. Each pixel's nearest
  codebook entry depends on its own channels only; :class:`DomainVectorQuantizer` takes it per pixel of the shard
  and the commit loss as the mean over the whole field (a domain mean). With ``remap`` (random indices for unknown
  entries) it is refused.
- **``Timesteps``** (the sinusoidal embedding of the timesteps, ``(B,)`` -> ``(B, C)``) and
  **``GaussianFourierProjection``** (its Fourier form, a fixed random frequency vector): they compute on the
  timesteps, never on a field, and hold nothing per row; kept as they are (their forward still runs under the
  guard, which watches every op on a field).

- **The conditional U-Nets' upsample sizes** (``UNet2DConditionModel``, ``UNet3DConditionModel``, ... : a model
  with ``num_upsamplers``): their forward passes each upsampler the skip's size only when the input's rows are not a
  multiple of ``2 ** num_upsamplers`` (``sample.shape[-2:]``). On a shard that test reads the shard's rows, so some
  ranks pass a size and others do not (at 40 rows on 3 ranks: 14, 13, 13) and their programs part. Passing the
  skip's size is what the unsharded model computes in either case (where the rows are a multiple, the skip holds
  exactly twice the rows below it, and nearest x2 to it is the scale factor's result), so halo makes every rank pass
  it: ``num_upsamplers`` is set so that the test always holds (the original is kept and put back by
  ``revert_domain_parallel``); the guard then resizes each upsample to the skip's global rows.

Latitude rows only: on a latitude x longitude mesh the converter refuses what this module recognises.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..dist.mesh import GroupRef
from ..parallel.reduce import domain_mean
from ..plan.plans import Site
from .pad import halo_pad

__all__ = ["DomainDownsample2D", "DomainVectorQuantizer", "diffusers_adapter", "unpin_upsample_sizes"]


def _diffusers(kind: type) -> bool:
    return kind.__module__.split(".")[0] == "diffusers"


class DomainDownsample2D(nn.Module):
    """diffusers' ``Downsample2D`` with a conv and ``padding=0`` on an H-shard (module docstring): its norm, the
    zero row and column of ``F.pad(x, (0, 1, 0, 1))`` added to the *global* field, then its conv (a ``DomainConv2d``
    once converted). The same children and state as diffusers' (``state_dict`` keys unchanged, ``conv`` and its
    alias ``Conv2d_0`` one module)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if hidden_states.dim() != 4 or hidden_states.shape[1] != self.channels:
            raise ValueError(f"Downsample2D: expected a (B, {self.channels}, H, W) field, got "
                             f"{tuple(hidden_states.shape)}")
        if self.norm is not None:  # over channels, per pixel (diffusers' permutes)
            hidden_states = self.norm(hidden_states.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        hidden_states = halo_pad(hidden_states, (0, 1, 0, 1), "zeros", group=self._halo_group.group,
                                 site=self._halo_pad_site, op="Downsample2D")
        return self.conv(hidden_states)


class DomainVectorQuantizer(nn.Module):
    """diffusers' ``VectorQuantizer`` (``VQModel``'s ``quantize``) on an H-shard (module docstring): the nearest
    codebook entry of each pixel (over its channels: nothing of another row), the commit loss the mean over the
    whole field (:func:`halo.parallel.domain_mean` of both terms: the same value on every rank, a loss counted once
    in backward, as halo's losses), the straight-through estimate as diffusers'. The indices are this rank's
    pixels (flattened in ``(B, H_r, W)`` order as diffusers flattens them, or ``(B, H_r, W)`` with
    ``sane_index_shape``). The same children and state (its ``embedding``)."""

    #: for ``halo.check_equivalence``: its indices are this rank's pixels flattened (every sample's), which do not
    #: concatenate to the reference's flattening of the field; its quantized field and loss are compared where the
    #: model uses them (the decoder's output, the model's commit loss)
    _halo_check = "self"

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        if z.dim() != 4 or z.shape[1] != self.vq_embed_dim:
            raise ValueError(f"VectorQuantizer: expected a (B, {self.vq_embed_dim}, H, W) field, got {tuple(z.shape)}")
        group = self._halo_group.group
        z = z.permute(0, 2, 3, 1).contiguous()
        indices = torch.argmin(torch.cdist(z.view(-1, self.vq_embed_dim), self.embedding.weight), dim=1)
        z_q = self.embedding(indices).view(z.shape)
        moved = domain_mean((z_q.detach() - z).square().permute(0, 3, 1, 2), group)  # over the whole field
        pulled = domain_mean((z_q - z.detach()).square().permute(0, 3, 1, 2), group)
        loss = moved + self.beta * pulled if self.legacy else self.beta * moved + pulled
        z_q = (z + (z_q - z).detach()).permute(0, 3, 1, 2).contiguous()
        if self.sane_index_shape:
            indices = indices.reshape(z_q.shape[0], z_q.shape[2], z_q.shape[3])
        return z_q, loss, (None, None, indices)


def _twin_as(cls: type, m: nn.Module, group: Any) -> nn.Module:
    """An instance of ``cls`` holding ``m``'s state and children (the same Parameters, buffers and modules; its own
    containers, of their own types: hooks' dicts are OrderedDicts), so ``state_dict`` keys are unchanged and
    ``revert_domain_parallel`` puts ``m`` back; the converter converts its children."""
    t = object.__new__(cls)
    for key, value in m.__dict__.items():
        t.__dict__[key] = copy.copy(value) if isinstance(value, dict) else value
    t.__dict__["_halo_group"] = GroupRef(group)  # by reference: a deep copy or a pickle of the model shares it
    t.__dict__["_halo_pad_site"] = Site()
    return t


def _is_downsample(module: nn.Module) -> bool:
    kind = type(module)
    return (kind.__name__ == "Downsample2D" and _diffusers(kind) and not module._parameters and not module._buffers
            and all(hasattr(module, a) for a in ("channels", "use_conv", "padding", "conv", "norm"))
            and isinstance(module.conv, nn.Conv2d) and module.use_conv and module.padding == 0
            and tuple(module.conv.stride) == (2, 2) and tuple(module.conv.padding) == (0, 0))


def _timestep_embedding(module: nn.Module) -> bool:
    kind = type(module)
    if not _diffusers(kind) or module._modules:
        return False
    if kind.__name__ == "Timesteps":
        return not module._parameters and not module._buffers and all(
            hasattr(module, a) for a in ("num_channels", "flip_sin_to_cos", "downscale_freq_shift"))
    if kind.__name__ == "GaussianFourierProjection":
        weight = module._parameters.get("weight")
        return set(module._parameters) <= {"weight", "W"} and not module._buffers and weight is not None \
            and weight.dim() == 1
    return False


def _is_quantizer(module: nn.Module) -> bool:
    kind = type(module)
    return (kind.__name__ == "VectorQuantizer" and _diffusers(kind) and set(module._modules) == {"embedding"}
            and isinstance(module.embedding, nn.Embedding) and not module._parameters
            and all(hasattr(module, a) for a in ("vq_embed_dim", "beta", "legacy", "remap", "sane_index_shape")))


def _quantizer(m: nn.Module, ctx: Any) -> nn.Module:
    if m.remap is not None:  # unknown indices are drawn at random (torch.randint): per rank, not the unsharded draws
        raise ValueError(f"{type(m).__module__}.VectorQuantizer with remap={m.remap!r}: its remapping draws random "
                         f"indices for unknown entries, which would differ on each rank; halo converts it without "
                         f"remap (or give custom_converters={{VectorQuantizer: fn}})")
    return _twin_as(DomainVectorQuantizer, m, ctx.group)


def _last_dim_norm(module: nn.Module) -> bool:
    """diffusers' ``RMSNorm`` over one trailing dim (``Downsample2D``'s ``norm_type="rms_norm"``: channels of a
    permuted field): its mean over dim -1, which the guard checks on the first call (refused where that dim is H)."""
    kind = type(module)
    return (kind.__name__ == "RMSNorm" and _diffusers(kind) and not module._modules and not module._buffers
            and set(module._parameters) <= {"weight", "bias"} and len(tuple(getattr(module, "dim", ()))) == 1)


#: where a conditional U-Net's own ``num_upsamplers`` is kept while it is converted
_UPSAMPLERS = "_halo_num_upsamplers"
#: ``2 ** 62`` exceeds any extent: ``dim % 2 ** num_upsamplers != 0`` for every rank's rows (>= 1)
_ALWAYS = 62


def _sized_unet(module: nn.Module) -> bool:
    count = module.__dict__.get(_UPSAMPLERS, module.__dict__.get("num_upsamplers"))
    return _diffusers(type(module)) and type(count) is int and count > 0


def _pin_upsample_sizes(m: nn.Module, ctx: Any) -> None:
    """Every rank passes its upsamplers the skip's size (module docstring); the model's children are converted as
    usual (``None``)."""
    if _UPSAMPLERS not in m.__dict__:
        m.__dict__[_UPSAMPLERS] = m.num_upsamplers
    m.num_upsamplers = _ALWAYS
    return None


def unpin_upsample_sizes(model: nn.Module) -> None:
    """Every conditional U-Net's own ``num_upsamplers`` back (``revert_domain_parallel`` calls this)."""
    for m in model.modules():
        if _UPSAMPLERS in m.__dict__:
            m.num_upsamplers = m.__dict__.pop(_UPSAMPLERS)


def diffusers_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module | None] | None:
    """The converter of a diffusers layer halo knows (module docstring), or ``None``."""
    if _sized_unet(module):
        return _pin_upsample_sizes
    if _is_downsample(module):
        return lambda m, ctx: _twin_as(DomainDownsample2D, m, ctx.group)
    if _is_quantizer(module):
        return _quantizer
    if _timestep_embedding(module) or _last_dim_norm(module):
        return lambda m, ctx: m
    return None
