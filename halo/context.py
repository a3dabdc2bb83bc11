"""One state object: everything halo remembers between calls lives in a :class:`HaloContext`.

Each module that keeps state across calls (the planner's epochs and records, the exchangers' specs, the groups'
ids, host buffers, timeouts, the default manager, ...) declares it as a small class of its own and asks the
current context for its instance::

    @dataclasses.dataclass
    class _CommState:
        timeout: float | None = None
        groups: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)

    def _state() -> _CommState:
        return context.state("comm", _CommState)

so the context never imports the modules whose state it holds (it sits below all of them), and no module keeps a
mutable global of its own. :meth:`HaloContext.reset` drops every module's state at once — the next access makes a
fresh instance from its factory — and :func:`use` runs a block under a fresh (or given) context, which is how tests
isolate themselves instead of monkeypatching module globals. The process-wide default context is a convenience
over this: ``halo.context.current()``.

Resetting while a converted model is mid-call, or while messages are in flight, is the caller's error (the same
as destroying a process group then); between steps it is safe: plans are learned again at the next call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["HaloContext", "Watch", "current", "made", "place", "reset", "state", "trusted", "use", "watch"]

T = TypeVar("T")


class HaloContext:
    """What halo remembers between calls: one instance of each module's state class, made on first access."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[str, Any] = {}

    def state(self, name: str, factory: Callable[[], T]) -> T:
        """The state named ``name``, made by ``factory()`` on first access (and again after :meth:`reset`)."""
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = factory()
        return slot

    def reset(self) -> None:
        """Forget everything: plans, epochs, provenance, records, exchangers, groups' ids, host buffers, timeouts,
        guard state and the default manager. A state class may define ``close()`` (called first)."""
        slots, self._slots = self._slots, {}
        for slot in slots.values():
            close = getattr(slot, "close", None)
            if close is not None:
                close()

    def names(self) -> tuple[str, ...]:
        """The states made so far (for tests and debugging)."""
        return tuple(self._slots)

    def __repr__(self) -> str:
        return f"HaloContext({', '.join(self._slots) or 'empty'})"


class _Current:
    """The context in use: the only mutable module-level object in halo (a holder, so readers never keep a stale
    reference)."""

    __slots__ = ("ctx",)

    def __init__(self) -> None:
        self.ctx = HaloContext()


_CURRENT = _Current()


def current() -> HaloContext:
    """The context in use (the process-wide default unless inside :func:`use`)."""
    return _CURRENT.ctx


def state(name: str, factory: Callable[[], T]) -> T:
    """``current().state(name, factory)``: the hot path of every module's ``_state()``."""
    slots = _CURRENT.ctx._slots
    slot = slots.get(name)
    if slot is None:
        slot = slots[name] = factory()
    return slot


@torch.compiler.substitute_in_graph(state)
def _traced_state(name: str, factory: Callable[[], T]) -> T:
    """What dynamo traces for :func:`state` (``substitute_in_graph``: eager runs the plain lookup).

    A user's first call of a model is often ``torch.compile(model)(x)``, so a state may first be asked for while
    dynamo traces. Its factory cannot run in the graph (dynamo cannot make a ``WeakKeyDictionary``; and a state
    made by the graph would be made again at each run from what the trace saw: one salt for every context), and a
    trace that read the slot empty would guard on its being empty, though it is filled by the time the graph runs
    (by the trace, or by code dynamo runs at trace time: a plan's ``assume_constant_result``). So a trace that does
    not see the slot has it filled for real and starts over (:func:`_fill`): the graph reads the slot filled and
    guards on that, as for a state made before the call."""
    _fill(name, factory, name in _CURRENT.ctx._slots)
    return _CURRENT.ctx._slots[name]


@torch._dynamo.assume_constant_result
def _fill(name: str, factory: Callable[[], Any], seen: bool) -> bool:
    """Run at trace time: where the trace has not ``seen`` the slot (empty then, or filled after dynamo read the
    slots), make the state if there is none and trace the frame again (dynamo's ``RestartAnalysis``: the next trace
    reads the slots afresh; once per state and frame, ``fullgraph=True`` too). The branch is in here, so that both
    traces take the same path through the traced code (dynamo checks that a restarted trace does)."""
    if not seen:
        slots = _CURRENT.ctx._slots
        if name not in slots:
            slots[name] = factory()
        raise torch._dynamo.exc.RestartAnalysis(restart_reason=f"halo: the context's {name!r} state was made")
    return True


def reset() -> None:
    """Reset the context in use (:meth:`HaloContext.reset`)."""
    _CURRENT.ctx.reset()


@contextlib.contextmanager
def use(ctx: HaloContext | None = None) -> Iterator[HaloContext]:
    """Run the block under ``ctx`` (default: a fresh context); the previous one is back afterwards, untouched."""
    ctx = HaloContext() if ctx is None else ctx
    before, _CURRENT.ctx = _CURRENT.ctx, ctx
    try:
        yield ctx
    finally:
        _CURRENT.ctx = before


# -- what the layers tell the guard (below both: the layers never import the guard) ------------------------------------

@dataclasses.dataclass
class Watch:
    """What code tells the guard of a converted model's first call (:mod:`halo.guard`) without importing it: the
    depth of :class:`trusted` blocks being run (> 0: the guard checks nothing there, and the reroute computes no
    site there), and the guard watching now (``None`` outside a guarded first call: the guard sets it on entering
    and clears it on leaving). The slot is ``"reroute"``, its name since the reroute held it."""

    trusted: int = 0
    guard: Any = None


def watch() -> Watch:
    """The :class:`Watch` of the context in use."""
    return state("reroute", Watch)


class trusted:  # noqa: N801 - a context manager, named like one
    """``with halo.guard.trusted():`` the guard does not check the ops in this block (code you know is right on a
    shard: the guard assumes dim -2 of a 3-d or larger tensor is H unless it followed the tensor there), and autograd
    nodes made in it are trusted too. Defined here, below the layers, so that a layer marks its own code trusted
    without importing the guard; :mod:`halo.guard` re-exports it."""

    def __enter__(self) -> trusted:
        w = self._watch = watch()  # (the context entered in: exit undoes it there)
        w.trusted += 1
        self._guard = w.guard
        self._start = self._guard.trust_begin() if self._guard is not None else None
        return self

    def __exit__(self, *exc: Any) -> None:
        self._watch.trusted -= 1
        if self._guard is not None:
            self._guard.trust_end(self._start)


def made(out: Any) -> None:
    """Tell the guard of a converted model's first call that ``out`` is a halo layer's output: a field split over
    the ranks with at least one row on each, so a shard of 1 row is a row of it, not a tensor that broadcasts (a
    bias, a ``(B, C, 1, 1)`` scale). A no-op when no guard is watching (and under ``torch.compile``: no guard
    watches a compiled region, and a read of the context state there would be a side effect to trace)."""
    if torch.compiler.is_compiling():
        return
    guard = watch().guard
    if guard is not None:
        guard.made_field(out)


def place(t: Any, dim: int, rows: int | None = None) -> None:
    """Tell the guard of a converted model's first call where ``t``, a halo layer's output, holds the sharded rows:
    at ``dim`` (``rows`` of them; more when later dims are merged into it, as tokens). For layers whose output is
    not ``(..., H, W)`` with H at -2: channels-last blocks (Swin, NATTEN), tokens, W-shards (``rows_to_columns``).
    Without it the guard would take dim -2 for H and pass a reduction over the real H (silently wrong). A no-op when
    no guard is watching (re-exported by :mod:`halo.guard`)."""
    guard = watch().guard
    if guard is not None:
        guard.place(t, dim, rows)
