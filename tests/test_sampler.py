"""Sampling by data-parallel rank (``halo.DomainSampler``, issue 30 item 3): on 4 gloo ranks, 2 dp x 2 domain, the
ranks of a domain group iterate the same indices, the two dp replicas get disjoint shares that cover the dataset,
epochs reshuffle alike, ``drop_last`` cuts alike; ranks that disagree on the seed or the epoch are refused on every
rank. One rank pool (a 4-rank run) does every case; a second one shows what torch's defaults do."""

from __future__ import annotations

import pytest

from halo.testing import run_on_ranks

N = 11  # odd: 11 over 2 replicas pads one index without drop_last, drops one with it


def _samples(rank, world):
    import halo

    manager = halo.initialize_domain_parallel(world, 2)  # domain groups [0, 1], [2, 3]; dp rank = rank // 2
    data = list(range(N))
    out = {"dp": (manager.dp_rank, manager.dp_world_size), "args": halo.data_parallel_sampler_args()}
    s = halo.DomainSampler(data, seed=3)
    out["epochs"] = []
    for epoch in range(2):
        s.set_epoch(epoch)
        out["epochs"].append(list(iter(s)))
    out["len"] = len(s)
    out["drop"] = list(halo.DomainSampler(data, shuffle=False, drop_last=True))
    out["mesh"] = list(halo.DomainSampler(data, mesh=manager.mesh, shuffle=False))

    def attempt(fn):
        try:
            fn()
            return "ok"
        except Exception as exc:  # noqa: BLE001 - every rank's outcome is compared
            return type(exc).__name__, str(exc)

    out["seed"] = attempt(lambda: halo.DomainSampler(data, seed=1 if rank == 3 else 0))
    s2 = halo.DomainSampler(data)
    out["epoch"] = attempt(lambda: s2.set_epoch(2 if rank == 1 else 1))
    out["length"] = attempt(lambda: halo.DomainSampler(data[:-1] if rank == 2 else data))
    out["after"] = attempt(lambda: s2.set_epoch(5))  # the group is usable after a refusal
    from torch.utils.data import DistributedSampler

    out["torch"] = list(DistributedSampler(data, shuffle=False))  # torch's defaults: the whole world
    return out


def test_domain_peers_same_indices_dp_replicas_disjoint():
    results = run_on_ranks(_samples, 4, timeout=180)
    for rank, r in enumerate(results):
        assert r["dp"] == (rank // 2, 2)
        assert r["args"] == {"num_replicas": 2, "rank": rank // 2}
        assert r["len"] == 6  # ceil(11 / 2)
    for epoch in range(2):
        a, b = results[0]["epochs"][epoch], results[2]["epochs"][epoch]
        assert results[1]["epochs"][epoch] == a and results[3]["epochs"][epoch] == b  # domain peers alike
        assert len(a) == len(b) == 6
        assert set(a) | set(b) == set(range(N))  # together they cover the dataset
        assert len(set(a) & set(b)) == 1  # the one padding index (12 = 11 + 1) repeats the first
    assert results[0]["epochs"][0] != results[0]["epochs"][1]  # set_epoch reshuffles
    assert results[0]["drop"] == results[1]["drop"] == [0, 2, 4, 6, 8]
    assert results[2]["drop"] == results[3]["drop"] == [1, 3, 5, 7, 9]
    assert results[0]["mesh"] == [0, 2, 4, 6, 8, 10] and results[3]["mesh"] == [1, 3, 5, 7, 9, 0]
    for key, text in [("seed", "differ in seed 0 vs 1"), ("epoch", "differ in epoch 1 vs 2"),
                      ("length", "differ in len(dataset) 11 vs 10")]:
        outcomes = [r[key] for r in results]
        assert all(o != "ok" and o[0] == "ValueError" for o in outcomes), (key, outcomes)
        assert all(text in o[1] and "the ranks disagree" in o[1] for o in outcomes), (key, outcomes)
        assert len({o[1] for o in outcomes}) == 1, (key, outcomes)  # the same message on every rank
    assert all(r["after"] == "ok" for r in results)
    # What the sampler prevents: torch's defaults give the two ranks of a domain group different indices.
    assert results[0]["torch"] != results[1]["torch"] and results[2]["torch"] != results[3]["torch"]


def test_one_process_and_bad_arguments():
    import halo

    s = halo.DomainSampler(list(range(5)), shuffle=False)
    assert list(s) == [0, 1, 2, 3, 4] and halo.data_parallel_sampler_args() == {"num_replicas": 1, "rank": 0}
    with pytest.raises(ValueError, match="manager= or mesh=, not both"):
        halo.DomainSampler([1], manager=object(), mesh=object())


def test_sampler_position_round_trips_through_a_checkpoint(tmp_path):
    """The data position a checkpoint keeps: the sampler's epoch (and its seed, checked), saved with the sampler
    itself; a sampler built with another seed is refused rather than resumed on another permutation."""
    import halo
    import halo.checkpoint

    s = halo.DomainSampler(list(range(7)), seed=3)
    s.set_epoch(4)
    order = list(s)
    halo.checkpoint.save({"sampler": s}, tmp_path, 1)
    fresh = halo.DomainSampler(list(range(7)), seed=3)
    halo.checkpoint.load({"sampler": fresh}, tmp_path)
    assert fresh.epoch == 4 and list(fresh) == order
    with pytest.raises(ValueError, match="seeded 3, this one 5"):
        halo.checkpoint.load({"sampler": halo.DomainSampler(list(range(7)), seed=5)}, tmp_path)
