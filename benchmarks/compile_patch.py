"""``python benchmarks/compile_patch.py [--sizes 8x91x180,16x181x360] [--reps 10] [--nproc 2] [--mesh 2x2]
[--backend inductor]``: a compiled 4-conv model, fwd + bwd, compute-then-patch (``halo::exchange_halos``) against
pad-then-conv (``overlap=False``: ``halo::exchange``, a full extended copy of the shard each way), in the same run,
interleaved; the eager forms alongside. ``--mesh HxW``: a latitude x longitude mesh of ``H * W`` ranks (H and W
both sharded: the 2-d patch, three halo-rows exchanges a conv, against the H then W extended copies). Gloo ranks
on CPU, float32, one thread per rank; times are the max over ranks, medians.
``dynamic=False``: a second input shape under the default automatic dynamic shapes fails in halo's trace-time plan
(``assume_constant_result argument conversion failed``, on main too).
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch

IMPLS = ("eager-patch", "eager-pad", "compiled-patch", "compiled-pad")


def _net(c: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(4):
        layers += [torch.nn.Conv2d(c, c, 3, padding=1)] + ([torch.nn.GELU()] if i < 3 else [])
    return torch.nn.Sequential(*layers)


def _step(fn, x: torch.Tensor, g: torch.Tensor, params) -> None:
    x.grad = None
    for p in params:
        p.grad = None
    fn(x).backward(g)


def bench_rank(rank: int, world: int, sizes, reps: int, mesh_shape=None, backend: str = "inductor") -> list[dict]:
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.conv import DomainConv2d
    from halo.plan.partition import split_sizes
    from halo.tools.bench import median, paired_ratio, time_iterations

    if mesh_shape is None:
        manager = halo.initialize_domain_parallel(world, world)
        convert = functools.partial(convert_to_domain_parallel, manager=manager)
        at, grid = (rank, 0), (world, 1)
    else:
        mesh = halo.DomainMesh(mesh_shape, periodic=(False, True))
        convert = functools.partial(convert_to_domain_parallel, mesh=mesh)
        at, grid = (mesh.axis_rank(0), mesh.axis_rank(1)), mesh_shape
    rows = []
    for c, h, w in sizes:
        net = _net(c)
        patch = convert(copy.deepcopy(net))
        pad = convert(copy.deepcopy(net))
        for m in pad.modules():
            if isinstance(m, DomainConv2d):
                m.overlap = False
        models = {"eager-patch": patch, "eager-pad": pad,
                  "compiled-patch": torch.compile(patch, fullgraph=True, backend=backend, dynamic=False),
                  "compiled-pad": torch.compile(pad, fullgraph=True, backend=backend, dynamic=False)}
        n, m_w = split_sizes(h, grid[0])[at[0]], split_sizes(w, grid[1])[at[1]]
        torch.manual_seed(1 + rank)
        x = torch.randn(1, c, n, m_w, requires_grad=True)
        g = torch.randn(1, c, n, m_w)
        outs = {k: m(x).detach() for k, m in models.items()}  # (compiles)
        err = max(float((v - outs["eager-patch"]).abs().max()) for v in outs.values())
        fns = {k: functools.partial(_step, models[k], x, g, list(models[k].parameters())) for k in IMPLS}
        times = time_iterations(fns, reps, None, None, warmup=2)
        row = {"size": f"1x{c}x{h}x{w}", "max_abs_diff": f"{err:.1e}"}
        row.update({k: f"{median(times[k]) * 1e3:.1f}" for k in IMPLS})
        for mode in ("eager", "compiled"):  # median over iterations of patch / pad in the same iteration
            row[f"{mode} ratio"] = f"{paired_ratio(times[f'{mode}-patch'], times[f'{mode}-pad']):.3f}"
        rows.append(row)
    return rows if rank == 0 else []


def main() -> None:
    from halo.testing import run_on_ranks

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="8x91x180,16x181x360", help="CxHxW,...")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--mesh", default=None, help="HxW: a latitude x longitude mesh (its H * W ranks; not --nproc)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no C++ compile)")
    a = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    mesh = None if a.mesh is None else tuple(int(v) for v in a.mesh.split("x"))
    nproc = a.nproc if mesh is None else mesh[0] * mesh[1]
    rows = run_on_ranks(bench_rank, nproc, sizes, a.reps, mesh, a.backend, timeout=1800)[0]
    cols = [*IMPLS, "eager ratio", "compiled ratio", "max_abs_diff"]
    print("ms fwd+bwd; ratio: patch / pad, paired per iteration (median)")
    print(f"{'size':<16}" + "".join(f"{k:>16}" for k in cols))
    for r in rows:
        print(f"{r['size']:<16}" + "".join(f"{r[k]:>16}" for k in cols))


if __name__ == "__main__":
    main()
