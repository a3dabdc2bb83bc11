"""Replicated state checked, not assumed (docs/design.md invariant 8): every rank of a domain group holds the same
parameters and buffers, the gradient sync runs once per step over the model's own groups, and ranks that are not at
the same step say why.

Each case on 2 or 4 gloo ranks (dp 2 x domain 2) asserts the same named error on every rank (or, where one rank
alone can see the cause, that rank's error names it and every other rank's error is bounded):

- a model built after ``torch.manual_seed(rank)``: ``halo.parallelize`` ("none" and "ddp") and
  ``check_replicated`` raise naming the first differing tensor and the ranks; a plainly converted model raises at its
  first forward (the periodic check runs at forward 0);
- ``sync_domain_gradients`` called twice for one backward raises; once per step (zero_grad or accumulation) does not;
- a forgotten sync: the weights diverge at the optimizer step and the periodic checksum (``check_every(3)``) launched
  at forward 3 names the tensor when its result is read, at forward 6 (no host wait at the check itself), on every
  rank;
- swapped dp / domain groups, the world group as the domain group, the world group as the dp group: refused;
- ``eval()`` on one rank only: named; one rank skipping ``backward``: that rank's error names it, the peer's is a
  bounded ``HaloCommError``; ranks whose forward counts differ: named;
- the CREDIT drop-in's ``domain_loss_scale()``: refused when fields of two heights were sharded since the last call,
  exact from ``like=`` the loss's own tensor.
"""

import pytest
import torch
from torch import nn

from halo.testing import run_on_ranks

H, W, C = 21, 8, 2


def _net():
    return nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, C, 3, padding=1)).double()


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reports what every rank raised
        return f"{type(exc).__name__}: {exc}"
    return None


def _field(seed=1):
    return torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# -- divergent seeds ----------------------------------------------------------------------------------------------

def _seeded(rank, world, domain, how):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.plan.replicated import check_replicated

    manager = halo.initialize_domain_parallel(world, domain)
    halo.set_timeout(20)
    torch.manual_seed(rank)  # the mistake: every rank builds other weights
    model = _net()
    if how == "check":
        return _error(lambda: check_replicated(model, manager.domain_group))
    if how in ("none", "ddp"):
        return _error(lambda: halo.parallelize(model, manager, data_parallel=how))
    # (refused at its first forward, or at conversion where convert_to_domain_parallel checks too)
    return _error(lambda: convert_to_domain_parallel(model, manager)(halo.shard(_field())))


@pytest.mark.parametrize("how", ["check", "none", "forward"])
def test_divergent_seed_is_refused_on_every_rank(how):
    errors = run_on_ranks(_seeded, 2, 2, how, timeout=60)
    assert all(e is not None and e.startswith("ValueError") for e in errors), errors
    assert len(set(errors)) == 1, errors
    assert "'0.weight' (float64 [4, 2, 3, 3]) differs across the domain group" in errors[0], errors[0]
    assert "group ranks [0] (global [0])" in errors[0] and "group ranks [1] (global [1])" in errors[0], errors[0]
    assert "torch.manual_seed(rank)" in errors[0], errors[0]


def test_divergent_seed_is_refused_by_parallelize_ddp_on_dp_x_domain():
    errors = run_on_ranks(_seeded, 4, 2, "ddp", timeout=90)
    assert all(e is not None and "'0.weight'" in e and "differs across the domain group" in e for e in errors), errors
    assert errors[0] == errors[1] and errors[2] == errors[3], errors
    assert "(global [2])" in errors[2] and "(global [3])" in errors[2], errors[2]  # the second domain group's ranks


# -- the gradient sync ------------------------------------------------------------------------------------------

def _step(model, x, opt=None, sync=True, twice=False, zero=True):
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    if opt is not None and zero:
        opt.zero_grad(set_to_none=True)
    domain_mean((model(x) - x) ** 2).backward()
    if sync:
        sync_domain_gradients(model)
        if twice:
            sync_domain_gradients(model)
    if opt is not None:
        opt.step()


def _double_sync(rank, world):
    import halo

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(20)
    torch.manual_seed(0)
    model = halo.parallelize(_net(), manager, data_parallel="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = halo.shard(_field())
    out = {"once": _error(lambda: [_step(model, x, opt) for _ in range(2)])}
    out["accumulated"] = _error(lambda: [_step(model, x, opt, zero=False) for _ in range(2)])  # backward each time
    out["zero_grad_kept"] = _error(lambda: (opt.zero_grad(set_to_none=False), _step(model, x, opt, zero=False)))
    out["twice"] = _error(lambda: _step(model, x, opt, twice=True))
    return out


def test_sync_twice_raises_once_per_step_does_not():
    results = run_on_ranks(_double_sync, 2, timeout=60)
    for r in results:
        assert r["once"] is None and r["zero_grad_kept"] is None, r
        # a backward into gradients the last sync left (no zero_grad): the next sync would sum them again
        assert r["accumulated"] is not None and "already summed" in r["accumulated"], r
        assert r["twice"] is not None and r["twice"].startswith("RuntimeError"), r
        assert "called twice for one backward" in r["twice"], r
    assert results[0]["twice"] == results[1]["twice"]


def _forgotten(rank, world, every):
    import halo
    from halo.plan.replicated import check_every

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(20)
    check_every(every)
    torch.manual_seed(0)
    model = halo.parallelize(_net(), manager, data_parallel="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = halo.shard(_field())
    done = 0
    try:
        for step in range(8):
            _step(model, x, opt, sync=step != 1)  # step 1 forgets the sync: each rank steps on its own part
            done += 1
    except ValueError as exc:
        return done, str(exc)
    return done, None


def test_forgotten_sync_is_caught_within_the_check_interval():
    results = run_on_ranks(_forgotten, 2, 3, timeout=60)
    # Launched at forward 3 (= 1 x 3), read at the next check, forward 6 (its result long computed): step 6 raises.
    assert all(done == 6 for done, _ in results), results
    errors = [e for _, e in results]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "differs across the domain group" in errors[0] and "periodic check at forward 3" in errors[0], errors[0]
    assert "read at forward 6" in errors[0], errors[0]
    assert "forgotten or doubled sync_domain_gradients" in errors[0], errors[0]


def _groups(rank, world, case):
    import halo
    from halo.parallel.reduce import sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, 2)
    halo.set_timeout(20)
    torch.manual_seed(0)
    model = halo.parallelize(_net(), manager, data_parallel="none")
    x = halo.shard(_field())
    from halo.parallel.reduce import domain_mean

    domain_mean((model(x) - x) ** 2).backward()
    world_group = torch.distributed.group.WORLD
    kwargs = {"swapped": dict(domain_group=manager.data_parallel_group, dp_group=manager.domain_group),
              "world_domain": dict(domain_group=world_group),
              "world_dp": dict(domain_group=manager.domain_group, dp_group=world_group),
              "right": dict(domain_group=manager.domain_group, dp_group=manager.data_parallel_group)}[case]
    return _error(lambda: sync_domain_gradients(model, **kwargs))


def test_wrong_groups_are_refused():
    for case, needle in (("swapped", "but the model was converted for the domain group"),
                         ("world_domain", "domain_group holds global ranks [0, 1, 2, 3]"),
                         ("world_dp", "which share global ranks")):
        errors = run_on_ranks(_groups, 4, case, timeout=60)
        assert all(e is not None and e.startswith("ValueError") and needle in e for e in errors), (case, errors)
    assert run_on_ranks(_groups, 4, "right", timeout=60) == [None] * 4


# -- ranks not at the same step ---------------------------------------------------------------------------------

def _not_in_step(rank, world, case):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean

    halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(_net())
    x = halo.shard(_field())
    domain_mean(model(x) ** 2).backward()
    if case == "eval":
        halo.set_timeout(3)
        if rank == 1:
            model.eval()
        return _error(lambda: model(x))
    if case == "skip_local":  # a backward that sends nothing (pointwise model, local loss): the rank that skips it
        halo.set_timeout(10)  # reaches the next step with its peer
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(C, C, 1)).double())
        (model(x) ** 2).sum().backward()
        loss = (model(x) ** 2).sum()
        if rank == 1:
            loss.backward()
        return _error(lambda: model(x))
    halo.set_timeout(3)
    loss = domain_mean(model(x) ** 2)
    if rank == 0:
        return _error(lambda: model(x))  # skipped loss.backward(): its peer waits in its backward
    return _error(loss.backward)


def test_eval_on_one_rank_is_named():
    """Rank 1 alone goes to eval(): its peer's call is steady (no agreement), so both raise HaloCommError within
    the timeout, and rank 1 says why. (Both ranks in another mode at once agree on it: one agreed call.)"""
    errors = run_on_ranks(_not_in_step, 2, "eval", timeout=60)
    assert all(e is not None and e.startswith("HaloCommError") for e in errors), errors
    assert "Likely cause: on this rank the model went to eval() mode since the model's last agreed call" in errors[1]


def _eval_mismatch_at_an_agreed_call(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(_net())
    if rank == 1:
        model.eval()
    return _error(lambda: model(halo.shard(_field())))


def test_eval_on_one_rank_at_an_agreed_call_is_one_error_everywhere():
    errors = run_on_ranks(_eval_mismatch_at_an_agreed_call, 2, timeout=60)
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert "eval() mode on group ranks [1]" in errors[0] and "train() mode on group ranks [0]" in errors[0], errors


def test_backward_skipped_on_one_rank_is_named_at_the_next_step():
    """Rank 1 ran the backward of a model that sends nothing (a 1x1 conv, local loss), rank 0 skipped it: rank 0's
    next call agrees (its backward did not run: not a steady call) and names the cause; rank 1's is steady and
    computes its own rows (exact: nothing it does needs rank 0)."""
    errors = run_on_ranks(_not_in_step, 2, "skip_local", timeout=60)
    assert errors[0] is not None and errors[0].startswith("HaloCommError"), errors
    assert "did not run backward() through the output of its previous forward" in errors[0], errors
    assert errors[1] is None, errors


def test_skipped_backward_names_the_cause_on_the_rank_that_skipped():
    errors = run_on_ranks(_not_in_step, 2, "skip_backward", timeout=60)
    assert errors[0] is not None and errors[0].startswith("HaloCommError"), errors
    assert "did not run backward() through the output of its previous forward" in errors[0], errors[0]
    assert errors[1] is not None and errors[1].startswith("HaloCommError"), errors  # bounded, names the peer


# -- CREDIT's loss scale ----------------------------------------------------------------------------------------

def _credit_scale(rank, world):
    from halo.compat import credit

    manager = credit.initialize_domain_parallel(world, world)
    x = credit.shard_tensor(torch.zeros(1, C, 21, W), manager=manager)
    y = credit.shard_tensor(torch.zeros(1, C, 21, W), manager=manager)
    plain = credit.domain_loss_scale(manager)
    again = credit.domain_loss_scale(manager)  # nothing sharded since: the same split
    credit.shard_tensor(torch.zeros(1, 1, 10, W), manager=manager)  # a static field of another height
    ambiguous = _error(lambda: credit.domain_loss_scale(manager))
    like = credit.domain_loss_scale(manager, like=y)
    return plain, again, ambiguous, like, x.shape[-2]


def test_credit_loss_scale_comes_from_the_loss_tensor_or_refuses():
    results = run_on_ranks(_credit_scale, 2, timeout=60)
    for rank, (plain, again, ambiguous, like, rows) in enumerate(results):
        want = 2 * (11, 10)[rank] / 21
        assert rows == (11, 10)[rank]
        assert plain == again == like == pytest.approx(want, rel=0, abs=1e-15), (plain, again, like, want)
        assert ambiguous is not None and ambiguous.startswith("ValueError"), ambiguous
        assert "10 rows, 21 rows" in ambiguous and "like=" in ambiguous, ambiguous
    assert results[0][2] == results[1][2]


def test_checksum_sees_one_bit():
    """The periodic check's device work: one exact integer sum of each tensor's bits, folded into one int64."""
    from halo.plan.replicated import checksum

    torch.manual_seed(0)
    model = _net()
    a = checksum(model)
    assert a.dtype == torch.int64 and a.dim() == 0
    assert torch.equal(a, checksum(model))
    with torch.no_grad():
        model[0].weight.view(torch.int64)[0, 0, 0, 0] ^= 1  # one bit of one weight
    assert not torch.equal(a, checksum(model))
    assert checksum(_net().to(torch.bfloat16)).dtype == torch.int64
