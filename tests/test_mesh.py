"""DomainParallelManager (CREDIT API) and DomainMesh: pure layouts, real groups on gloo, DDP over the dp axis."""

import numpy as np
import pytest
import torch

from halo.dist.mesh import mesh_layout
from halo.testing import RankError, run_on_ranks


@pytest.mark.parametrize("world", range(1, 17))
def test_manager_layout_every_size(world):
    for size in range(1, world + 1):
        if world % size:
            with pytest.raises(ValueError, match=rf"world_size \({world}\) must be divisible .* {size}"):
                mesh_layout(world, (size,))
            continue
        layout = mesh_layout(world, (size,))
        # CREDIT: domain groups are contiguous blocks, dp groups strided.
        assert [list(map(int, row)) for row in layout] == [list(range(i * size, (i + 1) * size))
                                                           for i in range(world // size)]
        assert [list(map(int, col)) for col in layout.T] == [list(range(j, world, size)) for j in range(size)]


def test_layout_bad_sizes():
    with pytest.raises(ValueError, match="must be positive, got 0"):
        mesh_layout(0, (1,))
    with pytest.raises(ValueError, match=r"domain sizes must be positive, got \(0,\)"):
        mesh_layout(4, (0,))
    with pytest.raises(ValueError, match=r"domain sizes must be positive, got \(-2,\)"):
        mesh_layout(4, (-2,))
    with pytest.raises(ValueError, match=r"divisible by the domain-parallel size 2 x 3 = 6"):
        mesh_layout(8, (2, 3))
    assert mesh_layout(12, (2, 3)).shape == (2, 2, 3)


def _manager_props(rank, world, domain):
    import torch.distributed as dist

    import halo

    m = halo.initialize_domain_parallel(world, domain)
    assert halo.get_domain_parallel_manager() is m
    out = {
        "attrs": (m.world_size, m.domain_parallel_size, m.data_parallel_size, m.shard_dim),
        "domain_rank": m.domain_rank, "domain_world_size": m.domain_world_size,
        "dp_rank": m.dp_rank, "dp_world_size": m.dp_world_size,
        "first": m.is_first_domain_rank, "last": m.is_last_domain_rank,
        "neighbors": m.neighbor_ranks(),
        "domain_ranks": dist.get_process_group_ranks(m.domain_group),
        "dp_ranks": dist.get_process_group_ranks(m.data_parallel_group),
        "mesh_names": m.device_mesh.mesh_dim_names,
    }
    # Every group communicates: the sum of global ranks over it.
    for name, group in (("domain_sum", m.domain_group), ("dp_sum", m.data_parallel_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out[name] = t.item()
    halo.destroy_domain_parallel()
    out["after_destroy"] = halo.get_domain_parallel_manager()
    return out


@pytest.mark.parametrize("world,domain", [(4, 2), (4, 4), (8, 2), (8, 4), (4, 1)])
def test_manager_on_ranks(world, domain):
    results = run_on_ranks(_manager_props, world, domain, timeout=120)
    for rank, r in enumerate(results):
        block, pos = divmod(rank, domain)
        domain_ranks = list(range(block * domain, (block + 1) * domain))
        dp_ranks = list(range(pos, world, domain))
        assert r["attrs"] == (world, domain, world // domain, -2)
        assert (r["domain_rank"], r["domain_world_size"]) == (pos, domain)
        assert (r["dp_rank"], r["dp_world_size"]) == (block, world // domain)
        assert r["first"] == (pos == 0) and r["last"] == (pos == domain - 1)
        assert r["neighbors"] == (rank - 1 if pos > 0 else None, rank + 1 if pos < domain - 1 else None)
        assert r["domain_ranks"] == domain_ranks and r["dp_ranks"] == dp_ranks
        assert r["domain_sum"] == sum(domain_ranks) and r["dp_sum"] == sum(dp_ranks)
        assert r["mesh_names"] == ("dp", "domain")
        assert r["after_destroy"] is None


def _wrong_world(rank, world):
    import halo

    halo.initialize_domain_parallel(world + 1, 1)


def test_world_size_mismatch_raises_on_every_rank():
    with pytest.raises(RankError, match=r"world_size=5 differs from the initialised process group's world size 4"):
        run_on_ranks(_wrong_world, 4, timeout=60)


def _mesh_2d(rank, world):
    import torch.distributed as dist

    from halo.dist.mesh import DomainMesh

    mesh = DomainMesh((2, 3), periodic=(False, True))
    out = {"coords": mesh.coords, "h": mesh.axis_ranks(0), "w": mesh.axis_ranks(1),
           "nh": mesh.neighbors(0), "nw": mesh.neighbors("domain_w"), "domain_rank": mesh.domain_rank}
    for axis in (0, 1):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.axis_group(axis))
        out[f"sum{axis}"] = t.item()
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=mesh.domain_group)
    out["domain_count"] = t.item()
    return out


def test_two_axis_mesh_with_periodic_longitude():
    results = run_on_ranks(_mesh_2d, 12, timeout=120)
    layout = np.arange(12).reshape(2, 2, 3)
    for rank, r in enumerate(results):
        d, i, j = (int(c) for c in np.argwhere(layout == rank)[0])
        assert r["coords"] == (d, i, j) and r["domain_rank"] == i * 3 + j
        assert r["h"] == [int(v) for v in layout[d, :, j]] and r["w"] == [int(v) for v in layout[d, i, :]]
        assert r["nh"] == (layout[d, i - 1, j] if i > 0 else None, layout[d, i + 1, j] if i < 1 else None)
        assert r["nw"] == (layout[d, i, (j - 1) % 3], layout[d, i, (j + 1) % 3])  # periodic: wraps
        assert r["sum0"] == layout[d, :, j].sum() and r["sum1"] == layout[d, i, :].sum()
        assert r["domain_count"] == 6


def _ddp_over_dp(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import halo

    m = halo.initialize_domain_parallel(world, 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False).double()
    ddp = DDP(model, process_group=m.data_parallel_group)
    x = torch.full((1, 3), float(rank + 1), dtype=torch.float64)
    ddp(x).sum().backward()
    return model.weight.grad.flatten().tolist(), dist.get_process_group_ranks(m.data_parallel_group)


def test_ddp_on_dp_group_averages_across_dp_only():
    results = run_on_ranks(_ddp_over_dp, 4, timeout=120)
    for rank, (grad, dp_ranks) in enumerate(results):
        # d/dw sum(w . x) = x, x = rank + 1; averaged over the dp group only (not the domain group).
        expected = sum(r + 1 for r in dp_ranks) / len(dp_ranks)
        assert grad == [expected] * 3, (rank, grad, expected)


def _mesh_3_axes(rank, world):
    import torch.distributed as dist

    from halo import context
    from halo.dist.mesh import DomainAxis, DomainMesh, DomainParallelManager, dp_coordinate, get_domain_parallel_manager

    mesh = DomainMesh((2, 1, 2), shard_dims=(-3, -2, -1), periodic=(False, False, True))
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=mesh.domain_group)
    out = {"axes": mesh.axes, "names": mesh.device_mesh.mesh_dim_names, "coords": mesh.coords,
           "n2": mesh.neighbors(2), "n0": mesh.neighbors(0), "count": t.item(), "dp": dp_coordinate(mesh.axis_group(2))}
    assert out["axes"][2] == DomainAxis("domain_2", 2, -1, True)
    # the manager is a facade over a one-axis mesh: every attribute answers from it
    manager = DomainParallelManager(world, 2)
    m = manager.mesh
    out["facade"] = ((manager.world_size, manager.domain_parallel_size, manager.data_parallel_size, manager.shard_dim,
                      manager.domain_rank, manager.dp_rank) == (m.world_size, m.domain_size, m.dp_size,
                                                                m.shard_dims[0], m.axis_rank(0), m.dp_rank))
    out["facade groups"] = manager.domain_group is m.domain_group and manager.data_parallel_group is m.dp_group
    # the default manager lives in the context: a fresh context has none, the old one is back afterwards
    import halo

    halo.initialize_domain_parallel(world, 2)
    default = get_domain_parallel_manager()
    with context.use():
        out["fresh"] = get_domain_parallel_manager()
    out["back"] = get_domain_parallel_manager() is default
    try:
        DomainMesh((2, 1, 2))
    except ValueError as e:
        out["no dims"] = str(e)
    return out


def test_a_mesh_with_three_axes_and_the_manager_facade():
    results = run_on_ranks(_mesh_3_axes, 4, timeout=120)
    layout = np.arange(4).reshape(1, 2, 1, 2)
    for rank, r in enumerate(results):
        _, i, _, j = (int(c) for c in np.argwhere(layout == rank)[0])
        assert r["names"] == ("dp", "domain_0", "domain_1", "domain_2") and r["coords"] == (0, i, 0, j)
        assert [a.dim for a in r["axes"]] == [-3, -2, -1] and [a.size for a in r["axes"]] == [2, 1, 2]
        assert r["n2"] == (layout[0, i, 0, 1 - j], layout[0, i, 0, 1 - j])  # periodic, two ranks
        assert r["n0"] == (None if i == 0 else layout[0, 0, 0, j], None if i == 1 else layout[0, 1, 0, j])
        assert r["count"] == 4 and r["dp"] == 0
        assert r["facade"] and r["facade groups"] and r["fresh"] is None and r["back"], r
        assert "shard_dims= names the dim of each beyond two" in r["no dims"], r
