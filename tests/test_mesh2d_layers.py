"""Latitude x longitude layers: a model converted with ``mesh=DomainMesh((ph, pw))`` vs the unsharded model.

Each rank holds a block of the field (H over the mesh's first axis, W over the second, both balanced splits at odd
sizes). Compared in float64 with the unsharded model run in the same test: the forward (gathered), the input
gradient, the parameter gradients summed over the domain group, BatchNorm's running statistics, and the model after
optimizer steps. Single layers cover the pole boundary with W sharded (rows across the pole rolled by W/2 around the
whole circle by the W ranks), max-pool indices, and every upsampling mode. Conversion refuses, on every rank alike,
layers without a latitude x longitude form.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from halo.plan.partition import local_range
from halo.testing import run_on_ranks

TOL = 1e-11


def _block(t, mesh):
    (h0, h1), (w0, w1) = (local_range(t.shape[d], mesh.axis_size(a), mesh.axis_rank(a)) for a, d in ((0, -2), (1, -1)))
    return t[..., h0:h1, w0:w1]


class Net(nn.Module):
    """Every layer kind with a latitude x longitude form, at sizes that split unevenly: 23 x 30 -> 12 x 15 -> ..."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(c, 6, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 6), nn.GELU())
        self.down = nn.Conv2d(6, 8, (3, 5), stride=2, padding=(1, 2))  # 23 x 30 -> 12 x 15
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1, ceil_mode=True)  # -> 6 x 8
        self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding="same", padding_mode="reflect"), nn.InstanceNorm2d(8),
                                 nn.Conv2d(8, 8, 1))
        self.avg = nn.AvgPool2d((2, 3), (1, 2), (1, 1), count_include_pad=False)  # -> 7 x 4
        self.up = nn.Upsample(size=(12, 15), mode="bilinear")
        self.tconv = nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=(0, 1))  # -> 23 x 30
        self.near = nn.Upsample(scale_factor=1, mode="nearest")
        self.out = nn.Conv2d(12, c, 5, padding=2)

    def forward(self, x):
        a = self.inc(x)
        b = self.pool(torch.relu(self.bn(self.down(a))))
        b = self.up(self.avg(self.mid(b)))
        b = self.near(self.tconv(b))
        return self.out(torch.cat([a, b], dim=1))


def _model_ranks(rank, world, shape, steps):
    os.environ["TRITON_INTERPRET"] = "0"
    import torch.distributed as dist

    from halo.dist.mesh import DomainMesh
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.shard import gather_2d

    mesh = DomainMesh(shape, periodic=(False, True))
    torch.manual_seed(0)
    ref = Net().double()
    model = convert_to_domain_parallel(Net().double(), mesh=mesh)
    model.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"fwd": [], "xgrad": [], "pgrad": [], "loss": []}
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 + step)
        full = torch.randn(2, 3, 23, 30, generator=gen, dtype=torch.float64)
        target = torch.randn(2, 3, 23, 30, generator=gen, dtype=torch.float64)
        xf = full.clone().requires_grad_(True)
        yr = ref(xf)
        loss_ref = ((yr - target) ** 2).mean()
        opt_ref.zero_grad()
        loss_ref.backward()
        x = _block(full, mesh).clone().requires_grad_(True)
        y = model(x)
        loss = domain_mean((y - _block(target, mesh)) ** 2, group=mesh.domain_group)
        opt.zero_grad()
        loss.backward()
        sync_domain_gradients(model, domain_group=mesh.domain_group, dp_group=None)
        yf = gather_2d(y.detach(), mesh=mesh)
        out["fwd"].append(float((yf - yr.detach()).abs().max()) if yf.shape == yr.shape else float("inf"))
        out["loss"].append(abs(float(loss.detach()) - float(loss_ref.detach())))
        out["xgrad"].append(float((x.grad - _block(xf.grad, mesh)).abs().max()))
        out["pgrad"].append(max(float((p.grad - q.grad).abs().max())
                                for p, q in zip(model.parameters(), ref.parameters(), strict=True)))
        opt_ref.step()
        opt.step()
    out["params"] = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    out["buffers"] = max(float((b.double() - c.double()).abs().max())
                         for b, c in zip(model.buffers(), ref.buffers(), strict=True))
    out["keys"] = list(model.state_dict()) == list(ref.state_dict())
    dist.barrier()
    return out


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)])
def test_converted_model_equals_unsharded(shape):
    results = run_on_ranks(_model_ranks, shape[0] * shape[1], shape, 2, timeout=300)
    for r in results:
        assert r["keys"]
        for key in ("fwd", "loss", "xgrad", "pgrad"):
            assert max(r[key]) < TOL, (key, r[key])
        assert r["params"] < TOL and r["buffers"] < TOL, (r["params"], r["buffers"])


def _pole_reference(x, conv, boundary):
    k, n, w = (1 if boundary == "pole" else 0), x.shape[-2], x.shape[-1]
    p = conv.padding[0]
    north = x.narrow(-2, k, p).flip(-2).roll(w // 2, -1)
    south = x.narrow(-2, n - k - p, p).flip(-2).roll(w // 2, -1)
    xp = F.pad(torch.cat([north, x, south], dim=-2), (conv.padding[1], conv.padding[1], 0, 0), mode="circular")
    return F.conv2d(xp, conv.weight, conv.bias, conv.stride, 0, conv.dilation)


def _layer_ranks(rank, world, shape):
    os.environ["TRITON_INTERPRET"] = "0"
    import torch.distributed as dist

    from halo.dist.mesh import DomainMesh
    from halo.nn import DomainConv2d, DomainMaxPool2d, DomainUpsample, convert_to_domain_parallel

    mesh = DomainMesh(shape, periodic=(False, True))
    out = {}

    def compare(name, fn_ref, layer, full, params=()):
        xf = full.clone().requires_grad_(True)
        yr = fn_ref(xf)
        g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        for p in params:
            p.grad = None
        (yr * g).sum().backward()
        pref = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        x = _block(full, mesh).clone().requires_grad_(True)
        y = layer(x)
        (y * _block(g, mesh)).sum().backward()
        pg = [p.grad.clone() for p in params]
        for t in pg:
            dist.all_reduce(t, group=mesh.domain_group)
        want = _block(yr.detach(), mesh)
        out[name] = max([float((y - want).abs().max()) if y.shape == want.shape else float("inf"),
                         float((x.grad - _block(xf.grad, mesh)).abs().max())]
                        + [float((a - b).abs().max()) for a, b in zip(pg, pref, strict=True)])

    full = torch.randn(2, 3, 21, 26, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for boundary in ("pole", "pole_centered"):
        for k, dil in ((3, 1), (5, 1), (3, 2)):
            conv = nn.Conv2d(3, 4, k, padding=dil * (k // 2), dilation=dil, padding_mode="circular").double()
            compare(f"{boundary} k{k} d{dil}", lambda t, c=conv, b=boundary: _pole_reference(t, c, b),
                    DomainConv2d(conv, boundary=boundary, mesh=mesh), full, list(conv.parameters()))
    pool = nn.MaxPool2d((3, 2), (2, 3), (1, 1), return_indices=True, ceil_mode=True)
    yr, ir = pool(full)
    y, i = DomainMaxPool2d(pool, mesh=mesh)(_block(full, mesh))
    out["maxpool indices"] = float(torch.equal(y, _block(yr, mesh)) and torch.equal(i, _block(ir, mesh))) - 1.0
    for layer in (nn.PixelShuffle(2), nn.PixelUnshuffle(2)):  # 21 x 26 -> 42 x 52; 20 x 26 -> 10 x 13
        src = full if isinstance(layer, nn.PixelShuffle) else full[..., :20, :].contiguous()
        compare(repr(layer), layer, convert_to_domain_parallel(nn.Sequential(layer), mesh=mesh)[0],
                src.repeat(1, 4, 1, 1) if isinstance(layer, nn.PixelShuffle) else src)
    for kw in (dict(scale_factor=2, mode="nearest"), dict(size=(40, 11), mode="nearest"),
               dict(size=(31, 40), mode="nearest-exact"), dict(scale_factor=(1.7, 0.6), mode="bilinear"),
               dict(scale_factor=2, mode="bilinear", align_corners=True), dict(size=(30, 29), mode="bicubic"),
               dict(size=(9, 12), mode="area")):
        up = nn.Upsample(**kw)
        compare(f"upsample {kw}", up, DomainUpsample(up, mesh=mesh), full)
    return out


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 1), (1, 3)])
def test_layers_on_mesh(shape):
    results = run_on_ranks(_layer_ranks, shape[0] * shape[1], shape, timeout=300)
    for r in results:
        for name, err in r.items():
            assert (err == 0.0) if name == "maxpool indices" else (err <= TOL), (name, err)


def _refusal_ranks(rank, world, layer):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh
    from halo.nn import convert_to_domain_parallel

    mesh = DomainMesh((2, 2))
    try:
        convert_to_domain_parallel(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), layer), mesh=mesh)
    except ValueError as e:
        return str(e)
    return "converted"


@pytest.mark.parametrize("layer, words", [
    (nn.Linear(30, 30), "mixes the sharded W"),
    (nn.LayerNorm((3, 21, 26)), "no latitude x longitude form"),
    (nn.AdaptiveAvgPool2d(2), "no latitude x longitude form"),
    (nn.Conv3d(3, 3, 3, padding=1), "no latitude x longitude form"),
    (nn.Softmax(dim=-1), "no latitude x longitude form"),
    (nn.Upsample(scale_factor=2, mode="trilinear"), "no latitude x longitude form"),
])
def test_layers_without_a_2d_form_are_refused(layer, words):
    results = run_on_ranks(_refusal_ranks, 4, layer, timeout=120)
    assert len(set(results)) == 1, results  # the same on every rank
    assert words in results[0] and "1 (" in results[0], results[0]


def _loss_ranks(rank, world, shape):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.comm import unsharded
    from halo.dist.mesh import DomainMesh
    from halo.parallel.reduce import domain_mean, domain_sum, latitude_weighted_mean, latitude_weighted_mse

    mesh = DomainMesh(shape)
    gen = torch.Generator().manual_seed(5)
    pred = torch.randn(2, 3, 21, 26, generator=gen, dtype=torch.float64)
    target = torch.randn(2, 3, 21, 26, generator=gen, dtype=torch.float64)
    out = {}
    for name, fn in (("mse", lambda p, t, **kw: latitude_weighted_mse(p, t, **kw)),
                     ("wmean per channel", lambda p, t, **kw: latitude_weighted_mean(p * t, dim=(0, 2, 3), **kw)),
                     ("mean", lambda p, t, **kw: domain_mean((p - t) ** 3, **kw)),
                     ("sum per sample", lambda p, t, **kw: domain_sum(p * t, dim=(1, 2, 3), **kw))):
        pf = pred.clone().requires_grad_(True)
        if name.startswith(("mse", "wmean")):
            with unsharded():  # halo's own function on this process's whole field: the reference
                want = fn(pf, target)
        else:  # plain reductions: the torch op itself
            want = ((pf - target) ** 3).mean() if name == "mean" else (pf * target).sum(dim=(1, 2, 3))
        want.sum().backward()
        p = _block(pred, mesh).clone().requires_grad_(True)
        got = fn(p, _block(target, mesh), mesh=mesh)
        got.sum().backward()
        out[name] = max(float((got - want).abs().max()), float((p.grad - _block(pf.grad, mesh)).abs().max()))
    try:  # a reduction that keeps W would mix different longitudes of the ranks
        domain_sum(_block(pred, mesh), dim=(0, 2), mesh=mesh)
        out["keeps W"] = "no error"
    except ValueError as e:
        out["keeps W"] = str(e)
    return out


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)])
def test_losses_on_mesh(shape):
    """Latitude weights come from the rank's global rows on the H axis, reductions run over the whole domain."""
    results = run_on_ranks(_loss_ranks, shape[0] * shape[1], shape, timeout=120)
    for r in results:
        assert "must include the sharded longitude dim -1" in r.pop("keeps W")
        for name, err in r.items():
            assert err <= TOL, (name, err)


class _Forward(nn.Module):
    """A conv, then one functional op on the block in ``forward``."""

    def __init__(self, op):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.op = op

    def forward(self, x):
        return self.op(self.conv(x))


FORWARD_OPS = {
    "periodic pad by hand": (lambda t: F.pad(t, (1, 1, 0, 0), mode="circular"), "pads W"),
    "roll in longitude": (lambda t: torch.roll(t, 3, dims=-1), "rolls along W"),
    "zonal mean": (lambda t: t - t.mean(dim=-1, keepdim=True), "W"),
    "conv over W": (lambda t: F.conv2d(t, torch.ones(3, 3, 1, 3, dtype=t.dtype), padding=(0, 1)), "kernel 3"),
    "latitude-only halo function": (lambda t: _halo_interpolate(t), "shards latitude only"),
    "latitude-only dropout": (lambda t: _halo_dropout(t), "shards latitude only"),
    "channel pad": (lambda t: F.pad(t, (0, 0, 0, 0, 1, 1)), None),  # pointwise in H and W: allowed
    "channel mean": (lambda t: t - t.mean(dim=1, keepdim=True), None),
}


def _halo_interpolate(t):
    from halo.nn import halo_interpolate

    return halo_interpolate(t, scale_factor=2, mode="bilinear")


def _halo_dropout(t):
    from halo.random import dropout

    return dropout(t, 0.5, training=True)


def _forward_ranks(rank, world, name):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh
    from halo.nn import convert_to_domain_parallel
    from halo.shard import gather_2d

    mesh = DomainMesh((2, 2))
    torch.manual_seed(0)
    ref = _Forward(FORWARD_OPS[name][0]).double()
    model = convert_to_domain_parallel(_Forward(FORWARD_OPS[name][0]).double(), mesh=mesh)
    model.load_state_dict(ref.state_dict())
    full = torch.randn(1, 3, 11, 14, dtype=torch.float64)
    try:
        y = model(_block(full, mesh))
    except ValueError as e:
        return str(e)
    return float((gather_2d(y.detach(), mesh=mesh) - ref(full).detach()).abs().max())


@pytest.mark.parametrize("name", list(FORWARD_OPS))
def test_functional_ops_on_w_are_watched(name):
    """Code in forward that acts on the sharded W (hand-written periodic padding, a roll in longitude, a zonal
    mean, a conv over W) is refused on every rank alike; ops on other dims run and are exact."""
    results = run_on_ranks(_forward_ranks, 4, name, timeout=120)
    words = FORWARD_OPS[name][1]
    if words is None:
        assert all(isinstance(r, float) and r <= TOL for r in results), results
    else:
        assert len(set(results)) == 1 and isinstance(results[0], str), results
        assert words in results[0], results[0]
        assert "latitude x longitude mesh" in results[0], results[0]


def _scores_ranks(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.comm import unsharded
    from halo.dist.mesh import DomainMesh
    from halo.rollout import scores

    mesh = DomainMesh((2, 2))
    gen = torch.Generator().manual_seed(7)
    preds = [torch.randn(2, 3, 21, 26, generator=gen, dtype=torch.float64) for _ in range(2)]
    targets = [p + 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in preds]
    clim = torch.randn(3, 21, 26, generator=gen, dtype=torch.float64)
    with unsharded():
        want = scores(preds, targets, clim)
    got = scores([_block(p, mesh) for p in preds], [_block(t, mesh) for t in targets], _block(clim, mesh), mesh=mesh)
    return max(float((got[k] - want[k]).abs().max()) for k in ("rmse", "acc"))


def test_rollout_scores_on_mesh():
    """Latitude-weighted RMSE and ACC of blocks equal the whole field's."""
    assert max(run_on_ranks(_scores_ranks, 4, timeout=120)) <= TOL


def _grid_ranks(rank, world, how):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel

    mesh = halo.DomainMesh((2, 2))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.GroupNorm(1, 3)).double()
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.GroupNorm(1, 3)).double(),
                                       mesh=mesh, grid=(21, 26))
    model.load_state_dict(ref.state_dict())
    full = torch.randn(2, 3, 21, 26, dtype=torch.float64)
    if how == "rows only":  # a latitude shard with every longitude: the mistake the declared grid catches
        x = halo.shard(full, group=mesh.axis_group(0))
    else:
        x = halo.shard_2d(full, mesh=mesh)
    try:
        y = model(x)
    except ValueError as e:
        return str(e)
    return float((halo.gather_2d(y.detach(), mesh=mesh) - ref(full).detach()).abs().max())


@pytest.mark.parametrize("how", ["blocks", "rows only"])
def test_declared_grid_on_mesh(how):
    """grid=(H, W) on a mesh: a call starts with no agreement, and an input that is not this rank's block (a
    latitude shard with all longitudes, which the layers would otherwise take for a field twice as wide) raises."""
    results = run_on_ranks(_grid_ranks, 4, how, timeout=120)
    if how == "blocks":
        assert all(isinstance(r, float) and r <= TOL for r in results), results
    else:
        assert all(isinstance(r, str) and "expects its block of" in r for r in results), results


class SqueezeExcite(nn.Module):
    """A conv, a squeeze-excitation gate (global average pool -> 1x1 convs -> sigmoid, in a Sequential) and a CBAM
    channel gate (average and max pools): the global pools of U-Net decoders (scSE) and ResNet blocks."""

    def __init__(self, c=6):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, 3, 1), nn.ReLU(), nn.Conv2d(3, c, 1),
                                nn.Sigmoid())
        self.max = nn.AdaptiveMaxPool2d((1, 1))
        self.mlp = nn.Sequential(nn.Conv2d(c, 3, 1), nn.ReLU(), nn.Conv2d(3, c, 1))
        self.out = nn.Conv2d(c, 2, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))  # ReLU zeros: ties for the max pool's winner
        y = y * self.se(y)
        y = y * torch.sigmoid(self.mlp(self.max(y)))
        return self.out(y)


def _global_ranks(rank, world, shape):
    os.environ["TRITON_INTERPRET"] = "0"
    import torch.distributed as dist

    import halo
    from halo.nn import DomainAdaptiveMaxPool2d, convert_to_domain_parallel

    mesh = halo.DomainMesh(shape)
    torch.manual_seed(0)
    ref = SqueezeExcite().double()
    model = convert_to_domain_parallel(SqueezeExcite().double(), mesh=mesh)
    model.load_state_dict(ref.state_dict())
    full = torch.randn(2, 3, 21, 26, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    xf = full.clone().requires_grad_(True)
    yr = ref(xf)
    g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (yr * g).sum().backward()
    x = _block(full, mesh).clone().requires_grad_(True)
    y = model(x)
    (y * _block(g, mesh)).sum().backward()
    errs = [float((y - _block(yr.detach(), mesh)).abs().max()), float((x.grad - _block(xf.grad, mesh)).abs().max())]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        gp = p.grad.clone()
        dist.all_reduce(gp, group=mesh.domain_group)
        errs.append(float((gp - q.grad).abs().max()))
    # Ties across ranks: a constant channel's maximum is everywhere; torch's winner is global index 0.
    t = full.clone()
    t[:, 1] = 3.0
    pool = nn.AdaptiveMaxPool2d(1, return_indices=True)
    vr, ir = pool(t)
    v, i = DomainAdaptiveMaxPool2d(pool, mesh=mesh)(_block(t, mesh))
    ties = torch.equal(v, vr) and torch.equal(i, ir)
    try:
        convert_to_domain_parallel(nn.Sequential(nn.Conv2d(3, 3, 3), nn.AdaptiveAvgPool2d(2)), mesh=mesh)(
            _block(full, mesh))
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return max(errs), ties, refused


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)])
def test_global_pools_on_mesh(shape):
    """Global average and max pools of blocks are whole on every rank and exact (the max's winner is torch's, ties
    across ranks included); the modules after the pool in its Sequential compute on the whole result; a pool to
    more than 1 x 1 is refused at conversion, on every rank."""
    results = run_on_ranks(_global_ranks, shape[0] * shape[1], shape, timeout=180)
    for err, ties, refused in results:
        assert err <= TOL, err
        assert ties
        assert "no latitude x longitude form" in refused and "global adaptive pools" in refused, refused
    assert len({r[2] for r in results}) == 1


PADS = [nn.ZeroPad2d((1, 2, 3, 0)), nn.ConstantPad2d((2, 1, 1, 2), 1.5), nn.ReflectionPad2d((2, 3, 1, 2)),
        nn.ReplicationPad2d((4, 1, 0, 3)), nn.ZeroPad2d((-1, 2, 1, -2))]
if hasattr(nn, "CircularPad2d"):
    PADS.append(nn.CircularPad2d((3, 3, 0, 0)))


class PeriodicPadded(nn.Module):
    """The WeatherBench recipe: circular in longitude, zeros in latitude, then a valid conv."""

    def __init__(self):
        super().__init__()
        self.pad = nn.Sequential(nn.CircularPad2d((1, 1, 0, 0)), nn.ZeroPad2d((0, 0, 1, 1)))
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(self.pad(x))


def _pad_ranks(rank, world, shape):
    os.environ["TRITON_INTERPRET"] = "0"
    import torch.distributed as dist

    import halo
    from halo.nn import DomainPad2d, convert_to_domain_parallel

    mesh = halo.DomainMesh(shape)
    full = torch.randn(2, 3, 21, 26, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    errs = {}
    for pad in PADS:
        xf = full.clone().requires_grad_(True)
        yr = pad(xf)
        g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        (yr * g).sum().backward()
        x = _block(full, mesh).clone().requires_grad_(True)
        y = DomainPad2d(pad, mesh=mesh)(x)
        want = _block(yr.detach(), mesh)
        (y * _block(g, mesh)).sum().backward()
        errs[repr(pad)] = max(float((y - want).abs().max()) if y.shape == want.shape else float("inf"),
                              float((x.grad - _block(xf.grad, mesh)).abs().max()))
    if hasattr(nn, "CircularPad2d"):
        torch.manual_seed(0)
        ref = PeriodicPadded().double()
        model = convert_to_domain_parallel(PeriodicPadded().double(), mesh=mesh)
        model.load_state_dict(ref.state_dict())
        xf = full.clone().requires_grad_(True)
        yr = ref(xf)
        yr.square().sum().backward()
        x = _block(full, mesh).clone().requires_grad_(True)
        y = model(x)
        y.square().sum().backward()
        gw = model.conv.weight.grad.clone()
        dist.all_reduce(gw, group=mesh.domain_group)
        errs["periodic recipe"] = max(float((y - _block(yr.detach(), mesh)).abs().max()),
                                      float((x.grad - _block(xf.grad, mesh)).abs().max()),
                                      float((gw - ref.conv.weight.grad).abs().max()))
    return errs


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)])
def test_padding_modules_on_mesh(shape):
    """Padding modules (every mode, a constant value, a negative pad that crops) on blocks: the padded field's
    blocks, forward and backward; the periodic-padding recipe of a WeatherBench ResNet converted on a mesh."""
    for r in run_on_ranks(_pad_ranks, shape[0] * shape[1], shape, timeout=180):
        for name, err in r.items():
            assert err <= TOL, (name, err)


def _conv_same_ranks(rank, world, shape):
    os.environ["TRITON_INTERPRET"] = "0"
    import _thirdparty as tp

    tp.load()
    from timm.layers import Conv2dSame

    from halo.dist.mesh import DomainMesh
    from halo.nn import DomainConv2dSame, convert_to_domain_parallel

    mesh = DomainMesh(shape, periodic=(False, True))
    out = {}
    full = torch.randn(2, 4, 21, 26, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for i, conv in enumerate((Conv2dSame(4, 4, 3, stride=2), Conv2dSame(4, 4, 4), Conv2dSame(4, 4, 3, dilation=2),
                              Conv2dSame(4, 4, (5, 3), stride=(3, 2), groups=4, bias=False))):
        conv = conv.double()
        model = convert_to_domain_parallel(nn.Sequential(conv), mesh=mesh)
        assert isinstance(model[0], DomainConv2dSame), type(model[0])
        xf = full.clone().requires_grad_(True)
        yr = conv(xf)
        g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        params = list(conv.parameters())
        (yr * g).sum().backward()
        pref = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        x = _block(full, mesh).clone().requires_grad_(True)
        y = model(x)
        (y * _block(g, mesh)).sum().backward()
        pg = [p.grad.clone() for p in params]
        for t in pg:
            torch.distributed.all_reduce(t, group=mesh.domain_group)
        want = _block(yr.detach(), mesh)
        out[f"conv{i}"] = max([float((y - want).abs().max()) if y.shape == want.shape else float("inf"),
                               float((x.grad - _block(xf.grad, mesh)).abs().max())]
                              + [float((a - b).abs().max()) for a, b in zip(pg, pref, strict=True)])
    return out


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)])
def test_timm_conv2d_same_on_mesh(shape):
    """timm's ``Conv2dSame`` (TF "same": the padding from each axis's global extent) on blocks of a mesh."""
    import _thirdparty as tp

    if tp.missing():
        pytest.skip(f"the zoo's packages are not installed: {tp.missing()} (tests/_thirdparty.py)")
    results = run_on_ranks(_conv_same_ranks, shape[0] * shape[1], shape, timeout=300)
    for r in results:
        for name, err in r.items():
            assert err <= TOL, (name, err)
