"""halo_interpolate / DomainUpsample on gloo ranks vs F.interpolate of the full field, forward and backward.

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

from halo.plan.partition import split_offsets
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
    from halo.nn.upsample import DomainUpsample, halo_interpolate

    if kind == "module":
        up = nn.Upsample(mode=mode, align_corners=align_corners, **kwargs)
        return up, DomainUpsample(up, group=group)
    if kind == "bilinear2d":
        up = nn.UpsamplingBilinear2d(**kwargs)
        return up, DomainUpsample(up, group=group)
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
    """DomainUpsample (and UpsamplingBilinear2d) with an explicit group; the second group lacks rank 0."""
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
    import halo.nn.base as base_mod  # the layer base agrees and exchanges (run_axes, exchange_axes)
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
                        with virtual_rank(full, parts, r, base_mod) as x:
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
    from halo.nn.upsample import DomainUpsample

    for up in (nn.Upsample(scale_factor=2, mode="bilinear"), nn.UpsamplingNearest2d(size=(20, 8)),
               nn.Upsample(scale_factor=(3, 1.5), mode="bicubic", align_corners=True)):
        layer = DomainUpsample(up)
        assert layer.extra_repr() == up.extra_repr() and layer.state_dict() == {}
        x = torch.randn(2, 3, 11, 9, dtype=torch.float64)
        assert torch.equal(layer(x), up(x))  # one process without torch.distributed: the plain op
    with pytest.raises(TypeError, match="nn.Upsample"):
        DomainUpsample(nn.MaxPool2d(2))


# -- a latitude x longitude mesh: one agreement per call, both axes' maps the global call's kernel's ------------

MESH_CASES = [  # (channels, channels_last, H, W, nn.Upsample arguments)
    # torch's two nearest kernels round these maps apart (H rows 22 and 44 of 66, W column 43 of 86); the global
    # call runs the generic kernel (H + W output > 128, 2 channels) where a block's own call would run the other
    (2, False, 39, 30, dict(size=(66, 86), mode="nearest")),
    (4, True, 39, 30, dict(size=(66, 86), mode="nearest")),  # channels-last, 4 channels: that kernel globally
    (2, False, 26, 30, dict(size=(44, 58), mode="nearest")),  # the channels-last kernel (H + W output <= 128)
    (3, False, 21, 26, dict(scale_factor=2, mode="bilinear")),
    (3, False, 40, 60, dict(scale_factor=2, mode="bilinear")),  # a block's short output padded to the global kernel
    (3, False, 21, 26, dict(scale_factor=(1.5, 0.7), mode="bicubic")),
    (3, True, 21, 26, dict(size=(9, 12), mode="area")),
]


def _mesh_cases(rank, world, shape, cases):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh
    from halo.nn import DomainUpsample
    from halo.plan.partition import local_range
    from halo.testing import HostWorkCounter

    mesh = DomainMesh(shape, periodic=(False, True))

    def block(t):
        (h0, h1), (w0, w1) = (local_range(t.shape[d], mesh.axis_size(a), mesh.axis_rank(a))
                              for a, d in ((0, -2), (1, -1)))
        return t[..., h0:h1, w0:w1]

    out = []
    for i, (c, channels_last, h, w, kw) in enumerate(cases):
        full = torch.randn(2, c, h, w, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        if channels_last:
            full = full.contiguous(memory_format=torch.channels_last)
        up = nn.Upsample(**kw)
        layer = DomainUpsample(up, mesh=mesh)
        xf = full.clone().requires_grad_(True)
        ref = up(xf)
        g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(100 + i), dtype=torch.float64)
        (ref * g).sum().backward()
        x = block(full).clone(memory_format=torch.preserve_format).requires_grad_(True)
        with HostWorkCounter() as counter:
            y = layer(x)
        (y * block(g)).sum().backward()
        want = block(ref.detach())
        # <A x, g> and <x, A^T g> of this rank's part (summed over ranks by the test), for halo and for torch itself
        dots = [float((y.detach() * block(g)).sum()), float((x.detach() * x.grad).sum()),
                float((ref.detach() * g).sum()), float((full * xf.grad).sum())]
        out.append({"agreements": counter.counts.get("agreement", 0), "shape": y.shape == want.shape, "dots": dots,
                    "exact": y.shape == want.shape and torch.equal(y.detach(), want),
                    "fwd": rel_err(y.detach(), want) if y.shape == want.shape else float("inf"),
                    "grad": rel_err(x.grad, block(xf.grad)),
                    "channels_last": y.is_contiguous(memory_format=torch.channels_last) == channels_last})
    return out


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)])
def test_mesh_one_agreement_and_the_global_kernels_maps(shape):
    """DomainUpsample on a latitude x longitude mesh (uneven blocks) plans both axes in one agreement per call (two
    one-axis passes took two), and its nearest maps are those of the kernel the one-call 2-d op runs: bitwise where
    torch's two kernels round apart; linear modes and area within a few ulps, forward and backward, in float64."""
    results = run_on_ranks(_mesh_cases, shape[0] * shape[1], shape, MESH_CASES, timeout=300)
    for i, case in enumerate(MESH_CASES):
        per_rank = [res[i] for res in results]
        assert all(p["agreements"] == 1 for p in per_rank), (case, per_rank)
        assert all(p["shape"] and p["channels_last"] for p in per_rank), (case, per_rank)
        if case[-1]["mode"] == "nearest":
            assert all(p["exact"] for p in per_rank), (case, [p["fwd"] for p in per_rank])
        else:
            assert max(p["fwd"] for p in per_rank) <= 1e-13, (case, per_rank)
        halo_ax, halo_atg = (sum(p["dots"][k] for p in per_rank) for k in (0, 1))
        torch_ax, torch_atg = per_rank[0]["dots"][2:]
        assert abs(halo_ax - halo_atg) <= 1e-12 * abs(halo_ax), (case, halo_ax, halo_atg)  # the exact adjoint
        if abs(torch_ax - torch_atg) <= 1e-12 * abs(torch_ax):
            assert max(p["grad"] for p in per_rank) <= 1e-12, (case, per_rank)
        else:  # torch's nearest backward reads another map than its generic forward kernel (float64: only the
            # forward computes the source index in double): its gradient is not its forward's adjoint; halo's is
            assert case[-1]["mode"] == "nearest" and not case[1], (case, torch_ax, torch_atg)
