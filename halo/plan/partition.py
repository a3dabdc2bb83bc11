"""Pure partition arithmetic: balanced splits, boundary row maps, and the halo-exchange plan.

Nothing here talks to another process; every function is deterministic in its arguments, so every rank
computes the same plan for the whole group from the same inputs (the local sizes of all ranks and the rows
each rank needs) and the sends of one rank match the receives of its peers by construction.

Terms (one tensor dim, global extent ``N`` split over ``P`` ranks of a group, index ``r`` in group order):

    owned rows   [start_r, stop_r)            the balanced split, as ``torch.tensor_split``
    needed rows  [lo_r, hi_r)                 "virtual" rows; may reach outside [0, N) and past neighbours
    before part  virtual rows v < start_r     (the halo before the shard: north for latitude)
    interior     owned rows within the need   (trimmed when a halo is negative)
    after part   virtual rows v >= stop_r

A virtual row maps to a source row of the global field by the boundary mode (``source_row``); a source row
lives on exactly one rank. Rank ``q`` sends rank ``r`` the *unique* source rows ``r`` needs from it, ascending,
as one message (dim-major buffer); ``r`` receives its messages, in peer order, into one buffer ``R`` and picks
its halo rows out of ``R`` by index (usually a contiguous slice: no copy).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BOUNDARIES",
    "ExchangePlan",
    "RankPlan",
    "check_boundary",
    "local_range",
    "offsets",
    "plan_exchange",
    "source_row",
    "split_granularity",
    "split_offsets",
    "split_problem",
    "split_sizes",
]

#: Boundary modes: what fills rows beyond the first and last rank of a group.
#: ``periodic`` is ``circular``; ``pole`` mirrors across a pole row that is on the grid (721-row ERA5: rows
#: 1, 2, ... rolled by W/2), ``pole_centered`` across a pole between rows (cell-centred grids: rows 0, 1, ...).
#: ``symmetric`` mirrors including the edge row (numpy's ``symmetric``: ``pole_centered`` without the roll; on a
#: latitude x longitude mesh the pole modes are this or ``reflect`` along H, then a roll along W across ranks).
BOUNDARIES = ("zeros", "replicate", "reflect", "symmetric", "circular", "periodic", "pole", "pole_centered")
POLE_MODES = ("pole", "pole_centered")


def check_boundary(boundary: str) -> str:
    """Return the canonical name of ``boundary`` or raise a ``ValueError`` listing the valid ones."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"unknown boundary {boundary!r}; expected one of {', '.join(BOUNDARIES)}")
    return "circular" if boundary == "periodic" else boundary


def split_sizes(n: int, parts: int, granularity: int = 1) -> list[int]:
    """Balanced split of ``n`` over ``parts``: ``n // parts + (r < n % parts)``, as ``torch.tensor_split``.

    ``granularity=g`` (``g > 1``): ``n`` is cut into ``n // g`` blocks of ``g`` rows (attention windows, patches)
    and the *blocks* are split balanced, ``g * split_sizes(n // g, parts)``, so no block straddles two parts.
    Raises a ``ValueError`` naming ``n``, ``g`` and ``parts`` when ``n`` is not a multiple of ``g`` or when some
    part would get no block. With ``g == 1`` a part may be empty (as ``torch.tensor_split``).
    """
    if parts <= 0:
        raise ValueError(f"cannot split over {parts} parts")
    if n < 0:
        raise ValueError(f"cannot split a negative extent {n}")
    if granularity != 1:
        return [granularity * s for s in _block_counts(n, parts, granularity)]
    q, rem = divmod(n, parts)
    return [q + (r < rem) for r in range(parts)]


def split_granularity(sizes: Sequence[int]) -> int | None:
    """The granularity ``g`` of which ``sizes`` is the split (``sizes == split_sizes(sum(sizes), len(sizes), g)``):
    1 for the balanced split, ``g > 1`` for a balanced split of whole blocks of ``g`` rows; ``None``: neither (a
    hand-made split, ``torch.chunk``'s). A pure function of the sizes, so every rank finds the same."""
    sizes = [int(s) for s in sizes]
    n, parts = sum(sizes), len(sizes)
    if parts == 0 or min(sizes) < 0:
        return None
    q, rem = divmod(n, parts)
    if sizes == [q + (r < rem) for r in range(parts)]:
        return 1
    # Blocks of g rows split balanced: the counts take the values q and q + 1 (both, or it is the balanced split of
    # rows too), so the sizes' gcd is g itself.
    g = math.gcd(*sizes)
    if g <= 1:
        return None
    q, rem = divmod(n // g, parts)
    return g if [s // g for s in sizes] == [q + (r < rem) for r in range(parts)] else None


def split_problem(sizes: Sequence[int], what: str = "rows") -> str | None:
    """What is wrong with a split that is not the balanced one (nor one of whole blocks: :func:`split_granularity`),
    naming the split expected and the one got; ``None`` for a split halo's layers compute on (invariant 1)."""
    if split_granularity(sizes) is not None:
        return None
    n, parts = sum(sizes), len(sizes)
    return (f"the shards hold {list(sizes)} {what} ({n} in all over {parts} ranks), which is not the balanced split "
            f"{split_sizes(n, parts)} (halo.shard, torch.tensor_split) nor a balanced split of whole blocks "
            f"(halo.shard(x, dim, granularity=g)); halo's layers compute every activation as the balanced split of "
            f"its global extent (invariant 1), so a shard cut otherwise (by hand, or torch.chunk) would give wrong "
            f"rows: shard the field with halo.shard / halo.scatter / halo.io, or slice torch.tensor_split's rows")


def _block_counts(n: int, parts: int, g: int) -> list[int]:
    """Blocks of ``g`` rows per part (``split_sizes`` with a granularity), checked."""
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"granularity must be a positive int, got {g!r}")
    if n % g:
        raise ValueError(f"cannot split {n} rows into blocks of granularity {g} over {parts} ranks: {n} is not a "
                         f"multiple of {g} ({n} = {n // g} x {g} + {n % g}); a block (an attention window, a "
                         f"patch) must not straddle two ranks")
    blocks = n // g
    if blocks < parts:
        raise ValueError(f"cannot split {n} rows into blocks of granularity {g} over {parts} ranks: there are only "
                         f"{blocks} blocks of {g} rows, so ranks {list(range(blocks, parts))} would get no block; "
                         f"use at most {blocks} ranks, or a smaller granularity")
    q, rem = divmod(blocks, parts)
    return [q + (r < rem) for r in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start offsets of consecutive parts of ``sizes``, with their total appended (length ``len(sizes) + 1``)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def split_offsets(n: int, parts: int, granularity: int = 1) -> list[int]:
    """Start offsets of the balanced split (of blocks of ``granularity`` rows), with ``n`` appended (length
    ``parts + 1``)."""
    return offsets(split_sizes(n, parts, granularity))


def local_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` of the balanced split of ``n`` over ``parts``."""
    if not 0 <= index < parts:
        raise ValueError(f"part index {index} out of range for {parts} parts")
    q, rem = divmod(n, parts)
    start = index * q + min(index, rem)
    return start, start + q + (index < rem)


def source_row(v: int, n: int, boundary: str) -> tuple[int | None, bool]:
    """Map virtual row ``v`` of an extent-``n`` dim to ``(source row or None for zero, rolled)``.

    ``rolled`` marks rows taken across a pole, which the receiver rolls by half the longitudes. Modes that
    reflect support a reach of less than ``n`` rows beyond each edge (as ``F.pad``); ``replicate``,
    ``circular`` and ``zeros`` any reach.
    """
    if 0 <= v < n:
        return v, False
    if boundary == "zeros":
        return None, False
    if boundary == "replicate":
        return (0 if v < 0 else n - 1), False
    if boundary == "circular":
        return v % n, False
    if boundary in ("reflect", "pole"):
        g = -v if v < 0 else 2 * (n - 1) - v
        if not 0 <= g < n:
            raise ValueError(f"{boundary} boundary reaches {_reach(v, n)} rows beyond the edge of an extent "
                             f"of {n} rows; it supports at most {n - 1}")
        return g, boundary == "pole"
    if boundary == "symmetric":  # mirrored including the edge row (pole_centered's rows without the roll)
        g = -v - 1 if v < 0 else 2 * n - 1 - v
        if not 0 <= g < n:
            raise ValueError(f"{boundary} boundary reaches {_reach(v, n)} rows beyond the edge of an extent "
                             f"of {n} rows; it supports at most {n}")
        return g, False
    if boundary == "pole_centered":
        g = -v - 1 if v < 0 else 2 * n - 1 - v
        if not 0 <= g < n:
            raise ValueError(f"{boundary} boundary reaches {_reach(v, n)} rows beyond the edge of an extent "
                             f"of {n} rows; it supports at most {n}")
        return g, True
    raise ValueError(f"unknown boundary {boundary!r}; expected one of {', '.join(BOUNDARIES)}")


def _reach(v: int, n: int) -> int:
    return -v if v < 0 else v - n + 1


@dataclass(frozen=True)
class RankPlan:
    """What one rank does in an exchange (peers are indices in the group).

    ``sends``: ``(peer, runs)`` with ``runs`` the ``(local_start, length)`` ranges to pack for that peer, in
    peer order; a peer may be this rank itself (rows it needs of its own, e.g. a reflection).
    ``recvs``: ``(peer, rows)`` in peer order; the messages land one after another in ``R``.
    ``before`` / ``after``: per halo row, ``(index into R or -1 for zero, rolled)``.
    ``interior``: ``(local_start, length)`` of the owned rows kept in the extended tensor.
    """

    index: int
    interior: tuple[int, int]
    sends: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    recvs: tuple[tuple[int, int], ...]
    before: tuple[tuple[int, bool], ...]
    after: tuple[tuple[int, bool], ...]

    @property
    def recv_rows(self) -> int:
        return sum(n for _, n in self.recvs)

    @property
    def send_ranges(self) -> tuple[tuple[int, int], ...]:
        """All send runs in message order: one pack of these gives every message as a contiguous slice."""
        return tuple(run for _, runs in self.sends for run in runs)


@dataclass(frozen=True)
class ExchangePlan:
    """The plan of every rank of a group; ``ranks[r]`` is rank ``r``'s part."""

    sizes: tuple[int, ...]
    needs: tuple[tuple[int, int], ...]
    boundary: str
    ranks: tuple[RankPlan, ...]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def halo_rows(self) -> int:
        """Rows that cross between ranks in one exchange (all ranks together): the message volume."""
        return sum(n for p in self.ranks for q, n in p.recvs if q != p.index)


def _runs(rows: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted unique rows -> maximal ``(start, length)`` runs."""
    runs: list[list[int]] = []
    for g in rows:
        if runs and runs[-1][0] + runs[-1][1] == g:
            runs[-1][1] += 1
        else:
            runs.append([g, 1])
    return tuple((s, n) for s, n in runs)


def plan_exchange(sizes: Sequence[int], needs: Sequence[tuple[int, int]], boundary: str) -> ExchangePlan:
    """Plan the exchange for a group whose ranks own ``sizes`` rows (in order) and need ``needs``.

    ``needs[r] = (lo, hi)``: rank ``r`` needs virtual rows ``lo <= v < hi`` of the global dim. Rows of its own
    are used in place; the rest come from their owners (by ``source_row``) or are zero.
    """
    boundary = check_boundary(boundary)
    sizes = tuple(int(s) for s in sizes)
    needs = tuple((int(lo), int(hi)) for lo, hi in needs)
    if len(needs) != len(sizes):
        raise ValueError(f"{len(sizes)} ranks but {len(needs)} need ranges")
    if any(s < 0 for s in sizes):
        raise ValueError(f"negative shard size in {sizes}")
    starts = offsets(sizes)
    n = starts[-1]
    p = len(sizes)

    def owner(g: int) -> int:
        return bisect.bisect_right(starts, g) - 1 if g < n else p - 1

    # wanted[r][q]: sorted unique global rows r needs from q; parts[r]: per halo row (global row, rolled).
    wanted: list[dict[int, set[int]]] = [{} for _ in range(p)]
    parts: list[tuple[list[tuple[int | None, bool]], list[tuple[int | None, bool]]]] = []
    interiors = []
    for r, (lo, hi) in enumerate(needs):
        if hi < lo:
            raise ValueError(f"rank {r} needs rows [{lo}, {hi}): the range is reversed")
        start, stop = starts[r], starts[r + 1]
        i0, i1 = max(lo, start), min(hi, stop)
        if i1 <= i0:  # no own rows needed: everything is halo, put it in the part on its side
            i0 = i1 = min(max(lo, start), stop) if hi > start else start
        before_v = range(lo, min(hi, i0))
        after_v = range(max(lo, i1), hi)
        interiors.append((i0 - start, i1 - i0))
        side_rows = []
        for vs in (before_v, after_v):
            rows = []
            for v in vs:
                g, rolled = source_row(v, n, boundary)
                rows.append((g, rolled))
                if g is not None:
                    wanted[r].setdefault(owner(g), set()).add(g)
            side_rows.append(rows)
        parts.append((side_rows[0], side_rows[1]))

    plans = []
    for r in range(p):
        sends = tuple((q, _runs([g - starts[r] for g in sorted(wanted[q][r])]))
                      for q in range(p) if r in wanted[q])
        recvs = tuple((q, len(wanted[r][q])) for q in sorted(wanted[r]))
        # Position of each global row in R: messages in peer order, rows ascending within a message.
        where: dict[int, int] = {}
        base = 0
        for q, _ in recvs:
            for i, g in enumerate(sorted(wanted[r][q])):
                where[g] = base + i
            base += len(wanted[r][q])
        before, after = (tuple((-1 if g is None else where[g], rolled) for g, rolled in rows)
                         for rows in parts[r])
        plans.append(RankPlan(r, interiors[r], sends, recvs, before, after))
    return ExchangePlan(sizes, needs, boundary, tuple(plans))
