"""Pure arithmetic behind the Triton kernels: fold a strided index space to five axes and pick a tile.

No triton import here, so the folding can be tested (and reasoned about) on any machine.

Every kernel walks an *index space* — the logical shape of what it writes — and reads and writes several
tensors through their own strides over that space. The host simplifies the space before the launch:

1. drop size-1 axes (except the packed dim, whose index selects the source row);
2. order the axes as the output lies in memory, outermost first, so that consecutive programs write
   consecutive memory and the tile's fast axis is the output's stride-1 axis (coalesced stores);
3. merge neighbouring axes that are contiguous in *every* tensor (``stride[a] == stride[b] * size[b]``);
4. move the main input's fastest axis next to the output's fastest: the ``[BM, BN]`` tile then spans both
   and both sides stay coalesced (a channels_last input packed into a dim-major buffer is a transpose);
5. pad at the front to ``MAX_RANK`` axes of size 1.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["MAX_RANK", "Plan", "UnsupportedLayout", "plan"]

MAX_RANK = 5  # index-space axes the kernels take: a point of axes 0..2 per program and a tile of axes 3 x 4


class UnsupportedLayout(NotImplementedError):
    """The strides do not fold into ``MAX_RANK`` axes; the dispatcher then takes the reference path."""


class Plan(NamedTuple):
    """A folded index space: what one launch (or one segment of a launch) needs besides pointers."""

    sizes: tuple[int, ...]  # MAX_RANK sizes, outermost first
    strides: tuple[tuple[int, ...], ...]  # per tensor, MAX_RANK strides (elements)
    dim_axis: int  # position of the packed dim among the MAX_RANK axes, -1 if none
    bm: int  # tile rows (axis 3)
    bn: int  # tile columns (axis 4, the output's fastest)
    num_warps: int
    grid: int  # programs: sizes[0] * sizes[1] * sizes[2] * ceil(sizes[3] / bm) * ceil(sizes[4] / bn)


def _pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_shape(rows: int, cols: int, tile: int, trim: bool) -> tuple[int, int]:
    """``(BM, BN)`` powers of two with ``BM * BN <= tile`` covering a ``rows x cols`` plane.

    With ``trim`` (compiled GPU code) BN halves while more than 1/8 of the lanes of the last column tile
    would be masked off (1440 columns: 512, not 2048), down to 32 lanes; masked lanes cost issue slots.
    Under the interpreter lanes are free and programs are not, so the widest tile is kept.
    """
    bn = min(_pow2(cols), tile)
    while trim and bn > 32 and cols < 0.875 * _cdiv(cols, bn) * bn:
        bn //= 2
    bm = min(_pow2(rows), max(1, tile // bn))
    return bm, bn


@functools.lru_cache(maxsize=4096)
def plan(
    shape: tuple[int, ...],
    dim: int,
    strides: tuple[tuple[int, ...], ...],
    main: int = 1,
    tile: int = 4096,
    trim: bool = True,
) -> Plan:
    """Fold the index space ``shape`` for tensors with ``strides`` (``strides[0]``: the output).

    ``dim`` is the packed dim (kept as its own axis; ``-1``: none, a plain copy), ``main`` the input whose
    fastest axis the tile should cover. Cached: a training loop pays the folding once per layer shape.
    Raises :class:`UnsupportedLayout` if more than ``MAX_RANK`` axes remain.
    """
    axes = [a for a in range(len(shape)) if shape[a] != 1 or a == dim]
    axes.sort(key=lambda a: (strides[0][a], strides[main][a]), reverse=True)  # output's order, outer first
    groups: list[list] = []  # [size, is the packed dim, stride of every tensor]
    for a in axes:
        st = tuple(s[a] for s in strides)
        g = groups[-1] if groups else None
        mergeable = g is not None and not g[1] and a != dim
        if mergeable and all(p == q * shape[a] for p, q in zip(g[2], st, strict=True)):
            g[0], g[2] = g[0] * shape[a], st  # contiguous in every tensor: one axis
        else:
            groups.append([shape[a], a == dim, st])
    if len(groups) > 2:  # tile the main input's fastest axis against the output's fastest (a transpose)
        k = min(range(len(groups) - 1), key=lambda i: (groups[i][0] == 1, groups[i][2][main]))
        if groups[k][0] > 1 and groups[k][2][main] < groups[-1][2][main]:
            fast = groups.pop(k)
            groups.insert(len(groups) - 1, fast)
    if len(groups) > MAX_RANK:
        raise UnsupportedLayout(
            f"shape {shape} with strides {strides} folds to {len(groups)} axes; the kernels take {MAX_RANK}"
        )
    groups = [[1, False, (0,) * len(strides)] for _ in range(MAX_RANK - len(groups))] + groups
    sizes = tuple(g[0] for g in groups)
    dim_axis = next((i for i, g in enumerate(groups) if g[1]), -1)
    bm, bn = tile_shape(sizes[3], sizes[4], tile, trim)
    grid = sizes[0] * sizes[1] * sizes[2] * _cdiv(sizes[3], bm) * _cdiv(sizes[4], bn)
    per_tensor = tuple(tuple(g[2][t] for g in groups) for t in range(len(strides)))
    return Plan(sizes, per_tensor, dim_axis, bm, bn, max(1, min(8, bm * bn // 512)), grid)
