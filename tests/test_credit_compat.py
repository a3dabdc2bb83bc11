"""``halo.compat.credit``: NCAR CREDIT's domain-parallel API and conventions, exact.

A trainer written the CREDIT way — manager singleton, ``convert_to_domain_parallel(model, manager,
custom_converters={Type: factory(module)})``, ``shard_batch``, a loss that is each rank's mean over its own rows,
``sync_domain_gradients(model, manager)`` *averaging* over the domain group, ``get_domain_manager`` through DDP —
gives the unsharded model's gradient of the global mean loss: on even shards as CREDIT writes it, on uneven ones
(which CREDIT refuses) with the loss times ``domain_loss_scale()``. dp 2 x domain 2 and domain 3, float64.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.testing import run_on_ranks

W, C = 8, 3


class PeriodicConv2d(nn.Module):
    """A CREDIT-style wrapper converted by a one-argument factory."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        return self.conv(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = PeriodicConv2d(C, C)
        self.norm = nn.GroupNorm(1, C)
        self.b = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return self.b(F.gelu(self.norm(self.a(x))))


def _batches(h, n):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(2, C, h, W, dtype=torch.float64, generator=g),
             "y": torch.randn(2, C, h, W, dtype=torch.float64, generator=g), "t": torch.tensor([3])}
            for _ in range(n)]


def _periodic(m):
    """A one-argument factory, as CREDIT's are; it keeps the wrapper (and so the state-dict keys)."""
    from halo.nn import DomainConv2d

    m.conv = DomainConv2d(m.conv)
    return m


def _trainer(rank, world, domain, h, scaled):
    from halo.compat import credit

    manager = credit.initialize_domain_parallel(world, domain)
    assert credit._MANAGER is manager and credit.get_domain_parallel_manager() is manager
    attrs = (manager._domain_group_idx, manager._domain_rank, manager._dp_rank)
    assert manager._domain_group is manager.domain_group and manager._dp_group is manager.data_parallel_group
    torch.manual_seed(0)
    model = credit.convert_to_domain_parallel(
        Net().double(), manager, custom_converters={PeriodicConv2d: _periodic})
    ddp = nn.parallel.DistributedDataParallel(model, process_group=manager.data_parallel_group)
    assert credit.get_domain_manager(ddp) is manager and credit.get_raw_model(ddp) is model
    batch = credit.shard_batch(_batches(h, world // domain)[manager.dp_rank], manager=manager)
    assert torch.equal(batch["t"], torch.tensor([3]))  # not spatial: unchanged
    loss = F.mse_loss(ddp(batch["x"]), batch["y"])  # CREDIT's loss: the mean over this rank's rows
    if scaled:
        loss = loss * credit.domain_loss_scale(manager)
    loss.backward()
    credit.sync_domain_gradients(ddp, manager)
    grads = {n.replace("module.", ""): p.grad.clone() for n, p in ddp.named_parameters()}
    lat = torch.linspace(0.1, 1.0, h, dtype=torch.float64).view(h, 1).expand(h, W)
    lw = credit.shard_lat_weights(lat, batch["x"].shape[-2])
    whole = credit.gather_spatial(batch["x"], manager)
    return attrs, grads, lw, whole


def _reference(h, n):
    torch.manual_seed(0)
    model = Net().double()
    loss = sum(F.mse_loss(model(b["x"]), b["y"]) for b in _batches(h, n)) / n
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("world, domain, h, scaled", [(4, 2, 20, False), (3, 3, 21, False), (3, 3, 22, True),
                                                      (4, 2, 21, True)])
def test_credit_trainer_is_exact(world, domain, h, scaled):
    results = run_on_ranks(_trainer, world, domain, h, scaled, timeout=180)
    want = _reference(h, world // domain)
    lat = torch.linspace(0.1, 1.0, h, dtype=torch.float64).view(h, 1).expand(h, W)
    rows = []
    for rank, (attrs, grads, lw, whole) in enumerate(results):
        assert attrs == (rank // domain, rank % domain, rank // domain)
        for name, g in want.items():
            assert torch.allclose(grads[name], g, rtol=0, atol=1e-12), (name, (grads[name] - g).abs().max())
        assert torch.equal(whole, _batches(h, world // domain)[rank // domain]["x"])
        if rank < domain:
            rows.append(lw)
    assert torch.equal(torch.cat(rows, dim=0), lat)  # every rank's latitude weights: its rows of the global ones


def test_credit_convention_without_the_scale_on_uneven_shards_is_not_exact():
    """What CREDIT would compute on uneven shards (it refuses them): the plain average is off; the test that the
    scale is what makes it exact, and not a tolerance."""
    results = run_on_ranks(_trainer, 3, 3, 22, False, timeout=180)
    want = _reference(22, 1)
    errs = [max((r[1][n] - g).abs().max().item() for n, g in want.items()) for r in results]
    assert min(errs) > 1e-6, errs
