"""``convert_to_domain_parallel(model, X)``: X a manager, a ``DomainMesh`` (one axis: latitude rows; two: latitude x
longitude) or a process group in the one position (issue 22 item 3), each equal to the unsharded model forward and
backward (float64, uneven rows and columns); ``mesh=`` keeps working; anything else raises the same TypeError on every
rank."""

import pytest
import torch
import torch.nn as nn

from halo.testing import run_on_ranks

H, W = 11, 9  # uneven over 2 and 3 ranks (6/5, 4/4/3) and over a (2, 2) mesh's columns (5/4)


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.ReLU(),
                         nn.Conv2d(3, 2, 3, padding=1, padding_mode="circular"))


def _target(kind, world):
    """The X of ``kind``, made on every rank (group creation is collective); no default manager is initialised,
    so the converter can only have used X."""
    import torch.distributed as dist

    import halo

    if kind == "manager":
        return halo.DomainParallelManager(world, world)
    if kind == "mesh1":
        return halo.DomainMesh((world,))
    if kind == "group":
        return dist.new_group(list(range(world)))
    if kind in ("mesh2", "mesh2-keyword"):
        return halo.DomainMesh((2, 2))
    raise ValueError(kind)


def _rank(rank, world, kind):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import local_share, sync_domain_gradients

    torch.manual_seed(0)
    ref = _net().double()
    model = _net().double()
    model.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 2, H, W, dtype=torch.float64, generator=gen)
    weight = torch.randn(2, 2, H, W, dtype=torch.float64, generator=gen)

    target = _target(kind, world)
    assert halo.get_domain_parallel_manager() is None
    if kind == "mesh2-keyword":
        convert_to_domain_parallel(model, mesh=target)
    else:
        convert_to_domain_parallel(model, target)
    two_d = kind.startswith("mesh2")
    group = target if kind == "group" else target.domain_group

    def split(t):
        return halo.shard_2d(t, mesh=target) if two_d else halo.shard(t, group=group)

    def whole(t):
        return halo.gather_2d(t, mesh=target) if two_d else halo.gather(t, group=group)

    xf = full.clone().requires_grad_(True)
    want = ref(xf)
    (want * weight).sum().backward()
    x = split(full).requires_grad_(True)
    y = model(x)
    local_share((y * split(weight)).sum()).backward()  # this rank's share of the global sum
    sync_domain_gradients(model, domain_group=group)  # each rank's parameter gradient is its rows' part: sum
    return {
        "converted": type(model[0]).__name__,
        "forward": float((whole(y.detach()) - want.detach()).abs().max()),
        "input grad": float((whole(x.grad) - xf.grad).abs().max()),
        "param grads": max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters(),
                                                                                strict=True)),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["manager", "mesh1", "group"])
def test_rows_target_in_the_second_position(kind, world):
    for out in run_on_ranks(_rank, world, kind, timeout=180):
        assert out["converted"] == "DomainConv2d", out
        for key in ("forward", "input grad", "param grads"):
            assert out[key] < 1e-12, (kind, world, out)


@pytest.mark.parametrize("kind", ["mesh2", "mesh2-keyword"])
def test_latitude_longitude_mesh_in_the_second_position(kind):
    """Before issue 22 a mesh in the manager's place failed with AttributeError 'shard_dim'."""
    for out in run_on_ranks(_rank, 4, kind, timeout=180):
        assert out["converted"] == "DomainConv2d", out
        for key in ("forward", "input grad", "param grads"):
            assert out[key] < 1e-12, (kind, out)


def _bad(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    out = []
    for bad in ("rows", 4, (2, 2), torch.zeros(1)):
        try:
            convert_to_domain_parallel(_net(), bad)
        except TypeError as e:
            out.append(str(e))
        else:
            out.append("no error")
    manager = halo.DomainParallelManager(world, world)
    try:
        convert_to_domain_parallel(_net(), manager, mesh=halo.DomainMesh((world,)))
    except ValueError as e:
        out.append(str(e))
    else:
        out.append("no error")
    try:
        convert_to_domain_parallel(_net())  # nothing given, nothing initialised
    except RuntimeError as e:
        out.append(str(e))
    else:
        out.append("no error")
    try:  # a mesh of three domain axes is a mesh, but no layer of halo's takes three
        convert_to_domain_parallel(_net(), halo.DomainMesh((world, 1, 1), shard_dims=(-3, -2, -1)))
    except ValueError as e:
        out.append(str(e))
    else:
        out.append("no error")
    return out


def test_a_bad_target_raises_the_same_error_on_every_rank():
    results = run_on_ranks(_bad, 2, timeout=120)
    assert results[0] == results[1], results
    type_errors, both, none, three = results[0][:4], results[0][4], results[0][5], results[0][6]
    for text, name in zip(type_errors, ("builtins.str", "builtins.int", "builtins.tuple", "torch.Tensor"),
                          strict=True):
        assert "DomainParallelManager, a halo.DomainMesh or a torch.distributed.ProcessGroup" in text, text
        assert f"got {name}" in text, text
    assert "not both" in both, both
    assert "needs a manager, a mesh or a group" in none, none
    assert "one domain axis (latitude) or two" in three and "got 3" in three, three
