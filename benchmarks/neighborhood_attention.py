"""Neighbourhood attention (NATTEN semantics) and CrossFormer long-range attention: sharded over gloo ranks vs
unsharded, on the CPU.

For each layer, forward + backward of ``y = layer(x); y.backward(g)`` on a ``(1, H, W, C)`` field
(``DomainNeighborhoodAttention2D``, kernel 7, dilation 1 and 2) or ``(1, C, H, W)`` field
(``DomainCrossFormerAttention``, long distance, window 4):

==========  ===========================================================================================
column      what
==========  ===========================================================================================
ms          median over iterations of the step time (each iteration: the max over ranks, so a rank that
            waits for a peer counts)
peak MB     peak resident memory of a rank's process during the steps (warm-up included), above what it
            held just before them (``ru_maxrss`` minus the resident size then; Linux; the unsharded run is a
            process of its own)
sent MB     bytes a rank sends per step, forward + backward (halo rows for NATTEN: the key/value rows its
            neighbours need, and their gradients back; the regroup's rows there and back, and their
            gradients), from the plan
act MB      the rank's input activation
==========  ===========================================================================================

    python benchmarks/neighborhood_attention.py [--nproc 2] [--grid 96x192] [--channels 32] [--iters 5]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import resource
import statistics
import time

import torch
import torch.distributed as dist

from halo.testing import run_on_ranks

__all__ = ["main"]


def _credit_attention(dim: int, window: int) -> torch.nn.Module:
    """A CREDIT-structured long-distance Attention (the test suite's copy)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_longrange import Attention

    return Attention(dim, "long", window, dim_head=8)


def _layer(kind: str, channels: int, group):
    from halo.nn.longrange import DomainCrossFormerAttention
    from halo.nn.neighborhood import DomainNeighborhoodAttention2D

    torch.manual_seed(0)
    if kind.startswith("natten"):
        dilation = int(kind.split("-d")[1])
        return DomainNeighborhoodAttention2D(channels, 4, 7, dilation, rel_pos_bias=True, group=group)
    return DomainCrossFormerAttention(_credit_attention(channels, 4), group=group)


def _sent_bytes(kind: str, h: int, w: int, channels: int, world: int, rank: int, itemsize: int) -> int:
    """Bytes this rank sends per forward + backward, from the plans (pure arithmetic)."""
    from halo.dist.comm import CommGroup
    from halo.nn.longrange import long_range_plan
    from halo.nn.neighborhood import neighborhood_row_plan
    from halo.plan.partition import offsets, split_sizes

    sizes = split_sizes(h, world)
    if kind.startswith("natten"):
        dilation = int(kind.split("-d")[1])
        needs = neighborhood_row_plan(sizes, 7, dilation)
        offs = offsets(sizes)
        lo, hi = offs[rank], offs[rank + 1]
        rows = sum(max(0, min(hi, b) - max(lo, a)) for q, (a, b) in enumerate(needs) if q != rank)
        return 2 * rows * w * 2 * channels * itemsize  # keys and values there, their gradients back
    plan = long_range_plan(CommGroup(None, world, rank, tuple(range(world))), -2, sizes, 4)
    rows = sum(len(r) for q, r in plan.sends if q != rank)
    back = sum(len(r) for q, r in plan.recvs if q != rank)
    return 2 * (rows + back) * w * channels * itemsize  # forward regroup and its inverse; backward the same


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


def _bench(rank: int, world: int, kind: str, h: int, w: int, channels: int, iters: int) -> dict:
    import halo
    from halo.plan.partition import split_offsets

    manager = halo.initialize_domain_parallel(world, world)
    layer = _layer(kind, channels, manager.domain_group)
    offs = split_offsets(h, world)
    lo, hi = offs[rank], offs[rank + 1]
    gen = torch.Generator().manual_seed(1)
    shape = (1, h, w, channels) if kind.startswith("natten") else (1, channels, h, w)
    hdim = 1 if kind.startswith("natten") else 2
    full = torch.randn(shape, generator=gen)
    x = full.narrow(hdim, lo, hi - lo).contiguous().requires_grad_(True)
    g = torch.randn_like(x)
    base = _rss_kb()  # resident now; the high-water mark after the steps (warm-up included) minus this
    layer(x).backward(g)  # warm-up: plans, buffers
    times = []
    for _ in range(iters):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        layer(x).backward(g)
        t = torch.tensor([time.perf_counter() - t0])
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    sent = _sent_bytes(kind, h, w, channels, world, rank, x.element_size()) if world > 1 else 0
    return {"ms": 1e3 * statistics.median(times), "peak_mb": peak / 1024, "sent_mb": sent / 2**20,
            "act_mb": x.numel() * x.element_size() / 2**20}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--grid", default="96x192")
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    h, w = (int(v) for v in args.grid.split("x"))
    print(f"# {platform.node()} {platform.machine()}, torch {torch.__version__}, "
          f"{datetime.datetime.now().isoformat(timespec='minutes')}; grid {h}x{w}, C={args.channels}, fp32, "
          f"1 thread per rank, median of {args.iters}")
    print(f"{'layer':<16}{'ranks':>6}{'ms':>10}{'peak MB/rank':>14}{'sent MB/rank':>14}{'act MB/rank':>13}"
          f"{'sent/act':>10}")
    for kind in ("natten-d1", "natten-d2", "crossformer-long"):
        for world in (1, args.nproc):
            res = run_on_ranks(_bench, world, kind, h, w, args.channels, args.iters, timeout=900)
            ms = max(r["ms"] for r in res)
            peak = max(r["peak_mb"] for r in res)
            sent = max(r["sent_mb"] for r in res)
            act = max(r["act_mb"] for r in res)
            print(f"{kind:<16}{world:>6}{ms:>10.1f}{peak:>14.1f}{sent:>14.2f}{act:>13.2f}"
                  f"{(sent / act if act else 0):>10.2f}")


if __name__ == "__main__":
    main()
