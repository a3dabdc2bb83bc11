"""The exchangers' buffer pools keep message strips, never activations (issue 33, item 4).

Each live exchanger keeps up to 4 buffers per (shape, dtype, format, stream). An extended shard (a pad-then-conv
input, saved by the conv for backward) pooled there would stay allocated after autograd frees it, for every shape of
every live exchanger: memory that never goes back to the caching allocator, on the one resource domain parallelism
exists to save. After a training step of :class:`SteadyNet` (every exchanging layer kind: 3x3 convs circular in W,
GroupNorm, a stride-2 conv, max pooling, bilinear upsampling, a transposed conv) on 2 gloo ranks (float64, 45 rows:
23 + 22), every pooled buffer must be a dim-major message strip with the rows of one of its exchanger's messages,
and all of them together a small fraction of one activation. The step is checked against the unsharded model too
(forward and the parameters' gradients, exact up to the domain sum's rounding).
"""

import torch
from _helpers import SteadyNet

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C, B = 45, 16, 3, 2


def _local(full, world, rank):
    offs = split_offsets(full.shape[-2], world)
    return full.narrow(-2, offs[rank], offs[rank + 1] - offs[rank])


def _step(rank, world):
    import halo
    from halo.exchange import _registry as exchange_registry
    from halo.exchange.exchanger import Exchanger
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet(C).double(), manager, boundary=None)
    full = torch.randn(B, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = _local(full, world, rank).clone()
    for _ in range(2):  # the second step reuses what the first pooled
        model.zero_grad(set_to_none=True)
        out = model(x)
        domain_mean((out - x) ** 2).backward()
        sync_domain_gradients(model, manager)
    out = out.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    del x
    pools = []
    for ex in exchange_registry._state().live.values():
        if isinstance(ex, Exchanger):
            rows = (ex.send_rows, ex.recv_rows)
            for key, bufs in ex.pool._pools.items():
                pools.append((key[0], rows, len(bufs), sum(b.untyped_storage().nbytes() for b in bufs)))
    return exchange_registry.pooled_bytes(), pools, out, grads


def _reference():
    torch.manual_seed(0)
    model = SteadyNet(C).double()
    full = torch.randn(B, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = model(full)
    ((out - full) ** 2).mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_pools_hold_halo_strips_only_after_a_step():
    world = 2
    results = run_on_ranks(_step, world, timeout=180)
    ref_out, ref_grads = _reference()
    activation = B * 6 * 23 * W * 8  # one hidden activation of rank 0 (6 channels, 23 rows, float64)
    for rank, (total, pools, out, grads) in enumerate(results):
        assert torch.allclose(out, _local(ref_out, world, rank), rtol=1e-12, atol=1e-12), rank
        for name, g in grads.items():  # the domain sum reorders the additions: rounding only
            assert torch.allclose(g, ref_grads[name], rtol=1e-10, atol=1e-12), (rank, name)
        assert pools, "no exchanger pooled anything: the test would see nothing"
        assert total == sum(nbytes for *_, nbytes in pools), (total, pools)
        for shape, rows, count, _ in pools:
            # dim-major messages: the rows outermost, as many as one of the exchanger's messages carries
            assert shape[0] in rows, (rank, shape, rows)
            assert 1 <= count <= 4, (rank, shape, count)
        # Before the fix the extended shards were pooled: at least one buffer of ~one activation per pad-then-conv
        # layer (here > 2 activations in all). Strips of 1-2 halo rows of <= 6 x 16 float64 values are far less.
        assert total < activation // 2, (rank, total, activation, pools)
