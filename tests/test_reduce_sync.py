"""sync_domain_gradients when which parameters have a gradient differs between ranks or steps (halo.parallel.layout).

The bug this file pins (issue 22, H4): the sync agreed on "which parameters have a gradient" once per *local*
pattern, so a rank whose pattern changed alone (a branch only its rows took) started an agreement its peers, whose
pattern was known, did not: both waited to the timeout (measured before the fix: HaloCommError on both ranks after
``set_timeout(3)``; with buckets of different sizes gloo even sums wrong bytes on one rank and aborts the other).
Now the layout is the parameters that require grad, agreed once, and the per-parameter counts ride in the bucket's
all-reduce: every step is exact against the unsharded model (float64, uneven rows, 2 and 3 ranks), a parameter no
rank used stays ``None`` as in the unsharded model, and the steady step reads nothing back.
"""

import time

import pytest
import torch
from _helpers import portable
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks, run_on_ranks_outcomes

H, W, C = 7, 5, 2
#: Per step, the global rows on which the branch ``b`` acts (``None``: all of them), and whether ``c`` requires
#: grad (on every rank alike: frozen at step 4, unfrozen at step 6).
STEPS = [(None, True), ({0}, True), (set(), True), ({6}, True), ({2, 3}, False), (None, False), ({1, 5}, True)]


class Branchy(nn.Module):
    """A 1x1 conv, a branch ``b * x`` on some rows only (a rank none of whose rows it acts on skips it: no gradient
    there), a scale ``c`` on everything, and ``unused`` (never used: ``None`` everywhere)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 1)
        self.b = nn.Parameter(torch.full((C, 1, 1), 0.5))
        self.c = nn.Parameter(torch.tensor(1.5))
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, x, rows, row0):
        h = self.conv(x) * self.c
        local = [r - row0 for r in range(row0, row0 + x.shape[-2]) if rows is None or r in rows]
        if local:  # the branch only where its rows are: a rank without any never touches b
            mask = torch.zeros(x.shape[-2], 1, dtype=x.dtype)
            mask[local] = 1.0
            h = h + self.b * x * mask
        return h


def _model():
    torch.manual_seed(0)
    return Branchy().double()


def _field(step):
    return torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(step))


def _reference():
    model, grads = _model(), []
    for step, (rows, c_grad) in enumerate(STEPS):
        model.zero_grad(set_to_none=True)
        model.c.requires_grad_(c_grad)
        (model(_field(step), rows, 0) ** 2).mean().backward()
        grads.append({k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()})
    return grads


def _steps(rank, world):
    import halo
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(20)
    model = _model()
    offs = split_offsets(H, world)
    out = []
    for step, (rows, c_grad) in enumerate(STEPS):
        model.zero_grad(set_to_none=True)
        model.c.requires_grad_(c_grad)
        x = _field(step)[..., offs[rank]:offs[rank + 1], :]
        domain_mean(model(x, rows, offs[rank]) ** 2).backward()
        had = {k: p.grad is not None for k, p in model.named_parameters()}
        with HostWorkCounter() as counter:
            sync_domain_gradients(model, manager)
        grads = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
        out.append((had, grads, counter.summary()))
    return portable(out)


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_missing_on_some_ranks_in_some_steps_are_exact(world):
    want = _reference()
    offs = split_offsets(H, world)
    results = run_on_ranks(_steps, world, timeout=180)
    for step, (rows, c_grad) in enumerate(STEPS):
        users = [r for r in range(world) if rows is None or any(offs[r] <= g < offs[r + 1] for g in rows)]
        for rank, res in enumerate(results):
            had, grads, counts = res[step]
            assert had["b"] == (rank in users) and had["c"] == c_grad and not had["unused"], (step, rank, had)
            for k, g in want[step].items():  # the unsharded gradient, or None where the unsharded model has none
                if g is None:
                    assert grads[k] is None, (step, rank, k)
                else:
                    assert torch.allclose(torch.as_tensor(grads[k]), g, rtol=1e-12, atol=1e-14), (step, rank, k)
            # Agreements: the first call, and the steps where requires_grad of c changed on every rank (4, 6);
            # unfrozen, c's gradient is summed in a second all-reduce of that step.
            assert counts.get("agreement", 0) == (1 if step in (0, 4, 6) else 0), (step, rank, counts)
            assert counts.get("c10d.all_reduce", 0) == (2 if step == 6 else 1), (step, rank, counts)
            # One read of the counts per step: unused has no gradient here (nor anywhere), so every rank asks.
            assert counts.get("read", 0) == 1 and counts.get("from_data", 0) == 0, (step, rank, counts)


def _steady(rank, world):
    """Every gradient on every rank: the steady sync reads nothing, builds nothing from data, agrees nothing."""
    import halo
    from halo.parallel.reduce import local_share, sync_domain_gradients
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    model = nn.Sequential(nn.Conv2d(C, 3, 3, padding=1), nn.Conv2d(3, C, 1)).double()
    counts = []
    for step in range(4):
        model.zero_grad(set_to_none=True)
        local_share(model(_field(step)[..., :3 + rank, :]).square().sum()).backward()  # this rank's rows' share
        with HostWorkCounter() as counter:
            sync_domain_gradients(model, manager)
        counts.append(counter.summary())
    return counts


def test_steady_sync_reads_nothing_and_agrees_once():
    for counts in run_on_ranks(_steady, 2, timeout=120):
        assert counts[0].get("agreement") == 1 and counts[0].get("c10d.all_reduce") == 1, counts[0]
        for c in counts[1:]:
            assert c == {"c10d.all_reduce": 1}, c


def _one_rank_freezes(rank, world, peer_reads):
    import halo
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(3)
    model = _model()
    offs = split_offsets(H, world)
    x = _field(0)[..., offs[rank]:offs[rank + 1], :]
    rows = None if peer_reads else set(range(H))
    for step in range(2):
        model.zero_grad(set_to_none=True)
        if step == 1 and rank == 1:
            model.b.requires_grad_(False)  # on this rank alone: its rows' part of b's gradient would be lost
        if not peer_reads:
            model.unused.requires_grad_(False)  # every other gradient present: rank 0 has nothing to read
        domain_mean(model(x, rows, offs[rank]) ** 2).backward()
        sync_domain_gradients(model, manager)
    domain_mean(x)  # the next collective
    return "no error"


@pytest.mark.parametrize("peer_reads", [True, False])
def test_requires_grad_changed_on_one_rank_raises(peer_reads):
    """A rank that reads the counts (rank 1, whose flag changed; rank 0 too when it misses ``unused``) raises
    ValueError naming the ranks; a rank with every gradient, which reads nothing, learns it from its next
    collective: HaloCommError within the timeout. Never a wrong sum, never a hang past the bound."""
    outcomes = run_on_ranks_outcomes(_one_rank_freezes, 2, peer_reads, timeout=90, pg_timeout=30)
    kind, message = outcomes[1]
    assert kind == "error" and message.startswith("ValueError") and "changed on global ranks [1] only" in message \
        and "here: b" in message, outcomes[1]
    kind, message = outcomes[0]
    if peer_reads:
        assert kind == "error" and message.startswith("ValueError") and "global ranks [1] only" in message, outcomes
    else:
        assert kind == "error" and message.startswith("HaloCommError") and "global rank" in message, outcomes


def _different_models(rank, world):
    import halo
    from halo.parallel.reduce import sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, 2)
    model = _model()
    model.c.requires_grad_(rank != 0)  # global rank 0 alone freezes c before the first sync
    halo.set_timeout(20)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    try:
        sync_domain_gradients(model, manager)
    except Exception as exc:  # noqa: BLE001
        time.sleep(1)  # leave the peers' last agreement time to arrive before this process closes its sockets
        return type(exc).__name__, str(exc)
    return None


def test_different_parameters_at_the_first_sync_raise_everywhere():
    """dp 2 x domain 2: global rank 0's flags differ; its domain group sees it, and the data-parallel groups hear
    it in their own agreement, so all four ranks raise ValueError (none waits for the others)."""
    outcomes = run_on_ranks(_different_models, 4, timeout=90)
    for kind, message in outcomes:
        assert kind == "ValueError" and "require grad" in message, outcomes
    for _, message in outcomes[:2]:  # the domain group of rank 0: names the parameter and the ranks
        assert "c requires grad on global ranks [1]" in message, message
