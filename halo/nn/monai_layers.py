"""MONAI's vision transformer (``ViT``) and ``UNETR`` on H-shards: patches of the global field, attention over all
patches by the ring, the tokens back into a field.

MONAI is not imported here: its classes are recognised by defining module, name and the attributes read.

``PatchEmbeddingBlock`` (``proj_type="conv"``) cuts the field into ``p x p`` patches with a conv of kernel and
stride ``p`` (converted as a child: a ``DomainConv2d``, whose output is the balanced split of the global patch rows,
the rows a patch reads across a rank's edge coming by the halo exchange, so any split of the image rows works),
flattens them row-major into tokens and adds ``position_embeddings`` (``(1, N, C)``, one per patch of the global
grid). On a latitude split rank ``r`` holds the patch rows ``[off_r, off_r + R_r)``, so its tokens are the global
tokens ``[off_r * Wp, (off_r + R_r) * Wp)`` in rank order: :class:`DomainPatchEmbeddingBlock` adds the rows of the
position table that belong to them (their gradient: the contribution of this rank's tokens, summed over the domain
group by the gradient sync as every other parameter's).

``SABlock`` (self-attention over all tokens: ``torch.einsum`` + ``softmax``, or SDPA with ``use_flash_attention``)
becomes :class:`DomainSABlock`: the same ``qkv`` (or ``to_q`` / ``to_k`` / ``to_v``) and ``out_proj`` on this rank's
tokens, the attention over every rank's keys by :func:`halo.nn.ring.ring_sdpa` (exact forward and backward). The
``TransformerBlock``'s LayerNorms and MLP act on each token and convert as usual.

``UNETR`` reads the ViT's hidden states back into fields with ``proj_feat`` (a ``view`` to the *global* patch
grid, ``feat_size``): on a shard its tokens are ``R_r x Wp``, so halo gives the model a ``proj_feat`` that views
this rank's tokens as its patch rows (the same permutation); its encoders and decoders (convs, transposed convs,
instance norms, the ``cat`` of the skips) are halo's layers, whose outputs are the balanced split of each level's
global rows, so the skips pair up. ``revert_domain_parallel`` takes the model's own ``proj_feat`` back.

MONAI's ``ChannelPad`` (HighResNet's residual branch: zero channels padded on, or a 1x1 conv) is pointwise in
latitude and kept.

Refused, by name and on every rank: ``proj_type="perceptron"`` (an einops rearrange of pixels into patches), a
token count other than the position table's (the unsharded model fails there too), an ``attn_mask``, causal
attention, a relative position embedding, ``save_attn``, ``attention_dtype``, a class token
(``classification=True``: a token that belongs to no rank's rows), attention dropout in training, and a latitude x
longitude mesh (a rank's tokens are then not contiguous; :func:`halo.nn.ring.latitude_only`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..context import place
from ..plan.plans import Site, carry, resolve
from .base import DomainLayer, adopt
from .registry import public
from .ring import latitude_only, place_like, ring_sdpa

__all__ = ["DomainPatchEmbeddingBlock", "DomainSABlock", "monai_adapter", "unpin_proj_feat"]

_PATCH_ATTRS = ("patch_embeddings", "position_embeddings", "dropout", "proj_type", "n_patches")
_SA_ATTRS = ("num_heads", "dim_head", "scale", "use_combined_linear", "out_proj", "drop_output", "drop_weights",
             "dropout_rate", "causal", "rel_positional_embedding", "save_attn", "attention_dtype", "include_fc")


def _tokens(cg: Any, extents: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
    """This rank's first token and the global token count (agreed extents of dim -2)."""
    (sizes,) = extents
    return sum(sizes[:cg.index]), sum(sizes)


@public
class DomainPatchEmbeddingBlock(DomainLayer, nn.Module):
    """MONAI's ``PatchEmbeddingBlock`` (``proj_type="conv"``) on an H-shard: its conv (a ``DomainConv2d`` once
    converted), this rank's tokens, and the rows of the position table that belong to them (module docstring). The
    same attributes and ``state_dict`` as MONAI's."""

    def __init__(self, block: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        missing = [a for a in _PATCH_ATTRS if not hasattr(block, a)]
        if missing:
            raise TypeError(f"{name} wraps MONAI's PatchEmbeddingBlock; {type(block).__name__} lacks {missing}")
        if block.proj_type != "conv":
            raise ValueError(f"{name}: MONAI's PatchEmbeddingBlock with proj_type={block.proj_type!r} rearranges "
                             f"pixels into patches with einops, which halo has no domain-parallel form of; build it "
                             f"with proj_type='conv' (the same patches, by a conv of kernel and stride patch_size)")
        adopt(self, block, name=name)
        self.halo_init(group)
        self._halo_path = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = f"{type(self).__name__} (monai PatchEmbeddingBlock) at {self._halo_path or 'its place'}"
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a (B, C, H, W) field (spatial_dims=2), got shape {tuple(x.shape)}")
        patches = self.patch_embeddings(x)
        tokens = patches.flatten(2).transpose(-1, -2)
        first, total = resolve(tokens, self.group, name, _tokens, site=self._halo_site, spec=(-2,),
                               allow_empty=True, split=False)
        if total != int(self.n_patches):
            raise ValueError(f"{name}: its position embeddings are built for {int(self.n_patches)} patches "
                             f"(img_size / patch_size), got {total} over the domain group; give the input size "
                             f"the model was built for (the unsharded model fails there too)")
        pos = self.position_embeddings
        out = self.dropout(tokens + pos[:, first:first + tokens.shape[1]])
        carry(out, x)
        place(out, 1, int(patches.shape[-2]))  # tokens: this rank's patch rows, the columns merged after them
        return out


@public
class DomainSABlock(DomainLayer, nn.Module):
    """MONAI's ``SABlock`` over this rank's tokens ``(B, N_r, C)``: its projections on them, the attention over
    every rank's keys by the ring (module docstring). The same attributes and ``state_dict`` as MONAI's."""

    halo_owns_children = True  # its einops rearranges are done here; its Linears act on each token

    def __init__(self, block: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        missing = [a for a in _SA_ATTRS if not hasattr(block, a)]
        if missing:
            raise TypeError(f"{name} wraps MONAI's SABlock; {type(block).__name__} lacks {missing}")
        what = ("causal attention" if block.causal else
                "a relative position embedding" if block.rel_positional_embedding is not None else
                "save_attn=True (the whole attention matrix)" if block.save_attn else
                f"attention_dtype={block.attention_dtype}" if block.attention_dtype is not None else None)
        if what is not None:
            raise ValueError(f"{name}: MONAI's SABlock with {what} has no domain-parallel form in halo; build it "
                             f"without")
        adopt(self, block, name=name)
        self.halo_init(group)
        self._ring_sites = (Site(), Site(), Site())  # ring_sdpa's agreements (q, k/v, mask)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        name = type(self).__name__
        if self.training and self.dropout_rate > 0:
            raise ValueError(f"{name}: attention dropout in training (dropout_rate={self.dropout_rate}) is not "
                             f"supported on shards (each rank would draw its own pattern); set it to 0 or call eval()")
        if attn_mask is not None:
            raise ValueError(f"{name}: an attn_mask (a mask over every rank's tokens) is not supported on shards")
        if x.dim() != 3:
            raise ValueError(f"{name}: expected (B, N, C) tokens, got shape {tuple(x.shape)}")
        b, n, _ = x.shape
        heads, d = self.num_heads, self.dim_head
        if self.use_combined_linear:  # "b h (qkv l d) -> qkv b l h d"
            q, k, v = self.qkv(x).reshape(b, n, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        else:  # "b h (l d) -> b l h d" each
            q, k, v = (f(x).reshape(b, n, heads, d).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        y = ring_sdpa(q, k, v, scale=self.scale, group=self.group, sites=self._ring_sites)
        y = y.transpose(1, 2).reshape(b, n, heads * d)  # "b l h d -> b h (l d)"
        if self.include_fc:
            y = self.out_proj(y)
        out = self.drop_output(y)
        carry(out, x)
        place_like(out, x, 1)
        return out


class _LocalProjFeat:
    """UNETR's ``proj_feat`` on an H-shard: this rank's tokens ``(B, R_r * Wp, C)`` viewed as its patch rows and
    permuted to ``(B, C, R_r, Wp)``, as MONAI's does for the whole grid (module docstring). Module-level (the
    converted model pickles)."""

    def __init__(self, cols: int, hidden: int) -> None:
        self.cols, self.hidden = cols, hidden

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        if c != self.hidden or n % self.cols:
            raise ValueError(f"UNETR.proj_feat on a shard: expected this rank's tokens (B, rows * {self.cols}, "
                             f"{self.hidden}), got shape {tuple(x.shape)}")
        out = x.view(b, n // self.cols, self.cols, c).permute(0, 3, 1, 2).contiguous()
        place(out, 2, n // self.cols)
        return out


def _unetr(m: nn.Module, ctx: Any) -> None:
    """UNETR itself: its ``proj_feat`` for this rank's tokens (module docstring); its children convert as usual."""
    if len(m.feat_size) != 2:
        raise ValueError(f"monai UNETR with spatial_dims={len(m.feat_size)}: halo converts the 2-d model "
                         f"(spatial_dims=2, (B, C, H, W) fields) only")
    m.__dict__["proj_feat"] = _LocalProjFeat(int(m.feat_size[1]), int(m.hidden_size))
    return None


def unpin_proj_feat(model: nn.Module) -> None:
    """MONAI UNETR's own ``proj_feat`` back (``revert_domain_parallel`` calls this)."""
    for m in model.modules():
        if isinstance(m.__dict__.get("proj_feat"), _LocalProjFeat):
            del m.__dict__["proj_feat"]


def _monai(m: nn.Module, name: str, attrs: tuple[str, ...] = ()) -> bool:
    kind = type(m)
    return kind.__module__.split(".")[0] == "monai" and kind.__name__ == name and all(hasattr(m, a) for a in attrs)


def _vit(m: nn.Module, ctx: Any) -> None:
    if hasattr(m, "cls_token") or hasattr(m, "classification_head"):
        raise ValueError("monai ViT with classification=True: its class token belongs to no rank's rows (it "
                         "attends to every patch and is read alone by the head); halo converts the ViT without it "
                         "(classification=False, as UNETR builds it)")
    return None


def monai_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module | None] | None:
    """The converter of a MONAI layer halo knows (module docstring), or ``None``."""
    if _monai(module, "PatchEmbeddingBlock", _PATCH_ATTRS):
        return latitude_only(lambda m, ctx: DomainPatchEmbeddingBlock(m, group=ctx.group), "MONAI's patch embedding")
    if _monai(module, "SABlock", _SA_ATTRS):
        return latitude_only(lambda m, ctx: DomainSABlock(m, group=ctx.group), "MONAI's self-attention")
    if _monai(module, "UNETR", ("feat_size", "hidden_size", "proj_axes", "vit")):
        return latitude_only(_unetr, "UNETR's tokens read back into fields")
    if _monai(module, "ViT", ("patch_embedding", "blocks", "norm")):
        return _vit
    if _monai(module, "ChannelPad", ("project", "pad")) and not module._parameters and not module._buffers:
        return _channel_pad
    return None


def _channel_pad(m: nn.Module, ctx: Any) -> nn.Module | None:
    """MONAI's ``ChannelPad`` (HighResNet's residual branch): zero channels padded on (``F.pad`` of the channel dim
    only) or a 1x1 conv: pointwise in latitude. With the conv, its child converts as usual (``None``); its forward
    is kept and watched by the guard."""
    return None if m.project is not None else m
