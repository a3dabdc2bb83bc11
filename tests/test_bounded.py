"""The planner's, the guard's and the reroute's tables stay bounded, and what they drop is learned again on every
rank alike, never silently not done (issue 22 item 1).

Why these. Every table that grows with the shapes seen (a sweep of resolutions, a variable batch, an evaluation at
another size) must be bounded, and eviction is only safe where it is *the same on every rank that must agree*:

* The planner's records (``halo.plan.plans``): a record a rank dropped makes that rank agree again while its peers,
  which kept theirs, go straight to their messages (a hang, or a collective paired with the wrong one). Records
  are therefore dropped per group (the group's own calls, which every member makes, oldest first), never because
  of another group's churn. The test churns a second model on a one-rank group of rank 0 only, past the cap, then
  runs the shared model again: it must compute what the unsharded model does (float64), without a timeout.
* A converted model's guarded epochs and the sites its modules compute exactly (``halo.guard.reroute``): a call at an
  epoch whose sites were dropped must not run unrouted (``F.group_norm`` of a shard: silently wrong). The two are
  one table: when an epoch is dropped, its sites go with it, and its next call is guarded again and learns them
  again. The test sweeps shapes past a cap of 2 and back, on 2 and 3 ranks at uneven rows, and checks every call
  against the unsharded model, forward and backward, and that the tables stay at their caps.
* ``revert_domain_parallel`` drops the sites, so it drops the guarded epochs too: a model converted again is
  guarded again at its first call (before, that call ran unguarded and unrouted: silently different).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

C, W = 3, 8
CAP = 6  # the records kept per group in the churn test (each call of Net records 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.b = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Normed(nn.Module):
    """A functional group norm over H in its forward: computed exactly at its site (``halo.guard.reroute``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, 4, 3, padding=1)
        self.b = nn.Conv2d(4, C, 3, padding=1)

    def forward(self, x):
        return self.b(F.group_norm(self.a(x), 2, eps=1e-4))


def _full(h, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, C, h, W, dtype=torch.float64, generator=g), torch.randn(2, C, h, W, dtype=torch.float64,
                                                                                  generator=g)


def _local(t, world, rank):
    offs = split_offsets(t.shape[-2], world)
    return t[..., offs[rank]:offs[rank + 1], :]


def _step(model, world, rank, h, seed):
    """One forward and backward at ``h`` rows: the output and input gradient gathered, the parameters' gradients
    summed over the domain."""
    import halo

    full, wts = _full(h, seed)
    x = _local(full, world, rank).clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y * _local(wts, world, rank)).sum().backward()
    grads = [halo.parallel.all_reduce(p.grad.clone()) for p in model.parameters()]
    return halo.gather(y.detach()), halo.gather(x.grad), grads


def _reference(cls, calls):
    torch.manual_seed(0)
    model = cls().double()
    out = []
    for h, seed in calls:
        full, wts = _full(h, seed)
        x = full.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        y = model(x)
        (y * wts).sum().backward()
        out.append((y.detach(), x.grad, [p.grad for p in model.parameters()]))
    return out


def _check(got, want, what):
    for i, (a, b) in enumerate(zip(got[:2], want[:2], strict=True)):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12), (what, i, (a - b).abs().max())
    for i, (a, b) in enumerate(zip(got[2], want[2], strict=True)):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-11), (what, "param grad", i, (a - b).abs().max())


# -- (b) records: one group's churn never evicts another group's records ------------------------------------------

H = 13
CHURN = tuple(range(5, 5 + 2 * CAP))  # rows of the side model's inputs: each a new epoch, 2 records each


def _churn_one_rank(rank, world):
    import torch.distributed as dist

    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.plan import plans

    halo.set_timeout(60)  # a rank agreeing alone would wait for peers that never join: bounded
    plans.set_limits(records=CAP)
    manager = halo.initialize_domain_parallel(world, world)
    solo = [dist.new_group([r]) for r in range(world)]  # (every rank makes every group, in the same order)
    torch.manual_seed(0)
    net = convert_to_domain_parallel(Net().double(), manager)
    steps = [_step(net, world, rank, H, 1), _step(net, world, rank, H, 2)]  # learned, then recalled
    if rank == 0:  # another model, on rank 0's own one-rank group: churns its records past the cap, here only
        torch.manual_seed(0)
        side = convert_to_domain_parallel(Net().double(), solo[0])
        for h in CHURN:
            side(torch.randn(1, C, h, W, dtype=torch.float64))
    steps.append(_step(net, world, rank, H, 3))  # every rank must still recall (or all learn again)
    kept = {ranks: len(keys) for ranks, keys in plans.state().kept.items()}
    return steps, kept


@pytest.mark.parametrize("world", [2, 3])
def test_one_groups_churn_on_one_rank_never_evicts_another_groups_records(world):
    want = _reference(Net, [(H, 1), (H, 2), (H, 3)])
    results = run_on_ranks(_churn_one_rank, world, timeout=240)
    for rank, (steps, kept) in enumerate(results):
        for i, (got, w) in enumerate(zip(steps, want, strict=True)):
            _check(got, w, (rank, i))
        assert all(n <= CAP for n in kept.values()), (rank, kept)  # every group's records at most at the cap
        assert kept[tuple(range(world))] == 2, (rank, kept)  # the shared model's: untouched by the churn
        if rank == 0:
            assert kept[(0,)] == CAP, kept  # the side model's: churned down to the cap


# -- (a) a model's guarded epochs and its modules' sites: one bounded table, dropped together, learned again ------

#: (rows, seed) of each call at a cap of 2 epochs: 13 learned, recalled; 16, 19 (13 dropped); 13 guarded again
#: and learned again (16 dropped), recalled; 16 guarded again (19 dropped). Every rank's shard changes at each new
#: height on 2 and on 3 ranks (a grid whose shares change on some ranks only is not learned: halo.plan.entry)
SWEEP = ((13, 1), (13, 2), (16, 3), (19, 4), (13, 5), (13, 6), (16, 7))
GUARDED = (True, False, True, True, True, False, True)  # which calls run under the guard


def _sweep(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE
    from halo.plan import plans
    from halo.testing import HostWorkCounter

    halo.set_timeout(60)
    plans.set_limits(epochs=2)
    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Normed().double(), manager, custom_converters={Normed: INSIDE})
    steps, tables = [], []
    for h, seed in SWEEP:
        with HostWorkCounter() as counter:
            steps.append(_step(model, world, rank, h, seed))
        guarded = plans.guarded_epochs(model)
        sites = model.__dict__.get("_halo_reroute", {})
        tables.append((list(guarded), sorted(sites), counter.summary().get("agreement", 0),
                       all(m is model for ms in guarded.values() for m in ms)))
    return steps, tables


@pytest.mark.parametrize("world", [2, 3])
def test_guarded_epochs_and_their_sites_are_dropped_together_and_learned_again(world):
    want = _reference(Normed, SWEEP)
    results = run_on_ranks(_sweep, world, timeout=300)
    for rank, (steps, tables) in enumerate(results):
        for i, (got, w) in enumerate(zip(steps, want, strict=True)):
            _check(got, w, (rank, i, SWEEP[i]))  # exact on every call, the ones after a drop included
        epochs = [t[0][-1] for t in tables]  # the epoch of each call (the most recently called)
        assert len({epochs[0], epochs[2], epochs[3]}) == 3 and epochs[4] == epochs[0] and epochs[6] == epochs[2]
        for i, (guarded, sites, agreements, own) in enumerate(tables):
            assert len(guarded) == min(i + 1 - GUARDED[:i + 1].count(False), 2), (rank, i, guarded)  # at the cap
            assert sorted(guarded) == sites and own, (rank, i, guarded, sites)  # the sites go with their epoch
            steady = min(a for _, _, a, _ in tables)
            assert (agreements > steady) == GUARDED[i], (rank, i, [t[2] for t in tables])  # guarded: learned again
        assert tables[3][0] == [epochs[2], epochs[3]] and tables[4][0] == [epochs[3], epochs[4]], (rank, tables)


def test_limits_are_checked_and_belong_to_the_context():
    from halo import context
    from halo.plan import plans

    with context.use():
        plans.set_limits(records=3, epochs=5)
        assert (plans.state().max_records, plans.state().max_epochs) == (3, 5)
        with context.use():
            assert (plans.state().max_records, plans.state().max_epochs) == (plans.MAX_RECORDS, plans.MAX_EPOCHS)
        for bad in (0, -1, 2.5, True, "3"):
            with pytest.raises(ValueError, match="positive int"):
                plans.set_limits(records=bad)
            with pytest.raises(ValueError, match="positive int"):
                plans.set_limits(epochs=bad)


def _reconverted(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel
    from halo.nn.convert import INSIDE

    halo.set_timeout(60)
    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Normed().double(), manager, custom_converters={Normed: INSIDE})
    steps = [_step(model, world, rank, H, 1)]  # guarded: its group norm's site learned
    revert_domain_parallel(model)  # the sites go (the class's forward back) ...
    convert_to_domain_parallel(model, manager, custom_converters={Normed: INSIDE})
    steps.append(_step(model, world, rank, H, 2))  # ... so its guarded epochs must go too: guarded again here
    return steps


def test_a_model_converted_again_after_revert_is_guarded_again():
    """Before: the reverted model kept its guarded epochs, so its next call at those shapes ran unguarded and
    unrouted (``F.group_norm`` of each shard: silently different)."""
    want = _reference(Normed, [(H, 1), (H, 2)])
    for rank, steps in enumerate(run_on_ranks(_reconverted, 2, timeout=240)):
        for i, (got, w) in enumerate(zip(steps, want, strict=True)):
            _check(got, w, (rank, i))
