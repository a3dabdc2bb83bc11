"""``halo check MODULE:FACTORY --shape B,C,H,W``: :func:`halo.check.check_equivalence` from the command line.

The library part (the comparison, :func:`~halo.check.boundary_reference`) is :mod:`halo.check`; this module is
the command's part: load the user's factory by name, build the model and sample the same way on every rank, start
the ranks (:mod:`halo.launch`) and print rank 0's report. It sits with the other tools so that the library never
imports the launcher or a user's module by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..check import boundary_reference, check_equivalence
from ..dist.mesh import DomainMesh, initialize_domain_parallel
from ..launch import is_printer, launch, rank_device
from ..plan.partition import check_boundary

__all__ = ["run_check"]


def _load(target: str, what: str = "the target") -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"halo check: {what} must be MODULE:FACTORY (e.g. mypkg.models:build), got {target!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"halo check: cannot load {target!r}: {exc}") from exc
    if not callable(factory):
        raise SystemExit(f"halo check: {target!r} is not callable")
    return factory


def _prepare(opts: dict, device: torch.device) -> tuple[nn.Module, torch.Tensor, nn.Module | None]:
    """``halo check``'s model (built by the target under seed 0), sample and reference, on ``device`` (the group's:
    ``cuda:LOCAL_RANK`` under NCCL, which cannot communicate CPU tensors)."""
    factory = _load(opts["target"])
    torch.manual_seed(0)
    model = factory()
    if not isinstance(model, nn.Module):
        raise SystemExit(f"halo check: {opts['target']!r} returned a {type(model).__name__}, not an nn.Module")
    model = model.to(device)
    sample = torch.randn(opts["shape"], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sample = sample.to(device)  # drawn on the CPU: the same sample on every device
    reference = None
    if opts.get("reference"):
        reference = _load(opts["reference"], "--reference")(model)
        if not isinstance(reference, nn.Module):
            raise SystemExit(f"halo check: --reference {opts['reference']!r} returned a "
                             f"{type(reference).__name__}, not an nn.Module")
        reference = reference.to(device)
    elif opts.get("boundary"):
        reference = boundary_reference(model, opts["boundary"])
    return model, sample, reference


def _check_rank(rank: int, world: int, opts: dict) -> str:
    """One rank of ``halo check``: the report as text (the same on every rank), or ``REFUSED: why``."""
    on: dict[str, Any] = {}
    if opts.get("mesh"):
        on["mesh"] = DomainMesh(opts["mesh"], periodic=(False, True))
    else:
        initialize_domain_parallel(world, world)
    model, sample, reference = _prepare(opts, rank_device(opts.get("backend") or "gloo"))
    convert_kwargs = {"boundary": opts["boundary"]} if opts["boundary"] else {}
    dtype = getattr(torch, opts["dtype"])
    rtol = opts["rtol"] if opts["rtol"] is not None else (1e-9 if dtype == torch.float64 else 1e-4)
    try:
        report = check_equivalence(model, sample, dtype=dtype, rtol=rtol, convert_kwargs=convert_kwargs,
                                   reference=reference, **on)
    except ValueError as exc:  # refused by the converter or the guard: the same on every rank
        return f"REFUSED: {exc}"
    return str(report)


def run_check(args: Any) -> int:
    """``halo check MODULE:FACTORY --shape B,C,H,W``: 0 if the converted model equals the unsharded one."""
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
    reference = getattr(args, "reference", None)
    if reference:
        _load(reference, "--reference")
    if args.boundary:
        try:
            check_boundary(args.boundary)
        except ValueError as exc:
            raise SystemExit(f"halo check: --boundary: {exc}") from exc
    opts = {"target": args.target, "shape": shape, "boundary": args.boundary, "dtype": args.dtype,
            "rtol": args.rtol, "mesh": mesh, "reference": reference, "backend": args.backend}
    results = launch(_check_rank, args.nproc, opts, backend=args.backend, timeout=args.timeout)
    if not is_printer():
        return 0
    text = results[0]
    print(text)
    return 0 if text.splitlines()[-1].startswith("OK") else 1
