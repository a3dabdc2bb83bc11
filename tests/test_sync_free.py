"""No hidden host syncs (issue 33, item 2): over 18 training steps, the every-8th replicated-state check included,
a converted model with ``grid=`` reads nothing back to the host and runs no host collective (without ``grid=``: one
host all-gather every 8th call, and at a call whose inputs changed); a standalone layer
agrees once per shape, not once per call; and what the checks exist for is still caught.

All on 2 gloo ranks, float64, odd sizes (45 rows: 23 + 22), every step compared with the unsharded model run in the
same test (forward, and for the standalone layer backward too). Counted with :class:`halo.testing.HostWorkCounter`:
``read`` (a value read into Python: on a GPU, a wait for all queued work), ``from_data``, ``agreement`` (halo's host
agreements) and each ``torch.distributed`` call.
"""

import pytest
import torch
from _helpers import SteadyNet, steady_reference
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 45, 16, 3
STEPS = 18  # the periodic check launches at forwards 0, 8 and 16 and reads the previous one's words at 8 and 16


def _local(full, world, rank):
    offs = split_offsets(full.shape[-2], world)
    return full.narrow(-2, offs[rank], offs[rank + 1] - offs[rank])


def _field(h=H, seed=1):
    return torch.randn(2, C, h, W, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# -- a converted model's steady steps ---------------------------------------------------------------------------

def _train(rank, world, grid=(H, W)):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.plan.replicated import check_every
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    assert check_every() == 8
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet().double(), manager, boundary=None, grid=grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = _local(_field(), world, rank).clone()
    counts, outputs = [], []
    for _ in range(STEPS):
        with HostWorkCounter(keep_stacks=True) as counter:
            opt.zero_grad(set_to_none=True)
            out = model(x)
            domain_mean((out - x) ** 2).backward()
            sync_domain_gradients(model, manager)
            opt.step()
        counts.append((counter.summary(), dict(counter.where)))
        outputs.append(out.detach())
    return counts, outputs


def _reference(steps):
    return steady_reference(_field(), steps)


def test_converted_model_with_grid_makes_no_host_work_for_18_steps():
    world = 2
    results = run_on_ranks(_train, world, timeout=300)
    ref = _reference(STEPS)
    for rank, (counts, outputs) in enumerate(results):
        for step, out in enumerate(outputs):  # exact against the unsharded model, every step
            want = _local(ref[step], world, rank)
            assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), (rank, step, (out - want).abs().max())
        assert counts[0][0].get("agreement", 0) > 1, counts[0][0]  # the first step learns
        messages = counts[2][0].get("c10d.batch_isend_irecv", 0)
        assert messages >= 6, counts[2][0]
        for step in range(2, STEPS):  # every steady step, the check's steps 8 and 16 included
            summary, where = counts[step]
            assert summary.get("read", 0) == 0, (rank, step, where.get("read"))
            assert summary.get("from_data", 0) == 0, (rank, step, where.get("from_data"))
            assert summary.get("agreement", 0) == 0, (rank, step, where.get("agreement"))
            for host in ("all_gather", "all_gather_object", "broadcast", "barrier", "gather"):
                assert summary.get(f"c10d.{host}", 0) == 0, (rank, step, host, summary)
            assert summary.get("c10d.batch_isend_irecv", 0) == messages, (rank, step, summary)
            # GroupNorm forward and backward, the loss forward and backward, one gradient bucket; and at a check
            # step one more: the checksum's all-reduce (on the device group; started, not waited for)
            want = 5 + (step % 8 == 0)
            assert summary.get("c10d.all_reduce", 0) == want, (rank, step, summary)


def test_converted_model_without_grid_agrees_only_every_8th_call_for_18_steps():
    """No ``grid=``: the first call learns the grid; later calls whose inputs look as at the last agreed one reuse
    its epoch with no host collective, and every 8th call agrees again (forwards 8 and 16: one host all-gather each,
    beside the replicated check's device all-reduce); exact against the unsharded model at every step."""
    world = 2
    results = run_on_ranks(_train, world, None, timeout=300)
    ref = _reference(STEPS)
    for rank, (counts, outputs) in enumerate(results):
        for step, out in enumerate(outputs):
            want = _local(ref[step], world, rank)
            assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), (rank, step, (out - want).abs().max())
        for step in range(2, STEPS):
            summary, where = counts[step]
            due = step % 8 == 0
            assert summary.get("read", 0) == 0, (rank, step, where.get("read"))
            assert summary.get("from_data", 0) == 0, (rank, step, where.get("from_data"))
            assert summary.get("agreement", 0) == int(due), (rank, step, where.get("agreement"))
            assert summary.get("c10d.all_gather", 0) == int(due), (rank, step, summary)
            for host in ("all_gather_object", "broadcast", "barrier", "gather"):
                assert summary.get(f"c10d.{host}", 0) == 0, (rank, step, host, summary)
            assert summary.get("c10d.all_reduce", 0) == 5 + due, (rank, step, summary)


def _model_inputs_change(rank, world, heights, one_rank_only):
    """A converted model without ``grid=``, trained at the heights given (two steps each); ``one_rank_only``: at the
    last height rank 1 alone is given 3 more columns. What every rank computed or raised."""
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(4)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.Conv2d(4, 2, 3, stride=2,
                                                                                              padding=1)).double(),
                                       manager)
    out = []
    for i, h in enumerate(heights):
        full = _field(h, seed=i)
        if one_rank_only and i == len(heights) - 1 and rank == 1:
            full = torch.cat([full, full[..., :3]], dim=-1)
        x = _local(full, world, rank).clone().requires_grad_()
        try:
            for _ in range(2):
                x.grad = None
                y = model(x)
                domain_mean(y.square()).backward()
        except Exception as exc:  # noqa: BLE001 - the test reports what every rank raised
            out.append((type(exc).__name__, str(exc)))
            break
        out.append((y.detach(), x.grad))
    return out


def _conv_reference(h, seed):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.Conv2d(4, 2, 3, stride=2, padding=1)).double()
    full = _field(h, seed=seed).requires_grad_()
    y = net(full)
    y.square().mean().backward()
    return y.detach(), full.grad


def test_converted_model_learns_a_grid_every_rank_sees_change():
    """45 -> 41 -> 37 rows over 2 ranks (23 + 22, 21 + 20, 19 + 18: every rank's shard changes): the changed calls
    agree on every rank and learn the new grid; forward and input gradient exact at every height."""
    heights = [45, 41, 37, 45]
    results = run_on_ranks(_model_inputs_change, 2, heights, False, timeout=120)
    for rank, res in enumerate(results):
        assert len(res) == len(heights), (rank, res)
        for i, (y, gx) in enumerate(res):
            want_y, want_gx = _conv_reference(heights[i], i)
            offs_in, offs_out = split_offsets(heights[i], 2), split_offsets(want_y.shape[-2], 2)
            assert torch.allclose(y, want_y[..., offs_out[rank]:offs_out[rank + 1], :], rtol=1e-12, atol=1e-12)
            assert torch.allclose(gx, want_gx[..., offs_in[rank]:offs_in[rank + 1], :], rtol=1e-12, atol=1e-12)


def test_converted_model_input_changed_on_one_rank_raises_on_every_rank():
    """Rank 1 alone is given a wider field: its peer's call looks steady and skips the agreement; both raise
    HaloCommError within the timeout (never a result computed with the old plans), each naming its peer, and the
    changed rank says what changed and what to do."""
    results = run_on_ranks(_model_inputs_change, 2, [45, 45], True, timeout=120)
    last = [res[-1] for res in results]
    assert all(isinstance(r[0], str) and r[0] == "HaloCommError" for r in last), last
    assert "global rank 1" in last[0][1] and "global ranks [0]" in last[1][1], last
    assert "Likely cause: on this rank its field's local extents (dims -2, -1) went from (22, 16) to (22, 19)" \
        in last[1][1], last[1]
    assert "set_grid(model, None)" in last[1][1], last[1]


# -- a diverged parameter is still caught -----------------------------------------------------------------------

def _diverge(rank, world, every, at, finish):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.plan.replicated import check_every, finish_check
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(20)
    check_every(every)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet().double(), manager, boundary=None, grid=(H, W))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = _local(_field(), world, rank).clone()
    done, reads = 0, 0
    try:
        for step in range(3 * every + 2):
            if step == at and rank == 1:
                with torch.no_grad():
                    model.dec.bias[1] += 1e-9  # one weight of one rank drifts (an optimizer step on one rank)
            with HostWorkCounter() as counter:
                opt.zero_grad(set_to_none=True)
                domain_mean((model(x) - x) ** 2).backward()
                sync_domain_gradients(model, manager)
                opt.step()
            if step >= 2:
                reads += counter.summary().get("read", 0)
            done += 1
            if finish and step == at:
                finish_check(model)
    except ValueError as exc:
        return done, reads, str(exc)
    return done, reads, None


@pytest.mark.parametrize("finish", [False, True])
def test_diverged_parameter_is_named_on_every_rank(finish):
    """``check_every(4)``: rank 1's bias drifts before step 5. The check launched at forward 8 sees it; its words are
    read at forward 12 (the next check), where every rank raises the same error naming the tensor; no steady step
    before it read anything back. With ``finish_check`` (a natural sync point) right after the drift, the
    pending check is read at once: it was launched at forward 4, before the drift, so nothing is reported there, and
    the drift is found as before."""
    results = run_on_ranks(_diverge, 2, 4, 5, finish, timeout=180)
    dones = [d for d, _, _ in results]
    errors = [e for _, _, e in results]
    assert dones == [12, 12], results  # the forward of step 12 raises
    assert all(r == 0 for _, r, _ in results), results
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "'dec.bias' (float64 [3]) differs across the domain group" in errors[0], errors[0]
    assert "group ranks [0] (global [0])" in errors[0] and "group ranks [1] (global [1])" in errors[0], errors[0]
    assert "periodic check at forward 8 (its result read at forward 12" in errors[0], errors[0]


def _finish_now(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.plan.replicated import check_every, finish_check

    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(20)
    check_every(8)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet().double(), manager, boundary=None, grid=(H, W))
    if rank == 1:  # after conversion's own check: diverged before the first forward
        with torch.no_grad():
            model.enc.weight[0, 0, 0, 0] += 1e-9
    x = _local(_field(), world, rank).clone()
    with torch.no_grad():
        model(x)  # forward 0 launches the check; nothing waits for it
    try:
        finish_check(model)
    except ValueError as exc:
        return str(exc)
    return None


def test_finish_check_reads_the_pending_check_at_once():
    errors = run_on_ranks(_finish_now, 2, timeout=120)
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "'enc.weight' (float64 [6, 3, 3, 3]) differs across the domain group" in errors[0], errors[0]
    assert "periodic check at forward 0 (its result read at forward 1" in errors[0], errors[0]


# -- a standalone layer on a plain shard ----------------------------------------------------------------------

def _standalone(rank, world, heights):
    import halo
    from halo.nn import DomainConv2d
    from halo.testing import HostWorkCounter

    halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    convs = [nn.Conv2d(C, 4, 3, padding=1).double(), nn.Conv2d(C, 4, 3, stride=2, padding=1).double()]
    layers = [DomainConv2d(c) for c in convs]
    results = []
    for i, h in enumerate(heights):
        full = _field(h, seed=i)
        x = _local(full, world, rank).clone().requires_grad_()  # a plain shard: not made by halo.shard
        with HostWorkCounter() as counter:
            ys = [layer(x) for layer in layers]
            sum((y * y).sum() for y in ys).backward()  # a per-rank loss: the plain adjoint of each conv
        results.append((h, counter.summary().get("agreement", 0), [y.detach() for y in ys], x.grad,
                        [(layer.weight.grad.clone(), layer.bias.grad.clone()) for layer in layers]))
        for layer in layers:
            layer.zero_grad(set_to_none=True)
    return results


def _unsharded(h, seed, world):
    torch.manual_seed(0)
    convs = [nn.Conv2d(C, 4, 3, padding=1).double(), nn.Conv2d(C, 4, 3, stride=2, padding=1).double()]
    full = _field(h, seed=seed).requires_grad_()
    ys = [c(full) for c in convs]
    gys = [2 * y.detach() for y in ys]  # d/dy of sum(y * y), whose rows each rank holds
    grads = torch.autograd.grad(ys, [full, *[p for c in convs for p in c.parameters()]], gys)
    return [y.detach() for y in ys], grads


def test_standalone_layer_agrees_once_per_shape():
    """Two DomainConv2d (3x3, and stride 2, whose output rows depend on every rank's extent) on plain shards, 16 calls
    at 45 rows, then 8 at 47 (24 + 23: every rank's shard changed): one agreement per layer at each new shape,
    none in the other calls; forward and backward exact against the unsharded convs in every call."""
    world = 2
    heights = [H] * 16 + [47] * 8
    results = run_on_ranks(_standalone, world, heights, timeout=240)
    ref = {}
    for rank, res in enumerate(results):
        for i, (h, agreements, ys, gx, gparams) in enumerate(res):
            if i not in ref:
                ref[i] = _unsharded(h, i, world)
            want_ys, want_grads = ref[i]
            first = i == 0 or heights[i - 1] != h
            assert agreements == (2 if first else 0), (rank, i, h, agreements)
            for y, want in zip(ys, want_ys, strict=True):
                want_local = _local(want, world, rank)
                assert torch.allclose(y, want_local, rtol=1e-12, atol=1e-12), (rank, i)
            assert torch.allclose(gx, _local(want_grads[0], world, rank), rtol=1e-12, atol=1e-12), (rank, i)
            got_params = [g for pair in gparams for g in pair]
            # (this rank's share of each parameter gradient, summed over the ranks below)
            if rank == 0:
                other = [g for pair in results[1][i][4] for g in pair]
                for g0, g1, want in zip(got_params, other, want_grads[1:], strict=True):
                    assert torch.allclose(g0 + g1, want, rtol=1e-10, atol=1e-10), (i, (g0 + g1 - want).abs().max())


def _extent_changes_on_some_ranks(rank, world):
    """45 rows (23 + 22), then 44 (22 + 22): rank 1's plain shard keeps its shape while the global extent changes.
    Rank 1 cannot tell; rank 0 agrees anew; neither may compute a silently wrong stride-2 conv."""
    import halo
    from halo.nn import DomainConv2d

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(4)
    torch.manual_seed(0)
    layer = DomainConv2d(nn.Conv2d(C, 4, 3, stride=2, padding=1).double())
    layer(_local(_field(45), world, rank))
    try:
        layer(_local(_field(44), world, rank))
    except Exception as exc:  # noqa: BLE001 - the test reports what every rank raised
        return type(exc).__name__, str(exc)
    return None


def test_standalone_layer_never_reuses_a_stale_plan():
    results = run_on_ranks(_extent_changes_on_some_ranks, 2, timeout=120)
    assert all(r is not None and r[0] == "HaloCommError" for r in results), results
    assert "global ranks [1]" in results[0][1] and "global rank 0" in results[1][1], results  # each names its peer
    assert "changed since its last call ((2, 3, 23, 16) -> (2, 3, 22, 16))" in results[0][1], results[0]


class _Event:
    """A CUDA event's host side as :func:`halo.dist.transport.wait_event` uses it (CPU-checkable)."""

    def __init__(self, done_after):
        self.queries, self.done_after, self.synced = 0, done_after, False

    def query(self):
        self.queries += 1
        return self.queries > self.done_after

    def synchronize(self):
        self.synced = True


class _Group:
    ranks, index, size = (0, 1), 0, 2


def test_the_pinned_copy_wait_is_bounded():
    """The CUDA path's host wait on the event behind the checksum's copy: returns once the event completed,
    ``synchronize()`` without a bound set, and past :func:`halo.set_timeout` a ``HaloCommError`` naming the peers."""
    import time

    import halo
    from halo.dist.transport import HaloCommError, wait_event

    previous = halo.set_timeout(None)
    try:
        ev = _Event(10**9)
        wait_event(ev, _Group(), "check", time.monotonic(), None)
        assert ev.synced and ev.queries == 0
        halo.set_timeout(0.2)
        ev = _Event(3)
        wait_event(ev, _Group(), "check", time.monotonic(), None)
        assert ev.queries == 4 and not ev.synced
        began = time.monotonic()
        with pytest.raises(HaloCommError, match=r"check: rank 0 .* waiting on the device work of the all-reduce "
                                                r"with global ranks \[1\]"):
            wait_event(_Event(10**9), _Group(), "check", time.monotonic(), None)
        assert time.monotonic() - began < 5
    finally:
        halo.set_timeout(previous)
