"""Multi-rank (gloo) tests of ``halo.dist.groups``: ``init_dist_group`` on every rank agrees with ``layout()``, and
every group it returns communicates (an all-reduce of the global rank sums the group's ranks).

Each rank returns what it saw; the parent asserts, so all ranks reach the same verdict.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from halo.dist import groups as G
from halo.testing import run_on_ranks

# (initializer name, dp, pp, tp, kwargs); world = dp * pp * tp
CONFIGS_8 = [
    ("Initializer_Data", 2, 2, 2, {}),
    ("Initializer_Pipeline", 2, 2, 2, {}),
    ("Initializer_Tensor", 2, 2, 2, {}),
    ("Initializer_Model", 2, 2, 2, {}),
    ("Initializer_Sequence", 2, 2, 2, {}),
    ("Initializer_1D", 2, 1, 4, {}),
    ("Initializer_2D", 2, 1, 4, {}),
    ("Initializer_2p5D", 1, 1, 8, {"depth": 2}),
    ("Initializer_3D", 1, 1, 8, {}),
]
CONFIGS_4 = [
    ("Initializer_Data", 4, 1, 1, {}),
    ("Initializer_Pipeline", 1, 4, 1, {}),
    ("Initializer_Sequence", 1, 2, 2, {}),
    ("Initializer_2D", 1, 1, 4, {}),
    ("Initializer_2p5D", 1, 1, 4, {"depth": 1}),
    ("Initializer_2p5D", 1, 1, 4, {"depth": 4}),
    ("Initializer_3D", 4, 1, 1, {}),
]


def _make(name, rank, world_size, dp, pp, tp, kwargs):
    return getattr(G, name)(rank, world_size, None, dp, pp, tp, **kwargs)


def _init_and_reduce(rank, world_size, configs):
    """On one rank: create every initializer's groups; for each returned group, report what it is and the
    all-reduced global rank over it."""
    out = []
    for name, dp, pp, tp, kwargs in configs:
        result = _make(name, rank, world_size, dp, pp, tp, kwargs).init_dist_group()
        infos = result if isinstance(result, list) else [result]
        seen = []
        for local_rank, group_world_size, pg, ranks_in_group, mode in infos:
            t = torch.tensor([float(rank)], dtype=torch.float64)
            dist.all_reduce(t, group=pg)
            seen.append(
                {
                    "local_rank": local_rank,
                    "size": group_world_size,
                    "ranks": list(ranks_in_group),
                    "mode": mode.value,
                    "torch_rank": dist.get_rank(pg),
                    "torch_size": dist.get_world_size(pg),
                    "torch_ranks": dist.get_process_group_ranks(pg),
                    "sum": t.item(),
                }
            )
        out.append((isinstance(result, list), seen))
    # a wrong world size is seen alike by every rank, so every rank raises the same error
    try:
        G.Initializer_Tensor(rank, world_size * 2, None, 1, 1, 1).init_dist_group()
        out.append("no error")
    except ValueError as exc:
        out.append(str(exc))
    return out


@pytest.mark.parametrize("world_size, configs", [(8, CONFIGS_8), (4, CONFIGS_4)], ids=["8ranks", "4ranks"])
def test_init_dist_group_matches_layout_and_communicates(world_size, configs):
    results = run_on_ranks(_init_and_reduce, world_size, configs, backend="gloo", timeout=180)
    for rank, per_rank in enumerate(results):
        *per_config, mismatch = per_rank
        assert f"built for rank {rank} of {world_size * 2}" in mismatch, mismatch
        assert mismatch.endswith(f"this process is rank {rank} of {world_size}"), mismatch
        for (name, dp, pp, tp, kwargs), (is_list, seen) in zip(configs, per_config, strict=True):
            init = _make(name, rank, world_size, dp, pp, tp, kwargs)
            layout = init.layout()
            assert is_list == init.returns_list, name
            assert [s["mode"] for s in seen] == [m.value for m in layout], name
            for s, groups in zip(seen, layout.values(), strict=True):
                (mine,) = [g for g in groups if rank in g]
                where = (name, rank, s["mode"])
                assert s["ranks"] == mine, where
                assert s["local_rank"] == mine.index(rank) == s["torch_rank"], where
                assert s["size"] == len(mine) == s["torch_size"], where
                assert s["torch_ranks"] == mine, where
                assert s["sum"] == sum(mine), where
