"""Window attention (Swin) on latitude shards: exact shifted windows, patch merging and patch embedding.

A Swin block attends within windows of ``ws`` rows: a shard made of *whole* windows computes its windows on its own.
What crosses ranks is the cyclic shift of the shifted-window blocks, ``torch.roll`` along H, which is an exchange
(rank ``r`` with rows ``[off, off + n)`` of the rolled field receives the virtual rows ``[off - s, off + n - s)`` of
the input, circular boundary), and the shifted-window mask, built from *global* row indices for this rank's
windows. The layers follow timm's (``timm.models.swin_transformer``, channels-last ``(B, H, W, C)``: H is dim 1;
W stays whole on each rank) and adopt its modules' parameters and buffers, so ``state_dict`` keys are unchanged
(invariant 6):

===============================  ================================================  =============================
layer                            replaces (recognised by name and attributes)      split it needs / gives
===============================  ================================================  =============================
``DomainSwinTransformerBlock``     timm ``SwinTransformerBlock`` (recent: ``_attn``,  whole windows of
                                 ``drop_path1/2``, ``always_partition``,           ``window_size[0]`` rows per
                                 ``dynamic_mask``)                                 rank (the last rank may end
                                                                                   in a partial window); output
                                                                                   split = input split
``DomainWindowAttention``          timm ``WindowAttention`` inside a block           per window (no messages)
``DomainPatchMerging``             timm ``PatchMerging`` (norm over ``4 * dim``,     any; shards of even offsets
                                 then reduction)                                   give ``ceil(n / 2)`` rows
                                                                                   each (a block split stays
                                                                                   one), else the balanced split
``DomainPatchEmbed``               timm ``PatchEmbed`` (``img_size`` checked on the  any (``DomainConv2d``; shards
                                 global H)                                         that are multiples of the
                                                                                   patch give ``n // patch``)
===============================  ================================================  =============================

Shard a field so that windows do not straddle ranks with ``halo.shard(x, dim, granularity=g)``: for a model with
patch ``p`` and window ``ws`` at the first stage, ``g = p * ws`` on the image (``2 * p * ws`` keeps the second
stage's windows whole too, and so on). A shard that is not made of whole windows raises the same ``ValueError`` on
every rank (the extents are agreed first, ``halo.plan.plans``).

Gradients: the input gradient is exact (the roll's backward is the adjoint exchange, a roll the other way);
parameter gradients on each rank are the contribution of its windows: sum them over the domain group
(``halo.parallel.sync_domain_gradients``). Dropout inside the attention (``attn_drop``, ``proj_drop`` of
``WindowAttention``) acts on windows, not on a field: in training with ``p > 0`` it is refused (it would draw
differently per rank); ``DropPath`` and the MLP's dropouts become halo's sharding-invariant ones as elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..context import place
from ..dist.comm import CommGroup
from ..exchange import exchange, exchanger_id
from ..plan.partition import offsets, split_offsets, split_sizes
from ..plan.plans import carry, resolve
from .base import DomainLayer, adopt
from .registry import public

__all__ = [
    "DomainPatchEmbed",
    "DomainPatchMerging",
    "DomainSwinTransformerBlock",
    "DomainWindowAttention",
    "SwinPlan",
    "adopt_recognised",
    "block_window_mask",
    "broken_windows",
    "halo_roll",
    "latitude_only",
    "roll_needs",
    "shifted_window_attention",
    "shifted_window_plan",
    "window_attention_mask",
    "window_partition",
    "window_reverse",
]


# -- pure functions -------------------------------------------------------------------------------------------

@public
def window_partition(x: torch.Tensor, window_size: tuple[int, int]) -> torch.Tensor:
    """``(B, H, W, C)`` -> ``(B * nW, wh, ww, C)``, windows in row-major order (timm's ``window_partition``).

    On a shard made of whole windows this is the unsharded partition's windows of this rank's window rows.
    """
    b, h, w, c = x.shape
    x = x.view(b, h // window_size[0], window_size[0], w // window_size[1], window_size[1], c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size[0], window_size[1], c)


@public
def window_reverse(windows: torch.Tensor, window_size: tuple[int, int], h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: ``(B * nW, wh, ww, C)`` -> ``(B, h, w, C)`` (timm's)."""
    c = windows.shape[-1]
    x = windows.view(-1, h // window_size[0], w // window_size[1], window_size[0], window_size[1], c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, h, w, c)


def _labels(n: int, window: int, shift: int, device: torch.device | None) -> torch.Tensor:
    """Region of each of ``n`` (padded) rows: timm's three slices ``[0, -ws)``, ``[-ws, -s)``, ``[-s, None)``
    assigned in order (a later slice overrides, as timm's ``img_mask[:, h, w, :] = cnt`` does)."""
    out = torch.zeros(n, dtype=torch.int64, device=device)
    for i, (a, b) in enumerate(((0, -window), (-window, -shift), (-shift, None))):
        out[a:b] = i
    return out


@public
def window_attention_mask(height: int, width: int, window_size: tuple[int, int], shift_size: tuple[int, int],
                          rows: tuple[int, int] | None = None, *, dtype: torch.dtype = torch.float32,
                          device: torch.device | None = None) -> torch.Tensor | None:
    """The shifted-window attention mask of timm's ``SwinTransformerBlock.get_attn_mask`` for the window rows
    ``rows = (first, stop)`` of the global field (all of them by default): ``(nW_rows * nW_w, N, N)``, 0 within a
    region and -100 across regions. ``height``/``width``: the global extents (padded up to a window multiple here,
    as timm does). ``None`` without a shift. Only the rows of this rank's windows are built."""
    if not any(shift_size):
        return None
    wh, ww = window_size
    hp, wp = math.ceil(height / wh) * wh, math.ceil(width / ww) * ww
    first, stop = rows if rows is not None else (0, hp // wh)
    lab_h = _labels(hp, wh, shift_size[0], device)[first * wh:stop * wh]
    lab_w = _labels(wp, ww, shift_size[1], device)
    img_mask = (3 * lab_h[:, None] + lab_w[None, :]).to(dtype)[None, :, :, None]  # 1, rows, Wp, 1
    mask_windows = window_partition(img_mask, window_size).view(-1, wh * ww)
    attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    return attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)


def roll_needs(sizes: tuple[int, ...], shift: int) -> tuple[tuple[int, int], ...]:
    """Virtual input rows each rank needs for ``torch.roll(x, shift)`` along the sharded dim, output split as the
    input: ``out[i] = x[(i - shift) mod N]``, so rows ``[off - shift, off + n - shift)`` (circular boundary)."""
    offs = offsets(sizes)
    return tuple((offs[r] - shift, offs[r + 1] - shift) for r in range(len(sizes)))


# -- halo_roll ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RollPlan:
    """A :func:`halo_roll` as planned for this rank: ``plain`` (``torch.roll``, by ``shift``), else the exchange
    ``ex`` that brings the ``rows`` of the rolled shard."""

    plain: bool
    ex: int = -1
    rows: int = 0
    shift: int = 0


def _roll_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], dim: int, shift: int, op: str) -> RollPlan:
    (sizes,) = extents
    n = sum(sizes)
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"{op}: shift must be an int, got {shift!r}")
    s = shift % n if n else 0
    if cg.size == 1 or s == 0:
        return RollPlan(True, shift=s)
    ex = exchanger_id(cg, dim, sizes, roll_needs(sizes, s), "circular", op)
    return RollPlan(False, ex, sizes[cg.index], s)


@public
def halo_roll(x: torch.Tensor, shift: int, dim: int = -2, group: Any | None = None) -> torch.Tensor:
    """``torch.roll(x, shift, dim)`` along the sharded ``dim`` of the ranks' shards: every rank keeps its extent
    and gets the rows of the rolled field it owns (``out[i] = x[(i - shift) mod N]`` in global rows).

    One planned exchange (circular boundary) whose backward is its exact adjoint (a roll by ``-shift``). With one
    rank, or a shift that is a multiple of ``N``, it is ``torch.roll`` (a copy). Every rank must pass the same
    ``shift``; extents are agreed (or recalled) first, so errors are raised on every rank alike.
    """
    op = "halo_roll"
    d = dim % x.dim() if x.dim() else dim
    plan = resolve(x, group, op, _roll_plan, (d, shift, op), spec=(dim,))
    if plan.plain:
        out = torch.roll(x, plan.shift, d)
    else:
        out = exchange(x, plan.ex, plan.rows, d)
    carry(out, x)
    return out


# -- modules --------------------------------------------------------------------------------------------------

def adopt_recognised(self: nn.Module, module: nn.Module, name: str, attrs: tuple[str, ...]) -> None:
    """:func:`halo.nn.base.adopt` of a third party's layer recognised by its name and attributes (timm's, CREDIT's;
    Swin V1 and V2): ``self`` shares ``module``'s state (parameters, buffers, children, attributes: the same objects),
    so that ``state_dict`` keys and hooks stay as they are (invariant 6); each of ``attrs`` must be there."""
    missing = [a for a in attrs if not hasattr(module, a)]
    if missing:
        raise TypeError(f"{name} adopts a {type(module).__name__}, which has no {', '.join(missing)}")
    adopt(self, module, name=name)


@public
class DomainWindowAttention(DomainLayer, nn.Module):
    """timm's ``WindowAttention`` (same parameters and buffers): multi-head self-attention within each window with
    the relative position bias, plus the shifted-window mask of this rank's windows. Windows are independent, so
    this is exact on any rank's windows; it is halo's own (the converter does not look inside it)."""

    #: for ``halo.check_equivalence``: it and its submodules take and return windows, not the field's rows
    _halo_check = "self"

    def __init__(self, attn: nn.Module) -> None:
        adopt_recognised(self, attn, "DomainWindowAttention",
                         ("qkv", "proj", "relative_position_bias_table", "relative_position_index", "num_heads",
                          "scale", "window_area"))
        self.halo_init()

    def _get_rel_pos_bias(self) -> torch.Tensor:
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.window_area, self.window_area, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training:
            for drop in ("attn_drop", "proj_drop"):
                p = getattr(getattr(self, drop, None), "p", 0.0)
                if p:
                    raise ValueError(
                        f"DomainWindowAttention: {drop} (p={p}) drops elements of windows, which each rank would draw "
                        f"differently from the unsharded model; set its p to 0 for domain-parallel training (or "
                        f"call .eval())")
        b_, n, _ = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if getattr(self, "fused_attn", False):
            attn_mask = self._get_rel_pos_bias()
            if mask is not None:
                num_win = mask.shape[0]
                mask = mask.view(1, num_win, 1, n, n).expand(b_ // num_win, -1, self.num_heads, -1, -1)
                attn_mask = attn_mask + mask.reshape(-1, self.num_heads, n, n)
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn + self._get_rel_pos_bias()
            if mask is not None:
                num_win = mask.shape[0]
                attn = attn.view(-1, num_win, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
                attn = attn.view(-1, self.num_heads, n, n)
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.transpose(1, 2).reshape(b_, n, -1)
        return self.proj(x)


@dataclasses.dataclass(frozen=True)
class SwinPlan:
    """A block's attention as planned for this rank: ``plain`` (one rank: timm's computation), else the global
    height, this rank's window rows ``[w0, w1)``, the zero rows it pads at the bottom, and the two roll exchanges
    (``-1``: no shift along H)."""

    plain: bool
    height: int = 0
    w0: int = 0
    w1: int = 0
    pad: int = 0
    roll: int = -1
    unroll: int = -1
    rows: int = 0


def broken_windows(sizes: tuple[int, ...] | list[int], window: int, pads: bool) -> list[int]:
    """The ranks whose shard starts or ends inside a window of ``window`` rows (the last may end in a partial one
    when the block ``pads`` to a window multiple)."""
    offs = offsets(sizes)
    last = len(sizes) - 1
    return [r for r in range(len(sizes)) if offs[r] % window or ((r < last or not pads) and sizes[r] % window)]


def shifted_window_plan(cg: CommGroup, sizes: tuple[int, ...], window: int, shift: int, pads: bool,
                        op: str) -> SwinPlan:
    """This rank's :class:`SwinPlan` on shards of whole windows (checked by the caller, :func:`broken_windows`):
    its window rows, the last rank's padding (``pads``: timm pads to a window multiple, CREDIT does not) and the two
    roll exchanges of the shift along H. Swin V1 and V2 blocks alike (``halo.nn.swinv2``)."""
    if cg.size == 1:
        return SwinPlan(True)
    r, offs = cg.index, offsets(sizes)
    h = offs[-1]
    w0, w1 = offs[r] // window, math.ceil(offs[r + 1] / window)
    pad = math.ceil(h / window) * window - h if pads and r == cg.size - 1 else 0
    roll = unroll = -1
    if shift % h:
        roll = exchanger_id(cg, 1, sizes, roll_needs(sizes, -shift), "circular", op)
        unroll = exchanger_id(cg, 1, sizes, roll_needs(sizes, shift), "circular", op)
    return SwinPlan(False, h, w0, w1, pad, roll, unroll, sizes[r])


def _swin_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], window: int, shift: int, op: str) -> SwinPlan:
    (sizes,) = extents
    bad = broken_windows(sizes, window, True) if cg.size > 1 else []
    if bad:
        h = sum(sizes)
        raise ValueError(
            f"{op}: a rank's shard must be made of whole attention windows of {window} rows along H (dim 1), but "
            f"the ranks hold {list(sizes)} rows of {h} (ranks {bad} start or end inside a window); shard the field "
            f"with halo.shard(x, dim, granularity={window}) (times the patch size before a patch embedding), e.g. "
            f"{_example(h, window, cg.size)}")
    return shifted_window_plan(cg, sizes, window, shift, True, op)


def block_window_mask(plan: SwinPlan, height: int, width: int, window_size: tuple[int, int],
                      shift_size: tuple[int, int], attn_mask: torch.Tensor | None, *, dynamic: bool,
                      dtype: torch.dtype, device: torch.device, what: Callable[[], str]) -> torch.Tensor | None:
    """The shifted-window mask of this rank's windows: built from global rows (``dynamic``), else cut from the
    block's own ``attn_mask`` buffer (made for the global resolution by timm / CREDIT). ``height``: the global H;
    ``width``: the padded W. ``what()`` starts the error that a buffer made for another resolution raises."""
    if not any(shift_size):
        return None
    ws = tuple(window_size)
    if dynamic:
        rows = None if plan.plain else (plan.w0, plan.w1)
        return window_attention_mask(height, width, ws, tuple(shift_size), rows, dtype=dtype, device=device)
    n_h, n_w = math.ceil(height / ws[0]), width // ws[1]
    if attn_mask is None or attn_mask.shape[0] != n_h * n_w:
        raise ValueError(f"{what()} has {None if attn_mask is None else attn_mask.shape[0]} windows, but the field of "
                         f"{height} x {width} rows has {n_h} x {n_w}; build the block for this resolution")
    return attn_mask if plan.plain else attn_mask[plan.w0 * n_w:plan.w1 * n_w]


def _roll(x: torch.Tensor, plan: SwinPlan, ex: int, sh: int, sw: int) -> torch.Tensor:
    """``torch.roll(x, (sh, sw), (1, 2))`` on this rank's rows: H across ranks by the plan's exchange ``ex``."""
    if plan.plain:
        return torch.roll(x, shifts=(sh, sw), dims=(1, 2))
    x = exchange(x, ex, plan.rows, 1) if ex >= 0 else x
    return torch.roll(x, shifts=sw, dims=2) if sw else x


def shifted_window_attention(x: torch.Tensor, plan: SwinPlan, window_size: tuple[int, int],
                             shift_size: tuple[int, int], attend: Callable[..., torch.Tensor],
                             mask: Callable[[int, int, torch.Tensor], torch.Tensor | None], *,
                             pads: bool = True) -> torch.Tensor:
    """A Swin block's attention on this rank's rows ``(B, H_r, W, C)`` (timm's ``_attn``; V1 and V2 blocks alike):
    the cyclic shift by ``-shift`` (H across ranks: the plan's roll exchange), padding to whole windows (``pads``:
    timm; the last rank's partial window), ``attend(windows, mask=mask(global H, padded W, padded x))`` on this
    rank's windows, the crop, and the shift back (the unroll exchange)."""
    b, h, w, c = x.shape
    ws, (sh, sw) = tuple(window_size), tuple(shift_size)
    has_shift = bool(sh or sw)
    if has_shift:
        x = _roll(x, plan, plan.roll, -sh, -sw)
    if pads:
        pad_h = (ws[0] - h % ws[0]) % ws[0] if plan.plain else plan.pad
        x = F.pad(x, (0, 0, 0, (ws[1] - w % ws[1]) % ws[1], 0, pad_h))
    _, hp, wp, _ = x.shape
    windows = window_partition(x, ws).view(-1, ws[0] * ws[1], c)
    windows = attend(windows, mask=mask(h if plan.plain else plan.height, wp, x))
    x = window_reverse(windows.view(-1, ws[0], ws[1], c), ws, hp, wp)
    x = x[:, :h, :w, :].contiguous()
    return _roll(x, plan, plan.unroll, sh, sw) if has_shift else x


def _example(h: int, window: int, parts: int) -> str:
    if h % window == 0 and h // window >= parts:
        return f"shards of {split_sizes(h, parts, window)} rows"
    return f"(but {h} rows are not {parts} or more whole windows of {window} rows)"


@public
class DomainSwinTransformerBlock(DomainLayer, nn.Module):
    """timm's ``SwinTransformerBlock`` on an H-shard ``(B, H_r, W, C)`` made of whole windows (module docstring).

    ``x + drop_path1(attn(norm1(x)))`` then ``x + drop_path2(mlp(norm2(x)))`` as timm; the attention rolls the
    shard by ``-shift`` across ranks (:func:`halo_roll`'s exchange), pads the last rank's partial window, attends
    within this rank's windows with the mask rows of those windows (timm's ``attn_mask`` buffer, or the mask built
    from global rows when ``dynamic_mask``), and rolls back. Parameters, buffers and children are the block's
    (``attn`` becomes a :class:`DomainWindowAttention` sharing its parameters).
    """

    def __init__(self, block: nn.Module, *, group: Any | None = None) -> None:
        adopt_recognised(self, block, "DomainSwinTransformerBlock",
                         ("norm1", "attn", "norm2", "mlp", "window_size", "shift_size", "drop_path1",
                          "drop_path2"))
        if not isinstance(self._modules["attn"], DomainWindowAttention):
            self._modules["attn"] = DomainWindowAttention(self._modules["attn"])
        self.halo_init(group)

    def _attn(self, x: torch.Tensor, plan: SwinPlan) -> torch.Tensor:
        def mask(height: int, width: int, xp: torch.Tensor) -> torch.Tensor | None:
            return block_window_mask(
                plan, height, width, tuple(self.window_size), tuple(self.shift_size), getattr(self, "attn_mask", None),
                dynamic=bool(getattr(self, "dynamic_mask", False)), dtype=xp.dtype, device=xp.device,
                what=lambda: f"DomainSwinTransformerBlock: the block's attn_mask (built for input_resolution "
                             f"{tuple(self.input_resolution)}; set_input_size, or dynamic_mask=True)")

        return shifted_window_attention(x, plan, tuple(self.window_size), tuple(self.shift_size), self.attn, mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainSwinTransformerBlock"
        plan = resolve(x, self.group, name, _swin_plan, (int(self.window_size[0]), int(self.shift_size[0]), name),
                       site=self._halo_site, spec=(1,))
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a channels-last (B, H_local, W, C) shard, got shape "
                             f"{tuple(x.shape)}")
        b, h, w, c = x.shape
        y = x + self.drop_path1(self._attn(self.norm1(x), plan))
        y = y.reshape(b, -1, c)
        y = y + self.drop_path2(self.mlp(self.norm2(y)))
        y = y.reshape(b, h, w, c)
        carry(y, x)
        place(y, 1)  # channels-last: the sharded rows are dim 1 (the guard must not take W for H)
        return y


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """A patch merging as planned for this rank: ``plain`` (one rank), else the exchange ``ex`` that brings the
    ``rows`` of input this rank's output rows read."""

    plain: bool
    ex: int = -1
    rows: int = 0


def _merge_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], op: str) -> MergePlan:
    (sizes,) = extents
    if cg.size == 1:
        return MergePlan(True)
    h = sum(sizes)
    m = math.ceil(h / 2)
    offs = offsets(sizes)
    if all(o % 2 == 0 for o in offs[:-1]) and min(sizes) > 0:  # whole 2-row blocks: keep the split
        out = offsets([math.ceil(s / 2) for s in sizes])
    else:
        if m < cg.size:
            raise ValueError(f"{op}: the output has {m} rows along H ({h} input rows) but the domain group has "
                             f"{cg.size} ranks; use at most {m} ranks for this layer")
        out = split_offsets(m, cg.size)
    needs = tuple((2 * out[r], 2 * out[r + 1]) for r in range(cg.size))  # row h (odd h): zero, as timm's pad
    lo, hi = needs[cg.index]
    return MergePlan(False, exchanger_id(cg, 1, sizes, needs, "zeros", op), hi - lo)


@public
class DomainPatchMerging(DomainLayer, nn.Module):
    """timm's ``PatchMerging`` (2x2 neighbours concatenated, ``norm`` over ``4 * dim``, ``reduction``) on an H-shard
    ``(B, H_r, W, C)``: shards of even offsets (a block split) give ``ceil(H_r / 2)`` rows each, read from their own
    rows; any other split gives the balanced split of ``ceil(H / 2)`` (one exchange). Odd H: the zero row timm pads
    comes from the exchange's zero boundary."""

    def __init__(self, merge: nn.Module, *, group: Any | None = None) -> None:
        adopt_recognised(self, merge, "DomainPatchMerging", ("norm", "reduction"))
        # timm's Swin V2 PatchMerging normalises after the reduction (over its output features)
        self._halo_post_norm = type(merge).__module__.endswith("swin_transformer_v2")
        self.halo_init(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainPatchMerging"
        plan = resolve(x, self.group, name, _merge_plan, (name,), site=self._halo_site, spec=(1,))
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a channels-last (B, H_local, W, C) shard, got shape {tuple(x.shape)}")
        b, h, w, c = x.shape
        y = x if plan.plain else exchange(x, plan.ex, plan.rows, 1)
        y = F.pad(y, (0, 0, 0, w % 2, 0, y.shape[1] % 2))
        _, h2, w2, _ = y.shape
        y = y.reshape(b, h2 // 2, 2, w2 // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        y = self.norm(self.reduction(y)) if self._halo_post_norm else self.reduction(self.norm(y))
        carry(y, x)
        place(y, 1)
        return y


@dataclasses.dataclass(frozen=True)
class EmbedPlan:
    pad: int = 0  # zero rows this rank adds at the bottom (dynamic_img_pad, last rank)


def _embed_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], img_size: Any, patch: int, strict: bool,
                dynamic: bool, op: str) -> EmbedPlan:
    (sizes,) = extents
    h = sum(sizes)
    if img_size is not None and strict and h != img_size[0]:
        raise ValueError(f"{op}: Input height ({h}, all ranks' rows) doesn't match model ({img_size[0]}).")
    if img_size is not None and not strict and not dynamic and h % patch:
        raise ValueError(f"{op}: Input height ({h}, all ranks' rows) should be divisible by patch size ({patch}).")
    pad = (patch - h % patch) % patch if dynamic and cg.index == cg.size - 1 else 0
    return EmbedPlan(pad)


@public
class DomainPatchEmbed(DomainLayer, nn.Module):
    """timm's ``PatchEmbed`` (``proj`` conv of kernel = stride = patch, then the output format and ``norm``) on an
    H-shard ``(B, C, H_r, W)``: ``img_size`` is checked against the global H, ``dynamic_img_pad`` pads the last
    rank, and ``proj`` is a :class:`halo.nn.DomainConv2d` (shards that are multiples of the patch give ``n // patch``
    rows each, so a block split stays one)."""

    def __init__(self, embed: nn.Module, *, group: Any | None = None) -> None:
        from .conv import DomainConv2d

        adopt_recognised(self, embed, "DomainPatchEmbed", ("proj", "norm", "patch_size", "flatten", "output_fmt"))
        proj = self._modules["proj"]
        if not isinstance(proj, DomainConv2d):
            self._modules["proj"] = DomainConv2d(proj, group=group)
        self.halo_init(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainPatchEmbed"
        img_size = getattr(self, "img_size", None)
        strict, dynamic = bool(getattr(self, "strict_img_size", False)), bool(getattr(self, "dynamic_img_pad", False))
        plan = resolve(x, self.group, name, _embed_plan,
                       (None if img_size is None else tuple(img_size), int(self.patch_size[0]), strict, dynamic, name),
                       site=self._halo_site, spec=(-2,))
        w, pw = x.shape[-1], self.patch_size[1]
        if img_size is not None and strict and w != img_size[1]:
            raise ValueError(f"{name}: Input width ({w}) doesn't match model ({img_size[1]}).")
        if img_size is not None and not strict and not dynamic and w % pw:
            raise ValueError(f"{name}: Input width ({w}) should be divisible by patch size ({pw}).")
        if dynamic:
            x = F.pad(x, (0, (pw - w % pw) % pw, 0, plan.pad))
        y = self.proj(x)
        rows = y.shape[-2]
        fmt = getattr(self.output_fmt, "value", self.output_fmt)
        if self.flatten:
            y = y.flatten(2).transpose(1, 2)
        elif fmt == "NHWC":
            y = y.permute(0, 2, 3, 1)
        elif fmt == "NLC":
            y = y.flatten(2).transpose(1, 2)
        elif fmt == "NCL":
            y = y.flatten(2)
        y = self.norm(y)
        carry(y, x)
        if self.flatten or fmt in ("NHWC", "NLC"):  # channels-last or tokens: the rows lead dim 1
            place(y, 1, rows)
        elif fmt == "NCL":
            place(y, 2, rows)
        return y


# -- recognising timm's classes (halo.nn.adapters) -----------------------------------------------------------

def latitude_only(make: Callable[[nn.Module, Any], nn.Module | None], what: str = "Swin layers") -> Callable:
    """The converter of a recognised layer that shards latitude only (W whole on each rank; Swin V1 and V2):
    ``make(module, group)``, refused on a latitude x longitude mesh with the same error on every rank."""
    def convert(m: nn.Module, ctx: Any) -> nn.Module | None:
        if getattr(ctx, "mesh", None) is not None:
            raise ValueError(f"{type(m).__name__}: halo's {what} shard latitude only (W whole on each rank); "
                             f"convert with a 1-D domain (no W sharding)")
        return make(m, ctx.group)
    return convert


def swin_adapter(module: nn.Module) -> Any:
    """The converter for a timm Swin layer recognised by class name and attributes, or ``None``."""
    kind, mods = type(module).__name__, module._modules
    if kind == "SwinTransformerBlock" and {"norm1", "attn", "norm2", "mlp", "drop_path1", "drop_path2"} <= set(mods) \
            and hasattr(module, "window_size") and hasattr(module, "shift_size") \
            and hasattr(mods["attn"], "relative_position_bias_table") and not hasattr(mods["attn"], "logit_scale"):
        return latitude_only(lambda m, g: DomainSwinTransformerBlock(m, group=g))
    if kind == "PatchMerging" and {"norm", "reduction"} <= set(mods) and isinstance(mods["reduction"], nn.Linear) \
            and isinstance(mods["norm"], nn.LayerNorm):
        v2 = type(module).__module__.endswith("swin_transformer_v2")  # the reduction, then norm over its output
        features = mods["reduction"].out_features if v2 else mods["reduction"].in_features
        if tuple(mods["norm"].normalized_shape) == (features,):
            return latitude_only(lambda m, g: DomainPatchMerging(m, group=g))  # v1: norm over 4*dim, then the reduction
    if kind == "PatchEmbed" and isinstance(mods.get("proj"), nn.Conv2d) and "norm" in mods \
            and all(hasattr(module, a) for a in ("patch_size", "flatten", "output_fmt")):
        return latitude_only(lambda m, g: DomainPatchEmbed(m, group=g))
    return None


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloWindowAttention = DomainWindowAttention
HaloSwinTransformerBlock = DomainSwinTransformerBlock
HaloPatchMerging = DomainPatchMerging
HaloPatchEmbed = DomainPatchEmbed
