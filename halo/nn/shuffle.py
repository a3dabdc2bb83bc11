"""``nn.PixelShuffle`` / ``nn.PixelUnshuffle`` on an H-shard: the output is the balanced split of the global output.

Pixel shuffle by ``r`` makes output row ``o`` from input row ``o // r``; rank ``r``'s output rows ``[o0, o1)`` need
input rows ``[o0 // r, (o1 - 1) // r + 1)``. Pixel unshuffle makes output row ``o`` from input rows
``[o * r, (o + 1) * r)``. Either way one planned exchange fetches exactly those rows (whichever ranks own them),
the torch op runs on them, and the rows before ``o0`` are dropped: a copy of values, bitwise the unsharded op's;
the backward is the exchange's exact adjoint. The global extents come from the plan (learned once per epoch).
A split that is not the balanced one but made of whole blocks (``halo.shard(..., granularity=g)``) is kept: an
unshuffle of shards that are multiples of ``r`` gives ``sizes // r``, a shuffle of such a split ``sizes * r``,
each rank reading only its own rows (invariant 1's split granularity).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import CommGroup
from ..exchange import exchange, exchanger_id, like_format
from ..mesh import group_attribute
from ..partition import offsets, split_offsets, split_sizes
from ..plans import Site, carry, resolve
from ._mesh2d import mesh_of, resolve_2d, set_mesh
from .pool import check_output_rows

__all__ = ["HaloPixelShuffle", "HaloPixelUnshuffle"]


class ShufflePlan(NamedTuple):
    plain: bool
    ex: int = -1
    rows: int = 0  # input rows fetched
    crop: int = 0  # output rows dropped before this rank's
    out: int = 0  # this rank's output rows


def _shuffle_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], factor: int, up: bool, op: str,
                  dim: int = 2) -> ShufflePlan:
    (sizes,) = extents
    if cg.size == 1:
        return ShufflePlan(True)
    n = sum(sizes)
    if not up and n % factor:
        raise ValueError(f"{op}: the field has {n} rows along {'H' if dim == 2 else 'W'}, not divisible by the "
                         f"downscale factor {factor}")
    m = n * factor if up else n // factor
    check_output_rows(op, m, n, cg.size, f", factor {factor}")
    offs = split_offsets(m, cg.size)
    if min(sizes) > 0 and (not up and all(s % factor == 0 for s in sizes)
                           or up and list(sizes) != split_sizes(n, cg.size)):
        # A block split stays one (the same for a balanced split when it coincides): every rank's output rows
        # come from its own input rows alone, ``sizes // factor`` (unshuffle) or ``sizes * factor`` (shuffle of
        # a split that is not the balanced one, e.g. windows or patches: halo.partition granularity).
        offs = offsets([s * factor if up else s // factor for s in sizes])
    needs, crops = [], []
    for r in range(cg.size):
        o0, o1 = offs[r], offs[r + 1]
        if up:
            lo, hi = o0 // factor, (o1 - 1) // factor + 1
            crops.append(o0 - lo * factor)
        else:
            lo, hi = o0 * factor, o1 * factor
            crops.append(0)
        needs.append((lo, hi))
    lo, hi = needs[cg.index]
    ex = exchanger_id(cg, dim, sizes, tuple(needs), "zeros", op)
    return ShufflePlan(False, ex, hi - lo, crops[cg.index], offs[cg.index + 1] - offs[cg.index])


def _shuffle_plan_2d(cg: CommGroup, extents: tuple[tuple[int, ...], ...], groups: tuple, factor: int, up: bool,
                     op: str) -> tuple[ShufflePlan, ShufflePlan]:
    from ..comm import comm_group

    return tuple(_shuffle_plan(comm_group(groups[a]), (extents[a],), factor, up, f"{op} ({'HW'[a]})", 2 + a)
                 for a in range(2))


def _check_4d(x: torch.Tensor, op: str) -> None:
    """Called after the agreement (the number of dims is agreed), so every rank raises alike (invariant 4)."""
    if x.dim() != 4:
        raise ValueError(f"{op}: expected a (B, C, H_local, W) shard, got shape {tuple(x.shape)}")


def _run(module: nn.Module, x: torch.Tensor, factor: int, up: bool, op: str) -> torch.Tensor:
    fn = F.pixel_shuffle if up else F.pixel_unshuffle
    mesh = mesh_of(module)
    if mesh is not None:  # a latitude x longitude mesh: each axis as H alone is (rows, then columns)
        plans = resolve_2d(x, mesh, op, _shuffle_plan_2d, (factor, up, op), module._halo_site)
        _check_4d(x, op)
        t = x
        for a, plan in enumerate(plans):
            if not plan.plain:
                t = exchange(t, plan.ex, plan.rows, 2 + a)
        out = fn(t, factor)
        for a, plan in enumerate(plans):
            if not plan.plain:
                out = out.narrow(2 + a, plan.crop, plan.out)
        out = like_format(out, x)
        carry(out, x)
        return out
    plan = resolve(x, module.group, op, _shuffle_plan, (factor, up, op), site=module._halo_site)
    _check_4d(x, op)
    if plan.plain:
        return fn(x, factor)
    rows = exchange(x, plan.ex, plan.rows, 2)
    out = like_format(fn(rows, factor).narrow(-2, plan.crop, plan.out), x)
    carry(out, x)
    return out


class HaloPixelShuffle(nn.PixelShuffle):
    """``nn.PixelShuffle`` on an H-shard (module docstring)."""

    group = group_attribute()

    def __init__(self, shuffle: nn.PixelShuffle, *, group: Any | None = None, mesh: Any | None = None) -> None:
        super().__init__(shuffle.upscale_factor)
        self.group = group
        self._halo_site = Site()
        set_mesh(self, mesh, "HaloPixelShuffle")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, self.upscale_factor, True, "HaloPixelShuffle")


class HaloPixelUnshuffle(nn.PixelUnshuffle):
    """``nn.PixelUnshuffle`` on an H-shard (module docstring)."""

    group = group_attribute()

    def __init__(self, unshuffle: nn.PixelUnshuffle, *, group: Any | None = None, mesh: Any | None = None) -> None:
        super().__init__(unshuffle.downscale_factor)
        self.group = group
        self._halo_site = Site()
        set_mesh(self, mesh, "HaloPixelUnshuffle")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, self.downscale_factor, False, "HaloPixelUnshuffle")
