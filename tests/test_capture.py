"""A steady step is capturable in a CUDA graph (issue 33 item 3), checked with the capture APIs' CPU-checkable parts.

While a CUDA stream captures, the host must do nothing a replay would skip or a capture forbids: no read of a
value into Python (a sync: illegal during capture), no tensor built from Python data (a blocking host-to-device
copy), no host agreement or host collective (gloo or the object collectives run once, at capture, never at replay),
no data-dependent op (``nonzero``, ``item``, ``masked_select``, ``unique``, ``equal``: their output shape or value
needs the device's result on the host), and no pooled buffer handed out (a replay writes into what it captured,
whoever holds it then). halo asks :func:`halo.dist.transport.capturing`; here it answers "capturing" for the steps
after the first two eager ones, on 2 gloo ranks, float64, 45 rows (23 + 22), 10 steps (the replicated check's step
8 included, which it defers to the next eager forward), each compared with the unsharded model.
"""

import torch
from _helpers import SteadyNet, steady_reference
from torch.utils._python_dispatch import TorchDispatchMode

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 45, 16, 3
STEPS = 10
DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                  "unique_consecutive", "equal", "is_nonzero", "item", "argwhere", "nonzero_static"}


def _local(full, world, rank):
    offs = split_offsets(full.shape[-2], world)
    return full.narrow(-2, offs[rank], offs[rank + 1] - offs[rank])


class _Ops(TorchDispatchMode):
    """The aten ops a step dispatches (by overload packet name)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _train(rank, world):
    import halo
    from halo.dist import transport
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet().double(), manager, boundary=None, grid=(H, W))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = _local(full, world, rank).clone()
    results = []
    eager = transport.capturing
    for step in range(STEPS):
        capture = step >= 2
        transport.capturing = (lambda device=None: True) if capture else eager
        ops = _Ops()
        try:
            with HostWorkCounter(keep_stacks=True) as counter, ops:
                opt.zero_grad(set_to_none=True)
                out = model(x)
                domain_mean((out - x) ** 2).backward()
                sync_domain_gradients(model, manager)
        finally:
            transport.capturing = eager
        opt.step()  # outside the "capture": torch's SGD is not halo's (users capture with capturable optimizers)
        results.append((capture, counter.summary(), dict(counter.where), sorted(ops.seen & DATA_DEPENDENT),
                        out.detach()))
    return results


def test_a_steady_step_does_nothing_a_cuda_graph_capture_forbids():
    world = 2
    runs = run_on_ranks(_train, world, timeout=300)
    ref = steady_reference(torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
                           STEPS)
    for rank, results in enumerate(runs):
        assert sum(capture for capture, *_ in results) == STEPS - 2
        for step, (capture, summary, where, data_dependent, out) in enumerate(results):
            want = _local(ref[step], world, rank)
            assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), (rank, step, (out - want).abs().max())
            if not capture:
                continue
            assert data_dependent == [], (rank, step, data_dependent)
            for key in ("read", "from_data", "agreement"):
                assert summary.get(key, 0) == 0, (rank, step, key, where.get(key))
            for host in ("all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                         "gather", "scatter"):
                assert summary.get(f"c10d.{host}", 0) == 0, (rank, step, host, summary)
            # the replicated check of steps 8 and 16 is deferred under capture: only the step's own reductions
            # (GroupNorm forward and backward, the loss forward and backward, one gradient bucket)
            assert summary.get("c10d.all_reduce", 0) == 5, (rank, step, summary)
            assert summary.get("c10d.batch_isend_irecv", 0) >= 6, (rank, step, summary)
