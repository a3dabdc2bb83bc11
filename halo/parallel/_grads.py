"""Gradient sync and gradient norms of a domain-parallel model (fp32 accumulation for half gradients).

After a replicated loss's ``backward()`` (:mod:`halo.parallel.reduce`: a domain reduction counts once) each rank's
parameter gradient is its own part of the global gradient, and

    loss = latitude_weighted_mse(pred, target); loss.backward(); sync_domain_gradients(model)

(sum over the domain group, mean over the data-parallel group) gives exactly the unsharded gradient of the
mean loss over the full batch. A term that is *not* a domain reduction (a weight penalty computed on every
rank) is summed P times by the sync: divide it by the domain size, or add its gradient after the sync. Which
gradients travel is decided alike on every rank (:mod:`halo.parallel.layout`); the norms are local after the sync.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dist.comm import CommGroup, comm_group
from ..dist.comm import all_reduce as bounded_all_reduce
from ..dist.mesh import DomainParallelManager, get_domain_parallel_manager
from ..dist.transport import eager_only
from .layout import agree_layout, layout_of, local_grad, mark_synced, refuse_second_sync, settle, status_section
from .marks import check as check_marks
from .marks import forget, quiet, syncing, watch

__all__ = ["accumulation_dtype", "clip_grad_norm_", "grad_norm", "local_grad", "sync_domain_gradients"]

_HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 (invariant 5), the dtype itself otherwise."""
    return torch.float32 if dtype in _HALF else dtype


def _params(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    seen, out = set(), []
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _live(group: Any | None) -> CommGroup | None:
    if group is None:
        return None
    info = comm_group(group)
    return info if info.size > 1 else None


@eager_only  # host bookkeeping (version counters, weak references) and collectives: always eager
def sync_domain_gradients(model: nn.Module | Iterable[torch.Tensor], manager: DomainParallelManager | None = None,
                          *, domain_group: Any | None = None, dp_group: Any | None = None,
                          bucket_mb: float = 128.0, _convention: str = "halo") -> None:
    """Sum parameter gradients over the domain group, then average them over the data-parallel group.

    After a replicated loss's ``backward()`` each rank holds its own part of the gradient (its rows of the
    field; a :class:`~halo.nn.norm.DomainLayerNorm` weight only its H-slice); the sum is the global gradient
    and the dp mean that of the mean loss over the full batch. Afterwards gradients are identical on every
    rank of both groups.

    Groups: ``domain_group`` / ``dp_group`` if given (either may be ``None``: skipped), else ``manager``'s (default
    the initialised manager); without a manager and without torch.distributed this is a no-op. With DDP or
    FSDP2 averaging over the dp axis, pass ``domain_group=manager.domain_group`` alone (sum and mean commute).
    FSDP2 / HSDP gradients (DTensors sharded over ``manager.device_mesh["dp"]``) are summed as their local shards,
    which are the same slice of each parameter on every rank of a domain group (tested against one process on
    uneven shards); a mesh that includes other domain ranks, or a second dp mean of DTensor gradients, raises.
    A model set up by :func:`halo.parallelize` is handled as its mode needs (``sync_domain_gradients(model)``).

    Which gradients travel is decided alike on every rank (:mod:`halo.parallel.layout`): the parameters that require
    grad, agreed once per list of parameter objects (one small all-gather of host data per group, at the first
    call; none in a steady step). A rank without a gradient for one of them (a parameter used only on the edge
    ranks, or on one rank's data only, in any step) contributes zeros and receives the sum; a parameter with no
    gradient on any rank stays ``None``; a rank missing a gradient reads the summed per-parameter counts back (one
    small read per step, on that rank only), a rank with every gradient reads nothing. ``requires_grad`` changed
    on every rank alike is agreed anew; changed on some ranks only, it raises ``ValueError`` (naming the ranks)
    on the ranks that read the counts, and :class:`halo.HaloCommError` within the timeout on the others. Gradients
    go in flat buckets of at most ``bucket_mb`` MB per (device, dtype), one all-reduce per bucket and group;
    bf16/fp16 gradients are bucketed in fp32.

    Refused before anything is sent (:mod:`~halo.parallel.marks`, host bookkeeping), with ``RuntimeError``: gradients
    from a backward that went through no halo domain reduction (a local ``F.mse_loss`` of the shard: x P after the
    sum; use :func:`halo.parallel.latitude_weighted_mse`, :func:`~halo.parallel.domain_mean`, or declare the loss with
    :func:`~halo.parallel.local_share` / :func:`~halo.parallel.replicated_loss`); gradients changed between the backward
    and the sync (clipping, unscaling: version counters; sync first, then :func:`clip_grad_norm_`); a backward
    accumulated into gradients already synced (accumulation with a sync per micro-step: use
    :func:`halo.parallel.no_sync` for all but the last). Inside a ``no_sync()`` window this does nothing.

    Checked, with no message: a second call for one backward (a gradient exactly as the previous sync left it, by
    its tensor and version counter: summing it again would multiply it by the domain size) raises
    ``RuntimeError``; for a converted model (or a wrapper of one), a ``domain_group`` other than the one it was
    converted for (swapped domain and dp groups, the world group) or a ``dp_group`` that shares other ranks with it
    raises ``ValueError``. A forgotten sync lets the weights diverge: the converted model's periodic check
    (:func:`halo.plan.replicated.check_every`) names the tensor within that many forwards.
    """
    if quiet():  # a no_sync() window: the parts keep accumulating, one sync after it
        return
    mode = model.__dict__.get("_halo_data_parallel") if isinstance(model, nn.Module) else None
    if mode == "fsdp-all":  # FSDP's reduce-scatter over every rank, divided by the dp size: done already
        scale = model.__dict__.get("_halo_grad_scale")
        if scale is not None:  # gloo: FSDP divided by every rank; the domain's part of that is undone here
            scaled = [p for p in model.parameters() if p.grad is not None]
            refuse_second_sync(scaled)
            with torch.no_grad():
                for p in scaled:
                    local_grad(p.grad).mul_(scale)
            mark_synced(scaled)
        forget(model.parameters())
        return
    groups = model.__dict__.get("_halo_groups") if isinstance(model, nn.Module) else None
    if mode in ("ddp", "fsdp", "hsdp") and domain_group is None and dp_group is None:
        if groups is not None and manager is None:
            domain_group = groups[0]  # the groups halo.parallelize set it up with (a manager's or a mesh's)
        else:
            manager = manager if manager is not None else get_domain_parallel_manager()
            domain_group, manager = manager.domain_group, None  # the wrapper averaged over dp already
    elif mode == "none" and domain_group is None and dp_group is None and manager is None and groups is not None:
        domain_group, dp_group = groups
    if domain_group is None and dp_group is None:
        manager = manager if manager is not None else get_domain_parallel_manager()
        if manager is None:
            if dist.is_available() and dist.is_initialized():
                raise RuntimeError("sync_domain_gradients: pass manager=, domain_group= or dp_group=, or call "
                                   "halo.initialize_domain_parallel(world_size, domain_parallel_size) first")
            return
        domain_group, dp_group = manager.domain_group, manager.data_parallel_group
    elif manager is not None:
        raise ValueError("sync_domain_gradients: pass either manager or domain_group/dp_group, not both")
    _check_groups(model, domain_group, dp_group)
    infos = [(info, op) for info, op in ((_live(domain_group), "sum"), (_live(dp_group), "mean")) if info]
    params = _params(model)  # every parameter: the flags of the frozen ones are part of the layout too
    grads = [p for p in params if p.requires_grad]
    watch(grads)  # from now on their gradients carry their provenance (a converted model's: from conversion)
    if not infos:
        syncing(grads)
        return
    for p in grads:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError("sync_domain_gradients: sparse gradients are not supported")
    refuse_second_sync(grads)
    domain_size = next((info.size for info, op in infos if op == "sum"), 1)
    check_marks(grads, lambda: _names(model, grads), domain_size, _convention)
    _check_sharded_grads(grads, infos)
    groups = [info for info, _ in infos]
    layout = layout_of(params, groups)
    if layout is None:
        if not grads:
            return
        names = _names(model, params)
        layout = agree_layout(params, [local_grad(p) for p in params], names, groups)
    changed = [i for i, p in enumerate(params) if p.requires_grad != layout.requires[i]]
    if not layout.travel and not changed:
        return
    names = _names(model, params) if changed else []
    if layout.travel and _sum(params, layout.travel, infos, bucket_mb, [names[i] for i in changed]):
        old = set(layout.travel)  # every rank's flags left the layout: every rank agrees anew, in this call
        layout = agree_layout(params, [local_grad(p) for p in params], names, groups)
        extra = tuple(i for i in layout.travel if i not in old)
        if extra:
            _sum(params, extra, infos, bucket_mb, [])
    elif not layout.travel:  # nothing travelled to carry the status: the ranks whose flags changed agree
        layout = agree_layout(params, [local_grad(p) for p in params], names, groups)
        if layout.travel:
            _sum(params, layout.travel, infos, bucket_mb, [])
    mark_synced([p for p in grads if p.grad is not None])
    syncing(grads)


def _names(model: Any, params: list[torch.Tensor]) -> list[str]:
    """The parameters' names for messages (a module's names, else their positions in the list passed)."""
    if isinstance(model, nn.Module):
        named = {id(p): n for n, p in model.named_parameters()}
        return [named.get(id(p), f"parameter {i}") for i, p in enumerate(params)]
    return [f"parameter {i}" for i in range(len(params))]


def _sum(params: list[torch.Tensor], travel: tuple[int, ...], infos: list[tuple[CommGroup, str]], bucket_mb: float,
         changed: list[str]) -> bool:
    """Sum (then average) the gradients of ``params[travel]`` in buckets, the first one carrying the status; return
    whether every rank's ``requires_grad`` flags left the layout (:func:`halo.parallel.layout.settle`)."""
    present = tuple(params[i].requires_grad and params[i].grad is not None for i in travel)
    pieces = []
    for i in travel:  # the same order and sizes on every rank (the agreed layout), so the buckets match
        p = params[i]
        if not p.requires_grad:  # frozen here since the layout was agreed: zeros, kept nowhere
            pieces.append(torch.zeros_like(local_grad(p.detach())))
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # a DTensor parameter gives a DTensor of zeros
        pieces.append(local_grad(p.grad))
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}
    cap = max(1, int(bucket_mb * 2 ** 20))
    for g in pieces:
        key = (g.device, accumulation_dtype(g.dtype))
        lists = buckets.setdefault(key, [[]])
        nbytes = g.numel() * key[1].itemsize
        if lists[-1] and filled[key] + nbytes > cap:
            lists.append([])
            filled[key] = 0
        lists[-1].append(g)
        filled[key] = filled.get(key, 0) + nbytes
    status = None
    for (device, acc), lists in buckets.items():
        for bucket in lists:
            parts = [g.reshape(-1).to(acc) for g in bucket]
            if status is None:
                parts.append(status_section(present, bool(changed), dist.get_world_size(), dist.get_rank(), device,
                                            acc))
            flat = torch.cat(parts)
            for info, op in infos:
                bounded_all_reduce(flat, info, "sync_domain_gradients")
                if op == "mean":
                    flat.div_(info.size)
            sizes = [g.numel() for g in bucket]
            if status is None:
                status = flat[sum(sizes):]
            for g, piece in zip(bucket, flat[:sum(sizes)].split(sizes), strict=True):
                g.copy_(piece.view_as(g))
    kept, relayout = settle(status, present, changed, [info for info, _ in infos])
    for i, keep in zip(travel, kept, strict=True):
        if not keep and params[i].requires_grad:
            params[i].grad = None  # no rank had a gradient: as the unsharded model, which did not use it
    return relayout



def _root(model: Any) -> Any:
    """The converted model inside ``model`` (through DDP / FSDP wrappers), or ``None``."""
    m = model
    for _ in range(8):
        if not isinstance(m, nn.Module):
            return None
        if "_halo_root" in m.__dict__:
            return m
        m = getattr(m, "module", None)
    return None


def _check_groups(model: Any, domain_group: Any | None, dp_group: Any | None) -> None:
    """The groups of a sync must be the model's: its domain group the one it was converted for, its dp group one
    that meets that domain group in this rank alone (swapped groups, or the world as either, raise)."""
    root = _root(model)
    if root is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        converted = comm_group(root.__dict__["_halo_root"].group)
    except (RuntimeError, ValueError):
        return
    if converted.size == 1:
        return
    me = dist.get_rank()
    if domain_group is not None:
        got = comm_group(domain_group)
        if got.ranks != converted.ranks:
            raise ValueError(
                f"sync_domain_gradients: domain_group holds global ranks {list(got.ranks)}, but the model was "
                f"converted for the domain group of global ranks {list(converted.ranks)} (on global rank {me}): "
                f"summing over another group gives wrong gradients (swapped domain and data-parallel groups, or "
                f"the world group as the domain group); pass the group the model was converted with "
                f"(manager.domain_group)")
    if dp_group is not None:
        got = comm_group(dp_group)
        shared = sorted(set(got.ranks) & set(converted.ranks))
        if shared != [me]:
            raise ValueError(
                f"sync_domain_gradients: dp_group holds global ranks {list(got.ranks)}, which share global ranks "
                f"{shared} with the model's domain group {list(converted.ranks)} (on global rank {me}): a "
                f"data-parallel group holds one rank of each domain group (this one); pass "
                f"manager.data_parallel_group")



def _check_sharded_grads(params: list[torch.Tensor], infos: list[tuple[CommGroup, str]]) -> None:
    """DTensor gradients (FSDP2 / HSDP): their mesh must lie within the data-parallel ranks, so that the ranks of a
    domain group hold the same slice of each parameter (their local shards add up), and FSDP already averaged them
    over that mesh (a dp mean here would mix different slices)."""
    for p in params:
        g = p.grad
        if g is None or not (hasattr(g, "device_mesh") and hasattr(g, "_local_tensor")):
            continue
        mesh_ranks = {int(r) for r in g.device_mesh.mesh.flatten().tolist()}
        me = dist.get_rank()
        for info, op in infos:
            shared = mesh_ranks & set(info.ranks)
            if op == "sum" and shared != {me}:
                raise ValueError(
                    f"sync_domain_gradients: a gradient is sharded over a mesh of global ranks {sorted(mesh_ranks)} "
                    f"that includes other ranks of the domain group {list(info.ranks)} (a flattened dp x domain "
                    f"mesh): its local shards are different slices and cannot be summed. Shard over the "
                    f"data-parallel mesh (manager.device_mesh['dp']), or, sharding over all ranks, set FSDP's "
                    f"gradient divide factor to the data-parallel size and do not call sync_domain_gradients")
            if op == "mean" and len(shared) > 1:
                raise ValueError(
                    "sync_domain_gradients: the gradients are DTensors sharded over the data-parallel ranks (FSDP2 "
                    "on device_mesh['dp']), which FSDP already averaged; a second dp mean would mix different "
                    "slices: pass domain_group=manager.domain_group alone")
        return  # one gradient tells the mesh (a model is sharded over one mesh)



def grad_norm(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0, *,
              verify_group: Any | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients together, each gradient counted once; fp32 for half grads.

    Call it *after* :func:`sync_domain_gradients`: gradients are then replicated on every rank of the domain
    group, so the local norm is the global one, with no communication, identical on every rank. Before the
    sync each rank holds only its part of the gradient, whose norm is not that of the sum (there is no cheap
    correct answer: sync first). ``verify_group``: check with one scalar all-reduce that every rank of that
    group got the same norm, and raise ``RuntimeError`` on all of them otherwise (a debugging aid).
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    grads = [p.grad for p in _params(parameters) if p.grad is not None]
    if not grads:
        total = torch.zeros((), dtype=torch.float32)
    else:
        out_dtype = functools.reduce(torch.promote_types, (accumulation_dtype(g.dtype) for g in grads))
        device = grads[0].device
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=accumulation_dtype(g.dtype)).to(device, out_dtype)
                 for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if verify_group is not None:
        _verify_norm(total, verify_group)
    return total


@eager_only  # a collective and a host read: eager, a graph break in a compiled step
def _verify_norm(total: torch.Tensor, verify_group: Any) -> None:
    """Raise on every rank of ``verify_group`` unless all of them hold the same ``total``."""
    info = comm_group(verify_group)
    if info.size > 1:
        spread = torch.stack([total, -total]).to(torch.float64)
        bounded_all_reduce(spread, info, "grad_norm", dist.ReduceOp.MAX)
        hi, lo = spread[0].item(), -spread[1].item()
        if hi != lo:
            raise RuntimeError(f"grad_norm: the ranks disagree on the gradient norm (from {lo:.6g} to {hi:.6g}); "
                               f"call sync_domain_gradients first")


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                    verify_group: Any | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with :func:`grad_norm` (each gradient once, fp32 for half grads).

    Call after :func:`sync_domain_gradients`; every rank then scales identically. Returns the total norm.
    """
    params = [p for p in _params(parameters) if p.grad is not None]
    total = grad_norm(params, norm_type, verify_group=verify_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
                           f"set error_if_nonfinite=False to clip anyway")
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
