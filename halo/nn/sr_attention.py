"""Spatial-reduction attention (PVT-v2, SegFormer's MiT) on H-shards: queries from this rank's tokens, keys and
values from the *global* reduced grid, by the ring.

The layer (timm's ``timm.models.pvt_v2.Attention``, segmentation_models_pytorch's
``encoders.mix_transformer.Attention``) takes a field's tokens ``(B, H * W, C)`` with the field's ``(H, W)`` and
computes ``q`` from every token but ``k``, ``v`` from a coarser grid: the token map ``(B, C, H, W)`` through ``sr``, a
conv of kernel = stride = ``sr_ratio`` (then a LayerNorm over channels), or, in timm's ``linear`` variant, through
``AdaptiveAvgPool2d(7)``, a 1x1 ``sr``, LayerNorm and GELU. Every query attends to every reduced key.

On a shard, rank ``r`` holds the rows ``[off_r, off_r + H_r)`` of the field and so its tokens. Here:

* ``q``: this rank's tokens (pointwise in the tokens);
* the reduced grid: ``sr`` is :class:`halo.nn.DomainConv2d` (the pool :class:`halo.nn.DomainAdaptiveAvgPool2d`) on this
  rank's token map ``(B, C, H_r, W)``: each rank gets its balanced share of the *global* reduced rows, computed from
  the global rows they read (a halo where a window straddles two ranks). Where ``H`` is not a multiple of
  ``sr_ratio`` the unsharded conv drops the last ``H % sr_ratio`` rows; so does the halo conv, since it plans from
  the global extent (``H // sr_ratio`` rows), whatever rank holds them. Fewer reduced rows than ranks is refused
  by the conv (or pool) naming the rows and ranks: halo's layers give every rank rows;
* attention over all reduced keys: :func:`halo.nn.ring.ring_sdpa` (each rank's reduced tokens are contiguous global
  key positions in rank order), with the layer's ``scale``. Both forms the originals compute -- timm's fused
  ``F.scaled_dot_product_attention`` and the explicit ``softmax(q @ k^T * scale) @ v`` (smp's, and timm's with
  ``fused_attn`` off) -- are that same function: the explicit one differs by rounding only.

The layer keeps the original's attributes and submodules (``state_dict`` keys unchanged); ``sr`` / ``pool`` /
dropouts are replaced by their halo forms in place (also when the layer is built directly, outside the converter).
Parameter gradients on each rank are the contribution of its tokens and reduced tokens: their sum over the domain
group is the unsharded gradient (``halo.sync_domain_gradients``). Attention dropout in training is refused (each
rank would draw its own weights); on a latitude x longitude mesh the layer is refused at conversion, as the other
attention over all tokens (:mod:`halo.nn.attention_layers`).

The rest of those models is exact by halo's ordinary layers and the guard: the overlapping patch embeddings
(strided convs with padding: ``DomainConv2d``), the depthwise 3x3 conv of the MLP over tokens reshaped to the shard's
``(B, C, H_r, W)``, LayerNorms over channels, ``DropPath``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..plan.plans import Site, carry
from .base import DomainLayer, adopt
from .conv import DomainConv2d
from .dropout import DomainDropout
from .pool import halo_pool
from .registry import is_pointwise_conv, public
from .ring import latitude_only, place_like, ring_sdpa

__all__ = ["DomainSRAttention", "sr_attention_adapter"]

#: the classes, by defining module -> class name (halo imports neither timm nor smp)
_CLASSES = {"timm.models.pvt_v2": "Attention", "segmentation_models_pytorch.encoders.mix_transformer": "Attention"}
_ATTRS = ("num_heads", "q", "kv", "proj", "attn_drop", "proj_drop", "sr", "norm", "scale")


@public
class DomainSRAttention(DomainLayer, nn.Module):
    """timm's PVT-v2 ``Attention`` or smp's MiT ``Attention`` (spatial-reduction attention) over a field's tokens
    ``(B, H_r * W, C)`` on an H-shard: the same attributes and numbers as the unsharded layer (module docstring).
    Called as the original: ``(x, feat_size)`` (timm) or ``(x, height, width)`` (smp), with this rank's ``H_r``."""

    def __init__(self, attn: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        missing = [a for a in _ATTRS if not hasattr(attn, a)]
        if missing:
            raise TypeError(f"{name} wraps timm's pvt_v2.Attention or smp's mix_transformer.Attention; "
                            f"{type(attn).__module__}.{type(attn).__name__} lacks {missing}")
        adopt(self, attn, name=name)
        self.__dict__["_sr_kind"] = f"{type(attn).__module__}.{type(attn).__name__}"
        if getattr(self, "pool", None) is not None and not isinstance(self.pool, DomainLayer):
            self.pool = halo_pool(self.pool, group=group)  # the global grid's 7 x 7 (timm's linear variant)
        if type(self.sr) is nn.Conv2d and not is_pointwise_conv(self.sr):
            self.sr = DomainConv2d(self.sr, group=group)  # the reduced rows of the global grid, this rank's share
        for slot in ("attn_drop", "proj_drop"):
            if type(getattr(self, slot)) is nn.Dropout:
                setattr(self, slot, DomainDropout(getattr(self, slot), group=group))
        self.halo_init(group)
        self._halo_path = ""  # where the layer sits (the converter sets it): named in its errors
        self._ring_sites = (Site(), Site(), Site())

    def extra_repr(self) -> str:
        reduce = "pool 7x7" if getattr(self, "pool", None) is not None else \
            f"sr_ratio={self.sr.stride[0]}" if isinstance(self.sr, nn.Conv2d) else "sr_ratio=1"
        return f"dim={self.q.in_features}, num_heads={self.num_heads}, {reduce}"

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Every rank's queries on the keys of all ranks (the ring), with the layer's scale."""
        return ring_sdpa(q, k, v, scale=self.scale, group=self.group, sites=self._ring_sites)

    def _reduced(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The reduced tokens ``(B, n_r, C)`` this rank holds (before ``kv``)."""
        b, n, c = x.shape
        linear = getattr(self, "pool", None) is not None  # timm's linear variant
        if not linear and (self.sr is None or isinstance(self.sr, nn.Identity)):  # sr_ratio 1: every token a key
            return x
        m = x.permute(0, 2, 1).reshape(b, c, h, w)
        try:  # the halo conv (pool) agrees on the extents first: a refusal is raised alike on every rank
            m = self.sr(self.pool(m)) if linear else self.sr(m)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__} ({self._sr_kind}) at {self._halo_path or 'its place'}: its "
                             f"keys and values come from a reduced grid (the global token map through "
                             f"{'pool' if linear else 'sr'}) that cannot be split over the domain group: {exc}") \
                from exc
        m = m.reshape(b, c, -1).permute(0, 2, 1)
        return self.act(self.norm(m)) if linear else self.norm(m)

    def forward(self, x: torch.Tensor, feat_size: Any = None, width: int | None = None, *,
                height: int | None = None) -> torch.Tensor:
        name = f"{type(self).__name__} ({self._sr_kind})"
        if height is not None:
            feat_size = height
        h, w = (feat_size, width) if width is not None else tuple(feat_size)
        if self.training and self.attn_drop.p > 0:
            raise ValueError(f"{name}: attention dropout in training (attn_drop={self.attn_drop.p}) is not supported "
                             f"on shards (each rank would draw its own pattern); set it to 0 or call eval()")
        if x.dim() != 3 or x.shape[1] != h * w:
            raise ValueError(f"{name}: expected this rank's tokens (B, H_r * W, C) with H_r * W = {h} * {w} = "
                             f"{h * w}, got shape {tuple(x.shape)}")
        b, n, c = x.shape
        heads = self.num_heads
        q = self.q(x).reshape(b, n, heads, c // heads).permute(0, 2, 1, 3)
        r = self._reduced(x, h, w)
        kv = self.kv(r).reshape(b, -1, 2, heads, c // heads).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        y = self._attend(q, k, v)
        y = y.transpose(1, 2).reshape(b, n, c)
        out = self.proj_drop(self.proj(y))
        carry(out, x)
        place_like(out, x, 1)
        return out


def _is_sr_attention(m: nn.Module) -> bool:
    kind = type(m)
    return _CLASSES.get(kind.__module__) == kind.__name__ and all(hasattr(m, a) for a in _ATTRS)


def sr_attention_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The converter ``fn(module, ctx)`` of timm's PVT-v2 or smp's MiT ``Attention`` (recognised by defining
    module, name and attributes), else ``None`` (for ``halo.nn.adapters.adapter``). Refused on a latitude x longitude
    mesh, naming why."""
    if not _is_sr_attention(module):
        return None

    return latitude_only(lambda m, ctx: DomainSRAttention(m, group=ctx.group), "spatial-reduction attention")
