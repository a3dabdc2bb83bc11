"""Where each parameter gradient came from and what was done to it since: what lets the sync refuse a wrong scale.

The replicated-weights check cannot see a gradient scale that every rank gets alike (a local ``F.mse_loss`` on the
shard: x P after the sum; clipping before the sum; a second sum of accumulated gradients). So the gradients carry
their provenance, kept on the host (no message, no device read):

* a domain reduction's backward (:func:`halo.parallel.domain_mean` and friends, eager or compiled), and the explicit
  :func:`halo.parallel.local_share` / :func:`halo.parallel.replicated_loss`, mark the backward they run in (its
  autograd graph task) as a *domain* backward;
* every watched parameter (those of a converted model, from its conversion on, and every parameter a sync has
  seen) has a gradient hook. When its gradient arrives in a backward, the hook notes the parameter under that
  backward, and whether it is accumulating into a gradient exactly as the last sync left it (gradient
  accumulation with a sync after every micro-step: the earlier micro-steps would be summed again). At the very end
  of that backward (after DDP's own copy into ``.grad``: a callback that queues itself once more) each noted
  gradient's tensor and version counter are recorded, with whether that backward was a domain one (and whether
  every backward that accumulated into it since the last sync was);
* :func:`check` (the sync, before it sends anything) refuses a gradient from a non-domain backward, a gradient
  written or replaced since its backward (``torch.nn.utils.clip_grad_norm_``, ``GradScaler.unscale_``, ``mul_``:
  its version counter moved), and a gradient a backward accumulated into after a sync; with CREDIT's convention
  (``halo.compat.credit``), a gradient of a halo domain loss. A gradient no backward wrote since the last sync
  (assigned by hand, or on a parameter first seen by this sync) has no record and is not judged.

Every rank of a domain group runs the same program, so every rank makes the same records and raises the same
error; a mistake made on some ranks only (a clip under ``if rank == 0``) raises there, and its peers' sums fail
within the timeout naming the rank (:func:`halo.dist.comm.set_timeout`). A converted model also gets, at conversion
(:func:`watch_model`), a forward pre-hook that refuses a torch DDP around it whose group spans its domain ranks.
State: the :mod:`halo.context` slot ``"reduce_marks"``; the hooks stay on the parameters (one each, marked by
``_halo_grad_watch``).
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from .. import context
from ..dist.comm import comm_group
from .layout import local_grad, synced_as_left

__all__ = ["DOMAIN_LOSSES", "check", "forget", "mark_domain_backward", "no_sync", "syncing", "watch",
           "watch_model"]

#: How the refusals name the losses to use.
DOMAIN_LOSSES = ("halo.parallel.latitude_weighted_mse(pred, target)", "halo.parallel.domain_mean((pred - target) ** 2)",
                 "halo.parallel.domain_sum")
MAX_TASKS = 256
MAX_RECORDS = 1 << 16
WHAT = "sync_domain_gradients"


@dataclasses.dataclass
class _Record:
    param: weakref.ref
    grad: weakref.ref
    version: int
    domain: bool


@dataclasses.dataclass
class _MarkState:
    domain_tasks: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    pending: dict = dataclasses.field(default_factory=dict)  # graph task -> [weakref(param)] seen in it
    fresh: dict = dataclasses.field(default_factory=dict)  # id(param) -> _Record since the last sync
    into_synced: dict = dataclasses.field(default_factory=dict)  # id(param) -> weakref(param)
    quiet: int = 0  # depth of no_sync() windows


def _state() -> _MarkState:
    return context.state("reduce_marks", _MarkState)


def _task() -> int:
    get = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if get is None else int(get())


def mark_domain_backward() -> None:
    """Mark the backward running now as a domain loss's (called by the domain reductions' backward)."""
    task = _task()
    if task < 0:
        return
    tasks = _state().domain_tasks
    tasks[task] = True
    tasks.move_to_end(task)
    while len(tasks) > MAX_TASKS:
        tasks.popitem(last=False)


def _queue(fn) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _arrived(p: torch.Tensor, task: int) -> None:
    """A gradient of ``p`` arrives in backward ``task`` (before it is accumulated into ``p.grad``)."""
    st = _state()
    if p.grad is not None and synced_as_left(p):
        st.into_synced[id(p)] = weakref.ref(p)
    elif id(p) in st.into_synced:  # flagged: kept while backwards only accumulate; zeroed (or written) since, cleared
        rec = st.fresh.get(id(p))
        g = None if p.grad is None else local_grad(p.grad)
        if g is None or rec is None or rec.param() is not p or rec.grad() is not g or rec.version != g._version:
            del st.into_synced[id(p)]
    seen = st.pending.get(task)
    if seen is None:
        while len(st.pending) >= MAX_TASKS:  # backwards that raised before their end: never finished
            del st.pending[next(iter(st.pending))]
        seen = st.pending[task] = []

        def once_more() -> None:  # queued from a final callback: runs after those queued before it (DDP's copy)
            _queue(lambda: _finish(task))

        _queue(once_more)
    seen.append(weakref.ref(p))


def _finish(task: int) -> None:
    """The end of backward ``task``: record every gradient it wrote, with its version now."""
    st = _state()
    domain = bool(st.domain_tasks.pop(task, False))
    if len(st.fresh) > MAX_RECORDS:  # parameters that are gone, never synced (a model trained without the sync)
        for table in (st.fresh, st.into_synced):
            for key in [k for k, v in table.items() if (v.param if isinstance(v, _Record) else v)() is None]:
                del table[key]
    for ref in st.pending.pop(task, []):
        p = ref()
        if p is None or p.grad is None:
            continue
        g = local_grad(p.grad)
        old = st.fresh.get(id(p))
        mine = domain
        if old is not None and old.param() is p and old.grad() is g:  # accumulated since the last sync
            mine = domain and old.domain
        st.fresh[id(p)] = _Record(weakref.ref(p), weakref.ref(g), g._version, mine)


def watch(params: Iterable[torch.Tensor]) -> None:
    """Put the provenance hook on each parameter that requires grad (once per parameter)."""
    for p in params:
        if not isinstance(p, torch.Tensor) or not p.requires_grad or not p.is_leaf or _watched(p):
            continue
        ref = weakref.ref(p)

        def hook(grad: torch.Tensor, ref=ref) -> None:
            q = ref()
            task = _task()
            if q is not None and task >= 0:
                _arrived(q, task)

        handle = p.register_hook(hook)
        try:
            p._halo_grad_watch = handle.id
        except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes: hooked, unmarked
            pass


def _watched(p: torch.Tensor) -> bool:
    """Whether ``p`` has its provenance hook: the mark is the hook's key among ``p``'s backward hooks. Torch never
    serializes a tensor's hooks, but a pickled parameter (``torch.save`` of a whole model) keeps its attributes: a
    mark alone would leave a loaded model's parameters unwatched for good."""
    key = getattr(p, "_halo_grad_watch", None)
    hooks = p._backward_hooks
    return type(key) is int and hooks is not None and key in hooks


def _names(params: list[torch.Tensor], names: Callable[[], list[str]], bad: list[int]) -> str:
    named = names()
    shown = ", ".join(repr(named[i]) for i in bad[:4])
    return f"{len(bad)} of {len(params)} gradients ({shown}{' ...' if len(bad) > 4 else ''})"


def check(params: list[torch.Tensor], names: Callable[[], list[str]], domain_size: int,
          convention: str = "halo") -> None:
    """Refuse, before the sync sends anything, gradients it would sum to a wrong scale (module docstring);
    ``names()``: the parameters' names, made only for a message.
    ``convention``: ``"halo"`` (domain losses, summed) or ``"credit"`` (per-shard means, averaged)."""
    st = _state()
    if not st.fresh and not st.into_synced:
        return
    into, changed, local, domain = [], [], [], []
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        ref = st.into_synced.get(id(p))
        if ref is not None and ref() is p:
            into.append(i)
        rec = st.fresh.get(id(p))
        if rec is None or rec.param() is not p:
            continue
        g = local_grad(p.grad)
        if rec.grad() is not g or g._version != rec.version:
            changed.append(i)
        (domain if rec.domain else local).append(i)
    if into:
        raise RuntimeError(
            f"{WHAT}: a backward accumulated into {_names(params, names, into)} that the previous sync had already "
            f"summed over the domain group (gradient accumulation with a sync after every micro-step): this sync "
            f"would sum the earlier micro-steps again (x{domain_size} on them). Sync once, after the last "
            f"micro-step's backward (the others inside `with halo.parallel.no_sync(model):`), or zero the gradients "
            f"after each sync")
    if changed:
        raise RuntimeError(
            f"{WHAT}: {_names(params, names, changed)} were changed between the backward and the sync (their version "
            f"counters moved, or .grad was replaced: torch.nn.utils.clip_grad_norm_, GradScaler.unscale_, an "
            f"in-place scale): each rank held only its part of the gradient, so a norm or scale taken there is not "
            f"the global one. Sync first, then clip with halo.parallel.clip_grad_norm_(model, max_norm) (the global "
            f"norm, the same on every rank), unscale and step")
    if convention == "halo" and local:
        raise RuntimeError(
            f"{WHAT}: {_names(params, names, local)} come from a backward that went through no halo domain "
            f"reduction: expected the gradient of a domain loss (replicated on every rank, counted once), got a "
            f"loss computed on this rank alone (F.mse_loss(pred_shard, target_shard) is this rank's mean over its "
            f"own rows: about x{domain_size} after the sum over the {domain_size} ranks). Use a domain loss: "
            f"{', '.join(DOMAIN_LOSSES)}; a loss that is this rank's share of a global sum: "
            f"halo.parallel.local_share(loss); a loss computed alike on every rank from whole values (a global "
            f"pool's result): halo.parallel.replicated_loss(loss); CREDIT's per-shard means: "
            f"halo.compat.credit.sync_domain_gradients")
    if convention == "credit" and domain:
        raise RuntimeError(
            f"halo.compat.credit.sync_domain_gradients: {_names(params, names, domain)} come from a halo domain "
            f"loss (domain_mean, latitude_weighted_mse, ...: every row counted once, replicated on every rank), "
            f"whose gradients are summed over the domain group; CREDIT's convention averages them (x1/{domain_size}). "
            f"Use halo.parallel.sync_domain_gradients with halo's losses, or CREDIT's per-shard loss with this sync")


def syncing(params: list[torch.Tensor]) -> None:
    """The sync summed these gradients: their records are spent."""
    st = _state()
    for p in params:
        st.fresh.pop(id(p), None)
        st.into_synced.pop(id(p), None)


def forget(params: Iterable[torch.Tensor]) -> None:
    """Drop the records of ``params`` (a sync that does not judge them: FSDP over every rank)."""
    syncing(list(params))


def quiet() -> bool:
    """Inside a :func:`no_sync` window."""
    return _state().quiet > 0


@contextmanager
def no_sync(model: Any | None = None) -> Iterator[None]:
    """Gradient accumulation: inside the window :func:`halo.parallel.sync_domain_gradients` does nothing (gradients
    keep accumulating, each rank its own part), and a wrapper's own reduction is held back too (DDP's
    ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``). Sync once after the window, after the last
    micro-step's backward: the sum of the accumulated parts is the gradient of the summed loss."""
    st = _state()
    inner = None
    if model is not None and hasattr(model, "no_sync") and callable(model.no_sync):
        inner = model.no_sync()
        inner.__enter__()
    fsdp = model is not None and hasattr(model, "set_requires_gradient_sync")
    if fsdp:
        model.set_requires_gradient_sync(False)
    st.quiet += 1
    try:
        yield
    finally:
        st.quiet -= 1
        if fsdp:
            model.set_requires_gradient_sync(True)
        if inner is not None:
            inner.__exit__(None, None, None)


def _refuse_spanning_ddp(module: torch.nn.Module, args: Any) -> None:
    """A converted model's forward pre-hook: refuse a torch ``DistributedDataParallel`` around it whose process
    group holds other ranks of its domain group (the world group): DDP would average the ranks' *parts* of the
    gradient (x1/P, measured x0.5 on 2 ranks) and the replicated-weights check cannot see it (every rank gets the
    same wrong gradient). Every rank of the domain group runs the same wrapper, so every rank raises alike."""
    if torch.compiler.is_compiling():
        return
    ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or module.__dict__.get("_halo_ddp_checked") == id(ddp):
        return
    root = module.__dict__.get("_halo_root")
    if root is None or not dist.is_initialized():
        return
    domain = comm_group(root.group)
    group = getattr(ddp, "process_group", None)
    wrapped = comm_group(group) if group is not None else comm_group(dist.group.WORLD)
    me = dist.get_rank()
    shared = sorted(set(wrapped.ranks) & set(domain.ranks))
    if domain.size > 1 and shared != [me]:
        raise ValueError(
            f"DistributedDataParallel around a domain-parallel model: its process group holds global ranks "
            f"{list(wrapped.ranks)}, which share global ranks {shared} with the model's domain group "
            f"{list(domain.ranks)} (on global rank {me}); expected a data-parallel group that holds one rank of each "
            f"domain group (this one). DDP would average the ranks' parts of the gradient (x1/{domain.size}). Wrap "
            f"with process_group=manager.data_parallel_group, or use halo.parallelize(model, manager, "
            f"data_parallel='ddp')")
    module.__dict__["_halo_ddp_checked"] = id(ddp)


def watch_model(model: torch.nn.Module) -> None:
    """What a converted model gets at conversion (``convert_to_domain_parallel``): the provenance hooks of its
    parameters (:mod:`halo.parallel.marks`, so that the sync can refuse a wrong gradient scale from the first step)
    and the check of a data-parallel wrapper around it (:func:`_refuse_spanning_ddp`), installed once."""
    watch(model.parameters())
    if "_halo_ddp_hook" not in model.__dict__:
        model.register_forward_pre_hook(_refuse_spanning_ddp)
        model.__dict__["_halo_ddp_hook"] = True
