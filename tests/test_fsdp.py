"""Domain parallelism composed with data parallelism as users run it: DDP, FSDP2, HSDP, FSDP2 over every rank,
mixed precision, and distributed checkpoints.

dp x domain on gloo ranks, float64, 21 rows (uneven shards) and 3 channels (parameters FSDP2 shards unevenly).
Each replica gets its own sample; each rank's loss is its rows' share; after the backward,
``sync_domain_gradients(model)`` does what the mode needs (``halo.parallelize``). The full gradients equal the
unsharded model's gradient of the mean over the replicas' samples (1e-12; bf16 mixed precision to its rounding).
Hand-wired: the README's recipe (FSDP2 on ``device_mesh["dp"]``, ``sync_domain_gradients(model,
domain_group=...)``) is exact too, and summing *and* averaging over dp again with FSDP's DTensor gradients raises.
A checkpoint saved with ``torch.distributed.checkpoint`` from FSDP2 on 4 ranks loads into the unconverted model in
one process and into a converted model on 3 ranks, keys and values unchanged.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 21, 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.norm = nn.GroupNorm(1, C)
        self.b = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return self.b(F.gelu(self.norm(self.a(x))))


def _samples(n=2):
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(n, 2, C, H, W, dtype=torch.float64, generator=g)
    ws = torch.randn(n, 2, C, H, W, dtype=torch.float64, generator=g)
    return xs, ws


def _run(rank, world, how):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import local_share, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, 2)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Net().double(), manager)
    if how.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=manager.device_mesh["dp"])
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=manager.data_parallel_group)
    xs, ws = _samples()
    dp, r = manager.dp_rank, manager.domain_rank
    offs = split_offsets(H, 2)
    x = xs[dp][..., offs[r]:offs[r + 1], :]
    w = ws[dp][..., offs[r]:offs[r + 1], :]
    local_share((wrapped(x) * w).sum()).backward()  # this rank's share of the global sum
    try:
        if how == "fsdp-both":
            sync_domain_gradients(model, manager)
        else:
            sync_domain_gradients(model, domain_group=manager.domain_group)
    except ValueError as exc:
        return str(exc)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name.replace("module.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return grads


def _reference(n=2):
    torch.manual_seed(0)
    model = Net().double()
    xs, ws = _samples(n)
    loss = sum((model(xs[i]) * ws[i]).sum() for i in range(n)) / n  # the dp mean of the replicas' losses
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["fsdp", "ddp"])
def test_domain_sum_with_data_parallel_wrappers_is_exact(how):
    results = run_on_ranks(_run, 4, how, timeout=180)
    want = _reference()
    for r in results:
        for name, g in want.items():
            assert torch.allclose(r[name], g, rtol=0, atol=1e-12), (how, name, (r[name] - g).abs().max())


def test_fsdp_gradients_averaged_twice_over_dp_raise():
    results = run_on_ranks(_run, 4, "fsdp-both", timeout=180)
    assert all(isinstance(r, str) and "pass domain_group=manager.domain_group alone" in r for r in results), results


def _parallelized(rank, world, domain, mode, mixed, ckpt):
    import halo
    from halo.parallel.reduce import local_share, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, domain)
    torch.manual_seed(0)
    kwargs = {}
    if mixed:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mode == "hsdp":
        kwargs["hsdp_shards"] = 2
    f32 = mode.endswith("-f32")  # float32: gloo has no PREMUL_SUM, what FSDP's divide factor uses
    mode = mode.removesuffix("-f32")
    model = halo.parallelize(Net().double() if not f32 else Net(), manager, data_parallel=mode, **kwargs)
    dp_size = world // domain
    xs, ws = _samples(dp_size)
    dp, r = manager.dp_rank, manager.domain_rank
    offs = split_offsets(H, domain)
    x = xs[dp][..., offs[r]:offs[r + 1], :]
    w = ws[dp][..., offs[r]:offs[r + 1], :]
    if f32:
        x, w = x.float(), w.float()
    local_share((model(x) * w).sum()).backward()  # this rank's share of the global sum
    sync_domain_gradients(model)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name.replace("module.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    if ckpt:
        import torch.distributed.checkpoint as dcp

        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)  # a step, so the checkpoint holds trained values
        sd = model.state_dict()
        dcp.save(sd, checkpoint_id=ckpt)
        grads["_values"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                            for k, v in sd.items()}
    return grads


CASES = [("ddp", 4, 2, False), ("fsdp", 4, 2, False), ("fsdp-all", 4, 2, False), ("none", 4, 2, False),
         ("hsdp", 8, 2, False), ("fsdp-all-f32", 4, 2, False)]


@pytest.mark.parametrize("mode, world, domain, mixed", CASES)
def test_parallelize_modes_are_exact(mode, world, domain, mixed):
    results = run_on_ranks(_parallelized, world, domain, mode, mixed, None, timeout=240)
    want = _reference(world // domain)
    tol = 1e-4 if mode.endswith("-f32") else 1e-12
    for r in results:
        for name, g in want.items():
            assert torch.allclose(r[name].double(), g, rtol=0, atol=tol), (mode, name, (r[name] - g).abs().max())


def test_parallelize_fsdp_mixed_precision():
    results = run_on_ranks(_parallelized, 4, 2, "fsdp", True, None, timeout=240)
    want = _reference(2)
    for r in results:
        for name, g in want.items():
            rel = ((r[name] - g).abs().max() / g.abs().max()).item()
            assert rel < 5e-2, (name, rel)  # bf16 compute: its rounding, not a wrong sum (that would be ~1)
            assert r[name].dtype == torch.float64  # gradients land in the parameters' dtype


def _load_converted(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(Net().double(), manager)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_distributed_checkpoint_moves_between_rank_counts(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_parallelized, 4, 2, "fsdp", False, path, timeout=240)[0]["_values"]
    plain = Net().double()  # the unconverted model, one process, no process group
    sd = plain.state_dict()
    assert set(sd) == set(saved), (sorted(sd), sorted(saved))
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(sd)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]), k
    for got in run_on_ranks(_load_converted, 3, path, timeout=120):  # 3 domain ranks, another layout
        for k, v in got.items():
            assert torch.equal(v, saved[k]), k


def _parallelized_mesh(rank, world, shape, mode):
    import halo
    from halo.parallel.reduce import local_share, sync_domain_gradients

    mesh = halo.DomainMesh(shape)
    torch.manual_seed(0)
    model = halo.parallelize(Net().double(), mesh=mesh, data_parallel=mode)
    xs, ws = _samples(mesh.dp_size)
    dp = mesh.dp_rank
    x, w = halo.shard_2d(xs[dp], mesh=mesh), halo.shard_2d(ws[dp], mesh=mesh)
    local_share((model(x) * w).sum()).backward()  # this rank's share of the global sum
    sync_domain_gradients(model)  # the groups parallelize set it up with: the mesh's
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name.replace("module.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return grads


@pytest.mark.parametrize("shape, mode", [((1, 2), "ddp"), ((2, 1), "fsdp"), ((1, 2), "fsdp-all"), ((1, 2), "none")])
def test_parallelize_on_a_latitude_longitude_mesh(shape, mode):
    """dp 2 x a (ph, pw) mesh on 4 ranks: the gradient of the mean loss over the global batch, as one process."""
    results = run_on_ranks(_parallelized_mesh, 4, shape, mode, timeout=240)
    want = _reference(2)
    for r in results:
        for name, g in want.items():
            assert torch.allclose(r[name], g, rtol=0, atol=1e-12), (mode, name, (r[name] - g).abs().max())
