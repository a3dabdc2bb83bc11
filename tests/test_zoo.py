"""A model zoo, written to the structure of widely used models, converted unchanged: exact, or refused clearly.

- **smp-style U-Net** (segmentation_models_pytorch's ``Unet``, the family NCAR CREDIT trains): a ResNet encoder
  (7x7 stride-2 stem, BatchNorm, 3x3 stride-2 max pool, basic blocks with 1x1 stride-2 shortcuts) and a decoder
  whose blocks upsample with ``F.interpolate(scale_factor=2, mode="nearest")`` in ``forward``, concatenate the
  skip and apply conv-BN-ReLU twice with scSE attention (a global pool). Exact where H divides over the ranks at
  every level (64 rows on 2 ranks, 96 on 3), and at 80 rows on 3 ranks, where the shards' own nearest upsampling
  of an unevenly split level would not line up with its skip: halo resizes the global field there
  (``halo.guard.reroute``), on every call.
- **WeatherBench-style ResNet** (Rasp & Thuerey's ``PeriodicConv2D``: circular padding in longitude and zeros in
  latitude with ``F.pad`` in ``forward``, then an unpadded conv): refused as written (its padding module is a leaf
  halo does not know; declared pointwise, the guard would refuse its pad of H at the first call), exact with the
  README's recipe (the padding module declared with ``custom_converters``), 33 x 48 on 3 ranks.

Float64, train mode, forward, input gradient and parameter gradients (summed over ranks) against the unsharded
model in the same test; tolerance 1e-12 (sums in another order).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

#: above the rank launch's timeout (one launch runs every case of a world size): pytest must not kill the ranks first
pytestmark = pytest.mark.timeout(500)

W = 48


# -- smp-style U-Net ---------------------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + idt)


class Encoder(nn.Module):
    def __init__(self, cin, widths=(8, 8, 12, 16)):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(widths[0], widths[1], 1)
        self.layer2 = BasicBlock(widths[1], widths[2], 2)
        self.layer3 = BasicBlock(widths[2], widths[3], 2)

    def forward(self, x):
        f1 = F.relu(self.bn1(self.conv1(x)))  # 1/2
        f2 = self.layer1(self.maxpool(f1))  # 1/4
        f3 = self.layer2(f2)  # 1/8
        return [f1, f2, f3, self.layer3(f3)]  # 1/16


class SCSEModule(nn.Module):
    def __init__(self, c, reduction=2):
        super().__init__()
        self.cSE = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // reduction, 1), nn.ReLU(inplace=True),
                                 nn.Conv2d(c // reduction, c, 1), nn.Sigmoid())
        self.sSE = nn.Sequential(nn.Conv2d(c, 1, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.cSE(x) + x * self.sSE(x)


class Conv2dReLU(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class DecoderBlock(nn.Module):
    """smp's DecoderBlock: nearest x2 in forward, the skip concatenated, two conv-BN-ReLU, scSE attention."""

    def __init__(self, cin, cskip, cout):
        super().__init__()
        self.conv1 = Conv2dReLU(cin + cskip, cout)
        self.attention1 = SCSEModule(cin + cskip)
        self.conv2 = Conv2dReLU(cout, cout)
        self.attention2 = SCSEModule(cout)

    def forward(self, x, skip=None):
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        if skip is not None:
            x = torch.cat([x, skip], dim=1)
            x = self.attention1(x)
        return self.attention2(self.conv2(self.conv1(x)))


class SmpUnet(nn.Module):
    def __init__(self, cin=3, classes=2):
        super().__init__()
        self.encoder = Encoder(cin)
        self.blocks = nn.ModuleList([DecoderBlock(16, 12, 12), DecoderBlock(12, 8, 8), DecoderBlock(8, 8, 8),
                                     DecoderBlock(8, 0, 8)])
        self.head = nn.Conv2d(8, classes, 3, padding=1)

    def forward(self, x):
        f1, f2, f3, f4 = self.encoder(x)
        x = f4
        for block, skip in zip(self.blocks, [f3, f2, f1, None], strict=True):
            x = block(x, skip)
        return self.head(x)


# -- WeatherBench-style ResNet -----------------------------------------------------------------------------------

class PeriodicPadding2D(nn.Module):
    """Rasp & Thuerey's periodic padding: circular in longitude, zeros in latitude, with F.pad in forward."""

    def __init__(self, pad):
        super().__init__()
        self.pad = pad

    def forward(self, x):
        x = F.pad(x, (self.pad, self.pad, 0, 0), mode="circular")
        return F.pad(x, (0, 0, self.pad, self.pad), mode="constant")


class PeriodicConv2D(nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.pad = PeriodicPadding2D((k - 1) // 2)
        self.conv = nn.Conv2d(cin, cout, k, padding=0)

    def forward(self, x):
        return self.conv(self.pad(x))


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = PeriodicConv2D(c, c, 3)
        self.bn1 = nn.BatchNorm2d(c)
        self.c2 = PeriodicConv2D(c, c, 3)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.c2(F.leaky_relu(self.bn1(self.c1(x)))))


class WeatherBenchResNet(nn.Module):
    def __init__(self, cin=3, hidden=8):
        super().__init__()
        self.inp = PeriodicConv2D(cin, hidden, 5)
        self.blocks = nn.Sequential(ResBlock(hidden), ResBlock(hidden))
        self.out = PeriodicConv2D(hidden, cin, 3)

    def forward(self, x):
        return self.out(self.blocks(F.leaky_relu(self.inp(x))))


def _recipe():
    """README's recipe for a hand-written periodic padding: circular in W, then zeros in H, as halo layers."""
    from halo.nn import DomainPad2d

    return {PeriodicPadding2D: lambda m, ctx: nn.Sequential(
        DomainPad2d(nn.CircularPad2d((m.pad, m.pad, 0, 0)), group=ctx.group),
        DomainPad2d(nn.ZeroPad2d((0, 0, m.pad, m.pad)), group=ctx.group))}


BUILDS = {"smp": SmpUnet, "weatherbench": WeatherBenchResNet}


def _data(h):
    full = torch.randn(2, 3, h, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return full


def _run(rank, world, name, h, recipe):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = BUILDS[name]().double()
    keys = list(model.state_dict())
    try:
        convert_to_domain_parallel(model, manager, custom_converters=_recipe() if recipe else None)
    except ValueError as exc:
        return str(exc)
    full = _data(h)
    offs = split_offsets(h, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    try:
        out = model(x)
    except ValueError as exc:
        return str(exc)
    gathered = halo.gather(out.detach())
    wts = torch.randn(gathered.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mo = split_offsets(gathered.shape[-2], world)
    (out * wts[..., mo[rank]:mo[rank + 1], :]).sum().backward()
    return {"keys": list(model.state_dict()) == keys, "out": gathered, "grad": halo.gather(x.grad), "wts": wts,
            "params": {n: p.grad for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def _reference(name, h, wts):
    torch.manual_seed(0)
    model = BUILDS[name]().double()
    x = _data(h).clone().requires_grad_(True)
    out = model(x)
    (out * wts).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}, dict(model.named_buffers())


def _check_exact(results, name, h):
    out, grad, params, buffers = _reference(name, h, results[0]["wts"])
    for r in results:
        assert r["keys"]
        assert torch.allclose(r["out"], out, rtol=0, atol=1e-12), (r["out"] - out).abs().max()
        assert torch.allclose(r["grad"], grad, rtol=0, atol=1e-12), (r["grad"] - grad).abs().max()
        for n, b in buffers.items():
            assert torch.allclose(r["buffers"][n].double(), b.double(), rtol=0, atol=1e-12), n
    for n, want in params.items():
        if want is None:  # unused (the last decoder block has no skip, so no first attention)
            assert all(r["params"][n] is None for r in results), n
            continue
        got = sum(r["params"][n] for r in results)
        assert torch.allclose(got, want, rtol=0, atol=1e-11), (n, (got - want).abs().max())


#: what runs on each world size: (model, rows, with the recipe); one launch per world size runs them all, in order
CASES = {2: [("smp", 64, False)], 3: [("smp", 96, False), ("smp", 80, False), ("weatherbench", 33, False),
                                     ("weatherbench", 33, True)]}


def _run_cases(rank, world):
    import os

    os.environ["TRITON_INTERPRET"] = "0"  # halo's kernels: the torch reference (the interpreter: test_kernels.py)
    return {case: _run(rank, world, *case) for case in CASES[world]}


_RUNS: dict = {}


def _results(world, *case):
    """Per-rank results of ``case`` (a key of ``CASES[world]``): one launch per world size, cached (a refusal at
    conversion, the weatherbench model as written, raises before any message, so the next case starts clean)."""
    if world not in _RUNS:
        _RUNS[world] = run_on_ranks(_run_cases, world, timeout=400)
    return [r[case] for r in _RUNS[world]]


@pytest.mark.parametrize("world, h", [(2, 64), (3, 96)])
def test_smp_unet_converts_unchanged_and_exact(world, h):
    _check_exact(_results(world, "smp", h, False), "smp", h)


def test_smp_unet_with_uneven_levels_is_exact():
    """80 rows on 3 ranks: a level of 5 rows (2 + 2 + 1) upsampled by nearest x2 on each shard would be 4 + 4 + 2
    against its skip's 4 + 3 + 3; halo resizes the global field instead (``halo.guard.reroute``)."""
    _check_exact(_results(3, "smp", 80, False), "smp", 80)


def test_weatherbench_resnet_refused_as_written_exact_with_the_recipe():
    errors = _results(3, "weatherbench", 33, False)
    assert all(isinstance(e, str) and "inp.pad (test_zoo.PeriodicPadding2D) is not a layer halo knows" in e
               for e in errors), errors
    assert "custom_converters={PeriodicPadding2D: fn}" in errors[0], errors[0]
    _check_exact(_results(3, "weatherbench", 33, True), "weatherbench", 33)
