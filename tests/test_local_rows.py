"""``halo.local_rows``: the part of a whole tensor (an absolute positional embedding of the global grid) that lines up
with a rank's shard, inside a converted model, against the unsharded model (float64, forward and backward, the
embedding's gradient summed over the domain group)."""

import os

import pytest
import torch
import torch.nn as nn

from halo.testing import run_on_ranks

TOL = 1e-12


class ViTish(nn.Module):
    """Patch embedding (a strided conv), an absolute positional embedding of the patch grid, a conv, a channels-last
    embedding: the shapes of a ViT / Swin stem on a weather grid."""

    def __init__(self, grid=(11, 9), c=6):
        super().__init__()
        self.embed = nn.Conv2d(3, c, 4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, c, *grid))
        self.pos_last = nn.Parameter(torch.randn(1, *grid, c))  # (1, H, W, C): added to a channels-last tensor
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, mesh=None):
        import halo

        x = self.embed(x)
        x = x + halo.local_rows(self.pos, x, mesh=mesh)
        y = x.permute(0, 2, 3, 1)
        if mesh is None:
            y = y + halo.local_rows(self.pos_last, y, dim=1, like_dim=1)
        else:
            y = y + halo.local_rows(self.pos_last, y, dim=(1, 2), like_dim=(1, 2), mesh=mesh)
        return self.conv(y.permute(0, 3, 1, 2))


def _ranks(rank, world, layout):
    os.environ["TRITON_INTERPRET"] = "0"
    import torch.distributed as dist

    import halo
    from halo.dist.comm import unsharded
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    torch.manual_seed(0)
    ref = ViTish().double()
    full = torch.randn(2, 3, 44, 36, dtype=torch.float64)
    xf = full.clone().requires_grad_(True)
    with unsharded():
        yr = ref(xf)
    g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (yr * g).sum().backward()
    model = ViTish().double()
    model.load_state_dict(ref.state_dict())
    if layout == "rows":
        manager = halo.initialize_domain_parallel(world, world)
        convert_to_domain_parallel(model, manager, custom_converters={ViTish: INSIDE})  # its own pos: local_rows
        x = halo.shard(full, granularity=4).requires_grad_(True)  # whole patches on every rank: 16, 16, 12 rows
        y = model(x)
        (y * halo.shard(g)).sum().backward()
        got, gx = halo.gather(y.detach()), halo.gather(x.grad)
        group = manager.domain_group
    else:
        mesh = halo.DomainMesh((2, 2))
        convert_to_domain_parallel(model, mesh=mesh, custom_converters={ViTish: INSIDE})
        x = halo.shard_2d(full, mesh=mesh).requires_grad_(True)  # 22 x 18: the patch conv exchanges what it needs
        y = model(x, mesh)
        (y * halo.shard_2d(g, mesh=mesh)).sum().backward()
        got, gx = halo.gather_2d(y.detach(), mesh=mesh), halo.gather_2d(x.grad, mesh=mesh)
        group = mesh.domain_group
    errs = [float((got - yr.detach()).abs().max()), float((gx - xf.grad).abs().max())]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        gp = p.grad.clone()
        dist.all_reduce(gp, group=group)
        errs.append(float((gp - q.grad).abs().max()))
    try:
        if layout == "rows":
            halo.local_rows(torch.zeros(1, 6, 10, 9), x, group=group)
        else:
            halo.local_rows(torch.zeros(1, 6, 10, 9), y, mesh=mesh)
        wrong = "no error"
    except ValueError as e:
        wrong = str(e)
    return max(errs), wrong


@pytest.mark.parametrize("layout, world", [("rows", 3), ("rows", 2), ("mesh", 4)])
def test_positional_embedding_on_shards(layout, world):
    results = run_on_ranks(_ranks, world, layout, timeout=180)
    for err, wrong in results:
        assert err <= TOL, err
        assert "must hold the whole global extent" in wrong, wrong
    assert len({w for _, w in results}) == 1
