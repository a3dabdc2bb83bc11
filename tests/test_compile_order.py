"""Every communicating op of halo in one order on every rank under ``torch.compile``; checkpointing inside a compiled
region.

* Newly ordered ops. ``halo.parallel.all_reduce`` with ``max``/``min`` (``halo::all_reduce``, which took only sum and
  mean before) and the replicated reductions ``domain_sum``/``domain_mean`` and the latitude-weighted losses
  (``halo::replicated_sum``; an autograd Function before, which dynamo could not trace: a graph break) are custom
  ops that read the device's order token and are declared to write it right after them
  (``halo.exchange.order_after``). A graph of two independent chains of each, on ranks with different shard sizes
  (45 rows on 2 ranks: 23 and 22, the first chain heavier than the second, so a memory-driven scheduler would see
  different sizes per rank), compiled whole (``fullgraph=True``) with aot_eager and inductor: what each rank posts
  is logged, in order, and must be program order in forward (and the eager order in backward) on every rank; the
  values, the input gradients of both chains equal the unsharded computation's in float64.
* Graph breaks. Every other path that communicates from Python (gather/scatter, long-range regrouping, async and
  in-place exchanges, global pools, the gradient sync) is a graph break: ``halo.dist.comm``'s posting and waiting
  helpers and ``halo.exchange.post_messages`` are ``torch._dynamo.disable``d, so dynamo never traces a collective
  into a graph, where nothing would order it. Checked: no graph holds a collective other than halo's own ordered
  ops, at least one graph break, results equal eager.
* Activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) inside the compiled forward of a
  converted model (convs, GroupNorm, a checkpointed ``domain_mean`` loss and a latitude-weighted MSE), compiled whole
  (``fullgraph=True``): aot_eager and inductor, 2 ranks, uneven rows, equal to the unsharded model forward, input
  gradient and parameter gradients, one posting order on every rank. torch 2.13 cannot recompute an ordered-effect op
  in backward (aot_eager saved a ``None`` token, inductor failed to unlift the tokens: both crashed inside torch), so
  in a compiled region halo's communicating ops are saved, not recomputed
  (``halo.exchange._ops._save_communication_in_checkpoints``): compiled backward posts only the adjoints, where eager
  checkpointing re-posts the forward's messages; both are exact.

Tolerance: float64; the compiled graph may reorder the arithmetic of fused kernels: 1e-12 relative.
"""

from __future__ import annotations

import pytest
import torch

from halo.testing import run_on_ranks

#: above the longest rank timeout of this file (cold inductor compiles): pytest must not kill the ranks first
pytestmark = pytest.mark.timeout(700)


H, W = 45, 6
TOL = 1e-12


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _chains(a: torch.Tensor, b: torch.Tensor, world: int) -> tuple[torch.Tensor, ...]:
    """Two independent chains, each with a max/min all-reduce and a replicated reduction (a's heavier)."""
    from halo.parallel.reduce import all_reduce, domain_mean, domain_sum

    ha = torch.sin(a) * 3 + a.square()
    ma = all_reduce(ha.amax(dim=-2), "max")  # (2, 4, W): the same shape on every rank
    mb = all_reduce(b.amin(dim=-2), "min")  # (2, 3, W)
    sa = domain_mean(ha * a)  # replicated, counted once
    sb = domain_sum(b.square())
    return ma, mb, sa, sb


def _loss(outs: tuple[torch.Tensor, ...], world: int) -> torch.Tensor:
    ma, mb, sa, sb = outs
    return (ma * ma).sum() + (mb * mb * mb).sum() + 2 * sa + 3 * sb


def _reference(fa: torch.Tensor, fb: torch.Tensor, world: int) -> tuple:
    """The unsharded computation. Every rank's per-rank terms (``ma``, ``mb``: each rank uses the all-reduced value
    in its own loss) add up over the ranks (the plain adjoint), the replicated ones count once."""
    a, b = fa.clone().requires_grad_(True), fb.clone().requires_grad_(True)
    ha = torch.sin(a) * 3 + a.square()
    ma, mb = ha.amax(dim=-2), b.amin(dim=-2)
    sa, sb = (ha * a).mean(), b.square().sum()
    loss = world * ((ma * ma).sum() + (mb * mb * mb).sum()) + 2 * sa + 3 * sb
    loss.backward()
    return (ma.detach(), mb.detach(), sa.detach(), sb.detach()), a.grad, b.grad


def _order_on_rank(rank: int, world: int, backend: str) -> dict:
    import torch._dynamo

    import halo
    import halo.parallel.reduce as hred
    from halo.plan.partition import split_offsets

    halo.initialize_domain_parallel(world, world)
    log: list = []
    inner = hred.bounded_all_reduce

    def logged(t, info, what, *args, **kwargs):
        log.append((what, tuple(t.shape)))
        return inner(t, info, what, *args, **kwargs)

    hred.bounded_all_reduce = logged
    offs = split_offsets(H, world)
    gen = torch.Generator().manual_seed(0)
    fa = torch.randn(2, 4, H, W, dtype=torch.float64, generator=gen)
    fb = torch.randn(2, 3, H, W, dtype=torch.float64, generator=gen)
    a0, b0 = fa[..., offs[rank]:offs[rank + 1], :], fb[..., offs[rank]:offs[rank + 1], :]

    def step(a, b):
        return _chains(a, b, world)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    results: dict = {}
    for name, fn in (("eager", step), ("compiled", compiled), ("again", compiled)):
        log.clear()
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        with torch._dynamo.config.patch(error_on_recompile=name == "again"):
            outs = fn(a, b)
        forward = list(log)
        log.clear()
        _loss(outs, world).backward()
        results[name] = {"forward": forward, "backward": list(log), "outs": [o.detach() for o in outs],
                         "ga": a.grad, "gb": b.grad}
    outs, ga, gb = _reference(fa, fb, world)
    results["ref"] = {"outs": outs, "ga": ga[..., offs[rank]:offs[rank + 1], :],
                      "gb": gb[..., offs[rank]:offs[rank + 1], :]}
    # Ties: the same maximum on both ranks (a constant field): the gradient splits over the ranks, as eager's.
    tie_runs = []
    for fn in (step, compiled):
        a = torch.ones_like(a0).requires_grad_(True)
        b = b0.clone().requires_grad_(True)
        _loss(fn(a, b), world).backward()
        tie_runs.append(a.grad)
    results["ties"] = tie_runs
    return results


# -- one rank launch per backend: every check of this file that compiles with it -----------------------------------

def _all_on_rank(rank: int, world: int, backend: str) -> dict:
    """The checks of this file for ``backend`` in one launch (a launch, its imports and dynamo's warm-up cost more
    than a check): the graph breaks (their own recording backend; first, while no plan of their shapes is known, so
    the loss outside a model still meets its agreement), the ordered ops, checkpointing. The functions each check
    wraps to log what is posted are put back after it, so no check sees another's log."""
    import torch._dynamo

    import halo.exchange as hx
    import halo.nn.norm as hn
    import halo.parallel.reduce as hred

    saved = (hred.bounded_all_reduce, hn.bounded_all_reduce, hx.Exchanger.start, hx.Exchanger.start_adjoint)
    checks = {"order": _order_on_rank, "ckpt": _checkpoint_on_rank}
    if backend == "aot_eager":
        checks = {"breaks": lambda r, w, b: _breaks_on_rank(r, w), **checks}
    out = {}
    for name, check in checks.items():
        torch._dynamo.reset()
        try:
            out[name] = check(rank, world, backend)
        finally:
            hred.bounded_all_reduce, hn.bounded_all_reduce, hx.Exchanger.start, hx.Exchanger.start_adjoint = saved
    return out


_RUNS: dict = {}


def _all(backend: str) -> dict:
    if backend not in _RUNS:
        _RUNS[backend] = run_on_ranks(_all_on_rank, 2, backend, timeout=600)
    return _RUNS[backend]


def _run(backend: str) -> list[dict]:
    return [r["order"] for r in _all(backend)]


FORWARD = [("all_reduce", (2, 4, W)), ("all_reduce", (2, 3, W)), ("domain reduction", (2,)),
           ("domain reduction", (1,))]
# The reverse: b's sum, a's mean (their gradients: halo::all_reduce "mean" of the replicated sums' gradient, the
# count's included), b's min, a's max (each: the gradient and the ties stacked in one all-reduce).
BACKWARD = [("all_reduce", (1,)), ("all_reduce", (2,)), ("all_reduce", (2, 2, 3, W)), ("all_reduce", (2, 2, 4, W))]
# Eager: the same order (its Functions all-reduce the gradient and the ties apart, and not the count).
EAGER_BACKWARD = [("domain reduction (backward)", (1,))] * 2 + [("all_reduce (backward)", (2, 3, W))] * 2 \
    + [("all_reduce (backward)", (2, 4, W))] * 2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_new_ordered_ops_post_in_program_order_on_every_rank(backend: str) -> None:
    """a's max, b's min, a's mean (sum and count: 2 numbers), b's sum (1 number): program order forward, its
    reverse backward, on every rank, every call (the second call reuses the graph: no recompilation)."""
    for rank, r in enumerate(_run(backend)):
        assert r["eager"]["forward"] == FORWARD, (rank, r["eager"]["forward"])
        assert r["eager"]["backward"] == EAGER_BACKWARD, (rank, r["eager"]["backward"])
        for name in ("compiled", "again"):
            assert r[name]["forward"] == FORWARD, (rank, name, r[name]["forward"])
            assert r[name]["backward"] == BACKWARD, (rank, name, r[name]["backward"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_new_ordered_ops_equal_the_unsharded_computation(backend: str) -> None:
    for rank, r in enumerate(_run(backend)):
        ref = r["ref"]
        for name in ("eager", "compiled", "again"):
            for got, want in zip(r[name]["outs"], ref["outs"], strict=True):
                assert _rel(got, want) < TOL, (rank, name, got, want)
            assert _rel(r[name]["ga"], ref["ga"]) < TOL, (rank, name, "ga")
            assert _rel(r[name]["gb"], ref["gb"]) < TOL, (rank, name, "gb")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_max_splits_ties_over_ranks_as_eager(backend: str) -> None:
    for r in _run(backend):
        eager, compiled = r["ties"]
        assert torch.allclose(compiled, eager, rtol=TOL, atol=TOL)
        assert eager.abs().sum() > 0


# -- the paths that communicate from Python: graph breaks, never a collective in a graph -------------------------

def _foreign_collectives(graphs: list) -> list[str]:
    """Collective or point-to-point calls in the captured graphs other than halo's ordered custom ops."""
    words = ("c10d", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "isend", "irecv", "send", "recv",
             "scatter", "barrier", "all_to_all")
    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            name = str(node.target).lower()
            if node.op in ("call_function", "call_method") and any(w in name for w in words) and "halo" not in name:
                found.append(name)
    return found


def _breaks_on_rank(rank: int, world: int) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import halo
    from halo.exchange import halo_exchange, halo_exchange_, halo_exchange_async
    from halo.nn.longrange import columns_to_rows, rows_to_columns
    from halo.nn.pool import halo_adaptive_avg_pool2d, halo_adaptive_max_pool2d
    from halo.parallel.reduce import domain_sum, latitude_weighted_mse, sync_domain_gradients
    from halo.plan.partition import split_offsets

    halo.initialize_domain_parallel(world, world)
    offs = split_offsets(H, world)
    full = torch.randn(2, 3, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x0 = full[..., offs[rank]:offs[rank + 1], :]
    weight = torch.nn.Parameter(torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(4)))

    def exchange_in_place(x):
        with torch.no_grad():
            ext = halo_exchange(x, 1)
            return halo_exchange_(ext * 2, 1)

    def sync(x):
        weight.grad = x.sum((0, 2, 3)) * (rank + 1)  # a different part of the gradient on every rank
        sync_domain_gradients([weight])
        return weight.grad * 1

    cases = {
        "gather": lambda x: halo.gather(x * 2),
        "regroup": lambda x: columns_to_rows(rows_to_columns(x * 2) * 3),
        "async": lambda x: halo_exchange_async(x * 2, 1).wait() * 3,
        "in_place": exchange_in_place,
        "adaptive_avg": lambda x: halo_adaptive_avg_pool2d(x * 2, 1) * 3,
        "adaptive_max": lambda x: halo_adaptive_max_pool2d(x * 2, 1) * 3,
        "sync_gradients": sync,
        # Outside a converted model (no epoch): the agreement on the extents is a graph break, the reduction
        # itself halo::replicated_sum in the graph after it.
        "loss_outside_model": lambda x: latitude_weighted_mse(x, x * 0.5) + domain_sum(x),
    }
    out = {}
    for name, fn in cases.items():
        graphs: list = []

        def record(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        counters.clear()
        results = []
        for f in (fn, torch.compile(fn, backend=record)):
            x = x0.clone().requires_grad_(name not in ("in_place", "sync_gradients"))
            y = f(x)
            grad = None
            if y.requires_grad:
                (y * y).sum().backward()
                grad = x.grad
            results.append((y.detach(), grad))
        (ye, ge), (yc, gc) = results
        err = float((yc - ye).abs().max())
        if ge is not None:
            err = max(err, float((gc - ge).abs().max()))
        out[name] = {"err": err, "breaks": sum(counters["graph_break"].values()),
                     "foreign": _foreign_collectives(graphs)}
    return out


@pytest.fixture(scope="module")
def breaks() -> list[dict]:
    return [r["breaks"] for r in _all("aot_eager")]


CASES = ["gather", "regroup", "async", "in_place", "adaptive_avg", "adaptive_max", "sync_gradients",
         "loss_outside_model"]


@pytest.mark.parametrize("case", CASES)
def test_python_communication_is_a_graph_break_never_a_graph_collective(breaks: list[dict], case: str) -> None:
    """Dynamo never puts one of these collectives into a graph (where nothing orders it against halo's custom ops):
    it breaks the graph there and runs it eagerly, in program order on every rank; results equal eager."""
    for rank, res in enumerate(breaks):
        r = res[case]
        assert r["foreign"] == [], (rank, case, r["foreign"])
        assert r["breaks"] >= 1, (rank, case, r)
        assert r["err"] <= 1e-15, (rank, case, r)


# -- activation checkpointing inside a compiled region ------------------------------------------------------------

class _Checkpointed(torch.nn.Module):
    """Convs and a GroupNorm under ``torch.utils.checkpoint`` (non-reentrant) in the forward, and the loss (a
    replicated ``domain_mean``) checkpointed too; returns the field and the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.c3 = torch.nn.Conv2d(4, 3, 3, padding=1)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.nn.functional.gelu(self.gn(self.c1(x))))

    @staticmethod
    def score(y: torch.Tensor) -> torch.Tensor:
        from halo.parallel.reduce import domain_mean

        return domain_mean(y.square())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.checkpoint import checkpoint

        from halo.parallel.reduce import latitude_weighted_mse

        h = checkpoint(self.block, x, use_reentrant=False)
        y = self.c3(h)
        # A latitude-weighted loss in the graph too (its weights a constant of it: fullgraph compiles).
        return y, checkpoint(self.score, y, use_reentrant=False) + latitude_weighted_mse(y, x)


def _checkpoint_on_rank(rank: int, world: int, backend: str) -> dict:
    import copy

    import halo
    import halo.exchange as hx
    import halo.parallel.reduce as hred
    from halo.dist.comm import unsharded
    from halo.nn import convert_to_domain_parallel
    from halo.plan.partition import split_offsets

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    net = _Checkpointed().double()
    ref_net = copy.deepcopy(net)
    model = convert_to_domain_parallel(net, manager)
    log: list = []
    start, start_adjoint, inner = hx.Exchanger.start, hx.Exchanger.start_adjoint, hred.bounded_all_reduce

    def logged_start(self, x):
        log.append(("exchange", tuple(x.shape[:2])))
        return start(self, x)

    def logged_adjoint(self, before, after, like):  # every adjoint posts here (pad-then-conv's and the patch's)
        log.append(("adjoint", tuple(like.shape[:2])))
        return start_adjoint(self, before, after, like)

    hx.Exchanger.start, hx.Exchanger.start_adjoint = logged_start, logged_adjoint

    def logged(t, info, what, *args, **kwargs):
        log.append(("all_reduce", tuple(t.shape)))
        return inner(t, info, what, *args, **kwargs)

    hred.bounded_all_reduce = logged
    import halo.nn.norm as hn

    hn.bounded_all_reduce = logged
    offs = split_offsets(H, world)
    full = torch.randn(2, 3, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x0 = full[..., offs[rank]:offs[rank + 1], :]

    def step(m, x):
        y, loss = m(x)
        return y, loss, 3 * loss + (y * y).sum()  # replicated (counted once) + sharded (summed over ranks)

    # The unsharded model: the same class, the whole field, halo's reductions on this process alone.
    xr = full.clone().requires_grad_(True)
    with unsharded():
        yr, lr, _ = step(ref_net, xr)
    (3 * lr + (yr * yr).sum()).backward()
    out: dict = {"ref": {"y": yr.detach()[..., offs[rank]:offs[rank + 1], :], "loss": lr.detach(),
                         "gx": xr.grad[..., offs[rank]:offs[rank + 1], :],
                         "gp": [p.grad.clone() for p in ref_net.parameters()]}}
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for name, m in (("compiled", compiled), ("eager", model), ("again", compiled)):
        log.clear()
        x = x0.clone().requires_grad_(True)
        y, loss, total = step(m, x)
        forward = list(log)
        log.clear()
        total.backward()
        out[name] = {"y": y.detach(), "loss": loss.detach(), "gx": x.grad,
                     "gp": [p.grad.clone() for p in model.parameters()], "forward": forward, "backward": list(log)}
        model.zero_grad(set_to_none=True)
    return out


def _ckpt(backend: str) -> list[dict]:
    return [r["ckpt"] for r in _all(backend)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_checkpointing_inside_a_compiled_region_equals_unsharded(backend: str) -> None:
    res = _ckpt(backend)
    for rank, r in enumerate(res):
        ref = r["ref"]
        for name in ("compiled", "again", "eager"):
            got = r[name]
            assert _rel(got["y"], ref["y"]) < TOL, (rank, name, "y")
            assert _rel(got["loss"], ref["loss"]) < TOL, (rank, name, "loss")
            assert _rel(got["gx"], ref["gx"]) < TOL, (rank, name, "gx")
    for name in ("compiled", "again", "eager"):  # each rank holds its part of the parameter gradients: their sum
        for i, want in enumerate(res[0]["ref"]["gp"]):
            got = sum(r[name]["gp"][i] for r in res)
            assert _rel(got, want) < TOL, (name, i)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_checkpointing_inside_a_compiled_region_posts_one_order(backend: str) -> None:
    """Forward: c1's exchange, the GroupNorm's all-reduce, c2's and c3's exchanges, the two losses' reductions; every
    rank the same sequence, forward and backward, and the compiled graph the same on every call."""
    res = _ckpt(backend)
    for name in ("compiled", "again", "eager"):
        assert res[0][name]["forward"] == res[1][name]["forward"], name
        assert res[0][name]["backward"] == res[1][name]["backward"], name
    for r in res:
        # The first compiled call runs the forward once eagerly under the guard (plans.guarded_eager_call), then
        # compiled: the eager order twice. A later compiled call posts it once.
        assert r["compiled"]["forward"] == 2 * r["eager"]["forward"], (r["compiled"]["forward"], r["eager"]["forward"])
        assert r["again"]["forward"] == r["eager"]["forward"], (r["again"]["forward"], r["eager"]["forward"])
        assert r["again"]["backward"] == r["compiled"]["backward"]
        # Compiled: the communicating ops' outputs are saved (the three adjoints, the GroupNorm's and the loss's
        # backward reductions; no forward exchange again). Eager: the checkpoint re-runs the forward's messages
        # (c1's and c2's exchanges and the GroupNorm's all-reduce, recomputed in the first checkpoint's backward).
        kinds = [e[0] for e in r["compiled"]["backward"]]
        assert kinds.count("adjoint") == 3 and kinds.count("all_reduce") == 3 and "exchange" not in kinds, kinds
        assert [e[0] for e in r["eager"]["backward"]].count("exchange") == 2, r["eager"]["backward"]


def test_compiled_checkpoint_policy_saves_communication_only() -> None:
    """The policy of a compiled ``torch.utils.checkpoint`` region: halo's communicating ops and ``order_after``
    saved, everything else (halo's dropout included) recomputed as torch would. torch 2.13+ asks a policy function
    per op (``_always_prefer_recompute``); torch 2.11 / 2.12 tag the region's graph nodes (``tag_nodes``)."""
    import torch.fx as fx
    from torch._higher_order_ops import wrap
    from torch.utils.checkpoint import CheckpointPolicy

    import halo.nn  # noqa: F401 - registers halo::group_norm
    import halo.random  # noqa: F401 - halo::philox_dropout: halo's, but it does not communicate

    saved = ("exchange", "exchange_adjoint", "all_reduce", "replicated_sum", "group_norm", "group_norm_backward",
             "order_after")
    recomputed = (torch.ops.aten.convolution.default, torch.ops.aten.mul.Tensor, torch.ops.halo.philox_dropout.default)
    policy = getattr(wrap, "_always_prefer_recompute", None)
    if policy is not None:
        assert getattr(policy, "_halo_saves_communication", False)
        verdict = {op: policy(None, getattr(torch.ops.halo, op).default) for op in saved}
        verdict.update({op: policy(None, op) for op in recomputed})
    else:
        graph = fx.Graph()
        ops = [getattr(torch.ops.halo, op).default for op in saved] + list(recomputed)
        for op in ops:
            graph.call_function(op, ())
        tagged = wrap.TagActivationCheckpoint.tag_nodes(fx.GraphModule(torch.nn.Module(), graph), False)
        verdict = {n.target: n.meta["recompute"] for n in tagged.graph.nodes}
        verdict = {**{op: verdict[getattr(torch.ops.halo, op).default] for op in saved},
                   **{op: verdict[op] for op in recomputed}}
    for op in saved:
        assert verdict[op] == CheckpointPolicy.MUST_SAVE, op
    for op in recomputed:
        assert verdict[op] == CheckpointPolicy.PREFER_RECOMPUTE, op
