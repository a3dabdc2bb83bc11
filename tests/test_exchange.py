"""halo_exchange on gloo ranks vs the padded full tensor built in the same process, forward and backward.

Exactness: an exchange only copies rows (and its adjoint adds at most a few copies of one gradient row), so
float64 results are compared exactly (rtol=atol=0) unless noted; bf16/fp16 forward is bitwise.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks


def padded_reference(x, before, after, dim, boundary):
    """The unsharded answer: F.pad (or the pole construction, or tiling for wide circular halos)."""
    x = x.movedim(dim, -2)
    n = x.shape[-2]
    if boundary == "zeros":
        out = F.pad(x, (0, 0, before, after))
    elif boundary in ("replicate", "reflect") or (boundary in ("circular", "periodic") and max(before, after) <= n):
        mode = "circular" if boundary == "periodic" else boundary
        shape = x.shape
        out = F.pad(x.reshape(-1, *shape[-3:]) if x.dim() > 4 else x if x.dim() > 2 else x[None],
                    (0, 0, before, after), mode=mode)
        out = out.reshape(*shape[:-2], n + before + after, shape[-1])
    elif boundary in ("circular", "periodic"):
        reps = 1 + (max(before, after) + n - 1) // n
        tiled = torch.cat([x] * (2 * reps + 1), dim=-2)
        out = tiled.narrow(-2, reps * n - before, n + before + after)
    else:  # pole: mirror across the pole (row 0 / row n-1 on the grid, or half a row beyond), roll by W/2
        shift = x.shape[-1] // 2
        k = 1 if boundary == "pole" else 0
        north = x.narrow(-2, k, before).flip(-2).roll(shift, -1)
        south = x.narrow(-2, n - k - after, after).flip(-2).roll(shift, -1)
        out = torch.cat([north, x, south], dim=-2)
    return out.movedim(-2, dim)


def _exchange_cases(rank, world, cases):
    from halo.exchange import halo_exchange

    out = []
    for shape, dim, halo_, boundary, dtype, seed in cases:
        dim = dim % len(shape)
        gen = torch.Generator().manual_seed(seed)
        full = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        b, a = (halo_, halo_) if isinstance(halo_, int) else halo_
        offs = split_offsets(shape[dim], world)
        n_r = offs[rank + 1] - offs[rank]
        x = full.narrow(dim, offs[rank], n_r).clone().requires_grad_(dtype == torch.float64)
        ext = halo_exchange(x, halo_, dim, boundary=boundary)
        ref = padded_reference(full, b, a, dim, boundary)
        want = ref.narrow(dim, offs[rank], n_r + b + a)
        fwd_equal = ext.shape == want.shape and torch.equal(ext.detach(), want)
        res = {"fwd": fwd_equal, "shape": tuple(ext.shape)}
        if dtype == torch.float64:
            # Backward: every rank weights its extended window; the same loss on the full tensor via autograd.
            weights = [torch.randn(want.shape[:dim] + (offs[r + 1] - offs[r] + b + a,) + want.shape[dim + 1:],
                                   generator=gen, dtype=torch.float64) for r in range(world)]
            (ext * weights[rank]).sum().backward()
            xf = full.clone().requires_grad_(True)
            reff = padded_reference(xf, b, a, dim, boundary)
            sum((reff.narrow(dim, offs[r], offs[r + 1] - offs[r] + b + a) * weights[r]).sum()
                for r in range(world)).backward()
            want_grad = xf.grad.narrow(dim, offs[rank], n_r)
            res["bwd_err"] = (x.grad - want_grad).abs().max().item()
            # Dot-product test: <A x, y> (forward) and <x, A^T y> (backward), summed over ranks in the parent.
            res["Ax_y"] = (ext.detach() * weights[rank]).sum().item()
            res["x_ATy"] = (x.detach() * x.grad).sum().item()
        out.append(res)
    return out


def _run(world, cases):
    return run_on_ranks(_manager_cases, world, cases, timeout=240)


def _manager_cases(rank, world, cases):
    import halo
    halo.initialize_domain_parallel(world, world)
    return _exchange_cases(rank, world, cases)


def _check(results, world, cases):
    for i, case in enumerate(cases):
        per_rank = [results[r][i] for r in range(world)]
        assert all(r["fwd"] for r in per_rank), (case, [r["fwd"] for r in per_rank])
        if "bwd_err" in per_rank[0]:
            assert max(r["bwd_err"] for r in per_rank) <= 1e-12, (case, per_rank)
            lhs = sum(r["Ax_y"] for r in per_rank)
            rhs = sum(r["x_ATy"] for r in per_rank)
            assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs)), (case, lhs, rhs)


BOUNDARY_MODES = ["zeros", "replicate", "reflect", "circular", "periodic", "pole", "pole_centered"]


@pytest.mark.parametrize("world", [3, 4, 7])
def test_exchange_721_rows_every_boundary(world):
    cases = []
    for i, boundary in enumerate(BOUNDARY_MODES):
        for halo_ in (1, 2, (3, 1), (0, 2)):
            cases.append(((1, 2, 721, 6), -2, halo_, boundary, torch.float64, 100 * world + 10 * i))
    _check(_run(world, cases), world, cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_random_shapes_and_wide_halos(world):
    """Halos wider than a neighbour's shard (rows from further ranks), H smaller than the halo, W = 1."""
    rng = random.Random(world)
    cases = []
    for i in range(40):
        boundary = rng.choice(BOUNDARY_MODES)
        h = rng.randint(world, 4 * world + 3)
        w = rng.choice([1, 2, 4, 6]) if boundary not in ("pole", "pole_centered") else rng.choice([2, 4, 6])
        limit = h - 1 if boundary in ("reflect", "pole") else h
        b, a = rng.randint(0, limit), rng.randint(0, limit)
        cases.append(((rng.randint(1, 2), rng.randint(1, 3), h, w), -2, (b, a), boundary, torch.float64, i))
    _check(_run(world, cases), world, cases)


@pytest.mark.parametrize("world", [3])
def test_exchange_other_dims(world):
    """Longitude (dim -1), a 3-d tensor, a 5-d (B, C, D, H, W) tensor sharded on H."""
    cases = [((2, 3, 5, 23), -1, 2, "circular", torch.float64, 1),
             ((2, 3, 5, 23), 3, (1, 3), "zeros", torch.float64, 2),
             ((4, 17, 6), 1, 2, "reflect", torch.float64, 3),
             ((1, 2, 3, 19, 8), -2, 2, "pole", torch.float64, 4),
             ((5, 11), 0, 1, "replicate", torch.float64, 5)]
    _check(_run(world, cases), world, cases)


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_low_precision_is_bitwise(world):
    cases = [((2, 3, 45, 16), -2, 2, b, dt, 7) for dt in (torch.bfloat16, torch.float16, torch.float32)
             for b in ("zeros", "pole", "circular")]
    _check(_run(world, cases), world, cases)


def test_exchange_single_rank_is_padding():
    cases = [((1, 2, 9, 6), -2, h, b, torch.float64, 3) for b in BOUNDARY_MODES for h in (1, (2, 3))]
    _check(_run(1, cases), 1, cases)


def _in_place_cases(rank, world, cases):
    import halo
    from halo.exchange import halo_exchange_

    halo.initialize_domain_parallel(world, world)
    out = []
    for shape, dim, (b, a), boundary, dtype, layout in cases:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
        offs = split_offsets(shape[dim], world)
        n_r = offs[rank + 1] - offs[rank]
        ext_shape = list(shape)
        ext_shape[dim] = n_r + b + a
        ext = torch.full(ext_shape, float("nan"), dtype=dtype).contiguous(memory_format=layout)
        ext.narrow(dim, b, n_r).copy_(full.narrow(dim, offs[rank], n_r))
        ptr = ext.data_ptr()
        got = halo_exchange_(ext, (b, a), dim, boundary=boundary)
        want = padded_reference(full, b, a, dim, boundary).narrow(dim, offs[rank], n_r + b + a)
        out.append(got is ext and ext.data_ptr() == ptr and torch.equal(ext, want))
    try:
        halo_exchange_(torch.zeros(1, 1, 5, 4, requires_grad=True), 1)
    except RuntimeError as exc:
        out.append(str(exc))
    return out


def test_in_place_exchange_fills_only_the_halo_rows():
    cases = [((1, 2, 37, 6), -2, (1, 2), b, torch.float64, torch.contiguous_format)
             for b in ("zeros", "reflect", "circular", "pole")]
    cases += [((2, 3, 37, 8), -2, (2, 2), "zeros", torch.bfloat16, torch.channels_last),
              ((2, 3, 9, 23), -1, (3, 1), "circular", torch.float32, torch.contiguous_format)]
    results = run_on_ranks(_in_place_cases, 3, cases, timeout=120)
    for r in results:
        assert r[:-1] == [True] * len(cases), r
        assert "halo_exchange_ writes in place and is not differentiable" in r[-1]


def _replicate_bf16(rank, world):
    """Rows copied several times (replicate boundary, halo 3) get their gradients back summed in fp32, rounded
    once, in a fixed order: 256 + 1 + 1 + 1 is 259 in fp32, 260 in bf16; a bf16 running sum would give 256.
    (The torch path of the kernels: Triton's interpreter rounds fp32 -> bf16 toward zero, compiled Triton rounds
    to nearest even, as torch does; the kernels' own tests hold them to each other.)"""
    import os

    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.exchange import halo_exchange

    halo.initialize_domain_parallel(world, world)
    out = []
    for _ in range(2):  # twice: bitwise the same
        x = torch.zeros(1, 2, 4, 6, dtype=torch.bfloat16, requires_grad=True)
        ext = halo_exchange(x, 3, boundary="replicate")
        g = torch.zeros_like(ext)
        g[..., 3, :] = 256  # this rank's first own row
        g[..., :3, :] = 1 if rank == 0 else 0  # rank 0's three halo rows are copies of its first row
        ext.backward(g)
        out.append(x.grad[..., 0, :].float().clone())
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_replicate_backward_sums_in_fp32_deterministically(world):
    for rank, (first, second) in enumerate(run_on_ranks(_replicate_bf16, world, timeout=60)):
        assert torch.equal(first, second), rank
        want = 260.0 if rank == 0 else 256.0
        assert torch.all(first == want), (rank, first)
