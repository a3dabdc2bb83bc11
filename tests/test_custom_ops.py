"""halo's custom ops under torch.compile: fake kernels that promise exactly the real strides, and one order of the
communicating ops on every rank.

* Strides: inductor asserts that every custom op's real output has the strides its fake kernel promised (a
  channels_last input once crashed ``torch.compile(backend="inductor")`` in ``halo::exchange``). Each op is run
  for real on gloo ranks and through its fake kernel (``FakeTensorMode``) on the same inputs (contiguous,
  channels_last, a non-dense slice), and shape, stride and dtype must be identical.
* Order: ``halo::exchange``, ``halo::exchange_adjoint`` (and ``halo::exchange_halos(_adjoint)``, a compiled
  stride-1 conv's), ``halo::all_reduce`` (sum, mean, max, min),
  ``halo::replicated_sum`` (the domain reductions and losses) and ``halo::group_norm(_backward)`` communicate, so
  no scheduler may swap two of them (inductor's memory-driven order depends on each rank's shard size; two ranks
  posting in different orders hang or swap halos; ``tests/test_compile_order.py`` orders the reductions). They
  are ordered effects (``halo.exchange.order_communication``: never dropped nor repeated) and each reads the
  device's order token, declared written right after it (``halo.exchange.order_after``): a data dependency that
  inductor's ``reorder_for_peak_memory`` keeps (it ignores effect tokens, torch 2.13). The test compiles a graph with
  independent exchanges and reductions on ranks with different shard sizes (45 rows on 2 ranks: 23 and 22), records
  what each rank posts, in order, and requires one sequence on every rank, equal to program order (forward) and to
  its reverse (backward), results equal to the eager ones, and no recompilation on the second step.
"""

from __future__ import annotations

import pytest
import torch

from halo.testing import run_on_ranks

#: above the longest rank timeout of this file (cold inductor compiles): pytest must not kill the ranks first
pytestmark = pytest.mark.timeout(500)



def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), str(t.dtype)


def _strides_on_rank(rank: int, world: int) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import halo
    import halo.exchange as hx
    import halo.exchange._ops as hops
    import halo.nn.norm as hn
    import halo.parallel.reduce as hred
    import halo.random as hr
    from halo.dist.comm import comm_group, group_id

    halo.initialize_domain_parallel(world, world)
    cg = comm_group(None)
    gid = group_id(cg)
    rows = [9, 8][rank]
    base = torch.randn(2, 6, rows, 5, dtype=torch.float64)
    inputs = {"contiguous": base, "channels_last": base.contiguous(memory_format=torch.channels_last),
              "slice": torch.randn(2, 6, rows, 9, dtype=torch.float64)[..., ::2]}
    same = torch.randn(2, 6, 4, 5, dtype=torch.float64)
    same_shape = {"contiguous": same, "channels_last": same.contiguous(memory_format=torch.channels_last),
                  "slice": torch.randn(2, 6, 4, 9, dtype=torch.float64)[..., ::2]}
    plan = hx._plan_uniform(base, 2, -2, None, "zeros", "test")
    order = hx.order_token(base.device)
    out: dict = {}

    def both(name, fn, *args):
        real = fn(*args)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake = fn(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        out[name] = ([_meta(t) for t in real], [_meta(t) for t in fake])

    for kind, x in inputs.items():
        both(f"exchange/{kind}", hops.exchange_op, x, order, plan.ex, 2, plan.rows)
        g = torch.randn(2, 6, plan.rows, x.shape[-1], dtype=torch.float64)
        g = g.contiguous(memory_format=torch.channels_last) if kind == "channels_last" else g
        both(f"exchange_adjoint/{kind}", hops.exchange_adjoint_op, g, order, plan.ex, 2, rows)
        both(f"exchange_halos/{kind}", hops.exchange_halos_op, x, order, plan.ex, 2, 2, 2)
        gh = torch.randn(2, 6, 4, x.shape[-1], dtype=torch.float64)
        gh = gh.contiguous(memory_format=torch.channels_last) if kind == "channels_last" else gh
        sent = sum(n for _, n in hx.get_exchanger(plan.ex).send_ranges)
        both(f"exchange_halos_adjoint/{kind}", hops.exchange_halos_adjoint_op, gh, order, plan.ex, 2, 2, sent)
        same = same_shape[kind]  # an all-reduce takes one shape on every rank
        both(f"all_reduce/{kind}", hred._all_reduce_op, same, order, "sum", gid)
        both(f"all_reduce_bf16/{kind}", hred._all_reduce_op, same.to(torch.bfloat16), order, "mean",
             gid)
        both(f"all_reduce_max/{kind}", hred._all_reduce_op, same, order, "max", gid)
        both(f"all_reduce_min_bf16/{kind}", hred._all_reduce_op, same.to(torch.bfloat16), order, "min", gid)
        flat = {"contiguous": same.reshape(-1), "channels_last": same.reshape(-1),
                "slice": same.reshape(-1)[::3]}[kind]  # a replicated sum takes a 1-d float64 buffer
        both(f"replicated_sum/{kind}", hred._replicated_sum_op, flat, order, gid)
        w, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
        count = [3 * n * x.shape[-1] for n in (9, 8)]
        both(f"group_norm/{kind}", hn._gn_op, x, w, b, order, 2, 1e-5, count, gid)
        stats = hn._gn_op(x, w, b, order, 2, 1e-5, count, gid)[3:]
        gy = torch.randn_like(x)
        both(f"group_norm_backward/{kind}", hn._gn_backward_op, gy, x, w, *stats, order, 2, float(sum(count)), gid,
             True, True, torch.float64)
        key = torch.tensor([12345], dtype=torch.int64)
        n = x.shape[-2] * x.shape[-1]
        both(f"philox_dropout/{kind}", hr._dropout_op, x, key, n, n, 0, 0, 1 << 30, 2.0)
    both("philox_bits", hr._bits_op, torch.tensor([7], dtype=torch.int64), 40, 8, 8, 0, 0, 1)
    return out


@pytest.fixture(scope="module")
def strides() -> list[dict]:
    return run_on_ranks(_strides_on_rank, 2, timeout=180)


OPS = ["exchange", "exchange_adjoint", "exchange_halos", "exchange_halos_adjoint",
       "all_reduce", "all_reduce_bf16", "all_reduce_max", "all_reduce_min_bf16",
       "replicated_sum", "group_norm", "group_norm_backward", "philox_dropout"]


@pytest.mark.parametrize("kind", ["contiguous", "channels_last", "slice"])
@pytest.mark.parametrize("op", OPS)
def test_fake_kernel_strides_are_the_real_ones(strides: list[dict], op: str, kind: str) -> None:
    for rank, res in enumerate(strides):
        real, fake = res[f"{op}/{kind}"]
        assert real == fake, f"rank {rank}: halo::{op} on a {kind} input: real (shape, stride, dtype) {real}, " \
                             f"fake {fake}"


def test_fake_kernel_strides_philox_bits(strides: list[dict]) -> None:
    for res in strides:
        real, fake = res["philox_bits"]
        assert real == fake


def test_exchange_keeps_channels_last(strides: list[dict]) -> None:
    """The extended shard of a channels_last input is channels_last (as the conv that reads it would want)."""
    for res in strides:
        (shape, stride, _), = res["exchange/channels_last"][0]
        assert stride == torch.empty(shape, memory_format=torch.channels_last).stride()


def test_communicating_ops_are_ordered_effects() -> None:
    from torch._higher_order_ops.effects import _get_effect

    import halo.nn  # noqa: F401 - registers halo::group_norm

    for op in ("halo::exchange", "halo::exchange_adjoint", "halo::exchange_halos", "halo::exchange_halos_adjoint",
               "halo::exchange_halos_2d", "halo::exchange_halos_2d_adjoint", "halo::all_reduce", "halo::replicated_sum",
               "halo::group_norm", "halo::group_norm_backward"):
        assert _get_effect(op) is not None, op


# -- the order of posting under torch.compile ---------------------------------------------------------------------

def _order_on_rank(rank: int, world: int, backend: str) -> dict:
    import torch._dynamo

    import halo
    import halo.exchange as hx
    import halo.nn.norm as hn
    import halo.parallel.reduce as hred
    from halo.plan.partition import split_offsets

    manager = halo.initialize_domain_parallel(world, world)
    log: list = []
    start = hx.Exchanger.start
    start_adjoint = hx.Exchanger.start_adjoint

    def logged_start(self, x):
        log.append(("exchange", self.plan.before.__len__(), self.plan.after.__len__(), tuple(x.shape[:2])))
        return start(self, x)

    def logged_adjoint(self, before, after, like):  # every adjoint posts here (pad-then-conv's and the patch's)
        log.append(("adjoint", tuple(like.shape[:2])))
        return start_adjoint(self, before, after, like)

    def logged_reduce(name):
        inner = getattr(name[0], name[1])

        def fn(t, info, what, *args, **kwargs):
            log.append(("all_reduce", what, tuple(t.shape)))
            return inner(t, info, what, *args, **kwargs)
        return fn

    hx.Exchanger.start, hx.Exchanger.start_adjoint = logged_start, logged_adjoint
    hred.bounded_all_reduce = logged_reduce((hred, "bounded_all_reduce"))
    hn.bounded_all_reduce = logged_reduce((hn, "bounded_all_reduce"))

    class Two(torch.nn.Module):
        """Independent chains: b's exchange and reduction do not depend on a's; a scheduler free to reorder by
        memory would see different sizes per rank (23 vs 22 rows, and a's chain is heavier than b's)."""

        def __init__(self) -> None:
            super().__init__()
            self.conv_a = torch.nn.Conv2d(4, 4, 5, padding=2)  # a halo of 2 rows
            self.conv_b = torch.nn.Conv2d(3, 3, 3, padding=1)  # a halo of 1 row
            self.gn = torch.nn.GroupNorm(2, 4)
            self.gn_b = torch.nn.GroupNorm(3, 3)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
            ea = self.conv_a(torch.sin(a) * 3 + a.square())
            eb = self.conv_b(b)
            # Two independent GroupNorms: each all-reduces its statistics (halo::group_norm and its backward).
            return ea, eb, self.gn(ea), self.gn_b(eb)

    from halo.nn import convert_to_domain_parallel

    torch.manual_seed(0)
    model = convert_to_domain_parallel(Two().double(), manager)
    compiled_model = torch.compile(model, backend=backend, fullgraph=True)

    def run(m, a, b):
        ea, eb, na, nb = m(a, b)
        return (ea * ea).sum() + (eb * eb).sum() + (na * na).sum() + (nb * nb * nb).sum()

    h, w = 45, 6
    offs = split_offsets(h, world)
    ga = torch.Generator().manual_seed(0)
    fa = torch.randn(2, 4, h, w, dtype=torch.float64, generator=ga)
    fb = torch.randn(2, 3, h, w, dtype=torch.float64, generator=ga)
    a0 = fa[..., offs[rank]:offs[rank + 1], :]
    b0 = fb[..., offs[rank]:offs[rank + 1], :]
    results = {}
    for name, m in (("eager", model), ("compiled", compiled_model)):
        for step in range(2 if name == "compiled" else 1):  # the second call: the compiled graph alone
            log.clear()
            a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
            # The second step reuses the graphs: the order token is one persistent tensor (no guard fails on it).
            with torch._dynamo.config.patch(error_on_recompile=step == 1):
                loss = run(m, a, b)
            forward = list(log)
            log.clear()
            loss.backward()
            results[name] = {"forward": forward, "backward": list(log), "loss": loss.item(),
                             "ga": a.grad, "gb": b.grad, "gp": [p.grad.clone() for p in model.parameters()]}
            model.zero_grad(set_to_none=True)
    # A rollout: two compiled forwards, then one backward (the backward's token is made in the backward, not saved
    # from the forward: a saved token would have changed version by the second forward, an autograd error).
    a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss = run(compiled_model, a, b) + run(compiled_model, a, b)
    loss.backward()
    results["rollout"] = {"loss": loss.item(), "ga": a.grad, "gb": b.grad,
                          "gp": [p.grad.clone() for p in model.parameters()]}
    results["token"] = hx.order_token(a0.device).tolist(), len(hx.order_devices())
    del manager
    return results


_ORDER: dict[str, list[dict]] = {}


def _order(backend: str) -> list[dict]:
    if backend not in _ORDER:
        _ORDER[backend] = run_on_ranks(_order_on_rank, 2, backend, timeout=400)
    return _ORDER[backend]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_communicating_ops_post_in_one_order_on_every_rank(backend: str) -> None:
    res = _order(backend)
    for r in res:
        eager, comp = r["eager"], r["compiled"]
        kinds = [e[0] for e in comp["forward"]]
        assert kinds.count("exchange") == 2 and kinds.count("all_reduce") == 2, comp["forward"]
        assert comp["loss"] == pytest.approx(eager["loss"], rel=1e-12)
        for k in ("ga", "gb"):
            assert torch.allclose(comp[k], eager[k], rtol=1e-12, atol=1e-12), k
        for p, q in zip(comp["gp"], eager["gp"], strict=True):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-12)
    # Every rank posted the same sequence (forward and backward): same kinds, same halo widths, same channels.
    assert res[0]["compiled"]["forward"] == res[1]["compiled"]["forward"]
    assert res[0]["compiled"]["backward"] == res[1]["compiled"]["backward"]


def test_aot_eager_keeps_program_order() -> None:
    """The ordered effect threads a token through the communicating ops: a's exchange, b's, a's GroupNorm, b's."""
    for r in _order("aot_eager"):
        assert r["compiled"]["forward"] == r["eager"]["forward"], (r["compiled"]["forward"], r["eager"]["forward"])


def test_inductor_keeps_program_order() -> None:
    """Without the order token, torch 2.13's ``reorder_for_peak_memory`` ran b's exchange and GroupNorm before a's
    (its memory-driven order ignores effect tokens; the order it picks depends on each rank's shard size)."""
    for r in _order("inductor"):
        assert r["compiled"]["forward"] == r["eager"]["forward"], (r["compiled"]["forward"], r["eager"]["forward"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_backward_posts_in_reverse_program_order(backend: str) -> None:
    """Backward: b's GroupNorm (3 groups), a's (2 groups), then the adjoints of b's exchange (3 channels) and a's (4):
    the reverse of the forward, on every rank."""
    want = [("all_reduce", "DomainGroupNorm (backward)", (2, 2, 3)),
            ("all_reduce", "DomainGroupNorm (backward)", (2, 2, 2)), ("adjoint", (2, 3)), ("adjoint", (2, 4))]
    for rank, r in enumerate(_order(backend)):
        assert r["compiled"]["backward"] == want, (rank, r["compiled"]["backward"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_two_compiled_forwards_then_one_backward(backend: str) -> None:
    """A rollout through the compiled model (twice the same step, one backward): twice the eager gradients."""
    for r in _order(backend):
        eager, roll = r["eager"], r["rollout"]
        assert roll["loss"] == pytest.approx(2 * eager["loss"], rel=1e-12)
        for k in ("ga", "gb"):
            assert torch.allclose(roll[k], 2 * eager[k], rtol=1e-12, atol=1e-12), k
        for p, q in zip(roll["gp"], eager["gp"], strict=True):
            assert torch.allclose(p, 2 * q, rtol=1e-12, atol=1e-12)


def test_order_token_is_one_untouched_tensor_per_device() -> None:
    """One token for the CPU, never written for real (``order_after`` only declares the write)."""
    for r in _order("inductor"):
        assert r["token"] == ([0], 1)
