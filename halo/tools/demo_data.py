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
    from ..dist.comm import unsharded
    from ..dist.mesh import initialize_domain_parallel
    from ..io import ShardedField
    from ..launch import rank_device
    from ..nn import convert_to_domain_parallel
    from ..plan.partition import split_offsets
    from ..rollout import rollout, scores
    from ..shard import gather
    from .demo import DemoNet, pole_boundary, reference_model

    began = time.perf_counter()

    def say(msg: str) -> None:  # progress, rank 0: reading a large file takes a while
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - began:.1f} s] {msg}", flush=True)

    device, dtype = rank_device(opts["backend"]), getattr(torch, opts["dtype"])
    initialize_domain_parallel(world, world)
    say(f"opening {opts['data']} on {world} ranks (each reads only its latitude rows)...")
    field = ShardedField(opts["data"], opts["variables"])
    steps = len(field)
    leads = min(opts["leads"], steps - 1)
    if leads < 1:
        raise SystemExit(f"halo demo --data: {opts['data']} has {steps} time step(s); a rollout needs at least 2")
    say(f"global statistics of {len(field.channels)} channels over {steps} time steps...")
    mean, std = field.stats(dtype)
    mean, std = mean.to(device, dtype).view(-1, 1, 1), std.to(device, dtype).clamp_min(1e-12).view(-1, 1, 1)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return (x.to(device, dtype) - mean) / std

    h, w = field.shape
    c = len(field.channels)
    boundary = pole_boundary(h)
    torch.manual_seed(opts["seed"])
    net = DemoNet(c, opts["hidden"], (h, w)).to(device, dtype)
    model = convert_to_domain_parallel(copy.deepcopy(net), boundary=boundary, grid=(h, w))
    say(f"reading time steps 0..{leads} and rolling the untrained model forward {leads} leads, sharded...")
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
    say("unsharded reference rollout (rank 0, the whole field)...")
    with unsharded():  # the reference: the whole field on this process, plain torch
        ref_preds = rollout(reference_model(net, boundary), full_x0, leads)
        ref = scores(ref_preds, full_targets)
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(full_preds, ref_preds,
                                                                                         strict=True))
    score_err = max(float((sharded[k] - ref[k]).abs().max()) for k in ("rmse", "acc"))
    m0, s0 = float(mean[0, 0, 0]), float(std[0, 0, 0])  # channel 0 back in the file's units for the pictures

    def physical(t: torch.Tensor) -> torch.Tensor:
        return (t[0, 0].double() * s0 + m0).float().cpu()

    return {"channels": field.channels, "grid": (h, w), "leads": leads, "world": world, "seconds": seconds,
            "rmse": sharded["rmse"][:, 0].cpu(), "acc": sharded["acc"][:, 0].cpu(), "err": err,
            "score_err": score_err, "tol": 1e-5 if dtype == torch.float32 else 1e-11,
            "maps": [(physical(full_targets[k]), physical(full_preds[k]),
                      float((full_preds[k][0, 0] - ref_preds[k][0, 0]).abs().max()) * s0) for k in range(leads)],
            "coords": _coords(field), "units": _units(field), "dtype": opts["dtype"],
            "offsets": split_offsets(h, world), "bytes_rows": (field.rows.start, field.rows.stop)}


def _coords(field: Any) -> tuple[list[float], list[float]] | None:
    """(latitudes in the order of the samples' rows, longitudes) in degrees, from the file; None without them."""
    import numpy as np

    try:
        lat = np.asarray(field.ds[field.lat].values, dtype=np.float64)
        lon = np.asarray(field.ds[field.lon].values, dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        return None
    if lat.ndim != 1 or lon.ndim != 1 or lat.size < 2 or lon.size < 2:
        return None
    if getattr(field, "flipped", False):  # the samples' rows are the file's, mirrored
        lat = lat[::-1]
    return lat.tolist(), lon.tolist()


def _units(field: Any) -> str:
    """The first channel's name and units (``t2m (K)``), from the file's attributes."""
    var = field.variables[0]
    units = field.ds[var].attrs.get("units")
    return f"{field.channels[0]} ({units})" if units else f"{field.channels[0]} (the file's units)"


def _pictures(res: dict, out: Path) -> list[Path]:
    """One picture per lead: the file's field at that time, the sharded prediction (shards labelled by rank) and
    |prediction - target| (a sequential map), channel 0 in the file's units, latitude and longitude in degrees."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plain_pictures(res, out)
    from .demo import label_shards

    h, w = res["grid"]
    coords = res["coords"]
    if coords is None:  # no coordinates in the file: a global grid, north to south, is assumed for the axes
        lat = [90.0 - 180.0 * i / max(h - 1, 1) for i in range(h)]
        lon = [360.0 * j / w for j in range(w)]
    else:
        lat, lon = coords
    north_first = lat[0] >= lat[-1]
    lat_shown = lat if north_first else lat[::-1]
    dlon = (lon[-1] - lon[0]) / max(w - 1, 1)
    extent = (lon[0] - dlon / 2, lon[-1] + dlon / 2, float(lat_shown[-1]), float(lat_shown[0]))
    paths = []
    for k, (target, pred, vs_unsharded) in enumerate(res["maps"], start=1):
        if not north_first:  # draw north up whatever the file's order
            target, pred = target.flip(0), pred.flip(0)
        diff = (pred - target).abs()
        lo, hi = float(min(target.min(), pred.min())), float(max(target.max(), pred.max()))
        fig, axes = plt.subplots(3, 1, figsize=(9, 13), constrained_layout=True)
        panels = ((target, f"the file at time step {k} (the target of lead {k})", "RdBu_r", lo, hi, res["units"]),
                  (pred, f"sharded rollout, lead {k} (gathered), shards labelled by rank", "RdBu_r", lo, hi,
                   res["units"]),
                  (diff, f"|prediction - target|, lead {k}: RMSE {float(res['rmse'][k - 1, 0]):.3g} (normalised)",
                   "viridis", 0.0, float(diff.max()) or 1.0, f"|error| of {res['units']}"))
        for ax, (img, title, cmap, vmin, vmax, label) in zip(axes, panels, strict=True):
            im = ax.imshow(img.numpy(), extent=extent, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax,
                           interpolation="nearest")
            ax.set(title=title, xlabel="longitude (degrees east)", ylabel="latitude (degrees north)")
            fig.colorbar(im, ax=ax, shrink=0.85, label=label)
        offs = res["offsets"] if north_first else [h - o for o in reversed(res["offsets"])]
        label_shards(axes[1], lat_shown, offs, [0, w], w, first_rank_at_bottom=not north_first)
        fig.suptitle(f"halo demo --data: {h}x{w} grid, {res['channels'][0]}, lead {k} of {res['leads']}, "
                     f"{res['world']} ranks (latitude rows), {res['dtype']}\nthe model is untrained (random weights): "
                     f"it shows that sharded equals unsharded, not skill\n(max |sharded - unsharded| here: "
                     f"{vs_unsharded:.1e})",
                     fontsize=10)
        path = out / f"halo_rollout_lead{k}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _plain_pictures(res: dict, out: Path) -> list[Path]:
    """Without matplotlib: target, prediction and |error| stacked in a plain PNG (no text)."""
    from .demo import png_bytes, rgb_rows, rgb_rows_sequential

    paths = []
    for k, (target, pred, _) in enumerate(res["maps"], start=1):
        lo, hi = float(min(target.min(), pred.min())), float(max(target.max(), pred.max()))
        diff = (pred - target).abs()
        gap = [bytes(3 * target.shape[1])] * 4
        rows = (rgb_rows(target, lo, hi, []) + gap + rgb_rows(pred, lo, hi, []) + gap
                + rgb_rows_sequential(diff, float(diff.max()) or 1.0))
        path = out / f"halo_rollout_lead{k}.png"
        path.write_bytes(png_bytes(rows, target.shape[1]))
        paths.append(path)
    return paths


def run_data_demo(args: argparse.Namespace) -> int:
    """Run the data demo (module docstring); 0 if the sharded rollout equals the unsharded one."""
    from ..launch import is_printer, launch

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
          f"{res['leads']} leads of an untrained model (each rank read only its latitude rows)")
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
