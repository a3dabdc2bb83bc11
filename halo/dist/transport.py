"""One transport: every message halo sends, every collective it runs and every wait on them goes through here.

The interface is small on purpose, so that a second way of moving bytes can be added without touching a layer:

``alloc(shape, like, pool)``      a message buffer (reused from an exchanger's :class:`BufferPool` when free)
``post(cg, what, send, ...)``     a batch of sends and receives to peers of a group (group indices); a :class:`Posted`
``wait(posted)``                  bounded by :func:`set_timeout` (else the group's timeout), naming the peers that
                                  did not answer (:class:`HaloCommError`), the buffers kept alive on failure
``all_reduce`` ``all_gather`` ``gather`` ``scatter`` ``reduce_scatter`` ``broadcast``
                                  the device collectives (one bounded entry each)
``all_gather_host`` ``gather_words`` ``all_gather_object`` ``broadcast_host``
                                  the bounded host collectives of agreements (CPU tensors on the group's host group)

Point-to-point (``torch.distributed.batch_isend_irecv``) is today's only implementation. Nothing else in halo calls
torch.distributed's communication functions or waits on a work handle (``tests/test_transport.py`` scans for it);
the groups themselves (:class:`halo.dist.comm.CommGroup`, host groups, ids) live in :mod:`halo.dist.comm`, one tier up: this
module sees a group only through the attributes it reads (``group``, ``host``, ``size``, ``index``, ``ranks``).
Its state (the timeout, the buffers given up on, the host staging buffers) is the context's ``"transport"`` slot.

Under ``torch.compile`` every function here that posts or waits is :func:`eager_only` (``torch._dynamo.disable``d
while dynamo traces, a direct call in eager mode): dynamo never traces
a collective into a graph (where nothing would order it against halo's communicating custom ops, see
:func:`halo.exchange.order_after`). A Python path that reaches one inside a compiled region is a graph break there,
so it runs eagerly in program order on every rank.

A one-sided transport later (torch ``SymmetricMemory``, ``torch.distributed._symmetric_memory``; NCCL/CUDA peers
within one node, NVLink): ``alloc`` returns a slice of a symmetric buffer, made by one rendezvous per (group, dtype,
size class) and reused across steps, so every peer can address every other's receive buffer; ``post`` writes the
boundary rows straight into the peer's receive buffer (a copy kernel or ``put`` into the peer's mapping) and then
sets a signal word in the peer's signal pad (one per message, a step counter so that a stale signal is never taken
for a fresh one); ``wait`` waits on the signals the peers set for this rank (``wait_signal``, stream-ordered; a host
poll of the pad bounded by the same timeout names the peers whose signal is missing). The choice is made per group
in ``post`` (the group's backend and whether every peer is on this node), so the exchange plans, the exchanger
ids, the pack/unpack kernels, compute-then-patch and the exact adjoint (the reverse messages of the same plan,
posted and waited the same way) stay as they are, and no layer changes. Across nodes, on gloo, or while a CUDA
graph is captured without symmetric memory, point-to-point stays.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle
import re
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import context


def eager_only(fn: Any) -> Any:
    """``fn`` never traced by dynamo (``torch._dynamo.disable``: a graph break where a compiled region reaches it, so it
    runs eagerly in program order), at no cost in eager mode: dynamo's disable wrapper costs ~1.5 us a call on a CPU
    (it sets and restores the frame callback), which a steady step pays for every post, wait and mark; this wrapper
    calls ``fn`` directly unless dynamo is tracing, where it hands over to the disabled form."""
    import functools

    disabled = torch._dynamo.disable(fn)
    compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    call.__wrapped_disabled__ = disabled  # type: ignore[attr-defined]
    return call

__all__ = [
    "ABANDONED_CAP",
    "BufferPool",
    "HOST_BUFFERS_CAP",
    "HaloCollectiveMismatch",
    "HaloCommError",
    "Posted",
    "abandoned",
    "all_gather",
    "all_gather_host",
    "all_gather_object",
    "all_reduce",
    "alloc",
    "broadcast",
    "broadcast_host",
    "capturing",
    "eager_only",
    "comm_error",
    "first_op",
    "gather",
    "gather_words",
    "get_timeout",
    "keep_alive",
    "post",
    "post_rows",
    "reduce_scatter",
    "scatter",
    "set_timeout",
    "start_all_reduce",
    "wait",
    "wait_all",
    "wait_event",
]

#: Buffers of messages given up on kept alive (a late peer may still write into them), at most this many.
ABANDONED_CAP = 64
#: Host staging buffers of :func:`gather_words` kept, one pair per (group, width), least recently used dropped.
HOST_BUFFERS_CAP = 64


class HaloCommError(RuntimeError):
    """A message of an exchange (or of an agreement or reduction) failed or timed out: a peer died, stalls, or
    called a different collective. The process group is not usable afterwards; tear it down."""


class HaloCollectiveMismatch(ValueError):
    """The ranks of a group reached different host collectives at the same point of their programs (their code
    took different paths: typically a branch on a shard's own shape, ``x.shape``, that differs between ranks).
    Raised alike on every rank of the group; the group is still usable (nothing was left half-sent)."""



@dataclasses.dataclass
class _TransportState:
    """The transport's part of the context: the wait bound, buffers given up on, host staging buffers."""

    timeout: float | None = None
    abandoned: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=ABANDONED_CAP))
    host_buffers: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)


def _state() -> _TransportState:
    return context.state("transport", _TransportState)


# -- the wait bound ------------------------------------------------------------------------------------------------

def set_timeout(seconds: float | timedelta | None) -> float | None:
    """Bound every wait of halo's communication to ``seconds``; ``None`` (default): the process group's timeout.

    Applies to agreements, halo messages (forward and backward) and the reductions inside layers and losses; all
    messages of one operation share the deadline. Past it this rank raises :class:`HaloCommError` naming this
    rank, the peers still pending and the time waited. Per process (and per :mod:`halo.context`): call it on every
    rank. Returns the previous value.

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
    state = _state()
    previous, state.timeout = state.timeout, seconds
    return previous


def get_timeout() -> float | None:
    """The timeout set by :func:`set_timeout` (``None``: the process group's)."""
    return _state().timeout


def keep_alive(obj: Any) -> None:
    """Keep ``obj`` (buffers of a message given up on) alive: a late peer may still write into it (the last
    :data:`ABANDONED_CAP` of them; a process with that many failed messages has torn its groups down long ago)."""
    _state().abandoned.append(obj)


def abandoned() -> int:
    """How many message buffers were given up on (kept alive) in this context: 0 in a healthy run."""
    return len(_state().abandoned)


def capturing(device: torch.device | None = None) -> bool:
    """Whether the current CUDA stream (of ``device``; ``None``: this thread's) is capturing a graph."""
    if device is not None:
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# -- buffers -------------------------------------------------------------------------------------------------------

_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _free(t: torch.Tensor) -> bool:
    """Nothing but the pool holds ``t`` or a view or alias of it (autograd's saved tensors included)."""
    if _STORAGE_USE_COUNT is None:
        return False
    storage = t.untyped_storage()
    return _STORAGE_USE_COUNT(storage._cdata) <= 2  # the pool's tensor and ``storage`` itself


def _stream_key(device: torch.device) -> int:
    """The current stream of ``device`` (0 off CUDA): buffers are handed out again only on the stream they were."""
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


class BufferPool:
    """Buffers by (shape, dtype, device, memory format, stream), handed out again once nothing else holds them.

    ``get`` hands out an alias (``detach``: a tensor of its own on the same storage), so every holder of a buffer,
    the caller's variables included, counts on the storage; a buffer that an autograd graph saved, a caller kept,
    or a message still uses is *not* free, and reuse can never overwrite a live tensor. Without torch's use-count
    API every call allocates.

    CUDA graphs and streams. Python references say nothing about a captured graph, which replays its writes into
    the buffers it captured whoever holds them now: so while the current stream is capturing, ``get`` allocates
    (from the graph's private memory pool: the graph owns the memory for its life, no later call is handed it, and
    dropping an exchanger or its pool cannot free memory a graph still writes) and the pool neither hands out nor
    keeps anything. Per-module graphs (``torch.cuda.make_graphed_callables``) therefore never share a pooled buffer.
    A buffer is reused only on the stream it was handed out on, where the reuse is ordered after every earlier use
    of it; an output consumed on *another* stream must be ordered back before the next halo call on the first
    stream (``torch.cuda.current_stream().wait_stream(other)``), as for any reused buffer.
    """

    def __init__(self, per_key: int = 4) -> None:
        self.per_key = per_key
        self._pools: dict[tuple, list[torch.Tensor]] = {}

    def get(self, shape: Sequence[int], like: torch.Tensor, fmt: torch.memory_format = torch.contiguous_format
            ) -> torch.Tensor:
        device = like.device
        if capturing(device):
            return torch.empty(tuple(shape), dtype=like.dtype, device=device, memory_format=fmt)
        key = (tuple(shape), like.dtype, device, fmt, _stream_key(device))
        pool = self._pools.setdefault(key, [])
        for buf in pool:
            if _free(buf):
                return buf.detach()
        buf = torch.empty(key[0], dtype=like.dtype, device=device, memory_format=fmt)
        if len(pool) < self.per_key:
            pool.append(buf)
        return buf.detach()

    def nbytes(self) -> int:
        """The bytes this pool keeps allocated (free or handed out): what it holds back from the caching allocator.
        Message strips only (:meth:`halo.exchange.exchanger.Exchanger.finish` never pools an activation), so after a step it
        is a few halo rows per shape, not the activations (``tests/test_pool_bytes.py``)."""
        return sum(buf.untyped_storage().nbytes() for bufs in self._pools.values() for buf in bufs)


def alloc(shape: Sequence[int], like: torch.Tensor, pool: BufferPool | None = None,
          fmt: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """A message buffer of ``shape`` with ``like``'s dtype and device: from ``pool`` (an exchanger's, reused once
    free) or fresh. The one place a one-sided transport would hand out symmetric memory instead (module docstring).
    """
    if pool is not None:
        return pool.get(shape, like, fmt)
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device, memory_format=fmt)


def _host_buffers(cg: Any, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (local, table) int64 host buffers of :func:`gather_words` for ``cg`` and ``width``: made once, kept in
    an LRU of :data:`HOST_BUFFERS_CAP` (a dropped pair is made again: scratch, never aliased across shapes)."""
    table = _state().host_buffers
    key = (id(cg), cg.size, width)
    bufs = table.get(key)
    if bufs is None:
        bufs = table[key] = (torch.zeros(width, dtype=torch.int64), torch.zeros(cg.size, width, dtype=torch.int64))
        if len(table) > HOST_BUFFERS_CAP:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return bufs


# -- errors --------------------------------------------------------------------------------------------------------

def _label(label: Any) -> str:
    """A wait's peer description: a string, a ``(verb, global rank)`` pair, or a tuple of pairs (one request for
    several messages). Made into text only when an error is raised."""
    if isinstance(label, str):
        return label
    if len(label) == 2 and isinstance(label[0], str):
        if isinstance(label[1], int):
            return f"{label[0]} global rank {label[1]}"
        return f"{label[0]} global ranks {_others(label[1][0])}"
    return " and ".join(_label(part) for part in label)


def _others(cg: Any) -> str:
    return str([g for g in cg.ranks if g != cg.ranks[cg.index]])


def comm_error(labels: Sequence[Any], i: int, cg: Any, what: str, began: float, posted: float,
               exc: BaseException | None) -> HaloCommError:
    """The error for a wait on ``labels[i]`` that failed (``exc``) or ran out of time."""
    labels = [_label(label) for label in labels]
    limit = _state().timeout
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


# -- point-to-point: post and wait ---------------------------------------------------------------------------------

class Posted:
    """Messages in flight (:func:`post`): their requests, who each talks to, and the buffers to keep alive if they
    are given up on. :func:`wait` finishes them (and drops the requests); waiting twice is a no-op."""

    __slots__ = ("cg", "keep", "labels", "posted", "what", "works")

    def __init__(self, works: Sequence[Any], labels: Sequence[Any], cg: Any, what: str, keep: Any) -> None:
        self.works, self.labels, self.cg, self.what, self.keep = works, labels, cg, what, keep
        self.posted = time.monotonic()

    def __bool__(self) -> bool:
        return bool(self.works)


@eager_only  # never traced into a compiled graph, unordered (module docstring): a graph break
def post(cg: Any, what: str, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
         *, host: bool = False, keep: Any = None) -> Posted:
    """Post one batch: each ``(peer, tensor)`` of ``sends`` to that peer, each of ``recvs`` from it (peers are group
    indices, never this rank; empty tensors are skipped), on ``cg``'s group (its host group where ``host``). A failed
    post raises :class:`HaloCommError` naming the peers; ``keep``: the buffers (default: the tensors)."""
    return _post(cg, what, sends, recvs, host, keep)


def _post(cg: Any, what: str, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
          host: bool, keep: Any) -> Posted:
    group = cg.host if host else cg.group
    ops, labels = [], []
    for peer, buf in sends:
        if buf.numel():
            ops.append(dist.P2POp(dist.isend, buf, group=group, group_peer=peer))
            labels.append(("send to", cg.ranks[peer]))
    for peer, buf in recvs:
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=peer))
            labels.append(("recv from", cg.ranks[peer]))
    keep = (sends, recvs) if keep is None else keep
    if not ops:
        return Posted((), (), cg, what, keep)
    posted = time.monotonic()
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as exc:  # noqa: BLE001 - a peer already gone can fail the post itself
        keep_alive(keep)
        raise comm_error([tuple(labels)], 0, cg, f"{what} (posting)", posted, posted, exc) from exc
    if len(works) != len(ops):  # coalesced (NCCL): one request for the whole batch
        labels = [tuple(labels)] * len(works)
    return Posted(works, labels, cg, what, keep)


@eager_only  # never traced into a compiled graph (module docstring)
def post_rows(cg: Any, what: str, send: torch.Tensor | None, send_list: Sequence[tuple[int, int]],
              recv: torch.Tensor | None, recv_list: Sequence[tuple[int, int]]) -> Posted:
    """:func:`post` of row slices: consecutive slices of ``send`` to the ``(peer, rows)`` of ``send_list``, into
    consecutive slices of ``recv`` from those of ``recv_list`` (a message to this rank itself is copied inline)."""
    me = cg.index
    sends, recvs, own = [], [], None
    at = 0
    for peer, n in send_list:
        buf = send[at:at + n]
        at += n
        if peer == me:
            own = buf
        elif n:
            sends.append((peer, buf))
    at = 0
    for peer, n in recv_list:
        buf = recv[at:at + n]
        at += n
        if peer == me:
            buf.copy_(own)
        elif n:
            recvs.append((peer, buf))
    if not sends and not recvs:
        return Posted((), (), cg, what, None)
    return _post(cg, what, sends, recvs, False, (send, recv))  # (not the wrapped post: ~1 us a call saved)


def wait(posted: Posted, what: str | None = None) -> None:
    """Finish :func:`post`'s messages under one deadline (``what``: the operation named in an error, default the
    post's); then the requests are dropped. A no-op when nothing was posted (:func:`wait_all`, which waits, is
    never traced by dynamo)."""
    if posted.works:
        wait_all(posted.works, posted.labels, posted.cg, posted.what if what is None else what, posted.posted,
                 posted.keep)
        posted.works = ()


@eager_only  # a wait never enters a compiled graph (module docstring)
def wait_all(works: Sequence[Any], labels: Sequence[Any], cg: Any, what: str, posted: float, keep: Any) -> None:
    """Wait for ``works`` under one deadline; turn a failure or timeout into :class:`HaloCommError`.

    ``labels[i]``: who work ``i`` talks to ("recv from global rank 3", or ``("recv from", 3)``: text is made only on
    the error path). ``keep``: the buffers, kept alive on failure so that a late write from a peer cannot land in
    freed memory.
    """
    limit = _state().timeout
    if limit is not None and capturing():
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


# -- collectives: one bounded entry per kind -----------------------------------------------------------------------

def _bounded(work: Any, cg: Any, what: str, keep: Any, label: str | None = None) -> None:
    """Wait on one collective's request, naming the group's other ranks if it fails or runs out of time."""
    posted = time.monotonic()
    wait_all([work], [label or f"the {what} with global ranks {_others(cg)}"], cg, what, posted, keep)


@eager_only  # never traced into a graph, unordered (module docstring): a graph break
def all_reduce(t: torch.Tensor, cg: Any, what: str, op: Any = None) -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``cg`` (``op`` default SUM) under the bounded wait; returns ``t``."""
    posted = time.monotonic()
    wire = _wire(t)
    work = dist.all_reduce(wire, op=op if op is not None else dist.ReduceOp.SUM, group=cg.group, async_op=True)
    wait_all([work], [("the all-reduce with", (cg,))], cg, what, posted, wire)
    return _back(t, wire)


def _wire(t: Any) -> Any:
    """``t`` in the layout every rank sends: row-major contiguous. A collective reduces or copies the tensors'
    memory element by element, so two ranks holding one logical tensor in different layouts (a channels-last part
    on one rank, a contiguous one on another: an empty share of a global pool) would mix elements silently."""
    return t.contiguous() if isinstance(t, torch.Tensor) and not t.is_contiguous() else t


def _wires(ts: Any) -> Any:
    return None if ts is None else [_wire(t) for t in ts]


def _back(t: Any, wire: Any) -> Any:
    """Write what a collective left in ``wire`` (the contiguous copy of ``t``) back into ``t``; returns ``t``."""
    if wire is not t:
        t.copy_(wire)
    return t


@eager_only  # never traced into a graph, unordered (module docstring): a graph break
def start_all_reduce(t: torch.Tensor, cg: Any, what: str, op: Any = None) -> Posted:
    """Start an in-place all-reduce of ``t`` over ``cg`` and return it as a :class:`Posted` for :func:`wait`, later
    (the replicated-state check reads its result a few steps on: nothing waits for it now). On a CUDA tensor the
    current stream is ordered after the collective (``Work.wait()`` without a timeout: a stream wait, the host is
    not blocked), so work queued next on it (a copy to pinned host memory) sees the reduced values."""
    posted = time.monotonic()
    work = dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=cg.group, async_op=True)
    if t.device.type == "cuda":
        work.wait()  # stream-ordered on NCCL (no timeout: the host goes on)
    result = Posted([work], [f"the all-reduce with global ranks {_others(cg)}"], cg, what, t)
    result.posted = posted
    return result


def wait_event(event: Any, cg: Any, what: str, posted: float, keep: Any) -> None:
    """Wait on the host for a CUDA event recorded after a collective (its result copied to pinned host memory),
    bounded as every wait here: polled up to :func:`set_timeout`, else ``event.synchronize()`` (the process group's
    watchdog catches a dead peer). An event recorded steps ago has long completed: no wait in practice."""
    limit = _state().timeout
    if limit is None:
        event.synchronize()
        return
    began = time.monotonic()
    while not event.query():
        if time.monotonic() - began > limit:
            keep_alive(keep)
            raise comm_error([f"the device work of the all-reduce with global ranks {_others(cg)}"], 0, cg, what,
                             began, posted, None)
        time.sleep(1e-4)


@eager_only  # never traced into a graph (module docstring)
def all_gather(chunks: list[torch.Tensor], t: torch.Tensor, cg: Any, what: str, *, host: bool = False) -> None:
    """Every rank's ``t`` into ``chunks`` (one per rank, group order) on ``cg``'s group (host group where
    ``host``), bounded."""
    wires = _wires(chunks)
    work = dist.all_gather(wires, _wire(t), group=cg.host if host else cg.group, async_op=True)
    _bounded(work, cg, what, (wires, t))
    for c, w in zip(chunks, wires, strict=True):
        _back(c, w)


@eager_only  # never traced into a graph (module docstring)
def gather(t: torch.Tensor, chunks: list[torch.Tensor] | None, cg: Any, what: str, dst: int) -> None:
    """Every rank's ``t`` into ``chunks`` on group rank ``dst`` (``None`` elsewhere), bounded."""
    wires = _wires(chunks)
    work = dist.gather(_wire(t), wires, group=cg.group, group_dst=dst, async_op=True)
    _bounded(work, cg, what, (t, wires))
    for c, w in zip(chunks or (), wires or (), strict=True):
        _back(c, w)


@eager_only  # never traced into a graph (module docstring)
def scatter(t: torch.Tensor, chunks: list[torch.Tensor] | None, cg: Any, what: str, src: int) -> None:
    """Group rank ``src``'s ``chunks[r]`` into ``t`` on rank ``r`` (``chunks`` ``None`` off ``src``), bounded."""
    wire = _wire(t)
    work = dist.scatter(wire, _wires(chunks), group=cg.group, group_src=src, async_op=True)
    _bounded(work, cg, what, (chunks, wire))
    _back(t, wire)


@eager_only  # never traced into a graph (module docstring)
def reduce_scatter(t: torch.Tensor, chunks: list[torch.Tensor], cg: Any, what: str, op: Any = None) -> None:
    """The reduction over ranks of ``chunks[r]`` into ``t`` on rank ``r`` (``op`` default SUM), bounded."""
    wire = _wire(t)
    work = dist.reduce_scatter(wire, _wires(chunks), op=op if op is not None else dist.ReduceOp.SUM,
                               group=cg.group, async_op=True)
    _bounded(work, cg, what, (chunks, wire))
    _back(t, wire)


@eager_only  # never traced into a graph (module docstring)
def broadcast(t: torch.Tensor, cg: Any, what: str, src: int, *, host: bool = False) -> torch.Tensor:
    """Group rank ``src``'s ``t`` into ``t`` on every rank (``host``: on the host group, CPU tensors), bounded."""
    wire = _wire(t)
    work = dist.broadcast(wire, group=cg.host if host else cg.group, group_src=src, async_op=True)
    _bounded(work, cg, what, wire)
    return _back(t, wire)


@eager_only  # never traced into a graph (module docstring)
def broadcast_host(t: torch.Tensor, cg: Any, what: str, src: int) -> torch.Tensor:
    """:func:`broadcast` of a CPU tensor on the host group (an agreement's metadata)."""
    return broadcast(t, cg, what, src, host=True)


@eager_only  # never traced into a graph (module docstring)
def first_op(group: Any, device: torch.device) -> None:
    """One tiny all-reduce on a raw process group, unbounded (the first NCCL op of a new group, which every member
    takes: :func:`halo.dist.comm.first_ops`)."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


# -- host collectives: the agreements' ---------------------------------------------------------------------------

@eager_only  # never traced into a graph (module docstring)
def all_gather_host(local: torch.Tensor, table: torch.Tensor, cg: Any, what: str) -> torch.Tensor:
    """Every rank's CPU tensor ``local`` into the rows of ``table`` (``(size, *local.shape)``), on the host group."""
    posted = time.monotonic()
    work = dist.all_gather(list(table.unbind(0)), local, group=cg.host, async_op=True)
    wait_all([work], [f"the agreement with global ranks {_others(cg)}"], cg, what, posted, (local, table))
    return table


#: A host gather's frame: every :func:`gather_words` call sends exactly this many int64 words first (a header of 3:
#: :data:`_FRAME`, the call's kind, its length; then up to ``FRAME_WORDS - 3`` words of its own, zero-padded), so
#: ranks that reached different host collectives (a branch on a shard's own shape) exchange equal byte counts and
#: each sees the others' headers: the same :class:`HaloCollectiveMismatch` on every rank, not gloo aborting the
#: process on a size mismatch (or a message misread). Longer rows follow in a second gather once every header agrees.
FRAME_WORDS = 48
_FRAME = 0x48414C4F  # "HALO"
#: the kinds of host gathers (the frame's second word)
WORDS, OBJECT = 1, 2


def _mismatch(table: np.ndarray, cg: Any, what: str) -> HaloCollectiveMismatch:
    kinds = {WORDS: "an agreement", OBJECT: "an exchange of objects"}
    calls = []
    for f, k, n in table[:, :3]:
        if f != _FRAME:
            calls.append("a collective not halo's")
        else:
            calls.append(kinds.get(int(k), "another collective") + (f" of {int(n)} words" if int(k) == WORDS else ""))
    ranks = ", ".join(f"group rank {r}: {c}" for r, c in enumerate(calls))
    return HaloCollectiveMismatch(
        f"{what}: the ranks of the domain group reached different collectives at this point ({ranks}): their "
        f"programs took different paths. A forward that branches on a shard's own size (x.shape, x.size()) "
        f"does this: each rank sees its own rows, not the field's. Take the decision from what is the same on "
        f"every rank (the global size: the model's input size, or a size passed in)")


@eager_only  # never traced into a graph (module docstring)
def gather_words(words: Sequence[int], cg: Any, what: str, kind: int = WORDS) -> np.ndarray:
    """Every rank's row of ``len(words)`` int64 words, in group order (an array ``(size, len(words))``): one
    all-gather on the host group into buffers made once per (group, width), written and read through numpy (no
    tensor built from Python data, nothing a device waits for). Agreements on one group run one at a time.

    Framed (:data:`FRAME_WORDS`): every call sends the same byte count first, so ranks in different calls raise
    :class:`HaloCollectiveMismatch` alike instead of crashing the process group; a row longer than the frame
    takes a second gather, after every rank's header said the same length."""
    n = len(words)
    body = FRAME_WORDS - 3
    local, table = _host_buffers(cg, FRAME_WORDS)
    frame = local.numpy()
    frame[:3] = (_FRAME, kind, n)
    frame[3:3 + min(n, body)] = words[:body]
    frame[3 + min(n, body):] = 0
    _all_gather_host(local, table, cg, what)
    rows = table.numpy()
    if not ((rows[:, 0] == _FRAME) & (rows[:, 1] == kind) & (rows[:, 2] == n)).all():
        raise _mismatch(rows, cg, what)
    if n <= body:
        return rows[:, 3:3 + n].copy()
    local, table = _host_buffers(cg, n)
    local.numpy()[:] = words
    _all_gather_host(local, table, cg, what)
    return table.numpy().copy()


@eager_only  # never traced into a graph (module docstring)
def all_gather_object(obj: Any, cg: Any, what: str = "all_gather_object") -> list[Any]:
    """Every rank's picklable ``obj`` in group order, on the host group (the slow path of an agreement: errors).

    Bounded like every other wait here (:func:`set_timeout`, else the process group's timeout): the pickled sizes
    travel in one :func:`gather_words`, then the bytes, zero-padded to the longest, in one all-gather on the host
    group. ``torch.distributed.all_gather_object`` has no ``async_op`` and so no bound but the group's timeout; a
    peer that never joins makes this rank raise :class:`HaloCommError` naming it within the bound instead. ``what``
    names the caller in that error.
    """
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = _gather_words((len(payload),), cg, what, OBJECT)[:, 0]
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
