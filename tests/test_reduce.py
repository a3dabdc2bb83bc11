"""halo.parallel.reduce on gloo ranks vs the unsharded value computed in the same test, forward and backward.

Tolerances: float64 values are sums of the same numbers in a different order (local sums, then across ranks),
so they agree to a few ulps of the sum: rtol 1e-12 (measured: ~1e-15). Dot-product tests compare two such
sums: 1e-12 relative. bf16 inputs: the fp32 accumulation is checked against a float64 reference with rtol 1e-5,
which a bf16 accumulation (or a result rounded to bf16: up to 2**-8 relative) fails; the test shows it does.
"""

import math

import pytest
import torch
from _helpers import portable
from torch import nn

from halo.parallel.reduce import (
    all_reduce,
    clip_grad_norm_,
    domain_mean,
    domain_sum,
    grad_norm,
    grid_latitudes,
    latitude_weighted_mean,
    latitude_weighted_mse,
    latitude_weights,
)
from halo.plan.partition import local_range
from halo.testing import run_on_ranks

H, W = 721, 8


def _field(seed, shape=(2, 3, H, W), offset=0.5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64) + offset


def _t(a):
    return torch.as_tensor(a)


def _close(a, b, rtol=1e-12):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).abs().max().item() <= rtol * max(1.0, b.abs().max().item())


# -- latitude weights (one process) --------------------------------------------------------------------------

def test_latitude_weights_721_grid():
    lat = grid_latitudes(721)
    assert lat[0] == 90 and lat[1] == 89.75 and lat[360] == 0 and lat[-1] == -90
    w = latitude_weights(721)
    assert w.dtype == torch.float64 and w.shape == (721,)
    assert abs(w.mean().item() - 1) < 1e-15
    assert torch.equal(w, w.flip(0)), "exactly symmetric about the equator"
    assert w[0] < 1e-15 and w[-1] < 1e-15, "cos(90) = 0 on the pole rows"
    assert w.argmax() == 360 and _close(w[360], 1 / torch.cos(torch.deg2rad(lat)).mean())
    assert torch.equal(latitude_weights(latitudes=lat), w)
    # WeatherBench 2 cell areas: pole rows get the polar cap, sin(90) - sin(89.875).
    area = latitude_weights(721, method="area")
    cap = 1 - math.sin(math.radians(89.875))
    assert _close(area[0] / area[360], cap / (2 * math.sin(math.radians(0.125))))
    assert abs(area.mean().item() - 1) < 1e-15 and torch.equal(area, area.flip(0))


def test_latitude_weights_cell_centred_and_auto():
    lat = grid_latitudes(720, poles_included=False)
    assert lat[0] == 89.875 and lat[-1] == -89.875 and torch.equal(lat, -lat.flip(0))
    assert torch.equal(grid_latitudes(720), lat), "even row count: cell-centred by default"
    assert torch.equal(grid_latitudes(721), grid_latitudes(721, poles_included=True))
    w = latitude_weights(32)
    assert abs(w.mean().item() - 1) < 1e-15 and torch.equal(w, w.flip(0)) and w.min() > 0.04
    regional = grid_latitudes(5, lat_range=(60, 20))
    assert regional.tolist() == [60, 50, 40, 30, 20]
    with pytest.raises(ValueError, match="expected one of cos, area"):
        latitude_weights(721, method="gauss")
    with pytest.raises(ValueError, match="n_lat=5 but 3 latitudes"):
        latitude_weights(5, latitudes=[1, 2, 3])


def test_single_process_is_the_plain_reduction():
    x = _field(0, (2, 3, 37, 8)).requires_grad_(True)
    assert all_reduce(x) is x
    assert _close(domain_mean(x), x.mean()) and _close(domain_sum(x, dim=(0, 2, 3)), x.sum((0, 2, 3)))
    w = latitude_weights(37)
    loss = latitude_weighted_mse(x, torch.zeros_like(x))
    loss.backward()
    xr = x.detach().clone().requires_grad_(True)
    (xr ** 2 * w[:, None]).mean().backward()
    assert _close(loss, (x.detach() ** 2 * w[:, None]).mean()) and _close(x.grad, xr.grad)
    with pytest.raises(ValueError, match="expected one of sum, mean, max, min"):
        all_reduce(x, op="prod")
    with pytest.raises(ValueError, match="must include the sharded latitude dim -2"):
        domain_sum(x, dim=(0, 1))


# -- grad norm (one process) ---------------------------------------------------------------------------------

def test_grad_norm_and_clip_match_torch():
    torch.manual_seed(0)
    a, b = nn.Linear(5, 4).double(), nn.Linear(5, 4).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 5, dtype=torch.float64)
    a(x).pow(2).sum().backward()
    b(x).pow(2).sum().backward()
    for p in (2.0, 1.0, 3.0, math.inf):
        want = torch.nn.utils.get_total_norm([q.grad for q in a.parameters()], p)
        assert _close(grad_norm(a, p), want), p
    total = clip_grad_norm_(a.parameters(), 0.5)
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert _close(total, want)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert _close(p.grad, q.grad)
    assert grad_norm([nn.Parameter(torch.zeros(2))]) == 0


def test_grad_norm_bf16_accumulates_in_fp32():
    gen = torch.Generator().manual_seed(3)
    grads = [(1 + 0.01 * torch.randn(n, generator=gen)).to(torch.bfloat16) for n in (40000, 333, 7)]
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    exact = torch.linalg.vector_norm(torch.cat([g.double() for g in grads])).item()
    got = grad_norm(params)
    assert got.dtype == torch.float32 and abs(got.item() - exact) <= 1e-5 * exact
    naive = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    assert abs(naive - exact) > 1e-5 * exact, "the tolerance would catch a bf16 norm"


# -- domain reductions on ranks ------------------------------------------------------------------------------

def _rank_seed(rank):
    return torch.Generator().manual_seed(1000 + rank)


def _reductions(rank, world):
    import halo
    from halo.parallel.reduce import local_latitude_weights

    halo.initialize_domain_parallel(world, world)
    full, target = _field(1), _field(2)
    lo, hi = local_range(H, world, rank)
    x = full[:, :, lo:hi].clone().requires_grad_(True)
    out = {"rows": (lo, hi)}
    out["sum"] = domain_sum(x).item()
    out["mean"] = domain_mean(x).item()
    out["sum_c"] = domain_sum(x, dim=(0, 2, 3)).detach()
    out["mean_c"] = domain_mean(x, dim=(-1, -2), keepdim=True).detach()
    out["lwm"] = latitude_weighted_mean(x).item()
    out["lwm_c"] = latitude_weighted_mean(x, dim=(0, 2, 3)).detach()
    out["lwm_area"] = latitude_weighted_mean(x, method="area").item()

    # Dot-product tests of the replicated reductions: a different y on every rank.
    gen = _rank_seed(rank)
    for name, fn in (("sum", domain_sum), ("mean", domain_mean), ("lwm", latitude_weighted_mean),
                     ("mean_c", lambda t: domain_mean(t, dim=(0, 2, 3)))):
        x.grad = None
        s = fn(x)
        y = torch.randn(s.shape, generator=gen, dtype=torch.float64)
        (s * y).sum().backward()
        out[f"dot_{name}"] = ((s.detach() * y).sum().item(), (x.detach() * x.grad).sum().item())

    # Plain all_reduce: dot-product test (sum, mean) and the gradient of max/min against torch.amax/amin.
    shape = (5, 4)
    a_all = [torch.randn(shape, generator=_rank_seed(100 + r), dtype=torch.float64) for r in range(world)]
    y_all = [torch.randn(shape, generator=_rank_seed(200 + r), dtype=torch.float64) for r in range(world)]
    for t in a_all:
        t[0, 0] = 7.0  # a tie on every rank
    a_all[0][1, 1] = a_all[-1][1, 1] = -9.0  # a tie on two ranks (min)
    a_all[0][2, 2] = a_all[-1][2, 2] = 9.0  # and for max
    for op in ("sum", "mean", "max", "min"):
        a = a_all[rank].clone().requires_grad_(True)
        s = all_reduce(a, op)
        (s * y_all[rank]).sum().backward()
        out[f"ar_{op}"] = ((s.detach() * y_all[rank]).sum().item(), (a.detach() * a.grad).sum().item())
        stack = torch.stack(a_all).requires_grad_(True)
        ref = {"sum": lambda t: t.sum(0), "mean": lambda t: t.mean(0), "max": lambda t: t.amax(0),
               "min": lambda t: t.amin(0)}[op](stack)
        sum((ref * y).sum() for y in y_all).backward()
        out[f"ar_{op}_err"] = ((s.detach() - ref.detach()).abs().max().item(),
                               (a.grad - stack.grad[rank]).abs().max().item())

    # The loss: every rank calls backward on the replicated loss; x.grad is its slice of the unsharded grad.
    x.grad = None
    loss = latitude_weighted_mse(x, target[:, :, lo:hi])
    loss.backward()
    out["mse"], out["mse_grad"] = loss.item(), x.grad.clone()

    out["local_w"] = local_latitude_weights(H)
    out["local_w_720"] = local_latitude_weights(720, method="area")

    # bf16: fp32 accumulation vs float64; what a bf16 accumulation would give.
    xb = (300 + 10 * full[:, :, lo:hi]).to(torch.bfloat16)
    tb = (300 + 10 * target[:, :, lo:hi]).to(torch.bfloat16)
    mean_b = domain_mean(xb)
    out["bf16_mean"] = (str(mean_b.dtype), mean_b.item())
    naive = xb.sum()  # bf16 result: what a bf16 reduction would hand on
    out["bf16_naive"] = all_reduce(naive.float()).item() / (full.numel())
    out["bf16_mse"] = latitude_weighted_mse(xb, tb).item()
    return portable(out)


@pytest.mark.parametrize("world", [3, 4, 7])
def test_domain_reductions_721_rows(world):
    results = run_on_ranks(_reductions, world, timeout=240)
    full, target = _field(1), _field(2)
    w = latitude_weights(H)[:, None]
    area = latitude_weights(H, method="area")[:, None]
    want = {"sum": full.sum(), "mean": full.mean(), "sum_c": full.sum((0, 2, 3)),
            "mean_c": full.mean((-1, -2), keepdim=True), "lwm": (full * w).mean(),
            "lwm_c": (full * w).mean((0, 2, 3)), "lwm_area": (full * area).mean()}
    for key, value in want.items():
        for r in results:
            assert _close(r[key], value), (key, r[key], value)
        assert all(torch.equal(_t(r[key]), _t(results[0][key])) for r in results), \
            f"{key}: the replicated value is bitwise identical on every rank"

    # Dot-product tests: replicated outputs are measured once (mean over ranks), plain ones on every rank.
    for name in ("sum", "mean", "lwm", "mean_c"):
        lhs = sum(r[f"dot_{name}"][0] for r in results) / world
        rhs = sum(r[f"dot_{name}"][1] for r in results)
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (name, lhs, rhs)
    for op in ("sum", "mean", "max", "min"):
        if op in ("sum", "mean"):  # linear: the dot-product test
            lhs = sum(r[f"ar_{op}"][0] for r in results)
            rhs = sum(r[f"ar_{op}"][1] for r in results)
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (op, lhs, rhs)
        for r in results:
            fwd, bwd = r[f"ar_{op}_err"]
            assert fwd <= 1e-12 and bwd <= 1e-12, (op, fwd, bwd)

    xf = full.clone().requires_grad_(True)
    loss = ((xf - target) ** 2 * w).mean()
    loss.backward()
    for r in results:
        lo, hi = r["rows"]
        assert _close(r["mse"], loss.detach())
        assert _close(r["mse_grad"], xf.grad[:, :, lo:hi])

    assert torch.equal(torch.cat([_t(r["local_w"]) for r in results]), latitude_weights(H))
    assert torch.equal(torch.cat([_t(r["local_w_720"]) for r in results]), latitude_weights(720, method="area"))

    exact = (300 + 10 * full).to(torch.bfloat16).double().mean().item()
    dtype, got = results[0]["bf16_mean"]
    assert dtype == "torch.float32" and abs(got - exact) <= 1e-5 * exact, (got, exact)
    assert abs(results[0]["bf16_naive"] - exact) > 1e-5 * exact, "a bf16 accumulation fails this tolerance"
    pb, tb = ((300 + 10 * t).to(torch.bfloat16).double() for t in (full, target))
    exact_mse = ((pb - tb) ** 2 * w).mean().item()
    assert abs(results[0]["bf16_mse"] - exact_mse) <= 1e-5 * exact_mse


# -- gradient sync: dp=2 x domain=2 --------------------------------------------------------------------------

HS, B = 37, 4


class Tiny(nn.Module):
    """1x1 convs and a GroupNorm (domain statistics), a parameter used only on the first 3 global rows (so
    only the northern rank has its gradient), and one never used."""

    def __init__(self):
        super().__init__()
        self.c1, self.gn, self.c2 = nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4), nn.Conv2d(4, 2, 1)
        self.edge = nn.Parameter(torch.full((2, 1, 1), 0.3))
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, x, row0=0):
        h = self.c2(torch.tanh(self.gn(self.c1(x))))
        k = max(0, min(3 - row0, x.shape[-2]))
        return torch.cat([h[..., :k, :] + self.edge, h[..., k:, :]], dim=-2) if k else h


def _tiny_data():
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(B, 3, HS, 6, generator=gen, dtype=torch.float64),
            torch.randn(B, 2, HS, 6, generator=gen, dtype=torch.float64))


def _tiny_model():
    torch.manual_seed(0)
    return Tiny().double()


def _sync(rank, world):
    import halo
    from halo.nn.norm import DomainGroupNorm
    from halo.parallel.reduce import sync_domain_gradients

    m = halo.initialize_domain_parallel(world, 2)
    model = _tiny_model()
    model.gn = DomainGroupNorm(model.gn)
    x, y = _tiny_data()
    per = B // m.dp_world_size
    lo, hi = local_range(HS, 2, m.domain_rank)
    xs, ys = (t[m.dp_rank * per:(m.dp_rank + 1) * per, :, lo:hi] for t in (x, y))
    loss = latitude_weighted_mse(model(xs, lo), ys)
    loss.backward()
    out = {"had_edge_grad": model.edge.grad is not None}
    try:
        grad_norm(model, verify_group=m.domain_group)
        out["verify"] = "no error"
    except RuntimeError as exc:
        out["verify"] = str(exc)
    sync_domain_gradients(model, m)
    out["grads"] = {k: (None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}
    out["norm"] = grad_norm(model, verify_group=m.domain_group).item()
    clip_grad_norm_(model.parameters(), 0.1)
    out["clipped"] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    # bf16 gradients are summed in fp32: 256 + 1 on domain group 0 and 1 + 1 on group 1, then the dp mean
    # 129.5 rounds to 130 in bf16; bf16 accumulation would give 256 + 1 = 256, then 129.
    p = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    p.grad = torch.tensor([256.0 if rank == 0 else 1.0], dtype=torch.bfloat16)
    sync_domain_gradients([p], m)
    out["bf16"] = p.grad.item()
    # explicit groups, and a group of one (nothing to do)
    q = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    q.grad = torch.full((3,), float(rank), dtype=torch.float64)
    sync_domain_gradients([q], domain_group=m.domain_group)
    out["domain_only"] = q.grad.tolist()
    return portable(out)


def test_sync_domain_gradients_dp2_x_domain2():
    results = run_on_ranks(_sync, 4, timeout=240)
    model = _tiny_model()
    x, y = _tiny_data()
    w = latitude_weights(HS)[:, None]
    ((model(x) - y) ** 2 * w).mean().backward()
    want = {k: (None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}
    total = torch.nn.utils.get_total_norm([g for g in want.values() if g is not None])
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert [r["had_edge_grad"] for r in results] == [True, False, True, False]
    for r in results:
        assert "the ranks disagree on the gradient norm" in r["verify"], "before the sync, every rank says so"
        assert r["grads"]["unused"] is None and want["unused"] is None
        for k, g in want.items():
            if g is not None:
                assert _close(r["grads"][k], g), k
        assert _close(r["norm"], total)
        assert all(_close(r["clipped"][k], clipped[k]) for k in clipped)
        assert r["bf16"] == 130.0
    assert [r["domain_only"] for r in results] == [[1.0] * 3, [1.0] * 3, [5.0] * 3, [5.0] * 3]
