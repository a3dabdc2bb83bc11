"""Across a pole with W sharded: compute-then-patch of a conv, and the overlapped PoleExchanger, vs the unsharded.

Reference: the full field with the rows across the pole (``pole``: rows 1, 2, ... mirrored; ``pole_centered``:
rows 0, 1, ...) rolled by W/2, then W padded circularly, and ``F.conv2d`` with no padding (tests/test_mesh2d_layers'
reference). Each rank runs a ``DomainConv2d(boundary=..., mesh=...)`` on its block at an odd H and even W (13 x 16
over 2 x 2, 3 x 2 and 2 x 3 ranks), float64: the output block, the input gradient block and the parameter gradients
summed over the domain group, to rounding. Counted on every rank: the convs that took compute-then-patch
(``halo.nn.conv.patch_conv_2d``), so a fall back to pad-then-conv fails the test, and the PoleExchanger starts that
posted the roll with the latitude exchange (overlapped) or after it (serial). Blocks of one row (H = 2 or 3 over as
many ranks: the mirrored rows are another rank's) take the serial path, still exact; ``pad-then-conv`` (overlap
off) runs the exchanger's ``finish`` / ``adjoint`` both ways. Dot-product tests: ``<E x, v> = <x, E^T v>`` summed
over the ranks, for the exchanger's ``finish`` / ``adjoint`` and its ``halos`` / ``start_adjoint`` /
``finish_adjoint`` (what compute-then-patch uses), overlapped and serial. One launch per mesh, shared.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from halo.plan.partition import local_range, split_sizes
from halo.testing import run_on_ranks

TOL = 1e-11
W = 16

# (kernel, dilation, boundary, H, overlap[, channels_last]): H = 13 is odd; H = 0 stands for as many rows as mesh
# rows (blocks of one row, whose rows across the pole mirror another rank's).
CONVS = [(3, 1, "pole", 13, True), (3, 2, "pole", 13, True), (3, 1, "pole_centered", 13, True, True),
         (3, 2, "pole_centered", 13, False), (3, 1, "pole", 0, True), (3, 1, "pole", 0, False)]


def _block(t, mesh):
    (h0, h1), (w0, w1) = (local_range(t.shape[d], mesh.axis_size(a), mesh.axis_rank(a)) for a, d in ((0, -2), (1, -1)))
    return t[..., h0:h1, w0:w1]


def _pole_reference(x, conv, boundary):
    k, n, w = (1 if boundary == "pole" else 0), x.shape[-2], x.shape[-1]
    p = conv.padding[0]
    north = x.narrow(-2, k, p).flip(-2).roll(w // 2, -1)
    south = x.narrow(-2, n - k - p, p).flip(-2).roll(w // 2, -1)
    xp = F.pad(torch.cat([north, x, south], dim=-2), (conv.padding[1], conv.padding[1], 0, 0), mode="circular")
    return F.conv2d(xp, conv.weight, conv.bias, conv.stride, 0, conv.dilation)


def _conv_case(mesh, case, seed, counts):
    import torch.distributed as dist

    from halo.nn import DomainConv2d

    k, dil, boundary, h, overlap, *cl = case
    fmt = torch.channels_last if cl else torch.contiguous_format
    h = h or mesh.axis_size(0)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(2, 3, h, W, generator=gen, dtype=torch.float64)
    conv = nn.Conv2d(3, 4, k, padding=dil * (k // 2), dilation=dil, padding_mode="circular").double()
    xf = full.clone().requires_grad_(True)
    yr = _pole_reference(xf, conv, boundary)
    g = torch.randn(yr.shape, generator=gen, dtype=torch.float64)
    (yr * g).sum().backward()
    pref = [p.grad.clone() for p in conv.parameters()]
    conv.zero_grad(set_to_none=True)
    before = dict(counts)
    x = _block(full, mesh).clone(memory_format=fmt).requires_grad_(True)
    y = DomainConv2d(conv, boundary=boundary, mesh=mesh, overlap=overlap)(x)
    (y * _block(g, mesh)).sum().backward()
    assert y.is_contiguous(memory_format=fmt)
    pg = [p.grad.clone() for p in conv.parameters()]
    for t in pg:
        dist.all_reduce(t, group=mesh.domain_group)
    want = _block(yr.detach(), mesh)
    err = max([float((y - want).abs().max()) if y.shape == want.shape else float("inf"),
               float((x.grad - _block(xf.grad, mesh)).abs().max())]
              + [float((a - b).abs().max()) for a, b in zip(pg, pref, strict=True)])
    return {"err": err, **{key: counts[key] - before[key] for key in counts}}


def _exchanger(mesh, h, p, boundary):
    from halo.exchange import get_exchanger, plan_exchange_2d
    from halo.plan.partition import offsets

    sizes = (tuple(split_sizes(h, mesh.axis_size(0))), tuple(split_sizes(W, mesh.axis_size(1))))
    needs = tuple(tuple((o[r] - p, o[r + 1] + p) for r in range(len(s))) for s, o in ((s, offsets(s)) for s in sizes))
    plan = plan_exchange_2d((mesh.axis_group(0), mesh.axis_group(1)), sizes, needs, (boundary, "circular"), (2, 3),
                            "test_pole_patch")
    return get_exchanger(plan.h)


def _dot_case(mesh, h, p, boundary, seed):
    """``<E x, v>`` and ``<x, E^T v>`` on this rank (summed over the ranks by the parent), both interfaces."""
    from halo.exchange import PoleExchanger

    ex = _exchanger(mesh, h or mesh.axis_size(0), p, boundary)
    gen = torch.Generator().manual_seed(seed * 41 + mesh.domain_rank)
    x = _block(torch.zeros(2, 3, h or mesh.axis_size(0), W, dtype=torch.float64), mesh)
    x = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    ext = ex.finish(x, ex.start(x))
    v = torch.randn(ext.shape, generator=gen, dtype=torch.float64)
    gx = ex.adjoint(v, x.shape)
    before, after = ex.halos(x, ex.start(x))
    gb, ga = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (before, after))
    gh = ex.finish_adjoint(ex.start_adjoint(gb, ga, x), torch.zeros_like(x), None)
    pole = bool(ex.spec.top or ex.spec.bottom) if isinstance(ex, PoleExchanger) else False
    return {"pole": pole, "own": pole and ex.own is not None,
            "dot": ((ext * v).sum().item(), (x * gx).sum().item()),
            "dot_halos": ((before * gb).sum().item() + (after * ga).sum().item(), (x * gh).sum().item())}


def _ranks(rank, world, shape):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh
    from halo.exchange import PoleExchanger
    from halo.nn import conv as conv_module

    counts = {"patch": 0, "overlapped": 0, "serial": 0}
    patch = conv_module.patch_conv_2d

    def counted_patch(*args, **kwargs):
        counts["patch"] += 1
        return patch(*args, **kwargs)

    start = PoleExchanger.start

    def counted_start(self, x):
        pending = start(self, x)
        if self.spec.top or self.spec.bottom:
            counts["overlapped" if "roll" in pending else "serial"] += 1
        return pending

    conv_module.patch_conv_2d, PoleExchanger.start = counted_patch, counted_start
    mesh = DomainMesh(shape, periodic=(False, True))
    return {"convs": [_conv_case(mesh, case, 10 + i, counts) for i, case in enumerate(CONVS)],
            "dots": [_dot_case(mesh, h, p, b, i) for i, (h, p, b) in
                     enumerate(((13, 2, "pole"), (13, 1, "pole_centered"), (0, 1, "pole")))]}


LAUNCHES = [(2, 2), (3, 2), (2, 3)]  # (2, 3): W = 16 as 6 + 5 + 5, a roll from two ranks, wrapping


@pytest.fixture(scope="module", params=LAUNCHES)
def launch(request):
    shape = request.param
    return shape, run_on_ranks(_ranks, shape[0] * shape[1], shape, timeout=180)


def test_pole_conv_patches_and_equals_the_unsharded_conv(launch):
    shape, results = launch
    for i, case in enumerate(CONVS):
        per = [r["convs"][i] for r in results]
        assert max(p["err"] for p in per) <= TOL, (shape, case, [p["err"] for p in per])
        overlap, thin = case[4], case[3] == 0
        # compute-then-patch taken (once per conv) when overlap is on; pad-then-conv (the exchanger's finish) not
        assert all(p["patch"] == (1 if overlap else 0) for p in per), (shape, case, per)
        # the pole ranks (first and last mesh row) start one exchange each: overlapped, or serial for 1-row blocks
        pole_ranks = [r for r in range(len(per)) if r // shape[1] in (0, shape[0] - 1)]
        for r, p in enumerate(per):
            want = (0, 1) if thin else (1, 0)
            got = (p["overlapped"], p["serial"])
            assert got == (want if r in pole_ranks else (0, 0)), (shape, case, r, got)


def test_pole_exchanger_is_its_adjoint(launch):
    shape, results = launch
    for i in range(3):
        per = [r["dots"][i] for r in results]
        assert any(p["pole"] for p in per)
        assert all(p["own"] == (i < 2) for p in per if p["pole"]), (shape, i, per)  # 1-row blocks: serial
        for key in ("dot", "dot_halos"):
            lhs, rhs = sum(p[key][0] for p in per), sum(p[key][1] for p in per)
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (shape, i, key, lhs, rhs)
