"""Domain-parallel norms on gloo ranks vs the unsharded torch module in the same process, forward and backward.

Float64 tolerance 1e-12 relative to the tensor's scale: the statistics are the same sums in a different order
(each rank's var_mean, then a combine across ranks in rank order, where torch reduces the whole tensor at
once); measured errors are ~1e-15. Parameter gradients are summed over ranks (what sync_domain_gradients does)
and compared with the unsharded gradient; running statistics after 2 training steps, and the eval-mode output,
on every rank. bf16 input: fp32 statistics, bf16 output, vs the fp32 reference on the same (bf16) values: the
output is the accurate value rounded once to bf16, so within 2**-8 (bf16's unit roundoff) of the output's
scale, plus 1e-4 for the fp32 arithmetic; statistics rounded to bf16 (values around 100 with unit spread) miss
this by 4-6x (measured 1.5e-2 to 2.4e-2), and their running statistics miss the 1e-5 bound by 60x.
"""

import copy

import pytest
import torch
from _helpers import portable
from torch import nn

from halo.nn.norm import DomainBatchNorm2d, DomainGroupNorm, DomainInstanceNorm2d, DomainLayerNorm
from halo.plan.partition import local_range
from halo.testing import run_on_ranks

DOMAIN = {nn.GroupNorm: DomainGroupNorm, nn.BatchNorm2d: DomainBatchNorm2d,
          nn.InstanceNorm2d: DomainInstanceNorm2d, nn.LayerNorm: DomainLayerNorm}
W = 5
BF16_TOL = 2 ** -8 + 1e-4


def _err(a, b):
    """max |a - b| relative to the scale of b (at least 1)."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1)).item() if b.numel() else 0.0


def _make(kind, kwargs, seed, dtype=torch.float64):
    torch.manual_seed(seed)
    m = getattr(nn, kind)(**kwargs).to(dtype)
    with torch.no_grad():  # non-trivial affine parameters and running statistics
        for p in m.parameters():
            p.uniform_(0.5, 1.5)
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return m


def _norm_cases(rank, world, cases, dp_layout=None):
    """Per case: 2 training steps (forward, backward of a random weighting), then eval; the unsharded module
    on the full tensors beside it. ``dp_layout``: ``(domain, batch sizes per dp rank)`` for dp x domain."""
    import halo

    domain = world if dp_layout is None else dp_layout[0]
    m = halo.initialize_domain_parallel(world, domain)
    out = []
    for kind, kwargs, shape, opts in cases:
        seed = opts.get("seed", 0)
        dtype, param_dtype = opts.get("dtype", torch.float64), opts.get("param_dtype")
        ref = _make(kind, kwargs, seed, torch.float64 if dtype == torch.float64 else torch.float32)
        if param_dtype is not None:  # the reference uses the same (rounded) parameter values, in fp32
            ref.load_state_dict({k: v.to(param_dtype) if v.is_floating_point() else v
                                 for k, v in ref.state_dict().items()})
        src = copy.deepcopy(ref).to(param_dtype) if param_dtype is not None else copy.deepcopy(ref)
        dom = DOMAIN[type(ref)](src, **opts.get("domain_kwargs", {}))
        res = {"state_keys": list(dom.state_dict()) == list(ref.state_dict()),
               "state_equal": all(torch.equal(a.to(b.dtype), b) for a, b in
                                  zip(dom.state_dict().values(), ref.state_dict().values(), strict=True))}
        h = shape[-2]
        lo, hi = local_range(h, domain, m.domain_rank)
        if dp_layout is not None:
            b0 = sum(dp_layout[1][:m.dp_rank])
            batch = slice(b0, b0 + dp_layout[1][m.dp_rank])
        else:
            batch = slice(None)
        gen = torch.Generator().manual_seed(seed + 1)
        errs = {"out": 0.0, "grad": 0.0}
        for _ in range(2):
            xf = (opts.get("offset", 3.0) + torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
            yf = torch.randn(shape, generator=gen, dtype=torch.float64)
            x = xf[batch, ..., lo:hi, :].clone().requires_grad_(True)
            y = dom(x)
            (y.double() * yf[batch, ..., lo:hi, :]).sum().backward()
            xr = xf.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
            yr = ref(xr)
            (yr.double() * yf).sum().backward()
            res["dtype"] = str(y.dtype)
            errs["out"] = max(errs["out"], _err(y, yr[batch, ..., lo:hi, :]))
            errs["grad"] = max(errs["grad"], _err(x.grad, xr.grad[batch, ..., lo:hi, :]))
        res.update(errs)
        res["param_grads"] = {k: p.grad for k, p in dom.named_parameters()}
        res["ref_grads"] = {k: p.grad for k, p in ref.named_parameters()}
        res["buffers"] = {k: _err(b, dict(ref.named_buffers())[k]) for k, b in dom.named_buffers()}
        res["buffers_exact"] = {k: torch.equal(b, dict(ref.named_buffers())[k])
                                for k, b in dom.named_buffers() if "num_batches" in k}
        dom.eval()
        ref.eval()
        with torch.no_grad():
            res["eval"] = _err(dom(xf[batch, ..., lo:hi, :]), ref(xr.detach())[batch, ..., lo:hi, :])
            res["eval_deepcopy"] = _err(copy.deepcopy(dom)(xf[batch, ..., lo:hi, :]),
                                        ref(xr.detach())[batch, ..., lo:hi, :])
        out.append(res)
    return portable(out)


def _check(results, cases, tol=1e-12, buffer_tol=None):
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        for r in per_rank:
            assert r["state_keys"] and r["state_equal"], case
            assert r["out"] <= tol and r["grad"] <= tol, (case, r["out"], r["grad"])
            assert r["eval"] <= tol and r["eval_deepcopy"] <= tol, (case, r["eval"])
            assert all(e <= (buffer_tol or tol) for e in r["buffers"].values()), (case, r["buffers"])
            assert all(r["buffers_exact"].values()), case
        for k, want in per_rank[0]["ref_grads"].items():
            got = sum(torch.as_tensor(r["param_grads"][k]) for r in per_rank)
            assert _err(got, want) <= tol, (case, k, _err(got, want))


def _cases(h):
    c, b = 4, 2
    shape = (b, c, h, W)
    return [
        ("GroupNorm", dict(num_groups=2, num_channels=c), shape, {}),
        ("GroupNorm", dict(num_groups=4, num_channels=c, affine=False), shape, {"seed": 1}),
        ("GroupNorm", dict(num_groups=1, num_channels=c), (3, c, 2, h, W), {"seed": 2}),  # 5-d: (B, C, D, H, W)
        ("BatchNorm2d", dict(num_features=c), shape, {}),
        ("BatchNorm2d", dict(num_features=c, momentum=None), shape, {"seed": 3}),
        ("BatchNorm2d", dict(num_features=c, affine=False, track_running_stats=False), shape, {"seed": 4}),
        ("InstanceNorm2d", dict(num_features=c, affine=True, track_running_stats=True), shape, {}),
        ("InstanceNorm2d", dict(num_features=c, affine=True, momentum=None, track_running_stats=True), shape,
         {"seed": 5}),
        ("InstanceNorm2d", dict(num_features=c), shape, {"seed": 6}),
        ("InstanceNorm2d", dict(num_features=c, affine=True), (c, h, W), {"seed": 7}),  # unbatched
        ("LayerNorm", dict(normalized_shape=(c, h, W)), shape, {}),
        ("LayerNorm", dict(normalized_shape=(h, W), bias=False), shape, {"seed": 8}),
        ("LayerNorm", dict(normalized_shape=(c, h, W), elementwise_affine=False), shape, {"seed": 9}),
    ]


@pytest.mark.parametrize("world,h", [(2, 37), (3, 45), (4, 37)])
def test_norms_match_unsharded_float64(world, h):
    cases = _cases(h)
    _check(run_on_ranks(_norm_cases, world, cases, timeout=240), cases)


def test_batchnorm_dp2_x_domain2_equals_full_batch():
    """Batches of 3 and 2 samples on the two dp groups: statistics over all 5 samples and the whole domain."""
    c = 4
    cases = [("BatchNorm2d", dict(num_features=c), (5, c, 37, W), {}),
             ("BatchNorm2d", dict(num_features=c, momentum=None), (5, c, 37, W), {"seed": 1}),
             ("GroupNorm", dict(num_groups=2, num_channels=c), (5, c, 37, W), {"seed": 2}),
             ("LayerNorm", dict(normalized_shape=(c, 37, W)), (5, c, 37, W), {"seed": 3})]
    _check(run_on_ranks(_norm_cases, 4, cases, (2, (3, 2)), timeout=240), cases)


def _per_dp_group(rank, world):
    """sync_dp=False: each dp group normalises its own batch."""
    import halo

    m = halo.initialize_domain_parallel(world, 2)
    ref = _make("BatchNorm2d", dict(num_features=3), 0)
    dom = DomainBatchNorm2d(copy.deepcopy(ref), sync_dp=False)
    x = torch.randn(4, 3, 37, W, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lo, hi = local_range(37, 2, m.domain_rank)
    mine = x[2 * m.dp_rank:2 * m.dp_rank + 2]
    return portable({"out": _err(dom(mine[..., lo:hi, :]), ref(mine)[..., lo:hi, :]),
                     "running": _err(dom.running_var, ref.running_var)})


def test_batchnorm_without_dp_sync():
    for r in run_on_ranks(_per_dp_group, 4, timeout=120):
        assert r["out"] <= 1e-12 and r["running"] <= 1e-12, r


@pytest.mark.parametrize("world", [3])
def test_norms_bf16_input(world):
    """bf16 input around 100 with unit spread (fp32 or bf16 parameters): fp32 statistics, bf16 output."""
    h, c = 45, 4
    shape = (2, c, h, W)
    bf16 = {"dtype": torch.bfloat16, "offset": 100.0}
    cases = [("GroupNorm", dict(num_groups=2, num_channels=c), shape, bf16),
             ("BatchNorm2d", dict(num_features=c), shape, bf16),
             ("InstanceNorm2d", dict(num_features=c, affine=True, track_running_stats=True), shape, bf16),
             ("LayerNorm", dict(normalized_shape=(c, h, W)), shape, bf16),
             ("GroupNorm", dict(num_groups=2, num_channels=c), shape, {**bf16, "param_dtype": torch.bfloat16}),
             ("LayerNorm", dict(normalized_shape=(c, h, W)), shape, {**bf16, "param_dtype": torch.bfloat16})]
    results = run_on_ranks(_norm_cases, world, cases, timeout=240)
    for i, case in enumerate(cases):
        for r in (res[i] for res in results):
            assert r["dtype"] == "torch.bfloat16", case
            assert r["out"] <= BF16_TOL and r["eval"] <= BF16_TOL, (case, r["out"], r["eval"])
            assert all(e <= 1e-5 for e in r["buffers"].values()), (case, r["buffers"])


# -- errors and single-process behaviour ---------------------------------------------------------------------

def _errors(rank, world):
    import halo

    halo.initialize_domain_parallel(world, world)
    out = {}
    ln = DomainLayerNorm(nn.LayerNorm((2, 40, W)).double())
    try:
        ln(torch.randn(1, 2, local_range(37, world, rank)[1] - local_range(37, world, rank)[0], W,
                       dtype=torch.float64))
    except ValueError as exc:
        out["layer"] = str(exc)
    gn = DomainGroupNorm(2, 4).double()
    try:  # one rank has a different W: every rank raises the same error, none hangs
        gn(torch.randn(1, 4, 10, W + (rank == 1), dtype=torch.float64))
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def test_errors_are_raised_on_every_rank():
    results = run_on_ranks(_errors, 3, timeout=120)
    for r in results:
        assert "normalized_shape (2, 40, 5) (global) but the input's last 3 dims are (2, 37, 5)" in r["layer"]
        assert "the ranks of the group disagree" in r["mismatch"]
    assert len({r["mismatch"] for r in results}) == 1


def test_single_process_equals_torch_and_shares_state():
    x = torch.randn(2, 4, 9, W, dtype=torch.float64) + 2
    for ref in (_make("GroupNorm", dict(num_groups=2, num_channels=4), 0),
                _make("BatchNorm2d", dict(num_features=4, momentum=None), 0),
                _make("InstanceNorm2d", dict(num_features=4, affine=True, track_running_stats=True), 0),
                _make("LayerNorm", dict(normalized_shape=(4, 9, W)), 0)):
        twin = copy.deepcopy(ref)
        dom = DOMAIN[type(ref)](twin)
        assert isinstance(dom, type(ref))
        assert all(a is b for a, b in zip(dom.state_dict(keep_vars=True).values(),
                                          twin.state_dict(keep_vars=True).values(), strict=True)), \
            "the converted module shares the original's parameters and buffers"
        for _ in range(2):
            assert _err(dom(x), ref(x)) <= 1e-12
        assert all(_err(a, b) <= 1e-12 for a, b in zip(dom.state_dict().values(), ref.state_dict().values(),
                                                       strict=True))
    built = DomainBatchNorm2d(4, momentum=None).double()
    assert built.momentum is None and isinstance(built, nn.BatchNorm2d)
    with pytest.raises(TypeError, match="takes no other arguments"):
        DomainGroupNorm(nn.GroupNorm(2, 4), 3)
    ln = DomainLayerNorm(nn.LayerNorm(W))  # over W only: pointwise in latitude
    assert _err(ln(x.float()), nn.functional.layer_norm(x.float(), (W,))) <= 1e-6


def _large_mean(rank, world):
    """fp32 input 250 + 0.1 noise (temperature in K): sharded output and input gradient vs the float64 truth,
    and vs the unsharded fp32 torch module."""
    import halo

    m = halo.initialize_domain_parallel(world, world)
    shape, out = (2, 4, 37, 8), {}
    gen = torch.Generator().manual_seed(0)
    xf = (250 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)).float().double()  # fp32 values
    gf = torch.randn(shape, generator=gen, dtype=torch.float64)
    lo, hi = local_range(shape[-2], world, m.domain_rank)
    for kind, kwargs in (("GroupNorm", dict(num_groups=2, num_channels=4)),
                         ("InstanceNorm2d", dict(num_features=4, affine=True))):
        ref32 = _make(kind, kwargs, 0, torch.float32)
        ref64 = copy.deepcopy(ref32).double()
        dom = DOMAIN[type(ref32)](copy.deepcopy(ref32))
        res = {}
        for name, mod, dtype, local in (("dom", dom, torch.float32, True), ("ref32", ref32, torch.float32, False),
                                        ("ref64", ref64, torch.float64, False)):
            x = xf.to(dtype)
            x = (x[..., lo:hi, :] if local else x).clone().requires_grad_(True)
            y = mod(x)
            (y.double() * (gf[..., lo:hi, :] if local else gf)).sum().backward()
            res[name] = (y.detach(), x.grad) if local else (y.detach()[..., lo:hi, :], x.grad[..., lo:hi, :])
        out[kind] = {f"{a}_{i}": _err(res[a][i], res["ref64"][i]) for a in ("dom", "ref32") for i in (0, 1)}
        out[kind]["dom_vs_ref32"] = _err(res["dom"][0], res["ref32"][0])
    return out


def test_large_mean_float32_stays_accurate():
    """Mean 250 against spread 0.1 (temperature in K): fp32 resolves the normalised values only to
    ``u = 2**-24 * 250 / 0.1 ~ 1.5e-4`` (an ulp of 250 over the spread; the unsharded torch module's error is
    ~5e-5). The sharded layers (combined (mean, M2), centred normalisation) stay within that rounding of the
    float64 truth on the same fp32 values (measured ~2e-5 output, ~1e-5 gradient) and of the unsharded fp32
    module. ``E[x^2] - E[x]^2`` in fp32 would lose all of fp32's bits here (checked below)."""
    u = 2 ** -24 * 250 / 0.1
    x = 250 + 0.1 * torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    naive = (x * x).mean() - x.mean() ** 2
    assert abs(naive.item() / x.double().var(correction=0).item() - 1) > 0.1, "the input is not ill-conditioned"
    for r in run_on_ranks(_large_mean, 2, timeout=120):
        for kind, e in r.items():
            assert e["dom_0"] <= u and e["dom_1"] <= u, (kind, e)
            assert e["dom_vs_ref32"] <= 2 * u, (kind, e)


# -- one plan over every axis: the norms on a latitude x longitude mesh -------------------------------------------

def _mesh_norms(rank, world, shape):
    """Each norm built with ``mesh=`` on a block of the field (H and W both split unevenly), vs the unsharded module:
    output block, input-gradient block, and parameter gradients summed over the domain group."""
    import torch.distributed as dist

    from halo.dist.mesh import DomainMesh

    mesh = DomainMesh(shape, periodic=(False, True))
    h, w, c = 11, 7, 4
    (h0, h1), (w0, w1) = (local_range(n, mesh.axis_size(a), mesh.axis_rank(a)) for a, n in ((0, h), (1, w)))
    out = {}
    for kind, kwargs in (("LayerNorm", dict(normalized_shape=(c, h, w))), ("GroupNorm", dict(num_groups=2,
                         num_channels=c)), ("BatchNorm2d", dict(num_features=c)),
                         ("InstanceNorm2d", dict(num_features=c, affine=True))):
        ref = _make(kind, kwargs, 5)
        dom = DOMAIN[type(ref)](copy.deepcopy(ref), mesh=mesh)
        full = 3 + torch.randn(2, c, h, w, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        g = torch.randn(2, c, h, w, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        xf = full.clone().requires_grad_(True)
        (ref(xf) * g).sum().backward()
        x = full[..., h0:h1, w0:w1].clone().requires_grad_(True)
        y = dom(x)
        (y * g[..., h0:h1, w0:w1]).sum().backward()
        errs = [_err(y, ref(full).detach()[..., h0:h1, w0:w1]), _err(x.grad, xf.grad[..., h0:h1, w0:w1])]
        for p, q in zip(dom.parameters(), ref.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=mesh.domain_group)
            errs.append(_err(grad, q.grad))
        out[kind] = max(errs)
    return out


@pytest.mark.parametrize("shape", [(2, 2), (3, 1), (1, 2)])
def test_norms_on_a_mesh_equal_unsharded(shape):
    """The norms' one plan over every axis: statistics over the whole domain (every block), DomainLayerNorm's
    elementwise affine sliced along H and W, on 2 x 2, 3 x 1 and 1 x 2 meshes at odd sizes."""
    for r in run_on_ranks(_mesh_norms, shape[0] * shape[1], shape, timeout=180):
        for kind, e in r.items():
            assert e <= 1e-12, (shape, kind, e)
