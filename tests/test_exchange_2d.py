"""halo_exchange_2d on a (ph, pw) DomainMesh vs the full field padded the same way, forward and backward.

Reference: pad H first (zeros / replicate / reflect / across the pole), then W circularly (the mesh's W axis is
periodic), and take this rank's window; that is also the order the exchange runs in, so corners must match.
Exactness: the forward only copies (compared with torch.equal). Backward adds up to ~6 copies of one gradient
value in a different order than autograd on the padded reference; the loss weights are small integers, so
every such sum is exact in float64 and the gradients are compared with torch.equal too.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from halo.plan.partition import local_range
from halo.testing import run_on_ranks

SHAPE = (2, 3, 33, 20)


def padded(full, halo_h, halo_w, boundary_h, boundary_w):
    (bh, ah), (bw, aw) = halo_h, halo_w
    if boundary_h in ("pole", "pole_centered"):
        k, n, shift = (1 if boundary_h == "pole" else 0), full.shape[-2], full.shape[-1] // 2
        north = full.narrow(-2, k, bh).flip(-2).roll(shift, -1)
        south = full.narrow(-2, n - k - ah, ah).flip(-2).roll(shift, -1)
        x = torch.cat([north, full, south], dim=-2)
    else:
        x = F.pad(full, (0, 0, bh, ah), mode="constant" if boundary_h == "zeros" else boundary_h)
    return F.pad(x, (bw, aw, 0, 0), mode="constant" if boundary_w == "zeros" else "circular")


def _pair(h):
    return (h, h) if isinstance(h, int) else h


def _window(t, coords, mesh, extra_h, extra_w):
    """Block ``coords = (h, w)`` of ``t`` (a full-size field) extended by ``extra_*`` rows (before + after)."""
    (h0, h1), (w0, w1) = (local_range(SHAPE[dim], mesh.axis_size(axis), coords[axis])
                          for axis, dim in ((0, -2), (1, -1)))
    return t.narrow(-2, h0, h1 - h0 + extra_h).narrow(-1, w0, w1 - w0 + extra_w)


def _run_cases(mesh, cases, seed):
    from halo.exchange import halo_exchange_2d

    results = []
    for k, (halo_h, halo_w, boundary_h, boundary_w) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + k)
        full = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
        (bh, ah), (bw, aw) = _pair(halo_h), _pair(halo_w)
        ref = padded(full, (bh, ah), (bw, aw), boundary_h, boundary_w or "circular")
        me = (mesh.axis_rank(0), mesh.axis_rank(1))
        x = _window(full, me, mesh, 0, 0).clone().requires_grad_(True)
        ext = halo_exchange_2d(x, halo_h, halo_w, mesh=mesh, boundary_h=boundary_h, boundary_w=boundary_w)
        want = _window(ref, me, mesh, bh + ah, bw + aw)
        # Every rank's integer weights on its window, drawn identically everywhere: the reference loss sums all.
        blocks = [divmod(r, mesh.axis_size(1)) for r in range(mesh.domain_size)]
        weights = torch.randint(-8, 9, (mesh.domain_size, *ref.shape), generator=gen).to(torch.float64)
        masks = torch.zeros_like(weights)
        for r, c in enumerate(blocks):
            _window(masks[r], c, mesh, bh + ah, bw + aw).copy_(_window(weights[r], c, mesh, bh + ah, bw + aw))
        mine = _window(weights[mesh.domain_rank], me, mesh, bh + ah, bw + aw)
        (ext * mine).sum().backward()
        xf = full.clone().requires_grad_(True)
        reff = padded(xf, (bh, ah), (bw, aw), boundary_h, boundary_w or "circular")
        (reff * masks.sum(0)).sum().backward()
        results.append({
            "fwd": ext.shape == want.shape and torch.equal(ext.detach(), want),
            "bwd": torch.equal(x.grad, _window(xf.grad, me, mesh, 0, 0)),
            "dot": ((ext.detach() * mine).sum().item(), (x.detach() * x.grad).sum().item()),
        })
    return results


CASES = [
    (1, 1, "zeros", None),
    ((2, 1), (1, 3), "zeros", None),
    ((0, 3), (2, 0), "zeros", None),
    (17, (7, 11), "zeros", None),  # wider than a neighbour's shard in both directions (rows from further)
    ((3, 1), 2, "replicate", None),
    (2, (1, 2), "reflect", "zeros"),  # W not wrapped when asked
]
POLE_CASES = [((2, 1), 3, "pole", None), ((1, 3), (2, 1), "pole_centered", None)]


def _ranks(rank, world, domain_shape):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh

    mesh = DomainMesh(domain_shape, periodic=(False, True))
    out = {"cases": _run_cases(mesh, CASES, 10)}
    # Poles with W sharded: the rows across the pole are rolled by W/2 around the whole circle by ranks that
    # hold other longitudes; with W whole on every rank (a column mesh) the roll is local.
    out["pole_cases"] = _run_cases(mesh, POLE_CASES, 20)
    out["pole_column"] = _run_cases(DomainMesh((world, 1), periodic=(False, True)), POLE_CASES, 20)
    try:  # an odd number of longitudes cannot be rolled by W/2: the same error on every rank
        x = torch.zeros(1, 1, 5 if mesh.axis_rank(0) == 0 else 4, 3 if mesh.axis_rank(1) == 0 else 2)
        from halo.exchange import halo_exchange_2d
        halo_exchange_2d(x, 1, 1, mesh=mesh, boundary_h="pole")
        out["pole_error"] = "no error"
    except ValueError as e:
        out["pole_error"] = str(e)
    return out


@pytest.mark.parametrize("domain_shape", [(2, 2), (2, 3)])
def test_halo_exchange_2d_matches_padded_field(domain_shape):
    world = domain_shape[0] * domain_shape[1]
    results = run_on_ranks(_ranks, world, domain_shape, timeout=240)
    for key, cases in (("cases", CASES), ("pole_cases", POLE_CASES), ("pole_column", POLE_CASES)):
        for i, case in enumerate(cases):
            per = [r[key][i] for r in results]
            assert all(p["fwd"] for p in per), (case, [p["fwd"] for p in per])
            assert all(p["bwd"] for p in per), (case, [p["bwd"] for p in per])
            lhs, rhs = sum(p["dot"][0] for p in per), sum(p["dot"][1] for p in per)
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (case, lhs, rhs)
    messages = {r["pole_error"] for r in results}
    assert len(messages) == 1, messages  # the same error on every rank
    assert "even number of longitudes" in messages.pop()
