"""The guard knows where halo's attention layers leave the sharded rows: a channels-last Swin or NATTEN output has
them at dim 1, ``rows_to_columns`` output is sharded along W. A mean over the real sharded dim after them is
computed over the whole domain (``halo.guard.reroute``: its result whole on every rank; taking dim -2 for H would have
passed it per shard: silently wrong), and so is a sum; one over the unsharded dim runs on the shard; all are exact. A
maximum over the sharded dim is refused on every rank."""

import os

import pytest
import torch
import torch.nn as nn

from halo.testing import run_on_ranks


class SwinHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        from test_swin import SmallSwin

        self.body = SmallSwin((32, 16))
        self.dim = dim

    def forward(self, x):
        y = self.body(x)  # (B, H, W, C) channels-last
        if self.dim < 0:  # -1: a sum over dim 1 (computed over the domain); -3: a maximum over it (refused)
            return y.sum(1) if self.dim == -1 else y.amax(1)
        return y.mean(self.dim)


class NattenHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        from test_neighborhood import NeighborhoodAttention2D

        self.inp = nn.Conv2d(3, 8, 3, padding=1)
        self.na = NeighborhoodAttention2D(8, 2, 3)
        self.dim = dim

    def forward(self, x):
        return self.na(self.inp(x).permute(0, 2, 3, 1)).mean(self.dim)


class AxialHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.inp = nn.Conv2d(3, 4, 3, padding=1)
        self.dim = dim

    def forward(self, x):
        from halo.nn import rows_to_columns

        return rows_to_columns(self.inp(x)).mean(self.dim)  # sharded along W now: a mean over H is local


#: (head, dim, allowed): a mean or a sum over the sharded dim (Swin, NATTEN: 1; axial: -1) is computed exactly,
#: whole on every rank; a maximum over it (SwinHead with -3: over dim 1) is refused
CASES = [(SwinHead, 1, True), (SwinHead, 2, True), (SwinHead, -1, True), (SwinHead, -3, False),
         (NattenHead, 1, True), (NattenHead, 2, True), (AxialHead, -1, True), (AxialHead, -2, True)]
WHOLE = {(SwinHead, 1), (SwinHead, -1), (NattenHead, 1), (AxialHead, -1)}  # over the sharded dim: whole everywhere


def _ranks(rank, world, kind, dim):
    os.environ["TRITON_INTERPRET"] = "0"
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import halo
    from halo.dist.comm import unsharded
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    ref = kind(dim).double()
    model = convert_to_domain_parallel(kind(dim).double(), manager)
    model.load_state_dict(ref.state_dict())
    full = torch.randn(1, 3, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x = halo.shard(full, granularity=8)
    try:
        y = model(x)
    except ValueError as e:
        return str(e)
    with unsharded():
        want = ref(full)
    if (kind, dim) in WHOLE:  # computed over the whole domain: the same on every rank
        got = y.detach()
    elif kind is AxialHead:  # W-sharded result: each rank holds its columns
        got = halo.gather(y.detach(), dim=-1)
    else:  # the mean over W leaves the rows sharded along dim 1
        got = halo.gather(y.detach(), dim=1)
    return float((got - want.detach()).abs().max())


def _all_cases(rank, world):
    """Every case in one launch (a launch and its imports cost more than a case); the refused one last (the guard
    refuses it on every rank before any message, but nothing runs after it anyway)."""
    order = [c for c in CASES if c[2]] + [c for c in CASES if not c[2]]
    return {(kind.__name__, dim): _ranks(rank, world, kind, dim) for kind, dim, _ in order}


_RUNS: list = []


def _results(kind, dim):
    if not _RUNS:
        _RUNS.append(run_on_ranks(_all_cases, 2, timeout=280))
    return [r[kind.__name__, dim] for r in _RUNS[0]]


@pytest.mark.parametrize("kind, dim, allowed", CASES)
def test_guard_follows_attention_layouts(kind, dim, allowed):
    results = _results(kind, dim)
    if allowed:
        assert all(isinstance(r, float) and r <= 1e-12 for r in results), results
    else:
        assert len(set(results)) == 1 and isinstance(results[0], str), results
        assert "reduces over H" in results[0], results[0]
