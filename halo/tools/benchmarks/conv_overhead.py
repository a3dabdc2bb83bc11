"""DomainConv2d forward + backward against nn.Conv2d on a tensor of the same local shape, in one run.

Every rank holds its part of a ``(1, C, H, W)`` activation split along H (721 x 1440 on GPU; on CPU 361 x 720
by default, a weather-sized shard that a 1-thread rank convolves in ~0.1-1 s), and times, interleaved:

==========  ==================================================================================
impl        one call
==========  ==================================================================================
plain       ``nn.Conv2d(C, C, 3, padding=1)`` on a local tensor ``(1, C, H_r, W)``: the floor
halo        ``DomainConv2d(conv)`` in a converted model, as users get it by default: the model's entry agrees
            on its input shapes (one small host all-gather), the layer recalls its plan and computes then
            patches (the conv of the shard while the halo rows travel, then their taps added to the boundary
            rows; the halo gradients added into the conv's own input gradient: no copy either way)
halo-grid   the same converted with a declared ``grid=`` (no agreement at all)
pad         ``DomainConv2d(conv, overlap=False)`` in a converted model: pad-then-conv (the exchange writes the
            extended shard into a buffer it reuses: one copy of the shard each way)
==========  ==================================================================================

each as ``y = layer(gelu(x)); y.backward(g)`` (a layer inside a network: its input comes from an activation and
its input gradient goes back into one, for plain and halo alike). ``ratio`` = the median over iterations of impl /
plain in the same iteration (paired: steadier on a shared machine than a ratio of medians); the goal is <= 1.05.
Each iteration's time is the max over ranks; the table gives medians.

    python benchmarks/conv_overhead.py [--quick] [--nproc 2] [--grid 361x720] [--channels 32,64]
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from halo.tools.bench import (
    append_csv,
    benchmark_parser,
    median,
    paired_ratio,
    plot_panels,
    print_table,
    rank_entry,
    run_meta,
    run_watched,
    time_iterations,
)

__all__ = ["main", "run"]

IMPLS = ("plain", "halo", "halo-grid", "pad")


def _step(layer: Any, x: torch.Tensor, g: torch.Tensor) -> None:
    """One forward + backward of ``layer`` on an activation of ``x`` (grads cleared first, as an optimizer step
    would)."""
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    layer(torch.nn.functional.gelu(x)).backward(g)


def conv_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    """One rank: time every impl's fwd + bwd for each channel count; rows on rank 0."""
    import torch.distributed as dist
    from torch import nn

    import halo
    from halo.launch import rank_device
    from halo.nn import convert_to_domain_parallel
    from halo.nn.conv import DomainConv2d
    from halo.plan.partition import split_sizes

    device = rank_device(cfg["backend"])
    dtype = getattr(torch, cfg["dtype"])
    group = dist.group.WORLD
    manager = halo.initialize_domain_parallel(world, world)
    h, w = cfg["grid"]
    rows_local = split_sizes(h, world)[rank]
    meta = run_meta(cfg["backend"], world, device)
    out = []
    began = time.perf_counter()
    for i, c in enumerate(cfg["channels"], start=1):
        if rank == 0:  # progress: a full CPU run takes tens of seconds
            print(f"  conv: case {i}/{len(cfg['channels'])}: {c} channels, {rows_local} local rows x {w} "
                  f"({time.perf_counter() - began:.0f} s so far)", flush=True)
        torch.manual_seed(0)
        conv = nn.Conv2d(c, c, 3, padding=1).to(device, dtype)
        layers = {"plain": conv,
                  "halo": convert_to_domain_parallel(nn.Sequential(conv), manager),
                  "halo-grid": convert_to_domain_parallel(nn.Sequential(conv), manager, grid=(h, w)),
                  "pad": convert_to_domain_parallel(nn.Sequential(DomainConv2d(conv, group=group, overlap=False)),
                                                    manager)}
        torch.manual_seed(1 + rank)  # each rank its own share (the entry refuses one field held whole by every rank)
        x = torch.randn(1, c, rows_local, w, device=device, dtype=dtype, requires_grad=True)
        if cfg["channels_last"]:
            x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
        g = torch.randn(1, c, rows_local, w, device=device, dtype=dtype)

        ref = layers["halo"](x)
        for name in ("halo-grid", "pad"):  # the sharded forms agree (the tests check exactness)
            if not torch.allclose(layers[name](x), ref, atol=1e-5):
                raise RuntimeError(f"conv_overhead: {name} output differs from the default")
        fns = {name: functools.partial(_step, layers[name], x, g) for name in IMPLS}
        times = time_iterations(fns, cfg["reps"], group, device, warmup=2)
        for name in IMPLS:
            t = median(times[name])
            out.append(dict(meta, dtype=cfg["dtype"], layout="channels_last" if cfg["channels_last"] else
                            "contiguous", grid=f"{h}x{w}", channels=c, local_rows=rows_local, kernel=3, impl=name,
                            time_ms=f"{t * 1e3:.2f}", ratio_plain=f"{paired_ratio(times[name], times['plain']):.3f}",
                            reps=cfg["reps"]))
    return out if rank == 0 else []


def run(opts: dict, *, grid: tuple[int, int] | None = None, channels: Sequence[int] | None = None,
        reps: int | None = None, dtype: str | None = None, channels_last: bool = False) -> int:
    """Run on ``opts['nproc']`` CPU ranks (or the torchrun world); print, append CSV, plot."""
    from halo.launch import is_printer, launch

    gpu, quick = opts["backend"] == "nccl", opts["quick"]
    if grid is None:
        grid = (91, 360) if quick else ((721, 1440) if gpu else (361, 720))
    cfg = {"backend": opts["backend"], "grid": grid, "channels": list(channels or ([32] if quick else [32, 64])),
           "reps": reps or (3 if quick else (20 if gpu else 7)), "dtype": dtype or ("bfloat16" if gpu else "float32"),
           "channels_last": channels_last}
    if is_printer() and not gpu and not quick and grid == (361, 720):
        print("CPU: grid 361x720 (0.5 deg) instead of 721x1440, to keep a 1-thread rank's step under a second")
    results = launch(rank_entry, opts["nproc"], "conv_overhead", "conv_rank", cfg, backend=opts["backend"],
                     timeout=opts["timeout"])
    if not is_printer():
        return 0
    rows = results[0]
    print_table(rows, ["grid", "channels", "local_rows", "dtype", "layout", "impl", "time_ms", "ratio_plain"])
    append_csv(Path(opts["out"]) / "conv_overhead.csv", rows)
    series = {impl: [(int(r["channels"]), float(r["ratio_plain"])) for r in rows if r["impl"] == impl]
              for impl in IMPLS if impl != "plain"}
    ms = {impl: [(int(r["channels"]), float(r["time_ms"])) for r in rows if r["impl"] == impl] for impl in IMPLS}
    first = rows[0]
    plot_panels(Path(opts["out"]) / "conv_overhead.png", [
        {"title": "DomainConv2d fwd+bwd / nn.Conv2d (same local shape)", "xlabel": "channels", "ylabel": "ratio",
         "series": series, "hline": 1.05},
        {"title": "time per fwd+bwd (max over ranks, median)", "xlabel": "channels", "ylabel": "ms",
         "series": ms}], f"3x3 conv on {first['grid']} over {first['world']} ranks, {first['device']}, "
                         f"{first['backend']}, {first['dtype']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from halo.launch import default_backend

    parser = benchmark_parser(__doc__)
    parser.add_argument("--grid", default=None, help="HxW of the global activation, e.g. 721x1440")
    parser.add_argument("--channels", default=None, help="e.g. 32,64")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0)
    a = parser.parse_args(argv)
    opts = {"quick": a.quick, "nproc": a.nproc, "backend": a.backend or default_backend(), "out": a.out,
            "timeout": a.timeout}
    grid = tuple(int(v) for v in a.grid.lower().split("x")) if a.grid else None
    channels = [int(c) for c in a.channels.split(",")] if a.channels else None
    return run_watched(lambda: run(opts, grid=grid, channels=channels, reps=a.reps, dtype=a.dtype,
                                   channels_last=a.channels_last), own=a.nproc)


if __name__ == "__main__":
    raise SystemExit(main())
