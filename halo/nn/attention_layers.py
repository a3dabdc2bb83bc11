"""Attention layers over all tokens of a field, converted: the same numbers as the unsharded layer, by the ring.

A field ``(B, C, H, W)`` split along H gives rank ``r`` the rows ``[off_r, off_r + H_r)``; its tokens (the row-major
``H * W`` positions, ``x.flatten(2).transpose(1, 2)``) are then the contiguous global tokens
``[off_r * W, (off_r + H_r) * W)``, in rank order: exactly the split :func:`halo.nn.ring.ring_sdpa` takes. Each layer
below keeps the original's parameters and attribute names (``state_dict`` keys unchanged) and computes its
projections on its own tokens (pointwise in the tokens) and the attention over all tokens with ``ring_sdpa``.
Parameter gradients on each rank are the contribution of its tokens: their sum over the domain group is the
unsharded gradient (``halo.sync_domain_gradients``).

=================================================  ===============================================================
layer                                              converted as
=================================================  ===============================================================
``nn.MultiheadAttention``                          :class:`DomainMultiheadAttention`: ``batch_first`` either way,
                                                   query, key and value tokens of fields split alike (self-
                                                   attention); ``key_padding_mask`` (this rank's keys: gathered,
                                                   small), ``attn_mask`` as ``ring_sdpa``'s (global key dim; bool
                                                   True = masked out, as torch's), ``need_weights`` (this rank's
                                                   query rows of the weights, from the gathered keys), ``kdim`` /
                                                   ``vdim``. Refused at conversion: ``add_bias_kv``,
                                                   ``add_zero_attn`` (an extra key every rank would add); in the
                                                   call: ``is_causal`` (torch's is a hint about the mask), dropout in
                                                   training
timm ``Attention`` (``timm.layers.Attention``,     :class:`DomainTimmAttention`: ``qkv``, ``q_norm`` / ``k_norm``,
``timm.models.vision_transformer.Attention``)      ``norm``, ``gate``, ``proj``; ``attn_mask`` / ``is_causal`` as
                                                   ``ring_sdpa``'s (global positions)
diffusers ``Attention`` with ``AttnProcessor2_0``  :class:`DomainDiffusersAttention`: a ``(B, C, H, W)`` field or
(or ``AttnProcessor``)                             ``(B, N, C)`` tokens; ``group_norm`` over the whole domain (the
                                                   converted ``DomainGroupNorm`` on the ``(B, C, H_r, W)`` shard);
                                                   ``residual_connection``, ``rescale_output_factor``. With
                                                   ``encoder_hidden_states`` (a whole context, the same on every
                                                   rank: text embeddings) it is cross-attention, exact locally: each
                                                   query row depends only on itself and the context. Refused:
                                                   ``attention_mask`` in self-attention, ``spatial_norm``, other
                                                   processors
=================================================  ===============================================================

On a latitude x longitude mesh these layers are refused at conversion (the registry's ``axes=1``): the ring over
all ranks would be exact without masks (keys are permutation-equivariant), but the guard's latitude-only planning
does not cover it yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..context import place
from ..plan.plans import Site, carry, resolve
from .base import DomainLayer, adopt
from .dropout import DomainDropout
from .efficientformer import efficientformer_adapter
from .norm import DomainGroupNorm
from .registry import converts, public
from .ring import gather_tokens, latitude_only, place_like, ring_sdpa

__all__ = [
    "DomainDiffusersAttention",
    "DomainMultiheadAttention",
    "DomainTimmAttention",
    "attention_adapter",
    "attention_converters",
]


class _RingLayer(DomainLayer, nn.Module):
    """Shared by the layers here: the group, the sites of ring_sdpa's agreements (q, k/v, mask)."""

    def _ring_init(self, group: Any) -> None:
        self.halo_init(group)
        self._ring_sites = (Site(), Site(), Site())

    def _refuse_dropout(self, p: float, what: str) -> None:
        if self.training and p > 0:
            raise ValueError(f"{type(self).__name__}: attention dropout in training ({what}={p}) is not supported "
                             f"on shards (each rank would draw its own pattern); set it to 0 or call eval()")

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
        return ring_sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, group=self.group,
                         sites=self._ring_sites)


# -- torch's nn.MultiheadAttention --------------------------------------------------------------------------------

def _mha(m: nn.Module, ctx: Any) -> nn.Module:
    return DomainMultiheadAttention(m, group=ctx.group)


@converts(nn.MultiheadAttention, make=_mha)
class DomainMultiheadAttention(_RingLayer):
    """``nn.MultiheadAttention`` over the tokens of fields split over the domain group (module docstring). Wraps
    an existing module (its Parameters are shared; state_dict keys unchanged)."""

    def __init__(self, mha: nn.MultiheadAttention, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"{name} wraps an nn.MultiheadAttention, got {type(mha).__name__}")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(f"{name}: add_bias_kv / add_zero_attn add a key (and value) of their own to every "
                             f"sequence, which halo's sharded attention does not have; build the layer without them")
        adopt(self, mha, name=name)
        self._ring_init(group)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"

    def _project(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:e], b[e:2 * e], b[2 * e:])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            return F.linear(query, w[:e], bq), F.linear(key, w[e:2 * e], bk), F.linear(value, w[2 * e:], bv)
        return (F.linear(query, self.q_proj_weight, bq), F.linear(key, self.k_proj_weight, bk),
                F.linear(value, self.v_proj_weight, bv))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        name = type(self).__name__
        self._refuse_dropout(self.dropout, "dropout")
        if is_causal:
            raise ValueError(f"{name}: is_causal=True (torch's hint that attn_mask is causal) is not supported on "
                             f"shards; pass the causal attn_mask itself (global positions, ring_sdpa's rules)")
        if query.dim() != 3:
            raise ValueError(f"{name}: expected batched (B, L, E) or (L, B, E) tokens, got shape "
                             f"{tuple(query.shape)} (unbatched input is not supported on shards)")
        dim = 1 if self.batch_first else 0
        x = query
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        bsz, nq, _ = query.shape
        heads, hd = self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)
        q, k, v = (t.reshape(bsz, t.shape[1], heads, hd).transpose(1, 2) for t in (q, k, v))
        mask = None
        if attn_mask is not None:
            mask = attn_mask
            if mask.dim() == 3:  # (B * heads, L, S)
                mask = mask.reshape(bsz, heads, *mask.shape[-2:])
            mask = mask.logical_not() if mask.dtype == torch.bool else mask.to(q.dtype)
            if key_padding_mask is not None and mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        if key_padding_mask is not None:
            kpm = key_padding_mask
            kpm = torch.zeros(kpm.shape, dtype=q.dtype, device=q.device).masked_fill(kpm, -math.inf) \
                if kpm.dtype == torch.bool else kpm.to(q.dtype)
            kpm = gather_tokens(kpm.unsqueeze(-1), group=self.group).reshape(bsz, 1, 1, -1)  # every rank's keys
            mask = kpm if mask is None else mask + kpm
        y = self._attend(q, k, v, mask)
        y = y.transpose(1, 2).reshape(bsz, nq, heads * hd)
        out = self.out_proj(y)
        weights = None
        if need_weights:  # this rank's query rows of the weights, over every key (gathered)
            kf = gather_tokens(k, group=self.group)
            s = torch.matmul(q, kf.transpose(-1, -2)) / math.sqrt(hd)
            if mask is not None:
                part = mask if mask.shape[-2] in (1, nq) else mask.narrow(-2, _q_offset(self, q), nq)
                s = s.masked_fill(~part, -math.inf) if part.dtype == torch.bool else s + part
            weights = s.softmax(-1)
            if average_attn_weights:
                weights = weights.mean(1)
        if not self.batch_first:
            out = out.transpose(0, 1)
        carry(out, x)
        place_like(out, x, dim)
        if weights is not None:
            carry(weights, x)
            place(weights, -2)
        return out, weights


def _first_rows(cg: Any, extents: tuple[tuple[int, ...], ...]) -> int:
    (sizes,) = extents
    return sum(sizes[:cg.index])


def _q_offset(layer: _RingLayer, q: torch.Tensor) -> int:
    """This rank's first query row (the weights of a mask given with the global rows)."""
    return resolve(q, layer.group, "DomainMultiheadAttention (weights)", _first_rows, spec=(-2,), allow_empty=True,
                   split=False)


# -- timm's Attention ---------------------------------------------------------------------------------------------

_TIMM_ATTRS = ("num_heads", "head_dim", "qkv", "q_norm", "k_norm", "attn_drop", "proj", "proj_drop")


@public
class DomainTimmAttention(_RingLayer):
    """timm's ``Attention`` (``timm.layers.Attention``, the ViT's) over a field's tokens ``(B, N_r, C)``: the same
    attributes and numbers (module docstring)."""

    def __init__(self, attn: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        missing = [a for a in _TIMM_ATTRS if not hasattr(attn, a)]
        if missing:
            raise TypeError(f"{name} wraps timm's Attention; {type(attn).__name__} lacks {missing}")
        adopt(self, attn, name=name)
        if type(self.proj_drop) is nn.Dropout:  # draws keyed on global token indices (as the converter makes it)
            self.proj_drop = DomainDropout(self.proj_drop, group=group)
        self._ring_init(group)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
                ) -> torch.Tensor:
        self._refuse_dropout(self.attn_drop.p, "attn_drop")
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected (B, N, C) tokens, got shape {tuple(x.shape)}")
        b, n, _ = x.shape
        dim = getattr(self, "attn_dim", self.num_heads * self.head_dim)
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        y = self._attend(q, k, v, attn_mask, is_causal, getattr(self, "scale", None))
        y = y.transpose(1, 2).reshape(b, n, dim)
        y = self.norm(y) if hasattr(self, "norm") else y
        if gate is not None:
            y = y * gate
        out = self.proj_drop(self.proj(y))
        carry(out, x)
        place_like(out, x, 1)
        return out


# -- diffusers' Attention -----------------------------------------------------------------------------------------

_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")


@public
class DomainDiffusersAttention(_RingLayer):
    """diffusers' ``Attention`` with its default processor on a field ``(B, C, H_r, W)`` or its tokens
    ``(B, N_r, C)`` (module docstring). Cross-attention (``encoder_hidden_states`` given: a whole context) runs
    locally: exact."""

    def __init__(self, attn: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        problem = _diffusers_problem(attn)
        if problem:
            raise ValueError(f"{type(attn).__module__}.{type(attn).__name__}: {problem}")
        adopt(self, attn, name=name)
        self.__dict__["_diffusers_class"] = type(attn)  # its methods (prepare_attention_mask, ...) run on self
        if type(self.group_norm) is nn.GroupNorm:  # statistics over the whole domain (parameter names kept)
            self.group_norm = DomainGroupNorm(self.group_norm, group=group)
        if len(self.to_out) > 1 and type(self.to_out[1]) is nn.Dropout:  # draws keyed on global token indices
            self.to_out = nn.ModuleList([self.to_out[0], DomainDropout(self.to_out[1], group=group),
                                         *self.to_out[2:]])
        self._ring_init(group)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        name = type(self).__name__
        x = hidden_states
        cross = encoder_hidden_states is not None
        if attention_mask is not None and not cross:
            raise ValueError(f"{name}: an attention_mask in self-attention over a field's tokens is not supported "
                             f"on shards (diffusers sizes it from the local tokens); pass none")
        four = x.dim() == 4
        if four:
            b, c, h, w = x.shape
            if self.group_norm is not None:
                x = self.group_norm(x)  # the converted DomainGroupNorm: statistics over the whole domain
            tokens = x.reshape(b, c, h * w).transpose(1, 2)
        else:
            if self.group_norm is not None:
                raise ValueError(f"{name}: group_norm over (B, N, C) tokens is not supported on shards; give the "
                                 f"layer its (B, C, H, W) field")
            tokens = x
            b = x.shape[0]
        query = self.to_q(tokens)
        context = tokens
        if cross:
            context = encoder_hidden_states
            if self.norm_cross:
                context = self._diffusers_class.norm_encoder_hidden_states(self, context)
        key, value = self.to_k(context), self.to_v(context)
        heads = self.heads
        hd = key.shape[-1] // heads
        q = query.view(b, -1, heads, hd).transpose(1, 2)
        k = key.view(b, -1, heads, hd).transpose(1, 2)
        v = value.view(b, -1, heads, hd).transpose(1, 2)
        if self.norm_q is not None:
            q = self.norm_q(q)
        if self.norm_k is not None:
            k = self.norm_k(k)
        if cross:  # a whole context: each query row depends on itself and the context only
            mask = None
            if attention_mask is not None:
                mask = self._diffusers_class.prepare_attention_mask(self, attention_mask, k.shape[-2], b)
                mask = mask.view(b, heads, -1, mask.shape[-1])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        else:
            y = self._attend(q, k, v)  # SDPA's default scale, as the processor (which ignores attn.scale)
        y = y.transpose(1, 2).reshape(b, -1, heads * hd).to(q.dtype)
        y = self.to_out[0](y)
        if len(self.to_out) > 1:
            y = self.to_out[1](y)
        if four:
            y = y.transpose(-1, -2).reshape(b, c, h, w)
        if self.residual_connection:
            y = y + hidden_states
        out = y / self.rescale_output_factor
        carry(out, hidden_states)
        if four:
            place(out, -2)
        else:
            place_like(out, hidden_states, 1)
        return out


def _diffusers_problem(attn: nn.Module) -> str | None:
    """Why halo cannot convert this diffusers ``Attention`` exactly (``None``: it can)."""
    proc = type(getattr(attn, "processor", None)).__name__
    if proc not in _PROCESSORS:
        return (f"halo converts diffusers' Attention with its default processor ({' or '.join(_PROCESSORS)}) only, "
                f"this one has {proc}; set attn.set_processor(AttnProcessor2_0()) or gather before it")
    if getattr(attn, "spatial_norm", None) is not None:
        return "its spatial_norm (resizes a latent to the shard's shape) has no domain-parallel form in halo"
    missing = [a for a in ("to_q", "to_k", "to_v", "to_out", "heads", "group_norm", "norm_q", "norm_k",
                           "residual_connection", "rescale_output_factor", "norm_cross") if not hasattr(attn, a)]
    if missing:
        return f"this diffusers version's Attention lacks {missing}"
    return None


# -- recognising the third-party classes (by name: halo never imports timm or diffusers) ---------------------------

def _is_timm_attention(m: nn.Module) -> bool:
    kind = type(m)
    return kind.__name__ == "Attention" and kind.__module__ in ("timm.layers.attention",
                                                                 "timm.models.vision_transformer") \
        and all(hasattr(m, a) for a in _TIMM_ATTRS)


def _is_diffusers_attention(m: nn.Module) -> bool:
    kind = type(m)
    return kind.__name__ == "Attention" and kind.__module__.split(".")[0] == "diffusers" and hasattr(m, "processor")


def attention_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The converter ``fn(module, ctx)`` of timm's or diffusers' attention class (recognised by name, module and
    attributes), else ``None`` (for ``halo.nn.adapters.adapter``). A diffusers ``Attention`` halo cannot compute
    exactly is refused at conversion, naming why; on a latitude x longitude mesh both are refused. timm's
    EfficientFormer attention (and its ``Flat``): :func:`halo.nn.efficientformer.efficientformer_adapter`."""
    if _is_timm_attention(module):
        return latitude_only(lambda m, ctx: DomainTimmAttention(m, group=ctx.group))
    if _is_diffusers_attention(module):
        return latitude_only(lambda m, ctx: DomainDiffusersAttention(m, group=ctx.group))
    return efficientformer_adapter(module)


@public
def attention_converters(model: nn.Module) -> dict[type, Callable[[nn.Module, Any], nn.Module]]:
    """``custom_converters`` for the timm / diffusers attention classes found in ``model`` (what
    :func:`attention_adapter` recognises), for ``convert_to_domain_parallel(model, custom_converters=...)``."""
    found: dict[type, Callable[[nn.Module, Any], nn.Module]] = {}
    for m in model.modules():
        fn = attention_adapter(m)
        if fn is not None:
            found.setdefault(type(m), fn)
    return found
