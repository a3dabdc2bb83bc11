"""The one state object (issue 22 item 1): ``halo.context.reset()`` between steps of a converted model relearns
everything and computes the same numbers; ``halo.context.use()`` isolates a block; the planner's tables stay bounded.

Why these. A reset that left a table behind (epochs, records, a module's guarded epochs or recorded sites) would
let the next step reuse a plan learned under another agreement: silently wrong rows. So (a) runs a converted model
(every layer kind whose plan depends on every rank's extents, float64, uneven rows, 2 and 3 ranks) for a step,
resets, runs the same step again and checks both against the unsharded model, forward and backward, that the step
after the reset learned again (agreements), and that the step after that is back to the steady count. The first
call after the reset runs the guard again, from the guard the root's config hands the planner (code,
not state: a reset keeps it; were it lost, that call would raise).
"""

import types

import pytest
import torch
from _helpers import SteadyNet

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 45, 16, 3


def _local(full, world, rank):
    offs = split_offsets(full.shape[-2], world)
    return full.narrow(-2, offs[rank], offs[rank + 1] - offs[rank])


def _step(model, manager, x):
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = model(xi)
    domain_mean((out - x) ** 2, group=manager.domain_group).backward()
    sync_domain_gradients(model, manager)
    return out.detach(), xi.grad, [p.grad.clone() for p in model.parameters()]


def _whole(step, manager):
    """A step's output and input gradient gathered (outside the counted steps), its parameters' gradients."""
    from halo.shard import gather

    out, dx, grads = step
    group = manager.domain_group  # (a reset forgets the default manager too: name the group)
    return gather(out, group=group), gather(dx, group=group), grads


def _counted(model, manager, x):
    from halo.testing import HostWorkCounter

    with HostWorkCounter() as counter:
        step = _step(model, manager, x)
    summary = counter.summary()
    return step, (summary.get("agreement", 0), summary.get("c10d.all_gather", 0))


def _reset_between_steps(rank, world, grid):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet().double(), manager, boundary=None, grid=grid)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = _local(full, world, rank).clone()
    first = _step(model, manager, x)
    counts = [_counted(model, manager, x)[1] for _ in range(3)]  # steps 2-4
    before = halo.context.current().names()
    halo.context.reset()
    emptied = halo.context.current().names()
    second, relearn = _counted(model, manager, x)
    after = [_counted(model, manager, x) for _ in range(3)]
    steps = [_whole(s, manager) for s in (first, second, after[-1][0])]
    return steps, counts, relearn, [c for _, c in after], before, emptied


def _reference():
    torch.manual_seed(0)
    model = SteadyNet().double()
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = full.clone().requires_grad_(True)
    out = model(x)
    ((out - full) ** 2).mean().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world, grid", [(2, None), (3, (H, W))])
def test_reset_between_steps_relearns_and_computes_the_same(world, grid):
    ref_out, ref_dx, ref_grads = _reference()
    for rank, res in enumerate(run_on_ranks(_reset_between_steps, world, grid, timeout=240)):
        steps, counts, relearn, after, before, emptied = res
        assert "plans" in before and emptied == (), (rank, before, emptied)
        for out, dx, grads in steps:  # the first step, the one after the reset, the last one
            assert _close(out, ref_out), (rank, (out - ref_out).abs().max())
            assert _close(dx, ref_dx), (rank, (dx - ref_dx).abs().max())
            for g, want in zip(grads, ref_grads, strict=True):
                assert _close(g, want), (rank, (g - want).abs().max())
        (out1, dx1, grads1), (out2, dx2, grads2) = steps[:2]  # the same numbers after the reset as before it
        assert torch.equal(out1, out2) and torch.equal(dx1, dx2), rank
        assert all(torch.equal(a, b) for a, b in zip(grads1, grads2, strict=True)), rank
        steady = counts[-1]
        assert steady == (0, 0), (rank, counts)  # steady: no agreement (a learned grid agrees every 8th call)
        assert relearn[0] > steady[0], (rank, relearn, steady)  # the reset dropped the plans: learned again
        assert after == counts, (rank, after, counts)  # then the same counts as after the first step


def test_use_starts_empty_and_leaves_the_outer_context_untouched():
    import halo
    from halo import context
    from halo.guard import reroute
    from halo.plan import plans

    outer = context.current()
    plans.set_validation("always")
    try:
        outer_plans = plans.state()
        names = outer.names()
        with context.use() as inner:
            assert inner is context.current() and inner is not outer
            assert inner.names() == ()
            assert plans.state() is not outer_plans and plans.state().validation == "first"
            with halo.guard.trusted():
                assert reroute.state().trusted == 1
            plans.set_validation("always")
            assert "plans" in inner.names() and "reroute" in inner.names()
        assert context.current() is outer and plans.state() is outer_plans
        assert outer.names() == names and plans.state().validation == "always"
        given = context.HaloContext()
        with context.use(given):
            assert context.current() is given
        assert context.current() is outer
    finally:
        plans.set_validation("first")


def test_the_planner_tables_stay_bounded():
    """5000 distinct agreed keys (fields of 5000 shapes): the epoch cache stays at its cap, each key keeps its
    number after eviction (the same agreement, never another's), and another context numbers them apart."""
    from halo import context
    from halo.plan import plans

    group = types.SimpleNamespace(ranks=(0, 1))
    with context.use():
        plans.epoch_number.cache_clear()
        first = plans.field_epoch(group, 2, (1, 2, 3, 4))
        epochs = {plans.field_epoch(group, 2, (1, 2, 5 + i, 8)) for i in range(5000)}
        assert len(epochs) == 5000 and first not in epochs  # distinct agreements, distinct epochs
        info = plans.epoch_number.cache_info()
        assert info.currsize == plans.EPOCH_CACHE < 5000, info
        assert plans.field_epoch(group, 2, (1, 2, 3, 4)) == first  # evicted, numbered the same again
        for i in range(plans.MAX_RECORDS + 50):  # one-process calls of many shapes: their plans, recorded
            plans.resolve(torch.empty(1, 1, 1 + i % 97, 1 + i // 97), None, "t", _extents, replicated=True)
        assert len(plans.state().records) == plans.MAX_RECORDS
        for i in range(plans.MAX_TENSORS + 50):
            plans.device_tensor((i,), torch.int64, torch.device("cpu"))
        assert len(plans.state().tensors) == plans.MAX_TENSORS
        with context.use():
            assert plans.field_epoch(group, 2, (1, 2, 3, 4)) != first  # a fresh context's epochs are its own


def _extents(cg, extents):
    return extents
