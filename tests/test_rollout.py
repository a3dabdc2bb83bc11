"""Sharded rollouts stay sharded and score like the unsharded rollout (``halo.rollout``).

A converted conv net (float64) rolls 4 steps from a 37 x 24 field with a forcing channel on 3 gloo
ranks (uneven shards: 13, 12, 12), converted with a declared grid: a step posts only the halo exchanges (no
all-gather, no agreement), and every predicted state, gathered afterwards, equals the unsharded rollout's.
Latitude-weighted RMSE and ACC per lead, sample and variable equal the same formulas on the whole field
(WeatherBench's cos-latitude weights normalised to mean 1), to 1e-12.
"""

import math

import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 37, 24, 3
STEPS = 4


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C + 1, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, C, 3, padding=1)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, C, H, W, dtype=torch.float64, generator=g)
    forcing = [torch.randn(2, 1, H, W, dtype=torch.float64, generator=g) for _ in range(STEPS)]
    targets = [torch.randn(2, C, H, W, dtype=torch.float64, generator=g) for _ in range(STEPS)]
    clim = torch.randn(C, H, W, dtype=torch.float64, generator=g) * 0.1
    return x0, forcing, targets, clim


def _run(rank, world):
    import os

    os.environ["TRITON_INTERPRET"] = "0"  # halo's kernels: the torch reference (the interpreter: test_kernels.py)
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.rollout import rollout, scores
    from halo.testing import HostWorkCounter

    halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(_net(), grid=(H, W))
    x0, forcing, targets, clim = _data()
    offs = split_offsets(H, world)
    rows = slice(offs[rank], offs[rank + 1])
    rollout(model, x0[..., rows, :], 1, [f[..., rows, :] for f in forcing])  # learn the plans
    with HostWorkCounter() as counter:
        preds = rollout(model, x0[..., rows, :], STEPS, lambda k: forcing[k][..., rows, :])
    s = scores(preds, [t[..., rows, :] for t in targets], clim[:, rows])
    return {"preds": [halo.gather(p) for p in preds], "rmse": s["rmse"], "acc": s["acc"],
            "counts": counter.summary()}


def _reference():
    from halo.parallel.reduce import latitude_weights

    model = _net()
    x0, forcing, targets, clim = _data()
    def step(x):
        return model(x)

    state, preds = x0, []
    torch.set_grad_enabled(False)
    for k in range(STEPS):
        state = step(torch.cat([state, forcing[k]], dim=1))
        preds.append(state)
    torch.set_grad_enabled(True)
    w = latitude_weights(H).view(H, 1)
    rmse, acc = [], []
    for p, t in zip(preds, targets, strict=True):
        mean = lambda v: (v * w).mean(dim=(-2, -1))  # noqa: E731
        pa, ta = p - clim, t - clim
        rmse.append(mean((p - t) ** 2).sqrt())
        acc.append(mean(pa * ta) / (mean(pa ** 2) * mean(ta ** 2)).sqrt())
    return preds, torch.stack(rmse), torch.stack(acc)


def test_sharded_rollout_equals_unsharded_and_scores_exactly():
    results = run_on_ranks(_run, 3, timeout=120)
    preds, rmse, acc = _reference()
    for r in results:
        for k in range(STEPS):
            err = (r["preds"][k] - preds[k]).abs().max()
            assert torch.allclose(r["preds"][k], preds[k], rtol=0, atol=1e-12), (k, err)
        assert torch.allclose(r["rmse"], rmse, rtol=1e-12, atol=0)
        assert torch.allclose(r["acc"], acc, rtol=1e-12, atol=1e-14)
        assert r["counts"].get("c10d.all_gather", 0) == 0 and r["counts"].get("agreement", 0) == 0, r["counts"]
        assert r["counts"].get("c10d.batch_isend_irecv", 0) >= STEPS  # only the halo exchanges
    assert rmse.shape == (STEPS, 2, C) and not math.isnan(float(acc.sum()))
