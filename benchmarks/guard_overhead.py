"""What the guard of functional ops (``halo.guard``) costs: per op while it watches, and per step afterwards.

The guard is a ``TorchFunctionMode`` active during a converted model's first call of each input shape. Measured in
one process (one rank: the mode's Python work per op, without the ranks' agreement, which is one small host
all-gather per *checked* op on more ranks), against the same ops with no mode:

==============  ================================================================================================
case            what
==============  ================================================================================================
elementwise     ``x * 0.5 + 1`` on a small tensor: an op the guard passes through after one dict lookup
checked         ``torch.cat([x, x], dim=1)``: an op it checks (rule, frame walk to the user's line)
layout          ``x.permute(0, 2, 3, 1)``: an op whose output it follows (where H went)
model           a converted U-Net-like model's first forward with the guard and without it (one rank, both
                learning their plans), and a later forward (the guard is off then: nothing to pay)
==============  ================================================================================================

    python benchmarks/guard_overhead.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from halo.tools.bench import append_csv, default_out, print_table, run_meta

__all__ = ["main"]


def _per_call(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


class Net(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.enc = nn.Conv2d(c, c, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(c, c, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.dec = nn.Conv2d(2 * c, c, 3, padding=1)

    def forward(self, x):
        a = F.gelu(self.enc(x))
        b = self.up(F.gelu(self.mid(self.down(a))))
        t = a.permute(0, 2, 3, 1)  # a channels-last detour, as ConvNeXt blocks take
        a = (t * torch.sigmoid(t.mean(-1, keepdim=True))).permute(0, 3, 1, 2)
        return x + self.dec(torch.cat([a, b], dim=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=default_out())
    args = parser.parse_args(argv)

    import halo
    from halo.guard import SpatialGuard
    from halo.testing import run_on_ranks

    x = torch.randn(2, 8, 16, 32)
    guard_cg = halo.dist.comm.comm_group(None)
    rows = []
    for case, fn in (("elementwise", lambda: x * 0.5 + 1), ("checked", lambda: torch.cat([x, x], dim=1)),
                     ("layout", lambda: x.permute(0, 2, 3, 1))):
        plain = _per_call(fn)
        with SpatialGuard({}, guard_cg, 0):
            guarded = _per_call(fn)
        rows.append({"case": case, "plain_us": f"{plain * 1e6:.1f}", "guarded_us": f"{guarded * 1e6:.1f}",
                     "overhead_us": f"{(guarded - plain) * 1e6:.1f}"})
    first, unguarded, steady = run_on_ranks(_first_call, 1, timeout=120)[0]
    rows.append({"case": "model: first call", "plain_us": f"{unguarded * 1e6:.0f}",
                 "guarded_us": f"{first * 1e6:.0f}", "overhead_us": f"{(first - unguarded) * 1e6:.0f}"})
    rows.append({"case": "model: later calls", "plain_us": f"{steady * 1e6:.0f}", "guarded_us": "(off)",
                 "overhead_us": "0"})
    meta = run_meta("gloo", 1)
    rows = [{**meta, **r} for r in rows]
    print_table(rows, ["case", "plain_us", "guarded_us", "overhead_us", "device"])
    append_csv(args.out / "guard_overhead.csv", rows)
    return 0


def _first_call(rank: int, world: int) -> tuple[float, float, float]:
    """A fresh converted model's first call with the guard, without it, and a steady call (best of 5 models)."""
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.plan import plans

    manager = halo.initialize_domain_parallel(world, world)
    x = torch.randn(2, 8, 64, 128)
    with_guard, without, steady = [], [], []
    for trial in range(10):
        plans.state().guard_on = trial % 2 == 0
        torch.manual_seed(trial)
        model = convert_to_domain_parallel(Net(), manager, grid=(64 + 2 * trial, 128))  # a new epoch each time
        xt = torch.randn(2, 8, 64 + 2 * trial, 128)
        t0 = time.perf_counter()
        model(xt)
        (with_guard if plans.state().guard_on else without).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        model(xt)
        steady.append(time.perf_counter() - t0)
    plans.state().guard_on = True
    del x
    return min(with_guard), min(without), min(steady)


if __name__ == "__main__":
    sys.exit(main())
