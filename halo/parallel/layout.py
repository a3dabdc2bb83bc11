"""Which gradients a gradient sync sends, decided alike on every rank of its groups (no rank waits alone).

:func:`halo.parallel.sync_domain_gradients` sums gradients in flat buckets, whose layout must be the same on every
rank: an all-reduce of buckets that differ pairs different bytes (gloo, measured: a silent wrong sum on one rank, an
abort on the other) and an agreement one rank starts alone waits for peers that are in the all-reduce (both time
out). Which parameters got a gradient in this backward is known to each rank alone and may change on one rank
only (a branch taken on its rows, an expert no row of its shard was routed to), so it never decides the layout.
The layout is the parameters that require grad, agreed on the host once per (groups, parameter objects): every
rank meets a new list of parameters in the same call, and the agreement raises the same ``ValueError`` on every
rank when the lists differ, naming the parameters and ranks. A rank without a gradient for one of them sends
zeros.

Every sync's first bucket carries a *status* section through the same all-reduce: one slot per parameter of the
layout, 1 where this rank has its gradient (the sum counts the ranks that have one), and one per global rank, 1
where that rank's ``requires_grad`` flags no longer match the layout. A rank that has every gradient and kept the
layout reads nothing back (the steady step, invariant 7). A rank missing a gradient reads the status once, after
the all-reduce: it keeps the sum where some rank had a gradient and sets ``None`` where no rank had one (as the
unsharded model, which did not use that parameter); the counts are the same on every rank, so every rank decides
alike. ``requires_grad`` changed on every rank alike (freezing, unfreezing) is agreed anew by every rank in the
same call; changed on some ranks only, every rank that reads the status raises ``ValueError`` naming the ranks
and parameters, and a rank that needs no read learns it, without a message in every step, only from the
``HaloCommError`` its next collective raises within the timeout. (Where no parameter travels, no all-reduce carries
the status: the ranks whose flags changed agree anew, which only ends well when every rank changed alike.)

State (the :mod:`halo.context` slot ``"reduce"``): the agreed layouts (per group, a least-recently-used table of
:data:`MAX_LAYOUTS`: the ranks of a group meet the same lists in the same order, so they evict alike), the status
sections made (:data:`MAX_STATUS`) and each gradient as the last sync left it (for :func:`refuse_second_sync`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import weakref

import torch

from .. import context
from ..dist import comm
from ..dist.comm import CommGroup

__all__ = ["Layout", "MAX_LAYOUTS", "MAX_STATUS", "agree_layout", "layout_of", "local_grad", "mark_synced",
           "refuse_second_sync", "settle", "status_section", "synced_as_left"]

#: Layouts remembered per group (least recently used dropped first).
MAX_LAYOUTS = 64
#: Status sections remembered (one per device, dtype, presence pattern; least recently used dropped first).
MAX_STATUS = 64
WHAT = "sync_domain_gradients"


@dataclasses.dataclass(frozen=True)
class Layout:
    """An agreed layout: the parameters it was agreed for (weakly), their ``requires_grad`` flags then, and the
    positions of those that travel (the flags that were set), in order."""

    refs: tuple[weakref.ref, ...]
    requires: tuple[bool, ...]
    travel: tuple[int, ...]


@dataclasses.dataclass
class _ReduceState:
    layouts: dict = dataclasses.field(default_factory=dict)  # group ranks -> OrderedDict(parameter ids -> Layout)
    status: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    synced: dict = dataclasses.field(default_factory=dict)  # id(param) -> (ref(param), ref(grad), grad version)


def _state() -> _ReduceState:
    return context.state("reduce", _ReduceState)


def local_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient's tensor on this rank: the local shard of a DTensor (FSDP2, HSDP), written in place."""
    return g._local_tensor if hasattr(g, "_local_tensor") and hasattr(g, "device_mesh") else g


def _key(infos: list[CommGroup]) -> tuple:
    return tuple(info.ranks for info in infos)


def layout_of(params: list[torch.Tensor], infos: list[CommGroup]) -> Layout | None:
    """The layout agreed for these parameter objects over these groups, or ``None`` (then :func:`agree_layout`).
    A parameter freed since (and its id reused) is a miss on every rank alike: its peers never met this list."""
    table = _state().layouts.get(_key(infos))
    layout = None if table is None else table.get(tuple(id(p) for p in params))
    if layout is None or any(r() is not p for r, p in zip(layout.refs, params, strict=True)):
        return None
    table.move_to_end(tuple(id(p) for p in params))
    return layout


def _words(requires: tuple[bool, ...], params: list[torch.Tensor], locals_: list[torch.Tensor]) -> list[int]:
    """``[count, travelling, digest]`` of the flags and of the travelling gradients' sizes, dtypes and devices."""
    sizes = [(i, t.numel(), str(t.dtype), t.device.type) for i, t in enumerate(locals_) if requires[i]]
    digest = hashlib.blake2b(repr((requires, sizes)).encode(), digest_size=8).digest()
    return [len(params), sum(requires), int.from_bytes(digest, "little", signed=True)]


def agree_layout(params: list[torch.Tensor], locals_: list[torch.Tensor], names: list[str],
                 infos: list[CommGroup]) -> Layout:
    """Agree on which of ``params`` travel (those that require grad) over every group of ``infos``, in order: one
    host all-gather of three words per group; every group is asked before any rank raises, so a disagreement in
    one group is the same ``ValueError`` on every rank of the others too. ``locals_``: each parameter's tensor on
    this rank (a DTensor's local shard), whose sizes make the buckets."""
    requires = tuple(p.requires_grad for p in params)
    words = _words(requires, params, locals_)
    failed = None
    for info in infos:
        table = comm.gather_words([*words, int(failed is not None)], info, WHAT)
        if (table[:, :3] != table[info.index, :3]).any():  # every rank of this group sees it: all describe it
            message = _describe(requires, locals_, names, info)  # (a collective: never skipped by a short circuit)
            failed = failed or message
        elif table[:, 3].any():
            failed = failed or (f"{WHAT}: the ranks of another group of this sync pass different parameters that "
                                f"require grad (their error names them); pass the same model on every rank")
    if failed:
        raise ValueError(failed)
    layout = Layout(tuple(weakref.ref(p) for p in params), requires, tuple(i for i, r in enumerate(requires) if r))
    tables = _state().layouts
    table = tables.setdefault(_key(infos), collections.OrderedDict())
    table[tuple(id(p) for p in params)] = layout
    if len(table) > MAX_LAYOUTS:
        table.popitem(last=False)
    return layout


def _describe(requires: tuple[bool, ...], locals_: list[torch.Tensor], names: list[str], info: CommGroup) -> str:
    """The message of a layout the ranks of ``info`` disagree on (every rank of ``info`` calls this)."""
    sizes = [(tuple(t.shape), str(t.dtype)) if r else None for t, r in zip(locals_, requires, strict=True)]
    rows = comm.all_gather_object((requires, sizes), info, WHAT)
    where = f"group ranks 0..{info.size - 1} (global {list(info.ranks)})"
    if len({len(flags) for flags, _ in rows}) != 1:
        return (f"{WHAT}: the ranks pass different numbers of parameters: {[len(flags) for flags, _ in rows]} on "
                f"{where}; pass the same model on every rank")
    diffs = []
    for i, name in enumerate(names):
        column = [(flags[i], shapes[i]) for flags, shapes in rows]
        if len(set(column)) > 1:
            on = [info.ranks[r] for r, (flag, _) in enumerate(column) if flag]
            shapes = {info.ranks[r]: s for r, (_, s) in enumerate(column) if s is not None}
            diffs.append(f"{name} requires grad on global ranks {on} (local shapes, dtypes: {shapes})")
    return (f"{WHAT}: the ranks of {where} disagree on the parameters that require grad: {'; '.join(diffs[:8])}"
            f"{' ...' if len(diffs) > 8 else ''}; set requires_grad alike on every rank (and pass the same model)")


def status_section(present: tuple[bool, ...], dirty: bool, world: int, me: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """The status section of a bucket (module docstring): ``present`` per travelling parameter, then a 1 at slot
    ``me`` of ``world`` if this rank's flags left the layout. Made once per pattern, device and dtype (never mutate
    it): the steady step builds no tensor from Python data."""
    key = (present, dirty, world, me, device, dtype)
    cache = _state().status
    out = cache.get(key)
    if out is None:
        host = torch.zeros(len(present) + world, dtype=torch.float64)
        view = host.numpy()  # written through numpy: no tensor from Python data
        view[:len(present)] = present
        view[len(present) + me] = float(dirty)
        out = host.to(device=device, dtype=dtype)
        cache[key] = out
        if len(cache) > MAX_STATUS:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return out


def settle(status: torch.Tensor, present: tuple[bool, ...], changed: list[str], infos: list[CommGroup]
           ) -> tuple[list[bool], bool]:
    """Read the summed ``status`` where this rank must (a gradient missing here, or its flags left the layout) and
    return ``(kept, relayout)``: per travelling parameter whether some rank had its gradient, and whether every
    rank's flags left the layout (every rank then agrees anew, in this call). Some ranks only: ``ValueError``
    (``changed``: the parameters whose flag changed here, by name)."""
    if all(present) and not changed:
        return [True] * len(present), False
    values = status.tolist()  # one read, after the all-reduce (only where a gradient is missing or flags changed)
    counts, slots = values[:len(present)], values[len(present):]
    moved = [g for g, v in enumerate(slots) if v > 0]
    everyone = 1
    for info in infos:
        everyone *= info.size
    if moved and len(moved) < everyone:
        here = f"here: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}" if changed else "not here"
        raise ValueError(f"{WHAT}: requires_grad changed on global ranks {moved} only (of {everyone}) since the ranks "
                         f"agreed on the parameters that require grad ({here}): the sum would miss their parts; set "
                         f"requires_grad alike on every rank")
    return [c > 0 for c in counts], bool(moved)


def mark_synced(params: list[torch.Tensor]) -> None:
    """Remember every synced gradient (the tensor and its version counter, which any later write bumps)."""
    synced = _state().synced
    if len(synced) > 4 * max(len(params), 1024):  # forget parameters that are gone
        for key in [k for k, (p, _, _) in synced.items() if p() is None]:
            del synced[key]
    for p in params:
        if p.grad is not None:
            g = local_grad(p.grad)
            synced[id(p)] = (weakref.ref(p), weakref.ref(g), g._version)


def synced_as_left(p: torch.Tensor) -> bool:
    """Whether ``p.grad`` is exactly as the last sync left it (its tensor, and no write since)."""
    mark = _state().synced.get(id(p))
    if mark is None or mark[0]() is not p or p.grad is None:
        return False
    g = local_grad(p.grad)
    return mark[1]() is g and g._version == mark[2]


def refuse_second_sync(params: list[torch.Tensor]) -> None:
    """Raise if a gradient is exactly as the last sync left it (not written by a backward or zeroed since): summing
    it again would multiply it by the domain size. A backward (new gradients, or accumulation into them) and
    ``zero_grad`` clear the mark; no communication, a Python loop over the parameters."""
    synced = _state().synced
    if not synced:
        return
    stale = 0
    for p in params:
        if p.grad is None:
            continue
        mark = synced.get(id(p))
        if mark is not None and mark[0]() is p:
            g = local_grad(p.grad)
            if mark[1]() is g and g._version == mark[2]:
                stale += 1
    if stale:
        raise RuntimeError(
            f"{WHAT}: {stale} of {len(params)} gradients are exactly as the previous sync_domain_gradients left them "
            f"(no backward and no zero_grad since): it was called twice for one backward, which would sum the "
            f"summed gradients again (x the domain size). Call it once per step, after the backward (with a "
            f"data-parallel wrapper, once in all: the wrapper's own averaging is not a sync)")
