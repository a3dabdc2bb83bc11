"""Gradient scale by construction (issue 30, item 2; item 7 for the losses): halo's sync knows where its gradients
came from and refuses the mistakes that gave a silently wrong scale, on every rank; the right calls are exact.

Measured before (gloo, float64): a local ``F.mse_loss`` of the shard + ``sync_domain_gradients`` on 3 ranks x3.003;
torch DDP over the world group around a converted model x0.5; a sync after every micro-step of an accumulation
x1.523; ``torch.nn.utils.clip_grad_norm_`` before the sync x1.97; CREDIT's loss with halo's sync x2, the reverse
x0.5; a loss on a global pool's result (whole on every rank) x2.000; ``latitude_weighted_mse`` with a target one
row shorter raised on one rank, the other waited. Each case below is the same program on every rank and fails if
its check is removed (the wrong scale would pass, or the one rank would raise alone); every exact case compares
with the unsharded model run in the same test.

Tolerances: float64 gradients are sums of the same products in another order (local rows, then across ranks):
rtol 1e-10, atol 1e-13 (measured ~1e-15).
"""

import pytest
import torch
import torch.nn.functional as F
from _helpers import portable
from torch import nn

from halo.testing import run_on_ranks, run_on_ranks_outcomes

H, W, C = 11, 6, 2  # 11 rows over 3 ranks: 4, 4, 3
RTOL, ATOL = 1e-10, 1e-13


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C, 3, 3, padding=1), nn.GELU(), nn.Conv2d(3, C, 3, padding=1)).double()


def _head():
    """A global pool and a head after it: the result is whole on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C, 3, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(3, 2)).double()


def _data(seed=1, batch=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, C, H, W, dtype=torch.float64, generator=g),
            torch.randn(batch, C, H, W, dtype=torch.float64, generator=g))


def _weights():
    from halo.parallel.reduce import latitude_weights

    return latitude_weights(H)[:, None]


def _grads(model):
    return {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()}


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is the test's subject
        return f"{type(exc).__name__}: {exc}"
    return None


def _assert_close(got, want):
    assert set(got) == set(want)
    for k, g in want.items():
        assert torch.allclose(torch.as_tensor(got[k]), g, rtol=RTOL, atol=ATOL), (k, got[k], g)


# -- one worker, several scenarios (each leaves every rank's state consistent: a refusal sends nothing) ---------

def _scenarios(rank, world, names):
    import halo
    from halo.parallel.reduce import (
        clip_grad_norm_,
        domain_mean,
        latitude_weighted_mse,
        local_share,
        no_sync,
        replicated_loss,
        sync_domain_gradients,
    )

    manager = halo.initialize_domain_parallel(world, world)
    x, y = _data()
    xs, ys = halo.shard(x), halo.shard(y)
    out = {}

    def fresh(make=_net):
        return halo.nn.convert_to_domain_parallel(make(), manager)

    for name in names:
        model = fresh(_head if name.startswith("head") else _net)
        if name == "local":  # CREDIT-style per-shard mean with halo's sum: x3 on 3 ranks
            F.mse_loss(model(xs), ys).backward()
            out[name] = _error(lambda m=model: sync_domain_gradients(m, manager))
        elif name == "lwmse":
            latitude_weighted_mse(model(xs), ys).backward()
            sync_domain_gradients(model, manager)
            out[name] = _grads(model)
        elif name == "share":  # this rank's share of the global mean, declared
            local_share(((model(xs) - ys) ** 2).sum() / y.numel()).backward()
            sync_domain_gradients(model, manager)
            out[name] = _grads(model)
        elif name == "head_local":  # a loss on the global pool's whole result, undeclared: x P, refused
            F.mse_loss(model(xs), y[:, 0, 0, :2]).backward()
            out[name] = _error(lambda m=model: sync_domain_gradients(m, manager))
        elif name == "head_replicated":
            replicated_loss(F.mse_loss(model(xs), y[:, 0, 0, :2])).backward()
            sync_domain_gradients(model, manager)
            out[name] = _grads(model)
        elif name == "torch_clip":  # torch's clip of each rank's part: not the global norm
            domain_mean((model(xs) - ys) ** 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            out[name] = _error(lambda m=model: sync_domain_gradients(m, manager))
        elif name == "scaled":  # any in-place change of a gradient between backward and the sync
            domain_mean((model(xs) - ys) ** 2).backward()
            with torch.no_grad():
                next(model.parameters()).grad.mul_(0.5)
            out[name] = _error(lambda m=model: sync_domain_gradients(m, manager))
        elif name == "halo_clip":
            domain_mean((model(xs) - ys) ** 2).backward()
            sync_domain_gradients(model, manager)
            total = clip_grad_norm_(model, 1e-3)
            out[name] = (_grads(model), total.item())
        elif name == "accum_each":  # a sync after every micro-step: x1.5 on the earlier ones
            errors = []
            for k in range(3):
                domain_mean((model(xs) - ys) ** 2 * (k + 1)).backward()
                errors.append(_error(lambda m=model: sync_domain_gradients(m, manager)))
                if errors[-1]:
                    break
            out[name] = errors
        elif name == "accum_no_sync":
            for k in range(3):
                loss = domain_mean((model(xs) - ys) ** 2 * (k + 1))
                if k < 2:
                    with no_sync(model):
                        loss.backward()
                        sync_domain_gradients(model, manager)  # a loop that syncs every micro-step: nothing here
                else:
                    loss.backward()
                    sync_domain_gradients(model, manager)
            out[name] = _grads(model)
        elif name == "accum_mixed":  # one micro-step's loss local: the accumulated gradient is not a domain loss's
            F.mse_loss(model(xs), ys).backward()
            domain_mean((model(xs) - ys) ** 2).backward()  # the last backward a domain loss's: not enough
            out[name] = _error(lambda m=model: sync_domain_gradients(m, manager))
        elif name == "accum_once":
            for k in range(3):
                domain_mean((model(xs) - ys) ** 2 * (k + 1)).backward()
            sync_domain_gradients(model, manager)
            out[name] = _grads(model)
    return portable(out)


def _ref(loss_fn, make=_net):
    model = make()
    loss_fn(model).backward()
    return model


def _mse_ref(model):
    x, y = _data()
    return ((model(x) - y) ** 2).mean()


@pytest.fixture(scope="module")
def three():
    """Every scenario on 3 ranks (one rank pool for the file's exact and refused cases)."""
    names = ["local", "lwmse", "share", "head_local", "head_replicated", "torch_clip", "scaled", "halo_clip",
             "accum_each", "accum_no_sync", "accum_once", "accum_mixed"]
    return run_on_ranks(_scenarios, 3, names, timeout=300)


def _same_on_every_rank(results, name):
    msgs = [r[name] for r in results]
    assert msgs[0] is not None and all(m == msgs[0] for m in msgs), msgs
    return msgs[0]


def test_local_loss_is_refused_on_every_rank(three):
    msg = _same_on_every_rank(three, "local")
    assert msg.startswith("RuntimeError") and "no halo domain reduction" in msg, msg
    assert "halo.parallel.latitude_weighted_mse" in msg and "halo.parallel.domain_mean" in msg and "x3" in msg, msg


def test_domain_losses_are_exact(three):
    x, y = _data()
    w = _weights()
    lw = _grads(_ref(lambda m: (w * (m(x) - y) ** 2).mean()))
    mse = _grads(_ref(_mse_ref))
    for r in three:
        _assert_close(r["lwmse"], lw)
        _assert_close(r["share"], mse)


def test_loss_on_a_global_pools_result(three):
    """Whole on every rank: undeclared it is x P (refused); declared with replicated_loss it is exact."""
    msg = _same_on_every_rank(three, "head_local")
    assert msg.startswith("RuntimeError") and "halo.parallel.replicated_loss(loss)" in msg, msg
    x, y = _data()
    want = _grads(_ref(lambda m: F.mse_loss(m(x), y[:, 0, 0, :2]), _head))
    for r in three:
        _assert_close(r["head_replicated"], want)


def test_gradients_changed_before_the_sync_are_refused(three):
    for name in ("torch_clip", "scaled"):
        msg = _same_on_every_rank(three, name)
        assert msg.startswith("RuntimeError") and "changed between the backward and the sync" in msg, msg
        assert "halo.parallel.clip_grad_norm_" in msg, msg
    assert "4 of 4 gradients" in three[0]["torch_clip"] and "1 of 4 gradients ('0.weight')" in three[0]["scaled"]


def test_halo_clip_after_the_sync_is_torchs_clip_on_the_unsharded_model(three):
    model = _ref(_mse_ref)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert total > 1e-2  # the clip is active
    for r in three:
        grads, got = r["halo_clip"]
        assert abs(got - total.item()) <= 1e-10 * total.item(), (got, total)
        _assert_close(grads, _grads(model))


def test_accumulation(three):
    """A sync after every micro-step is refused at the second; no_sync() for the first two, or one sync after the
    last, gives the unsharded gradient of the summed loss."""
    for r in three:
        errors = r["accum_each"]
        assert errors[0] is None and len(errors) == 2, errors
        assert errors[1].startswith("RuntimeError") and "already summed" in errors[1] and "no_sync" in errors[1]
    x, y = _data()
    model = _net()
    for k in range(3):
        (((model(x) - y) ** 2).mean() * (k + 1)).backward()
    want = _grads(model)
    msg = _same_on_every_rank(three, "accum_mixed")
    assert "no halo domain reduction" in msg, msg
    for r in three:
        _assert_close(r["accum_no_sync"], want)
        _assert_close(r["accum_once"], want)


# -- data-parallel wrappers: dp 2 x domain 2 -------------------------------------------------------------------

def _wrapped(rank, world):
    import halo
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, 2)
    x, y = _data(batch=4)
    per = 4 // manager.dp_world_size
    batch = slice(manager.dp_rank * per, (manager.dp_rank + 1) * per)
    xs, ys = halo.shard(x[batch], group=manager.domain_group), halo.shard(y[batch], group=manager.domain_group)
    out = {}
    model = halo.nn.convert_to_domain_parallel(_net(), manager)
    world_ddp = nn.parallel.DistributedDataParallel(model)  # the world group: holds the other domain rank
    out["world"] = _error(lambda: domain_mean((world_ddp(xs) - ys) ** 2).backward())
    model = halo.nn.convert_to_domain_parallel(_net(), manager)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=manager.data_parallel_group)
    domain_mean((ddp(xs) - ys) ** 2).backward()
    sync_domain_gradients(ddp, domain_group=manager.domain_group)  # DDP averaged over dp already
    out["dp"] = _grads(ddp)
    model = halo.nn.convert_to_domain_parallel(_net(), manager)  # accumulation: DDP's reduction held back too
    ddp = nn.parallel.DistributedDataParallel(model, process_group=manager.data_parallel_group)
    from halo.parallel.reduce import no_sync

    for k in range(3):
        loss = domain_mean((ddp(xs) - ys) ** 2 * (k + 1))
        if k < 2:
            with no_sync(ddp):
                loss.backward()
        else:
            loss.backward()
    sync_domain_gradients(ddp, domain_group=manager.domain_group)
    out["accum"] = _grads(ddp)
    return portable(out)


def test_ddp_over_domain_ranks_is_refused_and_over_dp_is_exact():
    """DDP over the world: refused at its first forward; over the dp group (accumulating in halo.parallel.no_sync, which
    holds DDP's reduction back too): exact."""
    results = run_on_ranks(_wrapped, 4, timeout=240)
    x, y = _data(batch=4)
    want = _grads(_ref(lambda m: ((m(x) - y) ** 2).mean()))
    for rank, r in enumerate(results):
        msg = r["world"]
        assert msg is not None and msg.startswith("ValueError") and "DistributedDataParallel" in msg, msg
        domain = [0, 1] if rank < 2 else [2, 3]
        assert f"holds global ranks [0, 1, 2, 3], which share global ranks {domain}" in msg, msg
        assert "manager.data_parallel_group" in msg and "halo.parallelize" in msg and "x1/2" in msg, msg
        _assert_close(r["dp"], want)
    model = _net()
    for k in range(3):
        (((model(x) - y) ** 2).mean() * (k + 1)).backward()
    want = _grads(model)
    for r in results:
        _assert_close(r["accum"], want)


# -- CREDIT's convention and halo's: one or the other, never both ----------------------------------------------

def _credit(rank, world):
    import halo
    from halo.compat import credit
    from halo.parallel.reduce import latitude_weighted_mse, sync_domain_gradients

    manager = credit.initialize_domain_parallel(world, world)
    x, y = _data()
    xs, ys = halo.shard(x), halo.shard(y)
    out = {}
    model = credit.convert_to_domain_parallel(_net(), manager)
    F.mse_loss(model(xs), ys).backward()  # CREDIT's loss with halo's sum: x2
    out["credit_loss_halo_sync"] = _error(lambda: sync_domain_gradients(model, manager))
    model = credit.convert_to_domain_parallel(_net(), manager)
    latitude_weighted_mse(model(xs), ys).backward()  # halo's loss with CREDIT's mean: x0.5
    out["halo_loss_credit_sync"] = _error(lambda: credit.sync_domain_gradients(model, manager))
    model = credit.convert_to_domain_parallel(_net(), manager)
    pred = model(xs)  # CREDIT's convention end to end (11 rows over 2: its scale for uneven shards)
    (F.mse_loss(pred, ys) * credit.domain_loss_scale(manager, like=pred)).backward()
    credit.sync_domain_gradients(model, manager)
    out["credit"] = _grads(model)
    return portable(out)


def test_credit_and_halo_conventions_do_not_mix():
    results = run_on_ranks(_credit, 2, timeout=180)
    msg = _same_on_every_rank(results, "credit_loss_halo_sync")
    assert "no halo domain reduction" in msg and "halo.compat.credit.sync_domain_gradients" in msg, msg
    msg = _same_on_every_rank(results, "halo_loss_credit_sync")
    assert msg.startswith("RuntimeError: halo.compat.credit.sync_domain_gradients") and "x1/2" in msg, msg
    assert "halo.parallel.sync_domain_gradients" in msg, msg
    want = _grads(_ref(_mse_ref))
    for r in results:
        _assert_close(r["credit"], want)


# -- losses: a mismatch on one rank is the same error on every rank (item 7) -----------------------------------

def _mismatch(rank, world, case):
    import halo
    from halo.parallel.reduce import latitude_weighted_mse

    halo.initialize_domain_parallel(world, world)
    x, y = _data()
    pred, target = halo.shard(x), halo.shard(y)
    if case == "row" and rank == 1:
        target = target[..., :-1, :]  # one row short, on this rank only
    if case == "dtype" and rank == 2:
        target = target.float()
    if case == "channel" and rank == 0:
        target = target[:, :1]
    return latitude_weighted_mse(pred, target).item()


@pytest.mark.parametrize("case", ["row", "dtype", "channel"])
def test_loss_mismatch_on_one_rank_raises_on_every_rank(case):
    outcomes = run_on_ranks_outcomes(_mismatch, 3, case, timeout=90, pg_timeout=30)
    first = [o[1].splitlines()[0] for o in outcomes if o[0] == "error"]
    assert len(first) == 3 and all(f == first[0] for f in first), outcomes
    assert first[0].startswith("ValueError: latitude_weighted_mse"), first[0]
    if case == "row":
        assert "pred is (2, 2, 11, 6) (rows per rank [4, 4, 3]), target is (2, 2, 10, 6) (rows per rank " \
               "[4, 3, 3])" in first[0], first[0]


def test_loss_shape_check_agrees_on_one_process():
    """No distributed run: the check still names both shapes."""
    from halo.parallel.reduce import latitude_weighted_mse

    x, y = _data()
    with pytest.raises(ValueError, match=r"pred is \(2, 2, 11, 6\).*target is \(2, 2, 10, 6\)"):
        latitude_weighted_mse(x, y[..., :-1, :])


# -- compiled domain loss; one rank alone clipping --------------------------------------------------------------

def _compiled(rank, world):
    import halo
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    x, y = _data()
    xs, ys = halo.shard(x), halo.shard(y)
    model = halo.nn.convert_to_domain_parallel(_net(), manager)
    loss_fn = torch.compile(lambda p, t: domain_mean((p - t) ** 2), backend="aot_eager", fullgraph=True)
    loss_fn(model(xs), ys).backward()  # the compiled backward marks itself a domain loss's (halo::replicated_grad)
    sync_domain_gradients(model, manager)
    return portable(_grads(model))


def test_compiled_domain_loss_is_accepted_and_exact():
    want = _grads(_ref(_mse_ref))
    for r in run_on_ranks(_compiled, 2, timeout=240):
        _assert_close(r, want)


def _one_rank_clips(rank, world):
    import halo
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(5)
    x, y = _data()
    model = halo.nn.convert_to_domain_parallel(_net(), manager)
    domain_mean((model(halo.shard(x)) - halo.shard(y)) ** 2).backward()
    if rank == 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    sync_domain_gradients(model, manager)
    return "no error"


def test_one_rank_alone_clipping_fails_within_the_timeout_naming_it():
    """The clipping rank raises the clear error; its peer's sum fails within the timeout naming the rank."""
    outcomes = run_on_ranks_outcomes(_one_rank_clips, 2, timeout=90, pg_timeout=60)
    assert outcomes[0][0] == "error" and "changed between the backward and the sync" in outcomes[0][1], outcomes
    assert outcomes[1][0] == "error" and outcomes[1][1].startswith("HaloCommError"), outcomes
    assert "global ranks [0]" in outcomes[1][1].splitlines()[0], outcomes[1][1]
