"""One rank of the simulated two-node job (``tests/test_multinode.py``): two torchrun agents on this machine, each
a "node" of 2 ranks. Checks the launcher's local-rank logic, the groups and host groups of domain groups that span
the two nodes and of ones inside a node, and one exact converted training step on each (float64 against the
unsharded model computed in this process). Writes this rank's findings as JSON to ``$HALO_MULTINODE_OUT/rank<r>``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import halo
from halo import launch
from halo.dist.comm import comm_group, unsharded
from halo.dist.mesh import DomainParallelManager
from halo.nn import convert_to_domain_parallel
from halo.parallel.reduce import domain_mean, sync_domain_gradients

H, W, C = 21, 12, 3  # 21 rows: 6, 5, 5, 5 on 4 ranks; 11, 10 on 2


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU(),
                         nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ConvTranspose2d(4, C, 2, stride=2)).double()


def exact_step(manager: DomainParallelManager, x: torch.Tensor) -> dict:
    """One converted step on ``manager``'s domain group against the unsharded model: max errors."""
    ref = net()
    with unsharded():
        out_ref = ref(x)
        out_ref.square().mean().backward()
    model = convert_to_domain_parallel(copy.deepcopy(net()), manager)
    x_local = halo.shard(x, group=manager.domain_group)
    out = model(x_local)
    domain_mean(out.square(), group=manager.domain_group).backward()
    sync_domain_gradients(model, manager)
    whole = halo.gather(out.detach(), group=manager.domain_group)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"out": (whole - out_ref).abs().max().item(),
            "grads": max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())}


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    halo.set_timeout(60)
    found: dict = {"rank": rank, "node": node, "local": local, "world": world}
    # the launcher's local-rank logic: torchrun's LOCAL_RANK, and without it the rank modulo the node's devices
    found["local_rank"] = launch.local_rank()
    found["local_rank_slurm"] = launch.local_rank({"SLURM_LOCALID": str(local)})
    found["local_rank_modulo"] = launch.local_rank({"RANK": str(rank)}, device_count=2)
    x = torch.randn(2, C, H, W, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, size in (("spans_nodes", 4), ("inside_node", 2)):
        manager = DomainParallelManager(world, size)
        cg = comm_group(manager.domain_group)
        host_ranks = [None] * cg.size
        dist.all_gather_object(host_ranks, rank, group=cg.host)  # the host group holds the domain group's ranks
        found[name] = {"domain_ranks": list(cg.ranks), "host_ranks": host_ranks,
                       "dp_ranks": dist.get_process_group_ranks(manager.data_parallel_group),
                       "nodes": sorted({r // 2 for r in cg.ranks}), **exact_step(manager, x)}
        halo.context.reset()
    out = os.environ["HALO_MULTINODE_OUT"]
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
