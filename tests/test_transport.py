"""The one transport (halo.dist.transport, issue 22 item 2) and the comm/exchange state in the context (item 1).

- (a) An AST scan: no halo module but ``halo/dist/transport.py`` (and the tools, the test harness) calls
  torch.distributed's communication functions or ``.wait()`` on a work handle. What still does is listed in
  :data:`EXPECTED`, with its reason; the list can only shrink (an entry that no longer occurs fails too).
- (b) post/wait on 2 and 3 gloo ranks, bf16 and float64, uneven messages (a ring both ways, a message to itself),
  bitwise; the exchange's adjoint passes the dot-product test and its forward equals the padded full field.
- (c) a wait on a peer that never posts: every waiting rank raises HaloCommError naming that peer within
  ``set_timeout``, nobody hangs.
- (d) ``halo.context.reset()`` between two calls of a converted model: the second call equals the first and the
  unsharded model, forward and backward (exchangers, groups, plans are made again); ``halo.context.use()`` starts
  empty and leaves the outer context as it was. The tables are bounded: an evicted or foreign id fails loudly.
"""

from __future__ import annotations

import ast
import os
import pathlib
import time

import pytest
import torch
import torch.nn.functional as F
from _helpers import run_allow_failures
from test_exchange import padded_reference
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
HALO = ROOT / "halo"

#: torch.distributed's communication functions (what only halo/dist/transport.py may call or pass on).
COMM_FUNCTIONS = frozenset({
    "isend", "irecv", "batch_isend_irecv", "P2POp", "send", "recv", "all_reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "barrier", "monitored_barrier", "gather", "scatter", "gather_object",
    "scatter_object_list", "all_to_all", "all_to_all_single",
})
#: Where direct calls are allowed: the transport itself, the tools (scripts, benchmarks), the test harness.
ALLOWED = ("halo/dist/transport.py", "halo/testing.py", "halo/tools/")

#: (file, what) -> why it is still there. May only shrink.
EXPECTED: dict[tuple[str, str], str] = {
    ("halo/launch.py", "dist.gather_object"): "used by the tools only: goes with the module into halo/tools",
}


def _dist_names(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to torch.distributed (``import torch.distributed as dist``) and to its functions (``from
    torch.distributed import all_reduce as ar``: alias -> name)."""
    modules: set[str] = set()
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed",
                                                                  "torch.distributed.distributed_c10d"):
            functions.update((a.asname or a.name, a.name) for a in node.names if a.name in COMM_FUNCTIONS)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return modules, functions


def _is_torch_distributed(node: ast.AST, modules: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in modules
    return (isinstance(node, ast.Attribute) and node.attr in ("distributed", "distributed_c10d")
            and (isinstance(node.value, ast.Name) and node.value.id == "torch"
                 or _is_torch_distributed(node.value, modules)))


def violations(path: pathlib.Path, root: pathlib.Path = ROOT) -> dict[tuple[str, str], str]:
    """Every use of a communication function of torch.distributed, and every ``.wait(...)`` call, in ``path``:
    (file, what) -> the first line."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    modules, functions = _dist_names(tree)
    found: dict[tuple[str, str], str] = {}
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in COMM_FUNCTIONS and _is_torch_distributed(node.value,
                                                                                                    modules):
            what = f"dist.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in functions:
            what = f"dist.{functions[node.id]}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait"
              and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "transport")):
            what = ".wait()"  # a work handle's (transport.wait is the one way to wait)
        if what is not None:
            found.setdefault((rel, what), f"{rel}:{node.lineno}")
    return found


def _scan() -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for path in sorted(HALO.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(ALLOWED):
            found.update(violations(path))
    return found


def test_nothing_but_the_transport_communicates():
    found = _scan()
    new = {k: v for k, v in found.items() if k not in EXPECTED}
    gone = [k for k in EXPECTED if k not in found]
    assert not new, ("communication outside halo/dist/transport.py (use halo.dist.transport, see "
                     "its module docstring):\n" + "\n".join(f"  {v}: {k[1]}" for k, v in sorted(new.items())))
    assert not gone, f"fixed, remove from EXPECTED: {gone}"


def test_the_scan_sees_every_form(tmp_path):
    """The scan cannot pass vacuously: each form of a direct call is found."""
    src = tmp_path / "halo" / "x.py"
    src.parent.mkdir()
    src.write_text("import torch\nimport torch.distributed as dd\nfrom torch.distributed import all_gather as ag\n"
                   "from torch import distributed\n"
                   "def f(t, g, w):\n    dd.all_reduce(t)\n    ops = [dd.P2POp(dd.isend, t, 1)]\n"
                   "    torch.distributed.broadcast(t, 0)\n    ag([t], t)\n    distributed.barrier()\n    w.wait()\n"
                   "    transport.wait(w)\n")
    found = {k[1] for k in violations(src, tmp_path)}
    assert found == {"dist.all_reduce", "dist.P2POp", "dist.isend", "dist.broadcast", "dist.all_gather",
                     "dist.barrier", ".wait()"}, found


# -- (b) post / wait and the exchange's adjoint on 2 and 3 ranks ---------------------------------------------------

def _ring(rank, world, dtype):
    """Each rank sends ``rank + 1`` rows to the next rank and ``rank + 2`` rows to the previous one (uneven), and a
    message to itself through post_rows; what arrives is bitwise what was sent."""
    import torch.distributed as dist

    from halo.dist import comm, transport

    cg = comm.comm_group(dist.group.WORLD)

    def rows(src, n, tag):
        base = torch.arange(n * 5, dtype=torch.float64).reshape(n, 5) / 7 + 100 * src + tag
        return base.to(dtype)

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    sends = [(nxt, rows(rank, rank + 1, 0)), (prv, rows(rank, rank + 2, 1))]
    bufs = [(prv, torch.full((prv + 1, 5), -1.0, dtype=dtype)), (nxt, torch.full((nxt + 2, 5), -1.0, dtype=dtype))]
    posted = transport.post(cg, "ring", sends, bufs)
    ok = bool(posted) and len(posted.works) > 0
    transport.wait(posted)
    transport.wait(posted)  # twice: a no-op
    ok &= torch.equal(bufs[0][1], rows(prv, prv + 1, 0)) and torch.equal(bufs[1][1], rows(nxt, nxt + 2, 1))
    # post_rows: consecutive slices, one of them to this rank itself (copied inline, not posted)
    send = torch.cat([rows(rank, 2, 2), rows(rank, 3, 3)])
    recv = torch.full((5, 5), -1.0, dtype=dtype)
    p = transport.post_rows(cg, "rows", send, [(rank, 2), (nxt, 3)], recv, [(rank, 2), (prv, 3)])
    transport.wait(p)
    ok &= torch.equal(recv[:2], rows(rank, 2, 2)) and torch.equal(recv[2:], rows(prv, 3, 3))
    empty = transport.post_rows(cg, "none", send, [(rank, 5)], recv, [(rank, 5)])
    ok &= not empty and torch.equal(recv, send)
    return ok


def _adjoint(rank, world):
    """<E x, y> = <x, E^T y> over the ranks (float64, uneven rows, circular and zeros), and E x = the padded full
    field's window: the exchange's backward is its exact adjoint."""
    import torch.distributed as dist

    from halo.dist import comm, transport
    from halo.exchange import halo_exchange

    cg = comm.comm_group(dist.group.WORLD)
    out = []
    for boundary, halo_ in (("circular", 2), ("zeros", (1, 3))):
        gen = torch.Generator().manual_seed(5)
        full = torch.randn(2, 3, 3 * world + 1, 6, generator=gen, dtype=torch.float64)
        offs = split_offsets(full.shape[-2], world)
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        ext = halo_exchange(x, halo_, group=dist.group.WORLD, boundary=boundary)
        b, a = (halo_, halo_) if isinstance(halo_, int) else halo_
        want = padded_reference(full, b, a, -2, boundary)[..., offs[rank]:offs[rank + 1] + b + a, :]
        y = torch.randn(ext.shape, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
        (ext * y).sum().backward()
        dots = torch.stack([(ext.detach() * y).sum(), (x.detach() * x.grad).sum()])
        transport.all_reduce(dots, cg, "dot products")
        out.append((torch.equal(ext.detach(), want), dots.tolist()))
    return out


def _transport_ranks(rank, world):
    return {"ring": [_ring(rank, world, d) for d in (torch.bfloat16, torch.float64)], "adjoint": _adjoint(rank, world)}


@pytest.mark.parametrize("world", [2, 3])
def test_post_wait_and_the_adjoint(world):
    for rank, res in enumerate(run_on_ranks(_transport_ranks, world, timeout=120)):
        assert res["ring"] == [True, True], (rank, res)
        for exact, (lhs, rhs) in res["adjoint"]:
            assert exact, rank
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (rank, lhs, rhs)


# -- (c) a wait on a missing peer: bounded, named on every waiting rank --------------------------------------------

TIMEOUT = 1.5


def _missing_peer(rank, world, marker):
    import torch.distributed as dist

    from halo.dist import comm, transport

    cg = comm.comm_group(dist.group.WORLD)
    if rank == world - 1:  # never posts; stays until every other rank has raised
        t0 = time.monotonic()
        while len(os.listdir(marker)) < world - 1 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        return "stayed away"
    comm.set_timeout(TIMEOUT)
    others = [r for r in range(world - 1) if r != rank]
    sends = [(r, torch.ones(3)) for r in others]
    recvs = [(r, torch.zeros(3)) for r in others] + [(world - 1, torch.zeros(3))]
    posted = transport.post(cg, "the test's messages", sends, recvs)
    t0 = time.monotonic()
    try:
        transport.wait(posted)
    except transport.HaloCommError as exc:
        open(os.path.join(marker, str(rank)), "w").close()
        return str(exc), time.monotonic() - t0, transport.abandoned()
    return "no error", time.monotonic() - t0, 0


def test_a_wait_on_a_missing_peer_names_it_on_every_rank(tmp_path):
    world = 3
    t0 = time.monotonic()
    results = run_allow_failures(_missing_peer, world, str(tmp_path), timeout=60.0, pg_timeout=30.0)
    assert time.monotonic() - t0 < 60
    assert results[world - 1] == ("ok", "stayed away"), results[world - 1]
    for rank in range(world - 1):
        status, (message, seconds, kept) = results[rank]
        assert status == "ok", results[rank]
        assert f"the test's messages: rank {rank} (group rank {rank} of {world}) timed out" in message, message
        assert "recv from global rank 2" in message and f"halo.set_timeout({TIMEOUT:g})" in message, message
        assert TIMEOUT - 0.05 <= seconds < TIMEOUT + 15, (rank, seconds)
        assert kept == 1, kept  # the buffers of the message given up on are kept alive


# -- (d) the state lives in the context --------------------------------------------------------------------------

class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular")
        self.norm = nn.GroupNorm(2, 4)
        self.b = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.b(F.gelu(self.norm(self.a(x))))


H, W = 11, 6


def _reset_between_calls(rank, world):
    import halo
    from halo import context
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_sum

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(_Net().double(), manager)
    full = torch.randn(2, 2, H, W, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weight = torch.randn(2, 2, H, W, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    offs = split_offsets(H, world)

    def step():
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        out = model(x)
        domain_sum(out * weight[..., offs[rank]:offs[rank + 1], :], group=manager.domain_group).backward()
        grads = [halo.parallel.all_reduce(p.grad.clone(), group=manager.domain_group) for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out.detach(), x.grad, grads

    first = step()
    context.reset()
    names_after_reset = context.current().names()
    halo.initialize_domain_parallel(world, world)  # the default manager went with the context
    second = step()
    names = context.current().names()
    # context.use(): a fresh context starts empty; the outer one is unchanged afterwards
    from halo.dist import comm, transport
    from halo.exchange import _registry as exchange_registry

    outer, outer_names = context.current(), context.current().names()
    outer_states = (comm._state(), exchange_registry._state(), transport._state())
    with context.use() as inner:
        fresh = inner.names()
        transport.set_timeout(7.0)
        third = step()
        inner_names = inner.names()
    same = context.current() is outer and context.current().names() == outer_names
    same &= (comm._state(), exchange_registry._state(), transport._state()) == outer_states
    same &= transport.get_timeout() is None
    return first, second, third, names_after_reset, names, fresh, inner_names, same


def test_reset_between_calls_and_a_fresh_context():
    world = 2
    torch.manual_seed(0)
    ref = _Net().double()
    full = torch.randn(2, 2, H, W, generator=torch.Generator().manual_seed(3), dtype=torch.float64).requires_grad_()
    weight = torch.randn(2, 2, H, W, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = ref(full)
    (out * weight).sum().backward()
    offs = split_offsets(H, world)
    for rank, res in enumerate(run_on_ranks(_reset_between_calls, world, timeout=180)):
        first, second, third, after_reset, names, fresh, inner_names, same = res
        assert after_reset == () and fresh == (), (after_reset, fresh)
        assert {"comm", "exchange", "transport"} <= set(names) and {"comm", "exchange"} <= set(inner_names), names
        assert same
        rows = slice(offs[rank], offs[rank + 1])
        for got in (first, second, third):
            o, gx, gp = got
            assert torch.equal(o, first[0]) and torch.equal(gx, first[1])  # the same after a reset, exactly
            assert all(torch.equal(a, b) for a, b in zip(gp, first[2], strict=True))
            torch.testing.assert_close(o, out.detach()[..., rows, :], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gx, full.grad[..., rows, :], rtol=1e-12, atol=1e-12)
            for a, p in zip(gp, ref.parameters(), strict=True):
                torch.testing.assert_close(a, p.grad, rtol=1e-11, atol=1e-12)


def test_ids_are_bounded_and_never_alias(monkeypatch):
    """Exchanger specs are an LRU of SPECS_CAP: an evicted id, or one of another context, fails loudly (never
    another plan's exchanger); group ids are held weakly and are unknown in a fresh context."""
    from halo import context
    from halo.dist import comm
    from halo.exchange import _registry as hx

    cg = comm.CommGroup(None, 2, 0, (0, 1))
    with context.use():
        monkeypatch.setattr(hx, "SPECS_CAP", 3)
        ids = [hx.exchanger_id(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", f"op{k}") for k in range(5)]
        assert len(set(ids)) == 5
        with pytest.raises(LookupError, match="unknown in this context"):
            hx.exchange_spec(ids[0])  # dropped: the least recently planned
        assert hx.exchange_spec(ids[4]).op == "op4"
        assert hx.exchanger_id(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", "op4") == ids[4]  # a planned one: kept
        again = hx.exchanger_id(cg, 2, (3, 3), ((-1, 4), (2, 7)), "zeros", "op0")
        assert again not in ids  # made again: a new id, never the old one
        gid = comm.group_id(cg)
        assert comm.group_by_id(gid) is cg and comm.group_id(cg) == gid
    with context.use():
        with pytest.raises(LookupError, match="names no group of this context"):
            comm.group_by_id(gid)
        with pytest.raises(LookupError):
            hx.exchange_spec(ids[4])
    with context.use():
        other = comm.CommGroup(None, 2, 1, (0, 1))
        g = comm.group_id(other)
        del other
        import gc

        gc.collect()
        with pytest.raises(LookupError):
            comm.group_by_id(g)  # its group is gone: the table does not keep it alive


def test_host_buffers_are_bounded():
    from halo import context
    from halo.dist import transport

    with context.use():
        cg = type("G", (), {"size": 2})()
        for width in range(transport.HOST_BUFFERS_CAP + 10):
            transport._host_buffers(cg, width)  # noqa: SLF001 - the bound of a private table
        assert len(transport._state().host_buffers) == transport.HOST_BUFFERS_CAP


# -- (d) ranks in different host collectives: the same clear error on every rank, the group still usable --------------

def _parted(rank, world):
    import torch.distributed as dist

    from halo.dist import comm, transport

    cg = comm.comm_group(dist.group.WORLD)
    comm.set_timeout(20)
    out = {}
    long_row = list(range(rank, rank + transport.FRAME_WORDS + 5))  # longer than a frame: a second gather
    out["long"] = transport.gather_words(long_row, cg, "the test's long row").tolist()
    for case in ("object", "length"):
        try:
            if case == "object":  # rank 0 agrees on a row while the others exchange objects
                if rank == 0:
                    transport.gather_words([7, 8, 9], cg, "the test's row")
                else:
                    transport.all_gather_object({"rank": rank}, cg, "the test's objects")
            else:  # the same verb, rows of other lengths (one of them past the frame)
                transport.gather_words([1] * (2 if rank else transport.FRAME_WORDS + 1), cg, "the test's rows")
            out[case] = "no error"
        except transport.HaloCollectiveMismatch as exc:
            out[case] = str(exc)
    out["after"] = transport.all_gather_object(rank, cg, "after")  # nothing half-sent: the group still works
    return out


def test_ranks_in_different_host_collectives_raise_alike():
    """A forward that branches on a shard's own rows sends ranks into different agreements: gloo aborts the process
    on a size mismatch (and could misread equal sizes). Framed host gathers make it one named error on every rank."""
    world = 3
    runs = run_on_ranks(_parted, world, timeout=120)
    from halo.dist import transport

    n = transport.FRAME_WORDS + 5
    for rank, res in enumerate(runs):
        assert res["long"] == [list(range(r, r + n)) for r in range(world)], rank
        assert "group rank 0: an agreement of 3 words, group rank 1: an exchange of objects" in res["object"], res
        assert f"group rank 0: an agreement of {transport.FRAME_WORDS + 1} words, group rank 1: an agreement of 2 " \
               f"words" in res["length"], res
        assert "branches on a shard's own size" in res["object"]
        assert res["after"] == list(range(world))
    # the same words on every rank (each names its own call first: "the test's row" / "the test's objects")
    assert len({r["object"].split(": ", 1)[1] for r in runs}) == 1
