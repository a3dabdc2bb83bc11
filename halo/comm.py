"""Talking to peers: the groups halo uses, their host side groups, bounded waits, and the error a failed wait gives.

``CommGroup`` is a process group as halo sees it: its size, this rank's position, the members' global ranks, and a
*host* group over the same members on which ranks agree on metadata (shapes, arguments) with CPU tensors, so an
agreement never syncs a GPU. With gloo (or a ``"cpu:gloo,cuda:nccl"`` group) the host group is the group itself;
with NCCL alone it is a gloo group over the same ranks *in the same order*, made eagerly where the device group is
made (:class:`halo.DomainMesh`, :func:`new_group`, the ``halo.groups`` initializers): every rank of the world creates
every host group, in one order, in the same collective call that creates the device groups. Never lazily by the
members alone: torch names a group made with ``use_local_synchronization`` from the number of groups this process
made before, so members that made different numbers of groups would meet on different store prefixes and hang.
A group spanning the whole world gets its host group on first use (all its members are every rank, so that first
use is collective); any other NCCL-only group halo was not told about raises a clear error on every member.

Every wait is bounded (invariant 4): by :func:`set_timeout` where set, else by the process group's own timeout.
A peer that died, stalls, or called a different collective makes this rank raise :class:`HaloCommError` naming
the peers still pending. Buffers of a message given up on are kept alive (:func:`keep_alive`): a late peer may
still write into them.

Under ``torch.compile`` the helpers here that post or wait (:func:`all_reduce`, :func:`all_gather_host`,
:func:`gather_words`, :func:`all_gather_object`, :func:`wait_all`) are ``torch._dynamo.disable``d: dynamo never
traces a collective into a graph (where nothing would order it against halo's communicating custom ops, see
:func:`halo.exchange.order_after`), whatever a torch version learns to trace (``time.monotonic``, ``async_op``,
``dist.*`` remapped to functional collectives). A Python path that reaches one inside a compiled region is a graph
break there, so it runs eagerly in program order on every rank; the communication that belongs in a graph goes
through halo's ordered custom ops instead. Inside a custom op's own kernel (never traced) the wrapper costs ~1 us.
"""

from __future__ import annotations

import collections
import inspect
import math
import pickle
import re
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .mesh import resolve_group

__all__ = [
    "CommGroup",
    "abandoned",
    "HaloCommError",
    "all_reduce",
    "comm_group",
    "gather_words",
    "get_timeout",
    "group_by_id",
    "group_id",
    "carries_cpu",
    "create_host_groups",
    "first_ops",
    "keep_alive",
    "new_group",
    "set_timeout",
    "wait_all",
]


class HaloCommError(RuntimeError):
    """A message of an exchange (or of an agreement or reduction) failed or timed out: a peer died, stalls, or
    called a different collective. The process group is not usable afterwards; tear it down."""


_TIMEOUT: list[float | None] = [None]  # a list, so that readers never hold a stale copy of the value
# Buffers of messages given up on: a late peer may still write into them, so they are never freed (bounded).
_ABANDONED: collections.deque = collections.deque(maxlen=64)


def set_timeout(seconds: float | timedelta | None) -> float | None:
    """Bound every wait of halo's communication to ``seconds``; ``None`` (default): the process group's timeout.

    Applies to agreements, halo messages (forward and backward) and the reductions inside layers and losses; all
    messages of one operation share the deadline. Past it this rank raises :class:`HaloCommError` naming this
    rank, the peers still pending and the time waited. Per process: call it on every rank. Returns the previous
    value.

    On NCCL: a set timeout makes each wait block the CPU until the messages arrive (``Work.wait(timeout)`` polls the
    work's CUDA event from the host), which costs the overlap of host and device and is illegal while a CUDA graph
    is being captured — so under capture (``torch.cuda.is_current_stream_capturing()``) halo waits without a
    timeout (stream-ordered, capturable), and a replayed graph is bounded only by the NCCL watchdog. ``None`` (the
    default, and what a sync-free or captured step wants on NCCL) keeps the stream-ordered wait: nothing blocks the
    host, and a dead or stuck peer is caught by the NCCL watchdog after the process group's ``timeout=`` (set it in
    ``init_process_group``; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` decides whether it aborts the process).
    """
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise ValueError(f"timeout must be a positive, finite number of seconds or None, got {seconds!r}")
        seconds = float(seconds)
    previous, _TIMEOUT[0] = _TIMEOUT[0], seconds
    return previous


def get_timeout() -> float | None:
    """The timeout set by :func:`set_timeout` (``None``: the process group's)."""
    return _TIMEOUT[0]


def keep_alive(obj: Any) -> None:
    """Keep ``obj`` (buffers of a message given up on) alive for good: a late peer may still write into it."""
    _ABANDONED.append(obj)


def abandoned() -> int:
    """How many message buffers were given up on (kept alive) in this process: 0 in a healthy run."""
    return len(_ABANDONED)


@dataclass(frozen=True, eq=False)
class CommGroup:
    """A process group as halo uses it. ``group is None``: one process, no torch.distributed."""

    group: Any
    size: int
    index: int  # this rank's position in the group
    ranks: tuple[int, ...]  # global ranks in group order
    _host: list = field(default_factory=list, repr=False)  # the host group, looked up on first use

    @property
    def host(self) -> Any:
        """The group on which ranks agree on metadata with CPU tensors, its ranks in this group's order (see the
        module docstring): the group itself where it carries CPU tensors, else the gloo group made with it."""
        if not self._host:
            self._host.append(_host_of(self))
        return self._host[0]

    def describe(self, r: int | None = None) -> str:
        """``group rank r (global g)``; this rank when ``r`` is None."""
        r = self.index if r is None else r
        return f"group rank {r} (global {self.ranks[r]})"


# -- host groups: made eagerly, in one order, on every rank (module docstring) ---------------------------------

_HOSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # device group -> its gloo host group
_WORLD_HOST: list = []  # the host group of a group spanning the whole world, made on first (collective) use
_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


def carries_cpu(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend(group)``) runs collectives of CPU tensors itself:
    ``gloo``, or a multi-backend string with a CPU entry (``"cpu:gloo,cuda:nccl"``)."""
    b = str(backend).lower().replace(" ", "")
    return b == "gloo" or any(part.startswith("cpu:") for part in b.split(","))


def _host_needed() -> bool:
    """Whether groups of this job need a separate gloo host group: the default backend does not carry CPU tensors
    (NCCL alone). The same answer on every rank (one backend string for the job)."""
    return not carries_cpu(dist.get_backend())


def _new_host(ranks: Sequence[int]) -> Any:
    """A gloo group over ``ranks``, group rank ``i`` = ``ranks[i]`` (not sorted: the host table is read in the device
    group's order). Collective over the world (not ``use_local_synchronization``: names from the world-wide count)."""
    ranks = [int(r) for r in ranks]
    if ranks == sorted(ranks):
        return dist.new_group(ranks, backend="gloo")
    if not _SORT_RANKS:
        raise ValueError(f"a group with ranks {ranks} (not ascending) needs torch.distributed.new_group("
                         f"sort_ranks=False) for its gloo host group, which this torch ({torch.__version__}) lacks")
    return dist.new_group(ranks, backend="gloo", sort_ranks=False)


def create_host_groups(blocks: Sequence[Sequence[int]], group: Any | None) -> None:
    """Make the host group of every group in ``blocks`` (each a group's global ranks, in group order; the blocks of
    one kind, e.g. every domain group of a mesh), in this order, and register this rank's one as ``group``'s.

    Collective: every rank of the world calls it with the same ``blocks``, where the device groups are made
    (``group``: this rank's device group among them, ``None`` if it is in none). A no-op where the job's backend
    carries CPU tensors itself (gloo, ``"cpu:gloo,cuda:nccl"``)."""
    if not _host_needed():
        return
    me = dist.get_rank()
    for block in blocks:
        host = _new_host(block)
        if group is not None and me in block:
            _HOSTS[group] = host


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """``torch.distributed.new_group(ranks, **kwargs)`` and, where the job's backend needs one (NCCL alone), its gloo
    host group, made in the same call: call it on every rank, in the same order, as torch's ``new_group``. Use it for
    an NCCL group you hand to halo yourself (a mesh's groups are made with their host groups already).

    ``sort_ranks=False`` (group rank ``i`` = ``ranks[i]``) needs torch >= 2.12; on torch 2.11 it is dropped where
    ``ranks`` ascend anyway, and refused (the same error on every rank, before any collective) where they do not."""
    if kwargs.get("sort_ranks", True) is False and not _SORT_RANKS:
        if [int(r) for r in ranks] != sorted(int(r) for r in ranks):
            raise ValueError(f"new_group(ranks={[int(r) for r in ranks]}, sort_ranks=False): a group whose ranks do "
                             f"not ascend needs torch.distributed.new_group(sort_ranks=...), which this torch "
                             f"({torch.__version__}) lacks (torch >= 2.12 has it); pass the ranks in ascending order")
        kwargs = {k: v for k, v in kwargs.items() if k != "sort_ranks"}
    group = dist.new_group(list(ranks), **kwargs)
    order = [int(r) for r in ranks] if kwargs.get("sort_ranks", True) is False else sorted(int(r) for r in ranks)
    if _host_needed():
        host = _new_host(order)
        if dist.get_rank() in order:
            _HOSTS[group] = host
    if dist.get_rank() in order:
        first_ops([group])
    return group


def _needs_first_op(backend: str, bound_device: Any) -> bool:
    """Whether NCCL groups need a first op that includes every member: NCCL in the backend and no device bound at
    ``init_process_group(device_id=...)`` (then torch makes each communicator on its group's first op, and batched
    point-to-point ops may be that first op only if every member takes part)."""
    return "nccl" in str(backend).lower() and bound_device is None


def first_ops(groups: Sequence[Any]) -> None:
    """Where NCCL runs without a bound device: one tiny all-reduce on each of ``groups`` (this rank's), in order, so
    that the first NCCL op on each includes every member. A halo exchange posts nothing on a rank that has no
    messages, which would be undefined as the group's first op. Call it where the groups are made (every member,
    the same order); a no-op with ``device_id=`` given to ``init_process_group`` (``halo.launch`` gives it)."""
    if not _needs_first_op(dist.get_backend(), getattr(dist.group.WORLD, "bound_device_id", None)):
        return
    one = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    seen: set[int] = set()
    for group in groups:
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            dist.all_reduce(one, group=group)


def _host_of(cg: CommGroup) -> Any:
    if carries_cpu(dist.get_backend(cg.group)):
        return cg.group
    host = _HOSTS.get(cg.group)
    if host is not None:
        return host
    if cg.size == dist.get_world_size():
        # Every rank is a member: this first use is collective over the world, like the creation of a group.
        if not _WORLD_HOST or dist.get_process_group_ranks(_WORLD_HOST[0]) != list(cg.ranks):
            _WORLD_HOST[:] = [_new_host(cg.ranks)]
            first_ops([cg.group])
        return _WORLD_HOST[0]
    raise ValueError(
        f"halo: the {dist.get_backend(cg.group)} group of global ranks {list(cg.ranks)} has no gloo host group for "
        f"halo's agreements (CPU tensors). Make it with halo.comm.new_group(ranks) instead of "
        f"torch.distributed.new_group (on every rank, in the same order), use the groups of a halo.DomainMesh, or "
        f"initialise with init_process_group(backend=\"cpu:gloo,cuda:nccl\"), whose groups carry CPU tensors")


_SINGLE = CommGroup(None, 1, 0, (0,))
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IDS: dict[int, int] = {}  # id(CommGroup) -> small int
_BY_ID: list[CommGroup] = []


def group_id(cg: CommGroup) -> int:
    """A small int naming ``cg`` in this process (what a compiled graph or a custom op can carry)."""
    gid = _IDS.get(id(cg))
    if gid is None or _BY_ID[gid] is not cg:
        gid = _IDS[id(cg)] = len(_BY_ID)
        _BY_ID.append(cg)
    return gid


def group_by_id(gid: int) -> CommGroup:
    """The :class:`CommGroup` of :func:`group_id` ``gid``."""
    return _BY_ID[gid]


_UNSHARDED = [0]  # > 0 inside ``unsharded()``: the default group is this process alone


def unsharded_default() -> bool:
    """Whether halo's default group is this process alone: no torch.distributed, or inside :func:`unsharded`."""
    return _UNSHARDED[0] > 0 or not (dist.is_available() and dist.is_initialized())


class unsharded:  # noqa: N801 - a context manager, named like one
    """``with halo.comm.unsharded():`` halo ops called without ``group=`` act on this process alone (the whole
    field): how :func:`halo.check_equivalence` runs the unsharded reference of a model that calls halo's functions
    (``halo.nn.pad_like``, ``halo.random.dropout``) in its forward, in a process of a distributed job."""

    def __enter__(self) -> unsharded:
        _UNSHARDED[0] += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _UNSHARDED[0] -= 1


def comm_group(group: Any | None = None) -> CommGroup:
    """``group`` as a :class:`CommGroup` (default: the manager's domain group; no torch.distributed: one rank)."""
    if group is None and unsharded_default():
        return _SINGLE
    group = resolve_group(group)
    cg = _GROUPS.get(group)
    if cg is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of the group it communicates over (global ranks "
                             f"{list(ranks)}); pass each rank its own domain group")
        cg = CommGroup(group, len(ranks), ranks.index(me), ranks)
        _GROUPS[group] = cg
    return cg


@torch._dynamo.disable  # a wait never enters a compiled graph (module docstring)
def wait_all(works: Sequence[Any], labels: Sequence[Any], cg: CommGroup, what: str, posted: float,
             keep: Any) -> None:
    """Wait for ``works`` under one deadline; turn a failure or timeout into :class:`HaloCommError`.

    ``labels[i]``: who work ``i`` talks to ("recv from global rank 3", or ``("recv from", 3)``: text is made only on
    the error path). ``keep``: the buffers, kept alive on failure so that a late write from a peer cannot land in
    freed memory.
    """
    limit = _TIMEOUT[0]
    if limit is not None and _capturing():
        limit = None  # a host-side wait (polling the work's CUDA event) is illegal during capture: stream-ordered
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
            keep_alive(keep)
            raise comm_error(labels, i, cg, what, began, posted, exc) from exc


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (never on a CPU-only build)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _label(label: Any) -> str:
    """A wait's peer description: a string, a ``(verb, global rank)`` pair, or a tuple of pairs (one request for
    several messages). Made into text only when an error is raised."""
    if isinstance(label, str):
        return label
    if len(label) == 2 and isinstance(label[0], str):
        if isinstance(label[1], int):
            return f"{label[0]} global rank {label[1]}"
        return f"{label[0]} global ranks {[g for g in label[1][0].ranks if g != label[1][0].ranks[label[1][0].index]]}"
    return " and ".join(_label(part) for part in label)


def comm_error(labels: Sequence[Any], i: int, cg: CommGroup, what: str, began: float, posted: float,
               exc: BaseException | None) -> HaloCommError:
    """The error for a wait on ``labels[i]`` that failed (``exc``) or ran out of time."""
    labels = [_label(label) for label in labels]
    limit = _TIMEOUT[0]
    now = time.monotonic()
    waited = now - began
    cause = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else "no completion"
    cause = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", cause)  # gloo's source location
    timed_out = (limit is not None and waited >= limit - 1e-3) or "timed out" in cause.lower()
    others = [label for label in dict.fromkeys(labels[i + 1:]) if label != labels[i]]
    also = f" (not yet confirmed either: {', '.join(others)})" if others else ""
    bound = f"halo.set_timeout({limit:g})" if limit is not None else "the process group's timeout"
    return HaloCommError(
        f"{what}: rank {cg.ranks[cg.index]} (group rank {cg.index} of {cg.size}) "
        f"{'timed out' if timed_out else 'failed'} after {waited:.2f} s (posted {now - posted:.2f} s ago; "
        f"bound: {bound}) waiting on {labels[i]}{also}. The peer may have died, be stuck, have raised an error "
        f"of its own (see its log), or have called a different collective or exchange (another shape, op or "
        f"call order); this process group is unusable now. Backend: {cause}")


def _others(cg: CommGroup) -> str:
    return str([g for g in cg.ranks if g != cg.ranks[cg.index]])


@torch._dynamo.disable  # never traced into a graph, unordered (module docstring): a graph break
def all_reduce(t: torch.Tensor, cg: CommGroup, what: str, op: Any = None) -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``cg`` (``op`` default SUM) under the bounded wait; returns ``t``."""
    posted = time.monotonic()
    work = dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=cg.group, async_op=True)
    wait_all([work], [("the all-reduce with", (cg,))], cg, what, posted, t)
    return t


@torch._dynamo.disable  # never traced into a graph (module docstring)
def all_gather_host(local: torch.Tensor, table: torch.Tensor, cg: CommGroup, what: str) -> torch.Tensor:
    """Every rank's CPU tensor ``local`` into the rows of ``table`` (``(size, *local.shape)``), on the host group."""
    posted = time.monotonic()
    work = dist.all_gather(list(table.unbind(0)), local, group=cg.host, async_op=True)
    wait_all([work], [f"the agreement with global ranks {_others(cg)}"], cg, what, posted, (local, table))
    return table


_HOST_BUFFERS: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


@torch._dynamo.disable  # never traced into a graph (module docstring)
def gather_words(words: Sequence[int], cg: CommGroup, what: str) -> np.ndarray:
    """Every rank's row of ``len(words)`` int64 words, in group order (an array ``(size, len(words))``): one
    all-gather on the host group into buffers made once per (group, width), written and read through numpy (no
    tensor built from Python data, nothing a device waits for). Agreements on one group run one at a time."""
    key = (id(cg), cg.size, len(words))
    bufs = _HOST_BUFFERS.get(key)
    if bufs is None:
        bufs = _HOST_BUFFERS[key] = (torch.zeros(len(words), dtype=torch.int64),
                                     torch.zeros(cg.size, len(words), dtype=torch.int64))
    local, table = bufs
    local.numpy()[:] = words
    all_gather_host(local, table, cg, what)
    return table.numpy().copy()


@torch._dynamo.disable  # never traced into a graph (module docstring)
def all_gather_object(obj: Any, cg: CommGroup, what: str = "all_gather_object") -> list[Any]:
    """Every rank's picklable ``obj`` in group order, on the host group (the slow path of an agreement: errors).

    Bounded like every other wait here (:func:`set_timeout`, else the process group's timeout): the pickled sizes
    travel in one :func:`gather_words`, then the bytes, zero-padded to the longest, in one all-gather on the host
    group. ``torch.distributed.all_gather_object`` has no ``async_op`` and so no bound but the group's timeout; a
    peer that never joins makes this rank raise :class:`HaloCommError` naming it within the bound instead. ``what``
    names the caller in that error.
    """
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = _gather_words((len(payload),), cg, what)[:, 0]
    width = max(int(sizes.max()), 1)
    local = torch.zeros(width, dtype=torch.uint8)
    local.numpy()[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    table = torch.empty(cg.size, width, dtype=torch.uint8)
    _all_gather_host(local, table, cg, what)
    rows = table.numpy()
    return [pickle.loads(rows[r, :int(sizes[r])].tobytes()) for r in range(cg.size)]  # copies, as torch's


# Inner names for this module's own calls (the counters of halo.testing.HostWorkCounter patch the public names:
# one all_gather_object counts as one agreement, not two).
_gather_words = gather_words
_all_gather_host = all_gather_host
