"""Domain parallelism composed with data parallelism as users run it: FSDP2 on the dp mesh, and DDP.

dp 2 x domain 2 on 4 gloo ranks, float64, 21 rows (uneven shards) and 3 channels (parameters that FSDP2 shards
unevenly over the 2 dp ranks). Each replica gets its own sample; each rank's loss is its rows' share; after the
backward the dp average is FSDP's / DDP's own, and ``sync_domain_gradients(model, domain_group=...)`` (the
README's recipe) sums the local shards over the domain group. The full gradients equal the unsharded model's
gradient of the mean over the two samples. Summing over the domain group *and* averaging over dp again with
FSDP's DTensor gradients would mix different slices: it raises, saying what to pass.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 21, 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.norm = nn.GroupNorm(1, C)
        self.b = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return self.b(F.gelu(self.norm(self.a(x))))


def _samples():
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(2, 2, C, H, W, dtype=torch.float64, generator=g)
    ws = torch.randn(2, 2, C, H, W, dtype=torch.float64, generator=g)
    return xs, ws


def _run(rank, world, how):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.reduce import sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, 2)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Net().double(), manager)
    if how.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=manager.device_mesh["dp"])
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=manager.data_parallel_group)
    xs, ws = _samples()
    dp, r = manager.dp_rank, manager.domain_rank
    offs = split_offsets(H, 2)
    x = xs[dp][..., offs[r]:offs[r + 1], :]
    w = ws[dp][..., offs[r]:offs[r + 1], :]
    (wrapped(x) * w).sum().backward()
    try:
        if how == "fsdp-both":
            sync_domain_gradients(model, manager)
        else:
            sync_domain_gradients(model, domain_group=manager.domain_group)
    except ValueError as exc:
        return str(exc)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name.replace("module.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return grads


def _reference():
    torch.manual_seed(0)
    model = Net().double()
    xs, ws = _samples()
    loss = sum((model(xs[i]) * ws[i]).sum() for i in range(2)) / 2  # the dp mean of the replicas' losses
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["fsdp", "ddp"])
def test_domain_sum_with_data_parallel_wrappers_is_exact(how):
    results = run_on_ranks(_run, 4, how, timeout=180)
    want = _reference()
    for r in results:
        for name, g in want.items():
            assert torch.allclose(r[name], g, rtol=0, atol=1e-12), (how, name, (r[name] - g).abs().max())


def test_fsdp_gradients_averaged_twice_over_dp_raise():
    results = run_on_ranks(_run, 4, "fsdp-both", timeout=180)
    assert all(isinstance(r, str) and "pass domain_group=manager.domain_group alone" in r for r in results), results
