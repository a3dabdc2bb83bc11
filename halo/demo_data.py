"""``halo demo --data PATH``: a short sharded rollout on a real netCDF/HDF5/zarr file, with its scores.

Every rank reads only its latitude rows of the file (:class:`halo.io.ShardedField`), normalises them with the
exact global statistics, and rolls the demo's model (untrained: the point is that sharded equals unsharded, not
skill) forward ``--leads`` steps from the first time step, sharded; scores are latitude-weighted RMSE and ACC
against the file's later time steps (:func:`halo.rollout.scores`). Rank 0 then reads the whole field, runs the
same model unsharded (convs padded across the poles by hand) and compares predictions and scores. One picture per
lead time: the target, the sharded prediction and their difference for the first channel.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_data_demo"]


def _rank_main(rank: int, world: int, opts: dict) -> dict | None:
    from . import initialize_domain_parallel
    from .comm import unsharded
    from .demo import DemoNet, pole_boundary, reference_model
    from .io import ShardedField
    from .launch import rank_device
    from .nn import convert_to_domain_parallel
    from .rollout import rollout, scores
    from .shard import gather

    device, dtype = rank_device(opts["backend"]), getattr(torch, opts["dtype"])
    initialize_domain_parallel(world, world)
    field = ShardedField(opts["data"], opts["variables"])
    steps = len(field)
    leads = min(opts["leads"], steps - 1)
    if leads < 1:
        raise SystemExit(f"halo demo --data: {opts['data']} has {steps} time step(s); a rollout needs at least 2")
    mean, std = field.stats()
    mean, std = mean.to(device, dtype).view(-1, 1, 1), std.to(device, dtype).clamp_min(1e-12).view(-1, 1, 1)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return (x.to(device, dtype) - mean) / std

    h, w = field.shape
    c = len(field.channels)
    boundary = pole_boundary(h)
    torch.manual_seed(opts["seed"])
    net = DemoNet(c, opts["hidden"], (h, w)).to(device, dtype)
    model = convert_to_domain_parallel(copy.deepcopy(net), boundary=boundary, grid=(h, w))
    x0 = norm(field.sample(0))[None]
    targets = [norm(field.sample(k))[None] for k in range(1, leads + 1)]
    t0 = time.perf_counter()
    preds = rollout(model, x0, leads)
    seconds = time.perf_counter() - t0
    sharded = scores(preds, targets)
    full_preds = [gather(p) for p in preds]
    full_targets = [gather(t) for t in targets]
    full_x0 = gather(x0)
    if rank != 0:
        return None
    with unsharded():  # the reference: the whole field on this process, plain torch
        ref_preds = rollout(reference_model(net, boundary), full_x0, leads)
        ref = scores(ref_preds, full_targets)
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(full_preds, ref_preds,
                                                                                         strict=True))
    score_err = max(float((sharded[k] - ref[k]).abs().max()) for k in ("rmse", "acc"))
    return {"channels": field.channels, "grid": (h, w), "leads": leads, "world": world, "seconds": seconds,
            "rmse": sharded["rmse"][:, 0].cpu(), "acc": sharded["acc"][:, 0].cpu(), "err": err,
            "score_err": score_err, "tol": 1e-5 if dtype == torch.float32 else 1e-11,
            "maps": [(full_targets[k][0, 0].float().cpu(), full_preds[k][0, 0].float().cpu()) for k in range(leads)],
            "bytes_rows": (field.rows.start, field.rows.stop)}


def _pictures(res: dict, out: Path) -> list[Path]:
    from .demo import _png_bytes, _rgb_rows

    paths = []
    for k, (target, pred) in enumerate(res["maps"], start=1):
        lim = float(max(target.abs().max(), pred.abs().max())) or 1.0
        diff = (pred - target).abs()
        gap = [bytes(3 * target.shape[1])] * 4
        rows = (_rgb_rows(target, -lim, lim, []) + gap + _rgb_rows(pred, -lim, lim, []) + gap
                + _rgb_rows(diff, -float(diff.max() or 1.0), float(diff.max() or 1.0), []))
        path = out / f"halo_rollout_lead{k}.png"
        path.write_bytes(_png_bytes(rows, target.shape[1]))
        paths.append(path)
    return paths


def run_data_demo(args: argparse.Namespace) -> int:
    """Run the data demo (module docstring); 0 if the sharded rollout equals the unsharded one."""
    from .launch import is_printer, launch

    if not Path(args.data).exists():
        raise SystemExit(f"halo demo: --data {args.data}: no such file or store")
    opts: dict[str, Any] = {"data": args.data, "leads": args.leads, "hidden": args.hidden, "dtype": args.dtype,
                            "seed": args.seed, "backend": args.backend,
                            "variables": args.variables.split(",") if args.variables else None}
    results = launch(_rank_main, args.nproc, opts, backend=args.backend, timeout=args.timeout)
    if not is_printer():
        return 0
    res = results[0]
    h, w = res["grid"]
    print(f"halo demo --data {args.data}: {h}x{w} grid, channels {res['channels']}, {res['world']} ranks, "
          f"{res['leads']} leads (each rank read only its latitude rows)")
    names = res["channels"]
    print("lead  " + "  ".join(f"{'RMSE ' + n:>14}  {'ACC ' + n:>12}" for n in names) + "   (normalised units)")
    for k in range(res["leads"]):
        print(f"{k + 1:>4}  " + "  ".join(f"{float(res['rmse'][k, i]):>14.4f}  {float(res['acc'][k, i]):>12.4f}"
                                          for i in range(len(names))))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in _pictures(res, out):
        print(f"picture: {path}")
    ok = res["err"] <= res["tol"] and res["score_err"] <= res["tol"]
    print(f"sharded vs unsharded rollout: max relative error {res['err']:.2e}, scores {res['score_err']:.2e} "
          f"(tolerance {res['tol']:.0e}); rollout {res['seconds']:.3f} s on rank 0")
    print("OK: the sharded rollout equals the unsharded one" if ok else "FAILED: sharded differs from unsharded")
    return 0 if ok else 1
