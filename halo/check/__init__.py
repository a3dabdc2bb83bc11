"""One call that says whether a converted model computes what the original computes: ``check_equivalence``.

Every rank of the domain group calls it with the *unconverted* model (or a factory) and the same whole sample. It
runs a copy of the model unsharded on the whole sample (on every rank: no communication, the reference), and a
converted copy on this rank's rows of the sample, in float64 by default (so rounding is not mistaken for a bug),
in train mode (batch statistics: the harder case) with dropout and drop-path off (their masks are drawn from
another stream by design: ``halo.random``). Forward hooks record every module's inputs and outputs; the sharded
outputs are assembled and compared with the reference's in the order the reference finished them, then the input
gradient and every parameter gradient (summed over the domain group) of ``sum(output * weights)`` with fixed
random weights.

What it handles (the models users have):

- **Whole and sharded tensors, told apart by their shapes.** After each run the ranks exchange the shapes of
  everything recorded (one all-gather of host data). A tensor of the reference's shape on every rank is *whole*
  (a global pool's result and the squeeze-excite branch after it, a ``(B, features)`` timestep embedding, a
  classifier head's logits): it is compared as it is on every rank. A tensor whose ranks' extents along one dim
  add up to the reference's (and agree with it in every other dim) is *split* along that dim (a field along H, a
  token sequence along its token dim, a 1-row field over 2 ranks as 1 + 0 rows): it is gathered along that dim.
  Anything else is reported, with every rank's shape. On a latitude x longitude mesh a non-whole tensor is
  assembled with ``gather_2d``.
- **Any output structure**: a tensor, or lists / tuples / dicts of them (``features_only`` encoders, multi-head
  models, ``ModelOutput``-style dataclasses registered with ``torch.utils._pytree``); every tensor leaf is compared
  and every floating (or complex) leaf enters the loss with its own weights. A whole output leaf enters each
  rank's loss with ``1/P`` of its weights (each rank's consumers use their share of a whole result: the convention
  of halo's global pool), so the summed gradients are the unsharded ones; a loss the model returns, replicated and
  counted once (``halo.parallel.domain_mean``: a VQ model's commit loss), enters every rank's loss in full, as a
  training step adds it.
- **Dtypes**: floating parameters, buffers and inputs run in ``dtype``, complex ones in the complex dtype of the
  same precision (complex128 for float64); integer and boolean tensors keep their dtype and are compared exactly.
- **Devices**: everything runs on the sample's device; the copies of the model are moved there. The loss
  weights are drawn on the CPU from a seeded generator (the same numbers on every device and every rank) and then
  moved to that device, so nothing made here mixes devices (a CPU generator's tensor times a CUDA output raises).
- **Tolerances relative to what produces a quantity**: a module's output is compared within
  ``rtol x max(max |output|, max |inputs|)`` of the reference (a value that cancels to ~0 from O(1) inputs is
  rounding at the inputs' scale); a parameter gradient within ``rtol x`` the largest reference gradient of the
  parameters of its module (the smallest enclosing module with another parameter whose gradient is not zero): a
  conv bias before a train-mode BatchNorm has a gradient that is 0 in exact arithmetic and 1e-24 .. 1e-15 in
  float64, rounding of sums of the same terms as its weight's gradient. The input gradient is compared relative
  to its own largest value. A real sharding bug is off by a fraction of the quantity itself (1e-3 .. 1), far
  above these.
- **The first difference, where it arises**: the first module (in the order the reference finished them:
  children before their parent) whose output differs is reported with its path and type, and its inputs are
  compared too: inputs that match mean the difference is made inside that module; an input that already differs
  means it was made before, by code in the parent's ``forward`` between its child modules (a functional op the
  guard cannot see), and the report says so, naming the parent.
- **Buffers after the step**: BatchNorm's running statistics (and every buffer both copies have) are compared
  after the forward, as the sharded copy holds them (replicated state is checked, not assumed), within ``rtol x``
  the scale of their module's inputs and outputs (a running mean that is 0 in exact arithmetic is rounding).
- **Layers halo folds together**: a halo layer marked ``_halo_check = "children"`` (timm's ``SelectAdaptivePool2d``,
  whose flatten halo folds into its global pool) is compared by its own output only, not by its submodules'.
- **Every parameter**: a reference parameter with a gradient that the converted model does not have under its
  name (a converter that wrapped a layer under another name: invariant 6 broken) is reported, not skipped.
- **Layers halo computes in a layout of its own**: inside one of halo's own layers (a class of ``halo``, below the
  model itself: CREDIT FuXi's ``DomainSwinV2Block``, whose attention holds a rank's windows of every sample as one
  block, or its ``DomainCubeEmbedding``, whose LayerNorm sees a field, not token rows), an output that differs from
  the reference's is left out (``report.inside``) when that layer's own output matches: the layer's output is what
  it computes, and a difference it makes shows there (and then everything inside it is reported too).

Every rank gets the same report: comparisons use gathered tensors, and each error is the maximum over the ranks.
``halo check MODULE:FACTORY --shape B,C,H,W`` runs it from the command line (:mod:`halo.tools.check`;
``--boundary pole`` compares with :func:`boundary_reference`, the unsharded model with its convs' latitude padding
filled across the poles).

Inside a distributed job, a model that calls halo's functions (``halo.nn.pad_like``, ``halo.random.dropout``,
``halo.parallel`` losses) runs unsharded on this process's whole field under ``with halo.dist.comm.unsharded():``: that
is how the reference runs here, and how to compute an unsharded loss on one rank to compare with.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ..dist.comm import CommGroup, all_gather_object, comm_group, unsharded
from ..dist.comm import all_reduce as bounded_all_reduce
from ..dist.mesh import DomainMesh, DomainParallelManager, get_domain_parallel_manager, mesh_2d
from ..shard import gather, gather_2d, shard, shard_2d
from ._boundary import boundary_reference
from ._record import (
    Call,
    cast,
    counted_once,
    gather_or_none,
    layout,
    load_matching,
    local_weights,
    param_pairs,
    record,
    shape_of,
    weighted,
    weights,
    windowed,
)
from ._report import GRAD_FLOOR_OF_MODEL as GRAD_FLOOR_OF_MODEL
from ._report import EquivalenceReport, Mismatch, Pending, agree_errors, differentiable, grad_floor, max_abs

__all__ = ["EquivalenceReport", "Mismatch", "boundary_reference", "check_equivalence"]

_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def check_equivalence(model: nn.Module | Callable[[], nn.Module], sample: torch.Tensor, *,
                      manager: Any | None = None, dtype: torch.dtype = torch.float64, rtol: float = 1e-9,
                      convert_kwargs: dict[str, Any] | None = None, reference: nn.Module | None = None,
                      seed: int = 0, raise_on_failure: bool = False, mesh: Any | None = None,
                      args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> EquivalenceReport:
    """Run ``model`` unsharded and converted (sharded along H over the domain group) on ``sample``; compare every
    module's output, the input gradient and the parameter gradients (module docstring: what is handled, how
    tolerances are scaled, how the first difference is located).

    Args:
        model: the *unconverted* model, or a factory returning one (called once per copy). Not modified.
        sample: the whole input field ``(B, C, H, W)``, the same on every rank. Both copies run on its device
            (under NCCL: this rank's CUDA device).
        manager: what to shard over, as :func:`halo.nn.convert_to_domain_parallel` takes it: a manager, a
            ``halo.DomainMesh`` (one axis: latitude rows; two: latitude x longitude) or a process group (default:
            the initialised manager).
        dtype: what both copies run in (float64: differences are bugs, not rounding); complex parameters, buffers
            and inputs run in the complex dtype of that precision, integer ones keep theirs.
        rtol: tolerance per compared tensor, relative to the scale of what produces it (module docstring).
        convert_kwargs: passed to ``convert_to_domain_parallel`` (``boundary=``, ``custom_converters=``, ...).
        reference: the unsharded model to compare with, when it is not ``model`` itself (a boundary torch's layers
            do not have, such as ``"pole"``: :func:`boundary_reference`); modules are matched by name, those only
            one side has are skipped. Its parameters and buffers are set from ``model``'s where the names (and
            shapes) agree, the rest of its parameters in order when their count and shapes agree.
        raise_on_failure: raise ``AssertionError`` with the report instead of returning a failed one.
        mesh: a latitude x longitude ``halo.DomainMesh((ph, pw))`` instead of a manager: the sample is split into
            blocks (``shard_2d``), the model converted with ``mesh=``, outputs gathered with ``gather_2d``.
        args: further positional inputs of the model's forward, whole and the same on every rank (a timestep, a
            class label): given to both copies as they are (tensors moved to the sample's device, floating ones
            cast to ``dtype``).
        kwargs: further keyword inputs of the model's forward, handled as ``args``.

    Every rank gets the same report (the comparisons use gathered tensors; errors are the maximum over ranks).
    """
    from ..nn import convert_to_domain_parallel  # lazily: ``import halo`` loads no layer

    if mesh is not None and manager is not None:
        raise ValueError("check_equivalence: pass a manager, a mesh or a group once (manager=), not also mesh=")
    target = mesh if mesh is not None else manager if manager is not None else get_domain_parallel_manager()
    if target is None:
        raise RuntimeError("check_equivalence needs a manager: call halo.initialize_domain_parallel first")
    if not isinstance(target, DomainParallelManager | DomainMesh | dist.ProcessGroup):
        raise TypeError(f"check_equivalence: manager= takes a halo.DomainParallelManager, a halo.DomainMesh or a "
                        f"torch.distributed.ProcessGroup, got {type(target).__module__}.{type(target).__qualname__}")
    mesh = mesh_2d(target)  # latitude x longitude blocks; else latitude rows
    if not isinstance(sample, torch.Tensor) or sample.dim() < 2:
        raise ValueError(f"check_equivalence: sample must be the whole field (B, C, H, W), got "
                         f"{getattr(sample, 'shape', type(sample))}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"check_equivalence: dtype must be a floating dtype (float64, float32, ...), got {dtype}")
    group = target if isinstance(target, dist.ProcessGroup) else target.domain_group
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    cg = comm_group(group) if dist.is_initialized() and ranks > 1 else None
    # Where things live (the CUDA path, reasoned; benchmarks/gpu_check.py runs it on a GPU): both copies of the model,
    # the sample, the extra inputs, the loss weights, the gathered tensors and the errors' all-reduce are on the
    # sample's device (under NCCL: this rank's GPU, which the communication requires); the only host data are
    # the shapes, exchanged as Python objects on the group's host (gloo) group, and the draws of the weights,
    # which are moved to the device before they meet a model tensor (weights).
    device = sample.device
    if cg is not None and device.type == "cpu" and _backend_needs_cuda(group):
        raise ValueError(f"check_equivalence: the domain group's backend is {dist.get_backend(group)!r}, which "
                         f"communicates CUDA tensors; the sample is on the CPU: move the sample (the model is "
                         f"copied to the sample's device) to this rank's GPU, e.g. sample.to('cuda')")

    def split(t: torch.Tensor) -> torch.Tensor:
        return shard(t, dim=-2, group=group) if mesh is None else shard_2d(t, mesh=mesh)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return gather(t, dim=-2, group=group) if mesh is None else gather_2d(t, mesh=mesh)

    def build() -> nn.Module:
        m = model() if callable(model) and not isinstance(model, nn.Module) else copy.deepcopy(model)
        if not isinstance(m, nn.Module):
            raise TypeError(f"check_equivalence: model must be an nn.Module or a factory of one, got "
                            f"{type(m).__name__}")
        m._apply(lambda t: cast(t, dtype, device))  # not .to(dtype): that drops a complex weight's imaginary part
        m.train()
        for mod in m.modules():
            if isinstance(mod, _RANDOM) or type(mod).__name__ in ("DropPath", "StochasticDepth"):
                mod.eval()  # drawn from another stream by design: off on both sides
        return m

    torch.manual_seed(seed)
    par = build()
    if reference is None:
        torch.manual_seed(seed)
        ref = build()
        ref.load_state_dict(par.state_dict())
    else:
        ref = copy.deepcopy(reference)
        ref._apply(lambda t: cast(t, dtype, device))
        ref.train()
        load_matching(ref, par)
    convert_to_domain_parallel(par, target, **(convert_kwargs or {}))
    in_windows = windowed(par)
    par_names = {id(m): n or "(model)" for n, m in par.named_modules() if id(m) not in in_windows}
    both = set(par_names.values())
    names = {id(m): n or "(model)" for n, m in ref.named_modules() if (n or "(model)") in both}
    kinds = {n or "(model)": type(m).__name__ for n, m in ref.named_modules()}

    x_full = cast(sample.detach(), dtype, device)
    grad_in = differentiable(x_full)
    extra = pytree.tree_map(lambda t: cast(t.detach(), dtype, device) if isinstance(t, torch.Tensor) else t,
                            (tuple(args), dict(kwargs or {})))
    weights_gen = torch.Generator().manual_seed(seed + 1)  # CPU: the same weights on every device (weights)

    # The reference: unsharded, on every rank.
    ref_log: list[Call] = []
    handles = record(ref, names, ref_log)
    xr = x_full.clone().requires_grad_(grad_in)
    try:
        with unsharded():  # halo functions in the model's forward act on this process's whole field
            out_ref = ref(xr, *extra[0], **extra[1])
            ref_leaves = pytree.tree_leaves(out_ref)
            wts = [weights(t, weights_gen) if differentiable(t) else None for t in ref_leaves]
            terms = [weighted(t, w) for t, w in zip(ref_leaves, wts, strict=True)
                     if w is not None and t.requires_grad]
            if terms:
                torch.stack(terms).sum().backward()
    finally:
        for h in handles:
            h.remove()

    # The converted model on this rank's rows.
    par_log: list[Call] = []
    handles = record(par, par_names, par_log)
    xp = split(x_full).detach().requires_grad_(grad_in)
    try:
        out_par = par(xp, *extra[0], **extra[1])
    finally:
        for h in handles:
            h.remove()
    par_leaves = pytree.tree_leaves(out_par)

    # Pair the calls (the k-th call of a module with its k-th call), then agree on every recorded tensor's layout
    # from every rank's shapes (one all-gather of host data): the same decisions on every rank.
    by_name: dict[str, list[Call]] = {}
    for call in par_log:
        by_name.setdefault(call.name, []).append(call)
    seen: dict[str, int] = {}
    pairs: list[tuple[str, Call, Call | None]] = []
    for call in ref_log:
        k = seen.get(call.name, 0)
        seen[call.name] = k + 1
        label = f"output of {call.name} ({kinds.get(call.name, '?')})" + (f" call {k + 1}" if k else "")
        calls = by_name.get(call.name, [])
        pairs.append((label, call, calls[k] if k < len(calls) else None))

    def shapes_of(mine: list[Any] | None, theirs: list[Any]) -> list[Any]:
        if mine is None:
            return [None] * len(theirs)
        return [shape_of(mine[i]) if i < len(mine) else None for i in range(len(theirs))]

    par_buffers = dict(par.named_buffers())
    buffers = [(n, b) for n, b in ref.named_buffers() if n in par_buffers]
    local_meta = ([shapes_of(p.outs if p else None, r.outs) for _, r, p in pairs],
                  [shapes_of(p.ins if p else None, r.ins) for _, r, p in pairs],
                  shapes_of(par_leaves, ref_leaves), [p is not None for _, _, p in pairs],
                  [shape_of(par_buffers[n]) for n, _ in buffers])
    metas = all_gather_object(local_meta, cg) if cg is not None else [local_meta]
    missing = [[r for r, m in enumerate(metas) if not m[3][j]] for j in range(len(pairs))]  # ranks not calling j
    is_mesh = mesh is not None

    def layout_of(want: Any, which: int, j: int, i: int) -> tuple:
        shapes = [m[which][j][i] if which < 2 else m[which][i] for m in metas]
        return layout(shape_of(want), shapes, is_mesh)

    # The sharded loss: each output leaf's weights, split as the leaf is (whole: 1/P each).
    index = cg.index if cg is not None else 0
    terms = []
    out_layouts = [layout_of(t, 2, 0, i) if isinstance(t, torch.Tensor) else ("skip",)
                   for i, t in enumerate(ref_leaves)]
    for i, (w, lay) in enumerate(zip(wts, out_layouts, strict=True)):
        if w is None or i >= len(par_leaves) or not differentiable(par_leaves[i]):
            continue
        g = par_leaves[i]
        mine = local_weights(w, lay, index, ranks, mesh, once=lay[0] == "whole" and counted_once(g))
        if (mine is not None and g.requires_grad and shape_of(g) == shape_of(mine)
                and g.is_complex() == mine.is_complex()):
            terms.append(weighted(g, mine))
    if terms:
        torch.stack(terms).sum().backward()

    # Module outputs, in the order the reference finished them.
    pending: list[Pending] = []
    first_call: list[int] = []  # pending index -> pair index (module outputs only)
    for j, (label, r, p) in enumerate(pairs):
        floor = max_abs(r.outs + r.ins)
        if missing[j]:  # decided from every rank's calls: the same entries everywhere
            where = "" if len(missing[j]) == len(metas) else f" on group rank(s) {missing[j]}"
            pending.append(Pending(label, None, torch.zeros(()), 0.0, rtol, f"not called in the sharded run{where}"))
            first_call.append(j)
            continue
        for i, want in enumerate(r.outs):
            if not isinstance(want, torch.Tensor):
                continue
            what = label + (f" [{i}]" if i else "")
            lay = layout_of(want, 0, j, i)
            if lay[0] == "bad":
                pending.append(Pending(what, None, want, floor, rtol, lay[1]))
            else:
                got = gather_or_none(p.outs[i], lay, group, mesh)
                pending.append(Pending(what, got, want, floor, rtol,
                                        "" if got is not None else "could not be assembled from the ranks"))
            first_call.append(j)
    n_outputs = len(pending)

    if grad_in:
        got = whole(xp.grad) if xp.grad is not None else whole(torch.zeros_like(xp))
        pending.append(Pending("input gradient", got, xr.grad if xr.grad is not None else torch.zeros_like(xr),
                                0.0, rtol))

    # Parameter gradients, summed over the domain group (each rank holds its rows' share).
    params = [(n, p, q) for n, p, q in param_pairs(par, ref, reference is not None) if q.grad is not None]
    maxima = {n: max_abs([q.grad]) for n, _, q in params}
    for name, p, q in params:
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        if cg is not None:
            bounded_all_reduce(g, cg, "check_equivalence (parameter gradients)")
        pending.append(Pending(f"gradient of {name}", g, q.grad, grad_floor(name, maxima), rtol))
    if reference is None:  # the same model: every parameter keeps its name (invariant 6), so none may go unchecked
        paired = {n for n, _, _ in params}
        for name, q in ref.named_parameters():
            if q.grad is not None and name not in paired:
                pending.append(Pending(f"gradient of {name}", None, q.grad, 0.0, rtol,
                                        "no parameter of that name in the converted model (its state_dict keys "
                                        "changed: a converter renamed it), so its gradient cannot be compared"))

    # Buffers after the step (BatchNorm's running statistics: replicated state, checked, not assumed), within rtol of
    # the scale of what produced them: their module's first call's inputs and outputs (a running mean that is 0 in
    # exact arithmetic, a BatchNorm's after another's, is ~1e-18 of rounding: not relative to itself).
    scales: dict[str, float] = {}
    for _, r, _ in pairs:
        if r.name not in scales:
            scales[r.name] = max_abs(r.outs + r.ins)
    for i, (name, want) in enumerate(buffers):
        lay = layout_of(want, 4, 0, i)
        got = None if lay[0] == "bad" else gather_or_none(par_buffers[name], lay, group, mesh)
        owner = name.rpartition(".")[0] or "(model)"
        pending.append(Pending(f"buffer {name} after the step", got, want, scales.get(owner, 0.0), rtol,
                                lay[1] if lay[0] == "bad" else ""))

    agree_errors(pending, cg, device)
    checks = [c.final() for c in pending]
    # An intermediate of one of halo's own layers, in the layout that layer computes in (windows in the batch dim,
    # a cube embedding's tokens as a field) is not the reference's intermediate: where that layer's own output
    # matches, its differences are not the model's (the same decision on every rank: the errors are agreed).
    drop = in_own_layout([pairs[first_call[k]][1].name for k in range(n_outputs)], checks[:n_outputs],
                         {n: type(m) for n, m in par.named_modules()})
    report = EquivalenceReport(dtype=str(dtype).removeprefix("torch."), ranks=ranks, rtol=rtol,
                               checks=[c for k, c in enumerate(checks) if k not in drop],
                               inside=sorted({checks[k].what for k in drop}))
    first_call = [j for k, j in enumerate(first_call) if k not in drop]
    n_outputs -= len(drop)
    bad = next((k for k in range(n_outputs) if not report.checks[k].ok), None)
    if bad is not None:
        j = first_call[bad]
        report.where = _locate(pairs[j], j, bool(missing[j]), kinds, layout_of, group, mesh, rtol, cg, device)
    if raise_on_failure and not report.ok:
        raise AssertionError(str(report))
    return report


def in_own_layout(names: list[str], checks: list[Mismatch], kinds: dict[str, type]) -> set[int]:
    """The module-output comparisons (indices into ``names`` / ``checks``, one per compared output) that are
    intermediates of a halo layer in its own layout: a failed one of a module inside one of halo's own layers (a
    class of ``halo``, below the model itself: ``DomainSwinV2Block``, ``DomainCubeEmbedding``, ...) whose every
    compared output matches. Such a layer computes its children in the layout it chooses (a rank's attention windows
    of every sample as one block, a cube embedding's tokens as a field), which does not assemble into the
    reference's tensor, and its own output is the truth of what it computes; a difference it makes shows at that
    output, which stays compared (so do everything outside it, the gradients and the buffers)."""
    ok: dict[str, bool] = {}
    for name, check in zip(names, checks, strict=True):
        ok[name] = ok.get(name, True) and check.ok

    def owner_ok(name: str) -> bool:
        while "." in name:
            name = name.rpartition(".")[0]
            kind = kinds.get(name)
            if kind is not None and (kind.__module__ or "").split(".")[0] == "halo" and ok.get(name, False):
                return True
        return False

    return {k for k, (name, check) in enumerate(zip(names, checks, strict=True))
            if not check.ok and name != "(model)" and owner_ok(name)}


def _backend_needs_cuda(group: Any) -> bool:
    backend = str(dist.get_backend(group)).lower()
    return "nccl" in backend and "cpu:" not in backend


def _locate(pair: tuple, j: int, missing: bool, kinds: dict[str, str], layout_of: Callable, group: Any, mesh: Any,
            rtol: float, cg: CommGroup | None, device: torch.device) -> str:
    """Where the first difference arises: inside the module (its inputs match), or before it (an input differs).
    ``missing``: some rank did not call it (the same on every rank)."""
    label, r, p = pair
    name = r.name
    kind = kinds.get(name, "?")
    if missing:
        return f"{name} ({kind}) runs in the reference but not in the converted model"
    pending = []
    for i, want in enumerate(r.ins):
        if not isinstance(want, torch.Tensor):
            continue
        lay = layout_of(want, 1, j, i)
        got = None if lay[0] == "bad" else gather_or_none(p.ins[i] if i < len(p.ins) else None, lay, group, mesh)
        pending.append((i, Pending(f"input {i}", got, want, max_abs([want]), rtol, lay[1] if lay[0] == "bad"
                                    else "")))
    agree_errors([q for _, q in pending], cg, device)
    differing = [(i, q.final()) for i, q in pending if not q.final().ok]
    if not differing:
        return (f"the inputs of {name} ({kind}) match the reference: the difference is made inside it (its own "
                f"forward, or layers it calls that are not modules)")
    i, m = differing[0]
    parent = name.rpartition(".")[0] if "." in name else "(model)"
    where = "the model's forward" if name == "(model)" else \
        f"the forward of {parent} ({kinds.get(parent, '?')}) before it calls {name}"
    return (f"input {i} of {name} ({kind}) already differs (max error {m.error:.3e}, max |ref| {m.scale:.3e}): the "
            f"difference is made by code outside any module, in {where}")
