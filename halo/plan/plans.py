"""Plans learned once: every rank's extents, agreed on once per *epoch* and recorded, so a steady step only sends
the messages the math needs (invariant 7).

Why epochs. A layer needs every rank's extent along H, but a rank sees only its own, and its own does not name the
global one (45 rows over 2 ranks is 23 + 22, 44 is 22 + 22: rank 1 cannot tell them apart). So the ranks must have
agreed on something that fixes the global extents, and a call may reuse what it learned only under that same
agreement. An epoch is the name of such an agreement, identical in meaning on every rank:

==========================================  ==================================================================
what starts an epoch                        what every rank agrees on, and its cost
==========================================  ==================================================================
a converted model's forward (its root)      every rank's input shapes: one small all-gather of host data (a
                                            digest of each rank's inputs and its share of the grid:
                                            :mod:`halo.plan.entry`) at the first call, every 8th and a call
                                            whose inputs changed on this rank; none with a declared grid
``shard`` / ``scatter`` of a whole field    the field's global shape, which every rank already holds (each call
                                            still agrees on its arguments and sample: one host all-gather)
==========================================  ==================================================================

Which epoch a call belongs to: inside a converted model's forward, the model's (a model computes the same shapes
from the same input shapes); outside, the epoch of its input tensor when halo made that tensor (a ``shard`` output,
a converted model's output, or the output of a halo layer applied to such a tensor); else none.

A call without an epoch agrees every time, except a layer's (a call with a site, e.g. ``DomainConv2d(conv)`` applied
to a plain shard outside a converted model): it agrees when its local shape or arguments differ from those of its
site's last agreement, and reuses that plan otherwise (:func:`_standalone` says why one record per site is safe
where one per local shape is not).

A call with an epoch looks up ``(epoch, site, group, op, its own shape/dtype/grad, its arguments)``; the first time,
every rank misses together (the key is new on all of them), agrees on its metadata (:func:`halo.plan.agree.agree`) and
records the plan made from the agreed extents. Afterwards the call costs a dict lookup. If every rank hits, every
rank's record came from the same agreement and its local shape is the one recorded, so the recorded extents are
the current ones: a hit can never be stale. A call without an epoch agrees every time (one host all-gather), but
for a layer's (below).

What this assumes, and what happens otherwise: a converted model's inner shapes follow from its input shapes, and
ranks make the same halo calls (SPMD). A program that breaks this (data-dependent shapes inside a model; one rank
taking a path the others do not) makes some ranks miss while others hit: the ones that miss wait for an agreement
the others never join, and every rank raises :class:`halo.HaloCommError` within the timeout. It is never silently
different.

Calls without a site of their own (halo's functions called in a model's ``forward``: ``pad_like``,
``halo_interpolate``, ``halo.random``) are told apart by their place in the forward's sequence of such calls, the
same on every rank. A converted model's first call of each epoch also runs under the guard of functional ops
(:mod:`halo.guard`).

``torch.compile``: the root's entry agreement runs outside the compiled graph (a dynamo-disabled hook), the epoch
is state (of the :mod:`halo.context`) that the graph guards on, and :func:`resolve` runs at trace time
(``assume_constant_result``) and returns a plan of plain ints and tuples baked into the graph; a new epoch recompiles
on every rank alike.

State. What the planner remembers lives in the context in use (:mod:`halo.context`, slot ``"plans"``):
:func:`halo.context.reset` forgets the records, the tensors' epochs and the running model's epoch, and the next call
learns again. Epoch numbers are digests of what was agreed, salted per context (:func:`epoch_number`): no table
grows with the shapes seen, and what outlives a reset (a module's guarded epochs and recorded sites, a compiled
graph guarding on the epoch) never matches a later context's epochs. The records (:data:`MAX_RECORDS` per group,
its oldest first: dropped alike on each of its ranks, never by another group's churn), a converted model's guarded
epochs (:data:`MAX_EPOCHS`, with its modules' sites: :mod:`halo.guard.reroute`) and the plans' device tensors
(:data:`MAX_TENSORS`) are bounded (:func:`set_limits`). What a plan names by number (an exchanger id) is held by its
record (:func:`hold`) and goes with it: a recalled plan never names something this rank dropped on its own.

A call is a :class:`Call` (frozen: its group, op, plan function and arguments, one :class:`AxisSpec` per sharded dim)
and a record's key is ``(epoch, site, this rank's side of the call, the Call)``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import operator
import os
import sys
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import guard_scalar

from .. import context
from ..dist.comm import CommGroup, HaloCommError, comm_group, gather_words, unsharded_default
from ..dist.transport import eager_only
from . import entry
from .agree import Meta, Spec, agree, needs_grad
from .partition import POLE_MODES, split_problem

__all__ = [
    "AxisSpec",
    "Call",
    "Site",
    "carry",
    "device_tensor",
    "enter_root",
    "epoch_of",
    "exit_root",
    "field_epoch",
    "guarded_eager_call",
    "guarded_epochs",
    "hold",
    "mark_whole",
    "resolve",
    "set_limits",
    "set_validation",
    "shard_sizes",
    "tag",
    "whole_source",
]

VALIDATION_MODES = ("first", "always")


#: The most plans recorded *per group* (its ranks; oldest dropped first) and the most device tensors of plans kept
#: (:func:`device_tensor`). Per group, because a record must be dropped on every rank of its group alike: the
#: group's calls are made by all its members in the same order (SPMD), so its records are dropped in the same
#: order on each; a cap over all groups would let one group's churn (a rank's own one-rank model, a group the
#: others are not in) evict another group's records on one rank only, which would then agree alone while its
#: peers recall (a hang, or a collective paired with the wrong one). Defaults of :func:`set_limits`.
MAX_RECORDS = 4096
MAX_TENSORS = 1024
#: The most epochs a converted model remembers having guarded (with the sites its modules compute exactly, which
#: go with them: :mod:`halo.guard.reroute`), least recently called dropped first; an epoch dropped is guarded again at
#: its next call, which learns its sites again. A default of :func:`set_limits`.
MAX_EPOCHS = 256
#: The most agreed keys whose epoch number is remembered (:func:`epoch_number`, a pure function: an evicted key gets
#: the same number again, so eviction never aliases two agreements and never makes one rank re-agree alone).
EPOCH_CACHE = 4096


class _State:
    """What the planner remembers (in the :mod:`halo.context`, slot ``"plans"``): the epoch of the converted model
    whose forward is running (``None`` outside one), the mode, the guard of functional ops active during a model's
    first call of an epoch (``halo.guard``), the epochs of tensors halo made, the recorded plans.

    ``salt`` makes this context's epoch numbers its own: epochs name what the ranks agreed on, and things that
    outlive a :func:`halo.context.reset` (a module's guarded epochs and recorded sites, a compiled graph that guards
    on the epoch) must not take a later context's epoch for theirs. ``token`` does the same for :class:`Site` ids."""

    __slots__ = ("depth", "epoch", "guard", "calls", "validation", "mesh_group", "guard_on", "salt", "token",
                 "sites", "provenance", "whole", "records", "kept", "held", "holding", "compiled", "tensors",
                 "max_records", "max_epochs")

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.depth = 0
        self.validation = "first"
        self.guard: Any = None
        self.calls = 0  # site-less calls so far in this forward (their site: their place in the sequence)
        self.mesh_group: Any = None  # the domain group of a model converted on a latitude x longitude mesh
        self.guard_on = True  # the guard of functional ops on first calls (off only to measure what it costs)
        self.salt = int.from_bytes(os.urandom(8), "little")  # (not torch's or Python's generator: seeds stay put)
        self.token = object()
        self.sites = 0  # site ids issued in this context
        self.provenance = TensorMap()  # tensor halo made -> its epoch
        self.whole = TensorMap()  # tensor whole and the same on every rank of a domain group (a global pool's output)
        self.records: dict = {}  # key -> plan (one lookup on the hot path)
        self.kept: dict[tuple[int, ...], collections.deque] = {}  # a group's ranks -> its records' keys, oldest first
        self.held: dict = {}  # record key -> what its plan holds (:func:`hold`), dropped with the record
        self.holding: list | None = None  # what the plan being made holds (during its ``make``)
        self.compiled: dict = {}  # record key -> what it holds, for a compiled graph that baked its plan in (kept)
        self.tensors: collections.OrderedDict = collections.OrderedDict()
        self.max_records = MAX_RECORDS  # per group (:func:`set_limits`)
        self.max_epochs = MAX_EPOCHS  # per converted model


#: the planner's state in the context in use (a C-level partial: the hot path's one Python call per fetch)
_state: Callable[[], _State] = functools.partial(context.state, "plans", _State)


def state() -> _State:
    """The planner's state (the running model's epoch, the active guard): read by the guard and the reroute."""
    return _state()


class TensorMap:
    """Tensor -> value by identity, holding the tensors weakly (a ``WeakKeyDictionary`` would compare colliding
    tensors with ``==``, which is elementwise)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, t: torch.Tensor, value: Any) -> None:
        key, items = id(t), self._items

        def drop(ref: weakref.ref, key: int = key) -> None:
            entry = items.get(key)
            if entry is not None and entry[0] is ref:
                del items[key]

        items[key] = (weakref.ref(t, drop), value)

    def get(self, t: torch.Tensor) -> Any:
        entry = self._items.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None


_REPLICATED = 0  # the epoch of calls on replicated tensors (epochs proper start at 1)


def set_limits(records: int | None = None, epochs: int | None = None) -> None:
    """Bound the planner's tables in the context in use: ``records``, the plans recorded per group (default
    :data:`MAX_RECORDS`); ``epochs``, the epochs a converted model remembers having guarded, with its modules'
    exactly computed sites (default :data:`MAX_EPOCHS`). What is dropped is learned again at its next call, on every
    rank alike, provided every rank of a group sets the same limits (set them on every rank, or on none)."""
    st = _state()
    for name, value in (("records", records), ("epochs", epochs)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"set_limits: {name} must be a positive int, got {value!r}")
    if records is not None:
        st.max_records = records
        for ranks in list(st.kept):
            _drop_oldest(st, ranks)
    if epochs is not None:
        st.max_epochs = epochs


def set_validation(mode: str) -> None:
    """``"first"`` (default): a call agrees with its peers the first time it meets an epoch, then reuses what it
    learned. ``"always"``: every call agrees (one small host all-gather each; a debugging aid)."""
    if mode not in VALIDATION_MODES:
        raise ValueError(f"unknown validation mode {mode!r}; expected one of {', '.join(VALIDATION_MODES)}")
    _state().validation = mode


class Site:
    """The identity of a module's calls in the records. A deep copy (an EMA model) or an unpickled module gets a
    site of its own. Its id is issued by the context in use (unique in it) and issued again in another context
    (:func:`site_id`): ids never collide with a later context's, nor depend on a process-wide counter."""

    __slots__ = ("id", "owner")

    def __init__(self) -> None:
        st = _state()
        st.sites += 1
        self.id, self.owner = st.sites, st.token

    def __deepcopy__(self, memo: dict) -> Site:
        return Site()

    def __reduce__(self) -> tuple:
        return (Site, ())


def site_id(site: Site, st: _State) -> int:
    """``site``'s id in the context whose planner state is ``st`` (issued there the first time it is used there)."""
    if site.owner is not st.token:
        st.sites += 1
        site.id, site.owner = st.sites, st.token
    return site.id


@functools.lru_cache(maxsize=EPOCH_CACHE)
def epoch_number(salt: int, key: Hashable) -> int:
    """The epoch of the agreement ``key`` in the context of ``salt``: a 62-bit digest of both, so the number names
    the agreement itself (no table that grows with every shape; the same number after a cache eviction; distinct
    keys and distinct contexts give distinct numbers but with the odds of a 62-bit collision). ``key`` holds only
    ints, strings, ``None`` and tuples of them (its ``repr`` is the same in every process)."""
    digest = hashlib.blake2b(repr((salt, key)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) + 1  # (0 is the epoch of replicated calls)


def _intern(key: Hashable) -> int:
    return epoch_number(_state().salt, key)


def tag(t: Any, epoch: int | None) -> None:
    """Record that halo made tensor ``t`` under ``epoch`` (its global extents follow from it)."""
    if epoch is not None and isinstance(t, torch.Tensor):
        _state().provenance[t] = epoch


def mark_whole(t: torch.Tensor, source: str) -> None:
    """Record that ``t`` is whole and the same on every domain rank (``source``: the layer that made it)."""
    _state().whole[t] = source


def whole_source(t: Any) -> str | None:
    """The layer that made ``t`` whole on every rank (:func:`mark_whole`), or ``None``."""
    whole = _state().whole
    if not whole._items or not isinstance(t, torch.Tensor):
        return None
    return whole.get(t)


def _epoch_of(x: torch.Tensor, st: _State) -> int | None:
    epoch = st.epoch
    if epoch is not None or torch.compiler.is_compiling():
        return epoch
    return st.provenance.get(x)


def epoch_of(x: torch.Tensor) -> int | None:
    """The epoch a call on ``x`` belongs to (module docstring); ``None``: agree on this call."""
    return _epoch_of(x, _state())


def field_epoch(group: CommGroup, dim: int, shape: tuple[int, ...]) -> int:
    """The epoch of a field of global ``shape`` split along ``dim`` over ``group`` (``shard``, ``scatter``):
    every rank knows the shape, so no agreement is needed."""
    return _intern(("field", group.ranks, dim, tuple(shape)))


# -- resolving a call ------------------------------------------------------------------------------------------

_SIZES_ONLY = object()  # an axis of a call that only learns extents (no halo, no boundary)


@dataclasses.dataclass(frozen=True)
class AxisSpec:
    """What a call says of one sharded dim (``spec=`` of :func:`resolve`, one per axis): the tensor ``dim`` and,
    for an exchange, its ``halo`` and ``boundary`` as passed (checked across ranks by the agreement). A positional
    ``(dim,)`` or ``(dim, halo, boundary)`` is read as one (:meth:`of`)."""

    dim: Any
    halo: Any = None
    boundary: Any = _SIZES_ONLY

    @property
    def sizes_only(self) -> bool:
        return self.boundary is _SIZES_ONLY

    @staticmethod
    def of(spec: Any) -> AxisSpec:
        if isinstance(spec, AxisSpec):
            return spec
        return AxisSpec(*spec)

    def agreed(self) -> Spec:
        """This axis as the agreement's row takes it (:class:`halo.plan.agree.Spec`)."""
        return Spec.of(self.dim) if self.sizes_only else Spec.of(self.dim, self.halo, self.boundary)


def _axes(specs: tuple) -> tuple[AxisSpec, ...]:
    """Each axis of a call (a ``(dim,)`` / ``(dim, halo, boundary)`` or an :class:`AxisSpec`) as an AxisSpec."""
    try:
        return _axes_of(specs)
    except TypeError:  # (an unhashable argument: a malformed halo, refused by the agreement, never recorded)
        return _axes_of.__wrapped__(specs)


@functools.lru_cache(maxsize=1024)
def _axes_of(specs: tuple) -> tuple[AxisSpec, ...]:
    return tuple(AxisSpec.of(s) for s in specs)


@dataclasses.dataclass(frozen=True)
class Call:
    """Everything a call of :func:`resolve` brings but its tensor: what, with this rank's side of the call
    (:func:`local_key`), names its plan. ``make(comm_group, extents, *extra)`` makes the plan from the agreed
    extents (one per axis of ``axes``); ``coords``: every rank's position on the mesh axes; ``split``: refuse
    extents that are not the balanced split (:func:`_check_agreed`). Compared by value; its hash is computed once
    (a recalled plan costs one lookup: :func:`_call` hands out one object per distinct call, most of the time)."""

    group: Any
    op: str
    make: Callable
    extra: tuple = ()
    axes: tuple[AxisSpec, ...] = (AxisSpec(-2),)
    coords: tuple[tuple[int, ...], ...] | None = None
    allow_empty: bool = False
    split: bool = False
    _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        try:
            h = hash((self.group, self.op, self.make, self.extra, self.axes, self.coords, self.allow_empty,
                      self.split))
        except TypeError:  # (a malformed argument: refused by the agreement, never recorded)
            h = -1
        object.__setattr__(self, "_hash", h)

    def __hash__(self) -> int:
        return self._hash


@functools.lru_cache(maxsize=4096)
def _interned(group: Any, op: str, make: Callable, extra: tuple, specs: tuple, coords: Any, allow_empty: bool,
              split: bool) -> Call:
    return Call(group, op, make, extra, _axes(specs), coords, allow_empty, split)


def _call(group: Any, op: str, make: Callable, extra: tuple, specs: tuple, coords: Any, allow_empty: bool,
          split: bool) -> Call:
    """The :class:`Call` of these arguments: one object per distinct call while it is among the most recent (a
    pure memo: an equal one made again is the same key, so dropping it never changes which record a call finds)."""
    try:
        return _interned(group, op, make, extra, specs, coords, allow_empty, split)
    except TypeError:  # (an unhashable argument: a malformed halo, refused by the agreement)
        return Call(group, op, make, extra, _axes(specs), coords, allow_empty, split)


def local_key(x: torch.Tensor, grad: bool) -> tuple:
    """This rank's side of a call: shape, dtype, device type, whether it records a backward (-1: not checked)."""
    return tuple(int(s) for s in x.shape), x.dtype, x.device.type, needs_grad(x) if grad else -1


def _meta(local: tuple, axes: tuple[AxisSpec, ...]) -> Meta:
    shape, dtype, device, grad = local
    return Meta(len(shape), shape, str(dtype).removeprefix("torch."), device, grad, tuple(a.agreed() for a in axes))


def _names_pole(extra: Any) -> bool:
    """Whether a plan's arguments name a pole boundary (a string among them: the layer's boundary)."""
    if isinstance(extra, str):
        return extra in POLE_MODES
    if isinstance(extra, (tuple, list)):
        return any(_names_pole(e) for e in extra)
    return False


def _check_agreed(call: Call, local: tuple, extents: tuple) -> None:
    """Checks of what every rank agreed on (so they fail identically on every rank, before any message):

    * ``split``: every sharded extent is the balanced split of its total, or one of whole blocks (invariant 1; a
      layer computes its output as the balanced split of the output extent, so a hand-cut shard would give wrong
      rows on some ranks and shape errors on others);
    * a pole boundary rolls the last dim (longitude) by half its extent: an odd extent is refused, as
      ``halo_exchange`` refuses it (a layer would roll by ``W // 2``, silently not across the pole).
    """
    shape, op = local[0], call.op
    ndim = len(shape)
    dims = [int(a.dim) % ndim if ndim else 0 for a in call.axes]
    if call.split:
        for d, sizes in zip(dims, extents, strict=False):
            problem = split_problem(sizes)
            if problem is not None:
                raise ValueError(f"{op}: along dim {d - ndim} (the sharded dim), {problem}")
    last = ndim - 1
    pole = _names_pole(call.extra) or any(not a.sizes_only and a.boundary in POLE_MODES for a in call.axes)
    if ndim and pole and not (dims == [last]):  # (exchanging the last dim itself: refused by the plan, named)
        width = sum(extents[dims.index(last)]) if last in dims else shape[-1]
        if width % 2:
            raise ValueError(f"{op}: pole boundary needs an even number of longitudes to roll by W/2, got W={width}: "
                             f"the rows across a pole are rolled by half the longitudes (the last dim); use an even "
                             f"W (a global lat-lon grid has one), or another boundary")


def hold(obj: Any) -> None:
    """Keep ``obj`` for as long as the plan being made (by :func:`resolve`'s ``make``, now) is recorded: what a
    plan refers to by a number (an exchanger id: :func:`halo.exchange.exchanger_id`) lives with the plan, so a plan
    recalled on every rank never names something one rank dropped (issue 31 item 4). Outside a ``make``: nothing."""
    holding = _state().holding
    if holding is not None:
        holding.append(obj)


def _agree_and_make(call: Call, local: tuple) -> tuple[Any, CommGroup, tuple]:
    """Agree on ``call`` and make its plan: the plan, the group, and what the plan holds (:func:`hold`)."""
    cg = comm_group(call.group)
    extents = agree(_meta(local, call.axes), cg, call.op, coords=call.coords, allow_empty=call.allow_empty)
    _check_agreed(call, local, extents)
    st = _state()
    outer, st.holding = st.holding, []
    try:
        plan = call.make(cg, extents, *call.extra)
        held = tuple(st.holding)
    finally:
        st.holding = outer
    return plan, cg, held


@eager_only
def _agreed(call: Call, local: tuple) -> Any:
    """A call without an epoch: agree now (outside any compiled graph: a graph break under ``torch.compile``)."""
    return _agree_and_make(call, local)[0]


def _keep(st: _State, key: tuple, ranks: tuple[int, ...], held: tuple) -> None:
    """Count a new record ``key`` of the group of ``ranks`` (dropping its oldest past the cap) with what it holds."""
    if held:
        st.held[key] = held
    else:
        st.held.pop(key, None)
    keys = st.kept.get(ranks)
    if keys is None:
        keys = st.kept[ranks] = collections.deque()
    keys.append(key)
    if len(keys) > st.max_records:  # this group's oldest first: the same sequence on each of its ranks
        _drop_oldest(st, ranks)


def _drop_oldest(st: _State, ranks: tuple[int, ...]) -> None:
    """Drop the group's oldest records beyond the cap (only its own: the same ones on each of its ranks), with what
    they hold."""
    keys = st.kept[ranks]
    while len(keys) > st.max_records:
        key = keys.popleft()
        st.records.pop(key, None)
        st.held.pop(key, None)
    if not keys:
        del st.kept[ranks]


_STANDALONE = -1  # the records of layers called on tensors halo did not make (no epoch): one per site


@eager_only
def _standalone(site: int, call: Call, local: tuple) -> Any:
    """A layer called outside a converted model on a tensor halo did not make (a plain shard: no epoch). It agrees
    when this rank's side of the call (its local shape, dtype, grad flag, arguments) differs from the one of its
    site's last agreement, and otherwise reuses that agreement's plan: one agreement per shape, not per call.

    Why one record per site, and not one per local shape. A rank's local shape does not name the global extent (45
    rows over 2 ranks are 23 + 22, 44 are 22 + 22). With a record per local shape, rank 0 could hit a record of one
    agreement while rank 1 hits one of another (45, 43, then 44 rows: each rank has seen its 22 rows before, under
    different totals), silently wrong. With one record per site, every rank's record is that of the same, last
    agreement (the ranks make the same calls: SPMD), so when every rank hits, every local shape is the one agreed
    and the recorded extents are the current ones. When the global extent changed, some rank's local shape changed
    (a balanced split fixes the shapes by the total) and it agrees while the others, which hit, post the old plan's
    messages: every rank raises :class:`halo.HaloCommError` within the timeout (invariant 4's bounded failure),
    never a silently different result, as for a converted model (module docstring). Records are dropped with the
    group's other records (:data:`MAX_RECORDS`, oldest first, alike on every rank)."""
    key = (_STANDALONE, site, call.group, call.op, call.axes)
    st = _state()
    entry = st.records.get(key)
    if entry is not None and entry[0] == (local, call):
        return entry[1]
    try:
        plan, cg, held = _agree_and_make(call, local)
    except HaloCommError as exc:
        if entry is None:
            raise
        raise HaloCommError(
            f"{exc}. Likely cause: this layer's input shape here changed since its last call ({entry[0][0][0]} -> "
            f"{local[0]}) but not on every rank, so the peers reused their plan: a plain shard (not made by "
            f"halo.shard, outside a converted model) whose global extent changed while some ranks' shards kept "
            f"their shape. Shard the field with halo.shard, run the layer in a converted model, or "
            f"halo.set_validation('always')") from exc
    st = _state()
    new = key not in st.records
    st.records[key] = ((local, call), plan)
    if new:
        _keep(st, key, cg.ranks, held)
    elif held:
        st.held[key] = held
    else:
        st.held.pop(key, None)
    return plan


def _recorded(epoch: int, site: int, call: Call, local: tuple) -> Any:
    """A call with an epoch: the record, or (first time, on every rank alike) an agreement that makes it."""
    key = (epoch, site, local, call)
    records = _state().records
    plan = records.get(key)
    if plan is None:
        plan, cg, held = _agree_and_make(call, local)
        st = _state()
        st.records[key] = plan
        _keep(st, key, cg.ranks, held)
    return plan


@torch._dynamo.assume_constant_result
def _traced(epoch: int, site: int, local: tuple, group: Any, op: str, make: Callable, extra: tuple, spec: tuple,
            coords: tuple | None, allow_empty: bool, split: bool) -> Any:
    """:func:`_recorded` at trace time under ``torch.compile`` (plain arguments in, the plan a constant of the
    graph); what the record holds is kept with the context from now on (the graph names its exchangers by id)."""
    call = _call(group, op, make, extra, spec, coords, allow_empty, split)  # (spec: one per axis)
    plan = _recorded(epoch, site, call, local)
    st = _state()
    key = (epoch, site, local, call)
    if key in st.held:
        st.compiled[key] = st.held[key]
    return plan


def _constant(v: Any) -> Any:
    """``v`` (a number, or tuples and lists of them) with every symbolic number in it a plain one, under
    ``torch.compile``.

    A plan is a function of sizes and arguments, and :func:`_traced` takes them as constants; but dynamo makes an
    int symbolic once it has seen it change at one place: a size at a model's second input shape (``dynamic=None``,
    the default), every size under ``dynamic=True`` or ``mark_dynamic``, an int handed from frame to frame across a
    graph break (a site id); and a float (``specialize_float`` is off: an ``nn.Upsample``'s scale factor under
    ``dynamic=True``). ``operator.index`` and ``guard_scalar`` specialize it (dynamo guards on its value), so each
    shape compiles its own graph with its own plans, instead of failing ("assume_constant_result argument
    conversion failed") or, without ``fullgraph``, breaking the graph at every layer's plan and agreeing there. A
    dim marked with ``torch._dynamo.mark_dynamic`` is refused by torch then (its ``ConstraintViolationError`` names
    the dim and the plan call that specialized it); ``maybe_mark_dynamic`` is not."""
    if isinstance(v, int):  # (a SymInt too, where dynamo traces this; an int subclass: an int of its value)
        return v if isinstance(v, bool) else operator.index(v)
    if isinstance(v, float):  # (a SymFloat too)
        return guard_scalar(v)
    if isinstance(v, (tuple, list)):
        items = [_constant(e) for e in v]
        if isinstance(v, list):
            return items
        # (a NamedTuple: its fields. Not ``type(v) in (tuple, list)``: dynamo cannot guard on the type of a tuple
        # an earlier plan returned, e.g. ring_sdpa's query sizes, and fails with an internal NotImplementedError)
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    return v


def resolve(x: torch.Tensor, group: Any, op: str, make: Callable, extra: tuple = (), *, site: Site | None = None,
            spec: tuple = (-2,), grad: bool = True, allow_empty: bool = False,
            coords: tuple[tuple[int, ...], ...] | None = None, replicated: bool = False,
            source: torch.Tensor | None = None, split: bool | None = None) -> Any:
    """The plan of a call on ``x``: ``make(comm_group, extents, *extra)``, where ``extents[k]`` holds every rank's
    extent along the dim of spec ``k`` (agreed, or recorded under the call's epoch: module docstring).

    ``spec``: ``(dim,)`` to learn extents only, or ``(dim, halo, boundary)`` for an exchange's own arguments (all
    checked across ranks on an agreement); a tuple of such specs for several sharded dims, with ``coords`` every
    rank's position on the mesh axes (:func:`halo.plan.agree.agree`). ``grad``: agree on whether the call records a
    backward. ``replicated``: ``x`` is whole on every rank (its shape is the global one), so what a call learned holds
    for as long as its shape does, in any epoch. ``make`` must be a pure function of its arguments that raises
    identically on every rank, and under ``torch.compile`` return plain constants (ints, floats, strings, tuples,
    NamedTuples). ``source``: the tensor whose epoch the call belongs to, when not ``x`` itself (a view of it).
    ``split``: refuse sharded extents that are not the balanced split (nor one of whole blocks), on every rank
    alike, naming the split expected and got; default: for a layer's calls (``site`` given) that learn the extents
    of a channels-first field's H (``spec=(-2,)``; on a mesh ``((-2,), (-1,))``): convolutions, pools, norms,
    upsampling, padding, whose outputs are the balanced split of the output extent (invariant 1), so that a shard cut
    otherwise cannot give wrong rows. Layers with a split rule of their own (Swin windows, channels-last) pass
    their own dim and keep it. A call with a pole boundary (in ``spec`` or in ``extra``)
    refuses an odd number of longitudes (the last dim) on every rank.
    """
    specs = (spec,) if isinstance(spec, AxisSpec) or not isinstance(spec[0], (tuple, AxisSpec)) else spec
    st = _state()
    if st.mesh_group is not None and len(specs) == 1 and not replicated \
            and (group is None or group is st.mesh_group):
        raise ValueError(f"{op} shards latitude only, but it runs in the forward of a model converted on a latitude "
                         f"x longitude mesh, whose blocks it would take for latitude rows (silently wrong); use a "
                         f"layer with a mesh form (halo.nn.convert.MESH_2D), or convert on latitude rows")
    local = local_key(x, grad)
    if group is None and unsharded_default():
        replicated = True  # one process (no torch.distributed, or halo.dist.comm.unsharded()): local shapes are global
    if split is None:  # a layer's call on a channels-first field's H (and W): invariant 1 (docstring)
        split = site is not None and all(_learns_h_or_w(s) for s in specs)
    split = bool(split and not replicated)
    epoch = _REPLICATED if replicated else _epoch_of(x if source is None else source, st)
    compiling = torch.compiler.is_compiling()
    if epoch is None and site is not None and st.validation != "always" and not compiling:
        site_key = site.id if site.owner is st.token else site_id(site, st)
        return _standalone(site_key, _call(group, op, make, extra, specs, coords, allow_empty, split), local)
    if epoch is None or st.validation == "always":
        return _agreed(_call(group, op, make, extra, specs, coords, allow_empty, split), local)
    if site is not None:
        site_key = site.id if site.owner is st.token else site_id(site, st)
    elif st.epoch is not None and not replicated:
        # A functional call inside a converted model: two calls may see the same local shape and different global
        # extents (45 and 44 rows over 2 ranks: rank 1 holds 22 of both), so each call is its own site, named by
        # its place in the forward's sequence of such calls (the same on every rank: they make the same calls).
        st.calls += 1
        site_key = -st.calls
    else:
        site_key = 0
    if compiling:  # (plain arguments into the constant-result function; the call's objects are made inside it)
        return _traced(*_constant((epoch, site_key, local)), group, op, make, *_constant((extra, specs, coords)),
                       allow_empty, split)
    try:  # (_call, inlined: the hot path of a recalled plan)
        call = _interned(group, op, make, extra, specs, coords, allow_empty, split)
    except TypeError:
        call = Call(group, op, make, extra, _axes(specs), coords, allow_empty, split)
    return _recorded(epoch, site_key, call, local)


def _learns_h_or_w(s: Any) -> bool:
    if isinstance(s, AxisSpec):
        return s.sizes_only and s.dim in (-2, -1)
    return len(s) == 1 and s[0] in (-2, -1)


def _first(cg: CommGroup, extents: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return extents[0]


def shard_sizes(x: torch.Tensor, dim: int = -2, group: Any | None = None, *, op: str = "shard_sizes",
                site: Site | None = None, allow_empty: bool = False, check_grad: bool = False,
                replicated: bool = False) -> tuple[int, ...]:
    """Every rank's extent of ``x`` along ``dim``, in group order, checked across ranks (:func:`resolve`).

    ``dim`` and the number of dims, all other dims, the dtype and the device type must be equal across the group;
    otherwise every rank raises the same ``ValueError`` naming the ranks and shapes. ``check_grad``: also agree on
    whether ``x`` records a backward (an op on ``x`` whose backward runs on some ranks only would leave those
    waiting).
    """
    return resolve(x, group, op, _first, site=site, spec=(dim,), grad=check_grad, allow_empty=allow_empty,
                   replicated=replicated)


def carry(out: Any, x: torch.Tensor) -> None:
    """Outside a converted model: give ``out`` (a halo op's result on ``x``) ``x``'s epoch."""
    st = _state()
    if st.epoch is None and not torch.compiler.is_compiling():
        provenance = st.provenance
        epoch = provenance.get(x)
        if epoch is not None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    provenance[t] = epoch


# -- the entry of a converted model --------------------------------------------------------------------------

_ENTRY = 0x454E5452  # "ENTR"
_DYNAMO_DIR = os.path.join("torch", "_dynamo") + os.sep


_MODULE_PY = os.path.join("torch", "nn", "modules", "module.py")


def _called_by_dynamo() -> bool:
    """Whether this model's call comes from a ``torch.compile``-d module or function: dynamo's frames above the
    module call that runs this hook (the ones below it are the hook's own ``dynamo.disable`` wrapper). A frame of
    ``dynamo.disable`` itself does not count: ``torch.utils.checkpoint`` (``torch._disable_dynamo``) runs eagerly."""
    f = sys._getframe(1)
    while f is not None and _MODULE_PY not in f.f_code.co_filename:
        f = f.f_back
    while f is not None:
        if _DYNAMO_DIR in f.f_code.co_filename and not f.f_code.co_qualname.startswith(_DISABLED):
            return True
        f = f.f_back
    return False


_DISABLED = ("DisableContext.", "_disable_dynamo.")  # (dynamo's eager wrappers: qualnames of torch 2.11 to 2.14)


def _check_entry(table: np.ndarray, cg: CommGroup, op: str) -> None:
    """What the entry's words tell when the ranks are not at the same step: train/eval mode and how many backwards
    ran through the model's outputs (the same ``ValueError`` on every rank, naming the ranks)."""
    modes, counts = table[:, 3], table[:, 4]
    if (modes != modes[0]).any():
        evals = [r for r in range(cg.size) if not modes[r]]
        trains = [r for r in range(cg.size) if modes[r]]
        raise ValueError(f"{op}: the model is in eval() mode on group ranks {evals} (global "
                         f"{[cg.ranks[r] for r in evals]}) and in train() mode on group ranks {trains}: layers that "
                         f"act differently in training (batch norm statistics, dropout) would compute different "
                         f"things or wait for each other; call model.train() / model.eval() on every rank alike")
    since = table[:, 5]
    if (since != since[0]).any():
        raise ValueError(f"{op}: the ranks of the domain group entered this agreement at different calls of the model "
                         f"({[int(c) for c in since]} calls since the last agreed one on group ranks 0..{cg.size - 1}):"
                         f" some ranks' inputs changed (a shape, dtype, train/eval mode) while others' did not, and "
                         f"those skipped the agreement on their steady calls; give every rank its share of the same "
                         f"inputs at every call (for a new grid: halo.nn.root.set_grid(model, None) on every rank)")
    if (counts != counts[0]).any():
        raise ValueError(f"{op}: the ranks of the domain group have run backward through this model's outputs "
                         f"different numbers of times ({[int(c) for c in counts]} on group ranks 0..{cg.size - 1}): "
                         f"a rank skipped a backward (a loss it found not finite, a branch the others did not take) "
                         f"or ran an extra one; every rank of a domain group must run the same steps")


def _backward_skipped(module: torch.nn.Module) -> str | None:
    """Why this rank's entry may wait alone: its previous forward recorded a backward that never ran here."""
    pending = module.__dict__.get("_halo_backward_pending")
    if pending is not None and pending[0]:
        return (f"this rank did not run backward() through the output of its previous forward (forward "
                f"{pending[1]}), which recorded one; if its peers did, they are waiting in their backward for this "
                f"rank's halo gradients. Run backward on every rank of the domain group (or the forward under "
                f"torch.no_grad() on every rank)")
    return None


def _watch_backward(module: torch.nn.Module, output: Any) -> None:
    """Note whether the backward of this forward's output runs (a tensor hook on one output that records one)."""
    leaf = next((t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if leaf is None or not torch.is_grad_enabled():
        module.__dict__.pop("_halo_backward_pending", None)
        return
    pending = [True, module.__dict__.get("_halo_forwards", 0) - 1]
    module.__dict__["_halo_backward_pending"] = pending
    state = module.__dict__

    def ran(grad: torch.Tensor) -> None:
        if pending[0]:
            pending[0] = False
            state["_halo_backwards"] = state.get("_halo_backwards", 0) + 1

    leaf.register_hook(ran)


@torch._dynamo.disable  # a hook: dynamo runs a disabled hook outside the graph even under fullgraph=True
def enter_root(module: torch.nn.Module, args: Any, kwargs: Any, method: str | None = None,
               compiled: bool = False) -> None:
    """Forward pre-hook of a converted model: start (or, inside another converted model, join) its step's epoch.
    ``method``: another entry of the model called from outside its forward (``halo.nn.root``: timm's
    ``forward_features``, ...), whose epoch is its own (a pure function of the inputs' and the method's name): its
    first call is guarded, not taken for one of ``forward``'s calls on the same inputs. ``compiled``: that method
    called from a compiled function (``torch.compile(model.forward_features)``), which no module call shows."""
    st = _state()
    if st.depth:
        st.depth += 1
        return
    st.calls = 0
    config = module.__dict__["_halo_root"]
    cg = comm_group(config.group)
    op = f"{type(module).__name__} (converted model entry)"
    seen = entry.view(args, kwargs, module, config, cg, op)  # the grid and this rank's share of it (halo.plan.entry)
    words = np.frombuffer(seen.digest, dtype=np.int64)
    forwards = module.__dict__.get("_halo_forwards", 0)
    if cg.size > 1:
        module.__dict__["_halo_forwards"] = forwards + 1
    steady = None if seen.local_only else entry.steady_epoch(module, seen, st.token)
    if seen.local_only:  # a declared grid (checked locally) with no sample to compare, or one rank
        epoch = _intern(("grid", config.grid, tuple(int(w) for w in words)))
    elif steady is not None:  # inputs as at the last agreed call (halo.plan.entry, "Steady calls"): no collective
        epoch = steady
    else:
        row = [_ENTRY, int(words[0]), int(words[1]), int(module.training), module.__dict__.get("_halo_backwards", 0),
               entry.since_agreed(module, st.token), *seen.words]
        try:
            table = gather_words(row, cg, op)  # host data only
        except HaloCommError as exc:
            hint = _backward_skipped(module) or entry.changed(module, seen, st.token)
            if hint:
                raise HaloCommError(f"{exc}. Likely cause: {hint}") from exc
            raise
        _check_entry(table, cg, op)
        entry.judge(table[:, 6:], seen, module, config, cg, op)  # the same error on every rank, or the grid learned
        epoch = _intern(("entry", cg.ranks, tuple(table[:, :3].ravel().tolist())))
        entry.agreed(module, seen, st.token, epoch)
    if method is not None:
        epoch = _intern(("method", method, epoch))
    if module.__dict__.get("_halo_data_parallel") != "fsdp-all":  # (fsdp-all: shards differ within a domain group)
        from .replicated import periodic_check

        periodic_check(module, cg, forwards, op)
    st.epoch, st.depth = epoch, 1
    st.mesh_group = config.group if getattr(config, "w_sharded", False) else None
    guarded = guarded_epochs(module)
    first = epoch not in guarded or st.validation == "always"
    if not first:
        guarded.move_to_end(epoch)  # least recently called dropped first (the same calls on every rank)
    dynamo = compiled or _called_by_dynamo()
    if first and st.guard_on and cg.size > 1 and dynamo:
        try:
            guarded_eager_call(module, args, kwargs, config, cg, epoch, method)
        except BaseException:  # (a refusal: no call is in progress, whether or not an exit hook runs after this)
            _abandon(st)
            raise
    elif first and st.guard_on and not dynamo:
        # The first call of this epoch: watch the ops its forward calls itself (``halo.guard``). Not for a compiled
        # model (the graph would be traced under the guard): that one is run eagerly above, before dynamo traces.
        factory = config.guard  # the root's config gives the guard (halo.nn.root, above it): nothing injected
        names = {id(m): n or "(the model)" for n, m in module.named_modules(remove_duplicate=False)}
        st.guard = factory(names, cg, epoch, w_sharded=getattr(config, "w_sharded", False))
        st.guard.__enter__()


def guarded_epochs(module: torch.nn.Module) -> collections.OrderedDict:
    """The epochs converted model ``module`` has run a guarded first call of, least recently called first, each with
    the modules given sites to compute exactly in it (:func:`halo.guard.reroute.install`, which adds and drops them: an
    epoch and its sites go together, past ``set_limits(epochs=)``). In the model's ``__dict__`` (a deep copy or a
    pickle keeps them, its modules mapped to the copy's)."""
    guarded = module.__dict__.get("_halo_guarded")
    if not isinstance(guarded, collections.OrderedDict):  # (a set, in a model pickled before they were bounded)
        guarded = module.__dict__["_halo_guarded"] = collections.OrderedDict.fromkeys(guarded or (), ())
    return guarded


class _Snapshot:
    """What one more eager run of a forward must not change: the model's buffers (BatchNorm's running statistics),
    torch's random states and the epoch's call counter, as they were at the call's start."""

    def __init__(self, module: torch.nn.Module, calls: int) -> None:
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.calls = calls

    def restore(self, st: _State) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        st.calls = self.calls


def _abandon(st: _State) -> None:
    """A root call that raised in its hooks: no call is in progress any more (the next one starts afresh)."""
    st.guard, st.epoch, st.depth, st.mesh_group = None, None, 0, None


def guarded_eager_call(module: torch.nn.Module, args: Any, kwargs: Any, config: Any, cg: CommGroup,
                       epoch: int, method: str | None = None) -> None:
    """The first call of an epoch under ``torch.compile`` (a compiled first call, or a compiled call at new shapes,
    in eval mode or without grad after eager training calls): the guard watches eager code only, and an unguarded
    epoch runs its functional ops per shard (a resize to the global size, a mean over H: silently different). So the
    forward runs here once, eagerly, under the guard, in this dynamo-disabled hook before dynamo traces it: its
    refusals are raised on every rank alike and the ops it computes exactly get their sites
    (:mod:`halo.guard.reroute`), as at an eager first call. Its outputs are dropped; the model's buffers (BatchNorm's
    running statistics), torch's random states and the epoch's call counter are put back, so the compiled call that
    follows computes what it would have (each rank alike: every rank of the group is at the same first call). The
    guard takes this function's frame for the model's call (``halo.guard._ops.in_hook``): the hook that runs it is
    not the model's code. ``method``: a root method (``halo.nn.root.RootMethod``), run through its entry module,
    where its sites are kept."""
    st = _state()
    call = module.forward
    if method is not None:
        root_method = module.__dict__[method]
        call = functools.partial(root_method.entry, functools.partial(getattr(type(module), method), module))
    snapshot = _Snapshot(module, st.calls)
    names = {id(m): n or "(the model)" for n, m in module.named_modules(remove_duplicate=False)}
    guard = st.guard = config.guard(names, cg, epoch, w_sharded=getattr(config, "w_sharded", False))
    before = module.__dict__.get("forward")
    out = None
    guard.__enter__()
    try:
        out = call(*args, **kwargs)
    finally:
        guard.__exit__(None, None, None)
        st.guard = None
        snapshot.restore(st)
    guard.finish(out, module)  # (the epoch guarded, with its sites)
    if method is None and module.__dict__.get("forward") is not before:
        # The model's own forward got sites (a functional op in its own code: a mean over H): torch's Module call
        # read ``self.forward`` before this hook ran, so the call in progress runs the class's forward without
        # them. Its exit hook (:func:`exit_root`) runs the forward again, rerouted, from this call's state, and
        # returns that output in its place (its autograd graph with it): one more eager forward, once per epoch.
        module.__dict__["_halo_rerun"] = snapshot


@torch._dynamo.disable  # a hook: dynamo runs a disabled hook outside the graph even under fullgraph=True
def exit_root(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    """Forward hook of a converted model (also on error): end its epoch; its outputs keep it (losses after it).
    Returns the output of a compiled first call whose own forward was rerouted by its guarded run (see
    :func:`guarded_eager_call`), run again with its sites, else ``None`` (the output as it is)."""
    st = _state()
    rerun = module.__dict__.pop("_halo_rerun", None)
    replaced = None
    if rerun is not None and output is not None and st.depth == 1:
        rerun.restore(st)
        try:
            output = replaced = module.forward(*args, **(kwargs or {}))
        except BaseException:
            _abandon(st)
            raise
    st.depth = max(0, st.depth - 1)
    if st.depth == 0:
        guard, st.guard = st.guard, None
        epoch, st.epoch = st.epoch, None
        st.mesh_group = None
        if guard is not None:
            guard.__exit__(None, None, None)
            if output is not None:  # the call completed: a forward hook's refused result must not be the output
                guard.finish(output, module)  # (its epoch guarded, with its sites: halo.guard.reroute.install)
        if output is not None and not torch.compiler.is_compiling():
            _watch_backward(module, output)
        if epoch is not None:
            provenance = st.provenance
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor):
                    provenance[t] = epoch
    return replaced


# -- tensors a plan needs on a device ------------------------------------------------------------------------------

def _device_tensor(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (values, dtype, device)
    tensors = _state().tensors
    t = tensors.get(key)
    if t is None:
        t = tensors[key] = torch.tensor(values, dtype=dtype, device=device)
        if len(tensors) > MAX_TENSORS:
            tensors.popitem(last=False)
    return t


def device_tensor(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, made once per (values, dtype, device) and cached (never write to
    it): an index map or weights of a plan costs no host-to-device copy per call. Under ``torch.compile`` it is a
    constant of the graph."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    return _device_tensor(values, dtype, device)
