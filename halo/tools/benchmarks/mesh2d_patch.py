"""One conv layer on a latitude x longitude block: compute-then-patch vs pad-then-conv vs latitude rows.

``halo bench --only mesh-patch [--mesh 2x2]``, or ``python benchmarks/mesh2d.py --patch [--mesh 2x2]
[--grid 361x720] [--channels 32] [--reps 12]``: one conv layer (3x3, fp32, ``y = conv(gelu(x));
y.backward(g)``, interleaved, max over ranks, medians), the "patch" column:

==============  =================================================================================================
impl            one call on ``P = ph * pw`` ranks
==============  =================================================================================================
plain rows      ``nn.Conv2d`` (zero padding) on a local tensor of a row slab's shape ``(1, C, H/P, W)``: the floor
plain block     the same on a local tensor of a block's shape ``(1, C, H/ph, W/pw)``
rows patch      ``DomainConv2d`` on latitude rows: the 1-D compute-then-patch (W padded locally)
blocks pad      ``exchange_2d`` (H, then W of the H-extended block: corners right) then the conv unpadded
blocks patch    ``halo.nn.patch2d.patch_conv_2d``: both exchanges behind the conv, strips added after
==============  =================================================================================================

``vs_plain``: paired ratio to the plain conv of the same local shape; ``vs_rows``: paired ratio to rows patch;
``cpu_*``: the same of the CPU time the ranks spend (``time.process_time``, max over ranks): on an oversubscribed
machine the wall time is mostly other processes' time slices, while the CPU time is the work (convs, copies,
packing) each form costs; ``sent_MB``: every point-to-point byte of one call, all ranks, forward and backward.
Both W boundaries (zeros, circular: latitude zeros, longitude periodic) in one launch.
"""

from __future__ import annotations

import torch

__all__ = ["main", "patch_rank", "run"]

IMPLS = ("plain rows", "plain block", "rows patch", "blocks pad", "blocks patch")


def _step(fn, x, g, params):
    x.grad = None
    for p in params:
        p.grad = None
    fn(torch.nn.functional.gelu(x)).backward(g)


def _impls(cfg, w_mode):
    """``{impl: (forward of an activation, input, upstream gradient, parameters)}`` on this rank."""
    from torch import nn

    from halo import initialize_domain_parallel
    from halo.dist.mesh import DomainMesh
    from halo.exchange import exchange_2d, plan_exchange_2d
    from halo.nn import DomainConv2d
    from halo.nn.patch2d import patch_conv_2d, plan_patch_2d
    from halo.plan.partition import offsets, split_sizes

    (h, w), (ph, pw), c = cfg["grid"], cfg["mesh"], cfg["channels"]
    world = ph * pw
    torch.manual_seed(0)
    conv = nn.Conv2d(c, c, 3, padding=1, padding_mode=w_mode)
    weight, bias = conv.weight, conv.bias
    manager = initialize_domain_parallel(world, world)
    rows_layer = DomainConv2d(conv, group=manager.domain_group, boundary="zeros")
    mesh = DomainMesh((ph, pw), periodic=(False, w_mode == "circular"))
    groups = (mesh.axis_group(0), mesh.axis_group(1))
    sizes = (split_sizes(h, ph), split_sizes(w, pw))
    bh, bw = "zeros", w_mode
    needs = tuple(tuple((o[r] - 1, o[r + 1] + 1) for r in range(len(s))) for s, o in
                  ((s, offsets(s)) for s in sizes))
    pad_plan = plan_exchange_2d(groups, sizes, needs, (bh, bw), (2, 3), "mesh2d pad")
    patch = plan_patch_2d(groups, sizes, (3, 3), (1, 1), (bh, bw), "mesh2d patch")
    hr = split_sizes(h, world)[manager.domain_rank]
    hb, wb = sizes[0][mesh.axis_rank(0)], sizes[1][mesh.axis_rank(1)]

    def tensors(rows, cols):
        return torch.randn(1, c, rows, cols, requires_grad=True), torch.randn(1, c, rows, cols)

    plain = nn.Conv2d(c, c, 3, padding=1)
    out = {"plain rows": (plain, *tensors(hr, w), list(plain.parameters())),
           "plain block": (plain, *tensors(hb, wb), list(plain.parameters())),
           "rows patch": (rows_layer, *tensors(hr, w), [weight, bias])}
    out["blocks pad"] = (lambda t: torch.nn.functional.conv2d(exchange_2d(t, pad_plan), weight, bias),
                         *tensors(hb, wb), [weight, bias])
    out["blocks patch"] = (lambda t: patch_conv_2d(t, weight, bias, patch.ex_h, patch.ex_w, patch.pad, (1, 1), 1,
                                                   ex_c=patch.ex_c), *tensors(hb, wb), [weight, bias])
    return out


def _timed(fns, reps, warmup=2):
    """Interleaved, the order rotating (as ``halo.tools.bench.time_iterations``): per impl, per iteration, the max
    over ranks of the wall time and of the CPU time of this process."""
    import time

    import torch.distributed as dist

    names, wall, cpu = list(fns), {k: [] for k in fns}, {k: [] for k in fns}
    for i in range(warmup + reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            both = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            if i >= warmup:
                wall[name].append(float(both[0]))
                cpu[name].append(float(both[1]))
    return wall, cpu


def patch_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    import torch.distributed as dist

    from halo.tools.bench import median, paired_ratio, run_meta
    from halo.tools.demo import Traffic

    rows = []
    for w_mode in ("zeros", "circular"):
        impls = _impls(cfg, w_mode)
        fns = {name: (lambda v=v: _step(v[0], v[1], v[2], v[3])) for name, v in impls.items()}
        times, cpu = _timed(fns, cfg["reps"])
        sent = {}
        for name, fn in fns.items():
            with Traffic() as traffic:
                fn()
            total = torch.tensor([float(traffic.bytes_sent)], dtype=torch.float64)
            dist.all_reduce(total)
            sent[name] = float(total)
        floor = {"rows patch": "plain rows", "blocks pad": "plain block", "blocks patch": "plain block"}
        meta = run_meta("gloo", world)
        for name in IMPLS:
            ts = times[name]
            rows.append(dict(meta, grid="x".join(map(str, cfg["grid"])), mesh="x".join(map(str, cfg["mesh"])),
                             channels=cfg["channels"], w_boundary=w_mode, impl=name, time_ms=f"{median(ts) * 1e3:.2f}",
                             vs_plain=f"{paired_ratio(ts, times[floor[name]]):.3f}" if name in floor else "",
                             vs_rows=f"{paired_ratio(ts, times['rows patch']):.3f}" if name in floor else "",
                             cpu_ms=f"{median(cpu[name]) * 1e3:.2f}",
                             cpu_vs_plain=f"{paired_ratio(cpu[name], cpu[floor[name]]):.3f}" if name in floor else "",
                             cpu_vs_rows=f"{paired_ratio(cpu[name], cpu['rows patch']):.3f}" if name in floor else "",
                             sent_MB=f"{sent[name] / 1e6:.3f}" if name in floor else ""))
    return rows


def main(argv: list[str]) -> int:
    import argparse
    from pathlib import Path

    from halo.launch import launch
    from halo.tools.bench import append_csv, default_out, print_table

    parser = argparse.ArgumentParser(description="one conv: rows vs blocks pad-then-conv vs blocks patch")
    parser.add_argument("--patch", action="store_true")
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--grid", default="361x720")
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=default_out())
    a = parser.parse_args(argv)
    cfg = {"mesh": tuple(int(v) for v in a.mesh.lower().split("x")),
           "grid": tuple(int(v) for v in a.grid.lower().split("x")), "channels": a.channels, "reps": a.reps}
    world = cfg["mesh"][0] * cfg["mesh"][1]
    result = launch(patch_rank, world, cfg, timeout=1800.0)
    rows = result[0] if result else []
    print_table(rows, ["grid", "mesh", "w_boundary", "impl", "time_ms", "vs_plain", "vs_rows", "cpu_ms", "cpu_vs_plain",
                       "cpu_vs_rows", "sent_MB", "load1"])
    append_csv(Path(a.out) / "mesh2d_patch.csv", rows)
    return 0


def run(opts: dict) -> int:
    """``halo bench --only mesh-patch``: the default mesh 2x2 (``--mesh``), fewer repetitions with ``--quick``."""
    argv = ["--mesh", opts.get("mesh") or "2x2", "--reps", "4" if opts.get("quick") else "12",
            "--out", str(opts["out"])]
    return main(argv)
