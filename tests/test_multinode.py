"""Multi-node, simulated (issue 33 item 8): two ``torchrun`` agents on this machine (``--nnodes 2``, 2 ranks each),
as a two-node job would start. Domain groups that span the two "nodes" and groups inside one are checked: the
launcher's local-rank logic on each node, the groups' and host groups' ranks, and one converted training step
exact (float64) against the unsharded model on each. Both agents run under one timeout, so a hang fails."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

JOB = Path(__file__).resolve().parent / "multinode_job.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_domain_groups_across_and_inside_nodes(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="", HALO_MULTINODE_OUT=str(tmp_path), OMP_NUM_THREADS="1")
    port = _free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                                str(port), str(JOB)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for node in (0, 1)]
    deadline, logs = time.monotonic() + 240, []
    for agent in agents:
        try:
            logs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise AssertionError("the two-node job did not finish within 240 s:\n" + "\n".join(logs)) from None
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)
    found = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(4)]
    for f in found:
        r = f["rank"]
        # torchrun numbers ranks node by node: node n holds ranks 2n, 2n+1, local ranks 0, 1
        assert (f["node"], f["local"]) == (r // 2, r % 2), f
        assert f["local_rank"] == f["local_rank_slurm"] == f["local_rank_modulo"] == r % 2, f
        across, inside = f["spans_nodes"], f["inside_node"]
        assert across["domain_ranks"] == across["host_ranks"] == [0, 1, 2, 3] and across["nodes"] == [0, 1], f
        block = [2 * (r // 2), 2 * (r // 2) + 1]  # CREDIT's layout: contiguous domain blocks, one per node here
        assert inside["domain_ranks"] == inside["host_ranks"] == block and inside["nodes"] == [r // 2], f
        assert inside["dp_ranks"] == [r % 2, r % 2 + 2], f  # data parallel strided, across the nodes
        for case in (across, inside):
            assert case["out"] < 1e-12 and case["grads"] < 1e-12, f  # exact: float64 rounding only
