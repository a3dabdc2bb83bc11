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
  of halo's global pool), so the summed gradients are the unsharded ones.
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
  after the forward, as the sharded copy holds them (replicated state is checked, not assumed).

Every rank gets the same report: comparisons use gathered tensors, and each error is the maximum over the ranks.
``halo check MODULE:FACTORY --shape B,C,H,W`` runs it from the command line (:mod:`halo.tools.check`;
``--boundary pole`` compares with :func:`boundary_reference`, the unsharded model with its convs' latitude padding
filled across the poles).

Inside a distributed job, a model that calls halo's functions (``halo.nn.pad_like``, ``halo.random.dropout``,
``halo.reduce`` losses) runs unsharded on this process's whole field under ``with halo.comm.unsharded():``: that
is how the reference runs here, and how to compute an unsharded loss on one rank to compare with.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["EquivalenceReport", "Mismatch", "boundary_reference", "check_equivalence"]

_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32,
            torch.bfloat16: torch.complex64}


@dataclass
class Mismatch:
    """One compared tensor: where, how far off, against what scale and tolerance."""

    what: str  # "output of enc.0 (Conv2d)", "input gradient", "gradient of enc.0.weight"
    error: float  # max |sharded - unsharded| (over all ranks)
    scale: float  # max |unsharded|
    tol: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= self.tol and not self.note

    def __str__(self) -> str:
        rel = self.error / self.scale if self.scale else float("inf") if self.error else 0.0
        status = "ok" if self.ok else "DIFFERS"
        extra = f" ({self.note})" if self.note else ""
        return (f"{status:8s}{self.what}: max error {self.error:.3e}, max |ref| {self.scale:.3e}, relative "
                f"{rel:.2e}, tolerance {self.tol:.1e}{extra}")


@dataclass
class EquivalenceReport:
    """What :func:`check_equivalence` found: every comparison in order, the first that failed, and where the first
    difference arises (``where``: inside that module, or before it in its parent's forward)."""

    checks: list[Mismatch] = field(default_factory=list)
    dtype: str = "float64"
    ranks: int = 1
    rtol: float = 0.0
    where: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def first_mismatch(self) -> Mismatch | None:
        return next((c for c in self.checks if not c.ok), None)

    def __str__(self) -> str:
        head = (f"halo.check_equivalence: {len(self.checks)} comparisons, {self.ranks} ranks, {self.dtype}, "
                f"tolerance {self.rtol:.0e} x the scale of what produces each tensor")
        bad = self.first_mismatch
        if bad is None:
            # (these words are matched by scripts and tests; buffers are among the comparisons counted above)
            return f"{head}\nOK: every module's output, the input gradient and every parameter gradient match"
        worst = [c for c in self.checks if not c.ok]
        lines = [head, f"FIRST DIFFERENCE: {bad}"]
        if self.where:
            lines.append(f"  where: {self.where}")
        lines += [f"  then: {c}" for c in worst[1:6]]
        if len(worst) > 6:
            lines.append(f"  ... and {len(worst) - 6} more")
        return "\n".join(lines)


# -- dtypes and devices -----------------------------------------------------------------------------------------

def _cast(t: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """Floating -> ``dtype``, complex -> the complex dtype of its precision, others keep theirs; all on ``device``."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    if t.is_complex():
        return t.to(device=device, dtype=_COMPLEX.get(dtype, torch.complex128))
    return t.to(device=device)


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _weights(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fixed random loss weights of ``like``'s shape and dtype (complex: complex weights), drawn on the CPU from
    the seeded generator (the same numbers whatever the device) and then moved to ``like``'s device."""
    real = torch.view_as_real(like) if like.is_complex() else like
    w = torch.randn(real.shape, generator=gen, dtype=torch.float64).to(real.dtype)
    w = torch.view_as_complex(w) if like.is_complex() else w
    return w.to(device=like.device)


def _weighted(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum(t * w)``; for complex ``t`` the real inner product ``sum(Re t Re w + Im t Im w)``."""
    if t.is_complex():
        return (torch.view_as_real(t) * torch.view_as_real(w)).sum()
    return (t * w).sum()


# -- recording --------------------------------------------------------------------------------------------------

@dataclass
class _Call:
    name: str
    outs: list[Any]  # the output's pytree leaves (tensors detached and cloned)
    ins: list[Any]  # the inputs' leaves (args, then kwargs)


def _snapshot(tree: Any) -> list[Any]:
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(tree)]


def _windowed(model: nn.Module) -> set[int]:
    """Modules whose tensors are attention windows or regrouped rows, not the field's rows: their shards do not
    concatenate to the reference's tensor (a rank's windows of every batch element are one block), so comparing them
    would report differences that are not there. halo's attention layers mark them with ``_halo_check``:
    ``"children"`` (the layer's own output is a field, compared; its submodules see windows: CrossFormer's attention)
    or ``"self"`` (the layer itself takes and returns windows: Swin's window attention)."""
    out: set[int] = set()
    for m in model.modules():
        mark = getattr(m, "_halo_check", None)
        if mark in ("children", "self"):
            out.update(id(c) for c in m.modules() if c is not m)
            if mark == "self":
                out.add(id(m))
    return out


def _record(model: nn.Module, names: dict[int, str], log: list[_Call]) -> list[Any]:
    handles = []
    for module in model.modules():
        name = names.get(id(module))
        if name is None:
            continue

        def hook(mod, args, kwargs, output, name=name):
            log.append(_Call(name, _snapshot(output), _snapshot((args, kwargs))))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return handles


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(int(s) for s in t.shape) if isinstance(t, torch.Tensor) else None


# -- layouts: whole, split along one dim, a mesh block -------------------------------------------------------------

def _layout(want: tuple[int, ...], shapes: list[tuple[int, ...] | None], mesh: bool) -> tuple:
    """How the ranks hold a tensor whose unsharded shape is ``want``: ``("whole",)``, ``("split", dim, sizes)``,
    ``("mesh",)`` or ``("bad", why)`` (``shapes``: every rank's, in group order; the same decision everywhere)."""
    if any(s is None for s in shapes):
        missing = [r for r, s in enumerate(shapes) if s is None]
        return ("bad", f"no tensor here on group rank(s) {missing}")
    if all(s == want for s in shapes):
        return ("whole",)
    if any(len(s) != len(want) for s in shapes):
        return ("bad", f"shapes on the ranks {shapes} vs the reference's {want}")
    if mesh:
        return ("mesh",) if len(want) >= 2 else ("bad", f"shapes on the ranks {shapes} vs the reference's {want}")
    dims = [d for d in range(len(want)) if any(s[d] != want[d] for s in shapes)]
    if len(dims) == 1 and sum(s[dims[0]] for s in shapes) == want[dims[0]]:
        return ("split", dims[0], tuple(s[dims[0]] for s in shapes))
    return ("bad", f"shapes on the ranks {shapes} are neither the reference's {want} on every rank nor a split of "
                   f"it along one dim")


def _assemble(t: torch.Tensor, layout: tuple, group: Any, mesh: Any) -> torch.Tensor:
    """The whole tensor from this rank's part (collective for ``split`` / ``mesh``: every rank calls it alike)."""
    from .shard import gather, gather_2d

    if layout[0] == "whole":
        return t
    x = t.detach().contiguous()
    kind = x.dtype
    dim = layout[1] if layout[0] == "split" else None
    if x.is_complex():
        x = torch.view_as_real(x)
    elif kind == torch.bool:
        x = x.to(torch.uint8)
    if layout[0] == "split":
        x = gather(x, dim=dim, group=group)
    else:
        x = gather_2d(x, mesh=mesh) if x.dim() - (kind.is_complex) >= 2 else x
    if kind.is_complex:
        return torch.view_as_complex(x.contiguous())
    return x.to(kind) if kind == torch.bool else x


def _local_weights(w: torch.Tensor, layout: tuple, index: int, ranks: int, mesh: Any) -> torch.Tensor | None:
    """This rank's share of the loss weights ``w`` of a whole output leaf (``None``: not in the loss)."""
    from .shard import shard_2d

    if layout[0] == "whole":
        return w / ranks
    if layout[0] == "split":
        sizes = layout[2]
        return w.narrow(layout[1], sum(sizes[:index]), sizes[index])
    if layout[0] == "mesh":
        return shard_2d(w, mesh=mesh)
    return None


# -- comparing -------------------------------------------------------------------------------------------------

def _measure(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, bool, str]:
    """(max |got - want|, max finite |want|, NaN where the reference has none, note) on this rank."""
    if got.shape != want.shape:
        return float("inf"), 0.0, False, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    note = f"dtype {got.dtype} vs {want.dtype}" if got.dtype != want.dtype else ""
    if want.numel() == 0:
        return 0.0, 0.0, False, note
    if _differentiable(want) or _differentiable(got):
        wide = torch.complex128 if (got.is_complex() or want.is_complex()) else torch.float64
        g, w = got.detach().to(wide), want.detach().to(wide)
        mag = w.abs()
        scale = float(mag.masked_fill(~torch.isfinite(mag), 0.0).max())
        same = (g == w) | (g.isnan() & w.isnan())
        diff = (g - w).abs().masked_fill(same, 0.0).nan_to_num(nan=float("inf"))
        nan = bool((g.isnan() & ~w.isnan()).any())
        return float(diff.max()), scale, nan, note
    g, w = got.detach(), want.detach()  # integer / bool: exact
    if w.dtype == torch.bool or g.dtype == torch.bool:
        return float((g != w).sum()), 1.0, False, note
    return float((g.to(torch.int64) - w.to(torch.int64)).abs().max()), float(w.to(torch.int64).abs().max()), False, \
        note


def _max_abs(leaves: list[Any]) -> float:
    best = 0.0
    for t in leaves:
        if _differentiable(t) and t.numel():
            mag = t.detach().abs()
            best = max(best, float(mag.masked_fill(~torch.isfinite(mag), 0.0).max()))
    return best


class _Pending:
    """A comparison whose error is made final after the maximum over the ranks."""

    def __init__(self, what: str, got: torch.Tensor | None, want: torch.Tensor, floor: float, rtol: float,
                 note: str = "") -> None:
        self.what, self.note = what, note
        if got is None:
            self.error, self.scale, self.nan = float("inf"), _max_abs([want]), False
        else:
            self.error, self.scale, self.nan, extra = _measure(got, want)
            self.note = self.note or extra
        exact = not (_differentiable(want))
        self.tol = 0.0 if exact else rtol * max(self.scale, floor, 1e-300)

    def final(self) -> Mismatch:
        note = self.note or ("NaN where the reference has none" if self.nan else "")
        return Mismatch(self.what, self.error, self.scale, self.tol, note)


def _agree(pending: list[_Pending], cg: Any, device: torch.device) -> None:
    """Each error and NaN flag becomes the maximum over the ranks (one all-reduce)."""
    from .comm import all_reduce as bounded_all_reduce

    if cg is None or cg.size == 1 or not pending:
        return
    vals = torch.tensor([[p.error, float(p.nan)] for p in pending], dtype=torch.float64).to(device)
    bounded_all_reduce(vals, cg, "check_equivalence (the errors' maximum over the ranks)", op=dist.ReduceOp.MAX)
    for p, (err, nan) in zip(pending, vals.cpu().tolist(), strict=True):
        p.error, p.nan = err, bool(nan)


#: A parameter gradient's tolerance is never below this fraction of the model's largest parameter gradient (times
#: ``rtol``): a module whose gradients are all zero in exact arithmetic (a position-bias MLP whose output shifts
#: whole softmax rows) holds only rounding noise, and its own largest gradient is noise too. Every gradient is
#: accumulated through the same backward as the largest one, so its rounding is of that scale; at float64's
#: rtol 1e-9 a real error still has to be below 1e-12 of the largest gradient to pass.
GRAD_FLOOR_OF_MODEL = 1e-3


def _grad_floor(name: str, maxima: dict[str, float]) -> float:
    """The largest reference gradient among the parameters of ``name``'s module: the smallest enclosing module
    (by path) that has another parameter whose gradient is not zero (the model, at the top); never below
    :data:`GRAD_FLOOR_OF_MODEL` of the model's largest."""
    model = GRAD_FLOOR_OF_MODEL * max(maxima.values(), default=0.0)
    parts = name.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        prefix = ".".join(parts[:depth])
        group = [v for n, v in maxima.items() if not prefix or n.startswith(prefix + ".")]
        others = [v for n, v in maxima.items() if n != name and (not prefix or n.startswith(prefix + "."))]
        if any(v > 0 for v in others):
            return max(max(group), model)
    return max(maxima.get(name, 0.0), model)


def _load_matching(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s parameters and buffers into ``dst`` where names and shapes agree, then the parameters left
    unmatched on both sides in order (a reference that wraps the layers: ``enc.conv.weight`` for ``enc.weight``)
    when their count and shapes agree."""
    theirs = src.state_dict()
    left_dst, used = [], set()
    with torch.no_grad():
        for n, t in dst.state_dict(keep_vars=True).items():
            s = theirs.get(n)
            if s is not None and s.shape == t.shape:
                t.copy_(s)
                used.add(n)
            elif isinstance(t, nn.Parameter):
                left_dst.append(t)
        left_src = [p for n, p in src.named_parameters() if n not in used]
        if left_dst and len(left_dst) == len(left_src) and all(a.shape == b.shape
                                                               for a, b in zip(left_dst, left_src, strict=True)):
            for a, b in zip(left_dst, left_src, strict=True):
                a.copy_(b)


def _param_pairs(par: nn.Module, ref: nn.Module, reference_given: bool) -> list[tuple[str, nn.Parameter, Any]]:
    ref_params = dict(ref.named_parameters())
    par_params = list(par.named_parameters())
    if reference_given and not all(n in ref_params for n, _ in par_params):
        listed = list(ref.parameters())
        if len(listed) == len(par_params):  # a reference that wraps the layers: by order
            return [(n, p, q) for (n, p), q in zip(par_params, listed, strict=True)]
    return [(n, p, ref_params[n]) for n, p in par_params if n in ref_params]


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
        args, kwargs: further inputs of the model's forward, whole and the same on every rank (a timestep, a class
            label): given to both copies as they are (tensors moved to the sample's device, floating ones cast to
            ``dtype``).

    Every rank gets the same report (the comparisons use gathered tensors; errors are the maximum over ranks).
    """
    from .comm import all_gather_object, comm_group, unsharded
    from .comm import all_reduce as bounded_all_reduce
    from .mesh import DomainMesh, DomainParallelManager, get_domain_parallel_manager, mesh_2d
    from .nn import convert_to_domain_parallel
    from .shard import gather, gather_2d, shard, shard_2d

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
    if not (dtype.is_floating_point):
        raise TypeError(f"check_equivalence: dtype must be a floating dtype (float64, float32, ...), got {dtype}")
    group = target if isinstance(target, dist.ProcessGroup) else target.domain_group
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    cg = comm_group(group) if dist.is_initialized() and ranks > 1 else None
    # Where things live (the CUDA path, reasoned; benchmarks/gpu_check.py runs it on a GPU): both copies of the model,
    # the sample, the extra inputs, the loss weights, the gathered tensors and the errors' all-reduce are on the
    # sample's device (under NCCL: this rank's GPU, which the communication requires); the only host data are
    # the shapes, exchanged as Python objects on the group's host (gloo) group, and the draws of the weights,
    # which are moved to the device before they meet a model tensor (_weights).
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
        m._apply(lambda t: _cast(t, dtype, device))  # not .to(dtype): that drops a complex weight's imaginary part
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
        ref._apply(lambda t: _cast(t, dtype, device))
        ref.train()
        _load_matching(ref, par)
    convert_to_domain_parallel(par, target, **(convert_kwargs or {}))
    windowed = _windowed(par)
    par_names = {id(m): n or "(model)" for n, m in par.named_modules() if id(m) not in windowed}
    both = set(par_names.values())
    names = {id(m): n or "(model)" for n, m in ref.named_modules() if (n or "(model)") in both}
    kinds = {n or "(model)": type(m).__name__ for n, m in ref.named_modules()}

    x_full = _cast(sample.detach(), dtype, device)
    grad_in = _differentiable(x_full)
    extra = pytree.tree_map(lambda t: _cast(t.detach(), dtype, device) if isinstance(t, torch.Tensor) else t,
                            (tuple(args), dict(kwargs or {})))
    weights_gen = torch.Generator().manual_seed(seed + 1)  # CPU: the same weights on every device (_weights)

    # The reference: unsharded, on every rank.
    ref_log: list[_Call] = []
    handles = _record(ref, names, ref_log)
    xr = x_full.clone().requires_grad_(grad_in)
    try:
        with unsharded():  # halo functions in the model's forward act on this process's whole field
            out_ref = ref(xr, *extra[0], **extra[1])
            ref_leaves = pytree.tree_leaves(out_ref)
            wts = [_weights(t, weights_gen) if _differentiable(t) else None for t in ref_leaves]
            terms = [_weighted(t, w) for t, w in zip(ref_leaves, wts, strict=True)
                     if w is not None and t.requires_grad]
            if terms:
                torch.stack(terms).sum().backward()
    finally:
        for h in handles:
            h.remove()

    # The converted model on this rank's rows.
    par_log: list[_Call] = []
    handles = _record(par, par_names, par_log)
    xp = split(x_full).detach().requires_grad_(grad_in)
    try:
        out_par = par(xp, *extra[0], **extra[1])
    finally:
        for h in handles:
            h.remove()
    par_leaves = pytree.tree_leaves(out_par)

    # Pair the calls (the k-th call of a module with its k-th call), then agree on every recorded tensor's layout
    # from every rank's shapes (one all-gather of host data): the same decisions on every rank.
    by_name: dict[str, list[_Call]] = {}
    for call in par_log:
        by_name.setdefault(call.name, []).append(call)
    seen: dict[str, int] = {}
    pairs: list[tuple[str, _Call, _Call | None]] = []
    for call in ref_log:
        k = seen.get(call.name, 0)
        seen[call.name] = k + 1
        label = f"output of {call.name} ({kinds.get(call.name, '?')})" + (f" call {k + 1}" if k else "")
        calls = by_name.get(call.name, [])
        pairs.append((label, call, calls[k] if k < len(calls) else None))

    def shapes_of(mine: list[Any] | None, theirs: list[Any]) -> list[Any]:
        if mine is None:
            return [None] * len(theirs)
        return [_shape(mine[i]) if i < len(mine) else None for i in range(len(theirs))]

    par_buffers = dict(par.named_buffers())
    buffers = [(n, b) for n, b in ref.named_buffers() if n in par_buffers]
    local_meta = ([shapes_of(p.outs if p else None, r.outs) for _, r, p in pairs],
                  [shapes_of(p.ins if p else None, r.ins) for _, r, p in pairs],
                  shapes_of(par_leaves, ref_leaves), [p is not None for _, _, p in pairs],
                  [_shape(par_buffers[n]) for n, _ in buffers])
    metas = all_gather_object(local_meta, cg) if cg is not None else [local_meta]
    missing = [[r for r, m in enumerate(metas) if not m[3][j]] for j in range(len(pairs))]  # ranks not calling j
    is_mesh = mesh is not None

    def layout(want: Any, which: int, j: int, i: int) -> tuple:
        shapes = [m[which][j][i] if which < 2 else m[which][i] for m in metas]
        return _layout(_shape(want), shapes, is_mesh)

    # The sharded loss: each output leaf's weights, split as the leaf is (whole: 1/P each).
    index = cg.index if cg is not None else 0
    terms = []
    out_layouts = [layout(t, 2, 0, i) if isinstance(t, torch.Tensor) else ("skip",)
                   for i, t in enumerate(ref_leaves)]
    for i, (w, lay) in enumerate(zip(wts, out_layouts, strict=True)):
        if w is None or i >= len(par_leaves) or not _differentiable(par_leaves[i]):
            continue
        g = par_leaves[i]
        mine = _local_weights(w, lay, index, ranks, mesh)
        if mine is not None and g.requires_grad and _shape(g) == _shape(mine) and g.is_complex() == mine.is_complex():
            terms.append(_weighted(g, mine))
    if terms:
        torch.stack(terms).sum().backward()

    # Module outputs, in the order the reference finished them.
    pending: list[_Pending] = []
    first_call: list[int] = []  # pending index -> pair index (module outputs only)
    for j, (label, r, p) in enumerate(pairs):
        floor = _max_abs(r.outs + r.ins)
        if missing[j]:  # decided from every rank's calls: the same entries everywhere
            where = "" if len(missing[j]) == len(metas) else f" on group rank(s) {missing[j]}"
            pending.append(_Pending(label, None, torch.zeros(()), 0.0, rtol, f"not called in the sharded run{where}"))
            first_call.append(j)
            continue
        for i, want in enumerate(r.outs):
            if not isinstance(want, torch.Tensor):
                continue
            what = label + (f" [{i}]" if i else "")
            lay = layout(want, 0, j, i)
            if lay[0] == "bad":
                pending.append(_Pending(what, None, want, floor, rtol, lay[1]))
            else:
                got = _gather_or_none(p.outs[i], lay, group, mesh)
                pending.append(_Pending(what, got, want, floor, rtol,
                                        "" if got is not None else "could not be assembled from the ranks"))
            first_call.append(j)
    n_outputs = len(pending)

    if grad_in:
        got = whole(xp.grad) if xp.grad is not None else whole(torch.zeros_like(xp))
        pending.append(_Pending("input gradient", got, xr.grad if xr.grad is not None else torch.zeros_like(xr),
                                0.0, rtol))

    # Parameter gradients, summed over the domain group (each rank holds its rows' share).
    params = [(n, p, q) for n, p, q in _param_pairs(par, ref, reference is not None) if q.grad is not None]
    maxima = {n: _max_abs([q.grad]) for n, _, q in params}
    for name, p, q in params:
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        if cg is not None:
            bounded_all_reduce(g, cg, "check_equivalence (parameter gradients)")
        pending.append(_Pending(f"gradient of {name}", g, q.grad, _grad_floor(name, maxima), rtol))

    # Buffers after the step (BatchNorm's running statistics: replicated state, checked, not assumed).
    for i, (name, want) in enumerate(buffers):
        lay = layout(want, 4, 0, i)
        got = None if lay[0] == "bad" else _gather_or_none(par_buffers[name], lay, group, mesh)
        pending.append(_Pending(f"buffer {name} after the step", got, want, 0.0, rtol,
                                lay[1] if lay[0] == "bad" else ""))

    _agree(pending, cg, device)
    report = EquivalenceReport(dtype=str(dtype).removeprefix("torch."), ranks=ranks, rtol=rtol,
                               checks=[c.final() for c in pending])
    bad = next((k for k in range(n_outputs) if not report.checks[k].ok), None)
    if bad is not None:
        j = first_call[bad]
        report.where = _locate(pairs[j], j, bool(missing[j]), kinds, layout, group, mesh, rtol, cg, device)
    if raise_on_failure and not report.ok:
        raise AssertionError(str(report))
    return report


def _backend_needs_cuda(group: Any) -> bool:
    backend = str(dist.get_backend(group)).lower()
    return "nccl" in backend and "cpu:" not in backend


def _gather_or_none(t: Any, lay: tuple, group: Any, mesh: Any) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return _assemble(t, lay, group, mesh)
    except (ValueError, RuntimeError):
        return None


def _locate(pair: tuple, j: int, missing: bool, kinds: dict[str, str], layout: Callable, group: Any, mesh: Any,
            rtol: float, cg: Any, device: torch.device) -> str:
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
        lay = layout(want, 1, j, i)
        got = None if lay[0] == "bad" else _gather_or_none(p.ins[i] if i < len(p.ins) else None, lay, group, mesh)
        pending.append((i, _Pending(f"input {i}", got, want, _max_abs([want]), rtol, lay[1] if lay[0] == "bad"
                                    else "")))
    _agree([q for _, q in pending], cg, device)
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


def boundary_reference(model: nn.Module, boundary: str) -> nn.Module:
    """The unsharded twin of ``convert_to_domain_parallel(model, boundary=boundary)``, in plain torch: a copy of
    ``model`` whose ``nn.Conv2d`` layers fill their latitude padding (dim -2) with ``boundary`` (``"pole"``: rows
    mirrored across the pole, the pole row not repeated, and rolled by half the longitudes; ``"pole_centered"``:
    the same with the edge row repeated; ``"zeros"``, ``"reflect"``, ``"replicate"``, ``"symmetric"``,
    ``"circular"``/``"periodic"`` as their names say), then pad longitude by their own ``padding_mode`` — the order
    halo's exchange uses (the pole roll is by half the unpadded longitudes). Module names and parameters are the
    model's, so :func:`check_equivalence` matches every module. Give it as ``reference=``; ``halo check --boundary
    B`` does. Transposed convs read no rows outside their input: unchanged, as the converter leaves them."""
    from .partition import check_boundary

    boundary = check_boundary(boundary)
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        if isinstance(mod, nn.Conv2d) and not isinstance(mod, nn.ConvTranspose2d):
            pads = _conv_pads(mod)
            if pads[0] == (0, 0):
                continue
            mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
            mod.padding, mod.padding_mode = (0, 0), "zeros"
            mod._reversed_padding_repeated_twice = [0, 0, 0, 0]
            mod.register_forward_pre_hook(_BoundaryPad(pads, boundary, mode))
    return ref


def _conv_pads(conv: nn.Conv2d) -> tuple[tuple[int, int], tuple[int, int]]:
    """(before, after) along H and W of ``conv``'s padding (``'same'``: torch's split, the extra row after)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0), (0, 0)
        out = []
        for k, d in zip(conv.kernel_size, conv.dilation, strict=True):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return out[0], out[1]
    ph, pw = conv.padding
    return (ph, ph), (pw, pw)


class _BoundaryPad:
    """A forward pre-hook: pad H of the conv's input with the boundary, then W with the conv's own mode."""

    def __init__(self, pads: tuple, boundary: str, w_mode: str) -> None:
        self.pads, self.boundary, self.w_mode = pads, boundary, w_mode

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        (top, bottom), (left, right) = self.pads
        x = _pad_rows(args[0], top, bottom, self.boundary)
        if left or right:
            x = F.pad(x, (left, right, 0, 0), mode=self.w_mode)
        return (x, *args[1:])


def _pad_rows(x: torch.Tensor, before: int, after: int, boundary: str) -> torch.Tensor:
    if boundary in ("zeros", "reflect", "replicate", "circular"):
        mode = "constant" if boundary == "zeros" else boundary
        return F.pad(x, (0, 0, before, after), mode=mode)
    n = x.shape[-2]
    k = 1 if boundary == "pole" else 0  # "pole": the pole row is on the grid and is not repeated
    shift = x.shape[-1] // 2 if boundary.startswith("pole") else 0
    north = x.narrow(-2, k, before).flip(-2).roll(shift, -1)
    south = x.narrow(-2, n - k - after, after).flip(-2).roll(shift, -1)
    return torch.cat([north, x, south], dim=-2)

