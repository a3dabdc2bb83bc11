"""HaloConv2d: pad-then-conv vs compute-then-patch (``overlap=True``) vs a plain conv of the same local shape.

Two gloo ranks on CPU, each holding a weather-sized shard ``(1, C, H_r, W)`` (default 64 x 181 x 360: ERA5
at 1 degree split in two), a 3x3 conv with padding 1. One step = forward + backward (input and parameter
gradients). The three variants run round-robin in the same iterations, so load drift on a shared machine
hits them alike; each iteration's time is the max over ranks (the step is as slow as its slowest rank). The
table reports the median over iterations and the median of the per-round ratio to the plain conv (paired in
time, so it is far less noisy than a ratio of medians on a loaded machine); the plain conv of the same local
size is the floor HaloConv2d cannot beat.

    python benchmarks/conv_overlap.py [--channels 64] [--rows 181] [--cols 360] [--iters 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import time
from pathlib import Path

import torch

from halo.testing import run_on_ranks

VARIANTS = ("plain", "pad_then_conv", "compute_then_patch")


def _rank(rank: int, world: int, channels: int, rows: int, cols: int, iters: int) -> dict[str, list[float]]:
    os.environ["TRITON_INTERPRET"] = "0"
    import torch.distributed as dist
    from torch import nn

    import halo
    from halo.nn.conv import HaloConv2d

    halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    conv = nn.Conv2d(channels, channels, 3, padding=1)
    layers = {"plain": conv, "pad_then_conv": HaloConv2d(conv, overlap=False),
              "compute_then_patch": HaloConv2d(conv, overlap=True)}
    x = torch.randn(1, channels, rows, cols, requires_grad=True)
    grad = torch.randn(1, channels, rows, cols)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for it in range(iters + 2):  # two warm-up rounds
        for name in VARIANTS:
            dist.barrier()
            t0 = time.perf_counter()
            layers[name](x).backward(grad)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if it >= 2:
                times[name].append(t.item())
            x.grad = None
            conv.zero_grad(set_to_none=True)
    return times


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--rows", type=int, default=181, help="rows per rank")
    ap.add_argument("--cols", type=int, default=360)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None, help="append CSV rows to OUT/conv_overlap.csv")
    args = ap.parse_args(argv)
    times = run_on_ranks(_rank, 2, args.channels, args.rows, args.cols, args.iters, timeout=1800)[0]
    floor = statistics.median(times["plain"])
    rows = []
    print(f"2 gloo ranks, shard (1, {args.channels}, {args.rows}, {args.cols}) fp32, 3x3 conv, fwd+bwd, "
          f"median of {args.iters} (max over ranks)")
    print(f"{'variant':<20} {'median ms':>10} {'min ms':>8} {'paired ratio to plain (median, IQR)':>36}")
    for name in VARIANTS:
        med = statistics.median(times[name])
        ratios = [t / p for t, p in zip(times[name], times["plain"], strict=True)]
        q1, ratio, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        rows.append({"device": "cpu", "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                     "variant": name, "channels": args.channels, "rows": args.rows, "cols": args.cols,
                     "iters": args.iters, "median_ms": round(1e3 * med, 3), "min_ms": round(1e3 * min(times[name]), 3),
                     "median_vs_plain": round(med / floor, 4), "paired_ratio": round(ratio, 4)})
        print(f"{name:<20} {1e3 * med:>10.1f} {1e3 * min(times[name]):>8.1f} "
              f"{ratio:>20.3f}x ({q1:.3f}-{q3:.3f})")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "conv_overlap.csv"
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
