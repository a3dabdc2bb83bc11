"""Reliability of halo_exchange: bad input, dead or stalled peers, NaN/Inf, long runs, unusual layouts.

Every case runs on gloo ranks whose functions *catch* what halo raises and return it, so the parent sees all
ranks together: an input error must give the same message on every rank (invariant 4: no rank waits alone),
a dead or stalled peer must make the survivors raise within the configured bound, naming the peer. Every
launch has a short run timeout, so a hang fails the test instead of stalling the suite.

Exactness: the exchange only copies rows, and its adjoint adds at most a few copies of a gradient row, so
forward values (NaN and Inf included) are compared bitwise and gradients to 1e-12 in float64, NaN positions
equal.
"""

from __future__ import annotations

import hashlib
import os
import re
import time

import pytest
import torch
from _helpers import run_allow_failures
from test_exchange import padded_reference

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

RUN_TIMEOUT = 60.0  # seconds for a whole launch: a hang fails here
HALO_TIMEOUT = 2.0  # halo.exchange.set_timeout in the fault tests
SLACK = 3.0  # scheduling slack on a shared 2-core machine (scaled up by a run's own slowness: see below)
BOUND_CAP = 12.0  # no load excuses more: well inside the process group's 30 s timeout of the fault tests


def _shard(full, world, rank, dim=-2):
    offs = split_offsets(full.shape[dim], world)
    return full.narrow(dim, offs[rank], offs[rank + 1] - offs[rank])


def _error(fn):
    """Run ``fn``; return ``(exception type name, message)`` or ``None`` if it did not raise."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent asserts on the text
        return type(exc).__name__, str(exc)
    return None


# -- 1. input validation: the same error on every rank, before any message is posted -----------------------

def _bad_input_cases(rank, world):
    import halo
    from halo.exchange import halo_exchange, halo_exchange_async

    def field(shape=(2, 3, 10, 6), dtype=torch.float32):
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)
        return _shard(full, world, rank)

    one = rank == 1  # the rank that gets the bad argument in the one-rank cases
    cases = {
        "no_manager": lambda: halo_exchange(field(), 1),
    }
    out = {name: _error(f) for name, f in cases.items()}
    halo.initialize_domain_parallel(world, world)
    x = field()
    cases = {
        "ndim_one_rank": lambda: halo_exchange(x[0] if one else x, 1),
        "ndim_zero": lambda: halo_exchange(torch.tensor(1.0), 1, dim=0),
        "ndim_too_many": lambda: halo_exchange(x.reshape(1, 1, 1, 1, 1, 2, 3, -1, 6) if one else x, 1),
        "dim_out_of_range": lambda: halo_exchange(x, 1, dim=4 if one else -2),
        "dim_differs": lambda: halo_exchange(x, 1, dim=-1 if one else -2),
        "halo_negative": lambda: halo_exchange(x, (-1, 2) if one else (1, 2)),
        "halo_malformed": lambda: halo_exchange(x, (1, 2, 3) if one else 1),
        "halo_differs": lambda: halo_exchange(x, 2 if one else 1),
        "halo_too_wide": lambda: halo_exchange(x, (1, 11)),
        "empty_shards": lambda: halo_exchange(_shard(torch.zeros(1, 1, 2, 4), world, rank), 1),
        "batch_differs": lambda: halo_exchange(torch.cat([x, x]) if one else x, 1),
        "channels_differ": lambda: halo_exchange(x[:, :2] if one else x, 1),
        "width_differs": lambda: halo_exchange(x[..., :5] if one else x, 1),
        "dtype_differs": lambda: halo_exchange(x.double() if one else x, 1),
        "device_differs": lambda: halo_exchange(x.to("meta") if one else x, 1),
        "grad_differs": lambda: halo_exchange(x.clone().requires_grad_(one), 1),
        "boundary_unknown": lambda: halo_exchange(x, 1, boundary="zero" if one else "zeros"),
        "boundary_differs": lambda: halo_exchange(x, 1, boundary="circular" if one else "zeros"),
        "pole_odd_width": lambda: halo_exchange(x[..., :5], 1, boundary="pole"),
        "pole_on_last_dim": lambda: halo_exchange(torch.zeros(2, 3, 4, 6), 1, dim=-1, boundary="pole"),
        "reflect_too_far": lambda: halo_exchange(x, 10, boundary="reflect"),
        "async_bad_boundary": lambda: halo_exchange_async(x, 1, boundary=3 if one else "zeros"),
    }
    out.update({name: _error(f) for name, f in cases.items()})
    # The group is still in step after all of that: a good exchange gives the padded field.
    full = torch.arange(2 * 3 * 10 * 6, dtype=torch.float32).reshape(2, 3, 10, 6)
    offs = split_offsets(10, world)
    want = padded_reference(full, 1, 1, -2, "zeros").narrow(-2, offs[rank], offs[rank + 1] - offs[rank] + 2)
    out["after"] = torch.equal(halo_exchange(x, 1), want)
    return out


# case -> (exception type, substrings every rank's message must contain)
BAD_INPUT = {
    "no_manager": ("RuntimeError", ["halo.initialize_domain_parallel(world_size, domain_parallel_size)"]),
    "ndim_one_rank": ("ValueError", ["disagree on the number of dims", "group rank 1 (global 1) has 3"]),
    "ndim_zero": ("ValueError", ["on every rank, expected a tensor with 1 to 8 dims, got 0 dims"]),
    "ndim_too_many": ("ValueError", ["on group rank 1 (global 1), expected a tensor with 1 to 8 dims, got 9 dims"]),
    "dim_out_of_range": ("ValueError", ["on group rank 1 (global 1), dim 4 is out of range for a 4-d tensor",
                                         "expected -4 <= dim <= 3"]),
    "dim_differs": ("ValueError", ["disagree on the sharded dim", "has dim=-2", "has dim=-1"]),
    "halo_negative": ("ValueError", ["on group rank 1 (global 1), halo must be non-negative, got (-1, 2)"]),
    "halo_malformed": ("ValueError", ["on group rank 1 (global 1), halo must be an int or a (before, after) "
                                       "pair of ints, got (1, 2, 3)"]),
    "halo_differs": ("ValueError", ["disagree on the halo: group rank 0 (global 0) has (1, 1), "
                                    "group rank 1 (global 1) has (2, 2)"]),
    "halo_too_wide": ("ValueError", ["a halo of 11 rows is wider than the whole domain (10 rows",
                                     "expected at most 10"]),
    "empty_shards": ("ValueError", ["group ranks [2] (global [2]) hold no rows", "use at most 2 ranks"]),
    "batch_differs": ("ValueError", ["disagree on the shape", "(2, 3, [4], 6)", "(4, 3, [3], 6)"]),
    "channels_differ": ("ValueError", ["disagree on the shape", "(2, 2, [3], 6)"]),
    "width_differs": ("ValueError", ["disagree on the shape", "(2, 3, [3], 5)",
                                     "only the extent along the sharded dim 2 may differ"]),
    "dtype_differs": ("ValueError", ["disagree on the dtype or device", "float32 on cpu", "float64 on cpu"]),
    "device_differs": ("ValueError", ["disagree on the dtype or device", "float32 on meta"]),
    "grad_differs": ("ValueError", ["disagree on whether the exchange records a backward",
                                    "group rank 1 (global 1) has an input that requires grad"]),
    "boundary_unknown": ("ValueError", ["on group rank 1 (global 1), unknown boundary 'zero'; expected one of "
                                        "zeros, replicate, reflect, symmetric, circular, periodic, pole, "
                                        "pole_centered"]),
    "boundary_differs": ("ValueError", ["disagree on the boundary", "'zeros'", "'circular'"]),
    "pole_odd_width": ("ValueError", ["pole boundary needs an even number of longitudes", "got W=5"]),
    "pole_on_last_dim": ("ValueError", ["cannot exchange the last dim itself"]),
    "reflect_too_far": ("ValueError", ["reflect boundary reaches 10 rows beyond the edge", "at most 9"]),
    "async_bad_boundary": ("ValueError", ["halo_exchange_async: on group rank 1 (global 1), unknown boundary '3'"]),
}


def _agreed(results, name):
    """Every rank's error for ``name`` (they must all be equal) or fail with all of them."""
    errors = [r[name] for r in results]
    assert all(e == errors[0] for e in errors), (name, errors)
    return errors[0]


def test_bad_input_same_error_on_every_rank():
    world = 3
    t0 = time.monotonic()
    results = run_on_ranks(_bad_input_cases, world, timeout=RUN_TIMEOUT, pg_timeout=10)
    assert time.monotonic() - t0 < RUN_TIMEOUT
    for name, (kind, parts) in BAD_INPUT.items():
        err = _agreed(results, name)
        assert err is not None, f"{name}: no error raised"
        assert err[0] == kind, (name, err)
        for part in parts:
            assert part in err[1], (name, part, err[1])
    assert all(r["after"] for r in results)


def _bad_input_2d(rank, world):
    import halo
    from halo.exchange import halo_exchange_2d

    out = {"no_mesh": _error(lambda: halo_exchange_2d(torch.zeros(1, 1, 4, 4), 1, 1))}
    mesh = halo.DomainMesh((2, 2))
    h, w = mesh.coords[1:]
    x = torch.zeros(1, 2, 5, 8)
    bad = rank == 3
    out["halo_w_one_rank"] = _error(lambda: halo_exchange_2d(x, 1, -1 if bad else 1, mesh=mesh))
    # A pole boundary works with W sharded (the rows across the pole are rolled around the whole circle), but
    # only for an even number of longitudes: 8 + 7 here.
    out["pole_odd_w"] = _error(lambda: halo_exchange_2d(x[..., :7] if w else x, 1, 1, mesh=mesh, boundary_h="pole"))
    out["w_extent_differs"] = _error(lambda: halo_exchange_2d(x[..., :7] if bad else x, 1, 1, mesh=mesh))
    full = torch.arange(4 * 10 * 16, dtype=torch.float64).reshape(1, 4, 10, 16)
    x = full.tensor_split(2, -2)[h].tensor_split(2, -1)[w]
    ext = halo_exchange_2d(x, 1, 2, mesh=mesh)
    want = torch.nn.functional.pad(full, (2, 2, 1, 1))[..., 5 * h:5 * h + 7, 8 * w:8 * w + 12]
    out["after"] = torch.equal(ext, want)
    return out


def test_bad_input_2d_same_error_on_every_rank():
    results = run_on_ranks(_bad_input_2d, 4, timeout=RUN_TIMEOUT, pg_timeout=10)
    err = _agreed(results, "no_mesh")
    assert err[0] == "RuntimeError" and "mesh=halo.DomainMesh((ph, pw))" in err[1]
    err = _agreed(results, "halo_w_one_rank")  # only rank 3's W group is wrong, yet all four ranks raise
    assert err[0] == "ValueError" and "on group rank 3 (global 3), halo must be non-negative, got (-1, -1)" in err[1]
    err = _agreed(results, "pole_odd_w")
    assert err[0] == "ValueError" and "even number of longitudes" in err[1] and "W=15" in err[1], err
    err = _agreed(results, "w_extent_differs")
    assert err[0] == "ValueError" and "group rank 3 (global 3) has shape (1, 2, [5], [7])" in err[1], err
    assert "dim 3 is sharded along axis 1" in err[1], err
    assert all(r["after"] for r in results)


# -- 2. dead and stalled peers: bounded, named ------------------------------------------------------------

def _run_allow_failures(fn, world, *args, timeout=RUN_TIMEOUT, pg_timeout=30.0):
    return run_allow_failures(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout)


def _faulty_sequence(rank, world, fault, steps, marker):
    """Exchange ``steps`` times; the faulty rank (the last) misbehaves at the last step. Survivors return
    ``(step, error type, message, seconds from the call to the error, seconds of the slowest healthy step)``
    and leave a file in ``marker``; a stalled rank stays away until every survivor has (so that it is their
    timeout that ends the wait). The healthy steps (the same exchange with the same peers, the first one with
    its agreement) measure how slow the machine is during this very run."""
    import torch.distributed as dist

    from halo import shard
    from halo.exchange import halo_exchange, set_timeout

    if fault != "stall_default":  # that one relies on the process group's timeout
        set_timeout(HALO_TIMEOUT)
    faulty = rank == world - 1
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4 * world + 1, 6, dtype=torch.float64)
    steady = fault.endswith("_steady")  # a shard halo made: after the first call, no agreement (halo.plan.plans)
    x = shard(x, group=dist.group.WORLD) if steady else _shard(x, world, rank)
    x.requires_grad_(fault == "skip_backward")
    slowest = 0.0
    for step in range(steps):
        last = step == steps - 1
        if faulty and last:
            if fault == "die":
                os._exit(7)
            if fault == "die_mid_exchange":  # after the agreement, instead of posting the messages
                dist.batch_isend_irecv = lambda ops: os._exit(7)
            if fault in ("stall", "stall_steady", "stall_default"):
                return _stay_away(marker, world)
        t0 = time.monotonic()
        halo = 3 if faulty and last and fault.startswith("changed_halo") else 2
        try:
            ext = halo_exchange(x, halo, group=dist.group.WORLD, boundary="circular")
            if fault == "skip_backward":
                if faulty and last:
                    return _stay_away(marker, world)
                t0 = time.monotonic()
                ext.sum().backward()
            slowest = max(slowest, time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001
            result = step, type(exc).__name__, str(exc), time.monotonic() - t0, slowest
            if faulty:
                _stay_away(marker, world)
                return result
            open(os.path.join(marker, str(rank)), "w").close()
            return result
    return "finished"


def _stay_away(marker, world, limit=30.0):
    t0 = time.monotonic()
    while len(os.listdir(marker)) < world - 1 and time.monotonic() - t0 < limit:
        time.sleep(0.05)
    return "stalled"


@pytest.mark.parametrize("fault, world, expect", [
    # dies before the call: the survivors' agreement fails (gloo names no rank: the group's are listed)
    ("die", 3, ["failed", "waiting on the agreement with global ranks {others}", "may have died"]),
    # dies after the agreement, instead of posting its messages: the survivors name it
    ("die_mid_exchange", 3, ["failed", "global rank 2", "may have died"]),
    ("stall", 2, ["timed out", "the agreement with global ranks [1]"]),  # never enters the call
    ("stall_default", 2, ["timed out", "bound: the process group's timeout", "global ranks [1]"]),
    ("stall_steady", 2, ["timed out", "global rank 1", "different collective"]),  # p2p only, no agreement
    ("skip_backward", 2, ["(backward)", "timed out", "recv from global rank 1"]),
    # in a steady state, one rank alone changes its halo: it agrees alone, its peer posts messages: both bounded
    ("changed_halo_steady", 2, ["timed out", "global rank 1"]),
])
def test_dead_or_stalled_peer_raises_within_the_bound(fault, world, expect, tmp_path):
    steps = 4
    t0 = time.monotonic()
    pg_timeout = HALO_TIMEOUT if fault == "stall_default" else 30.0  # else halo's own timeout must act first
    results = _run_allow_failures(_faulty_sequence, world, fault, steps, str(tmp_path), pg_timeout=pg_timeout)
    assert time.monotonic() - t0 < RUN_TIMEOUT
    faulty = results[-1]
    if fault == "changed_halo_steady":
        assert faulty[0] == "ok" and faulty[1][:2] == (steps - 1, "HaloCommError"), faulty
        assert "waiting on the agreement with global ranks [0]" in faulty[1][2], faulty
    else:
        assert faulty == (("died", 7) if fault.startswith("die") else ("ok", "stalled")), faulty
    for rank, (status, res) in enumerate(results[:-1]):
        assert status == "ok" and isinstance(res, tuple), (rank, status, res)
        step, kind, message, seconds, slowest = res
        assert step == steps - 1, (rank, res)
        assert kind == "HaloCommError", (rank, res)
        assert f"rank {rank} (group rank {rank} of {world}" in message, message
        for part in expect:
            part = part.format(others=[q for q in range(world) if q != rank])
            assert part in message, (part, message)
        # Within the bound: the wait's limit plus slack for scheduling, the slack scaled by how slow the machine
        # was in this run (its slowest healthy step: a loaded machine stretches both alike), never as much as a
        # broken bound would take (the process group's 30 s timeout, or a hang).
        assert seconds < HALO_TIMEOUT + min(SLACK + 10 * slowest, BOUND_CAP), (rank, seconds, slowest, message)
        waited = re.search(r"timed out after ([0-9.]+) s \(posted [0-9.]+ s ago; bound: halo.set_timeout", message)
        if waited:  # halo's own bound acted: the wait lasted its limit, neither less nor (but for scheduling) more
            waited = float(waited.group(1))
            assert HALO_TIMEOUT - 0.05 <= waited < HALO_TIMEOUT + min(1.0 + 10 * slowest, BOUND_CAP), \
                (rank, waited, slowest, message)



# -- all_gather_object (the slow path of agreements, the guard's and check's notes): bounded like every wait -------

OBJECT_TIMEOUT = 3.0


def _gather_objects(rank, world, stall, marker):
    """Rank ``world - 1`` stays away when ``stall`` (until the others are done): the others must raise within
    ``halo.set_timeout``; else every rank gathers objects of different pickled sizes, in group order."""
    import halo
    from halo.dist.comm import HaloCommError, all_gather_object, comm_group, set_timeout

    halo.initialize_domain_parallel(world, world)
    set_timeout(OBJECT_TIMEOUT)
    cg = comm_group(None)
    if stall and rank == world - 1:
        return _stay_away(marker, world)
    obj = {"rank": rank, "text": "x" * (100 * rank + 1), "mask": (True,) * rank, "t": torch.arange(rank + 2)}
    t0 = time.monotonic()
    try:
        got = all_gather_object(obj, cg, "the test's gather")
    except HaloCommError as exc:
        open(os.path.join(marker, str(rank)), "w").close()
        return "raised", str(exc), time.monotonic() - t0
    return "gathered", got, time.monotonic() - t0


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_object_gathers_in_group_order(world, tmp_path):
    for rank, (status, res) in enumerate(_run_allow_failures(_gather_objects, world, False, str(tmp_path))):
        assert status == "ok" and res[0] == "gathered", (rank, status, res)
        for r, obj in enumerate(res[1]):
            assert obj["rank"] == r and obj["text"] == "x" * (100 * r + 1) and obj["mask"] == (True,) * r
            assert torch.equal(obj["t"], torch.arange(r + 2))


def test_all_gather_object_is_bounded_by_set_timeout(tmp_path):
    """A rank that never joins: the other raises HaloCommError within ``set_timeout(3)`` (not the process group's
    30 s), naming itself, the rank it waited on and the bound."""
    t0 = time.monotonic()
    results = _run_allow_failures(_gather_objects, 2, True, str(tmp_path), pg_timeout=30.0)
    assert time.monotonic() - t0 < RUN_TIMEOUT
    assert results[1] == ("ok", "stalled"), results[1]
    status, (kind, message, seconds) = results[0]
    assert status == "ok" and kind == "raised", results[0]
    assert "the test's gather: rank 0 (group rank 0 of 2) timed out" in message, message
    assert "global ranks [1]" in message and f"halo.set_timeout({OBJECT_TIMEOUT:g})" in message, message
    assert OBJECT_TIMEOUT - 0.05 <= seconds < OBJECT_TIMEOUT + SLACK, (seconds, message)


def _changed_halo(rank, world):
    """Outside a steady state (a locally sliced shard: every call agrees), one rank changes its halo: every rank
    raises the same error at once, and the group is still usable."""
    import torch.distributed as dist

    from halo.exchange import halo_exchange, set_timeout

    set_timeout(HALO_TIMEOUT)
    x = _shard(torch.randn(1, 2, 13, 6, generator=torch.Generator().manual_seed(0)), world, rank)
    halo_exchange(x, 2, group=dist.group.WORLD)
    err = _error(lambda: halo_exchange(x, 3 if rank == world - 1 else 2, group=dist.group.WORLD))
    return err, halo_exchange(x, 2, group=dist.group.WORLD).shape


def test_changed_halo_outside_a_steady_state_is_one_error_everywhere():
    results = run_on_ranks(_changed_halo, 2, timeout=RUN_TIMEOUT)
    assert results[0][0] == results[1][0] and results[0][0][0] == "ValueError", results
    assert "disagree on the halo" in results[0][0][1]


# -- 3. NaN and Inf propagate as in the unsharded reference --------------------------------------------------

def _nonfinite_cases(rank, world, cases):
    from halo.exchange import halo_exchange

    out = []
    for shape, halo_, boundary, seed in cases:
        gen = torch.Generator().manual_seed(seed)
        full = torch.randn(shape, generator=gen, dtype=torch.float64)
        h = shape[-2]
        for row, value in zip((0, 1, h // 3, h // 3 + 1, h - 1), (float("nan"), float("inf"), -float("inf"),
                                                                   float("nan"), float("inf")), strict=True):
            full[..., row, (row * 7) % shape[-1]] = value
        b, a = (halo_, halo_) if isinstance(halo_, int) else halo_
        offs = split_offsets(h, world)
        n_r = offs[rank + 1] - offs[rank]
        x = full.narrow(-2, offs[rank], n_r).clone().requires_grad_(True)
        ext = halo_exchange(x, halo_, boundary=boundary, group=torch.distributed.group.WORLD)
        ref = padded_reference(full, b, a, -2, boundary)
        want = ref.narrow(-2, offs[rank], n_r + b + a)
        fwd = ext.shape == want.shape and torch.equal(ext.isnan(), want.isnan()) and torch.equal(
            ext.nan_to_num(0.0), want.nan_to_num(0.0))
        # Backward with weights that hold NaN and Inf too: the gradient carries them wherever F.pad's does.
        weights = [torch.randn(shape[:-2] + (offs[r + 1] - offs[r] + b + a, shape[-1]), generator=gen,
                               dtype=torch.float64) for r in range(world)]
        for w in weights:
            w[..., 0, 0], w[..., -1, -1] = float("inf"), float("nan")
        (ext * weights[rank]).sum().backward()
        xf = full.clone().requires_grad_(True)
        reff = padded_reference(xf, b, a, -2, boundary)
        sum((reff.narrow(-2, offs[r], offs[r + 1] - offs[r] + b + a) * weights[r]).sum()
            for r in range(world)).backward()
        want_grad = xf.grad.narrow(-2, offs[rank], n_r)
        try:
            torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=1e-12, equal_nan=True)
            bwd = ""
        except AssertionError as exc:
            bwd = str(exc)
        out.append((fwd, bwd, int(ext.isnan().sum()), int(x.grad.isnan().sum())))
    return out


def test_nan_and_inf_propagate_like_the_reference():
    world = 3
    cases = [((1, 2, 13, 6), h, b, i) for i, (h, b) in enumerate(
        [(2, "zeros"), ((3, 1), "replicate"), (2, "reflect"), (5, "circular"), (2, "pole"), (1, "pole_centered")])]
    results = run_on_ranks(_nonfinite_cases, world, cases, timeout=RUN_TIMEOUT)
    for i, case in enumerate(cases):
        for rank in range(world):
            fwd, bwd, nan_fwd, nan_bwd = results[rank][i]
            assert fwd, (case, rank)
            assert not bwd, (case, rank, bwd)
        assert sum(results[r][i][2] for r in range(world)) > 0, case  # NaNs really went through
        assert sum(results[r][i][3] for r in range(world)) > 0, case


# -- 4. long runs: no memory growth, bitwise determinism ----------------------------------------------------

def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _long_run(rank, world, steps, conv_steps):
    os.environ["TRITON_INTERPRET"] = "0"  # the production CPU path (torch reference kernels)
    from halo.exchange import halo_exchange

    group = torch.distributed.group.WORLD
    gen = torch.Generator().manual_seed(1234)
    full = torch.randn(2, 8, 97, 64, generator=gen)
    x = _shard(full, world, rank).clone().requires_grad_(True)
    digest = hashlib.sha256()
    first = None
    rss = {}
    for step in range(steps):
        if step == steps // 10:
            rss["start"] = _rss_mb()
        ext = halo_exchange(x, 2, group=group, boundary="circular")
        ext.backward(torch.ones_like(ext))
        if first is None:
            first = (ext.detach().clone(), x.grad.clone())
        elif step % 50 == 0:
            digest.update(ext.detach().numpy().tobytes() + x.grad.numpy().tobytes())
        same = torch.equal(ext, first[0]) and torch.equal(x.grad, first[1])
        if not same:
            return {"step": step, "same": False}
        x.grad = None
    rss["end"] = _rss_mb()
    out = {"same": True, "rss": rss, "digest": digest.hexdigest()}
    if conv_steps:
        from halo.nn.conv import DomainConv2d

        torch.manual_seed(0)
        conv = DomainConv2d(8, 8, 3, padding=1, group=group)
        digest = hashlib.sha256()
        for step in range(conv_steps):
            if step == conv_steps // 10:
                out["conv_rss_start"] = _rss_mb()
            conv.zero_grad(set_to_none=True)
            xc = x.detach().clone().requires_grad_(True)
            conv(xc).square().mean().backward()
            if step % 10 == 0:
                digest.update(xc.grad.numpy().tobytes() + conv.weight.grad.numpy().tobytes())
        out["conv_rss_end"] = _rss_mb()
        out["conv_digest"] = digest.hexdigest()
    return out


def test_long_run_no_growth_and_bitwise_deterministic():
    """500 exchanges (forward + backward) at a fixed shape, twice: the same bits every step and every run,
    RSS flat. Timing is benchmarks/long_run.py's job (not asserted on a shared machine)."""
    try:
        import halo.nn.conv  # noqa: F401 - DomainConv2d is optional here
        conv_steps = 50
    except ImportError:
        conv_steps = 0
    runs = [run_on_ranks(_long_run, 2, 500, conv_steps, timeout=RUN_TIMEOUT * 2) for _ in range(2)]
    for results in runs:
        for res in results:
            assert res["same"], res
            growth = res["rss"]["end"] - res["rss"]["start"]
            assert growth < 16, res["rss"]  # MB; one shard is 0.2 MB, a leak of one buffer per step is 100 MB
            if conv_steps:
                assert res["conv_rss_end"] - res["conv_rss_start"] < 16, res
    for rank in range(2):
        assert runs[0][rank]["digest"] == runs[1][rank]["digest"]
        if conv_steps:
            assert runs[0][rank]["conv_digest"] == runs[1][rank]["conv_digest"]


# -- 5. legal but unusual layouts ------------------------------------------------------------------------------

LAYOUTS = ("channels_last", "transposed", "narrow", "permuted_batch", "in_place", "no_grad", "empty_batch")
LAYOUT_HALOS = ((2, "zeros"), ((1, 3), "circular"), (2, "pole"))


def _layout_cases(rank, world, impl, kinds, halos):
    os.environ["TRITON_INTERPRET"] = impl  # "1": the Triton kernels in the interpreter; "0": the torch path
    from halo.exchange import halo_exchange

    group = torch.distributed.group.WORLD
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2, 3, 11, 6, generator=gen, dtype=torch.float64)
    offs = split_offsets(11, world)
    n_r = offs[rank + 1] - offs[rank]

    def prepare(kind):
        """(leaf whose grad is checked, x to exchange, the function of the full field x corresponds to)."""
        mine = _shard(full, world, rank)
        if kind == "channels_last":
            leaf = mine.clone().contiguous(memory_format=torch.channels_last).requires_grad_(True)
            return leaf, leaf, lambda f: f
        if kind == "transposed":
            leaf = mine.transpose(-1, -2).contiguous().requires_grad_(True)  # (B, C, W, H_r) in memory
            return leaf, leaf.transpose(-1, -2), lambda f: f
        if kind == "narrow":
            junk = torch.full_like(mine[..., :3], float("nan"))
            leaf = torch.cat([junk, mine, junk], dim=-1).requires_grad_(True)  # x: a strided window of it
            return leaf, leaf.narrow(-1, 3, 6), lambda f: f
        if kind == "permuted_batch":
            leaf = mine.permute(1, 0, 2, 3).contiguous().requires_grad_(True)
            return leaf, leaf.permute(1, 0, 2, 3), lambda f: f
        if kind == "in_place":
            leaf = mine.clone().requires_grad_(True)
            y = leaf * 1.0
            y.mul_(3.0).add_(1.0)  # x is the output of in-place ops
            return leaf, y, lambda f: f * 3.0 + 1.0
        if kind == "no_grad":
            return None, mine.clone(), lambda f: f
        if kind == "empty_batch":
            leaf = mine[:0].clone().requires_grad_(True)
            return leaf, leaf, lambda f: f[:0]
        raise AssertionError(kind)

    out = {}
    for kind in kinds:
        for halo_, boundary in halos:
            b, a = (halo_, halo_) if isinstance(halo_, int) else halo_
            leaf, x, f = prepare(kind)
            ext = halo_exchange(x, halo_, group=group, boundary=boundary)
            want = padded_reference(f(full), b, a, -2, boundary).narrow(-2, offs[rank], n_r + b + a)
            ok = ext.shape == want.shape and torch.equal(ext.detach(), want)
            if kind == "channels_last":
                ok = ok and ext.is_contiguous(memory_format=torch.channels_last)
            grad_ok = True
            if leaf is not None:
                ext.sum().backward()  # an expanded (stride-0) gradient: one more unusual layout
                xf = full.clone().requires_grad_(True)
                ref = padded_reference(f(xf), b, a, -2, boundary)  # every rank's window is summed
                sum(ref.narrow(-2, offs[r], offs[r + 1] - offs[r] + b + a).sum() for r in range(world)).backward()
                want_grad = xf.grad.narrow(-2, offs[rank], n_r)
                got = leaf.grad
                if kind == "transposed":
                    got = got.transpose(-1, -2)
                elif kind == "narrow":
                    got = got.narrow(-1, 3, 6)  # the other columns get zero
                    grad_ok = bool((leaf.grad.narrow(-1, 0, 3) == 0).all() and (leaf.grad.narrow(-1, 9, 3) == 0).all())
                elif kind == "permuted_batch":
                    got = got.permute(1, 0, 2, 3)
                elif kind == "empty_batch":
                    want_grad = want_grad[:0]
                grad_ok = grad_ok and got.shape == want_grad.shape and bool(
                    (got - want_grad).abs().max() <= 1e-12 if got.numel() else True)
            out[(kind, boundary)] = (ok, grad_ok)
    return out


@pytest.mark.parametrize("impl, kinds, halos", [
    ("0", LAYOUTS, LAYOUT_HALOS),  # the torch path (production on CPU)
    ("1", ("channels_last", "transposed", "empty_batch"), LAYOUT_HALOS[1:2]),  # Triton kernels, interpreted: slow
])
def test_unusual_layouts_match_the_padded_field(impl, kinds, halos):
    world = 3
    results = run_on_ranks(_layout_cases, world, impl, kinds, halos, timeout=RUN_TIMEOUT)
    failed = [(rank, case, res) for rank in range(world) for case, res in results[rank].items() if not all(res)]
    assert not failed, failed


# -- one process: the metadata table and the timeout setting -------------------------------------------------

def test_metadata_rows_and_timeout_setting():
    """The agreement's fast row: codes for what can be coded, a flag for what a rank got wrong on its own."""
    from halo.exchange import get_timeout, set_timeout
    from halo.plan.agree import ROW_WORDS, SHAPE_AT, Meta, Spec

    x = torch.zeros(2, 3, 5, 7, dtype=torch.bfloat16)
    good = Meta.of(x, (Spec.of(-2, (1, 2), "pole_centered"),), 1)
    row = good.row()
    assert len(row) == ROW_WORDS and row[1] == 0 and row[SHAPE_AT:SHAPE_AT + 4] == [2, 3, 5, 7]
    assert Meta.of(x, (Spec.of(-2, (1, 2), "pole"),), 1).row() != row  # the boundary is in the row
    for bad in (Spec.of(3, "x" * 40, 5), Spec.of(-2, (1, 2), "zero"), Spec.of(9, 1, "zeros"), Spec.of(-2, -1)):
        assert Meta.of(x, (bad,), 1).row()[1] == 1, bad  # flagged: every rank then gathers the details
    assert Spec.of(-2, needs=[(0, 3), (2, 6)]) != Spec.of(-2, needs=[(0, 3), (2, 7)])
    assert set_timeout(1.5) is None and get_timeout() == 1.5
    assert set_timeout(None) == 1.5 and get_timeout() is None
    for bad in (0, -1, float("inf"), "5", True):
        with pytest.raises(ValueError, match="positive, finite number of seconds or None"):
            set_timeout(bad)
