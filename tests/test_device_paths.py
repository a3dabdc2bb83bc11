"""CUDA/NCCL paths that can be checked on CPU: host groups (eager, one order, the group's own rank order), the
DeviceMesh device type, waits under CUDA-graph capture, the launcher's local rank, the buffer pool under capture.

The NCCL-only host path is forced on gloo ranks by making ``halo.dist.comm.carries_cpu`` say no (what it answers for
``"nccl"``): the device groups are then gloo groups and halo makes separate gloo host groups for them, as on NCCL.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from halo.testing import run_on_ranks


def _host_groups(rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F

    import halo
    from halo.dist import comm

    comm.carries_cpu = lambda backend: False  # every group needs a host group, as with NCCL alone
    out = {}
    # Ranks made different numbers of groups before (a rank-local group each): torch's names of groups made with
    # use_local_synchronization count them, so a lazily made host group would meet on different store prefixes.
    # torch >= 2.14 counts local groups in every later group's name (_world.group_count): after such an asymmetry
    # any group creation hangs in torch itself (its DeviceMesh too), so there the asymmetry is not made.
    import torch.distributed.distributed_c10d as c10d

    before = getattr(c10d._world, "group_count", 0)
    dist.new_group([rank], use_local_synchronization=True)  # one on every rank: symmetric, fine on every torch
    if getattr(c10d._world, "group_count", 0) == before:
        for _ in range(rank):
            dist.new_group([rank], use_local_synchronization=True)
    mesh = halo.DomainMesh((world,))
    cg = comm.comm_group(mesh.axis_group(0))
    out["mesh_table"] = comm.gather_words([rank, 11], cg, "test").tolist()
    out["separate_host"] = cg.host is not cg.group

    # A group whose order is not ascending: group rank i is global rank order[i]; the host table in that order.
    order = [2, 0, 1]
    if not comm.HAS_SORT_RANKS:  # torch 2.11: no new_group(sort_ranks=); the same clear error on every rank
        try:
            comm.new_group(order, sort_ranks=False)
        except ValueError as exc:
            out["no_sort_ranks"] = str(exc)
        comm.new_group([0, 1, 2], sort_ranks=False)  # ascending: made as a plain group
    else:
        g = comm.new_group(order, sort_ranks=False)
        cg = comm.comm_group(g)
        out["order"] = list(cg.ranks)
        out["order_table"] = comm.gather_words([rank], cg, "test").tolist()
        # ... and an exchange over it with uneven rows (3, 2, 2 by group rank): extents attributed by group rank.
        full = torch.arange(7 * 4, dtype=torch.float64).reshape(1, 1, 7, 4)
        i = cg.index
        lo = [0, 3, 5][i]
        x = full[..., lo:lo + [3, 2, 2][i], :].clone()
        ext = halo.halo_exchange(x, 1, group=g)
        ref = F.pad(full, (0, 0, 1, 1))[..., lo:lo + x.shape[-2] + 2, :]
        out["exchange_exact"] = torch.equal(ext, ref)

    # An NCCL-only subset group made with torch's new_group (no host group): a clear error on every member.
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        try:
            comm.gather_words([rank], comm.comm_group(sub), "test")
        except ValueError as exc:
            out["unregistered"] = str(exc)
    return out


def test_host_groups_eager_in_group_order():
    results = run_on_ranks(_host_groups, 3, timeout=90)
    for rank, out in enumerate(results):
        assert out["separate_host"]
        assert out["mesh_table"] == [[0, 11], [1, 11], [2, 11]]
        if "no_sort_ranks" in out:  # torch 2.11
            assert "sort_ranks" in out["no_sort_ranks"] and "[2, 0, 1]" in out["no_sort_ranks"], out
            assert "order" not in out
        else:
            assert out["order"] == [2, 0, 1]
            assert out["order_table"] == [[2], [0], [1]]
            assert out["exchange_exact"], rank
        if rank < 2:
            assert "has no gloo host group" in out["unregistered"]
            assert "halo.dist.comm.new_group" in out["unregistered"]


def test_carries_cpu():
    from halo.dist.comm import carries_cpu

    assert carries_cpu("gloo") and carries_cpu("cpu:gloo,cuda:nccl") and carries_cpu("CUDA:nccl, cpu:gloo")
    assert not carries_cpu("nccl") and not carries_cpu("cuda:nccl")


def test_device_type_for():
    from halo.dist.mesh import device_type_for

    assert device_type_for("nccl") == "cuda"
    assert device_type_for("gloo", cuda_available=True) == "cpu"
    assert device_type_for("cpu:gloo,cuda:nccl", cuda_available=True) == "cuda"
    assert device_type_for("cuda:nccl,cpu:gloo", cuda_available=True) == "cuda"
    assert device_type_for("cpu:gloo,cuda:nccl", cuda_available=False) == "cpu"
    assert device_type_for("cpu:gloo") == "cpu"


def test_first_op_only_for_unbound_nccl():
    from halo.dist.comm import _needs_first_op

    assert _needs_first_op("nccl", None) and _needs_first_op("cpu:gloo,cuda:nccl", None)
    assert not _needs_first_op("nccl", torch.device("cuda", 0))
    assert not _needs_first_op("gloo", None)


class _Work:
    def __init__(self):
        self.calls = []

    def wait(self, timeout=None):
        self.calls.append(timeout)
        return True


def test_wait_under_capture_passes_no_timeout(monkeypatch):
    """set_timeout on NCCL polls the work's event from the host: illegal during graph capture. Under capture the
    wait is the plain stream-ordered one; outside, the bounded one."""
    from halo.dist import comm, transport

    previous = comm.set_timeout(5.0)
    try:
        cg = comm.CommGroup(None, 2, 0, (0, 1))
        work = _Work()
        comm.wait_all([work], ["peer"], cg, "test", 0.0, None)
        assert isinstance(work.calls[0], timedelta) and 0 < work.calls[0].total_seconds() <= 5.0
        monkeypatch.setattr(transport, "capturing", lambda device=None: True)
        comm.wait_all([work], ["peer"], cg, "test", 0.0, None)
        assert work.calls[1] is None
    finally:
        comm.set_timeout(previous)


def test_local_rank_from_launchers():
    from halo.launch import local_rank

    assert local_rank({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}, 8) == 3  # torchrun's wins
    assert local_rank({"SLURM_LOCALID": "2", "SLURM_PROCID": "10"}, 4) == 2  # srun
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 8) == 5  # Open MPI
    assert local_rank({"MPI_LOCALRANKID": "1"}, 8) == 1  # MPICH / Intel MPI
    assert local_rank({"PALS_LOCAL_RANKID": "7"}, 8) == 7
    assert local_rank({"RANK": "13"}, 4) == 1  # no local rank: the global rank modulo the devices
    assert local_rank({"PMI_RANK": "6"}, 0) == 0  # no devices: 6 % 1
    assert local_rank({}, 8) == 0
    assert local_rank({"LOCAL_RANK": " ", "SLURM_LOCALID": "4"}, 8) == 4  # empty: not set
    with pytest.raises(ValueError, match=r"SLURM_LOCALID='x'.*non-negative integer"):
        local_rank({"SLURM_LOCALID": "x"}, 8)
    with pytest.raises(ValueError, match=r"LOCAL_RANK='-1'"):
        local_rank({"LOCAL_RANK": "-1"}, 8)


def test_buffer_pool_under_capture_and_streams(monkeypatch):
    """While a CUDA graph is captured the pool hands out fresh buffers and keeps none (a replay writes what it
    captured whoever holds it now); buffers are reused only on the stream they were handed out on."""
    from halo.dist import transport

    like = torch.zeros(1, dtype=torch.float32)
    pool = transport.BufferPool()
    a = pool.get((3, 4), like)
    ptr = a.data_ptr()
    del a
    b = pool.get((3, 4), like)
    assert b.data_ptr() == ptr  # free again: reused (the eager path is unchanged)
    del b
    monkeypatch.setattr(transport, "capturing", lambda device=None: True)
    held = [pool.get((3, 4), like) for _ in range(3)]
    assert all(t.data_ptr() != ptr for t in held)  # not the pooled buffer, though it is free
    assert len({t.data_ptr() for t in held}) == 3
    assert sum(len(v) for v in pool._pools.values()) == 1  # nothing captured was kept
    monkeypatch.setattr(transport, "capturing", lambda device=None: False)
    monkeypatch.setattr(transport, "_stream_key", lambda device: 7)  # another stream
    c = pool.get((3, 4), like)
    assert c.data_ptr() != ptr
    monkeypatch.setattr(transport, "_stream_key", lambda device: 0)
    assert pool.get((3, 4), like).data_ptr() == ptr
