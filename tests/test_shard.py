"""shard / scatter / gather on gloo ranks against torch.tensor_split and the unsharded computation.

Exactness: these ops only copy values (forward, and backward of shard, scatter and gather-to-dst), so float64
results are compared exactly; gather's backward averages the ranks' gradients (a sum, then a division by P),
so it is compared to the mean with a relative tolerance of 1e-14. Dot-product tests use the inner products of
halo.shard's docstring (sharded: sum over ranks; replicated: mean over ranks, i.e. counted once) and sum
float64 products of up to 10^5 terms in different orders: relative tolerance 1e-12.
"""

import os

import pytest
import torch

from halo.testing import run_on_ranks

SHAPES = [((1, 2, 721, 65), -2), ((2, 3, 33, 65), -1), ((3, 33, 65), -2), ((1, 2, 3, 33, 65), -2),
          ((1, 2, 3, 33, 65), -1), ((2, 1, 5, 4), -2)]  # the last: H=5 leaves ranks 5 and 6 of 7 empty


def _dot(a, b):
    return (a.detach() * b.detach()).sum().item()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _case(rank, world, shape, dim, seed, group, src, dst):
    from halo.shard import gather, scatter, shard

    d = dim % len(shape)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=gen, dtype=torch.float64)
    parts = torch.tensor_split(full, world, d)
    ys = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in parts]  # weights of each slice
    Ys = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(world)]  # of each full copy
    res = {}

    X = full.clone().requires_grad_(True)  # shard: replicated -> sharded
    s = shard(X, dim, group=group)
    res["shard_fwd"] = s.is_contiguous() and torch.equal(s, parts[rank])
    res["roundtrip"] = torch.equal(gather(s.detach(), dim, group=group), full)
    (s * ys[rank]).sum().backward()
    res["shard_grad"] = torch.equal(X.grad, torch.cat(ys, d))
    res["shard_dot"] = (_dot(s, ys[rank]), _dot(X, X.grad))

    x = parts[rank].clone().requires_grad_(True)  # gather: sharded -> replicated; each rank its own weights
    g = gather(x, dim, group=group)
    res["gather_fwd"] = torch.equal(g, full)
    (g * Ys[rank]).sum().backward()
    mean = torch.tensor_split(sum(Ys) / world, world, d)[rank]
    res["gather_grad"] = _rel(x.grad, mean) if x.numel() else 0.0
    res["gather_dot"] = (_dot(g, Ys[rank]), _dot(x, x.grad))

    Xs = full.clone().requires_grad_(True) if rank == src else None  # scatter: on src -> sharded
    sc = scatter(Xs, dim, src=src, group=group)
    res["scatter_fwd"] = sc.requires_grad and torch.equal(sc, parts[rank])
    (sc * ys[rank]).sum().backward()
    res["scatter_grad"] = Xs is None or torch.equal(Xs.grad, torch.cat(ys, d))
    res["scatter_dot"] = (_dot(sc, ys[rank]), _dot(Xs, Xs.grad) if Xs is not None else 0.0)

    x = parts[rank].clone().requires_grad_(True)  # gather to dst: sharded -> on dst; the others add 0
    gd = gather(x, dim, group=group, dst=dst)
    here = rank == dst
    res["gather_to_fwd"] = torch.equal(gd, full) if here else gd.numel() == 0
    (gd * Ys[0]).sum().backward() if here else gd.sum().backward()
    res["gather_to_grad"] = torch.equal(x.grad, torch.tensor_split(Ys[0], world, d)[rank])
    res["gather_to_dot"] = (_dot(gd, Ys[0]) if here else 0.0, _dot(x, x.grad))

    # A chain against the unsharded computation: shard -> local nonlinear op -> gather -> the same loss on
    # every rank (counted once) must give the one-device gradient.
    w = torch.cat(ys, d)
    X = full.clone().requires_grad_(True)
    h = gather(torch.sin(shard(X, dim, group=group)) * ys[rank], dim, group=group)
    (h ** 2 * Ys[0]).sum().backward()
    Xr = full.clone().requires_grad_(True)
    hr = torch.sin(Xr) * w
    (hr ** 2 * Ys[0]).sum().backward()
    res["chain_fwd"] = torch.equal(h, hr.detach())
    res["chain_grad"] = _rel(X.grad, Xr.grad)
    return res


def _ranks(rank, world, cases):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    halo.initialize_domain_parallel(world, world)
    return [_case(rank, world, shape, dim, seed, None, 1, world - 1) for shape, dim, seed in cases]


def _check(results, cases, world, group_size=None):
    """``results[r][i]``: rank r's measurements of case i; groups of ``group_size`` consecutive ranks."""
    p = group_size or world
    for i, case in enumerate(cases):
        for g0 in range(0, world, p):
            per = [results[r][i] for r in range(g0, g0 + p)]
            for key in ("shard_fwd", "roundtrip", "shard_grad", "gather_fwd", "scatter_fwd", "scatter_grad",
                        "gather_to_fwd", "gather_to_grad", "chain_fwd"):
                assert all(r[key] for r in per), (case, key, [r[key] for r in per])
            # mean of P equal gradients = (sum of P) / P rounds in the last bits
            assert max(r["gather_grad"] for r in per) <= 1e-14, (case, [r["gather_grad"] for r in per])
            assert max(r["chain_grad"] for r in per) <= 1e-14, (case, [r["chain_grad"] for r in per])
            # <A x, y> = <x, A^T y> with each side measured in its space's inner product
            shard_rhs = {r["shard_dot"][1] for r in per}  # replicated input gradient: the same on every rank
            assert len(shard_rhs) == 1, (case, shard_rhs)
            pairs = {
                "shard": (sum(r["shard_dot"][0] for r in per), shard_rhs.pop()),
                "gather": (sum(r["gather_dot"][0] for r in per) / p, sum(r["gather_dot"][1] for r in per)),
                "scatter": (sum(r["scatter_dot"][0] for r in per), sum(r["scatter_dot"][1] for r in per)),
                "gather_to": (sum(r["gather_to_dot"][0] for r in per), sum(r["gather_to_dot"][1] for r in per)),
            }
            for name, (lhs, rhs) in pairs.items():
                assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (case, name, lhs, rhs)


@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_shard_scatter_gather_match_tensor_split_and_are_adjoint(world):
    cases = [(shape, dim, 10 * world + i) for i, (shape, dim) in enumerate(SHAPES)]
    _check(run_on_ranks(_ranks, world, cases, timeout=240), cases, world)


def _gradcheck(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.shard import gather, shard
    halo.initialize_domain_parallel(world, world)
    # Replicated -> replicated, every rank in lock step on the same input, so the local finite differences
    # see the whole map (a sharded input would be perturbed on every rank at once and mislead them).
    x = torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weights = torch.arange(1.0, 25.0, dtype=torch.float64).reshape(x.shape)
    out = []
    for dim in (-2, -1):  # H = 4 over 3 ranks: 2, 1, 1; W = 3: 1, 1, 1
        w = torch.tensor_split(weights, world, dim)[rank]
        out.append(torch.autograd.gradcheck(lambda t, dim=dim, w=w: gather(torch.sin(shard(t, dim)) * w, dim),
                                            (x.clone().requires_grad_(True),)))
    return out


def test_gradcheck_shard_then_gather():
    assert run_on_ranks(_gradcheck, 3, timeout=240) == [[True, True]] * 3


def _formats(rank, world):
    """shard and gather of channels_last (4-d) and channels_last_3d (5-d) fields along H: the results keep the
    input's memory format (as torch's slicing and cat do: a channels_last model's shards and gathered outputs are
    channels_last, as the unsharded model's tensors are) and their values."""
    import halo
    from halo.shard import gather, shard
    halo.initialize_domain_parallel(world, world)
    out = []
    for shape, fmt in (((2, 3, 7, 5), torch.channels_last), ((2, 3, 2, 7, 5), torch.channels_last_3d),
                       ((2, 3, 7, 5), torch.contiguous_format)):
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x = x.contiguous(memory_format=fmt)
        local = shard(x, -2)
        whole = gather(local, -2)
        out.append((local.is_contiguous(memory_format=fmt), whole.is_contiguous(memory_format=fmt),
                    torch.equal(local, torch.tensor_split(x, world, -2)[rank]), torch.equal(whole, x)))
    return out


def test_shard_and_gather_keep_the_memory_format():
    for res in run_on_ranks(_formats, 2, timeout=240):
        assert res == [(True, True, True, True)] * 3, res


def _ranks_2d(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh
    from halo.shard import gather_2d, scatter_2d, shard_2d

    res = {}
    # 1-D domain groups [0, 1, 2] and [3, 4, 5] (dp = 2): a group that does not contain global rank 0
    mesh = DomainMesh((3,))
    i = mesh.axis_rank(0)
    res["1d"] = [_case(i, 3, shape, dim, 100 + mesh.dp_rank, mesh.domain_group, 1, 0)
                 for shape, dim in [((2, 3, 33, 65), -2), ((3, 33, 65), -1)]]

    mesh = DomainMesh((2, 3), periodic=(False, True))
    h, w = mesh.axis_rank(0), mesh.axis_rank(1)
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2, 3, 33, 65, generator=gen, dtype=torch.float64)
    block = torch.tensor_split(torch.tensor_split(full, 2, -2)[h], 3, -1)[w]
    y = torch.randn(block.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    Y = torch.randn(full.shape, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)

    X = full.clone().requires_grad_(True)
    s = shard_2d(X, mesh=mesh)
    (s * y).sum().backward()
    res["shard"] = (torch.equal(s, block), _dot(s, y), _dot(X, X.grad))

    x = block.clone().requires_grad_(True)
    g = gather_2d(x, mesh=mesh)
    (g * Y).sum().backward()
    res["gather"] = (torch.equal(g, full), _dot(g, Y), _dot(x, x.grad))

    Xs = full.clone().requires_grad_(True) if mesh.domain_rank == 4 else None
    sc = scatter_2d(Xs, src=4, mesh=mesh)
    (sc * y).sum().backward()
    res["scatter"] = (torch.equal(sc, block), _dot(sc, y), _dot(Xs, Xs.grad) if Xs is not None else 0.0)

    x = block.clone().requires_grad_(True)
    gd = gather_2d(x, mesh=mesh, dst=5)
    here = mesh.domain_rank == 5
    (gd * Y).sum().backward() if here else gd.sum().backward()
    res["gather_to"] = (torch.equal(gd, full) if here else gd.numel() == 0, _dot(gd, Y) if here else 0.0,
                        _dot(x, x.grad))
    try:
        gather_2d(block, mesh=mesh, dst=6)
    except ValueError as e:
        res["dst_error"] = str(e)
    return res


def test_1d_subgroups_and_2d_mesh():
    results = run_on_ranks(_ranks_2d, 6, timeout=240)
    one_d = [((2, 3, 33, 65), -2, 0), ((3, 33, 65), -1, 1)]
    _check([r["1d"] for r in results], one_d, 6, group_size=3)
    for name in ("shard", "gather", "scatter", "gather_to"):
        assert all(r[name][0] for r in results), (name, [r[name][0] for r in results])
    lhs = {"shard": sum(r["shard"][1] for r in results), "gather": sum(r["gather"][1] for r in results) / 6,
           "scatter": sum(r["scatter"][1] for r in results), "gather_to": sum(r["gather_to"][1] for r in results)}
    rhs = {"shard": results[0]["shard"][2], "gather": sum(r["gather"][2] for r in results),
           "scatter": sum(r["scatter"][2] for r in results), "gather_to": sum(r["gather_to"][2] for r in results)}
    assert len({r["shard"][2] for r in results}) == 1
    for name in lhs:
        assert abs(lhs[name] - rhs[name]) <= 1e-12 * max(1.0, abs(lhs[name])), (name, lhs[name], rhs[name])
    assert all("dst=6 is not a domain rank" in r["dst_error"] for r in results)


def _errors(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.shard import gather, scatter, shard
    halo.initialize_domain_parallel(world, world)
    x = torch.zeros(2, 3, 7, 5)
    attempts = [
        lambda: shard(x, dim=4),
        lambda: gather(x, dim=-5),
        lambda: gather(x, dst=3),
        lambda: gather(x, dst=-1),
        lambda: scatter(x, src=3),
        lambda: scatter(x if rank == 1 else None, dim=4, src=1),
        lambda: scatter(None, src=0),
        lambda: shard(torch.zeros(2, 3, 7 + (rank == 2), 5)),  # a rank whose field differs
        lambda: gather(torch.zeros(2, 3, 7, 5 + (rank == 1))),
        lambda: gather(torch.zeros(2, 3, 7, 5, dtype=torch.float64 if rank == 0 else torch.float32)),
    ]
    out = []
    for attempt in attempts:
        try:
            attempt()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    # the group is still in step afterwards
    out.append(torch.equal(gather(shard(x + 1.0)), x + 1.0))
    return out


def test_errors_are_raised_on_every_rank():
    results = run_on_ranks(_errors, 3, timeout=240)
    expected = ["shard: on every rank, dim 4 is out of range",
                "gather: on every rank, dim -5 is out of range", "dst=3 is not a rank of the group",
                "dst=-1 is not a rank", "src=3 is not a rank",
                "dim 4 is out of range for the 4-d tensor of shape (2, 3, 7, 5) on group rank 1",
                "group rank 0 (src, global 0) must pass a tensor", "extents along dim 2 differ: [7, 7, 8]",
                "the ranks of the group disagree", "the ranks of the group disagree"]
    for i, want in enumerate(expected):
        got = [r[i] for r in results]
        assert all(want in g for g in got), (want, got)
        if i == 7:
            assert len(set(got)) == 1  # the same message on every rank
    assert all(r[-1] is True for r in results)


def test_single_process_without_torch_distributed():
    from halo.shard import gather, scatter, shard

    x = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.equal(gather(shard(x)), x) and torch.equal(scatter(x, -1), x) and torch.equal(gather(x, dst=0), x)
    assert torch.autograd.gradcheck(lambda t: gather(torch.sin(scatter(t, -1)) * 2, -1, dst=0), (x,))
    assert torch.autograd.gradcheck(lambda t: gather(shard(t) ** 2), (x,))
