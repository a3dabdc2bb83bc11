"""Exchangers by plan, addressed by small ints (what a compiled graph holds), and the pole step of a latitude axis.

A plan's spec (group, dim, every rank's extent and needs, boundary, op) gets an id once per context
(:func:`exchanger_id`); the live :class:`~halo.exchange.Exchanger` of an id is made on first use and kept, least
recently used dropped (:func:`get_exchanger`). Both tables are bounded; an evicted or unknown id raises
``LookupError`` and is never reused. A latitude exchange across a pole with longitude sharded is a
:class:`PoleSpec`: the latitude exchange with the mirror boundary, then the rows across the pole rolled along W
(:func:`pole_step`), run by a :class:`PoleExchanger` behind the same id space and interface.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .. import context
from ..dist.comm import CommGroup, comm_group, id_base
from ..plan.partition import POLE_MODES, check_boundary, offsets, plan_exchange
from .exchanger import Exchanger

__all__ = ["ExchangeSpec", "LIVE_CAP", "PoleExchanger", "PoleSpec", "SPECS_CAP", "exchange_spec", "exchanger_id",
           "get_exchanger", "pole_step", "pooled_bytes"]


class ExchangeSpec(NamedTuple):
    """What names an exchanger: the group, the dim, every rank's extent, every rank's needs, boundary, op name."""

    group: Any
    dim: int
    sizes: tuple[int, ...]
    needs: tuple[tuple[int, int], ...]
    boundary: str
    op: str


#: Exchange plans remembered per context (least recently planned dropped first; one whose exchanger is live is
#: kept). Each is a few hundred bytes: the cap bounds a process that plans ever new shapes (a sweep of sizes).
SPECS_CAP = 16384
#: Exchangers (with their buffers) kept live per context, least recently used dropped (made again from the spec).
LIVE_CAP = 256


@dataclasses.dataclass
class _ExchangeState:
    """The exchangers' part of the context: specs by id (ids never reused within a context) and live exchangers."""

    ids: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # spec -> id, LRU
    specs: dict = dataclasses.field(default_factory=dict)  # id -> spec
    live: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # id -> Exchanger
    next_id: int = dataclasses.field(default_factory=id_base)
    poles: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # PoleSpec -> id
    pole_specs: dict = dataclasses.field(default_factory=dict)  # id -> PoleSpec


def _state() -> _ExchangeState:
    return context.state("exchange", _ExchangeState)


def exchanger_id(cg: CommGroup, dim: int, sizes: Sequence[int], needs: Sequence[tuple[int, int]], boundary: str,
                 op: str = "halo_exchange") -> int:
    """The id of this rank's exchanger for a plan (made and cached on first use). ``sizes``: every rank's extent
    along ``dim``; ``needs[r]``: the virtual rows rank ``r`` needs. Both must be agreed (the same on every rank)."""
    spec = ExchangeSpec(cg.group, dim, tuple(int(s) for s in sizes), tuple((int(a), int(b)) for a, b in needs),
                        check_boundary(boundary), op)
    state = _state()
    ex_id = state.ids.get(spec)
    if ex_id is not None:
        state.ids.move_to_end(spec)
        return ex_id
    try:
        _plan(spec.sizes, spec.needs, spec.boundary)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    ex_id = state.ids[spec] = state.next_id
    state.specs[ex_id] = spec
    state.next_id += 1
    _evict(state)
    return ex_id


def _evict(state: _ExchangeState) -> None:
    """Drop the least recently planned specs beyond :data:`SPECS_CAP` (a live exchanger's spec is kept)."""
    for _ in range(len(state.ids) - SPECS_CAP):
        spec, ex_id = next(iter(state.ids.items()))
        state.ids.move_to_end(spec)
        if ex_id not in state.live:
            del state.ids[spec], state.specs[ex_id]


def exchange_spec(ex_id: int) -> ExchangeSpec:
    """The spec of exchanger ``ex_id`` (of its latitude step, for a :func:`pole_step`); a clear error for an id
    this context does not know (evicted past :data:`SPECS_CAP`, or made before ``halo.context.reset()`` or in
    another context): never another's spec."""
    state = _state()
    pole = state.pole_specs.get(ex_id)
    spec = state.specs.get(ex_id if pole is None else pole.h)
    if spec is None:
        raise LookupError(f"halo: exchanger id {ex_id} is unknown in this context (made before halo.context.reset(), "
                          f"in another halo.context.use() block, or dropped past halo.exchange._registry.SPECS_CAP="
                          f"{SPECS_CAP} plans): plan the exchange again")
    return spec


@functools.lru_cache(maxsize=1024)
def _plan(sizes: tuple[int, ...], needs: tuple[tuple[int, int], ...], boundary: str):
    return plan_exchange(sizes, needs, boundary)


def get_exchanger(ex_id: int) -> Exchanger | PoleExchanger:
    """The exchanger of id ``ex_id`` (rebuilt if it was evicted; its buffers go with it)."""
    state = _state()
    live = state.live
    ex = live.get(ex_id)
    if ex is None:
        pole = state.pole_specs.get(ex_id)
        if pole is not None:
            ex = PoleExchanger(pole, get_exchanger(pole.h), get_exchanger(pole.roll))
        else:
            spec = exchange_spec(ex_id)
            cg = comm_group(spec.group)
            ex = Exchanger(_plan(spec.sizes, spec.needs, spec.boundary).ranks[cg.index], cg, spec.dim,
                           spec.boundary, spec.op)
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
    together. Pure in agreed values (raises alike on every rank); ids as :func:`exchanger_id` (never reused).
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
    pole = PoleSpec(h, roll, top, bottom, (spec.dim, w_dim))
    state = _state()
    pole_id = state.poles.get(pole)
    if pole_id is None:
        pole_id = state.poles[pole] = state.next_id
        state.pole_specs[pole_id] = pole
        state.next_id += 1
        while len(state.poles) > SPECS_CAP:  # bounded as the specs; an evicted id is unknown, never reused
            dropped, old = state.poles.popitem(last=False)
            del state.pole_specs[old]
    else:
        state.poles.move_to_end(pole)
    return pole_id


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
