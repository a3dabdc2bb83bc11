"""Exchangers by plan, addressed by small ints (what a compiled graph holds), and the pole step of a latitude axis.

A plan's spec (group, dim, every rank's extent and needs, boundary, op) gets an id once per context
(:func:`exchanger_id`); the live :class:`~halo.exchange.Exchanger` of an id is made on first use and kept, least
recently used dropped (:func:`get_exchanger`). A latitude exchange across a pole with longitude sharded is a
:class:`PoleSpec`: the latitude exchange with the mirror boundary, then the rows across the pole rolled along W
(:func:`pole_step`), run by a :class:`PoleExchanger` behind the same id space and interface.

Who keeps a spec. An id and its spec are one :class:`ExchangeRef`, and the spec lives exactly as long as something
holds that ref: the planner's record of the plan that made it (:func:`halo.plan.plans.hold`, so a recalled plan's
ids always resolve, whatever else this rank planned since), its live exchanger, a compiled graph that baked its id
in, or, for the rest (a call planned every time, a plan made by hand), a bounded LRU of the :data:`SPECS_CAP` most
recently planned. Nothing evicts a spec apart from its holders, so no rank drops what its peers still use (issue 31
item 4: the records of a shared model outlived their specs when a rank planned other shapes). An id no one holds any
more is unknown (``LookupError``) and never reused.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .. import context
from ..dist.comm import CommGroup, comm_group, id_base
from ..plan.partition import POLE_MODES, check_boundary, offsets, plan_exchange
from ..plan.plans import hold
from .exchanger import Exchanger

__all__ = ["ExchangeRef", "ExchangeSpec", "LIVE_CAP", "PoleExchanger", "PoleSpec", "SPECS_CAP", "exchange_ref",
           "exchange_spec", "exchanger_id", "get_exchanger", "pole_step", "pooled_bytes"]


class ExchangeSpec(NamedTuple):
    """What names an exchanger: the group, the dim, every rank's extent, every rank's needs, boundary, op name."""

    group: Any
    dim: int
    sizes: tuple[int, ...]
    needs: tuple[tuple[int, int], ...]
    boundary: str
    op: str


#: Exchange plans that nothing else holds, remembered per context (least recently planned dropped first). Each is a
#: few hundred bytes: the cap bounds a process that plans ever new shapes (a sweep of sizes) outside any record.
SPECS_CAP = 16384
#: Exchangers (with their buffers) kept live per context, least recently used dropped (made again from the spec).
LIVE_CAP = 256


class ExchangeRef:
    """An exchanger id with its spec (an :class:`ExchangeSpec` or a :class:`PoleSpec`, whose steps' refs it holds
    in ``parts``): held by whatever holds the id (module docstring), known to the registry only weakly."""

    __slots__ = ("id", "spec", "parts", "__weakref__")

    def __init__(self, ex_id: int, spec: Any, parts: tuple = ()) -> None:
        self.id, self.spec, self.parts = ex_id, spec, parts


@dataclasses.dataclass
class _ExchangeState:
    """The exchangers' part of the context: refs by id and by spec (weakly: their holders keep them), the unheld
    ones' LRU and the live exchangers (each holds its ref). A compiled graph's ids are held by the planner
    (:func:`halo.plan.plans.hold`: the records a trace recalled are kept with the context)."""

    by_id: weakref.WeakValueDictionary = dataclasses.field(default_factory=weakref.WeakValueDictionary)
    by_spec: weakref.WeakValueDictionary = dataclasses.field(default_factory=weakref.WeakValueDictionary)
    recent: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # id -> ref, LRU
    live: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # id -> Exchanger
    next_id: int = dataclasses.field(default_factory=id_base)


def _state() -> _ExchangeState:
    return context.state("exchange", _ExchangeState)


def _ref(state: _ExchangeState, spec: Any, parts: tuple = ()) -> ExchangeRef:
    """The ref of ``spec`` (made, with a new id, if nothing holds one), held by the record being planned and
    touched in the LRU of recent plans."""
    ref = state.by_spec.get(spec)
    if ref is None:
        ref = ExchangeRef(state.next_id, spec, parts)
        state.next_id += 1
        state.by_id[ref.id] = ref
        state.by_spec[spec] = ref
    recent = state.recent
    recent[ref.id] = ref
    recent.move_to_end(ref.id)
    while len(recent) > SPECS_CAP:
        recent.popitem(last=False)
    hold(ref)
    return ref


def exchange_ref(cg: CommGroup, dim: int, sizes: Sequence[int], needs: Sequence[tuple[int, int]], boundary: str,
                 op: str = "halo_exchange") -> ExchangeRef:
    """:func:`exchanger_id` as the ref itself (its id resolves for as long as the caller holds it)."""
    spec = ExchangeSpec(cg.group, dim, tuple(int(s) for s in sizes), tuple((int(a), int(b)) for a, b in needs),
                        check_boundary(boundary), op)
    state = _state()
    ref = state.by_spec.get(spec)
    if ref is None:
        try:
            _plan(spec.sizes, spec.needs, spec.boundary)
        except ValueError as exc:
            raise ValueError(f"{op}: {exc}") from None
    return _ref(state, spec)


def exchanger_id(cg: CommGroup, dim: int, sizes: Sequence[int], needs: Sequence[tuple[int, int]], boundary: str,
                 op: str = "halo_exchange") -> int:
    """The id of this rank's exchanger for a plan (made and cached on first use). ``sizes``: every rank's extent
    along ``dim``; ``needs[r]``: the virtual rows rank ``r`` needs. Both must be agreed (the same on every rank).
    Called in a plan function of :func:`halo.plan.plans.resolve`, the id is held by the plan's record."""
    return exchange_ref(cg, dim, sizes, needs, boundary, op).id


def exchange_spec(ex_id: int) -> ExchangeSpec:
    """The spec of exchanger ``ex_id`` (of its latitude step, for a :func:`pole_step`); a clear error for an id
    this context does not know (evicted past :data:`SPECS_CAP`, or made before ``halo.context.reset()`` or in
    another context): never another's spec."""
    ref = _lookup(ex_id)
    return ref.parts[0].spec if ref.parts else ref.spec


def _lookup(ex_id: int) -> ExchangeRef:
    ref = _state().by_id.get(ex_id)
    if ref is None:
        raise LookupError(f"halo: exchanger id {ex_id} is unknown in this context (made before halo.context.reset(), "
                          f"in another halo.context.use() block, or held by nothing any more: no record, live "
                          f"exchanger or compiled graph, and past the {SPECS_CAP} most recent of "
                          f"halo.exchange._registry.SPECS_CAP): plan the exchange again")
    return ref


@functools.lru_cache(maxsize=1024)
def _plan(sizes: tuple[int, ...], needs: tuple[tuple[int, int], ...], boundary: str):
    return plan_exchange(sizes, needs, boundary)


def get_exchanger(ex_id: int) -> Exchanger | PoleExchanger:
    """The exchanger of id ``ex_id`` (rebuilt if it was evicted; its buffers go with it)."""
    state = _state()
    live = state.live
    ex = live.get(ex_id)
    if ex is None:
        ref = _lookup(ex_id)
        spec = ref.spec
        if ref.parts:
            ex = PoleExchanger(spec, get_exchanger(spec.h), get_exchanger(spec.roll))
        else:
            cg = comm_group(spec.group)
            ex = Exchanger(_plan(spec.sizes, spec.needs, spec.boundary).ranks[cg.index], cg, spec.dim,
                           spec.boundary, spec.op)
        ex.ref = ref  # the live exchanger holds its spec
        live[ex_id] = ex
        if len(live) > LIVE_CAP:
            live.popitem(last=False)
    else:
        live.move_to_end(ex_id)
    return ex


def pooled_bytes() -> int:
    """The bytes the live exchangers of the context in use keep in their buffer pools (up to
    ``BufferPool.per_key`` buffers per shape, dtype, format and stream, for up to :data:`LIVE_CAP` exchangers):
    memory held back from the caching allocator between steps. Only message strips are pooled (halo rows, their
    gradients), so this is about ``4 x (rows sent + rows received) x`` a row's bytes per exchanger and shape, never
    an activation. A pole exchanger's steps are counted once (they are live exchangers of their own)."""
    return sum(ex.pool.nbytes() for ex in _state().live.values() if isinstance(ex, Exchanger))


# -- the pole, a step of the latitude axis ------------------------------------------------------------------------

class PoleSpec(NamedTuple):
    """A latitude exchange across a pole with longitude sharded: exchange ``h`` (the latitude rows with the mirror
    boundary), then the ``top`` / ``bottom`` rows of its result (those across the pole) rolled by half the
    longitudes by exchange ``roll`` over the longitude group. ``dims``: the latitude and longitude tensor dims."""

    h: int
    roll: int
    top: int
    bottom: int
    dims: tuple[int, int]


def _pole_rows(need: tuple[int, int], n: int) -> tuple[int, int]:
    lo, hi = need
    return max(0, min(hi, 0) - lo), max(0, hi - max(lo, n))


def pole_step(ex_id: int, w_group: Any, w_sizes: Sequence[int], w_dim: int) -> int:
    """The exchange of a latitude axis of a mesh whose longitude axis is sharded over ``w_group`` (every rank's
    extent ``w_sizes`` along tensor dim ``w_dim``): ``ex_id`` itself unless its boundary is a pole mode, else the
    id of a :class:`PoleSpec` doing what ``ex_id`` does with the longitude whole on each rank.

    Across a pole the rows are the mirrored rows (``reflect`` for ``pole``, ``symmetric`` for ``pole_centered``)
    rolled by W/2 around the whole circle, which other ranks of the longitude group hold; so the latitude rows are
    exchanged with the mirror and the rows across the pole are then rolled along W by a circular exchange whose
    rows are shifted by W/2. The ranks of a longitude group share their latitude position: they roll the same rows
    together. Pure in agreed values (raises alike on every rank); ids as :func:`exchanger_id` (never reused, held
    as they are: the pole's ref holds its two steps').
    """
    spec = exchange_spec(ex_id)
    if spec.boundary not in POLE_MODES or len(w_sizes) < 2:
        return ex_id  # not a pole, or the longitude whole on this rank: the exchanger rolls locally
    width = sum(w_sizes)
    if width % 2:
        raise ValueError(f"{spec.op}: pole boundary needs an even number of longitudes to roll by W/2, got W={width}")
    cg_h, cg_w = comm_group(spec.group), comm_group(w_group)
    mirror = "reflect" if spec.boundary == "pole" else "symmetric"
    h = exchanger_id(cg_h, spec.dim, spec.sizes, spec.needs, mirror, spec.op)
    offs, half = offsets(w_sizes), width // 2
    roll = exchanger_id(cg_w, w_dim, w_sizes, tuple((offs[j] + half, offs[j + 1] + half) for j in range(len(w_sizes))),
                        "circular", spec.op)
    top, bottom = _pole_rows(spec.needs[cg_h.index], sum(spec.sizes))
    state = _state()
    pole = PoleSpec(h, roll, top, bottom, (spec.dim, w_dim))
    return _ref(state, pole, (state.by_id[h], state.by_id[roll])).id  # (its steps held with it)


class PoleExchanger:
    """One rank's part of a :class:`PoleSpec`: the latitude exchange, then the roll of the rows across the pole
    (one message per peer for both poles: the top and bottom rows travel as one strip). The adjoint runs the
    steps' adjoints in reverse. The interface of :class:`Exchanger` that :func:`exchange` uses."""

    def __init__(self, spec: PoleSpec, h: Exchanger, roll: Exchanger) -> None:
        self.spec, self.h, self.roll = spec, h, roll
        self.op = h.op

    def start(self, x: torch.Tensor) -> dict:
        return self.h.start(x)

    def finish(self, x: torch.Tensor, pending: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        ext = self.h.finish(x, pending, out)
        top, bottom, (dh, _) = self.spec.top, self.spec.bottom, self.spec.dims
        if top or bottom:
            rows = ext.shape[dh]
            strip = torch.cat([ext.narrow(dh, 0, top), ext.narrow(dh, rows - bottom, bottom)], dh)
            rolled = self.roll.finish(strip, self.roll.start(strip))
            ext.narrow(dh, 0, top).copy_(rolled.narrow(dh, 0, top))
            ext.narrow(dh, rows - bottom, bottom).copy_(rolled.narrow(dh, top, bottom))
        return ext

    def adjoint(self, grad_ext: torch.Tensor, x_shape: Sequence[int]) -> torch.Tensor:
        top, bottom, (dh, _) = self.spec.top, self.spec.bottom, self.spec.dims
        if top or bottom:
            rows = grad_ext.shape[dh]
            strip = torch.cat([grad_ext.narrow(dh, 0, top), grad_ext.narrow(dh, rows - bottom, bottom)], dh)
            back = self.roll.adjoint(strip, strip.shape)
            grad_ext = torch.cat([back.narrow(dh, 0, top), grad_ext.narrow(dh, top, rows - top - bottom),
                                  back.narrow(dh, top, bottom)], dh)
        return self.h.adjoint(grad_ext, x_shape)
