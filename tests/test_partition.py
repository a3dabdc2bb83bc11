"""Pure partition arithmetic, checked against torch.tensor_split and a brute-force row map."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from halo.plan.partition import (
    BOUNDARIES,
    check_boundary,
    local_range,
    plan_exchange,
    source_row,
    split_offsets,
    split_sizes,
)


@given(st.integers(0, 2000), st.integers(1, 64))
@settings(max_examples=500, deadline=None)
def test_balanced_split_matches_tensor_split(n, p):
    expected = [t.numel() for t in torch.tensor_split(torch.arange(n), p)]
    assert split_sizes(n, p) == expected
    offs = split_offsets(n, p)
    assert offs[0] == 0 and offs[-1] == n
    for r in range(p):
        assert local_range(n, p, r) == (offs[r], offs[r + 1])


def test_split_examples_from_design():
    assert split_sizes(721, 4) == [181, 180, 180, 180]
    assert split_sizes(721, 7) == [103] * 7
    assert split_sizes(5, 7) == [1, 1, 1, 1, 1, 0, 0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="0 parts"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="part index 3 out of range for 3"):
        local_range(9, 3, 3)
    with pytest.raises(ValueError, match="expected one of zeros, replicate"):
        check_boundary("mirror")
    with pytest.raises(ValueError, match="reflect boundary reaches 5 rows .* at most 4"):
        source_row(-5, 5, "reflect")


def _padded_index(n, lo, hi, boundary):
    """Independent reference: the index map of F.pad-like padding (plus the pole roll flag), by formula."""
    out = []
    for v in range(lo, hi):
        if 0 <= v < n:
            out.append((v, False))
        elif boundary == "zeros":
            out.append((None, False))
        elif boundary == "replicate":
            out.append((min(max(v, 0), n - 1), False))
        elif boundary in ("circular", "periodic"):
            out.append((v % n, False))
        elif boundary in ("reflect", "pole"):
            out.append((abs(v) if v < 0 else 2 * n - 2 - v, boundary == "pole"))
        else:  # symmetric, pole_centered: mirror about the half-row beyond the edge (the pole's rows rolled)
            out.append((-1 - v if v < 0 else 2 * n - 1 - v, boundary == "pole_centered"))
    return out


@st.composite
def layouts(draw):
    p = draw(st.integers(1, 9))
    sizes = draw(st.lists(st.integers(1, 12), min_size=p, max_size=p))
    n = sum(sizes)
    boundary = draw(st.sampled_from(BOUNDARIES))
    limit = n - 1 if boundary in ("reflect", "pole") else n if boundary in ("symmetric", "pole_centered") else 3 * n
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    needs = []
    for r in range(p):
        b = draw(st.integers(-sizes[r], min(limit, 2 * n)))
        a = draw(st.integers(-sizes[r], min(limit, 2 * n)))
        lo, hi = offs[r] - b, offs[r + 1] + a
        if hi < lo:
            lo, hi = hi, lo
        lo, hi = max(lo, -limit), min(hi, n + limit)
        if hi < lo:
            hi = lo
        needs.append((lo, hi))
    return sizes, needs, boundary


@given(layouts())
@settings(max_examples=2000, deadline=None)
def test_plan_delivers_every_needed_row(layout):
    """Simulate the plan with row ids: every rank's extended rows equal the reference index map."""
    sizes, needs, boundary = layout
    plan = plan_exchange(sizes, needs, boundary)
    n = sum(sizes)
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    # Messages: what q packs for r, in q's send order, must be what r expects from q.
    messages = {}
    for q, rp in enumerate(plan.ranks):
        for r, runs in rp.sends:
            rows = [offs[q] + s + i for s, k in runs for i in range(k)]
            assert rows == sorted(set(rows)), "a message carries unique rows in ascending order"
            assert all(offs[q] <= g < offs[q + 1] for g in rows)
            messages[(q, r)] = rows
    for r, rp in enumerate(plan.ranks):
        recv = []
        for q, k in rp.recvs:
            rows = messages.pop((q, r))
            assert len(rows) == k
            recv += rows
        got = [(None if i < 0 else recv[i], rolled) for i, rolled in rp.before]
        i0, ni = rp.interior
        got += [(offs[r] + i0 + i, False) for i in range(ni)]
        got += [(None if i < 0 else recv[i], rolled) for i, rolled in rp.after]
        lo, hi = needs[r]
        assert got == _padded_index(n, lo, hi, boundary), (r, rp)
    assert not messages, "every message is received"


def test_neighbour_halo_is_contiguous_slice():
    """The common case (zeros, halo within the neighbour) needs no gather: halo rows are in order."""
    plan = plan_exchange([181, 180, 180, 180], [(-1, 182), (180, 362), (360, 542), (540, 722)], "zeros")
    r1 = plan.ranks[1]
    assert r1.recvs == ((0, 1), (2, 1))
    assert r1.before == ((0, False),) and r1.after == ((1, False),)
    assert plan.ranks[0].before == ((-1, False),)
    assert plan.halo_rows() == 6
