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

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import cast_as_torch
from ..dist.comm import CommGroup
from ..exchange import exchanger_id
from ..plan.geometry import check_output_rows, shuffle_needs
from .base import AxisPlan, DomainLayer
from .registry import converts

__all__ = ["DomainPixelShuffle", "DomainPixelUnshuffle"]


@dataclasses.dataclass(frozen=True)
class ShufflePlan(AxisPlan):
    """One axis of a pixel (un)shuffle: the input rows fetched (``rows``), the output rows dropped before this
    rank's (``crop``) and this rank's output rows (``out``)."""

    crop: int = 0
    out: int = 0


def _shuffle_plan(cg: CommGroup, sizes: tuple[int, ...], dim: int, factor: int, up: bool, op: str) -> ShufflePlan:
    """The geometry of one axis (H or W: the same arithmetic, ``dim`` names it): which input rows each rank
    needs for its output rows."""
    if cg.size == 1:
        return ShufflePlan(True, dim=dim)
    n = sum(sizes)
    if not up and n % factor:
        raise ValueError(f"{op}: the field has {n} rows along {'W' if dim == 3 else 'H'}, not divisible by the "
                         f"downscale factor {factor}")
    m = n * factor if up else n // factor
    check_output_rows(op, m, n, cg.size, f", factor {factor}")
    offs, needs, crops = shuffle_needs(sizes, factor, up)
    lo, hi = needs[cg.index]
    ex = exchanger_id(cg, dim, sizes, tuple(needs), "zeros", op)
    return ShufflePlan(False, ex, hi - lo, dim, crops[cg.index], offs[cg.index + 1] - offs[cg.index])


def _check_4d(x: torch.Tensor, op: str) -> None:
    """Called after the agreement (the number of dims is agreed), so every rank raises alike (invariant 4)."""
    if x.dim() != 4:
        raise ValueError(f"{op}: expected a (B, C, H_local, W) shard, got shape {tuple(x.shape)}")


def _run(module: DomainLayer, x: torch.Tensor, factor: int, up: bool, op: str) -> torch.Tensor:
    """Fetch the input rows of this rank's output rows along each axis, shuffle, drop the rows before its own."""
    plans = module.axis_plans(x, op, _shuffle_plan, (factor, up, op))
    _check_4d(x, op)
    out = (F.pixel_shuffle if up else F.pixel_unshuffle)(module.exchange_axes(x, plans), factor)
    for plan in plans:
        if not plan.plain:
            out = out.narrow(plan.dim, plan.crop, plan.out)
    return module.finish(out, x)


@converts(nn.PixelShuffle, axes=2, functional=(F.pixel_shuffle, torch.pixel_shuffle),
          example=lambda kind: (kind(2), (2, 8, 23, 7)))
class DomainPixelShuffle(DomainLayer, nn.PixelShuffle):
    """``nn.PixelShuffle`` on an H-shard (module docstring)."""

    def __init__(self, shuffle: nn.PixelShuffle, *, group: Any | None = None, mesh: Any | None = None) -> None:
        nn.PixelShuffle.__init__(self, shuffle.upscale_factor)
        self.halo_init(group, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, cast_as_torch("pixel_shuffle", x), self.upscale_factor, True, "DomainPixelShuffle")


@converts(nn.PixelUnshuffle, axes=2, functional=(F.pixel_unshuffle, torch.pixel_unshuffle),
          example=lambda kind: (kind(2), (2, 3, 22, 6)))  # 22 rows: a multiple of the factor, as torch needs
class DomainPixelUnshuffle(DomainLayer, nn.PixelUnshuffle):
    """``nn.PixelUnshuffle`` on an H-shard (module docstring)."""

    def __init__(self, unshuffle: nn.PixelUnshuffle, *, group: Any | None = None, mesh: Any | None = None) -> None:
        nn.PixelUnshuffle.__init__(self, unshuffle.downscale_factor)
        self.halo_init(group, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, cast_as_torch("pixel_unshuffle", x), self.downscale_factor, False, "DomainPixelUnshuffle")


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloPixelShuffle = DomainPixelShuffle
HaloPixelUnshuffle = DomainPixelUnshuffle
