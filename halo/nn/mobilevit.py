"""timm's MobileViT block (``timm.models.mobilevit.MobileVitBlock``) on latitude shards, exactly.

The block: a local conv (``conv_kxk``, ``conv_1x1``), then its *global* part: the map cut into patches of
``p_h x p_w`` pixels, each of the ``p_h * p_w`` positions inside a patch a sequence of ``N = n_h * n_w`` tokens (one
per patch) run through a transformer (timm's ``Block``: attention over all ``N`` tokens), folded back, then
``conv_proj`` and the fusion conv with the block's input. On a shard, timm's own unfold reshapes
``(B, C, H_r, W)`` to ``(B * C * n_h, p_h, n_w, p_w)``, which merges the sharded rows with the batch (the guard
refuses it), and ``n_h`` comes from the shard's rows.

:class:`DomainMobileVitBlock` keeps timm's arithmetic and changes where the rows are:

- the patches must be whole on each rank: where a rank's first row is not a multiple of ``p_h`` (an uneven split),
  the rows are first regrouped (:func:`halo.nn.longrange.regroup`, one planned row permutation, its adjoint the
  inverse) to the most balanced split of whole patch rows (a rank may hold none: ring attention takes empty
  ranks), and moved back after the fold; with whole patches already, nothing moves;
- each rank unfolds its own patch rows: its tokens are the global tokens of its patch rows, in global order (rank
  order is token order: patch ``(i, j)`` is token ``i * n_w + j``), so the transformer's attention, converted to
  :class:`halo.nn.attention_layers.DomainTimmAttention` (ring attention over the domain group), attends to all ``N``
  tokens; its norms and MLP act on each token alone;
- a global H that is not a multiple of ``p_h`` makes timm resize the whole map (bilinear, along H): refused, naming
  the sizes that fit; a W that is not a multiple of ``p_w`` is resized along W only, on each rank's rows (the same
  numbers: W is whole on every rank and H keeps its size, so the bilinear weights along H are the identity).

Parameters, buffers and children are the block's own (``state_dict`` unchanged); its children (the convs, the
transformer) are converted by the converter's walk as any others. Latitude rows only: on a latitude x longitude mesh
the block is refused (:func:`halo.nn.ring.latitude_only`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..context import place, trusted
from ..dist.comm import CommGroup
from ..plan.partition import offsets
from ..plan.plans import Site, carry, resolve
from .base import DomainLayer, adopt
from .longrange import RegroupPlan, regroup, regroup_plan
from .norm import DomainGroupNorm
from .registry import public
from .ring import latitude_only

__all__ = ["DomainMobileVitBlock", "DomainMobileVitV2Block", "mobilevit_adapter"]

_ATTRS = ("conv_kxk", "conv_1x1", "transformer", "norm", "conv_proj", "conv_fusion", "patch_size", "patch_area")


@dataclasses.dataclass(frozen=True)
class PatchPlan:
    """This rank's patch rows: ``to`` (rows regrouped into whole patches, ``None``: they are already) and ``back``
    (its inverse)."""

    to: RegroupPlan | None
    back: RegroupPlan | None


def _patch_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], patch_h: int, op: str) -> PatchPlan:
    (sizes,) = extents
    h = sum(sizes)
    if h % patch_h:
        fits = f"{h - h % patch_h} or {h + patch_h - h % patch_h}"
        raise ValueError(f"{op}: {h} rows at this block are not a multiple of its patch height {patch_h}; timm then "
                         f"resizes the whole map along H (bilinear), which halo does not compute on shards: give "
                         f"the model an input whose rows here are a multiple of {patch_h} (e.g. {fits})")
    if cg.size == 1 or all(o % patch_h == 0 for o in offsets(sizes)):
        return PatchPlan(None, None)
    q, r = divmod(h // patch_h, cg.size)  # the most balanced split of whole patch rows (a rank may hold none)
    target = tuple((q + (i < r)) * patch_h for i in range(cg.size))
    identity = tuple(range(h))
    return PatchPlan(regroup_plan(cg, 2, sizes, target, identity, f"{op} (whole patches)"),
                     regroup_plan(cg, 2, target, sizes, identity, f"{op} (back)"))


@public
class DomainMobileVitBlock(DomainLayer, nn.Module):
    """timm's ``MobileVitBlock`` on an H-shard ``(B, C, H_r, W)`` (module docstring): the same numbers as the
    unsharded block, its tokens those of this rank's whole patch rows, its attention over all tokens."""

    def __init__(self, block: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        missing = [a for a in _ATTRS if not hasattr(block, a)]
        if missing:
            raise TypeError(f"DomainMobileVitBlock adopts timm's MobileVitBlock; {type(block).__name__} lacks "
                            f"{missing}")
        adopt(self, block, name="DomainMobileVitBlock")
        self.halo_init(group)
        self._halo_back_site = Site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainMobileVitBlock"
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a (B, C, H_local, W) shard, got shape {tuple(x.shape)}")
        shortcut = x
        x = self.conv_1x1(self.conv_kxk(x))
        patch_h, patch_w = self.patch_size
        plan = resolve(x, self.group, name, _patch_plan, (int(patch_h), name), site=self._halo_site, spec=(-2,),
                       allow_empty=True)
        y = x if plan.to is None else regroup(x, plan.to)
        b, c, h, w = y.shape
        n_h, new_w = h // patch_h, math.ceil(w / patch_w) * patch_w
        n_w = new_w // patch_w
        with trusted():  # timm's unfold, of whole patch rows: every row stays with its own patch (no rows mixed)
            if new_w != w:
                y = F.interpolate(y, size=(h, new_w), mode="bilinear", align_corners=False)
            t = y.reshape(b * c * n_h, patch_h, n_w, patch_w).transpose(1, 2)
            t = t.reshape(b, c, n_h * n_w, self.patch_area).transpose(1, 3).reshape(b * self.patch_area, n_h * n_w, c)
        t = self.norm(self.transformer(t))  # (B * P, N_r, C): the guard takes dim -2, the tokens, for the rows
        with trusted():  # timm's fold
            t = t.contiguous().view(b, self.patch_area, n_h * n_w, c)
            t = t.transpose(1, 3).reshape(b * c * n_h, n_w, patch_h, patch_w)
            y = t.transpose(1, 2).reshape(b, c, n_h * patch_h, n_w * patch_w)
            if new_w != w:
                y = F.interpolate(y, size=(h, w), mode="bilinear", align_corners=False)
        carry(y, x)
        y = y if plan.back is None else regroup(y, plan.back)
        place(y, -2)
        y = self.conv_proj(y)
        if self.conv_fusion is not None:
            y = self.conv_fusion(torch.cat((shortcut, y), dim=1))
        return y


_ATTRS_V2 = ("conv_kxk", "conv_1x1", "transformer", "norm", "conv_proj", "patch_size", "patch_area")


@public
class DomainMobileVitV2Block(DomainLayer, nn.Module):
    """timm's ``MobileVitV2Block`` on an H-shard ``(B, C, H_r, W)``: the unfold to ``(B, C, P, N_r)`` of this rank's
    whole patch rows (regrouped as :class:`DomainMobileVitBlock`'s), the patches' tokens at dim -1 for the guard.
    Its ``LinearTransformerBlock`` blocks are torch's and timm's own code on them, exact through the guard: their
    ``GroupNorm1`` a domain group norm (sums over the domain), ``LinearSelfAttention``'s softmax over the tokens and
    its sum of the keys over them domain reductions (``halo.guard.reroute``), its 1x1 convs pointwise. A global H
    that is not whole patches (timm resizes the whole map first) is refused, naming the rows; ``coreml_exportable``
    (``F.unfold``) too."""

    def __init__(self, block: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        missing = [a for a in _ATTRS_V2 if not hasattr(block, a)]
        if missing:
            raise TypeError(f"DomainMobileVitV2Block adopts timm's MobileVitV2Block; {type(block).__name__} lacks "
                            f"{missing}")
        adopt(self, block, name="DomainMobileVitV2Block")
        self.halo_init(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainMobileVitV2Block"
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a (B, C, H_local, W) shard, got shape {tuple(x.shape)}")
        if getattr(self, "coreml_exportable", False):
            raise ValueError(f"{name}: coreml_exportable (F.unfold of the map) is not computed on shards; build the "
                             f"model without it")
        patch_h, patch_w = self.patch_size
        b, _, h, w = x.shape
        if w % patch_w:
            raise ValueError(f"{name}: {w} columns are not a multiple of the patch width {patch_w}; timm then resizes "
                             f"the whole map (bilinear, align_corners=True), which halo does not compute on shards")
        for m in (*self.transformer.modules(), *self.norm.modules()):  # their group norms see the tokens last
            if isinstance(m, DomainGroupNorm):
                m.__dict__["_halo_tokens_last"] = True
        x = self.conv_1x1(self.conv_kxk(x))
        plan = resolve(x, self.group, name, _patch_plan, (int(patch_h), name), site=self._halo_site, spec=(-2,),
                       allow_empty=True)
        y = x if plan.to is None else regroup(x, plan.to)
        c, h = y.shape[1], y.shape[2]
        n_h, n_w = h // patch_h, w // patch_w
        with trusted():  # timm's unfold, of whole patch rows
            t = y.reshape(b, c, n_h, patch_h, n_w, patch_w).permute(0, 1, 3, 5, 2, 4).reshape(b, c, self.patch_area,
                                                                                              n_h * n_w)
        place(t, t.dim() - 1)  # (B, C, P, N_r): the tokens, in global order, hold the sharded rows
        t = self.norm(self.transformer(t))
        with trusted():  # timm's fold
            t = t.reshape(b, c, patch_h, patch_w, n_h, n_w).permute(0, 1, 4, 2, 5, 3)
            y = t.reshape(b, c, n_h * patch_h, n_w * patch_w)
        carry(y, x)
        y = y if plan.back is None else regroup(y, plan.back)
        return self.conv_proj(y)


def mobilevit_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The converter of timm's ``MobileVitBlock`` and ``MobileVitV2Block`` (by name, module and attributes), else
    ``None``."""
    kind = type(module)
    if kind.__module__ != "timm.models.mobilevit" or module._parameters or module._buffers:
        return None
    if kind.__name__ == "MobileVitBlock" and all(hasattr(module, a) for a in _ATTRS):
        return latitude_only(lambda m, ctx: DomainMobileVitBlock(m, group=ctx.group))
    if kind.__name__ == "MobileVitV2Block" and all(hasattr(module, a) for a in _ATTRS_V2):
        return latitude_only(lambda m, ctx: DomainMobileVitV2Block(m, group=ctx.group))
    return None
