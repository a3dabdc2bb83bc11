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

EfficientFormerV2 (``timm.models.efficientformer_v2``) keeps its fields ``(B, C, H, W)`` throughout; its
attentions over all tokens of a grid are :class:`DomainEfficientFormerV2Attention2d` (``Attention2d``: in the third
stage after a stride-2 depthwise ``stride_conv``, then upsampled back by ``upsample``, bilinear; with its *talking
heads*, 1x1 convs over the heads of the scores before and after the softmax, folded exactly into one ring attention
per head: see the class) and :class:`DomainEfficientFormerV2Attention2dDownsample` (``Attention2dDownsample``:
queries from the stride-2 grid, keys and values from the full one). Their convs and BatchNorms (``q``, ``k``, ``v``,
``v_local``, ``stride_conv``, ``proj``) and ``upsample`` are halo's, converted as children; the bias rows are those
of this rank's queries, as above. timm fixes V2's grids (and bias tables) from ``img_size``.

Refused, by name and on every rank alike: a grid other than the bias table's (the unsharded model fails there
too, with a shape error; for V2's stride-2 attention also an input grid that its upsample does not give back, where
the residual sum would fail on some ranks only), the layers here and ``Flat`` on a latitude x longitude mesh (a
rank's tokens are then not contiguous in the global order; :func:`halo.nn.ring.latitude_only`), a V2 layer whose
convs, norms or upsample are still torch's on more than one rank (built directly, or by a custom converter, whose
result the converter does not enter: they would run on each shard alone), and a look-alike without the attributes
read here.

Cost: V1's attention is the ring's of the original; V2's talking heads make each head's queries ``heads * key_dim``
wide and its output ``heads * d`` (the values of every head side by side), ``heads`` times the original's per head,
with K and V sent once for all heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..dist.comm import comm_group
from ..parallel.reduce import all_reduce
from ..plan.plans import Site, carry, resolve
from .base import DomainLayer, adopt
from .registry import is_pointwise_conv, public
from .ring import latitude_only, place_like, ring_sdpa

__all__ = ["DomainEfficientFormerAttention", "DomainEfficientFormerV2Attention2d",
           "DomainEfficientFormerV2Attention2dDownsample", "efficientformer_adapter"]

_MODULE = "timm.models.efficientformer"
_MODULE_V2 = "timm.models.efficientformer_v2"
_ATTRS_V2 = ("q", "k", "v", "v_local", "proj", "act", "num_heads", "key_dim", "d", "dh", "scale", "resolution",
             "attention_biases", "attention_bias_idxs")
_ATTRS = ("qkv", "proj", "num_heads", "key_dim", "val_dim", "val_attn_dim", "scale", "attention_biases",
          "attention_bias_idxs")


def _tokens(cg: Any, extents: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
    """This rank's first token and the global token count (agreed extents of dim -2)."""
    (sizes,) = extents
    return sum(sizes[:cg.index]), sum(sizes)


@public
class DomainEfficientFormerAttention(DomainLayer, nn.Module):
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


# -- EfficientFormerV2 ------------------------------------------------------------------------------------------------

def _rows(cg: Any, extents: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
    """This rank's first row and the global rows of a field (agreed extents of dim -2)."""
    (sizes,) = extents
    return sum(sizes[:cg.index]), sum(sizes)


class _V2Layer(DomainLayer, nn.Module):
    """What both V2 attentions share: the adopted state, the sites, the grid checks and the bias rows."""

    _kind = ""

    def _v2_init(self, attn: nn.Module, group: Any, attrs: tuple[str, ...]) -> None:
        name = type(self).__name__
        missing = [a for a in attrs if not hasattr(attn, a)]
        if missing:
            raise TypeError(f"{name} wraps timm's efficientformer_v2.{self._kind}; {type(attn).__module__}."
                            f"{type(attn).__name__} lacks {missing}")
        adopt(self, attn, name=name)
        self.__dict__.pop("attention_bias_cache", None)  # the original's eval cache of the whole bias table
        self.halo_init(group)
        self._halo_path = ""
        self._grid_sites = (Site(), Site())
        self._ring_sites = (Site(), Site(), Site())

    def _name(self) -> str:
        return f"{type(self).__name__} ({_MODULE_V2}.{self._kind}) at {self._halo_path or 'its place'}"

    def _check_children(self) -> None:
        """Refuse (once, on every rank alike: the modules are the same) children that act across rows and are still
        torch's own: the layer leaves its convs, norms, pools and upsample to the converter, so one built directly
        (or by a custom converter, whose result the converter does not enter) would run them on each shard alone."""
        if "_children_checked" in self.__dict__:
            return
        if comm_group(self.group).size > 1:
            torch_own = [f"{n} ({type(m).__name__})" for n, m in self.named_modules() if m is not self
                         and not isinstance(m, DomainLayer) and isinstance(m, _ACROSS_ROWS)
                         and not (isinstance(m, nn.Conv2d) and is_pointwise_conv(m))]
            if torch_own:
                raise ValueError(f"{self._name()}: its children {', '.join(torch_own)} are torch's own, which "
                                 f"compute each shard alone; convert the model with halo.nn.convert_to_domain_parallel "
                                 f"(it converts them), or convert them before the call")
        self.__dict__["_children_checked"] = True

    def _grid(self, t: torch.Tensor, resolution: tuple[int, int], what: str, site: int) -> int:
        """This rank's first token of the field ``t`` ``(B, C, h_r, w)`` (row-major tokens: its first row times
        ``w``), after checking that the global grid is the one the layer's bias table was built for (timm fixes it
        from ``img_size``): the same verdict on every rank."""
        first, rows = resolve(t, self.group, self._name(), _rows, site=self._grid_sites[site], spec=(-2,))
        if (rows, t.shape[-1]) != tuple(resolution):
            raise ValueError(f"{self._name()}: its {what} grid is built for {tuple(resolution)} (timm's img_size "
                             f"fixes it, with the position bias), got ({rows}, {t.shape[-1]}) over the domain group; "
                             f"build the model with img_size= the input's size (the unsharded model fails there too)")
        return first * t.shape[-1]

    def _bias(self, first: int, n: int) -> torch.Tensor:
        """The bias rows of this rank's ``n`` queries from token ``first``: ``(heads, n, N)``."""
        return self.attention_biases[:, self.attention_bias_idxs[first:first + n]]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, first: int,
                scale: float) -> torch.Tensor:
        """This rank's queries on every rank's keys (the ring), ``mask`` the rows of its queries."""
        return ring_sdpa(q, k, v, attn_mask=mask, scale=scale, group=self.group, sites=self._ring_sites)


#: the children's layers that read other rows (a 1x1 stride-1 conv does not)
_ACROSS_ROWS = (nn.Conv2d, nn.modules.batchnorm._BatchNorm, nn.AvgPool2d, nn.MaxPool2d, nn.Upsample)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, heads * c, h, w)`` as timm splits it (``reshape(B, heads, c, h * w)``) to tokens
    ``(B, heads, h * w, c)``."""
    b, _, h, w = t.shape
    return t.reshape(b, heads, -1, h * w).transpose(-1, -2)


@public
class DomainEfficientFormerV2Attention2d(_V2Layer):
    """timm's EfficientFormerV2 ``Attention2d`` on an H-shard ``(B, C, H_r, W)``: attention over all tokens of its
    grid (after its stride-2 depthwise ``stride_conv`` where it has one, then bilinear ``upsample``), with the
    position bias and the *talking heads*, exactly.

    The talking heads are 1x1 convs over the heads of the ``N x N`` scores: ``talking_head1`` before the softmax,
    ``talking_head2`` after it. Both fold into one ring attention per head (the reordering of sums, not an
    approximation): with ``W1, b1`` and ``W2, b2`` their weights,

    * head ``h``'s scores ``sum_g W1[h,g] (scale q_g . k_g + B_g) + b1[h]`` are one dot product of
      ``q'_h = [W1[h,g] scale q_g]_g`` with the keys of every head side by side, ``[k_g]_g``, plus the mask
      ``sum_g W1[h,g] B_g + b1[h]`` (this rank's bias rows): ``ring_sdpa`` with ``scale=1``;
    * ``A_h = sum_g W2[h,g] P_g + b2[h]`` applied to ``V_h`` is ``sum_g W2[h,g] (P_g V_h) + b2[h] sum_j V_h[j]``:
      the ring attention of head ``g`` over the values of every head side by side (``P_g [V_h]_h``), mixed by
      ``W2``, plus ``b2`` times the column sums of ``V`` over all tokens (an all-reduce).

    So K and V travel once for all heads (``heads * key_dim`` and ``heads * d`` wide, as the layer's own), and each
    rank's scores are ``heads x n_r x N``. Children (``stride_conv``, ``q``, ``k``, ``v``, ``v_local``, ``proj``:
    convs and BatchNorms; ``upsample``) are halo's (the converter converts them). State unchanged."""

    _kind = "Attention2d"

    def __init__(self, attn: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        self._v2_init(attn, group, (*_ATTRS_V2, "talking_head1", "talking_head2", "stride_conv", "upsample"))

    def extra_repr(self) -> str:
        stride = "" if self.stride_conv is None else ", stride 2"
        return f"num_heads={self.num_heads}, resolution={tuple(self.resolution)}{stride}, talking heads"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_children()
        heads = self.num_heads
        y = x
        if self.stride_conv is not None:
            _, rows = resolve(x, self.group, self._name(), _rows, site=self._halo_site, spec=(-2,))
            up = self.upsample.scale_factor if self.upsample is not None else 1
            up = int(up[0] if isinstance(up, tuple) else up)  # (timm's: the stride, 2)
            back = tuple(r * up for r in self.resolution)
            if (rows, x.shape[-1]) != back:  # else the residual sum would fail on some ranks only
                raise ValueError(f"{self._name()}: its input grid must be {back} (its stride-2 grid "
                                 f"{tuple(self.resolution)} upsampled by {up}, timm's img_size fixes it), got "
                                 f"({rows}, {x.shape[-1]}) over the domain group; build the model with img_size= the "
                                 f"input's size, with an even grid at this stage (the unsharded model fails there "
                                 f"too)")
            y = self.stride_conv(x)
        first = self._grid(y, self.resolution, "attention", 0)
        b, _, h, w = y.shape
        q, k = _heads(self.q(y), heads), _heads(self.k(y), heads)  # (B, heads, n, key_dim)
        v = self.v(y)
        v_local = self.v_local(v)
        v = _heads(v, heads)  # (B, heads, n, d)
        n = q.shape[-2]
        # (in q's and v's dtype: under autocast they are half, the heads' weights float32, and an einsum would
        # promote; timm's 1x1 convs of the heads run in half there)
        w1, b1 = self.talking_head1.weight[:, :, 0, 0].to(q.dtype), self.talking_head1.bias
        w2, b2 = self.talking_head2.weight[:, :, 0, 0].to(v.dtype), self.talking_head2.bias
        q1 = torch.einsum("hg,bgnc->bhngc", w1 * self.scale, q).reshape(b, heads, n, -1)
        k1 = k.transpose(1, 2).reshape(b, 1, k.shape[-2], -1)  # every head's keys side by side
        v1 = v.transpose(1, 2).reshape(b, 1, v.shape[-2], -1)  # every head's values side by side
        mask = torch.einsum("hg,gnm->hnm", w1, self._bias(first, n))
        if b1 is not None:
            mask = mask + b1[:, None, None]
        o = self._attend(q1, k1, v1, mask.unsqueeze(0), first, 1.0)  # (B, g, n, heads * d): P_g [V_h]_h
        out = torch.einsum("hg,bgnhd->bhnd", w2, o.reshape(b, heads, n, heads, self.d))
        if b2 is not None:  # b2[h] times the sum of V_h over all tokens
            out = out + b2.to(v.dtype)[None, :, None, None] * all_reduce(v.sum(-2, keepdim=True), group=self.group)
        out = out.transpose(-1, -2).reshape(b, self.dh, h, w) + v_local
        if self.upsample is not None:
            out = self.upsample(out)
        out = self.proj(self.act(out))
        carry(out, x)
        return out


@public
class DomainEfficientFormerV2Attention2dDownsample(_V2Layer):
    """timm's EfficientFormerV2 ``Attention2dDownsample`` on an H-shard ``(B, C, H_r, W)``: queries from the
    stride-2 grid (``q``, a ``LocalGlobalQuery``: a strided depthwise conv plus a strided 1x1 pool, then a 1x1
    ConvNorm), keys and values from the full grid, the bias rows of this rank's reduced queries (``N2 x N`` table),
    by the ring (queries and keys counted apart: each rank holds its share of both grids). Children are halo's (the
    converter converts them). State unchanged."""

    _kind = "Attention2dDownsample"

    def __init__(self, attn: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        self._v2_init(attn, group, (*_ATTRS_V2, "resolution2", "out_dim"))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, resolution={tuple(self.resolution)} -> {tuple(self.resolution2)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_children()
        heads = self.num_heads
        self._grid(x, self.resolution, "key", 0)
        qf = self.q(x)
        first = self._grid(qf, self.resolution2, "query", 1)
        b, _, h2, w2 = qf.shape
        q, k = _heads(qf, heads), _heads(self.k(x), heads)
        v = self.v(x)
        v_local = self.v_local(v)
        v = _heads(v, heads)
        n = q.shape[-2]
        o = self._attend(q, k, v, self._bias(first, n).unsqueeze(0), first, self.scale)  # (B, heads, n, d)
        out = o.transpose(-1, -2).reshape(b, self.dh, h2, w2) + v_local
        out = self.proj(self.act(out))
        carry(out, x)
        return out


def _is_timm(m: nn.Module, name: str, attrs: tuple[str, ...] = (), module: str = _MODULE) -> bool:
    kind = type(m)
    return kind.__module__ == module and kind.__name__ == name and all(hasattr(m, a) for a in attrs)


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
    if _is_timm(module, "Attention2d", _ATTRS_V2, _MODULE_V2):
        return latitude_only(lambda m, ctx: DomainEfficientFormerV2Attention2d(m, group=ctx.group),
                             "EfficientFormerV2's attention over all tokens")
    if _is_timm(module, "Attention2dDownsample", _ATTRS_V2, _MODULE_V2):
        return latitude_only(lambda m, ctx: DomainEfficientFormerV2Attention2dDownsample(m, group=ctx.group),
                             "EfficientFormerV2's attention over all tokens")
    return None
