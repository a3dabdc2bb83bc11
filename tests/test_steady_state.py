"""A steady training step asks nothing of the host but the math's messages (invariant 7), and stays exact.

The model has every layer kind whose plan depends on every rank's extents (3x3 convs, circular in longitude,
GroupNorm, a stride-2 conv, a transposed conv, max pooling, bilinear upsampling); one step is forward,
``domain_mean`` loss, backward, ``sync_domain_gradients`` and an SGD step. Steps 3 and 4 are counted with
:class:`halo.testing.HostWorkCounter` on 2 and 3 gloo ranks (float64, uneven shards): no read of a tensor's value
into Python, no tensor built from Python data, no agreement (a declared grid; or a learned one, whose steady calls
agree only every 8th: tests/test_sync_free.py), and the same collectives in both steps. The agreements of the
first step and the safety of what is learned (a global extent that changes while some ranks' local shapes do
not; a rank whose shapes change) are tested against the unsharded model too.
"""

import pytest
import torch
import torch.nn.functional as F
from _helpers import SteadyNet, steady_reference
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 45, 16, 3


def _local(full, world, rank):
    offs = split_offsets(full.shape[-2], world)
    return full.narrow(-2, offs[rank], offs[rank + 1] - offs[rank])


def _steady(rank, world, grid):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet().double(), manager, boundary=None, grid=grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = _local(full, world, rank).clone()
    counts, outputs = [], []
    for _ in range(5):
        with HostWorkCounter(keep_stacks=True) as counter:
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = domain_mean((out - x) ** 2)
            loss.backward()
            sync_domain_gradients(model, manager)
            opt.step()
        counts.append((counter.summary(), dict(counter.where)))
        outputs.append(out.detach())
    return counts, outputs


def _reference(steps=5):
    return steady_reference(torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
                            steps)


@pytest.mark.parametrize("world, grid", [(2, None), (3, None), (3, (H, W))])
def test_steady_step_makes_no_host_work(world, grid):
    results = run_on_ranks(_steady, world, grid, timeout=240)
    ref = _reference()
    for rank, (counts, outputs) in enumerate(results):
        for step, out in enumerate(outputs):  # exact against the unsharded model, every step
            want = _local(ref[step], world, rank)
            assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), (rank, step, (out - want).abs().max())
        first, _ = counts[0]
        assert first.get("agreement", 0) > 1, first  # the first step learns (one agreement per layer call)
        steady = [c for c, _ in counts[3:5]]
        assert steady[0] == steady[1], (rank, steady)
        summary, where = counts[3]
        assert summary.get("read", 0) == 0, (rank, where.get("read"))
        assert summary.get("from_data", 0) == 0, (rank, where.get("from_data"))
        assert summary.get("agreement", 0) == 0, (rank, summary, where.get("agreement"))  # (steady: none agrees)
        assert summary.get("c10d.all_gather", 0) == 0, (rank, summary)
        assert summary.get("c10d.all_gather_object", 0) == 0, summary
        # The math's messages: at most 6 exchanges forward and 6 backward (one that needs no rows of another rank,
        # here the 2x2 pooling when shards split at even rows, posts nothing), GroupNorm's all-reduce forward and
        # backward, the loss's forward and backward, one gradient bucket.
        assert 6 <= summary.get("c10d.batch_isend_irecv", 0) <= 12, (rank, summary)
        assert summary.get("c10d.all_reduce", 0) == 5, (rank, summary)


def _changing(rank, world, heights, entry):
    """Train-time resolutions that change between steps: exact every time, on every rank."""
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.shard import gather, shard

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, stride=2, padding=1))
    ref = nn.Sequential(*[nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, stride=2, padding=1)])
    ref.load_state_dict(conv.state_dict())
    model = convert_to_domain_parallel(conv, manager)
    out = []
    for h in heights:
        full = torch.randn(1, 2, h, 8, generator=torch.Generator().manual_seed(h))
        x = shard(full) if entry == "shard" else _local(full, world, rank)
        y = gather(model(x))  # the converted model, then a gather of its output
        z = gather(halo.halo_exchange(x, 1))  # a raw exchange of the shard, then a gather
        padded = F.pad(full, (0, 0, 1, 1))
        out.append(((y - ref(full)).abs().max().item() < 1e-6,  # float32 convs of other shapes: rounding only
                    torch.equal(z, torch.cat([padded[..., o:o + n + 2, :] for o, n in _spans(h, world)], dim=-2))))
    return out


def _spans(h, world):
    offs = split_offsets(h, world)
    return [(offs[r], offs[r + 1] - offs[r]) for r in range(world)]


@pytest.mark.parametrize("entry", ["shard", "local"])
def test_global_extent_changes_while_some_local_shapes_do_not(entry):
    """45 rows over 2 ranks are 23 + 22, 44 are 22 + 22: rank 1's shard keeps its shape. Every call learns
    the new extents on every rank (the model's entry agreement, or shard's epoch), steps back and forth."""
    results = run_on_ranks(_changing, 2, [45, 44, 45, 44, 46, 45], entry, timeout=120)
    for rank, res in enumerate(results):
        assert all(a and b for a, b in res), (rank, res)


def _grid_mismatch(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)), manager, grid=(45, 8))
    halo.set_timeout(3)
    x = torch.randn(1, 2, 23 if rank == 0 else 22, 8)
    model(x)  # fine
    try:
        model(torch.randn(1, 2, 22, 8))  # rank 0 should hold 23 rows of the declared 45
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def test_declared_grid_checks_every_rank_locally():
    """A declared grid is a promise: the rank that breaks it raises at once, naming the grid; its peers, which
    need no agreement, find no partner for their messages and raise within the timeout."""
    results = run_on_ranks(_grid_mismatch, 2, timeout=60)
    kind, message = results[0]
    assert kind == "ValueError" and "grid=(45, 8)" in message and "expects 23 rows" in message, results[0]
    assert results[1][0] == "HaloCommError" and "global rank 0" in results[1][1], results[1]


def _shape_change_one_rank(rank, world):
    """A converted model called with a shape that changed on one rank only: the entry agreement sees it, so
    every rank agrees anew and the layer's own check raises the same clear error everywhere."""
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.set_timeout(5)
    manager = halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)), manager)
    gen = torch.Generator().manual_seed(rank)  # each rank its own rows (the same values on every rank: a whole field)
    model(torch.randn(1, 2, 5, 8, generator=gen))
    try:
        model(torch.randn(1, 2, 5, 9 if rank == 1 else 8, generator=gen))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def test_shape_change_on_one_rank_is_one_error_everywhere():
    results = run_on_ranks(_shape_change_one_rank, 2, timeout=60)
    assert results[0] == results[1], results
    assert results[0][0] == "ValueError" and "disagree on the shape" in results[0][1], results


def test_counter_sees_what_it_counts():
    from halo.testing import HostWorkCounter

    with HostWorkCounter() as c:
        t = torch.tensor([1.0, 2.0])
        t.sum().item()
        bool(t[0] > 0)
    assert c.summary() == {"from_data": 1, "read": 2}

