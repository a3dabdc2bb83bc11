"""DomainGroupNorm fwd+bwd time vs nn.GroupNorm on the local shape, on 1 and 2 gloo ranks (CPU).

    python benchmarks/groupnorm.py [--shape 1 32 181 360] [--groups 8] [--iters 10] [--before OLD_norm.py]

``--before``: also time the DomainGroupNorm of another copy of ``halo/nn/norm.py`` (e.g.
``git show HEAD:halo/nn/norm.py > /tmp/norm_before.py``). Prints the median over iterations of the slowest
rank's time, in ms.
"""

import argparse
import copy
import importlib.util
import statistics
import time

import torch
from torch import nn


def _load_before(path):
    spec = importlib.util.spec_from_file_location("halo.nn._norm_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.DomainGroupNorm


def _bench(rank, world, shape, groups, iters, before):
    import torch.distributed as dist

    import halo
    from halo.nn.norm import DomainGroupNorm
    from halo.tools.bench import gather_times

    torch.set_num_threads(1)
    man = halo.initialize_domain_parallel(world, world)
    gn = nn.GroupNorm(groups, shape[1])
    mods = {"nn.GroupNorm (local)": gn, "DomainGroupNorm": DomainGroupNorm(copy.deepcopy(gn), group=man.domain_group)}
    if before:
        mods["DomainGroupNorm (before)"] = _load_before(before)(copy.deepcopy(gn), group=man.domain_group)
    gen = torch.Generator().manual_seed(rank)
    x = (torch.randn(shape, generator=gen) + 250).requires_grad_(True)
    g = torch.randn(shape, generator=gen)
    times = {k: [] for k in mods}
    for i in range(iters + 1):
        for k, m in mods.items():
            if world > 1:
                dist.barrier()
            x.grad = None
            t0 = time.perf_counter()
            m(x).backward(g)
            if i:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(gather_times(v)) * 1e3 for k, v in times.items()}


def main():
    from halo.testing import run_on_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 32, 181, 360], help="per-rank (B, C, H, W)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--before", default=None)
    a = ap.parse_args()
    for world in a.worlds:
        res = run_on_ranks(_bench, world, tuple(a.shape), a.groups, a.iters, a.before, timeout=900)[0]
        print(f"P={world} per-rank {tuple(a.shape)} fp32, fwd+bwd ms (median, slowest rank):",
              {k: round(v, 1) for k, v in res.items()}, flush=True)


if __name__ == "__main__":
    main()
