"""Compute-then-patch on a latitude x longitude mesh (halo.nn.patch2d) vs the unsharded conv, forward and backward.

Reference: the full field padded by the boundary modes (H first, then W: the two paddings commute, so the corners
are the same either way), ``F.conv2d`` with no padding. Each rank convolves its block with ``patch_conv_2d`` and
returns its errors; the parent compares: the output block, the input gradient block, the weight and bias gradients
summed over the ranks, all in float64 to rounding (the sums run in another order than torch's). A dot-product test
checks that the Function's backward is the adjoint of its forward as a linear map of ``x`` (the sums over ranks of
``<A x, v>`` and ``<x, A^T v>``). Uneven blocks on every axis (13 x 17 over 2 or 3 ranks), kernels 3 and 5,
dilation 2, groups 2, one axis with ``p = 0``; one launch per mesh (every case in it), shared by the tests.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from halo.plan.partition import local_range, split_sizes
from halo.testing import run_on_ranks

TOL = 1e-11
H, W = 13, 17

# (kernel, dilation, groups, (boundary H, boundary W), bias[, channels_last])
CASES = [
    ((3, 3), (1, 1), 1, ("zeros", "circular"), True),
    ((3, 3), (1, 1), 1, ("zeros", "circular"), True, True),  # a channels_last block (and gradient)
    ((5, 5), (1, 1), 1, ("reflect", "zeros"), True),
    ((3, 3), (2, 2), 2, ("zeros", "circular"), False),
    ((5, 3), (2, 1), 2, ("reflect", "zeros"), True),   # p_h = 4: the strips' (j-1)d zero rows
    ((3, 5), (1, 2), 1, ("replicate", "reflect"), True),  # p_w = 4
    ((1, 3), (1, 1), 1, ("zeros", "circular"), True),   # p_h = 0: only W exchanged, no corners
    ((3, 1), (1, 1), 2, ("circular", "zeros"), False),  # p_w = 0: only H exchanged
]


def _pad(t, p, boundaries):
    (ph, pw), (bh, bw) = p, boundaries
    mode = {"zeros": "constant"}
    t = F.pad(t, (0, 0, ph, ph), mode=mode.get(bh, bh))
    return F.pad(t, (pw, pw, 0, 0), mode=mode.get(bw, bw))


def _block(t, mesh):
    (h0, h1), (w0, w1) = (local_range(t.shape[d], mesh.axis_size(a), mesh.axis_rank(a)) for a, d in ((0, -2), (1, -1)))
    return t[..., h0:h1, w0:w1]


def _case(mesh, case, seed):
    from halo.nn.patch2d import patch_2d_applies, patch_conv_2d, plan_patch_2d

    k, d, g, boundaries, with_bias, *fmt = case
    gen = torch.Generator().manual_seed(seed)
    cin, cout = 4, 6
    full = torch.randn(2, cin, H, W, generator=gen, dtype=torch.float64)
    weight = torch.randn(cout, cin // g, *k, generator=gen, dtype=torch.float64)
    bias = torch.randn(cout, generator=gen, dtype=torch.float64) if with_bias else None
    grad_out = torch.randn(2, cout, H, W, generator=gen, dtype=torch.float64)
    p = tuple(di * (ki - 1) // 2 for ki, di in zip(k, d, strict=True))
    xf, wf = full.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    bf = bias.clone().requires_grad_(True) if with_bias else None
    ref = F.conv2d(_pad(xf, p, boundaries), wf, bf, 1, 0, d, g)
    (ref * grad_out).sum().backward()

    sizes = (split_sizes(H, mesh.axis_size(0)), split_sizes(W, mesh.axis_size(1)))
    groups = (mesh.axis_group(0), mesh.axis_group(1))
    applies = patch_2d_applies(sizes, k, (1, 1), d, [(pp, pp) for pp in p], boundaries)
    plan = plan_patch_2d(groups, sizes, k, d, boundaries)
    fmt = torch.channels_last if fmt else torch.contiguous_format
    x = _block(full, mesh).clone(memory_format=fmt).requires_grad_(True)
    wl = weight.clone().requires_grad_(True)
    bl = bias.clone().requires_grad_(True) if with_bias else None
    y = patch_conv_2d(x, wl, bl, plan.ex_h, plan.ex_w, plan.pad, d, g, ex_c=plan.ex_c)
    y.backward(_block(grad_out, mesh).contiguous(memory_format=fmt))

    # The adjoint: A x = the conv without bias; <A x, v> and <x, A^T v> summed over the ranks must agree.
    u = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed * 31 + mesh.domain_rank),
                    dtype=torch.float64).requires_grad_(True)
    v = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed * 37 + mesh.domain_rank),
                    dtype=torch.float64)
    au = patch_conv_2d(u, weight, None, plan.ex_h, plan.ex_w, plan.pad, d, g, ex_c=plan.ex_c)
    (atv,) = torch.autograd.grad(au, u, v)
    return {
        "applies": applies,
        "fwd": (y.detach() - _block(ref.detach(), mesh)).abs().max().item(),
        "xgrad": (x.grad - _block(xf.grad, mesh)).abs().max().item(),
        "wgrad": wl.grad, "bgrad": bl.grad if with_bias else None,
        "wref": wf.grad, "bref": bf.grad if with_bias else None,
        "dot": ((au.detach() * v).sum().item(), (u.detach() * atv).sum().item()),
        "corners": plan.ex_c >= 0,
    }


def _errors(mesh):
    """Cases the patch refuses: the same error on every rank (blocks thinner than the halo; a pole across an odd number
    of longitudes, 17: no roll by W/2; an even W across a pole is tests/test_pole_patch.py's)."""
    from halo.nn.patch2d import patch_2d_applies, plan_patch_2d

    sizes = (split_sizes(H, mesh.axis_size(0)), split_sizes(W, mesh.axis_size(1)))
    groups = (mesh.axis_group(0), mesh.axis_group(1))
    out = {}
    for name, k, d, boundaries in (("thin", (9, 3), (2, 1), ("zeros", "zeros")),
                                   ("pole", (3, 3), (1, 1), ("pole", "circular"))):
        pads = [((dd * (kk - 1)) // 2,) * 2 for kk, dd in zip(k, d, strict=True)]
        applies = patch_2d_applies(sizes, k, (1, 1), d, pads, boundaries)
        try:
            plan_patch_2d(groups, sizes, k, d, boundaries)
            out[name] = (applies, "no error")
        except ValueError as exc:
            out[name] = (applies, str(exc))
    return out


def _ranks(rank, world, shapes):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh

    out = {}
    for shape in shapes:
        mesh = DomainMesh(shape, periodic=(False, True))
        out[shape] = {"cases": [_case(mesh, case, 100 + i) for i, case in enumerate(CASES)], "errors": _errors(mesh)}
    return out


LAUNCHES = {4: [(2, 2)], 6: [(3, 2)], 3: [(3, 1), (1, 3)]}


@pytest.fixture(scope="module", params=sorted(LAUNCHES))
def launch(request):
    world = request.param
    return LAUNCHES[world], run_on_ranks(_ranks, world, LAUNCHES[world], timeout=240)


def test_patch_conv_2d_equals_the_unsharded_conv(launch):
    shapes, results = launch
    for shape in shapes:
        for i, case in enumerate(CASES):
            per = [r[shape]["cases"][i] for r in results]
            assert all(p["applies"] for p in per), (shape, case)
            assert max(p["fwd"] for p in per) <= TOL, (shape, case, [p["fwd"] for p in per])
            assert max(p["xgrad"] for p in per) <= TOL, (shape, case, [p["xgrad"] for p in per])
            wsum = sum(p["wgrad"] for p in per)
            assert (wsum - per[0]["wref"]).abs().max().item() <= TOL, (shape, case)
            if case[4]:
                bsum = sum(p["bgrad"] for p in per)
                assert (bsum - per[0]["bref"]).abs().max().item() <= TOL, (shape, case)
            lhs, rhs = sum(p["dot"][0] for p in per), sum(p["dot"][1] for p in per)
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (shape, case, lhs, rhs)
            both = shape[0] > 1 and shape[1] > 1 and min(case[0]) > 1
            assert not both or all(p["corners"] for p in per), (shape, case)  # the corner exchange did run


def test_refusals_are_the_same_on_every_rank(launch):
    shapes, results = launch
    for shape in shapes:
        for name in ("thin", "pole"):
            verdicts = {r[shape]["errors"][name] for r in results}
            assert len(verdicts) == 1, (shape, name, verdicts)
            ((applies, message),) = verdicts
            # thin: 8 halo rows, blocks of 7 rows or fewer unless H is whole; pole: 17 longitudes, whatever the mesh
            refused = name == "pole" or shape[0] > 1
            assert applies is not refused, (shape, name, applies)
            assert (message != "no error") is refused, (shape, name, message)
