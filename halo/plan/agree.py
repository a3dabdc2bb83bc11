"""Agreement before communication: every rank's arguments, gathered on host data and checked alike.

Invariant 4, "no rank waits alone": an argument that is wrong on one rank only (a shape, a dtype, a halo) must make
every rank raise the same error before any message is posted. So each rank describes its call as a :class:`Meta`
(its tensor's layout and its arguments as passed), every rank's description is gathered, and one pure function of
the gathered table decides: the extents along the sharded dims, or the error.

Two paths, both on the host group of :mod:`halo.dist.comm` (CPU tensors: an agreement never syncs a GPU):

* fast: each rank's :meth:`Meta.row`, a fixed-width row of small integers (codes for dtype, device and boundary),
  all-gathered into one table. When every row equals this rank's but for the sharded extents and no rank flagged a
  problem of its own, the check could only pass: the extents are read off the table.
* slow, only when something is wrong: every rank's :class:`Meta` itself (strings and all) is gathered with
  ``all_gather_object`` and checked in detail, so that every rank raises the same message naming the rank and what
  it passed. Errors are the only users of this path, so its cost does not matter.

How often an agreement runs is :mod:`halo.plan.plans`' business: once per step, or once per call outside a step.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..dist.comm import CommGroup
from ..dist.transport import all_gather_object, gather_words
from .partition import BOUNDARIES, check_boundary

__all__ = ["DEVICES", "DTYPES", "MAX_NDIM", "ROW_WORDS", "SHAPE_AT", "Meta", "Spec", "agree", "agree_with",
           "needs_grad"]

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
DEVICES = ("cpu", "cuda", "xpu", "mps", "meta")
MAX_NDIM = 8
MAX_SPECS = 2
_MAGIC = 0x48414C4F  # "HALO": a peer in a different all-gather of the same size is caught, not misread

# What a spec carries in its halo slot.
NO_HALO, HALO, BAD_HALO, NEEDS = 0, 1, 2, 3
_BIG = 1 << 62  # halos are clamped to this, so any int fits the int64 table
_SIZES_ONLY = object()  # no boundary: the call only learns extents


def needs_grad(x: torch.Tensor) -> int:
    """1 if an op on ``x`` records a backward (a backward exchange every rank must take part in), else 0."""
    return int(torch.is_grad_enabled() and x.requires_grad)


def _code(value: Any, table: Sequence[Any]) -> int:
    try:
        return table.index(value)
    except ValueError:
        return -1


@dataclass(frozen=True)
class Spec:
    """One exchange's arguments as one rank passed them (unvalidated)."""

    dim: int
    kind: int = NO_HALO  # NO_HALO (sizes only), HALO (before, after), BAD_HALO (text), NEEDS (digest)
    before: int = 0
    after: int = 0
    text: str = ""  # repr of a malformed halo
    boundary: str | None = None  # as passed; None: sizes only

    @staticmethod
    def of(dim: Any, halo: Any = None, boundary: Any = _SIZES_ONLY, needs: Any = None) -> Spec:
        """Record the arguments as passed; nothing raises here (problems are judged after the gather)."""
        try:
            dim = operator.index(dim)
        except TypeError:
            dim = _BIG  # reported as out of range
        b = None if boundary is _SIZES_ONLY else boundary if isinstance(boundary, str) else repr(boundary)
        if needs is not None:
            key = repr(tuple(tuple(int(v) for v in n) for n in needs)).encode()
            digest = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)
            return Spec(dim, NEEDS, digest, len(needs), boundary=b)
        if halo is None:
            return Spec(dim, boundary=b)
        items = tuple(halo) if isinstance(halo, (tuple, list)) else (halo, halo)
        try:
            if len(items) != 2:
                raise TypeError
            before, after = (max(-_BIG, min(_BIG, operator.index(h))) for h in items)
        except TypeError:
            return Spec(dim, BAD_HALO, text=repr(halo), boundary=b)
        return Spec(dim, HALO, before, after, boundary=b)

    def boundary_code(self) -> int:
        return -2 if self.boundary is None else _code(self.boundary, BOUNDARIES)

    def halo_str(self) -> str:
        if self.kind == HALO:
            return f"({self.before}, {self.after})"
        if self.kind == BAD_HALO:
            return self.text
        return "per-rank needs" if self.kind == NEEDS else "none (shapes only)"


@dataclass(frozen=True)
class Meta:
    """What one rank brings to a call: its tensor's layout and its arguments, one spec per sharded dim."""

    ndim: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    grad: int  # 1 / 0: the op records a backward (every rank must agree); -1: not checked
    specs: tuple[Spec, ...]

    @staticmethod
    def of(x: torch.Tensor, specs: Sequence[Spec], grad: int = -1) -> Meta:
        return Meta(x.dim(), tuple(x.shape), str(x.dtype).removeprefix("torch."), x.device.type, grad,
                    tuple(specs))

    def row(self) -> list[int]:
        """The fast path's fixed-width row: codes only; word 1 flags a problem this rank sees on its own."""
        problem = int(local_problem(self, MAX_NDIM) is not None or len(self.specs) > MAX_SPECS
                      or _code(self.device, DEVICES) < 0)
        shape = list(self.shape[:MAX_NDIM]) + [-1] * (MAX_NDIM - min(self.ndim, MAX_NDIM))
        words = [_MAGIC, problem, self.ndim, *shape, _code(self.dtype, [str(d).removeprefix("torch.") for d in DTYPES]),
                 _code(self.device, DEVICES), self.grad, len(self.specs)]
        for s in self.specs[:MAX_SPECS]:
            words += [max(-_BIG, min(_BIG, s.dim)), s.kind, s.before, s.after, s.boundary_code()]
        return words + [0] * (ROW_WORDS - len(words))

    def describe(self, sharded: Sequence[int] = ()) -> str:
        dims = [f"[{s}]" if i in sharded else str(s) for i, s in enumerate(self.shape)]
        return f"shape ({', '.join(dims)}{',' if len(dims) == 1 else ''}) {self.dtype} on {self.device}"


ROW_WORDS = 3 + MAX_NDIM + 4 + 5 * MAX_SPECS
SHAPE_AT = 3  # first shape word in a row


# -- checks: pure functions of what every rank passed ---------------------------------------------------------

def _rank(cg: CommGroup, r: int) -> str:
    return cg.describe(r)


def _first_bad(metas: Sequence[Meta], cg: CommGroup, op: str, problem) -> None:
    """Raise ``problem(meta)`` for the lowest rank where it is not None, naming the other ranks too."""
    bad = [(r, msg) for r, m in enumerate(metas) if (msg := problem(m)) is not None]
    if not bad:
        return
    r, msg = bad[0]
    if len(bad) == len(metas) > 1:
        where = "on every rank"
    else:
        others = [q for q, _ in bad[1:]]
        where = f"on {_rank(cg, r)}" + (f" (and group ranks {others})" if others else "")
    raise ValueError(f"{op}: {where}, {msg}")


def _ndim_problem(m: Meta, max_nd: float) -> str | None:
    if not 1 <= m.ndim <= max_nd:
        return f"expected a tensor with 1 to {MAX_NDIM} dims, got {m.ndim} dims"
    return None


def _spec_problem(m: Meta, k: int) -> str | None:
    """What is wrong with rank-local argument set ``k`` of ``m`` on its own (None: nothing)."""
    s = m.specs[k]
    if not -m.ndim <= s.dim < m.ndim:
        got = s.dim if s.dim != _BIG else "(not an int)"
        return (f"dim {got} is out of range for a {m.ndim}-d tensor of {m.describe()}; expected "
                f"{-m.ndim} <= dim <= {m.ndim - 1}")
    if s.kind == BAD_HALO:
        return f"halo must be an int or a (before, after) pair of ints, got {s.text}"
    if s.kind == HALO and min(s.before, s.after) < 0:
        return f"halo must be non-negative, got {s.halo_str()}"
    if s.boundary is not None and s.boundary not in BOUNDARIES:
        return f"unknown boundary {s.boundary!r}; expected one of {', '.join(BOUNDARIES)}"
    return None


def local_problem(m: Meta, max_nd: float) -> str | None:
    """What is wrong with one rank's arguments on their own (None: nothing)."""
    return _ndim_problem(m, max_nd) or next(
        (p for k in range(len(m.specs)) if (p := _spec_problem(m, k)) is not None), None)


def _canonical(boundary: str | None) -> str | None:
    return None if boundary is None else check_boundary(boundary)


def _check(metas: Sequence[Meta], cg: CommGroup, op: str) -> list[int]:
    """Check every rank's arguments on their own and against group rank 0's; return the sharded dims.

    A pure function of the gathered metas, so every rank raises the same error (or none). Extents along the
    sharded dims are left to :func:`_extents`.
    """
    n = len(metas)
    for r, m in enumerate(metas):
        if not isinstance(m, Meta) or len(m.specs) != len(metas[cg.index].specs):
            raise RuntimeError(f"{op}: {_rank(cg, r)} answered the agreement from a different call (another "
                               f"collective or halo op); every rank must make the same sequence of halo calls")
    max_nd = MAX_NDIM if n > 1 else math.inf
    _first_bad(metas, cg, op, lambda m: _ndim_problem(m, max_nd))
    for k in range(len(metas[0].specs)):
        _first_bad(metas, cg, op, lambda m, k=k: _spec_problem(m, k))

    ref = metas[0]
    dims = [s.dim % ref.ndim for s in ref.specs]

    def disagree(what: str, a: str, r: int, b: str, hint: str) -> ValueError:
        return ValueError(f"{op}: the ranks of the group disagree on {what}: {_rank(cg, 0)} has {a}, "
                          f"{_rank(cg, r)} has {b}; {hint}")

    for r, m in enumerate(metas):
        if m.ndim != ref.ndim:
            raise disagree("the number of dims", f"{ref.ndim} ({ref.describe()})", r, f"{m.ndim} ({m.describe()})",
                           "every rank must pass a shard of the same tensor")
        for k, (s, s0) in enumerate(zip(m.specs, ref.specs, strict=True)):
            if s.dim % m.ndim != dims[k]:
                raise disagree("the sharded dim", f"dim={s0.dim}", r, f"dim={s.dim}", "pass the same dim on every rank")
            if (s.kind, s.before, s.after, s.text) != (s0.kind, s0.before, s0.after, s0.text):
                what = "the rows each rank needs" if NEEDS in (s.kind, s0.kind) else "the halo"
                raise disagree(what, s0.halo_str(), r, s.halo_str(), f"pass the same {what[4:]} on every rank")
            if _canonical(s.boundary) != _canonical(s0.boundary):
                raise disagree("the boundary", repr(s0.boundary), r, repr(s.boundary),
                               "pass the same boundary on every rank")
        if (m.dtype, m.device) != (ref.dtype, ref.device):
            raise disagree("the dtype or device", ref.describe(dims), r, m.describe(dims),
                           "every rank must pass the same dtype on the same device type")
        if m.grad != ref.grad:
            yes, no = "an input that requires grad", "one that does not (or grad mode off)"
            raise disagree("whether the exchange records a backward", yes if ref.grad else no, r,
                           yes if m.grad else no, "the backward exchange would wait forever for the ranks "
                           "without one: make x.requires_grad and torch.is_grad_enabled() the same everywhere")
        if any(m.shape[i] != ref.shape[i] for i in range(ref.ndim) if i not in dims):
            only = f"dim {dims[0]}" if len(dims) == 1 else f"dims {dims}"
            raise disagree("the shape", ref.describe(dims), r, m.describe(dims),
                           f"only the extent along the sharded {only} may differ")
    return dims


def _extents(shapes: Sequence[tuple[int, ...]], dims: Sequence[int], like: Meta, cg: CommGroup, op: str,
             coords: Sequence[tuple[int, ...]] | None, allow_empty: bool) -> tuple[tuple[int, ...], ...]:
    """The extents of the ranks in this rank's line along each axis ``k`` (``coords[r][k]``: rank ``r``'s
    position on axis ``k``; default one axis in group order); checks lines agree and no shard is empty."""
    n = len(shapes)
    coords = coords if coords is not None else [(r,) for r in range(n)]

    def describe(r: int) -> str:
        return Meta(len(shapes[r]), shapes[r], like.dtype, like.device, 0, ()).describe(dims)

    if len(dims) > 1:  # a dim sharded along axis k: ranks at the same position on axis k must agree on it
        for k, d in enumerate(dims):
            for r in range(n):
                q = next(p for p, c in enumerate(coords) if c[k] == coords[r][k])
                if shapes[r][d] != shapes[q][d]:
                    raise ValueError(
                        f"{op}: the ranks of the group disagree on the shape: {_rank(cg, q)} has {describe(q)}, "
                        f"{_rank(cg, r)} has {describe(r)}; dim {d} is sharded along axis {k}, so ranks at the "
                        f"same position on that axis must have the same extent")
    out = []
    me = coords[cg.index]
    for k, d in enumerate(dims):
        line = sorted((c[k], r) for r, c in enumerate(coords)
                      if all(c[j] == me[j] for j in range(len(me)) if j != k))
        sizes = tuple(shapes[r][d] for _, r in line)
        out.append(sizes)
        empty = [r for r in range(n) if shapes[r][d] == 0]
        if empty and not allow_empty:
            total = sum(sizes)
            raise ValueError(
                f"{op}: group ranks {empty} (global {[cg.ranks[r] for r in empty]}) hold no rows along dim "
                f"{d} ({total} rows over {len(sizes)} ranks, sizes {list(sizes)}); expected at least 1 row per "
                f"rank: use at most {max(1, total)} ranks for this dim")
    return tuple(out)


# -- the agreement ----------------------------------------------------------------------------------------------

def agree(meta: Meta, cg: CommGroup, op: str, *, coords: Sequence[tuple[int, ...]] | None = None,
          allow_empty: bool = False) -> tuple[tuple[int, ...], ...]:
    """Every rank's extents along each sharded dim of ``meta`` (one tuple per spec), after checking that the
    ranks' calls agree; the same ``ValueError`` on every rank otherwise. One small all-gather of host data."""
    return agree_with(meta, (), cg, op, coords=coords, allow_empty=allow_empty)[0]


def agree_with(meta: Meta, tail: Sequence[int], cg: CommGroup, op: str, *,
               coords: Sequence[tuple[int, ...]] | None = None,
               allow_empty: bool = False) -> tuple[tuple[tuple[int, ...], ...], np.ndarray]:
    """:func:`agree`, with ``tail``: words of this rank's own (a fingerprint, a sample key) that ride on the same
    all-gather, unchecked here; returns the extents and every rank's tail (``(size, len(tail))``, group order), for
    the caller to judge (a pure function of it, so that every rank raises alike). No extra collective."""
    tail = [int(v) for v in tail]
    if cg.size == 1:
        dims = _check([meta], cg, op)
        return _extents([meta.shape], dims, meta, cg, op, coords, allow_empty), np.asarray([tail], dtype=np.int64)
    row = meta.row()
    table = gather_words([*row, len(tail), *tail], cg, op)
    tails = table[:, ROW_WORDS + 1:]
    table = table[:, :ROW_WORDS + 1]  # (the tail's length: a peer in a different call is caught, not misread)
    row = [*row, len(tail)]
    dims = [s.dim % meta.ndim for s in meta.specs] if not row[1] else []
    ok = not row[1] and bool((table[:, 0] == _MAGIC).all()) and not table[:, 1].any()
    if ok:  # every row equals this rank's but for the sharded extents: the full check could only pass
        masked = table.copy()
        for d in dims:
            masked[:, SHAPE_AT + d] = row[SHAPE_AT + d]
        ok = bool((masked == np.asarray(row, dtype=np.int64)).all())
    if ok:
        shapes = [tuple(int(v) for v in r[SHAPE_AT:SHAPE_AT + meta.ndim]) for r in table]
    else:  # something differs: gather what every rank passed and say exactly what (all ranks take this path)
        metas = all_gather_object(meta, cg)
        if any(not isinstance(m, Meta) for m in metas):
            _check(metas, cg, op)  # raises: another call answered
        dims = _check(metas, cg, op)
        shapes = [m.shape for m in metas]
    return _extents(shapes, dims, meta, cg, op, coords, allow_empty), tails
