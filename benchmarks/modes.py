"""Step time of a converted model in the modes users train in, against the unsharded model in the same mode.

    python benchmarks/modes.py [--ranks 2] [--grid 181x64] [--steps 6]

The model is the modes matrix's (tests/test_modes.py: convs 3x3 / stride 2 / dilation 2 / transposed, pools,
upsampling, GroupNorm, BatchNorm, padding, pixel shuffle, a global pool). Each step is forward + backward; the
sharded time is the max over ranks of each step (ranks meet at a barrier first), the unsharded time is the same
model on the whole field on rank 0 (one thread, as each rank), in the same run, interleaved. Printed: medians (ms)
and sharded/unsharded (ideal 1/ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

MODES = ("fp32", "bf16 autocast", "channels_last", "checkpoint")


def _rank(rank: int, world: int, grid: tuple[int, int], steps: int) -> dict:
    import copy

    import torch.distributed as dist
    from test_modes import ModesNet
    from torch.utils.checkpoint import checkpoint

    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.plan.partition import split_offsets

    manager = halo.initialize_domain_parallel(world, world)
    h, w = grid
    offs = split_offsets(h, world)
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        fmt = torch.channels_last if mode == "channels_last" else torch.contiguous_format
        ref = ModesNet().to(memory_format=fmt)
        ref.drop.p = 0.0
        dom = convert_to_domain_parallel(copy.deepcopy(ref), manager)
        whole = torch.randn(2, 3, h, w).contiguous(memory_format=fmt)
        local = whole[..., offs[rank]:offs[rank + 1], :].clone()

        def step(model, inp, mode=mode):
            inp = inp.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16 autocast"):
                y = checkpoint(model, inp, use_reentrant=False) if mode == "checkpoint" else model(inp)
            y.float().square().sum().backward()

        times: dict[str, list[float]] = {"sharded": [], "unsharded": []}
        for _ in range(steps):
            dist.barrier()
            t = time.perf_counter()
            step(dom, local)
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times["sharded"].append(dt.item())
            dist.barrier()
            if rank == 0:
                t = time.perf_counter()
                step(ref, whole)
                times["unsharded"].append(time.perf_counter() - t)
        out[mode] = {k: statistics.median(v[1:]) for k, v in times.items() if v}
    return out


def main() -> None:
    from halo.testing import run_on_ranks
    from halo.tools.bench import LoadWatch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--grid", default="181x64")
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    grid = tuple(int(v) for v in a.grid.split("x"))
    print(f"modes: {grid[0]}x{grid[1]}, {a.ranks} gloo ranks, {a.steps} steps per mode (first dropped)", flush=True)
    with LoadWatch(own=a.ranks) as load:
        res = run_on_ranks(_rank, a.ranks, grid, a.steps, timeout=900)[0]
    print(f"{'mode':<16}{'sharded ms':>12}{'unsharded ms':>14}{'ratio':>8}")
    for mode, t in res.items():
        print(f"{mode:<16}{t['sharded'] * 1e3:>12.1f}{t['unsharded'] * 1e3:>14.1f}"
              f"{t['sharded'] / t['unsharded']:>8.2f}")
    print(load.warning() or f"load average peak {load.peak}: quiet enough")
    print(f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
