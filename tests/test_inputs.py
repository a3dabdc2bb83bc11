"""Inputs a user cut wrongly: refused on every rank with the same error naming what was expected and what came, or
computed exactly; never silently different (docs/design.md invariants 1, 4 and 8).

- A hand-made shard that is not the balanced split (25 + 23 rows of 48 into ``DomainConv2d``, in both conv paths:
  compute-then-patch and ``overlap=False``; ``torch.chunk``'s 31, 31, 31, 28 of 121 on 4 ranks): the same
  ``ValueError`` on every rank naming the split expected and the one got. A split of whole blocks
  (``halo.shard(..., granularity=g)``) is still taken, and exact where the conv path computes it.
- One rank dropping a row at step 2 of a converted model: rank 0 dropping one gives 23 + 24, not a balanced split:
  refused on every rank; rank 1 dropping one gives 24 + 23, the balanced split of 47 rows: computed exactly (equal to
  the unsharded model on the 47-row field, forward and input gradient).
- ``boundary="pole"`` with an odd number of longitudes: refused on every rank by a converted conv, a ``DomainConv2d``
  built with ``boundary="pole"`` and ``halo_exchange`` alike (a converted conv used to roll by ``W // 2``); an even W
  is exact against the unsharded pole padding.
- Pure: :func:`halo.plan.partition.split_granularity` for balanced, block and hand-made splits.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_granularity, split_problem, split_sizes
from halo.testing import run_on_ranks


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_split_granularity_is_exact():
    for n in range(0, 60):
        for p in range(1, 6):
            assert split_granularity(split_sizes(n, p)) == 1
            for g in (2, 3, 4, 16):
                if n % g == 0 and n // g >= p:
                    assert split_granularity(split_sizes(n, p, g)) in (1, g)
    assert split_granularity([25, 23]) is None
    assert split_granularity([31, 31, 31, 28]) is None
    assert split_granularity([16, 32]) is None  # the larger blocks come first
    assert split_granularity([32, 16]) == 16
    assert split_granularity([8, 8, 4]) == 4
    msg = split_problem([25, 23])
    assert "[25, 23]" in msg and "[24, 24]" in msg
    assert split_problem([24, 24]) is None and split_problem([32, 16]) is None


# -- hand-made splits ----------------------------------------------------------------------------------------------

def _unbalanced(rank, world, n, cut, overlap):
    import halo
    from halo.nn import DomainConv2d

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(20)
    torch.manual_seed(0)
    conv = DomainConv2d(nn.Conv2d(2, 3, 3, padding=1).double(), overlap=overlap)
    x = torch.randn(1, 2, n, 8, dtype=torch.float64)
    parts = x.split(cut, dim=-2) if isinstance(cut, list) else x.chunk(world, dim=-2)
    return _error(lambda: conv(parts[rank].clone()))


@pytest.mark.parametrize("overlap", [True, False])
def test_hand_made_split_is_refused_in_both_conv_paths(overlap):
    errors = run_on_ranks(_unbalanced, 2, 48, [25, 23], overlap, timeout=60)
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("ValueError: DomainConv2d:"), errors[0]
    assert "[25, 23]" in errors[0] and "balanced split [24, 24]" in errors[0], errors[0]


def test_torch_chunk_split_is_refused_on_every_rank():
    errors = run_on_ranks(_unbalanced, 4, 121, None, True, timeout=90)
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors
    assert "[31, 31, 31, 28]" in errors[0] and "balanced split [31, 30, 30, 30]" in errors[0], errors[0]


def _block_split(rank, world, overlap):
    import halo
    from halo.nn import DomainConv2d

    halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    plain = nn.Conv2d(2, 3, 3, padding=1).double()
    conv = DomainConv2d(plain, overlap=overlap)
    x = torch.randn(1, 2, 48, 8, dtype=torch.float64)
    xs = halo.shard(x, granularity=16)  # 32 + 16 rows: a balanced split of whole blocks of 16
    y = halo.gather(conv(xs))
    return tuple(xs.shape), float((y - plain(x)).abs().max())


@pytest.mark.parametrize("overlap", [True, False])  # compute-then-patch falls back to pad-then-conv on blocks
def test_block_split_is_still_computed_exactly(overlap):
    for rank, (shape, err) in enumerate(run_on_ranks(_block_split, 2, overlap, timeout=60)):
        assert shape[-2] == (32, 16)[rank]
        assert err <= 1e-12, err


# -- a rank dropping a row at step 2 ----------------------------------------------------------------------------

def _drop_row(rank, world, dropper):
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(3)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1)).double()
    model = convert_to_domain_parallel(nn.Sequential(*[m for m in ref]).double())
    x = torch.randn(1, 2, 48, 8, dtype=torch.float64)
    xs = halo.shard(x).clone().requires_grad_(True)
    model(xs).square().sum().backward()  # step 1: the balanced split of 48 rows
    x2 = xs.detach()[..., :-1, :] if rank == dropper else xs.detach()
    x2 = x2.clone().requires_grad_(True)
    result = {}
    try:
        y = model(x2)
    except (ValueError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    y.square().sum().backward()
    # The field as the ranks hold it now: rank `dropper` lost its last row.
    sizes = split_sizes(48, world)
    off = sum(sizes[:dropper]) + sizes[dropper] - 1
    full = torch.cat([x[..., :off, :], x[..., off + 1:, :]], dim=-2).clone().requires_grad_(True)
    yf = ref(full)
    yf.square().sum().backward()
    offs = [0, x2.shape[-2]] if rank == 0 else [full.shape[-2] - x2.shape[-2], full.shape[-2]]
    result["fwd"] = float((y - yf[..., offs[0]:offs[1], :]).abs().max())
    result["dx"] = float((x2.grad - full.grad[..., offs[0]:offs[1], :]).abs().max())
    return result


@pytest.mark.parametrize("dropper", [0, 1])
def test_rank_dropping_a_row_is_refused_on_every_rank(dropper):
    """One rank's shard loses a row after a steady step (23 + 24 is no balanced split; 24 + 23 is 47's): only that
    rank sees a change, its peer's call is steady and skips the entry's agreement (halo.plan.entry), so every rank
    raises HaloCommError within the timeout, the dropping rank naming what changed; never a result from the old
    plans. (With every rank's shard changed the new grid is learned: tests/test_sync_free.py.)"""
    results = run_on_ranks(_drop_row, 2, dropper, timeout=60)
    assert all("error" in r and r["error"].startswith("HaloCommError") for r in results), results
    assert "went from (24, 8) to (23, 8)" in results[dropper]["error"], results[dropper]


# -- the pole with an odd number of longitudes ------------------------------------------------------------------

def _pole(rank, world, width):
    import halo
    from halo.nn import DomainConv2d, convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(20)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 12, width, dtype=torch.float64)
    xs = halo.shard(x)
    plain = nn.Conv2d(2, 3, 3, padding=1).double()
    out = {}
    out["convert"] = _error(lambda: convert_to_domain_parallel(nn.Sequential(plain), boundary="pole")(xs))
    out["layer"] = _error(lambda: DomainConv2d(plain, boundary="pole")(xs))
    out["exchange"] = _error(lambda: halo.halo_exchange(xs, 1, boundary="pole"))
    if width % 2 == 0:  # exact: the rows across the pole (row 1 mirrored), rolled by W/2
        top = x[..., 1:2, :].roll(width // 2, dims=-1)
        bottom = x[..., -2:-1, :].roll(width // 2, dims=-1)
        want = F.conv2d(torch.cat([top, x, bottom], dim=-2), plain.weight, plain.bias, padding=(0, 1))
        got = halo.gather(DomainConv2d(plain, boundary="pole")(xs))
        out["err"] = float((got - want).abs().max())
    return out


def test_pole_with_odd_width_is_refused_in_every_layer():
    results = run_on_ranks(_pole, 2, 7, timeout=60)
    for key in ("convert", "layer", "exchange"):
        errors = [r[key] for r in results]
        assert all(e is not None and e.startswith("ValueError") for e in errors), (key, errors)
        assert len(set(errors)) == 1, (key, errors)
        assert "even number of longitudes" in errors[0] and "W=7" in errors[0], errors[0]
    for r in run_on_ranks(_pole, 2, 8, timeout=60):
        assert r["convert"] is None and r["layer"] is None and r["exchange"] is None, r
        assert r["err"] <= 1e-12, r
