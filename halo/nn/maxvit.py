"""timm's MaxViT partition attention (``timm.models.maxxvit``) on latitude shards, exact: block and grid windows.

A MaxViT block attends within windows of ``g = partition_size[0]`` rows twice: *block* windows are ``g`` consecutive
rows of the global grid (window ``k``, position ``i``: row ``k * g + i``), *grid* windows are ``g`` rows spread over
the whole field (row ``i * (H / g) + k``: every window reaches every rank). Both become local attention after one
**regroup** of the rows: every rank receives the rows of whole windows (windows balanced over the ranks,
``split_sizes(n_windows, P)``), stored window after window, so that its rows are a block partition of its own;
attention runs on those windows with timm's own attention module; the inverse regroup brings every row home. A shard
of whole block windows already is such a layout (no message). W stays whole on each rank and is partitioned there as
timm does (consecutive columns for block windows, strided for grid windows). The relative position bias is per
window position, the same for every window, so nothing about it depends on which rank holds a window.

The regroup is :func:`halo.nn.longrange.regroup`, the project's one planned permutation of global rows: its
``source`` is the global rows in window order (:func:`window_rows`), its output split the balanced split of whole
windows, and the way back is the inverse plan. Its messages are point-to-point (``halo.dist.transport``: any sizes,
bounded waits naming the peers), one per pair of ranks that share rows; its backward is the inverse permutation
(dot-product tested in float64 in ``tests/test_maxvit.py``). The plans are a pure function of the agreed extents,
learned once per global shape (``halo.plan.plans.resolve``).

============================  ==================================================  =============================
layer                         replaces (recognised by name and attributes)        split it needs / gives
============================  ==================================================  =============================
``DomainPartitionAttention``    timm ``PartitionAttentionCl`` (channels-last,       any; output split = input
                              ``(B, H_r, W, C)``), ``PartitionAttention2d``       split (a rank may hold no
                              (``(B, C, H_r, W)``), 'block' or 'grid' ('M'        window: it attends to none)
                              blocks), ``ParallelPartitionAttention`` (both,
                              concatenated over channels: 'PM' blocks)
``DomainPartitionedAttention``  its ``attn`` (``attn_block``, ``attn_grid``:        per window (no messages)
                              ``AttentionCl`` / ``Attention2d``, timm's forward
                              on windows)
============================  ==================================================  =============================

Bytes moved: a grid layer sends (and its backward sends again) about ``(1 - 1/P)`` of its input there and the same
back (a rank keeps only the rows of its own windows); a block layer on a shard of whole windows sends nothing, on a
balanced split that cuts windows only the rows of the cut windows.

Refused, on every rank by name: H or W not a multiple of the partition (timm asserts on the global field), a
latitude x longitude mesh (W sharded), dropout inside the attention (``attn_drop``/``proj_drop`` act on windows) in
training with ``p > 0``, and CoAtNet's ``TransformerBlock2d`` ('T' blocks: ``Attention2d`` over every token of the
feature map with a relative position bias of the field's size). Parameter gradients on each rank are the
contribution of its windows: the gradient sync sums them (a rank with no window has none for the attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..context import place
from ..dist.comm import CommGroup
from ..plan.partition import offsets, split_sizes
from ..plan.plans import Site, carry, resolve
from .base import DomainLayer
from .longrange import RegroupPlan, regroup, regroup_plan
from .registry import public
from .window import adopt_recognised, latitude_only

__all__ = ["DomainPartitionAttention", "DomainPartitionedAttention", "PartitionPlan", "maxvit_adapter",
           "partition_plan", "window_rows"]


# -- the regroup: planning (the move is halo.nn.longrange.regroup) ------------------------------------------------

def window_rows(height: int, window: int, grid: bool) -> list[int]:
    """The global rows in window order, window ``k`` after window ``k - 1``, positions ``i`` within each: block
    windows take row ``k * window + i``, grid windows row ``i * (H / window) + k`` (timm's ``window_partition`` /
    ``grid_partition`` along H). The regroup's ``source``: its output row ``p`` is input row ``window_rows(...)[p]``."""
    n = height // window
    return [i * n + k if grid else k * window + i for k in range(n) for i in range(window)]


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
    """A partition attention's call as planned for this rank: ``plain`` (one rank: timm's computation), else the
    regroup ``to`` this rank's whole windows (windows balanced over the ranks, stored window after window) and
    ``back`` (its inverse), both ``None`` where the shards already hold whole windows (no message)."""

    plain: bool
    to: RegroupPlan | None = None
    back: RegroupPlan | None = None


def _plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], window: tuple[int, int], grid: bool, width: int,
          dim: int, op: str) -> PartitionPlan:
    """Pure and agreed (every rank raises alike): H and W must be multiples of the partition, as timm asserts on
    the global field."""
    (sizes,) = extents
    h = sum(sizes)
    kind = "grid" if grid else "window"
    if width < 0:
        raise ValueError(f"{op}: expected a 4-d shard, (B, H_local, W, C) channels-last or (B, C, H_local, W)")
    if window[0] <= 0 or h % window[0]:
        raise ValueError(f"{op}: the field's {h} rows along H (all ranks: {list(sizes)}) are not a multiple of the "
                         f"{kind} partition's {window[0]} rows, which timm requires of the global field; give the "
                         f"model an input (or a {kind} size) that fits")
    if window[1] <= 0 or width % window[1]:
        raise ValueError(f"{op}: the field's {width} columns along W are not a multiple of the {kind} partition's "
                         f"{window[1]} columns, which timm requires")
    if cg.size == 1:
        return PartitionPlan(True)
    g = window[0]
    if g == 1 or not grid and all(o % g == 0 for o in offsets(sizes)):
        return PartitionPlan(False)  # shards of whole windows (a grid window of one row is a row): no message
    blocks = [g * n for n in split_sizes(h // g, cg.size)]
    to = regroup_plan(cg, dim, sizes, blocks, window_rows(h, g, grid), op)
    return PartitionPlan(False, to, dataclasses.replace(to.inverse(), op=f"{op} (back)"))


def partition_plan(x: torch.Tensor, partition_size: tuple[int, int], grid: bool, dim: int = 1,
                   group: Any | None = None, *, site: Site | None = None, op: str = "halo.nn.maxvit.partition_plan"
                   ) -> PartitionPlan:
    """The :class:`PartitionPlan` of a block (``grid=False``) or grid partition of ``partition_size`` on the shard
    ``x``, whose rows are ``dim`` (1: channels-last ``(B, H_r, W, C)``; 2: ``(B, C, H_r, W)``; W follows it): the
    extents agreed over ``group`` (or recalled), so that a field whose H or W the partition does not divide raises
    the same ``ValueError`` on every rank."""
    d = dim % x.dim() if x.dim() else dim
    width = int(x.shape[d + 1]) if x.dim() == 4 and d + 1 < 4 else -1
    size = tuple(int(s) for s in partition_size)
    return resolve(x, group, op, _plan, (size, bool(grid), width, d, op), site=site, spec=(d,), split=False)


# -- local partitions (timm's, on rows that are whole windows) -----------------------------------------------------

def _partition(x: torch.Tensor, size: tuple[int, int], grid_h: bool, grid_w: bool, cl: bool) -> torch.Tensor:
    """timm's ``window_partition`` / ``grid_partition`` (and their ``_nchw`` forms), with the kind chosen per axis:
    ``(B, H, W, C)`` -> ``(B', gh, gw, C)`` (``cl``), ``(B, C, H, W)`` -> ``(B', C, gh, gw)``. Windows' order is not
    timm's across the batch dim (each is attended on its own); within a window tokens are in timm's order."""
    gh, gw = size
    if cl:
        b, h, w, c = x.shape
    else:
        b, c, h, w = x.shape
        x = x.permute(0, 2, 3, 1)
    hs = (gh, h // gh) if grid_h else (h // gh, gh)  # (position, window) if grid else (window, position)
    ws = (gw, w // gw) if grid_w else (w // gw, gw)
    x = x.reshape(b, *hs, *ws, c)
    ph, kh = (1, 2) if grid_h else (2, 1)  # dims of the position and the window index along H
    pw, kw = (3, 4) if grid_w else (4, 3)
    x = x.permute(0, kh, kw, ph, pw, 5).reshape(b * (h // gh) * (w // gw), gh, gw, c)  # (none on a rank: 0)
    return x if cl else x.permute(0, 3, 1, 2).contiguous()


def _reverse(windows: torch.Tensor, size: tuple[int, int], bhw: tuple[int, int, int], grid_h: bool, grid_w: bool,
             cl: bool) -> torch.Tensor:
    """The inverse of :func:`_partition`, back to ``(B, H, W, C)`` (``cl``) or ``(B, C, H, W)``."""
    gh, gw = size
    b, h, w = bhw
    if not cl:
        windows = windows.permute(0, 2, 3, 1)
    c = windows.shape[-1]
    x = windows.reshape(b, h // gh, w // gw, gh, gw, c)  # (B, kh, kw, ph, pw, C)
    order = [0, 0, 0, 0, 0, 5]
    for dst, src in zip((1, 2) if grid_h else (2, 1), (3, 1), strict=True):  # H: (position, window) or reversed
        order[dst] = src
    for dst, src in zip((3, 4) if grid_w else (4, 3), (4, 2), strict=True):
        order[dst] = src
    x = x.permute(*order).reshape(b, h, w, c)
    return x if cl else x.permute(0, 3, 1, 2).contiguous()


class _unwatched:  # noqa: N801 - a context manager, named like one
    """Torch-function dispatch off while code runs on windows (timm's attention, the local partition of the
    regrouped rows), so that halo's guard (a ``TorchFunctionMode`` on a converted model's first calls) does not take
    them for fields: they are tokens of whole windows, never a field's rows (``halo.guard.trusted`` would still
    refuse the views it follows, as for Swin V2's window attention in ``halo.nn.swinv2``). Under ``torch.compile``
    no guard watches, and nothing is changed."""

    def __enter__(self) -> None:
        self.off = None if torch.compiler.is_compiling() else torch._C.DisableTorchFunction()
        if self.off is not None:
            self.off.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.off is not None:
            self.off.__exit__(*exc)


# -- modules --------------------------------------------------------------------------------------------------

@public
class DomainPartitionedAttention(DomainLayer, nn.Module):
    """timm's ``AttentionCl`` / ``Attention2d`` of a MaxViT block (same parameters and buffers, its relative
    position bias included), run by timm's own forward on windows: exact on any rank's windows, no messages. It is
    halo's own (the converter does not look inside: its 1x1 convs and linears act on windows, not on a field)."""

    #: for ``halo.check_equivalence``: it and its submodules take and return windows, not the field's rows
    _halo_check = "self"

    def __init__(self, attn: nn.Module) -> None:
        adopt_recognised(self, attn, "DomainPartitionedAttention", ("qkv", "proj", "num_heads", "dim_head"))
        self.__dict__["_halo_kind"] = type(attn)  # timm's class: its forward computes each window
        self.halo_init()

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        if self.training:
            drops = [f"{n} (p={m.p})" for n, m in self.named_modules()
                     if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
            if drops:
                raise ValueError(
                    f"DomainPartitionedAttention ({self._halo_kind.__name__}): its dropout {', '.join(drops)} draws "
                    f"per window (or per position-bias table), which each rank would draw differently from the "
                    f"unsharded model; set p to 0 for domain-parallel training (or call .eval())")
        with _unwatched():  # windows, not fields: the guard does not look inside (_unwatched)
            return self._halo_kind.forward(self, windows)


@public
class DomainPartitionAttention(DomainLayer, nn.Module):
    """timm's ``PartitionAttentionCl`` / ``PartitionAttention2d`` ('M' blocks) and ``ParallelPartitionAttention``
    ('PM' blocks: block and grid attention side by side, their outputs concatenated over channels) on an H-shard
    (module docstring): ``x + drop_path1(ls1(partition_attn(norm1(x))))`` then
    ``x + drop_path2(ls2(mlp(norm2(x))))`` as timm, where each partition attention regroups the rows into whole
    block or grid windows (:func:`halo.nn.longrange.regroup`), attends within them (``attn``, or ``attn_block`` and
    ``attn_grid``: :class:`DomainPartitionedAttention` sharing timm's modules' parameters) and moves the rows home (the
    inverse regroup).
    Parameters, buffers and children are the block's."""

    def __init__(self, block: nn.Module, *, group: Any | None = None) -> None:
        self_attrs = ("partition_size", "norm1", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")
        parallel = type(block).__name__ == "ParallelPartitionAttention"
        adopt_recognised(self, block, "DomainPartitionAttention",
                         self_attrs + (("attn_block", "attn_grid") if parallel else ("partition_block", "attn")))
        self._halo_cl = parallel or type(block).__name__.endswith("Cl")  # (B, H, W, C), else (B, C, H, W)
        #: (attention child, grid?) of each partition attention, in timm's order (its outputs are concatenated)
        self._halo_parts = (("attn_block", False), ("attn_grid", True)) if parallel \
            else (("attn", not block.partition_block),)
        for attn, _ in self._halo_parts:
            if not isinstance(self._modules[attn], DomainPartitionedAttention):
                self._modules[attn] = DomainPartitionedAttention(self._modules[attn])
        self.halo_init(group)
        self._halo_sites = tuple(Site() for _ in self._halo_parts)  # one plan each (grid and block differ)
        self._halo_path = type(block).__name__  # where it sits (the converter sets it): named in its errors

    def _attend(self, x: torch.Tensor, attn: nn.Module, grid: bool, site: Site) -> torch.Tensor:
        """One partition attention (block or grid windows) of the shard ``x``: the field's rows out."""
        name = f"DomainPartitionAttention at {self._halo_path}"
        cl = self._halo_cl
        size = tuple(int(s) for s in self.partition_size)
        dim = 1 if cl else 2
        plan = partition_plan(x, size, grid, dim, self.group, site=site, op=name)
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-d shard ({'(B, H_local, W, C)' if cl else '(B, C, H_local, W)'}),"
                             f" got shape {tuple(x.shape)}")
        width = x.shape[dim + 1]
        if plan.plain:  # one rank: timm's partition of the field
            windows = _partition(x, size, grid, grid, cl)
            return _reverse(attn(windows), size, (x.shape[0], x.shape[dim], width), grid, grid, cl)
        y = x if plan.to is None else regroup(x, plan.to)  # whole windows, one after another: blocks along H
        with _unwatched():  # y holds windows (a rank may hold none), not the field's rows
            windows = _partition(y, size, False, grid, cl)
            out = attn(windows) if windows.shape[0] else windows  # a rank with no window attends to none
            out = _reverse(out, size, (y.shape[0], y.shape[dim], width), False, grid, cl)
        out = out if plan.back is None else regroup(out, plan.back)
        place(out, dim)  # the field's rows again, at dim (1 channels-last, 2 NCHW)
        return out

    def _partition_attn(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self._attend(x, self._modules[attn], grid, site)
                for (attn, grid), site in zip(self._halo_parts, self._halo_sites, strict=True)]
        if len(outs) == 1:
            return outs[0]
        out = torch.cat(outs, dim=-1)  # ParallelPartitionAttention: [window, grid] over channels (channels-last)
        place(out, 1)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.drop_path1(self.ls1(self._partition_attn(self.norm1(x))))
        y = y + self.drop_path2(self.ls2(self.mlp(self.norm2(y))))
        carry(y, x)
        if self._halo_cl:
            place(y, 1)  # channels-last: the sharded rows are dim 1 (the guard must not take W for H)
        return y


# -- recognising timm's classes (halo.nn.timm_layers asks here) ------------------------------------------------------

_REFUSED = {
    "TransformerBlock2d": "its Attention2d attends over every token of the feature map with a relative position "
                          "bias of the whole field (CoAtNet's 'T' blocks), which halo has no domain-parallel form of",
}


def maxvit_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The converter of timm's MaxViT partition attention (recognised by class name, defining module and the
    attributes read), a refusal naming MaxViT's layers halo cannot compute exactly, or ``None``."""
    kind = type(module)
    if kind.__module__ != "timm.models.maxxvit":
        return None
    mods = module._modules
    parallel = kind.__name__ == "ParallelPartitionAttention"
    attns = ("attn_block", "attn_grid") if parallel else ("attn",)
    if (parallel or kind.__name__ in ("PartitionAttentionCl", "PartitionAttention2d")) \
            and {"norm1", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2", *attns} <= set(mods) \
            and (parallel or hasattr(module, "partition_block")) \
            and len(tuple(getattr(module, "partition_size", ()))) == 2 \
            and all(hasattr(mods[a], b) for a in attns for b in ("qkv", "proj", "num_heads", "dim_head")):
        return latitude_only(lambda m, g: DomainPartitionAttention(m, group=g), "MaxViT partition attention layers")
    why = _REFUSED.get(kind.__name__)
    if why is None:
        return None

    def refuse(m: nn.Module, ctx: Any) -> nn.Module:
        raise ValueError(f"timm.models.maxxvit.{kind.__name__}: {why}; on each shard it would attend within the "
                         f"shard's rows only (silently different from the unsharded model). Gather before it "
                         f"(halo.gather), or give custom_converters={{{kind.__name__}: fn}}")

    return refuse


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloPartitionedAttention = DomainPartitionedAttention
HaloPartitionAttention = DomainPartitionAttention
