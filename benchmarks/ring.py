"""Attention over all tokens on shards: ``ring_sdpa`` ring vs gathered vs local SDPA on the same shard, CPU gloo.

Forward + backward of ``o = f(q, k, v); o.backward(g)`` with ``(1, heads, N_r, d)`` shards of ``N`` global tokens
(float32), each implementation in a process of its own (so that its peak memory is its own):

=========  ==============================================================================================
impl       what
=========  ==============================================================================================
ring       ``ring_sdpa(..., variant="ring")``: K/V blocks around the ring, online softmax, exact
gathered   ``ring_sdpa(..., variant="gathered")``: all-gather of K/V, SDPA, reduce-scatter of dK/dV, exact
flex       ``halo.nn.domain_flex_attention`` (no score_mod): K and V gathered, this rank's rows of the dense
           scores (flex_attention's eager semantics), exact; on 1 rank: the same code unsharded
local      ``F.scaled_dot_product_attention`` on the shard alone: wrong (attends within the shard), the
           floor of the compute on one rank's queries without any message
full       (1 rank) SDPA on all ``N`` tokens: the unsharded layer
=========  ==============================================================================================

Columns: ``ms`` the median over iterations of the step (each iteration the max over ranks); ``sent MB`` what one
rank sends per step, forward + backward, from the algorithm (ring: ``P - 1`` K/V blocks forward, ``P - 1`` K/V +
dK/dV blocks and one dK/dV block backward; gathered: its padded K/V block to each peer and each peer's padded dK/dV
rows, as gloo's ring all-gather / reduce-scatter move them, ``(P - 1)`` blocks each); ``peak MB`` the rank's
resident high-water mark during the steps above what it held before them.

    python benchmarks/ring.py [--sizes 1024,4096,8192] [--worlds 2,3] [--heads 4] [--dim 32] [--iters 5]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from halo.testing import run_on_ranks

__all__ = ["main"]


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


def _sent(impl: str, sizes: list[int], rank: int, row: int) -> int:
    p = len(sizes)
    if p == 1 or impl in ("local", "full"):  # (flex: the gathered variant's bytes, K and V in two gathers)
        return 0
    if impl == "ring":
        fwd = sum(sizes[(rank - s) % p] for s in range(p - 1)) * row
        bwd = sum(sizes[(rank - s) % p] for s in range(p - 1)) * 2 * row + sizes[(rank + 1) % p] * row
        return fwd + bwd
    return 2 * (p - 1) * max(sizes) * row  # all-gather out, reduce-scatter back (ring algorithms)


def _bench(rank: int, world: int, impl: str, n: int, heads: int, dim: int, iters: int) -> dict:
    import halo
    from halo.nn.flex import domain_flex_attention
    from halo.nn.ring import ring_sdpa
    from halo.plan.partition import split_sizes
    from halo.plan.plans import Site

    torch.set_num_threads(1)
    manager = halo.initialize_domain_parallel(world, world)
    sizes = split_sizes(n, world)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, heads, sizes[rank], dim, generator=gen).requires_grad_(True) for _ in range(3))
    g = torch.randn(1, heads, sizes[rank], dim, generator=gen)
    sites = (Site(), Site(), Site())

    def step() -> None:
        if impl in ("local", "full"):
            o = F.scaled_dot_product_attention(q, k, v)
        elif impl == "flex":
            o = domain_flex_attention(q, k, v, group=manager.domain_group)
        else:
            o = ring_sdpa(q, k, v, group=manager.domain_group, variant=impl, sites=sites)
        o.backward(g)

    base = _rss_kb()
    step()  # warm-up: the agreements, buffers
    times = []
    for _ in range(iters):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - t0])
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    row = heads * 2 * dim * q.element_size()  # one token's K and V
    return {"ms": 1e3 * statistics.median(times), "peak_mb": peak / 1024,
            "sent_mb": _sent(impl, sizes, rank, row) / 2**20}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,4096,8192")
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--csv", default=str(Path(__file__).resolve().parent / "out" / "ring.csv"))
    args = p.parse_args(argv)
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")
    print(f"# {platform.node()} {platform.machine()}, torch {torch.__version__}, {when}; heads {args.heads}, "
          f"d {args.dim}, fp32, 1 thread per rank, median of {args.iters}, load {os.getloadavg()[0]:.1f}")
    print(f"{'N':>6}{'ranks':>6}{'impl':>10}{'ms':>10}{'sent MB/rank':>14}{'peak MB/rank':>14}")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        runs = [(1, "full"), (1, "flex")] + [(w, impl) for w in (int(s) for s in args.worlds.split(","))
                                             for impl in ("ring", "gathered", "flex", "local")]
        for world, impl in runs:
            res = run_on_ranks(_bench, world, impl, n, args.heads, args.dim, args.iters, timeout=900)
            ms = max(r["ms"] for r in res)
            sent = max(r["sent_mb"] for r in res)
            peak = max(r["peak_mb"] for r in res)
            print(f"{n:>6}{world:>6}{impl:>10}{ms:>10.1f}{sent:>14.2f}{peak:>14.1f}")
            rows.append({"date": when, "device": "cpu", "backend": "gloo", "torch": torch.__version__, "n": n,
                         "world": world, "impl": impl, "heads": args.heads, "dim": args.dim, "ms": f"{ms:.2f}",
                         "sent_mb": f"{sent:.3f}", "peak_mb": f"{peak:.1f}"})
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
