"""The fast paths where they apply (issue 33 item 5): compute-then-patch on a latitude x longitude mesh whose W axis
has one rank is the latitude-rows path (the W axis is plain: the conv pads it itself), not pad-then-conv.

Compared in float64 with the unsharded conv in the same test (forward, input and parameter gradients), and the
path taken is counted, so the test fails if the mesh falls back to pad-then-conv (a full copy of the shard each way).
"""

import os

import pytest
import torch
import torch.nn as nn

from halo.plan.partition import local_range
from halo.testing import run_on_ranks

TOL = 1e-11


def _count_patches(conv_mod) -> dict:
    """Count the 1-D compute-then-patch calls (``_PatchConvFn.apply``) of this rank from now on."""
    calls = {"patch": 0}
    apply = conv_mod._PatchConvFn.apply

    def counted(*a):
        calls["patch"] += 1
        return apply(*a)

    conv_mod._PatchConvFn.apply = counted
    return calls


def _size1_ranks(rank, world, shape):
    os.environ["TRITON_INTERPRET"] = "0"
    import torch.distributed as dist

    import halo.nn.conv as conv_mod
    from halo.dist.mesh import DomainMesh
    from halo.nn import DomainConv2d

    mesh = DomainMesh(shape, periodic=(False, True))
    calls = _count_patches(conv_mod)
    out = {}
    full = torch.randn(2, 3, 23, 17, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for k, dil, mode in ((3, 1, "zeros"), (5, 2, "circular"), (3, 1, "reflect")):
        torch.manual_seed(2)
        conv = nn.Conv2d(3, 4, k, padding=dil * (k // 2), dilation=dil, padding_mode=mode).double()
        xf = full.clone().requires_grad_(True)
        yr = conv(xf)
        g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (yr * g).sum().backward()
        pref = [p.grad.clone() for p in conv.parameters()]
        conv.zero_grad()
        (h0, h1) = local_range(23, mesh.axis_size(0), mesh.axis_rank(0))
        x = full[..., h0:h1, :].clone().requires_grad_(True)
        before = calls["patch"]
        y = DomainConv2d(conv, mesh=mesh)(x)
        (y * g[..., h0:h1, :]).sum().backward()
        pg = [p.grad.clone() for p in conv.parameters()]
        for t in pg:
            dist.all_reduce(t, group=mesh.domain_group)
        out[f"k{k} d{dil} {mode}"] = (
            max([float((y - yr.detach()[..., h0:h1, :]).abs().max()),
                 float((x.grad - xf.grad[..., h0:h1, :]).abs().max())]
                + [float((a - b).abs().max()) for a, b in zip(pg, pref, strict=True)]),
            calls["patch"] - before)
    return out


@pytest.mark.parametrize("shape", [(3, 1)])
def test_compute_then_patch_on_a_mesh_with_a_one_rank_w_axis(shape):
    for r in run_on_ranks(_size1_ranks, shape[0] * shape[1], shape, timeout=300):
        for name, (err, patched) in r.items():
            assert err <= TOL, (name, err)
            assert patched == 1, (name, "compute-then-patch not taken", patched)


def _launch_ranks(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    from torch.utils._python_dispatch import TorchDispatchMode

    import halo
    from halo.nn import DomainConv2d

    class Convs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {"convolution": 0, "convolution_backward": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in self.n:
                self.n[name] += 1
            return func(*args, **(kwargs or {}))

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    full = torch.randn(1, 3, 23, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (h0, h1) = local_range(23, world, rank)
    layer = DomainConv2d(conv, group=manager.domain_group)
    x = full[..., h0:h1, :].clone().requires_grad_(True)
    layer(x).sum().backward()  # the first call plans
    x.grad = None
    counter = Convs()
    with counter:
        y = layer(x)
        y.sum().backward()
    ref = conv(full)
    return counter.n, float((y - ref.detach()[..., h0:h1, :]).abs().max())


def test_compute_then_patch_is_one_strip_conv_per_layer():
    """Both boundary strips of a middle rank in one conv (stacked along the batch), forward and backward: two
    launches each way per layer (the shard's conv and the strips'), not three."""
    results = run_on_ranks(_launch_ranks, 3, timeout=300)
    for rank, (n, err) in enumerate(results):
        assert err <= TOL, (rank, err)
        assert n == {"convolution": 2, "convolution_backward": 2}, (rank, n)


def _by_size_ranks(rank, world):
    import copy

    import torch.distributed as dist

    import halo
    import halo.nn.conv as conv_mod
    from halo.nn import convert_to_domain_parallel

    conv_mod._PATCH_MIN_ENV = None  # the default rule, not the suite's HALO_PATCH_MIN_ELEMENTS=0
    default = conv_mod.PATCH_MIN_ELEMENTS["cpu"]
    halo.initialize_domain_parallel(world, world)
    calls = _count_patches(conv_mod)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 4, 3, padding=1), nn.GELU(),
                        nn.Conv2d(4, 4, 5, padding=4, dilation=2)).double()
    model = convert_to_domain_parallel(copy.deepcopy(net))
    full = torch.randn(2, 4, 45, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h0, h1 = local_range(45, world, rank)  # 23 + 22 rows of 2 x 4 x 16: 2944 and 2816 elements
    out = {}
    for name, least in (("default", default), ("above both", 4000), ("below both", 1000), ("between", 2900)):
        conv_mod.PATCH_MIN_ELEMENTS["cpu"] = least
        xf = full.clone().requires_grad_(True)
        net.zero_grad()
        yr = net(xf)
        g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (yr * g).sum().backward()
        model.zero_grad()
        x = full[..., h0:h1, :].clone().requires_grad_(True)
        before = calls["patch"]
        y = model(x)
        (y * g[..., h0:h1, :]).sum().backward()
        errs = [float((y - yr.detach()[..., h0:h1, :]).abs().max()),
                float((x.grad - xf.grad[..., h0:h1, :]).abs().max())]
        for p, q in zip(model.parameters(), net.parameters(), strict=True):
            t = p.grad.clone()
            dist.all_reduce(t)
            errs.append(float((t - q.grad).abs().max()))
        out[name] = (max(errs), calls["patch"] - before, x.numel())
    conv_mod.PATCH_MIN_ELEMENTS["cpu"] = default
    return out


def test_overlap_default_chooses_the_path_by_shard_size_and_ranks_may_differ():
    """``overlap=None`` takes compute-then-patch on shards of at least ``PATCH_MIN_ELEMENTS`` elements and
    pad-then-conv below (the suite's tiny shapes would pad by default: the 32 Ki elements measured on CPU). The two
    paths send the same messages, so a threshold between the ranks' shard sizes (2944 and 2816 elements) has rank 0
    patch and rank 1 pad in the same step, still exact: forward, input and parameter gradients, float64."""
    results = run_on_ranks(_by_size_ranks, 2, timeout=300)
    layers = 3
    expect = {"default": (0, 0), "above both": (0, 0), "below both": (layers, layers), "between": (layers, 0)}
    for rank, out in enumerate(results):
        for name, (err, patched, numel) in out.items():
            assert err <= TOL, (rank, name, err)
            assert patched == expect[name][rank], (rank, name, patched, numel)
