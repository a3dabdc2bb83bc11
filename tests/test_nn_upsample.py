"""halo_interpolate / HaloUpsample on gloo ranks vs F.interpolate of the full field, forward and backward.

Tolerances (halo/nn/upsample.py says why):
- forward bitwise for nearest, nearest-exact, area, and bilinear upsampling by a power of two without
  align_corners: the rows are torch's own map, or torch's own op on shift-invariant geometry;
- forward 1e-12 relative (float64) for the other bilinear and bicubic cases: the weights are torch's, but the
  rows are combined with one rounding per term where torch's kernel fuses them (measured: ~1e-15);
- input gradient 1e-12 relative (float64): rows read by two ranks get their partial gradients added by the
  exchange adjoint, in another order than torch's backward.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _helpers import virtual_rank

from halo.partition import split_offsets
from halo.testing import run_on_ranks

H, W = 37, 12

# (mode, align_corners) x interpolation arguments
MODES = [("nearest", None), ("nearest-exact", None), ("bilinear", False), ("bilinear", True),
         ("bicubic", False), ("bicubic", True), ("area", None)]


def sizes_for(h):
    return [{"scale_factor": 2}, {"scale_factor": 3}, {"scale_factor": (2.0, 1.5)}, {"size": (2 * h + 5, 7)},
            {"scale_factor": 2.5, "recompute_scale_factor": True}, {"scale_factor": 0.5}, {"size": (h, 24)}]


def exact_expected(mode, align_corners, kwargs, h):
    """Cases whose forward is bitwise equal by construction."""
    if mode in ("nearest", "nearest-exact", "area"):
        return True
    if mode != "bilinear" or align_corners:
        return False
    if "size" in kwargs:
        return kwargs["size"][0] in (2 * h, 4 * h)
    sf = kwargs["scale_factor"]
    sf = sf[0] if isinstance(sf, tuple) else sf
    return sf in (2, 4) and not kwargs.get("recompute_scale_factor")


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _call(kind, mode, align_corners, kwargs, group):
    from halo.nn.upsample import HaloUpsample, halo_interpolate

    if kind == "module":
        up = nn.Upsample(mode=mode, align_corners=align_corners, **kwargs)
        return up, HaloUpsample(up, group=group)
    if kind == "bilinear2d":
        up = nn.UpsamplingBilinear2d(**kwargs)
        return up, HaloUpsample(up, group=group)
    return (lambda t: F.interpolate(t, mode=mode, align_corners=align_corners, **kwargs),
            lambda t: halo_interpolate(t, mode=mode, align_corners=align_corners, group=group, **kwargs))


def _upsample_cases(rank, world, domain, cases):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo

    manager = halo.initialize_domain_parallel(world, domain)
    r, group = manager.domain_rank, (manager.domain_group if domain < world else None)
    results = []
    for kind, mode, align_corners, kwargs, h, w, seed in cases:
        gen = torch.Generator().manual_seed(seed + manager.dp_rank)
        full = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
        offs = split_offsets(h, domain)
        x = full[..., offs[r]:offs[r + 1], :].clone().requires_grad_(True)
        ref_fn, halo_fn = _call(kind, mode, align_corners, kwargs, group)
        try:
            out = halo_fn(x)
        except (ValueError, NotImplementedError) as exc:
            results.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        xf = full.clone().requires_grad_(True)
        ref = ref_fn(xf)
        o = split_offsets(ref.shape[-2], domain)
        want = ref.detach()[..., o[r]:o[r + 1], :]
        res = {"shape": out.shape == want.shape}
        res["exact"] = res["shape"] and torch.equal(out.detach(), want)
        res["fwd_err"] = rel_err(out.detach(), want) if res["shape"] else float("inf")
        weights = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        (ref * weights).sum().backward()
        (out * weights[..., o[r]:o[r + 1], :]).sum().backward()
        res["grad_err"] = rel_err(x.grad, xf.grad[..., offs[r]:offs[r + 1], :])
        results.append(res)
    return results


def _run(world, cases, domain=None):
    return run_on_ranks(_upsample_cases, world, domain or world, cases, timeout=300)


def _check(results, cases):
    for i, case in enumerate(cases):
        per_rank = [res[i] for res in results]
        assert all("error" not in p for p in per_rank), (case, per_rank)
        assert all(p["shape"] for p in per_rank), case
        _, mode, align_corners, kwargs, h, _, _ = case
        if exact_expected(mode, align_corners, kwargs, h):
            assert all(p["exact"] for p in per_rank), (case, [p["fwd_err"] for p in per_rank])
        else:  # torch's weights, one rounding more per term than torch's fused kernel
            assert max(p["fwd_err"] for p in per_rank) <= 1e-12, (case, [p["fwd_err"] for p in per_rank])
        assert max(p["grad_err"] for p in per_rank) <= 1e-12, (case, [p["grad_err"] for p in per_rank])


@pytest.mark.parametrize("world,h", [(2, H), (3, 45), (4, H), (7, H)])
def test_interpolate_matches_unsharded(world, h):
    """Every mode x (scale 2, 3, per-dim scales, size, recomputed scale, downsampling, size keeping H)."""
    cases = [("fn", mode, ac, kw, h, W, 10 * world + i)
             for i, ((mode, ac), kw) in enumerate((m, k) for m in MODES for k in sizes_for(h))]
    _check(_run(world, cases), cases)


def test_upsample_modules_on_subgroups():
    """HaloUpsample (and UpsamplingBilinear2d) with an explicit group; the second group lacks rank 0."""
    cases = [("module", "nearest", None, {"scale_factor": 2}, H, W, 1),
             ("module", "bilinear", False, {"scale_factor": 2}, H, W, 2),
             ("module", "bilinear", False, {"scale_factor": 3}, H, W, 3),
             ("module", "bicubic", True, {"size": (50, 30)}, H, W, 4),
             ("bilinear2d", "bilinear", True, {"scale_factor": 2}, H, W, 5)]
    _check(_run(4, cases, domain=2), cases)


def test_errors_agree_on_every_rank():
    cases = [("fn", "bilinear", False, {"size": (2, W)}, H, W, 1),  # 2 output rows on 3 ranks
             ("fn", "nearest", None, {"scale_factor": (0.05, 1.0)}, H, W, 2),  # 1 row
             ("fn", "bilinear", False, {"scale_factor": 0.5, "antialias": True}, H, W, 3),
             ("fn", "bilinear", False, {"scale_factor": 2}, H, W, 4)]  # fine
    results = _run(3, cases)
    for i, expected in enumerate(["ValueError", "ValueError", "NotImplementedError"]):
        errors = [res[i].get("error") for res in results]
        assert all(e is not None and e.startswith(expected) for e in errors), errors
        assert len(set(errors)) == 1, errors
    assert "use at most 2 ranks" in results[0][0]["error"]
    _check([res[3:] for res in results], cases[3:])


# -- one process: the exchange replaced by slices of the full field (forward only, many configurations) ----

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6)])
def test_interpolate_sweep_one_process(dtype, tol):
    """Many heights (odd, even, 1-2 rows per rank) x modes x sizes on 2, 3 and 7 virtual ranks, float64 and
    float32: bitwise where promised, else within a few ulps (tol: float64 1e-14, float32 2e-6 relative)."""
    import halo.nn.pool as pool_mod
    import halo.nn.upsample as up_mod

    failures, count = [], 0
    for h in (7, 13, 21, 44, 100):
        full = torch.randn(1, 2, h, 9, generator=torch.Generator().manual_seed(h), dtype=dtype)
        for mode, ac in MODES:
            for kw in sizes_for(h) + [{"size": (3 * h - 1, 9)}, {"scale_factor": 4}, {"size": (h // 3 + 2, 5)}]:
                ref = F.interpolate(full, mode=mode, align_corners=ac, **kw)
                for parts in (2, 3, 7):
                    if ref.shape[-2] < parts:
                        continue
                    outs = []
                    for r in range(parts):
                        with virtual_rank(full, parts, r, up_mod) as x, virtual_rank(full, parts, r, pool_mod):
                            outs.append(up_mod.halo_interpolate(x, mode=mode, align_corners=ac, **kw))
                    got = torch.cat(outs, dim=-2)
                    count += 1
                    exact = exact_expected(mode, ac, kw, h)
                    if got.shape != ref.shape or (not torch.equal(got, ref) if exact else rel_err(got, ref) > tol):
                        failures.append((h, mode, ac, kw, parts, got.shape, rel_err(got, ref)))
    assert not failures, failures[:10]
    assert count > 500


def test_row_taps_agree_with_torch():
    """The H weights of the explicit path against torch's, read off F.interpolate of one-hot rows: bilinear
    bitwise; bicubic within 16 ulps (torch's kernel evaluates the cubic polynomials with its own fusions)."""
    from halo.nn.upsample import kernel_scales, row_taps

    for dtype in (torch.float64, torch.float32):
        for n, kw in [(37, {"scale_factor": 3}), (45, {"size": (100, 1)}), (721, {"scale_factor": 1.5}),
                      (13, {"scale_factor": 0.7})]:
            for mode, ac in [("bilinear", False), ("bilinear", True), ("bicubic", False), ("bicubic", True)]:
                eye = torch.eye(n, dtype=dtype).view(n, 1, n, 1)  # batch b: the one-hot row b
                scale_h = kernel_scales(kw.get("size"), kw.get("scale_factor"), None)[0]
                if "scale_factor" in kw:
                    kw2 = {"scale_factor": (kw["scale_factor"], 1.0)}
                else:
                    kw2 = kw
                dense = F.interpolate(eye, mode=mode, align_corners=ac, **kw2)[:, 0, :, 0].T  # (m, n)
                rows, weights = row_taps(n, dense.shape[0], scale_h, mode, ac, dtype)
                mine = torch.zeros_like(dense)
                mine.scatter_add_(1, rows, weights)
                err = (mine - dense).abs().max().item()
                if mode == "bilinear":
                    assert torch.equal(mine, dense), (dtype, n, kw, mode, ac, err)
                else:
                    assert err <= 16 * torch.finfo(dtype).eps, (dtype, n, kw, mode, ac, err)


def test_module_surface():
    from halo.nn.upsample import HaloUpsample

    for up in (nn.Upsample(scale_factor=2, mode="bilinear"), nn.UpsamplingNearest2d(size=(20, 8)),
               nn.Upsample(scale_factor=(3, 1.5), mode="bicubic", align_corners=True)):
        layer = HaloUpsample(up)
        assert layer.extra_repr() == up.extra_repr() and layer.state_dict() == {}
        x = torch.randn(2, 3, 11, 9, dtype=torch.float64)
        assert torch.equal(layer(x), up(x))  # one process without torch.distributed: the plain op
    with pytest.raises(TypeError, match="nn.Upsample"):
        HaloUpsample(nn.MaxPool2d(2))
