"""``nn.LPPool2d`` on shards (``halo.nn.DomainLPPool2d``): converted by ``convert_to_domain_parallel`` and equal to
torch's layer on the whole field, forward and backward (input and the conv's parameter gradients), float64, on 2
and 3 ranks with uneven rows, for several norms (1.5, 2, 3, inf), kernels, strides and ceil_mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W = 23, 10

#: (norm_type, kernel_size, stride, ceil_mode)
CONFIGS = [(2, 3, 2, False), (3, 2, None, False), (1.5, (3, 2), (1, 2), True), (float("inf"), 2, 2, False),
           (2, (4, 3), (3, 1), True)]


def _model(cfg) -> nn.Module:
    p, k, s, ceil = cfg
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Softplus(), nn.LPPool2d(p, k, s, ceil_mode=ceil)).double()


def _field() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(2, 2, H, W, generator=gen, dtype=torch.float64), gen


def _on_rank(rank: int, world: int) -> list:
    import halo
    from halo.nn import DomainLPPool2d, convert_to_domain_parallel, revert_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    offs = split_offsets(H, world)
    out = []
    for cfg in CONFIGS:
        model = convert_to_domain_parallel(_model(cfg), manager)
        assert isinstance(model[2], DomainLPPool2d), type(model[2])
        assert list(model.state_dict()) == list(_model(cfg).state_dict())
        full, gen = _field()
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        y = model(x)
        yg = halo.gather(y.detach())
        wts = torch.randn(yg.shape, generator=gen, dtype=torch.float64)
        mo = split_offsets(yg.shape[-2], world)
        (y * wts[..., mo[rank]:mo[rank + 1], :]).sum().backward()
        grads = [halo.parallel.all_reduce(p.grad.clone()) for p in model.parameters()]
        out.append((yg, halo.gather(x.grad), grads, type(revert_domain_parallel(model)[2]).__name__))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_lppool2d_converted_equals_torch(world: int) -> None:
    results = run_on_ranks(_on_rank, world, timeout=240)
    for i, cfg in enumerate(CONFIGS):
        ref = _model(cfg)
        full, gen = _field()
        x = full.clone().requires_grad_(True)
        y = ref(x)
        wts = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        (y * wts).sum().backward()
        for rank, res in enumerate(results):
            yg, gx, grads, reverted = res[i]
            assert yg.shape == y.shape, (cfg, rank, yg.shape, y.shape)
            torch.testing.assert_close(yg, y.detach(), rtol=1e-12, atol=1e-12, msg=f"{cfg} rank {rank} output")
            torch.testing.assert_close(gx, x.grad, rtol=1e-10, atol=1e-12, msg=f"{cfg} rank {rank} input grad")
            for g, p in zip(grads, ref.parameters(), strict=True):
                torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12, msg=f"{cfg} rank {rank} param grad")
            assert reverted == "LPPool2d", reverted


def test_halo_lppool2d_refuses_another_layer() -> None:
    from halo.nn import DomainLPPool2d

    with pytest.raises(TypeError, match="DomainLPPool2d wraps an nn.LPPool2d, got AvgPool2d"):
        DomainLPPool2d(nn.AvgPool2d(2))


def _on_mesh(rank: int, world: int) -> list:
    import halo
    from halo.dist.mesh import DomainMesh
    from halo.nn import convert_to_domain_parallel
    from halo.plan.partition import local_range

    mesh = DomainMesh((2, 2))
    out = []
    for cfg in CONFIGS:
        model = convert_to_domain_parallel(_model(cfg), mesh=mesh)
        full, gen = _field()
        (h0, h1), (w0, w1) = (local_range(full.shape[d], mesh.axis_size(a), mesh.axis_rank(a)) for a, d in ((0, -2),
                                                                                                            (1, -1)))
        x = full[..., h0:h1, w0:w1].clone().requires_grad_(True)
        y = model(x)
        yg = halo.gather_2d(y.detach(), mesh=mesh)
        wts = torch.randn(yg.shape, generator=gen, dtype=torch.float64)
        (g0, g1), (c0, c1) = (local_range(yg.shape[d], mesh.axis_size(a), mesh.axis_rank(a)) for a, d in ((0, -2),
                                                                                                          (1, -1)))
        (y * wts[..., g0:g1, c0:c1]).sum().backward()
        grads = [halo.parallel.all_reduce(p.grad.clone(), group=mesh.domain_group) for p in model.parameters()]
        out.append((yg, halo.gather_2d(x.grad, mesh=mesh), grads))
    return out


def test_lppool2d_on_a_latitude_longitude_mesh_equals_torch() -> None:
    results = run_on_ranks(_on_mesh, 4, timeout=240)
    for i, cfg in enumerate(CONFIGS):
        ref = _model(cfg)
        full, gen = _field()
        x = full.clone().requires_grad_(True)
        y = ref(x)
        wts = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        (y * wts).sum().backward()
        for rank, res in enumerate(results):
            yg, gx, grads = res[i]
            assert yg.shape == y.shape, (cfg, rank, yg.shape, y.shape)
            torch.testing.assert_close(yg, y.detach(), rtol=1e-12, atol=1e-12, msg=f"{cfg} rank {rank} output")
            torch.testing.assert_close(gx, x.grad, rtol=1e-10, atol=1e-12, msg=f"{cfg} rank {rank} input grad")
            for g, p in zip(grads, ref.parameters(), strict=True):
                torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12, msg=f"{cfg} rank {rank} param grad")
