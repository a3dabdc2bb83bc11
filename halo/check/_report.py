"""What :func:`halo.check.check_equivalence` compares and reports: the measure of one difference, its tolerance
relative to what produces the tensor, the maximum over the ranks, and the report users read.

Split out of :mod:`halo.check` (the call itself), which re-exports :class:`Mismatch` and
:class:`EquivalenceReport` (users import them from ``halo.check``). The other public names here (:class:`Pending`,
:func:`measure`, :func:`max_abs`, :func:`agree_errors`, :func:`grad_floor`, :func:`differentiable`) are the
pieces ``check_equivalence`` is made of, public within the package so that ``halo.check`` imports no private name;
they are not part of halo's API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..dist.comm import CommGroup
from ..dist.comm import all_reduce as bounded_all_reduce

__all__ = ["GRAD_FLOOR_OF_MODEL", "EquivalenceReport", "Mismatch", "Pending", "agree_errors", "differentiable",
           "grad_floor", "max_abs", "measure"]


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
    #: module outputs not compared: intermediates of halo layers in their own layout, whose layers' outputs match
    inside: list[str] = field(default_factory=list)

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
            ok = f"{head}\nOK: every module's output, the input gradient and every parameter gradient match"
            return ok + self._inside()
        worst = [c for c in self.checks if not c.ok]
        lines = [head, f"FIRST DIFFERENCE: {bad}"]
        if self.where:
            lines.append(f"  where: {self.where}")
        lines += [f"  then: {c}" for c in worst[1:6]]
        if len(worst) > 6:
            lines.append(f"  ... and {len(worst) - 6} more")
        return "\n".join(lines) + self._inside()

    def _inside(self) -> str:
        if not self.inside:
            return ""
        shown = ", ".join(self.inside[:3]) + (f" and {len(self.inside) - 3} more" if len(self.inside) > 3 else "")
        return (f"\n(not compared: {len(self.inside)} intermediates of halo layers in their own layout, whose "
                f"layers' outputs match: {shown})")


def differentiable(t: Any) -> bool:
    """A floating or complex tensor: compared within a tolerance and weighted in the loss (others: exactly, and
    not in the loss)."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def measure(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, bool, str]:
    """(max |got - want|, max finite |want|, NaN where the reference has none, note) on this rank."""
    if got.shape != want.shape:
        return float("inf"), 0.0, False, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    note = f"dtype {got.dtype} vs {want.dtype}" if got.dtype != want.dtype else ""
    if want.numel() == 0:
        return 0.0, 0.0, False, note
    if differentiable(want) or differentiable(got):
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


def max_abs(leaves: list[Any]) -> float:
    """The largest finite magnitude among the floating (or complex) tensors of ``leaves`` (0 without any)."""
    best = 0.0
    for t in leaves:
        if differentiable(t) and t.numel():
            mag = t.detach().abs()
            best = max(best, float(mag.masked_fill(~torch.isfinite(mag), 0.0).max()))
    return best


class Pending:
    """A comparison whose error is made final after the maximum over the ranks (:func:`agree_errors`).

    ``got`` ``None``: nothing could be compared (the error is infinite; ``note`` says why). The tolerance is
    ``rtol`` times the larger of the reference's own scale and ``floor`` (the scale of what produces it); integer
    and boolean tensors are compared exactly."""

    def __init__(self, what: str, got: torch.Tensor | None, want: torch.Tensor, floor: float, rtol: float,
                 note: str = "") -> None:
        self.what, self.note = what, note
        if got is None:
            self.error, self.scale, self.nan = float("inf"), max_abs([want]), False
        else:
            self.error, self.scale, self.nan, extra = measure(got, want)
            self.note = self.note or extra
        exact = not differentiable(want)
        self.tol = 0.0 if exact else rtol * max(self.scale, floor, 1e-300)

    def final(self) -> Mismatch:
        note = self.note or ("NaN where the reference has none" if self.nan else "")
        return Mismatch(self.what, self.error, self.scale, self.tol, note)


def agree_errors(pending: list[Pending], cg: CommGroup | None, device: torch.device) -> None:
    """Each error and NaN flag becomes the maximum over the ranks (one all-reduce): every rank reports alike."""
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


def grad_floor(name: str, maxima: dict[str, float]) -> float:
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
