"""One call that says whether a converted model computes what the original computes: ``check_equivalence``.

Every rank of the domain group calls it with the *unconverted* model (or a factory) and the same whole sample. It
runs a copy of the model unsharded on the whole sample (on every rank: no communication, the reference), and a
converted copy on this rank's rows of the sample, in float64 by default (so rounding is not mistaken for a bug),
in train mode (batch statistics: the harder case) with dropout and drop-path off (their masks are drawn from
another stream by design: ``halo.random``). Forward hooks record every module's output; the sharded outputs are
gathered and compared with the reference's in the order the reference ran them, then the input gradient and every
parameter gradient (summed over the domain group) of ``sum(output * weights)`` with fixed random weights.

The report names the first module whose output differs (its path, type, the error, the reference's scale and the
tolerance used): where a model's sharded run goes wrong, the first differing module is where to look. A module whose
output is whole on every rank (after a global pool) is compared as it is. ``halo check MODULE:FACTORY --shape
B,C,H,W`` runs it from the command line.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["EquivalenceReport", "Mismatch", "check_equivalence"]

_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass
class Mismatch:
    """One compared tensor: where, how far off, against what scale and tolerance."""

    what: str  # "output of enc.0 (Conv2d)", "input gradient", "gradient of enc.0.weight"
    error: float  # max |sharded - unsharded|
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
    """What :func:`check_equivalence` found: every comparison in order, and the first that failed."""

    checks: list[Mismatch] = field(default_factory=list)
    dtype: str = "float64"
    ranks: int = 1
    rtol: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def first_mismatch(self) -> Mismatch | None:
        return next((c for c in self.checks if not c.ok), None)

    def __str__(self) -> str:
        head = (f"halo.check_equivalence: {len(self.checks)} comparisons, {self.ranks} ranks, {self.dtype}, "
                f"tolerance {self.rtol:.0e} x the reference's max |value| per tensor")
        bad = self.first_mismatch
        if bad is None:
            return f"{head}\nOK: every module's output, the input gradient and every parameter gradient match"
        worst = [c for c in self.checks if not c.ok]
        lines = [head, f"FIRST DIFFERENCE: {bad}"]
        lines += [f"  then: {c}" for c in worst[1:6]]
        if len(worst) > 6:
            lines.append(f"  ... and {len(worst) - 6} more")
        return "\n".join(lines)


def _record(model: nn.Module, names: dict[int, str], log: list[tuple[str, Any]]) -> list[Any]:
    handles = []
    for module in model.modules():
        name = names.get(id(module))
        if name is None:
            continue

        def hook(mod, args, output, name=name):
            log.append((name, pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                              output)))

        handles.append(module.register_forward_hook(hook))
    return handles


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> Mismatch:
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    tol = rtol * max(scale, 1e-300)
    if got.shape != want.shape:
        return Mismatch(what, float("inf"), scale, tol, f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
    if got.numel() == 0:
        return Mismatch(what, 0.0, 0.0, tol)
    diff = (got.double() - want.double()).abs()
    nan = bool((got.isnan() != want.isnan()).any())
    err = float(diff.nan_to_num(0.0).max())
    return Mismatch(what, err, scale, tol, "NaN where the reference has none" if nan else "")


def check_equivalence(model: nn.Module | Callable[[], nn.Module], sample: torch.Tensor, *,
                      manager: Any | None = None, dtype: torch.dtype = torch.float64, rtol: float = 1e-9,
                      convert_kwargs: dict[str, Any] | None = None, reference: nn.Module | None = None,
                      seed: int = 0, raise_on_failure: bool = False, mesh: Any | None = None) -> EquivalenceReport:
    """Run ``model`` unsharded and converted (sharded along H over the domain group) on ``sample``; compare every
    module's output, the input gradient and the parameter gradients (module docstring).

    Args:
        model: the *unconverted* model, or a factory returning one (called once per copy). Not modified.
        sample: the whole input field ``(B, C, H, W)``, the same on every rank.
        manager: the domain-parallel manager (default: the initialised one).
        dtype: what both copies run in (float64: differences are bugs, not rounding).
        rtol: tolerance per compared tensor, relative to the reference's largest magnitude in it.
        convert_kwargs: passed to ``convert_to_domain_parallel`` (``boundary=``, ``custom_converters=``, ...).
        reference: the unsharded model to compare with, when it is not ``model`` itself (a boundary torch's layers
            do not have, such as ``"pole"``, written out by hand); modules are matched by name, those only one
            side has are skipped. Its parameters are set from ``model``'s state dict where the names agree.
        raise_on_failure: raise ``AssertionError`` with the report instead of returning a failed one.
        mesh: a latitude x longitude ``halo.DomainMesh((ph, pw))`` instead of a manager: the sample is split into
            blocks (``shard_2d``), the model converted with ``mesh=``, outputs gathered with ``gather_2d``.

    Every rank gets the same report (the comparisons use gathered tensors).
    """
    from .comm import all_reduce as bounded_all_reduce
    from .comm import comm_group, unsharded
    from .mesh import get_domain_parallel_manager, mesh_2d
    from .nn import convert_to_domain_parallel
    from .shard import gather, gather_2d, shard, shard_2d

    if mesh is not None:
        if mesh_2d(mesh) is None:
            raise ValueError(f"check_equivalence: mesh= takes a DomainMesh with two domain axes, got {mesh!r}")
        manager = None
    else:
        manager = manager if manager is not None else get_domain_parallel_manager()
        if manager is None:
            raise RuntimeError("check_equivalence needs a manager: call halo.initialize_domain_parallel first")
    if not isinstance(sample, torch.Tensor) or sample.dim() < 2:
        raise ValueError(f"check_equivalence: sample must be the whole field (B, C, H, W), got "
                         f"{getattr(sample, 'shape', type(sample))}")
    group = manager.domain_group if mesh is None else mesh.domain_group
    ranks = manager.domain_world_size if mesh is None else mesh.domain_size

    def split(t: torch.Tensor) -> torch.Tensor:
        return shard(t, dim=-2, group=group) if mesh is None else shard_2d(t, mesh=mesh)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return gather(t, dim=-2, group=group) if mesh is None else gather_2d(t, mesh=mesh)

    def build() -> nn.Module:
        m = model() if callable(model) and not isinstance(model, nn.Module) else copy.deepcopy(model)
        m = m.to(dtype).train()
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
        ref = copy.deepcopy(reference).to(dtype).train()
    if mesh is None:
        convert_to_domain_parallel(par, manager, **(convert_kwargs or {}))
    else:
        convert_to_domain_parallel(par, mesh=mesh, **(convert_kwargs or {}))
    par_names = {id(m): n or "(model)" for n, m in par.named_modules()}
    both = set(par_names.values())
    names = {id(m): n or "(model)" for n, m in ref.named_modules() if (n or "(model)") in both}
    kinds = {n or "(model)": type(m).__name__ for n, m in ref.named_modules()}

    x_full = sample.detach().to(dtype)
    weights_gen = torch.Generator().manual_seed(seed + 1)

    ref_log: list[tuple[str, Any]] = []
    handles = _record(ref, names, ref_log)
    xr = x_full.clone().requires_grad_(True)
    try:
        with unsharded():  # halo functions in the model's forward act on this process's whole field
            out_ref = ref(xr)
            if not isinstance(out_ref, torch.Tensor):
                raise ValueError(f"check_equivalence: the model must return one tensor, got {type(out_ref).__name__}")
            wts = torch.randn(out_ref.shape, generator=weights_gen, dtype=dtype)
            (out_ref * wts).sum().backward()
    finally:
        for h in handles:
            h.remove()

    par_log: list[tuple[str, Any]] = []
    handles = _record(par, par_names, par_log)
    xp = split(x_full).detach().requires_grad_(True)
    try:
        out_par = par(xp)
    finally:
        for h in handles:
            h.remove()
    (out_par * split(wts)).sum().backward()

    report = EquivalenceReport(dtype=str(dtype).removeprefix("torch."), ranks=ranks, rtol=rtol)
    from .plans import whole_source

    seen: dict[str, int] = {}
    par_by_name: dict[str, list[Any]] = {}
    for name, out in par_log:
        par_by_name.setdefault(name, []).append(out)
    for name, want in ref_log:
        k = seen.get(name, 0)
        seen[name] = k + 1
        label = f"output of {name} ({kinds.get(name, '?')})" + (f" call {k + 1}" if k else "")
        calls = par_by_name.get(name, [])
        if k >= len(calls):
            report.checks.append(Mismatch(label, float("inf"), 0.0, 0.0, "not called in the sharded run"))
            continue
        got = calls[k]
        for i, (w, g) in enumerate(zip(pytree.tree_leaves(want), pytree.tree_leaves(got), strict=False)):
            if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor) or not w.is_floating_point():
                continue
            what = label + (f" [{i}]" if i else "")
            if w.dim() >= 2 and whole_source(g) is None:
                g = _gather(g, whole)
                if g is None:
                    report.checks.append(Mismatch(what, float("inf"), 0.0, 0.0, "could not be gathered along H"))
                    continue
            report.checks.append(_compare(what, g, w, rtol))
    report.checks.append(_compare("input gradient", whole(xp.grad), xr.grad, rtol))
    ref_params = dict(ref.named_parameters())
    if reference is not None:  # parameters match by name or by order (a reference that wraps the layers)
        ref_params = {n: p for (n, _), p in zip(par.named_parameters(), ref.parameters(), strict=False)} \
            if len(list(ref.parameters())) == len(list(par.parameters())) else ref_params
    for name, p in par.named_parameters():
        want = ref_params.get(name)
        if want is None or want.grad is None:
            continue
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        if dist.is_initialized() and ranks > 1:  # each rank holds its rows' share
            bounded_all_reduce(g, comm_group(group), "check_equivalence (parameter gradients)")
        report.checks.append(_compare(f"gradient of {name}", g, want.grad, rtol))
    if raise_on_failure and not report.ok:
        raise AssertionError(str(report))
    return report


def _gather(t: torch.Tensor, whole: Callable) -> torch.Tensor | None:
    try:
        return whole(t.contiguous())
    except (ValueError, RuntimeError):
        return None


def _load(target: str) -> Callable[[], nn.Module]:
    import importlib

    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"halo check: the target must be MODULE:FACTORY (e.g. mypkg.models:build), got {target!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"halo check: cannot load {target!r}: {exc}") from exc
    if not callable(factory):
        raise SystemExit(f"halo check: {target!r} is not callable")
    return factory


def _check_rank(rank: int, world: int, opts: dict) -> str:
    from . import initialize_domain_parallel
    from .mesh import DomainMesh

    on: dict[str, Any] = {}
    if opts.get("mesh"):
        on["mesh"] = DomainMesh(opts["mesh"], periodic=(False, True))
    else:
        initialize_domain_parallel(world, world)
    factory = _load(opts["target"])
    sample = torch.randn(opts["shape"], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    convert_kwargs = {"boundary": opts["boundary"]} if opts["boundary"] else {}
    dtype = getattr(torch, opts["dtype"])
    rtol = opts["rtol"] if opts["rtol"] is not None else (1e-9 if dtype == torch.float64 else 1e-4)
    try:
        report = check_equivalence(factory, sample, dtype=dtype, rtol=rtol, convert_kwargs=convert_kwargs, **on)
    except ValueError as exc:  # refused by the converter or the guard: the same on every rank
        return f"REFUSED: {exc}"
    return str(report)


def run_check(args: Any) -> int:
    """``halo check MODULE:FACTORY --shape B,C,H,W``: 0 if the converted model equals the unsharded one."""
    from .launch import is_printer, launch

    try:
        shape = tuple(int(v) for v in args.shape.split(","))
    except ValueError as exc:
        raise SystemExit(f"halo check: --shape must be B,C,H,W integers, got {args.shape!r}") from exc
    mesh = getattr(args, "mesh", None)
    if mesh:
        if len(shape) < 3 or shape[-2] < mesh[0] or shape[-1] < mesh[1]:
            raise SystemExit(f"halo check: --shape {shape} needs at least 3 dims, H >= {mesh[0]} and W >= {mesh[1]} "
                             f"for a {mesh[0]}x{mesh[1]} mesh")
        args.nproc = mesh[0] * mesh[1]
    elif len(shape) < 3 or shape[-2] < args.nproc:
        raise SystemExit(f"halo check: --shape {shape} needs at least 3 dims and H >= --nproc ({args.nproc})")
    _load(args.target)  # a bad target fails here, before any rank starts
    opts = {"target": args.target, "shape": shape, "boundary": args.boundary, "dtype": args.dtype,
            "rtol": args.rtol, "mesh": mesh}
    results = launch(_check_rank, args.nproc, opts, backend=args.backend, timeout=args.timeout)
    if not is_printer():
        return 0
    text = results[0]
    print(text)
    return 0 if text.splitlines()[-1].startswith("OK") else 1
