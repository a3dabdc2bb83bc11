"""The fixed cost per step against NCAR CREDIT's domain parallelism, from a tiny field to 0.25 degree (issue 33 3).

The same 4-conv model (3x3 convs, GELU between) on 2 ranks, forward + backward of a sum loss, timed interleaved in
one run (each iteration's time is the max over ranks; the table gives medians and paired ratios):

==========  ======================================================================================================
impl        one step
==========  ======================================================================================================
plain       the unconverted convs on the local shard, zero padding: the floor (no exchange at all)
credit      ``credit.domain_parallel.convert_to_domain_parallel(model, manager)`` (miles-credit, its own manager):
            pad by halo exchange (``torch.cat`` of the received rows), conv with no H padding
halo        ``halo.nn.convert_to_domain_parallel(model, manager)``, as users get it by default
halo-grid   the same with a declared ``grid=`` (no entry agreement)
==========  ======================================================================================================

``halo/credit`` and ``halo/plain`` are medians over iterations of the paired ratio (both timed in the same
iteration). On a CPU the fields use few channels (``--channels``), so that a 1-thread rank's step stays under a
second at 721 x 1440; the fixed per-step cost is what the small sizes show. Needs miles-credit (the zoo's
packages: ``pip install --no-deps -r tests/zoo-requirements.txt``); run from the repository.

    python benchmarks/vs_credit.py [--quick] [--channels 8] [--reps 7] [--sizes 32x128,91x180]
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((32, 128), (91, 180), (181, 360), (361, 720), (721, 1440))  # tiny ... 0.25 degree
IMPLS = ("plain", "credit", "halo", "halo-grid", "halo-pad", "halo-patch")


def model(c: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Conv2d(c, c, 3, padding=1)] + ([nn.GELU()] if i < 3 else [])
    return nn.Sequential(*layers)


def _overlap(net: nn.Module, on: bool) -> nn.Module:
    """``net`` with every halo conv's path forced: compute-then-patch (``on``) or pad-then-conv."""
    for m in net.modules():
        if hasattr(m, "overlap"):
            m.overlap = on
    return net


def _step(net: nn.Module, x: torch.Tensor) -> None:
    for p in net.parameters():
        p.grad = None
    net(x).sum().backward()


def sweep_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    import _thirdparty  # the torchvision stand-in credit's imports need beside a CPU torch

    _thirdparty.load()
    import credit.domain_parallel as cdp
    import torch.distributed as dist

    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.plan.partition import split_sizes
    from halo.tools.bench import median, paired_ratio, run_meta, time_iterations

    manager = halo.initialize_domain_parallel(world, world)
    credit_manager = cdp.initialize_domain_parallel(world, world)
    meta = run_meta("gloo", world)
    rows = []
    for h, w in cfg["sizes"]:
        c = cfg["channels"]
        net = model(c)
        nets = {"plain": net,
                "credit": cdp.convert_to_domain_parallel(copy.deepcopy(net), credit_manager),
                "halo": convert_to_domain_parallel(copy.deepcopy(net), manager),
                "halo-grid": convert_to_domain_parallel(copy.deepcopy(net), manager, grid=(h, w)),
                "halo-pad": _overlap(convert_to_domain_parallel(copy.deepcopy(net), manager), False),
                "halo-patch": _overlap(convert_to_domain_parallel(copy.deepcopy(net), manager), True)}
        x = torch.randn(1, c, split_sizes(h, world)[rank], w, generator=torch.Generator().manual_seed(rank))
        ref = nets["halo"](x)
        if not torch.allclose(nets["credit"](x), ref, atol=1e-4):  # both exact for 3x3 "same" convs
            raise RuntimeError(f"vs_credit: CREDIT and halo disagree at {h}x{w}")
        fns = {name: functools.partial(_step, nets[name], x) for name in IMPLS}
        times = time_iterations(fns, cfg["reps"], dist.group.WORLD, warmup=2)
        for name in IMPLS:
            rows.append(dict(meta, grid=f"{h}x{w}", channels=c, impl=name, time_ms=f"{median(times[name]) * 1e3:.2f}",
                             halo_per_credit=f"{paired_ratio(times[name], times['credit']):.2f}",
                             per_plain=f"{paired_ratio(times[name], times['plain']):.2f}", reps=cfg["reps"]))
        if rank == 0:
            print(f"  vs_credit: {h}x{w} done", flush=True)
    return rows if rank == 0 else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the two smallest sizes, 3 iterations")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="", help="grids to run instead, e.g. 32x128,91x180")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    a = parser.parse_args(argv)
    from halo.testing import run_on_ranks
    from halo.tools.bench import append_csv, print_table, run_watched

    sizes = tuple(tuple(int(n) for n in g.split("x")) for g in a.sizes.split(",")) if a.sizes else None
    cfg = {"sizes": sizes or (SIZES[:2] if a.quick else SIZES), "channels": a.channels,
           "reps": 3 if a.quick and not sizes else a.reps}

    def run() -> int:
        rows = run_on_ranks(sweep_rank, a.nproc, cfg, timeout=1800)[0]
        print_table(rows, ["grid", "channels", "impl", "time_ms", "halo_per_credit", "per_plain"])
        append_csv(a.out / "vs_credit.csv", rows)
        return 0

    return run_watched(run, own=a.nproc)


if __name__ == "__main__":
    raise SystemExit(main())
