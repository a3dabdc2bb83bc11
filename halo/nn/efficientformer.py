"""timm's EfficientFormer on H-shards: its last stage's attention over all tokens, with its position bias, by the ring.

EfficientFormer (``timm.models.efficientformer``) is a MetaFormer: conv stages whose token mixer is ``Pooling``
(``AvgPool2d(3, 1, 1, count_include_pad=False)`` minus its input: a halo pool, then pointwise), then, in the last
stage, ``Flat`` (``x.flatten(2).transpose(1, 2)``: ``(B, C, H, W)`` to row-major tokens ``(B, H * W, C)``) and
``MetaBlock1d`` blocks whose ``Attention`` attends over all ``N = H * W`` tokens with a learned bias per head and
relative offset, ``attention_biases[:, attention_bias_idxs]`` (``N x N``), added to ``q @ k^T * scale`` before the
softmax. The bias table fixes ``N`` (timm builds it for a 7 x 7 last stage: 224 x 224 inputs through four stages;
its ``img_size=`` is accepted and ignored), so the unsharded model runs only at inputs that give that grid.

On a latitude split, rank ``r`` holds the rows ``[off_r, off_r + H_r)`` of the last stage's grid, so ``Flat`` gives
it the contiguous global tokens ``[off_r * W, (off_r + H_r) * W)``, in rank order: ``Flat`` is kept as it is (the
guard follows ``flatten(2)`` into tokens), and :class:`DomainEfficientFormerAttention` computes ``qkv`` on this
rank's tokens (pointwise) and the attention over every rank's keys with :func:`halo.nn.ring.ring_sdpa`, whose additive
``attn_mask`` is the bias rows of this rank's queries, ``attention_biases[:, attention_bias_idxs[t0:t0 + n]]``
(``heads x n x N``, ``t0`` this rank's first token: its share of the ``N x N`` table, never the whole one). The
bias's gradient flows through the mask (ring_sdpa's ``dS``) into ``attention_biases``: each rank holds the
contribution of its query rows, and their sum over the domain group is the unsharded gradient
(``halo.sync_domain_gradients``), as for every other parameter. Everything else in the model is halo's ordinary
layers and the guard: the strided stem and downsample convs, BatchNorm (domain statistics), the LayerNorms and MLPs
over tokens (pointwise), the head's ``x.mean(dim=1)`` over the tokens (a mean over H: computed by the guard, whole
on every rank) and its two classifiers on that whole result.

Refused, by name and on every rank alike: a token count other than the bias table's (the unsharded model fails
there too, with a shape error), ``Flat`` and the attention on a latitude x longitude mesh (a rank's tokens are then
not contiguous in the global order; :func:`halo.nn.ring.latitude_only`), and a look-alike without the attributes
read here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..plan.plans import Site, carry, resolve
from .base import HaloLayer, adopt
from .registry import public
from .ring import latitude_only, place_like, ring_sdpa

__all__ = ["DomainEfficientFormerAttention", "efficientformer_adapter"]

_MODULE = "timm.models.efficientformer"
_ATTRS = ("qkv", "proj", "num_heads", "key_dim", "val_dim", "val_attn_dim", "scale", "attention_biases",
          "attention_bias_idxs")


def _tokens(cg: Any, extents: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
    """This rank's first token and the global token count (agreed extents of dim -2)."""
    (sizes,) = extents
    return sum(sizes[:cg.index]), sum(sizes)


@public
class DomainEfficientFormerAttention(HaloLayer, nn.Module):
    """timm's EfficientFormer ``Attention`` over a field's tokens ``(B, N_r, C)`` (this rank's contiguous share of
    the global row-major tokens) on an H-shard: the same attributes, ``state_dict`` and numbers as the unsharded
    layer, its position bias the ring's mask rows of this rank's queries (module docstring)."""

    def __init__(self, attn: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        missing = [a for a in _ATTRS if not hasattr(attn, a)]
        if missing:
            raise TypeError(f"{name} wraps timm's efficientformer.Attention; {type(attn).__module__}."
                            f"{type(attn).__name__} lacks {missing}")
        adopt(self, attn, name=name)
        self.__dict__.pop("attention_bias_cache", None)  # the original's eval cache of the whole N x N bias
        self.halo_init(group)
        self._halo_path = ""  # where the layer sits (the converter sets it): named in its errors
        self._ring_sites = (Site(), Site(), Site())

    def extra_repr(self) -> str:
        return f"dim={self.qkv.in_features}, num_heads={self.num_heads}, tokens={self.attention_bias_idxs.shape[0]}"

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, first: int
                ) -> torch.Tensor:
        """This rank's queries on every rank's keys (the ring), the bias rows of its queries (``first`` its first
        token) added to the scores."""
        return ring_sdpa(q, k, v, attn_mask=bias, scale=self.scale, group=self.group, sites=self._ring_sites)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = f"{type(self).__name__} ({_MODULE}.Attention) at {self._halo_path or 'its place'}"
        first, total = resolve(x, self.group, name, _tokens, site=self._halo_site, spec=(-2,), allow_empty=True,
                               split=False)
        if x.dim() != 3:  # after the agreement (x.dim() is alike on every rank: the agreement checked it)
            raise ValueError(f"{name}: expected this rank's tokens (B, N_r, C), got shape {tuple(x.shape)}")
        table = self.attention_bias_idxs.shape[0]
        if total != table:
            raise ValueError(f"{name}: its position bias is built for {table} tokens (attention_bias_idxs "
                             f"{tuple(self.attention_bias_idxs.shape)}), got {total} over the domain group; give "
                             f"the input size that makes the last stage's grid hold {table} tokens (the unsharded "
                             f"model fails there too)")
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, self.num_heads, -1).permute(0, 2, 1, 3)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.val_dim], dim=3)
        bias = self.attention_biases[:, self.attention_bias_idxs[first:first + n]]  # (heads, n, N): our query rows
        y = self._attend(q, k, v, bias.unsqueeze(0), first)
        out = self.proj(y.transpose(1, 2).reshape(b, n, self.val_attn_dim))
        carry(out, x)
        place_like(out, x, 1)
        return out


def _is_timm(m: nn.Module, name: str, attrs: tuple[str, ...] = ()) -> bool:
    kind = type(m)
    return kind.__module__ == _MODULE and kind.__name__ == name and all(hasattr(m, a) for a in attrs)


def _keep(m: nn.Module, ctx: Any) -> nn.Module:
    return m


def efficientformer_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The converter ``fn(module, ctx)`` of timm's EfficientFormer ``Attention`` and ``Flat`` (recognised by
    defining module, name and attributes), else ``None`` (for ``halo.nn.adapters.adapter``). Both are refused on a
    latitude x longitude mesh, naming why."""
    if _is_timm(module, "Attention", _ATTRS):
        return latitude_only(lambda m, ctx: DomainEfficientFormerAttention(m, group=ctx.group),
                             "EfficientFormer's attention over all tokens")
    if _is_timm(module, "Flat") and not module._modules and not module._parameters and not module._buffers:
        return latitude_only(_keep, "EfficientFormer's Flat (row-major tokens of the whole grid)")
    return None
