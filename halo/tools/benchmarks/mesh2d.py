"""Latitude rows vs latitude x longitude blocks: the ``halo demo`` model's training step on the same ranks.

=================  ==============================================================================================
impl               one step (forward, latitude-weighted loss, backward, gradient sync), same field, same ranks
=================  ==============================================================================================
plain              the unsharded torch model on one rank (the demo's reference), timed on rank 0 alone first
rows P             the converted model on ``P = ph * pw`` ranks, each holding ``H/P`` latitude rows
blocks ph x pw     the converted model on the same ranks as a ``ph x pw`` mesh (``convert_to_domain_parallel(...,
                   mesh=DomainMesh((ph, pw)))``): ``H/ph`` rows by ``W/pw`` columns each
=================  ==============================================================================================

Both sharded steps run in the same launch, interleaved iteration by iteration (each iteration's time is the max
over ranks; medians reported), and one more step of each is counted: bytes the ranks send (all point-to-point
messages of the step, halo rows and pole rolls, forward and backward) against the bytes of the activations that
the exchanges read (the local inputs of the layers that exchange). A block shares a perimeter of about
``2 (H/ph + W/pw)`` per layer where a row slab shares ``2 W``: with ``W = 2 H`` the blocks send less once
``P >= 4``. On a 2-core CPU the step times of 4 ranks oversubscribe the cores (compare the two sharded forms with
each other, not with ``plain``).

    python benchmarks/mesh2d.py [--quick] [--mesh 2x2] [--grid 721x1440]
    halo bench --only mesh --mesh 2x2
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from halo.tools.bench import (
    append_csv,
    benchmark_parser,
    median,
    paired_ratio,
    print_table,
    rank_entry,
    run_meta,
    time_iterations,
)

__all__ = ["main", "run"]


def mesh_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    import torch.distributed as dist

    from halo import initialize_domain_parallel
    from halo.dist.mesh import DomainMesh
    from halo.launch import rank_device
    from halo.nn.convert import convert_to_domain_parallel
    from halo.parallel.reduce import latitude_weighted_mse, sync_domain_gradients
    from halo.shard import shard, shard_2d
    from halo.tools.demo import DemoNet, Traffic, latitudes, make_field, pole_boundary, reference_model, weighted_mse

    device, dtype = rank_device(cfg["backend"]), getattr(torch, cfg["dtype"])
    h, w = cfg["grid"]
    ph, pw = cfg["mesh"]
    field = make_field(h, w, cfg["channels"], 0).to(device, dtype)
    target = field.roll(max(1, w // 72), dims=-1)
    torch.manual_seed(0)
    net = DemoNet(cfg["channels"], cfg["hidden"], (h, w)).to(device, dtype)
    boundary = pole_boundary(h)
    meta = run_meta(cfg["backend"], world, device)

    plain_s = None
    if rank == 0:  # the unsharded step alone first (it would otherwise compete with the other ranks)
        ref, lat = reference_model(net, boundary), latitudes(h).to(device)
        ts = []
        for _ in range(cfg["reps"] + 1):
            ref.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            weighted_mse(ref(field), target, lat).backward()
            ts.append(time.perf_counter() - t0)
        plain_s = median(ts[1:])
    dist.barrier()

    manager = initialize_domain_parallel(world, world)
    rows_model = convert_to_domain_parallel(copy.deepcopy(net), manager, boundary=boundary)
    xr, yr = (shard(t, dim=-2, group=manager.domain_group) for t in (field, target))
    mesh = DomainMesh((ph, pw), periodic=(False, True))
    block_model = convert_to_domain_parallel(copy.deepcopy(net), boundary=boundary, mesh=mesh)
    xb, yb = (shard_2d(t, mesh=mesh) for t in (field, target))

    def rows_step() -> None:
        rows_model.zero_grad(set_to_none=True)
        latitude_weighted_mse(rows_model(xr), yr).backward()
        sync_domain_gradients(rows_model, manager)

    def block_step() -> None:
        block_model.zero_grad(set_to_none=True)
        latitude_weighted_mse(block_model(xb), yb, mesh=mesh).backward()
        sync_domain_gradients(block_model, domain_group=mesh.domain_group, dp_group=None)

    names = {f"rows {world}": rows_step, f"blocks {ph}x{pw}": block_step}
    times = time_iterations(names, cfg["reps"], dist.group.WORLD, device, warmup=1)
    sent = {}
    for name, step in names.items():
        with Traffic() as traffic:
            step()
        # on the default group's own device: NCCL reduces device tensors only (gloo's CPU tensor on a CPU run)
        total = torch.tensor([float(traffic.bytes_sent)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        sent[name] = float(total)
    field_bytes = field.numel() * field.element_size()
    rows = []
    if rank == 0:
        rows.append(dict(meta, grid=f"{h}x{w}", hidden=cfg["hidden"], impl="plain", time_s=f"{plain_s:.4f}",
                         vs_rows="", sent_MB="", sent_per_input=""))
        base = times[f"rows {world}"]
        for name, ts in times.items():
            rows.append(dict(meta, grid=f"{h}x{w}", hidden=cfg["hidden"], impl=name, time_s=f"{median(ts):.4f}",
                             vs_rows=f"{paired_ratio(ts, base):.3f}", sent_MB=f"{sent[name] / 1e6:.3f}",
                             sent_per_input=f"{sent[name] / field_bytes:.4f}"))
    return rows


def run(opts: dict, *, grid: tuple[int, int] | None = None, hidden: int = 8, channels: int = 4,
        reps: int | None = None) -> int:
    from halo.launch import is_printer, launch

    mesh = tuple(opts.get("mesh") or (2, 2))
    quick = opts["quick"]
    grid = grid or ((91, 180) if quick else (721, 1440))
    cfg = {"backend": opts["backend"], "grid": grid, "hidden": hidden, "channels": channels, "dtype": "float32",
           "reps": reps or (2 if quick else 5), "mesh": mesh}
    world = mesh[0] * mesh[1]
    print(f"mesh2d: {world} ranks as rows and as a {mesh[0]}x{mesh[1]} mesh, grid {grid[0]}x{grid[1]} ...", flush=True)
    rows = launch(rank_entry, world, "mesh2d", "mesh_rank", cfg, backend=opts["backend"], timeout=opts["timeout"])
    rows = rows[0] if rows else []
    if not is_printer():
        return 0
    print_table(rows, ["grid", "world", "impl", "time_s", "vs_rows", "sent_MB", "sent_per_input", "load1"])
    append_csv(Path(opts["out"]) / "mesh2d.csv", rows)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from halo.launch import default_backend

    parser = benchmark_parser(__doc__)
    parser.add_argument("--grid", default=None, help="HxW, default 721x1440 (--quick: 91x180)")
    parser.add_argument("--mesh", default="2x2", help="PHxPW (default 2x2)")
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900.0)
    a = parser.parse_args(argv)
    opts = {"quick": a.quick, "backend": a.backend or default_backend(), "out": a.out, "timeout": a.timeout,
            "mesh": tuple(int(v) for v in a.mesh.lower().split("x"))}
    grid = tuple(int(v) for v in a.grid.lower().split("x")) if a.grid else None
    return run(opts, grid=grid, hidden=a.hidden, reps=a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
