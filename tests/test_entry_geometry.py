"""The global geometry is known, always (issue 30 items 1, 3's check, 7): a converted model knows the grid it runs on
and every rank checks, on every call, that each field it is given is its share; shard / gather / scatter and the
model's entry agree before they check, so a mistake on one rank only is the same error on every rank.

Cases, each refused on every rank with the grid, the expected local shape and the one got (or exact):

- the whole field on every rank: with ``grid=`` declared (local check), after a learned grid (every rank holds all
  its rows), and on the first call (the same non-constant values on every rank: a host fingerprint);
- a shard along W (``halo.shard(x, dim=-1)``: its spec names the dim; with ``grid=``: the shape), a ``(B, H, W, C)``
  tensor sharded with the default dim (with ``grid=``), a latitude shard fed to a 2x2 mesh model;
- a hand-cut split that is not the balanced share of any grid;
- ``gather`` of a gather's output, of a tensor every rank holds whole, of unbalanced pieces;
- ranks of one domain group holding different samples (``halo_sample_key``; ``shard`` of different fields);
- one rank only: another dtype, shape or argument at the model's entry, ``shard``, ``gather``, ``scatter``.

Exact cases (float64, forward and backward against the unsharded model in the same test; only copies and the
same convolutions per row, so the tolerance is 1e-12 for the conv's reordered sums): declared, learned and
shard-spec grids, a re-learned resolution, ``set_grid`` for an evaluation at another resolution.
"""

import pytest
import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks, run_on_ranks_outcomes

H, W, C = 9, 8, 3  # 9 rows over 2 ranks: 5 + 4
TOL = 1e-12


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.Tanh(), nn.Conv2d(C, C, 3, padding=1)).double()


def _full(h=H, w=W, seed=1):
    return torch.randn(2, C, h, w, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _rows(full, world, rank, dim=-2):
    offs = split_offsets(full.shape[dim], world)
    return full.narrow(dim, offs[rank], offs[rank + 1] - offs[rank]).clone()


def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the type and message are the outcome
        return f"{type(exc).__name__}: {exc}"


def _exact(model, ref, full, x, world, rank, gather):
    """max |forward - unsharded| and max |input grad - unsharded's rows| on this rank."""
    x = x.detach().requires_grad_(True)
    y = model(x)
    (y * y).sum().backward()  # the loss of this rank's rows; the unsharded one sums all rows
    X = full.clone().requires_grad_(True)
    Y = ref(X)
    (Y * Y).sum().backward()
    fwd = (gather(y.detach()) - Y.detach()).abs().max().item()
    return max(fwd, (x.grad - _rows(X.grad, world, rank)).abs().max().item())


def _one_d(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.root import set_grid

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(10)
    full = _full()
    mine = _rows(full, world, rank)
    out = {}

    def fresh(grid=None):
        return convert_to_domain_parallel(_net(), manager, grid=grid)

    # -- exact: declared, learned, a shard's spec; a new resolution learned; set_grid for an evaluation
    ref = _net()
    out["exact_declared"] = _exact(fresh((H, W)), ref, full, mine, world, rank, halo.gather)
    out["exact_learned"] = _exact(fresh(), ref, full, mine, world, rank, halo.gather)
    out["exact_spec"] = _exact(fresh(), ref, full, halo.shard(full), world, rank, halo.gather)
    model = fresh()
    model(mine)
    big = _full(13, W, 2)
    out["relearned"] = _exact(model, ref, big, _rows(big, world, rank), world, rank, halo.gather)
    model = fresh((H, W))
    out["declared_other_resolution"] = _outcome(lambda: model(_rows(big, world, rank)))
    set_grid(model, (13, W))
    out["set_grid"] = _exact(model, ref, big, _rows(big, world, rank), world, rank, halo.gather)
    out["set_grid_disagree"] = _outcome(lambda: set_grid(model, (13 + rank, W)))

    # -- the whole field on every rank
    out["whole_declared"] = _outcome(lambda: fresh((H, W))(full))
    model = fresh()
    model(mine)
    out["whole_after_learning"] = _outcome(lambda: model(full))
    out["whole_first_call"] = _outcome(lambda: fresh()(full))
    out["constant_first_call"] = _outcome(lambda: fresh()(torch.ones(2, C, 5, W, dtype=torch.float64)))

    # -- a shard along W; a (B, H, W, C) tensor sharded with the default dim
    out["w_shard_declared"] = _outcome(lambda: fresh((H, W))(_rows(full, world, rank, -1)))
    out["w_shard_spec"] = _outcome(lambda: fresh()(halo.shard(full, dim=-1)))
    bhwc = full.permute(0, 2, 3, 1).contiguous()
    out["bhwc_declared"] = _outcome(lambda: fresh((H, W))(halo.shard(bhwc)))

    # -- a hand-cut split (7 + 2 of 9 rows): no grid's balanced share (6 + 3 is one of whole 3-row blocks)
    cut = full[..., :7, :] if rank == 0 else full[..., 7:, :]
    out["hand_cut"] = _outcome(lambda: fresh()(cut.clone()))

    # -- gather: of a gather's output, of a whole tensor, of unbalanced pieces; a good one
    g = halo.gather(halo.shard(full))
    out["gather_good"] = torch.equal(g, full)
    out["gather_gathered"] = _outcome(lambda: halo.gather(g))
    out["gather_whole"] = _outcome(lambda: halo.gather(full.clone()))
    out["gather_uneven"] = _outcome(lambda: halo.gather(cut.clone()))

    # -- samples: different keys; shard of different fields; the same key passes
    for name, key in (("key_differs", f"2026-01-0{rank + 1}T00"), ("key_same", "2026-01-01T00")):
        x = mine.clone()
        x.halo_sample_key = key
        out[name] = _outcome(lambda x=x: fresh()(x))
    x = mine.clone()
    x.halo_sample_key = 7
    out["key_same_declared"] = _outcome(lambda: fresh((H, W))(x))
    x = mine.clone()
    x.halo_sample_key = 7 + rank
    out["key_differs_declared"] = _outcome(lambda: fresh((H, W))(x))
    out["shard_different_samples"] = _outcome(lambda: halo.shard(_full(seed=10 + rank)))

    # -- a second field input that is whole; two sample keys on one rank's inputs
    two = convert_to_domain_parallel(_Two(), manager)
    out["second_field_whole"] = _outcome(lambda: two(mine, full))
    a, b = mine.clone(), mine.clone()
    a.halo_sample_key, b.halo_sample_key = 1, 2
    out["two_keys"] = _outcome(lambda: convert_to_domain_parallel(_Two(), manager)(a, b))

    # -- a spec that does not match the shares (set by hand: halo's own shards cannot disagree with it)
    from halo.dist.comm import comm_group
    from halo.plan.entry import FieldSpec, set_spec

    ranks = comm_group(None).ranks
    x = mine.clone()
    set_spec(x, FieldSpec((2, C, 11, W), (2,), ranks, (world,)))
    out["spec_vs_shares"] = _outcome(lambda: fresh()(x))
    out["spec_vs_declared"] = _outcome(lambda: fresh((H, W))(x))
    out["gather_spec"] = _outcome(lambda: halo.gather(x))
    return out


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1).double()
        self.b = nn.Conv2d(C, C, 3, padding=1).double()

    def forward(self, x, forcing):
        return self.a(x) + self.b(forcing)


@pytest.fixture(scope="module")
def one_d():
    return run_on_ranks(_one_d, 2, timeout=300)


def _same_everywhere(results, key):
    got = [r[key] for r in results]
    assert all(g == got[0] for g in got), (key, got)
    return got[0]


def test_exact_with_every_source_of_the_grid(one_d):
    for rank, r in enumerate(one_d):
        for key in ("exact_declared", "exact_learned", "exact_spec", "relearned", "set_grid"):
            assert r[key] <= TOL, (rank, key, r[key])


def test_declared_grid_is_fixed_until_set_grid(one_d):
    msgs = [r["declared_other_resolution"] for r in one_d]
    assert "ValueError" in msgs[0] and "grid=(9, 8)" in msgs[0] and "expects 5 rows x 8 columns" in msgs[0]
    assert "got shape (2, 3, 7, 8)" in msgs[0], msgs
    assert "expects 4 rows x 8 columns" in msgs[1] and "got shape (2, 3, 6, 8)" in msgs[1], msgs
    msg = _same_everywhere(one_d, "set_grid_disagree")
    assert "set_grid: the ranks of the domain group pass different grids ((13, 8), (14, 8)" in msg, msg


def test_whole_field_is_refused_on_every_rank(one_d):
    msgs = [r["whole_declared"] for r in one_d]  # local: each rank names its own share
    for rank, m in enumerate(msgs):
        want = (5, 4)[rank]
        assert m.startswith("ValueError") and "grid=(9, 8)" in m and f"expects {want} rows x 8 columns" in m, m
        assert "got shape (2, 3, 9, 8)" in m, m
    msg = _same_everywhere(one_d, "whole_after_learning")
    assert "every rank of the domain group holds all rows of the model's grid (9, 8) (learned)" in msg, msg
    assert "on group rank 0 (global 0)), got 9 x 8" in msg, msg
    msg = _same_everywhere(one_d, "whole_first_call")
    assert "every rank of the domain group holds the same values (9 x 8" in msg, msg
    assert _same_everywhere(one_d, "constant_first_call") == "ok"  # constant shares: no verdict from values


def test_w_shard_and_channels_last_are_refused(one_d):
    for rank, r in enumerate(one_d):
        want = (5, 4)[rank]
        assert f"expects {want} rows x 8 columns" in r["w_shard_declared"], r["w_shard_declared"]
        assert "got shape (2, 3, 9, 4)" in r["w_shard_declared"], r["w_shard_declared"]
        assert f"expects {want} rows x 8 columns" in r["bhwc_declared"], r["bhwc_declared"]
        assert "got shape (2, 9, 4, 3)" in r["bhwc_declared"], r["bhwc_declared"]
    msg = _same_everywhere(one_d, "w_shard_spec")
    assert "is a shard (halo.shard) along dim -1" in msg and "the model shards dims -2" in msg, msg


def test_hand_cut_split_is_refused(one_d):
    msg = _same_everywhere(one_d, "hand_cut")
    assert "not the shares of any one grid along dim -2" in msg and "[7, 2]" in msg and "[5, 4]" in msg, msg


def test_gather_refuses_what_is_not_a_shard(one_d):
    assert all(r["gather_good"] for r in one_d)
    msg = _same_everywhere(one_d, "gather_gathered")
    assert "gather: x is already whole and the same on every rank (the output of halo.gather" in msg, msg
    msg = _same_everywhere(one_d, "gather_whole")
    assert "every rank of the group holds the same values" in msg and "18 rows along dim -2 instead of 9" in msg
    msg = _same_everywhere(one_d, "gather_uneven")
    assert "not the shares of one tensor along dim -2" in msg and "[7, 2]" in msg, msg


def test_ranks_looking_at_different_samples_are_refused(one_d):
    msg = _same_everywhere(one_d, "key_differs")
    assert "ranks 0,1 of the domain group are looking at different samples" in msg, msg
    assert "'2026-01-01T00', '2026-01-02T00'" in msg and "DistributedSampler(num_replicas=dp_size" in msg, msg
    msg = _same_everywhere(one_d, "key_differs_declared")  # a key makes a declared-grid entry agree
    assert "looking at different samples: keys [7, 8]" in msg, msg
    assert _same_everywhere(one_d, "key_same") == "ok" and _same_everywhere(one_d, "key_same_declared") == "ok"
    msg = _same_everywhere(one_d, "shard_different_samples")
    assert "shard: ranks 0,1 of the domain group are looking at different samples: fingerprints" in msg, msg


def test_every_field_input_and_spec_is_checked(one_d):
    msg = _same_everywhere(one_d, "second_field_whole")
    assert "on group rank 0 (global 0) (and group ranks [1] (global [1])): input 1 of shape (2, 3, 9, 8) is a " \
        "field" in msg and "where the first field holds (5, 8)" in msg, msg
    msg = _same_everywhere(one_d, "two_keys")
    assert "its inputs carry different sample keys [1, 2]" in msg, msg
    msg = _same_everywhere(one_d, "spec_vs_shares")
    assert "the inputs are shards (halo.shard) of a 11 x 8 field, but the ranks' shares add up to 9 x 8" in msg, msg
    for r in one_d:
        assert "is a shard (halo.shard) of a field of shape (2, 3, 11, 8), but the model was converted with " \
            "grid=(9, 8)" in r["spec_vs_declared"], r["spec_vs_declared"]
    msg = _same_everywhere(one_d, "gather_spec")
    assert "x is a shard (halo.shard) of a field of 11 along dim -2, but the ranks' extents [5, 4] add up to 9" in msg


def _one_rank_only(rank, world):
    """Every entry point given a bad shape, dtype or argument on ONE rank: each rank's message, in order."""
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(10)
    full = _full()
    mine = _rows(full, world, rank)
    odd = rank == world - 1
    model = convert_to_domain_parallel(_net(), manager)
    model(mine)  # learned
    attempts = {
        "entry_dtype": lambda: model(mine.float() if odd else mine),
        "entry_shape": lambda: model(mine[:1] if odd else mine),
        "entry_step_arg": lambda: convert_to_domain_parallel(_Step(), manager)(mine, 3 + odd),
        "entry_w": lambda: model(_rows(_full(w=W + 2 * odd), world, rank)),
        "shard_dtype": lambda: halo.shard(full.float() if odd else full),
        "shard_shape": lambda: halo.shard(full[:1] if odd else full),
        "gather_dtype": lambda: halo.gather(mine.float() if odd else mine),
        "gather_shape": lambda: halo.gather(mine[:1] if odd else mine),
        "scatter_dim": lambda: halo.scatter(full if rank == 0 else None, dim=-1 if odd else -2),
        "scatter_granularity": lambda: halo.scatter(full if rank == 0 else None, granularity=1 + odd),
    }
    out = {name: _outcome(fn) for name, fn in attempts.items()}
    out["after"] = _exact(model, _net(), full, mine, world, rank, halo.gather)  # the group is still in step
    return out


class _Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1).double()

    def forward(self, x, step):
        return self.conv(x) * step


def test_one_rank_only_is_one_error_everywhere():
    outcomes = run_on_ranks_outcomes(_one_rank_only, 3, timeout=240, pg_timeout=60)
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    results = [res for _, res in outcomes]
    want = {"entry_dtype": "disagree on the dtype of input 0", "entry_shape": "disagree on the shape of input 0",
            "entry_step_arg": "disagree on input 1", "entry_w": "disagree on the shape",
            "shard_dtype": "the ranks of the group disagree on the dtype", "shard_shape": "disagree on the shape",
            "gather_dtype": "disagree on the dtype", "gather_shape": "disagree on the shape",
            "scatter_dim": "pass different (src, dim, granularity): [(0, -2, 1), (0, -2, 1), (0, -1, 1)]",
            "scatter_granularity": "pass different (src, dim, granularity)"}
    for key, text in want.items():
        msg = _same_everywhere(results, key)
        assert msg.startswith("ValueError") and text in msg, (key, msg)
    assert "group rank 2 (global 2)" in results[0]["entry_dtype"], results[0]["entry_dtype"]
    assert all(r["after"] <= TOL for r in results), [r["after"] for r in results]


def _declared_one_rank(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(3)
    full = _full()
    model = convert_to_domain_parallel(_net(), manager, grid=(H, W))
    model(_rows(full, world, rank))
    model(_rows(full, world, rank, -1) if rank == 1 else _rows(full, world, rank))  # rank 1: a W shard


def test_declared_grid_one_rank_wrong_is_bounded_and_named():
    """With grid= the check is local (no communication per call): the wrong rank raises at once, expected vs got;
    its peer waits in the first exchange and raises within the timeout, naming it."""
    outcomes = run_on_ranks_outcomes(_declared_one_rank, 2, timeout=120, pg_timeout=60)
    (k0, m0), (k1, m1) = outcomes
    assert k1 == "error" and m1.startswith("ValueError") and "expects 4 rows x 8 columns" in m1, outcomes[1]
    assert "got shape (2, 3, 9, 4)" in m1, m1
    assert k0 == "error" and m0.startswith("HaloCommError") and "global rank 1" in m0, outcomes[0]


def _mesh(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    mesh = halo.DomainMesh((2, 2))
    halo.set_timeout(10)
    full = _full(H, 10)
    ref = _net()
    out = {}
    model = convert_to_domain_parallel(_net(), mesh)

    def gather(t):
        return halo.gather_2d(t, mesh=mesh)

    x = halo.shard_2d(full, mesh=mesh)
    y = model(x)
    out["exact"] = (gather(y.detach()) - ref(full).detach()).abs().max().item()
    out["rows_only"] = _outcome(lambda: model(halo.shard(full, group=mesh.axis_group(0))))
    out["whole"] = _outcome(lambda: model(full))
    rows = halo.shard(full, group=mesh.axis_group(0)).detach().clone()  # a plain latitude shard, all columns
    out["rows_only_plain"] = _outcome(lambda: model(rows))
    block = x.detach()[..., :-1, :].clone() if rank == 1 else x.detach().clone()  # mesh row 0: 3 and 2 rows
    out["not_tiling"] = _outcome(lambda: model(block))
    return out


def test_mesh_blocks_are_checked_on_both_axes():
    results = run_on_ranks(_mesh, 4, timeout=240)
    assert all(r["exact"] <= TOL for r in results), [r["exact"] for r in results]
    msg = _same_everywhere(results, "rows_only")
    assert "is a shard (halo.shard) along dim -2 over global ranks" in msg and "dims -2, -1" in msg, msg
    msg = _same_everywhere(results, "whole")
    assert "holds all rows and columns of the model's grid (9, 10)" in msg, msg
    msg = _same_everywhere(results, "rows_only_plain")
    assert "holds all columns of the model's grid (9, 10)" in msg, msg
    msg = _same_everywhere(results, "not_tiling")
    assert "the ranks' blocks do not tile one grid: group rank 0 (global 0) holds 5 x 5, group rank 1 (global 1) " \
        "holds 4 x 5" in msg, msg


# -- one process: the pieces ----------------------------------------------------------------------------------

def test_fingerprint_reads_a_strided_subsample_of_host_tensors_only():
    from halo.plan.entry import fingerprint

    x = torch.randn(2, 3, 721, 1440)
    a, const = fingerprint(x)
    assert a and not const
    assert fingerprint(x.clone())[0] == a  # the same values: the same digest
    y = x.clone()
    y[0, 0, 0, 0] += 1  # a sampled element (index 0 of every dim) changes it
    assert fingerprint(y)[0] != a
    assert fingerprint(x[..., :720, :])[0] != a  # the shape is part of it
    assert fingerprint(torch.zeros(2, 3, 5, 4))[1] and fingerprint(torch.zeros(0, 3))[0] == 0
    assert fingerprint(x.to(torch.bfloat16))[0] and fingerprint(x.contiguous(memory_format=torch.channels_last))[0] == a
    meta = torch.empty(2, 3, 5, 4, device="meta")
    assert fingerprint(meta) == (0, True)  # off the host: never read


def test_set_grid_refuses_what_is_not_a_converted_model_or_a_grid():
    from halo.nn.root import _check_grid, set_grid
    from halo.plan.entry import known_grid

    with pytest.raises(ValueError, match="is not a converted model"):
        set_grid(nn.Conv2d(1, 1, 1), (4, 4))
    with pytest.raises(ValueError, match=r"set_grid: grid must be \(H, W\), two positive ints, got \(4, 0\)"):
        _check_grid((4, 0), "set_grid")
    assert known_grid(nn.Conv2d(1, 1, 1)) is None


def _data_parallel(rank, world):
    """2 domain groups x 2 ranks: each domain group its own sample (allowed), or one group's ranks two (refused)."""
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, 2)
    halo.set_timeout(10)
    dp, dr = manager.dp_rank, manager.domain_rank
    ref = _net()
    full = _full(seed=100 + dp)  # this domain group's sample
    out = {"exact": _exact(convert_to_domain_parallel(_net(), manager), ref, full, halo.shard(full), 2, dr,
                           halo.gather)}
    x = _rows(full, 2, dr)
    x.halo_sample_key = dp
    out["keyed"] = _outcome(lambda: convert_to_domain_parallel(_net(), manager)(x))
    y = _rows(full, 2, dr)
    y.halo_sample_key = dp if dp == 0 else 10 + dr  # group 1's ranks: two samples
    out["stitched"] = _outcome(lambda: convert_to_domain_parallel(_net(), manager)(y))
    return out


def test_samples_are_compared_within_a_domain_group_only():
    results = run_on_ranks(_data_parallel, 4, timeout=240)
    assert all(r["exact"] <= TOL and r["keyed"] == "ok" for r in results), results
    assert [r["stitched"] for r in results[:2]] == ["ok", "ok"], results
    for r in results[2:]:
        assert "ranks 0,1 of the domain group are looking at different samples: keys [10, 11]" in r["stitched"], r


def _declared_grid_cadence(rank, world):
    """A model converted with grid= fed halo.shard outputs (the README's loop): its entry compares the samples at
    the first call and every check_every()-th, not every call; a key that differs is named within that many."""
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(30)
    model = convert_to_domain_parallel(_net(), manager, grid=(H, W))
    x_local = halo.shard(_full())
    counts = []
    for _ in range(17):
        with HostWorkCounter() as counter:
            model(x_local)
        counts.append(counter.summary().get("agreement", 0))
    y = _full().clone()
    y.halo_sample_key = 100 + rank  # a sampler that splits the domain group, from now on
    y_local = _rows(y, world, rank)
    y_local.halo_sample_key = y.halo_sample_key
    calls = 0
    try:
        while calls < 8:
            calls += 1
            model(y_local)
        return counts, "not refused"
    except ValueError as exc:
        return counts, (calls, str(exc))


def test_declared_grid_entry_compares_samples_every_nth_call():
    results = run_on_ranks(_declared_grid_cadence, 2, timeout=120)
    for counts, refused in results:
        # calls 1-2 learn the layers' plans; then only calls 9 and 17 agree (the entry's sample check), none else
        assert counts[0] >= 1 and counts[2:] == [0] * 6 + [1] + [0] * 7 + [1], counts
        calls, msg = refused
        assert calls == 8 and "looking at different samples: keys [100, 101]" in msg, refused  # call 25 (8 x 3 + 1)
    assert results[0][1] == results[1][1]
