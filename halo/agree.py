"""Agreement before communication: every rank's arguments gathered and checked alike; bounded waits.

Invariant 4, "no rank waits alone":

* Arguments are checked *after* one all-gather of every rank's metadata (shape, dtype, device, dim, halo,
  boundary, whether a gradient is needed), by a pure function of the gathered table, so an argument that is
  wrong on one rank only makes every rank raise the same error before any point-to-point message is posted.
  Inside :func:`static_shapes` the gather happens on the first run only (the signature is then compared
  locally).
* Every wait (the gather, the forward messages, the backward messages) is bounded: by
  :func:`set_timeout` where set, else by the process group's timeout. A peer that died, stalls, or called a
  different collective makes this rank raise :class:`HaloCommError` naming the peers, not wait forever.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import operator
import re
import time
import weakref
import zlib
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .mesh import resolve_group
from .partition import BOUNDARIES, check_boundary

__all__ = [
    "GroupInfo",
    "HaloCommError",
    "clear_shape_cache",
    "get_timeout",
    "group_info",
    "set_timeout",
    "set_validation",
    "shard_sizes",
    "static_shapes",
]

VALIDATION_MODES = ("first", "always")
_validation = "first"


def set_validation(mode: str) -> None:
    """How often ranks cross-check shapes inside :func:`static_shapes`: ``"first"`` (default) or ``"always"``.

    Outside ``static_shapes`` every exchange that has to learn its peers' extents does one small all-gather
    (which also checks that B, C, W, dtype, device, halo and boundary agree). Inside it, ``"first"`` does that
    only the first time each position of the call sequence is met; ``"always"`` keeps gathering (a debugging
    aid).
    """
    global _validation
    if mode not in VALIDATION_MODES:
        raise ValueError(f"unknown validation mode {mode!r}; expected one of {', '.join(VALIDATION_MODES)}")
    _validation = mode


_epochs: list[list] = []  # stack of [tag, position in the call sequence]
_static_cache: dict[tuple, tuple[Any, Any]] = {}


@contextlib.contextmanager
def static_shapes(tag: Hashable = "default") -> Iterator[None]:
    """Promise that the code inside makes the same sequence of exchanges, with the same global shapes,
    every time it runs under this ``tag`` (a training step at fixed resolution), so ranks need not re-learn
    each other's extents: after the first run, no collective is spent on shapes.

    Why a promise and not a cache keyed on the local shape: when a global extent changes, some ranks' shards
    can keep their shape (45 rows over 2 ranks is 23 + 22, 44 is 22 + 22), so a per-rank cache would make
    one rank skip the check its peers run, and the group would hang. Keyed on the position in a call sequence
    that every rank walks identically, all ranks hit or miss together. A rank that sees its own arguments
    change under a used tag raises an error naming the tag; use a new tag per resolution. (Its peers then
    find no partner for their messages and raise :class:`HaloCommError` when the timeout runs out.) Enter it
    once per step, not around a whole training loop: each call position is remembered.
    """
    _epochs.append([tag, 0])
    try:
        yield
    finally:
        _epochs.pop()


def clear_shape_cache() -> None:
    """Forget everything learned under :func:`static_shapes` (call on every rank)."""
    _static_cache.clear()


# -- timeouts ------------------------------------------------------------------------------------------------

_timeout: float | None = None
# Buffers of messages given up on: a late peer may still write into them, so they are never freed (bounded).
_abandoned: collections.deque = collections.deque(maxlen=64)


class HaloCommError(RuntimeError):
    """A message of an exchange (or of its shape agreement) failed or timed out: a peer died, stalls, or
    called a different collective. The process group is not usable afterwards; tear it down."""


def set_timeout(seconds: float | timedelta | None) -> float | None:
    """Bound every wait of halo's exchanges to ``seconds``; ``None`` (default): the process group's timeout.

    Applies to the shape all-gather and to the forward and backward messages, per exchange (all messages of
    one exchange share the deadline). Past it this rank raises :class:`HaloCommError` naming this rank, the
    peers still pending and the time waited. Per process: call it on every rank. Returns the previous value.
    On NCCL a set timeout makes each wait block the CPU until the messages arrive (``Work.wait(timeout)``);
    ``None`` keeps the stream-ordered wait and leaves timeouts to the NCCL watchdog.
    """
    global _timeout
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise ValueError(f"timeout must be a positive, finite number of seconds or None, got {seconds!r}")
        seconds = float(seconds)
    previous, _timeout = _timeout, seconds
    return previous


def get_timeout() -> float | None:
    """The timeout set by :func:`set_timeout` (``None``: the process group's)."""
    return _timeout


def _wait(works: Sequence[Any], labels: Sequence[str], info: GroupInfo, what: str, posted: float,
          keep: Any) -> None:
    """Wait for ``works`` under one deadline; turn a failure or timeout into :class:`HaloCommError`.

    ``labels[i]``: who work ``i`` talks to ("recv from global rank 3"). ``keep``: the buffers, parked in
    ``_abandoned`` on failure so that a late write from a peer cannot land in freed memory.
    """
    limit = _timeout
    began = time.monotonic()
    for i, work in enumerate(works):
        exc: BaseException | None = None
        try:
            if limit is None:
                done = work.wait()
            else:
                left = limit - (time.monotonic() - began)
                done = work.wait(timeout=timedelta(seconds=max(left, 1e-3)))
        except Exception as e:  # noqa: BLE001 - every backend error becomes one clear error
            exc, done = e, False
        if done is False:
            _abandoned.append(keep)
            raise _comm_error(labels, i, info, what, began, posted, limit, exc) from exc


def _comm_error(labels: Sequence[str], i: int, info: GroupInfo, what: str, began: float, posted: float,
                limit: float | None, exc: BaseException | None) -> HaloCommError:
    now = time.monotonic()
    waited = now - began
    cause = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else "no completion"
    cause = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", cause)  # gloo's source location
    timed_out = (limit is not None and waited >= limit - 1e-3) or "timed out" in cause.lower()
    others = [label for label in dict.fromkeys(labels[i + 1:]) if label != labels[i]]
    also = f" (not yet confirmed either: {', '.join(others)})" if others else ""
    bound = f"halo.exchange.set_timeout({limit:g})" if limit is not None else "the process group's timeout"
    return HaloCommError(
        f"{what}: rank {info.ranks[info.index]} (group rank {info.index} of {info.size}) "
        f"{'timed out' if timed_out else 'failed'} after {waited:.2f} s (posted {now - posted:.2f} s ago; "
        f"bound: {bound}) waiting on {labels[i]}{also}. The peer may have died, be stuck, or have called a "
        f"different collective or exchange (another shape, op or call order); this process group is unusable "
        f"now. Backend: {cause}")


# -- group bookkeeping ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupInfo:
    group: Any
    size: int
    index: int  # this rank's position in the group
    ranks: tuple[int, ...]  # global ranks in group order


_group_infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_info(group: Any | None) -> GroupInfo:
    """Size and position in ``group`` (default: the manager's domain group; no process group: one rank)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return GroupInfo(None, 1, 0, (0,))
    group = resolve_group(group)
    info = _group_infos.get(group)
    if info is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of the group it exchanges over (global ranks "
                             f"{list(ranks)}); pass each rank its own domain group")
        info = GroupInfo(group, len(ranks), ranks.index(me), ranks)
        _group_infos[group] = info
    return info


# -- agreement: every rank's arguments, gathered, then checked by one pure function ---------------------------

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_DEVICES = ["cpu", "cuda", "xpu", "mps", "meta"]
_MAX_NDIM = 8

_MAGIC = 0x48414C4F  # "HALO": a peer in a different all-gather of the same size is caught, not misread
_TEXT = 3  # int64 words per text field (24 bytes): a dtype, a device type, a boundary name, a bad halo
_NO_HALO, _HALO, _BAD_HALO, _NEEDS = 0, 1, 2, 3  # what a spec carries in its halo slot
_SPEC_WORDS = 5 + 2 * _TEXT  # dim, kind, before, after, text, has boundary, boundary
_MAX_SPECS = 2
_META_WORDS = 4 + _MAX_NDIM + 2 * _TEXT + _MAX_SPECS * _SPEC_WORDS
_BIG = 1 << 62  # halos are clamped to this, so any int fits the int64 table
_SIZES_ONLY = object()  # no boundary: the call only learns extents (shard_sizes)


def _encode_text(s: str) -> list[int]:
    b = s.encode("utf-8", "replace")
    if len(b) > 8 * _TEXT:
        b = b[:8 * _TEXT - 3] + b"..."
    b = b.ljust(8 * _TEXT, b"\0")
    return [int.from_bytes(b[i:i + 8], "little", signed=True) for i in range(0, 8 * _TEXT, 8)]


def _decode_text(words: Sequence[int]) -> str:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0").decode(
        "utf-8", "replace")


@dataclass(frozen=True)
class _Spec:
    """One exchange's arguments as one rank passed them (unvalidated)."""

    dim: int
    kind: int = _NO_HALO  # _NO_HALO (sizes only), _HALO (before, after), _BAD_HALO (text), _NEEDS (crc, len)
    before: int = 0
    after: int = 0
    text: str = ""  # repr of a malformed halo
    boundary: str | None = None  # as passed; None: sizes only

    @staticmethod
    def of(dim: Any, halo: Any = None, boundary: Any = _SIZES_ONLY, needs: Any = None) -> _Spec:
        """Record the arguments as passed; nothing raises here (problems are judged after the gather)."""
        try:
            dim = operator.index(dim)
        except TypeError:
            dim = _BIG  # reported as out of range
        b = None if boundary is _SIZES_ONLY else boundary if isinstance(boundary, str) else repr(boundary)
        if needs is not None:
            key = repr(tuple(tuple(int(v) for v in n) for n in needs)).encode()
            return _Spec(dim, _NEEDS, zlib.crc32(key), len(needs), boundary=b)
        if halo is None:
            return _Spec(dim, boundary=b)
        items = tuple(halo) if isinstance(halo, (tuple, list)) else (halo, halo)
        try:
            if len(items) != 2:
                raise TypeError
            before, after = (max(-_BIG, min(_BIG, operator.index(h))) for h in items)
        except TypeError:
            return _Spec(dim, _BAD_HALO, text=repr(halo), boundary=b)
        return _Spec(dim, _HALO, before, after, boundary=b)

    def encode(self) -> list[int]:
        return [max(-_BIG, min(_BIG, self.dim)), self.kind, self.before, self.after,
                *_encode_text(self.text), int(self.boundary is not None), *_encode_text(self.boundary or "")]

    @staticmethod
    def decode(w: Sequence[int]) -> _Spec:
        return _Spec(w[0], w[1], w[2], w[3], _decode_text(w[4:4 + _TEXT]),
                     _decode_text(w[5 + _TEXT:5 + 2 * _TEXT]) if w[4 + _TEXT] else None)

    def halo_str(self) -> str:
        if self.kind == _HALO:
            return f"({self.before}, {self.after})"
        if self.kind == _BAD_HALO:
            return self.text
        return "per-rank needs" if self.kind == _NEEDS else "none (shapes only)"


@dataclass(frozen=True)
class _Meta:
    """What one rank brings to an exchange: its tensor's layout and its arguments, one spec per exchange."""

    ndim: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    grad: int  # 1 / 0: the exchange records a backward (every rank must agree); -1: not checked
    specs: tuple[_Spec, ...]
    magic: int = _MAGIC

    @staticmethod
    def of(x: torch.Tensor, specs: Sequence[_Spec], grad: int) -> _Meta:
        return _Meta(x.dim(), tuple(x.shape), str(x.dtype).removeprefix("torch."), x.device.type, grad,
                     tuple(specs))

    def encode(self) -> list[int]:
        shape = list(self.shape[:_MAX_NDIM]) + [-1] * (_MAX_NDIM - min(self.ndim, _MAX_NDIM))
        words = [self.magic, self.ndim, self.grad, len(self.specs), *shape, *_encode_text(self.dtype),
                 *_encode_text(self.device)]
        for s in self.specs:
            words += s.encode()
        return words + [0] * (_META_WORDS - len(words))

    @staticmethod
    def decode(w: Sequence[int]) -> _Meta:
        ndim, n_specs = w[1], w[3]
        shape = tuple(w[4:4 + min(max(ndim, 0), _MAX_NDIM)])
        at = 4 + _MAX_NDIM
        dtype, device = _decode_text(w[at:at + _TEXT]), _decode_text(w[at + _TEXT:at + 2 * _TEXT])
        at += 2 * _TEXT
        specs = tuple(_Spec.decode(w[at + k * _SPEC_WORDS:at + (k + 1) * _SPEC_WORDS])
                      for k in range(min(max(n_specs, 0), _MAX_SPECS)))
        return _Meta(ndim, shape, dtype, device, w[2], specs, w[0])

    def describe(self, sharded: Sequence[int] = ()) -> str:
        dims = [f"[{s}]" if i in sharded else str(s) for i, s in enumerate(self.shape)]
        return f"shape ({', '.join(dims)}{',' if len(dims) == 1 else ''}) {self.dtype} on {self.device}"


def _canonical(boundary: str | None) -> str | None:
    return None if boundary is None else check_boundary(boundary)


def _needs_grad(x: torch.Tensor) -> int:
    return int(torch.is_grad_enabled() and x.requires_grad)


_comm_devices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gather(meta: _Meta, info: GroupInfo, op: str) -> list[list[int]]:
    """Every rank's encoded ``meta`` in group order: one all-gather of a small int64 table, under the timeout."""
    device = _comm_devices.get(info.group)
    if device is None:
        nccl = dist.get_backend(info.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        _comm_devices[info.group] = device
    local = _encoded_tensor(meta, device)
    table = torch.empty((info.size, _META_WORDS), dtype=torch.int64, device=device)
    posted = time.monotonic()
    work = dist.all_gather(list(table.unbind(0)), local, group=info.group, async_op=True)
    others = [g for g in info.ranks if g != info.ranks[info.index]]
    _wait([work], [f"the shape all-gather with global ranks {others}"], info, op, posted,
          (local, table))
    return table.tolist()


@functools.lru_cache(maxsize=256)
def _encoded(meta: _Meta) -> tuple[int, ...]:
    return tuple(meta.encode())


@functools.lru_cache(maxsize=64)
def _encoded_tensor(meta: _Meta, device: torch.device) -> torch.Tensor:
    """The all-gather's input, built once per signature (never written: the gather only reads it)."""
    return torch.tensor(_encoded(meta), dtype=torch.int64, device=device)


def _rank(info: GroupInfo, r: int) -> str:
    return f"group rank {r} (global {info.ranks[r]})"


def _first_bad(metas: Sequence[_Meta], info: GroupInfo, op: str, problem) -> None:
    """Raise ``problem(meta)`` for the lowest rank where it is not None, naming the other ranks too."""
    bad = [(r, msg) for r, m in enumerate(metas) if (msg := problem(m)) is not None]
    if not bad:
        return
    r, msg = bad[0]
    if len(bad) == len(metas) > 1:
        where = "on every rank"
    else:
        others = [q for q, _ in bad[1:]]
        where = f"on {_rank(info, r)}" + (f" (and group ranks {others})" if others else "")
    raise ValueError(f"{op}: {where}, {msg}")


def _ndim_problem(m: _Meta, max_nd: float) -> str | None:
    if not 1 <= m.ndim <= max_nd:
        return f"expected a tensor with 1 to {_MAX_NDIM} dims, got {m.ndim} dims"
    return None


def _spec_problem(m: _Meta, k: int) -> str | None:
    """What is wrong with rank-local argument set ``k`` of ``m`` on its own (None: nothing)."""
    s = m.specs[k]
    if not -m.ndim <= s.dim < m.ndim:
        got = s.dim if s.dim != _BIG else "(not an int)"
        return (f"dim {got} is out of range for a {m.ndim}-d tensor of {m.describe()}; expected "
                f"{-m.ndim} <= dim <= {m.ndim - 1}")
    if s.kind == _BAD_HALO:
        return f"halo must be an int or a (before, after) pair of ints, got {s.text}"
    if s.kind == _HALO and min(s.before, s.after) < 0:
        return f"halo must be non-negative, got {s.halo_str()}"
    if s.boundary is not None and s.boundary not in BOUNDARIES:
        return f"unknown boundary {s.boundary!r}; expected one of {', '.join(BOUNDARIES)}"
    return None


def _local_problem(m: _Meta, max_nd: float) -> str | None:
    return _ndim_problem(m, max_nd) or next(
        (p for k in range(len(m.specs)) if (p := _spec_problem(m, k)) is not None), None)


def _check(metas: Sequence[_Meta], info: GroupInfo, op: str) -> list[int]:
    """Check every rank's arguments on their own and against group rank 0's; return the sharded dims.

    A pure function of the gathered table, so every rank raises the same error (or none). Extents along the
    sharded dims are left to :func:`_extents`.
    """
    n = len(metas)
    for r, m in enumerate(metas):
        if m.magic != _MAGIC or len(m.specs) != len(metas[info.index].specs):
            raise RuntimeError(f"{op}: {_rank(info, r)} answered the shape all-gather from a different call "
                               f"(another collective or halo op); every rank must make the same sequence of "
                               f"exchanges")
    max_nd = _MAX_NDIM if n > 1 else math.inf
    _first_bad(metas, info, op, lambda m: _ndim_problem(m, max_nd))
    for k in range(len(metas[0].specs)):
        _first_bad(metas, info, op, lambda m, k=k: _spec_problem(m, k))

    ref = metas[0]
    dims = [s.dim % ref.ndim for s in ref.specs]

    def disagree(what: str, a: str, r: int, b: str, hint: str) -> ValueError:
        return ValueError(f"{op}: the ranks of the group disagree on {what}: {_rank(info, 0)} has {a}, "
                          f"{_rank(info, r)} has {b}; {hint}")

    for r, m in enumerate(metas):
        if m.ndim != ref.ndim:
            raise disagree("the number of dims", f"{ref.ndim} ({ref.describe()})", r, f"{m.ndim} ({m.describe()})",
                           "every rank must pass a shard of the same tensor")
        for k, (s, s0) in enumerate(zip(m.specs, ref.specs, strict=True)):
            if s.dim % m.ndim != dims[k]:
                raise disagree("the sharded dim", f"dim={s0.dim}", r, f"dim={s.dim}", "pass the same dim on every rank")
            if (s.kind, s.before, s.after, s.text) != (s0.kind, s0.before, s0.after, s0.text):
                what = "the rows each rank needs" if _NEEDS in (s.kind, s0.kind) else "the halo"
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


def _extents(shapes: Sequence[tuple[int, ...]], dims: Sequence[int], like: _Meta, info: GroupInfo, op: str,
             coords: Sequence[tuple[int, ...]] | None, allow_empty: bool) -> tuple[tuple[int, ...], ...]:
    """The extents of the ranks in this rank's line along each axis ``k`` (``coords[r][k]``: rank ``r``'s
    position on axis ``k``; default one axis in group order); checks lines agree and no shard is empty."""
    n = len(shapes)
    coords = coords if coords is not None else [(r,) for r in range(n)]

    def describe(r: int) -> str:
        return _Meta(len(shapes[r]), shapes[r], like.dtype, like.device, 0, ()).describe(dims)

    if len(dims) > 1:  # a dim sharded along axis k: ranks at the same position on axis k must agree on it
        for k, d in enumerate(dims):
            for r in range(n):
                q = next(p for p, c in enumerate(coords) if c[k] == coords[r][k])
                if shapes[r][d] != shapes[q][d]:
                    raise ValueError(
                        f"{op}: the ranks of the group disagree on the shape: {_rank(info, q)} has {describe(q)}, "
                        f"{_rank(info, r)} has {describe(r)}; dim {d} is sharded along axis {k}, so ranks at the "
                        f"same position on that axis must have the same extent")
    out = []
    me = coords[info.index]
    for k, d in enumerate(dims):
        line = sorted((c[k], r) for r, c in enumerate(coords)
                      if all(c[j] == me[j] for j in range(len(me)) if j != k))
        sizes = tuple(shapes[r][d] for _, r in line)
        out.append(sizes)
        empty = [r for r in range(n) if shapes[r][d] == 0]
        if empty and not allow_empty:
            total = sum(sizes)
            raise ValueError(
                f"{op}: group ranks {empty} (global {[info.ranks[r] for r in empty]}) hold no rows along dim "
                f"{d} ({total} rows over {len(sizes)} ranks, sizes {list(sizes)}); expected at least 1 row per "
                f"rank: use at most {max(1, total)} ranks for this dim")
    return tuple(out)


def _agree(x: torch.Tensor, info: GroupInfo, specs: Sequence[_Spec], op: str, *, grad: int = -1,
           coords: Sequence[tuple[int, ...]] | None = None, allow_empty: bool = False) -> tuple[tuple[int, ...], ...]:
    """Gather every rank's metadata (or recall it under :func:`static_shapes`), validate, return the extents."""
    meta = _Meta.of(x, specs, grad)
    if info.size == 1:
        dims = _check([meta], info, op)
        return _extents([meta.shape], dims, meta, info, op, coords, allow_empty)
    key = None
    if _epochs:
        epoch = _epochs[-1]
        key = (epoch[0], epoch[1], id(info.group))
        epoch[1] += 1
        hit = _static_cache.get(key)
        if hit is not None and _validation == "first":
            if hit[0] != meta:
                raise RuntimeError(
                    f"{op}: under halo.static_shapes({epoch[0]!r}) call {epoch[1] - 1} met {_summary(meta)} "
                    f"where the first run met {_summary(hit[0])}; shapes and arguments must repeat under one "
                    f"tag: use a new tag per resolution")
            return hit[1]
    rows = _gather(meta, info, op)
    # Fast path: every row equals this rank's but for the sharded extents, and this rank's arguments are fine,
    # so the full check could only pass. Every rank sees the same table, so all take the same path.
    dims: list[int] | None = None
    if _local_problem(meta, _MAX_NDIM) is None:
        dims = [s.dim % meta.ndim for s in specs]
        local = _encoded(meta)
        for row in rows:
            masked = list(row)
            for d in dims:
                masked[4 + d] = local[4 + d]
            if tuple(masked) != local:
                dims = None
                break
    if dims is not None:
        shapes = [tuple(row[4:4 + meta.ndim]) for row in rows]
    else:
        metas = [_Meta.decode(row) for row in rows]
        dims = _check(metas, info, op)
        shapes = [m.shape for m in metas]
    result = _extents(shapes, dims, meta, info, op, coords, allow_empty)
    if key is not None:
        _static_cache[key] = (meta, result)
    return result


def _summary(m: _Meta) -> str:
    specs = "; ".join(f"dim {s.dim}, halo {s.halo_str()}, boundary {s.boundary!r}" for s in m.specs)
    return f"{m.describe()} ({specs}{', needs grad' if m.grad == 1 else ''})"


def shard_sizes(x: torch.Tensor, dim: int, group: Any | None = None, *, op: str = "halo_exchange",
                allow_empty: bool = False, check_grad: bool = False) -> tuple[int, ...]:
    """Every rank's extent of ``x`` along ``dim``, in group order; checks that the ranks agree.

    ``dim`` and the number of dims, all other dims, the dtype and the device type must be equal across the
    group; otherwise every rank raises the same ``ValueError`` naming the ranks and shapes (errors are found
    from the gathered table, so an argument wrong on one rank only cannot make its peers wait). Costs one small
    all-gather per call, or per call position under :func:`static_shapes` (``set_validation``).
    ``check_grad``: also agree on whether ``x`` records a backward (``x.requires_grad`` under grad mode), as
    an exchange of ``x`` that runs a backward on some ranks only would leave those waiting.
    """
    grad = _needs_grad(x) if check_grad else -1
    return _agree(x, group_info(group), (_Spec.of(dim),), op, grad=grad, allow_empty=allow_empty)[0]


