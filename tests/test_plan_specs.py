"""Exchanger specs never outlive, nor are outlived by, the plans that hold their ids (issue 31 item 4).

The bug. A plan recorded by the planner (``halo.plan.plans``) holds exchanger ids (``halo.exchange._registry``).
The registry's specs were an LRU of ``SPECS_CAP`` (a live exchanger's kept), evicted on each rank by that rank's own
planning, apart from the records holding their ids. Churn more shapes than the caps and come back to an early shape:
its record is recalled (every rank hits) and names an id whose spec is gone, so the exchange raised ``LookupError``
(a shape the model ran a minute ago no longer runs); and where the churn is one rank's own (a model on a one-rank
group), that rank alone fails while its peers post their messages and wait for it.

The fix: a spec is held by whatever holds its id (the record that planned it, the live exchanger, a compiled graph
that baked it in) and only the unheld ones are an LRU; so an id a plan holds always resolves, on every rank.

Every check compares forward and backward (input and parameter gradients) with the unsharded model in float64, on
3 ranks at odd rows, and fails if the exchange is replaced by a local one (the halo rows come from the peers).
"""

import pytest
import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

C, W = 2, 6
CAPS = 3, 1  # SPECS_CAP, LIVE_CAP: far below the shapes the churn plans
EARLY = 13  # rows of the first and the last call
CHURN = (5, 8, 11, 14, 17, 20)  # every rank's share changes at each (3 ranks): a learned grid re-learns


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.b = nn.Conv2d(C, C, (5, 3), padding=(2, 1), padding_mode="circular")

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _full(h, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, C, h, W, dtype=torch.float64, generator=g),
            torch.randn(2, C, h, W, dtype=torch.float64, generator=g))


def _local(t, world, rank):
    offs = split_offsets(t.shape[-2], world)
    return t[..., offs[rank]:offs[rank + 1], :]


def _step(model, world, rank, h, seed):
    import halo

    full, wts = _full(h, seed)
    x = _local(full, world, rank).clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y * _local(wts, world, rank)).sum().backward()
    grads = [halo.parallel.all_reduce(p.grad.clone()) for p in model.parameters()]
    return halo.gather(y.detach()), halo.gather(x.grad), grads


def _reference(calls):
    torch.manual_seed(0)
    model = Net().double()
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


def _outcome(fn):
    """What a call did: ``("ok", value)`` or ``("error", type, message)`` (a verdict every rank can report)."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test reports what any rank raised
        return ("error", type(exc).__name__, str(exc)[:300])


def _sweep(rank, world, mode):
    """``mode``: ``"model"`` (a converted model churns shapes on every rank), ``"layer"`` (a standalone layer on
    ``halo.shard`` outputs), ``"solo"`` (rank 0 alone churns exchanges on its own one-rank group)."""
    import torch.distributed as dist

    import halo
    from halo.exchange import _registry as hx
    from halo.nn import DomainConv2d, convert_to_domain_parallel

    halo.set_timeout(30)  # a rank failing alone would leave its peers waiting: bounded
    hx.SPECS_CAP, hx.LIVE_CAP = CAPS
    manager = halo.initialize_domain_parallel(world, world)
    solo = [dist.new_group([r]) for r in range(world)]  # (every rank makes every group, in the same order)
    torch.manual_seed(0)
    net = convert_to_domain_parallel(Net().double(), manager)
    results = [_outcome(lambda: _step(net, world, rank, EARLY, 1))]
    if mode == "model":
        results += [_outcome(lambda h=h: _step(net, world, rank, h, 2)) for h in CHURN]
    elif mode == "layer":
        torch.manual_seed(0)
        layer = DomainConv2d(nn.Conv2d(C, C, 3, padding=1).double())
        for h in CHURN:
            layer(halo.shard(torch.randn(1, C, h, W, dtype=torch.float64)))
    elif rank == 0:  # exchanges on rank 0's own one-rank group: planned here only
        for h in CHURN:
            halo.halo_exchange(torch.randn(1, C, h, W, dtype=torch.float64), 1, group=solo[0])
    results.append(_outcome(lambda: _step(net, world, rank, EARLY, 3)))  # back to the early shape: recalled
    live = len(hx._state().live)  # noqa: SLF001 - the bound of a private table
    return results, live


@pytest.mark.parametrize("mode", ["model", "layer", "solo"])
def test_an_early_shape_runs_again_after_churning_past_the_caps(mode):
    world = 3
    calls = [(EARLY, 1)] + ([(h, 2) for h in CHURN] if mode == "model" else []) + [(EARLY, 3)]
    want = _reference(calls)
    results = run_on_ranks(_sweep, world, mode, timeout=300)
    errors = [(rank, r) for rank, (res, _) in enumerate(results) for r in res if r[0] != "ok"]
    assert not errors, errors
    for rank, (res, live) in enumerate(results):
        for i, (got, w) in enumerate(zip(res, want, strict=True)):
            _check(got[1], w, (mode, rank, i))
        assert live <= CAPS[1], (rank, live)  # the live exchangers stay at their cap


def test_a_held_spec_is_kept_and_an_unheld_one_is_bounded(monkeypatch):
    """In one process: an id a plan holds (:func:`halo.plan.plans.resolve` records it) resolves past the cap; an id
    nothing holds is dropped past it, and is never reused (a new plan of the same spec gets a new id)."""
    from halo import context
    from halo.dist.comm import CommGroup
    from halo.exchange import _registry as hx

    cg = CommGroup(None, 2, 0, (0, 1))
    with context.use():
        monkeypatch.setattr(hx, "SPECS_CAP", 2)
        monkeypatch.setattr(hx, "LIVE_CAP", 1)
        held = hx.exchange_ref(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", "held")
        ids = [hx.exchanger_id(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", f"op{k}") for k in range(4)]
        assert hx.exchange_spec(held.id).op == "held"  # held by `held`: kept, past the cap
        assert hx.exchange_spec(ids[3]).op == "op3"
        with pytest.raises(LookupError, match="unknown in this context"):
            hx.exchange_spec(ids[0])  # held by nothing: dropped
        again = hx.exchanger_id(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", "op0")
        assert again not in ids and again != held.id
        assert hx.exchanger_id(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", "held") == held.id
        del held
        for k in range(4, 8):
            hx.exchanger_id(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", f"op{k}")
        assert len(hx._state().by_id) <= 2 + 1, len(hx._state().by_id)  # noqa: SLF001 - the bound


def test_a_compiled_graphs_exchangers_outlive_its_records(monkeypatch):
    """A compiled graph bakes its exchanger ids in: they must resolve after the records it was traced from are
    dropped and other shapes churned the live exchangers and the unheld specs (one process: the replicated path,
    which plans and compiles as a sharded call does; circular boundary, so the rows come from the other end)."""
    import halo
    from halo import context
    from halo.exchange import _registry as hx
    from halo.plan import plans

    def f(x):
        return halo.halo_exchange(x, 1, boundary="circular") * 2

    with context.use():
        monkeypatch.setattr(hx, "SPECS_CAP", 1)
        monkeypatch.setattr(hx, "LIVE_CAP", 1)
        plans.set_limits(records=1)
        torch._dynamo.reset()
        g = torch.compile(f, backend="aot_eager", fullgraph=True)
        x = torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True)
        want = torch.nn.functional.pad(x.detach(), (0, 0, 1, 1), mode="circular") * 2
        assert torch.equal(f(x.detach()), want)  # eager first (the context's tables made): the trace recalls it
        assert torch.equal(g(x), want)
        for h in (5, 9, 11):  # eager calls at other shapes: their records, specs and exchangers evict the others
            f(torch.randn(1, 2, h, 4, dtype=torch.float64))
        assert len(plans.state().records) == 1 and len(hx._state().live) == 1  # noqa: SLF001 - the caps held
        y = g(x)  # the same graph (no retrace), its ids still known
        assert torch.equal(y, want)
        y.sum().backward()  # the adjoint: every halo row's gradient back on its source row
        grad = torch.full_like(x, 2.0)
        grad[..., 0, :] += 2.0
        grad[..., -1, :] += 2.0
        assert torch.equal(x.grad, grad)
        torch._dynamo.reset()
