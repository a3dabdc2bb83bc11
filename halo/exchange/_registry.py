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
from ..dist import transport
from ..dist.comm import CommGroup, comm_group, id_base
from ..plan.partition import POLE_MODES, check_boundary, offsets, plan_exchange, source_row
from ..plan.plans import device_tensor, hold
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
    an activation. A pole exchanger's steps are counted once (they are live exchangers of their own), its own strips
    (the rows across the pole and their gradients) with it."""
    return sum(ex.pool.nbytes() for ex in _state().live.values())


# -- the pole, a step of the latitude axis ------------------------------------------------------------------------

class PoleSpec(NamedTuple):
    """A latitude exchange across a pole with longitude sharded: exchange ``h`` (the latitude rows with the mirror
    boundary), and the ``top`` / ``bottom`` rows of its result (those across the pole) rolled by half the
    longitudes by exchange ``roll`` over the longitude group (at once with ``h`` where those mirrored rows are the
    rank's own: :class:`PoleExchanger`). ``dims``: the latitude and longitude tensor dims."""

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
    """One rank's part of a :class:`PoleSpec`: the latitude exchange and the roll of the rows across the pole (one
    message per peer for both poles: the top and bottom rows travel as one strip). The interface of
    :class:`Exchanger` that :func:`exchange` and compute-then-patch (``halos`` / ``start_adjoint`` /
    ``finish_adjoint``) use.

    Overlapped where it can be: the rows across the pole are this rank's own mirrored rows (``reflect`` /
    ``symmetric`` of its first / last rows) rolled by W/2, so when the rank holds every one of them (``own``) the
    roll's strip is gathered from the shard itself and posted in :meth:`start`, at once with the latitude exchange
    (two groups), and both are waited on in :meth:`finish`; the latitude exchange's own copies of those rows (a
    message to itself) are overwritten. Otherwise (a shard thinner than the halo: the mirrored rows come from
    another rank) the roll runs after the latitude exchange, on its result. The adjoint alike: the rows' gradients
    rolled back and the latitude adjoint (with the pole rows' gradients zero) posted at once, the rolled-back
    gradients added onto the mirrored rows after; or, serially, the roll's adjoint first. Strips live in this
    exchanger's pool (message strips only, as :class:`Exchanger`'s).

    Order: the roll is posted on the W group in :meth:`start` where overlapped, in :meth:`finish` / :meth:`halos`
    (after the latitude wait) where serial, and its adjoint in :meth:`start_adjoint` either way, alike on every rank
    of a W line (they share their latitude position, so the same ``own``): messages between two ranks of a group are
    told apart by order alone, so a caller with other W messages in flight posts them in one order on every rank.
    """

    def __init__(self, spec: PoleSpec, h: Exchanger, roll: Exchanger) -> None:
        self.spec, self.h, self.roll = spec, h, roll
        self.op = h.op
        self.sides = h.sides  # which halo rows hold data (compute-then-patch's live sides): the latitude plan's
        self.pool = transport.BufferPool()
        hs = h.ref.spec
        self.own = _own_rows(hs.sizes, hs.needs, hs.boundary, h.cg.index, spec.top, spec.bottom)
        # The roll's rows are all "after" (each rank needs W/2 columns away, never its own): its halos alone.
        rp = roll.plan
        self.roll_after_only = not rp.before and rp.interior[1] == 0

    # forward ------------------------------------------------------------------------------------------
    def start(self, x: torch.Tensor) -> dict:
        pending = {"h": self.h.start(x)}
        if self.own is not None:
            strip = self._strip_like(x)
            torch.index_select(x, self.spec.dims[0], _rows_index(self.own[0] + self.own[1], x.device), out=strip)
            pending["strip"], pending["roll"] = strip, self.roll.start(strip)
        return pending

    def finish(self, x: torch.Tensor, pending: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        ext = self.h.finish(x, pending["h"], out)
        top, bottom, (dh, _) = self.spec.top, self.spec.bottom, self.spec.dims
        if top or bottom:
            rows = ext.shape[dh]
            if "roll" not in pending:  # serial: the rows across the pole are the latitude exchange's
                strip = self._strip_like(ext)
                strip.narrow(dh, 0, top).copy_(ext.narrow(dh, 0, top))
                strip.narrow(dh, top, bottom).copy_(ext.narrow(dh, rows - bottom, bottom))
                pending = {"strip": strip, "roll": self.roll.start(strip)}
            rolled = self._rolled(pending["strip"], pending["roll"])
            ext.narrow(dh, 0, top).copy_(rolled.narrow(dh, 0, top))
            ext.narrow(dh, rows - bottom, bottom).copy_(rolled.narrow(dh, top, bottom))
        return ext

    def halos(self, x: torch.Tensor, pending: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The halo rows alone, ``(before, after)`` (as :meth:`Exchanger.halos`), the rows across the pole rolled."""
        before, after = self.h.halos(x, pending["h"])
        top, bottom, (dh, _) = self.spec.top, self.spec.bottom, self.spec.dims
        if not (top or bottom):
            return before, after
        if "roll" not in pending:
            strip = self._strip_like(x)
            strip.narrow(dh, 0, top).copy_(before.narrow(dh, 0, top))
            strip.narrow(dh, top, bottom).copy_(after.narrow(dh, after.shape[dh] - bottom, bottom))
            pending = {"strip": strip, "roll": self.roll.start(strip)}
        rolled = self._rolled(pending["strip"], pending["roll"])
        nb, na = before.shape[dh], after.shape[dh]
        if top:
            part = rolled.narrow(dh, 0, top)
            before = part if top == nb else torch.cat([part, before.narrow(dh, top, nb - top)], dh)
        if bottom:
            part = rolled.narrow(dh, top, bottom)
            after = part if bottom == na else torch.cat([after.narrow(dh, 0, na - bottom), part], dh)
        return before, after

    def _strip_like(self, x: torch.Tensor) -> torch.Tensor:
        """A pooled strip of the ``top + bottom`` rows across the pole, ``x``'s other extents (a message strip)."""
        dh = self.spec.dims[0]
        shape = list(x.shape)
        shape[dh] = self.spec.top + self.spec.bottom
        return transport.alloc(shape, x, self.pool)

    def _rolled(self, strip: torch.Tensor, pending: dict) -> torch.Tensor:
        """Wait for the roll of ``strip``: its rows rolled by W/2 (a view of the roll's buffers where it can)."""
        if self.roll_after_only:
            return self.roll.halos(strip, pending)[1]
        return self.roll.finish(strip, pending)

    # adjoint ------------------------------------------------------------------------------------------
    def adjoint(self, grad_ext: torch.Tensor, x_shape: Sequence[int]) -> torch.Tensor:
        """``grad_x`` (as :meth:`Exchanger.adjoint`): the roll's adjoint and the latitude adjoint, at once where the
        rows across the pole are this rank's own."""
        dh = self.spec.dims[0]
        p = self.h.plan
        nb, (i0, ni) = len(p.before), p.interior
        before, after = grad_ext.narrow(dh, 0, nb), grad_ext.narrow(dh, nb + ni, len(p.after))
        interior = grad_ext.narrow(dh, nb, ni)
        if (i0, ni) != (0, x_shape[dh]):  # a trimmed exchange: the gradient covers only part of x
            full = grad_ext.new_zeros(tuple(x_shape))
            full.narrow(dh, i0, ni).copy_(interior)
            return self.finish_adjoint(self.start_adjoint(before, after, full), full, full)
        return self.finish_adjoint(self.start_adjoint(before, after, interior), interior, None)

    def start_adjoint(self, before: torch.Tensor | None, after: torch.Tensor | None, like: torch.Tensor) -> dict:
        """Post the adjoint of :meth:`halos` (as :meth:`Exchanger.start_adjoint`): the pole rows' gradients rolled
        back along W and the halo rows' gradients back along H; do not wait."""
        top, bottom, (dh, _) = self.spec.top, self.spec.bottom, self.spec.dims
        if not (top or bottom):
            return {"h": self.h.start_adjoint(before, after, like)}
        g = self._strip_like(like)
        nb = before.shape[dh] if before is not None else 0
        na = after.shape[dh] if after is not None else 0
        if top:
            g.narrow(dh, 0, top).copy_(before.narrow(dh, 0, top))
        if bottom:
            g.narrow(dh, top, bottom).copy_(after.narrow(dh, na - bottom, bottom))
        pend_roll = self.roll.start_adjoint(None, g, g)
        if self.own is None:  # serial: the rows rolled back are the latitude exchange's halo rows' gradients
            back = self._unrolled(pend_roll, g)
            before, after = self._pole_rows_set(before, after, back, nb, na, like)
            return {"h": self.h.start_adjoint(before, after, like)}
        before, after = self._pole_rows_set(before, after, None, nb, na, like)  # their part is the roll's
        return {"h": self.h.start_adjoint(before, after, like), "roll": pend_roll, "g": g}

    def finish_adjoint(self, pending: dict, base: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Wait for :meth:`start_adjoint` and add what arrives onto ``base``'s rows (as
        :meth:`Exchanger.finish_adjoint`), the rolled-back rows onto the mirrored rows they came from."""
        res = self.h.finish_adjoint(pending["h"], base, out)
        if "roll" in pending:
            back = self._unrolled(pending["roll"], pending["g"])
            if res is base and out is not base:
                res = base.clone()
            dh, (top_rows, bottom_rows) = self.spec.dims[0], self.own
            top = len(top_rows)
            for at, rows in ((0, top_rows), (top, bottom_rows)):  # each side's rows distinct: no two adds race
                if rows:
                    res.index_add_(dh, _rows_index(rows, res.device), back.narrow(dh, at, len(rows)))
        return res

    def _unrolled(self, pending: dict, g: torch.Tensor) -> torch.Tensor:
        """Wait for the roll's adjoint of ``g``: the strip's gradient (the rows rolled back by W/2), pooled."""
        base = self._strip_like(g).zero_()
        return self.roll.finish_adjoint(pending, base, base)

    def _pole_rows_set(self, before: torch.Tensor | None, after: torch.Tensor | None, rows: torch.Tensor | None,
                       nb: int, na: int, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``before`` / ``after`` with their rows across the pole replaced by ``rows`` (zeros when ``None``), in
        pooled copies (never the caller's tensors, which may be autograd's gradient)."""
        top, bottom, dh = self.spec.top, self.spec.bottom, self.spec.dims[0]
        out = []
        for t, n, k, at, first in ((before, nb, top, 0, True), (after, na, bottom, top, False)):
            if not k:
                out.append(t)
                continue
            shape = list(t.shape)
            buf = transport.alloc(shape, like, self.pool)
            pole, rest = (buf.narrow(dh, 0, k), buf.narrow(dh, k, n - k)) if first else \
                (buf.narrow(dh, n - k, k), buf.narrow(dh, 0, n - k))
            if rows is None:
                pole.zero_()
            else:
                pole.copy_(rows.narrow(dh, at, k))
            rest.copy_(t.narrow(dh, k, n - k) if first else t.narrow(dh, 0, n - k))
            out.append(buf)
        return out[0], out[1]


def _own_rows(sizes: tuple[int, ...], needs: tuple[tuple[int, int], ...], mirror: str, index: int, top: int,
              bottom: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The local rows of rank ``index`` that its ``top`` / ``bottom`` rows across the pole mirror (in halo row
    order), or ``None`` where some are another rank's (a shard thinner than the halo: the serial path)."""
    offs, n = offsets(sizes), sum(sizes)
    start, stop = offs[index], offs[index + 1]
    lo, hi = needs[index]
    sides = []
    for vs in (range(lo, lo + top), range(hi - bottom, hi)):
        rows = []
        for v in vs:
            g, _ = source_row(v, n, mirror)
            if g is None or not start <= g < stop:
                return None
            rows.append(g - start)
        sides.append(tuple(rows))
    return (sides[0], sides[1]) if top or bottom else None


def _rows_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return device_tensor(rows, torch.int64, device)
