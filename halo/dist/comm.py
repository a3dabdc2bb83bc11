"""Talking to peers: the groups halo uses, their host side groups, bounded waits, and the error a failed wait gives.

``CommGroup`` is a process group as halo sees it: its size, this rank's position, the members' global ranks, and a
*host* group over the same members on which ranks agree on metadata (shapes, arguments) with CPU tensors, so an
agreement never syncs a GPU. With gloo (or a ``"cpu:gloo,cuda:nccl"`` group) the host group is the group itself;
with NCCL alone it is a gloo group over the same ranks *in the same order*, made eagerly where the device group is
made (:class:`halo.DomainMesh`, :func:`new_group`, the ``halo.dist.groups`` initializers): every rank of the world creates
every host group, in one order, in the same collective call that creates the device groups. Never lazily by the
members alone: torch names a group made with ``use_local_synchronization`` from the number of groups this process
made before, so members that made different numbers of groups would meet on different store prefixes and hang.
A group spanning the whole world gets its host group on first use (all its members are every rank, so that first
use is collective); any other NCCL-only group halo was not told about raises a clear error on every member.

Every wait is bounded (invariant 4) and every message is posted by :mod:`halo.dist.transport` (the one transport:
``alloc`` / ``post`` / ``wait`` and the bounded collectives); the names of it that callers used from here
(:func:`set_timeout`, :func:`wait_all`, :func:`all_reduce`, :func:`gather_words`, :func:`all_gather_object`, ...)
stay here as aliases. This module's state (the groups as halo sees them, their ids, host groups, the unsharded
flag) is the context's ``"comm"`` slot (:mod:`halo.context`): ``halo.context.reset()`` forgets it, so a group made
with an NCCL-only backend before a reset gets its host group again only by being made again (a gloo or
``"cpu:gloo,cuda:nccl"`` group needs none). Group ids are never reused within a context; an id of another context
(or one whose group is gone) fails loudly.

The default group (no ``group=``) is the default manager's domain group: :func:`halo.initialize_domain_parallel`
(:mod:`halo.dist.mesh`, one tier up) sets it here when it makes the manager (:func:`set_default_group`, data of the
context like the timeout), and forgets it with the manager; this module never imports the mesh.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import context
from . import transport
from .transport import (
    HaloCollectiveMismatch,
    HaloCommError,
    abandoned,
    all_gather_host,
    all_gather_object,
    all_reduce,
    comm_error,
    gather_words,
    get_timeout,
    keep_alive,
    set_timeout,
    wait_all,
)

__all__ = [
    "CommGroup",
    "HAS_SORT_RANKS",
    "abandoned",
    "HaloCollectiveMismatch",
    "HaloCommError",
    "all_gather_host",
    "all_gather_object",
    "all_reduce",
    "comm_error",
    "comm_group",
    "gather_words",
    "get_timeout",
    "group_by_id",
    "group_id",
    "id_base",
    "carries_cpu",
    "create_host_groups",
    "first_ops",
    "keep_alive",
    "new_group",
    "set_default_group",
    "set_timeout",
    "unsharded",
    "unsharded_default",
    "wait_all",
]


def id_base() -> int:
    """Where a context's ids start: random (``os.urandom``, not a seeded generator) times 2**32, so an id kept past
    a ``halo.context.reset()`` (in a compiled graph, a plan) names nothing in the next context, never another."""
    return int.from_bytes(os.urandom(3), "little") << 32


@dataclasses.dataclass
class _CommState:
    """The groups' part of the context (module docstring)."""

    groups: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)  # pg -> CG
    hosts: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)  # pg -> gloo
    world_host: list = dataclasses.field(default_factory=list)  # a world-spanning group's host, made on first use
    ids: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)  # CG -> id
    by_id: dict = dataclasses.field(default_factory=dict)  # id -> weakref to its CommGroup
    next_id: int = dataclasses.field(default_factory=id_base)
    unsharded: int = 0  # > 0 inside ``unsharded()``: the default group is this process alone
    default_group: Any = None  # the default manager's domain group (set_default_group), None: no manager


def _state() -> _CommState:
    return context.state("comm", _CommState)


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

#: Whether this torch's ``torch.distributed.new_group`` takes ``sort_ranks=`` (torch >= 2.12).
HAS_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


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
    if not HAS_SORT_RANKS:
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
    me, hosts = dist.get_rank(), _state().hosts
    for block in blocks:
        host = _new_host(block)
        if group is not None and me in block:
            hosts[group] = host


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """``torch.distributed.new_group(ranks, **kwargs)`` and, where the job's backend needs one (NCCL alone), its gloo
    host group, made in the same call: call it on every rank, in the same order, as torch's ``new_group``. Use it for
    an NCCL group you hand to halo yourself (a mesh's groups are made with their host groups already).

    ``sort_ranks=False`` (group rank ``i`` = ``ranks[i]``) needs torch >= 2.12; on torch 2.11 it is dropped where
    ``ranks`` ascend anyway, and refused (the same error on every rank, before any collective) where they do not."""
    if kwargs.get("sort_ranks", True) is False and not HAS_SORT_RANKS:
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
            _state().hosts[group] = host
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
    device = torch.device("cuda", torch.cuda.current_device())
    seen: set[int] = set()
    for group in groups:
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            transport.first_op(group, device)


def _host_of(cg: CommGroup) -> Any:
    if carries_cpu(dist.get_backend(cg.group)):
        return cg.group
    state = _state()
    host = state.hosts.get(cg.group)
    if host is not None:
        return host
    if cg.size == dist.get_world_size():
        # Every rank is a member: this first use is collective over the world, like the creation of a group.
        world = state.world_host
        if not world or dist.get_process_group_ranks(world[0]) != list(cg.ranks):
            world[:] = [_new_host(cg.ranks)]
            first_ops([cg.group])
        return world[0]
    raise ValueError(
        f"halo: the {dist.get_backend(cg.group)} group of global ranks {list(cg.ranks)} has no gloo host group for "
        f"halo's agreements (CPU tensors). Make it with halo.dist.comm.new_group(ranks) instead of "
        f"torch.distributed.new_group (on every rank, in the same order), use the groups of a halo.DomainMesh, or "
        f"initialise with init_process_group(backend=\"cpu:gloo,cuda:nccl\"), whose groups carry CPU tensors")


_SINGLE = CommGroup(None, 1, 0, (0,))


def group_id(cg: CommGroup) -> int:
    """A small int naming ``cg`` in this context (what a compiled graph or a custom op can carry). Ids are never
    reused within a context; the table holds the groups weakly (bounded by the groups alive)."""
    state = _state()
    gid = state.ids.get(cg)
    if gid is None:
        gid = state.ids[cg] = state.next_id
        state.next_id += 1
        state.by_id[gid] = weakref.ref(cg, lambda _, gid=gid, by_id=state.by_id: by_id.pop(gid, None))
    return gid


def group_by_id(gid: int) -> CommGroup:
    """The :class:`CommGroup` of :func:`group_id` ``gid``; a clear error for an id this context never gave (made
    before ``halo.context.reset()`` or in another context) or whose group is gone."""
    ref = _state().by_id.get(gid)
    cg = ref() if ref is not None else None
    if cg is None:
        raise LookupError(f"halo: group id {gid} names no group of this context (made before halo.context.reset(), "
                          f"in another halo.context.use() block, or its group was destroyed): plan again")
    return cg


def set_default_group(group: Any | None) -> None:
    """Make ``group`` the default group of the context in use (what ``group=None`` means), or forget it (``None``):
    called by :func:`halo.initialize_domain_parallel` and :func:`halo.destroy_domain_parallel` with the manager's
    domain group."""
    _state().default_group = group


def _resolve_group(group: Any | None) -> Any:
    if group is not None:
        return group
    default = _state().default_group
    if default is not None:
        return default
    raise RuntimeError("no process group given and no domain-parallel manager initialised: pass group=..., or call "
                       "halo.initialize_domain_parallel(world_size, domain_parallel_size) on every rank first")


def unsharded_default() -> bool:
    """Whether halo's default group is this process alone: no torch.distributed, or inside :func:`unsharded`."""
    return _state().unsharded > 0 or not (dist.is_available() and dist.is_initialized())


class unsharded:  # noqa: N801 - a context manager, named like one
    """``with halo.dist.comm.unsharded():`` halo ops called without ``group=`` act on this process alone (the whole
    field): how :func:`halo.check_equivalence` runs the unsharded reference of a model that calls halo's functions
    (``halo.nn.pad_like``, ``halo.random.dropout``) in its forward, in a process of a distributed job."""

    def __enter__(self) -> unsharded:
        self._state = _state()  # the context entered in: exit undoes it there
        self._state.unsharded += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._state.unsharded -= 1


def comm_group(group: Any | None = None) -> CommGroup:
    """``group`` as a :class:`CommGroup` (default: the manager's domain group; no torch.distributed: one rank)."""
    if group is None and unsharded_default():
        return _SINGLE
    group = _resolve_group(group)
    groups = _state().groups
    cg = groups.get(group)
    if cg is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of the group it communicates over (global ranks "
                             f"{list(ranks)}); pass each rank its own domain group")
        cg = CommGroup(group, len(ranks), ranks.index(me), ranks)
        groups[group] = cg
    return cg
