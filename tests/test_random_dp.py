"""The stream of halo's draws is the layer's own mesh's data-parallel coordinate (issue 22): a model converted with
``mesh=DomainMesh(...)`` (no manager) or given ``group=`` a mesh's domain group draws different masks on each
replica, and the domain ranks of a replica draw what the unsharded field draws with that replica's stream."""

from __future__ import annotations

import torch

from halo.testing import run_on_ranks

B, C, H, W = 2, 3, 5, 6
SEED, P = 1234, 0.5


def _field() -> torch.Tensor:
    return torch.arange(1, B * C * H * W + 1, dtype=torch.float64).reshape(B, C, H, W)


def _dp_masks(rank, world):
    from torch import nn

    import halo
    from halo.nn import convert_to_domain_parallel

    assert halo.get_domain_parallel_manager() is None
    x = _field()
    out = {}
    # Latitude x longitude mesh (1, 2) with dp 2, a converted nn.Dropout.
    mesh = halo.DomainMesh((1, 2))
    model = convert_to_domain_parallel(nn.Sequential(nn.Dropout(P)), mesh=mesh).train()
    j = mesh.axis_rank(1)
    block = x[..., 3 * j:3 * j + 3].clone()
    halo.random.manual_seed(SEED)
    out["mesh"] = (mesh.dp_rank, j, (model(block) != 0))
    # One latitude axis of 2 with dp 2, halo.random.dropout with group= the mesh's domain group (rows 3 + 2).
    line = halo.DomainMesh((2,))
    i = line.axis_rank(0)
    rows = x[..., (0, 3)[i]:(3, 5)[i], :].clone()
    halo.random.manual_seed(SEED)
    out["rows"] = (line.dp_rank, i, halo.random.dropout(rows, P, group=line.domain_group) != 0)
    return out


def _reference(stream: int) -> torch.Tensor:
    """The unsharded field's keep mask drawn with ``stream`` (the same key: the same seed, one draw)."""
    from halo import kernels

    torch.manual_seed(SEED)
    key = torch.randint(1 << 62, (1,), dtype=torch.int64)
    bits = kernels.bits(key, B * C * H * W, H * W, H * W, 0, stream, 0)
    return (bits >= round(P * (1 << 24))).view(B, C, H, W)


def test_replicas_draw_differently_domain_ranks_agree():
    results = run_on_ranks(_dp_masks, 4, timeout=90)
    for kind, cut in (("mesh", lambda full, k: full[..., 3 * k:3 * k + 3]),
                      ("rows", lambda full, k: full[..., (0, 3)[k]:(3, 5)[k], :])):
        seen = {}
        for out in results:
            dp, k, mask = out[kind]
            expected = cut(_reference(dp), k)
            assert torch.equal(mask, expected), (kind, dp, k)
            seen.setdefault(dp, []).append(mask)
        assert sorted(seen) == [0, 1], kind
        # The replicas' masks differ (with p = 0.5 over 90 elements, equal masks are a bug, not chance).
        flat = [torch.cat([m.flatten() for m in seen[dp]]) for dp in (0, 1)]
        assert not torch.equal(*flat), kind
