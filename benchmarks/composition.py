"""Step time of a converted model with each data-parallel wrapping of ``halo.parallelize``, in one run.

4 gloo CPU ranks (dp 2 x domain 2), the demo's U-Net-like model at 181 x 360 (float32, 16 hidden channels), one step
= forward, loss, backward, ``sync_domain_gradients(model)``, SGD step; each mode's own model, interleaved over
iterations, max over ranks per iteration, medians. ``ratio`` = the median of mode / ``none`` in the same iteration.

    python benchmarks/composition.py [--out DIR] [--iters 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from halo.tools.bench import (
    LoadWatch,
    append_csv,
    default_out,
    median,
    paired_ratio,
    print_table,
    run_meta,
    time_iterations,
)

__all__ = ["main"]

MODES = ("none", "ddp", "fsdp", "fsdp-all")


def _rank(rank: int, world: int, iters: int) -> dict:
    import halo
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.plan.partition import split_offsets
    from halo.tools.demo import DemoNet

    manager = halo.initialize_domain_parallel(world, 2)
    h, w = 181, 360
    offs = split_offsets(h, 2)
    r = manager.domain_rank
    x = torch.randn(1, 4, h, w, generator=torch.Generator().manual_seed(manager.dp_rank))[..., offs[r]:offs[r + 1], :]
    steps = {}
    for mode in MODES:
        if rank == 0:
            print(f"  composition: building {mode!r} ...", flush=True)
        torch.manual_seed(0)
        model = halo.parallelize(DemoNet(4, 16, (h, w)), manager, data_parallel=mode, grid=(h, w))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            domain_mean((model(x) - x) ** 2).backward()
            sync_domain_gradients(model)
            opt.step()

        steps[mode] = step
    if rank == 0:
        print(f"  composition: timing {iters} iterations of {len(MODES)} modes, interleaved ...", flush=True)
    return time_iterations(steps, iters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=default_out())
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args(argv)
    from halo.testing import run_on_ranks

    with LoadWatch(own=4) as watch:
        times = run_on_ranks(_rank, 4, args.iters, timeout=900)[0]
    meta = run_meta("gloo", 4)
    rows = [{**meta, "mode": m, "step_s": f"{median(times[m]):.4f}",
             "ratio": f"{paired_ratio(times[m], times['none']):.2f}"} for m in MODES]
    print_table(rows, ["mode", "step_s", "ratio", "device"])
    append_csv(args.out / "composition.csv", rows)
    if watch.warning():
        print(watch.warning())
    return 0


if __name__ == "__main__":
    sys.exit(main())
