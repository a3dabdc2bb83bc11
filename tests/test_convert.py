"""The converter on structures real model zoos use: tied modules, subclasses, blocks with their own state.

Each structure runs converted on 2 gloo ranks and unsharded in the same test (float64, 21 rows: uneven shards,
train mode), forward and backward; parameter gradients summed over the ranks equal the unsharded ones. Tolerance
1e-12: only the order of sums differs (norm statistics and parameter gradients added across ranks).

Before this test the converter walked ``named_children()``, which yields a module used in two slots once (the
second slot kept the plain conv and ran it on the shard: error 0.47, nothing raised), and recursed into any
module with children, so timm's ``BatchNormAct2d`` (a ``BatchNorm2d`` subclass holding ``drop``/``act``) kept
per-shard statistics (error 1.4, nothing raised).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.nn.registry import converts
from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W = 21, 12


class BatchNormAct2d(nn.BatchNorm2d):
    """timm.layers.BatchNormAct2d, as timm writes it (timm itself imports torchvision, which the CPU wheel of torch
    here cannot load): batch norm in its own forward, then ``drop`` and ``act`` children."""

    def __init__(self, num_features, act=nn.ReLU, drop=0.0):
        super().__init__(num_features)
        self.drop = nn.Dropout(drop) if drop else nn.Identity()
        self.act = act()

    def forward(self, x):
        training = self.training or self.running_mean is None
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, training, 0.1 if self.momentum is None else self.momentum, self.eps)
        return self.act(self.drop(x))


class Tied(nn.Module):
    """One conv used twice (tied weights), and a BatchNormAct2d."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.again = self.conv  # the same instance in a second slot
        self.bn = BatchNormAct2d(3, act=nn.SiLU)
        self.up = nn.UpsamplingBilinear2d(scale_factor=2)  # an Upsample subclass with no forward of its own
        self.near = nn.UpsamplingNearest2d(scale_factor=0.5)

    def forward(self, x):
        return self.near(self.up(self.bn(self.again(F.gelu(self.conv(x))))))


def _run(rank, world, build):
    import halo
    from halo.nn import convert_to_domain_parallel

    m = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = build().double()
    keys = list(model.state_dict())
    convert_to_domain_parallel(model, m)
    types = {name: type(mod).__name__ for name, mod in model.named_modules(remove_duplicate=False)}
    full = torch.randn(2, 3, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    out = model(x)
    full_out = halo.gather(out.detach())
    wts = torch.randn(full_out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mo = split_offsets(wts.shape[-2], world)
    (out * wts[..., mo[rank]:mo[rank + 1], :]).sum().backward()  # each rank weighs its own output rows
    return {"types": types, "keys": list(model.state_dict()) == keys, "out": full_out, "grad": halo.gather(x.grad),
            "params": {n: p.grad for n, p in model.named_parameters()}, "wts": wts}


def _reference(build, wts):
    torch.manual_seed(0)
    model = build().double()
    full = torch.randn(2, 3, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = full.clone().requires_grad_(True)
    out = model(x)
    (out * wts).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_tied_module_and_batchnorm_subclass_convert_exactly(world):
    results = run_on_ranks(_run, world, Tied, timeout=120)
    out, grad, params = _reference(Tied, results[0]["wts"])
    for r in results:
        assert r["types"]["conv"] == r["types"]["again"] == "DomainConv2d", r["types"]
        assert r["types"]["bn"] == "DomainBatchNormAct2d" and r["types"]["bn.act"] == "SiLU", r["types"]
        assert r["types"]["up"] == r["types"]["near"] == "DomainUpsample", r["types"]
        assert r["keys"]
        assert torch.allclose(r["out"], out, rtol=0, atol=1e-12), (r["out"] - out).abs().max()
        assert torch.allclose(r["grad"], grad, rtol=0, atol=1e-12), (r["grad"] - grad).abs().max()
    for name, want in params.items():
        got = sum(r["params"][name] for r in results)
        assert torch.allclose(got, want, rtol=0, atol=1e-11), (name, (got - want).abs().max())


class OwnForwardNorm(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 2


class Scaled(nn.Module):
    """A block with a parameter of its own, used pointwise, around a conv."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(3, 1, 1))
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return self.gamma * self.conv(x)


class Pad(nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 1, 1, 1))


def _refusals(rank, world):
    import halo
    from halo.nn import DomainConv2d, convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    m = halo.initialize_domain_parallel(world, world)
    out = {}
    for name, model in (("own_forward", nn.Sequential(OwnForwardNorm(3))), ("own_state", nn.Sequential(Scaled())),
                        ("unknown", nn.Sequential(nn.Conv2d(3, 3, 3), Pad())),
                        # the model itself follows the same rules (a bare conv was left plain: error 0.84)
                        ("root_conv", nn.Conv2d(3, 3, 3)), ("root_unknown", Pad()), ("root_state", Scaled())):
        try:
            convert_to_domain_parallel(model, m)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    inside = convert_to_domain_parallel(nn.Sequential(Scaled()), m, custom_converters={Scaled: INSIDE})
    out["inside"] = (type(inside[0]).__name__, type(inside[0].conv).__name__)
    root = convert_to_domain_parallel(Scaled(), m, custom_converters={Scaled: INSIDE})
    out["root_inside"] = (type(root).__name__, type(root.conv).__name__)
    out["root_kept"] = [type(convert_to_domain_parallel(layer, m)).__name__
                        for layer in (nn.ReLU(), DomainConv2d(nn.Conv2d(3, 3, 3)))]
    twice = convert_to_domain_parallel(convert_to_domain_parallel(nn.Sequential(nn.Conv2d(3, 3, 3)), m), m)
    out["idempotent"] = type(twice[0]).__name__
    return out


def test_subclasses_and_blocks_with_own_state_are_refused_with_a_way_out():
    for r in run_on_ranks(_refusals, 2, timeout=60):
        assert "0 (test_convert.OwnForwardNorm) subclasses nn.BatchNorm2d but has a forward() of its own" \
            in r["own_forward"], r["own_forward"]
        assert "custom_converters={OwnForwardNorm: fn}" in r["own_forward"]
        assert "has parameters or buffers of its own (gamma)" in r["own_state"], r["own_state"]
        assert "custom_converters={Scaled: halo.nn.convert.INSIDE}" in r["own_state"]
        assert "1 (test_convert.Pad) is not a layer halo knows" in r["unknown"], r["unknown"]
        assert "A layer that reads other rows or changes H (a conv, a pool, a pad" in r["unknown"]
        assert "the model itself is a Conv2d, which halo replaces" in r["root_conv"], r["root_conv"]
        assert "the model (test_convert.Pad) is not a layer halo knows" in r["root_unknown"], r["root_unknown"]
        assert "the model (test_convert.Scaled) has parameters or buffers of its own" in r["root_state"]
        assert r["root_inside"] == ("Scaled", "DomainConv2d")
        assert r["root_kept"] == ["ReLU", "DomainConv2d"]
        assert r["inside"] == ("Scaled", "DomainConv2d")
        assert r["idempotent"] == "DomainConv2d"


PADS = [nn.ZeroPad2d((1, 2, 3, 0)), nn.ZeroPad2d((0, 0, -2, 1)), nn.ConstantPad2d((2, 1, 1, 2), 0.0),
        nn.ConstantPad2d((1, 0, 9, 12), -1.5), nn.ConstantPad2d((0, 2, -3, 2), 2.0),
        nn.ReflectionPad2d((1, 1, 2, 3)), nn.ReplicationPad2d((2, 0, 4, 1)), nn.CircularPad2d((1, 2, 3, 2))]


def _pads_and_softmax(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    m = halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, 3, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    offs = split_offsets(H, world)
    out = []
    for i, pad in enumerate(PADS + [nn.Softmax(dim=1), nn.LogSoftmax(dim=-3), nn.Softmax2d()]):
        model = convert_to_domain_parallel(nn.Sequential(pad), m)
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        y = model(x)
        y_full = halo.gather(y.detach())
        wts = torch.randn(y_full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + i))
        mo = split_offsets(y_full.shape[-2], world)
        (y * wts[..., mo[rank]:mo[rank + 1], :]).sum().backward()
        out.append((type(model[0]).__name__, y_full, halo.gather(x.grad), wts))
    errors = {}
    for name, bad, shape in (("softmax_h", nn.Softmax(dim=2), None), ("softmax_flat", nn.Softmax(dim=-1), "flat"),
                             ("softmax_keys", nn.LogSoftmax(dim=-1), None)):
        model = convert_to_domain_parallel(nn.Sequential(bad), m)
        x = full[..., offs[rank]:offs[rank + 1], :]
        try:
            model(x.flatten(-2) if shape == "flat" else x)
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    return out, errors


@pytest.mark.parametrize("world", [2, 3])
def test_padding_and_softmax_modules_are_exact_or_refused(world):
    results = run_on_ranks(_pads_and_softmax, world, timeout=120)
    full = torch.randn(2, 3, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for i, layer in enumerate(PADS + [nn.Softmax(dim=1), nn.LogSoftmax(dim=-3), nn.Softmax2d()]):
        x = full.clone().requires_grad_(True)
        y = layer(x)
        (gx,) = torch.autograd.grad((y * results[0][0][i][3]).sum(), x)  # the same weights on every rank
        for out, errors in results:
            kind, got, grad, _ = out[i]
            want_kind = "DomainPad2d" if i < len(PADS) else {"Softmax": "DomainSoftmax", "LogSoftmax":
                                                              "DomainLogSoftmax"}.get(type(layer).__name__, "Softmax2d")
            assert kind == want_kind, (i, kind)
            if i < len(PADS):  # rows are copied: bitwise
                assert torch.equal(got, y.detach()), (layer, (got - y).abs().max())
            else:  # the same arithmetic per pixel; vectorised loops may round the last bit differently
                assert torch.allclose(got, y.detach(), rtol=0, atol=1e-15), (layer, (got - y).abs().max())
            assert torch.allclose(grad, gx, rtol=0, atol=1e-12), (layer, (grad - gx).abs().max())
            assert "0 (nn.Softmax(dim=2)) on an input of shape" in errors["softmax_h"], errors
            assert "would normalise over H" in errors["softmax_h"]
            assert "may hold H (e.g. H x W flattened)" in errors["softmax_flat"], errors
            assert "the keys of an attention map" in errors["softmax_keys"], errors
            assert "custom_converters={nn.LogSoftmax: None}" in errors["softmax_keys"], errors


class PeriodicPad(nn.Module):
    """The "periodic padding" weather codebases write by hand: circular in longitude, zeros in latitude."""

    def forward(self, x):
        return F.pad(F.pad(x, (2, 2, 0, 0), mode="circular"), (0, 0, 2, 2))


def _periodic_net():
    torch.manual_seed(0)
    return nn.Sequential(PeriodicPad(), nn.Conv2d(2, 3, 5)).double()


def _periodic(rank, world):
    import halo
    from halo.nn import DomainPad2d, convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    try:
        convert_to_domain_parallel(_periodic_net(), manager)
        refused = ""
    except ValueError as e:
        refused = str(e)

    def periodic(m, ctx):
        return nn.Sequential(DomainPad2d(nn.CircularPad2d((2, 2, 0, 0)), group=ctx.group),
                             DomainPad2d(nn.ZeroPad2d((0, 0, 2, 2)), group=ctx.group))

    net = convert_to_domain_parallel(_periodic_net(), manager, custom_converters={PeriodicPad: periodic})
    full = torch.randn(2, 2, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = halo.shard(full, dim=-2).requires_grad_(True)
    y = net(x)
    (y * y).sum().backward()
    return refused, halo.gather(y.detach(), dim=-2), halo.gather(x.grad, dim=-2), net[1].weight.grad


def test_hand_written_periodic_padding_converts_with_the_readme_recipe():
    """README's recipe for a hand-written periodic pad: refused without it, exact with it (3 ranks, 21 rows)."""
    results = run_on_ranks(_periodic, 3, timeout=120)
    ref = _periodic_net()
    full = torch.randn(2, 2, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    y = ref(full)
    (y * y).sum().backward()
    for refused, got, gx, _ in results:
        assert "PeriodicPad) is not a layer halo knows" in refused and "custom_converters" in refused, refused
        assert torch.equal(got, y.detach())
        assert torch.allclose(gx, full.grad, rtol=0, atol=1e-12)
    wgrad = sum(r[3] for r in results)
    assert torch.allclose(wgrad, ref[1].weight.grad, rtol=1e-12, atol=1e-12)


class Shuffles(nn.Module):
    """Sub-pixel upsampling (ESPCN, many super-resolution and ViT decoders) and its inverse, around convs."""

    def __init__(self):
        super().__init__()
        self.down = nn.PixelUnshuffle(2)
        self.conv = nn.Conv2d(12, 12, 3, padding=1)
        self.up = nn.PixelShuffle(2)
        self.up3 = nn.PixelShuffle(3)
        self.head = nn.Conv2d(3, 9, 3, padding=1)

    def forward(self, x):
        y = self.up(self.conv(self.down(x)))  # 22 -> 11 -> 22 rows
        return self.up3(self.head(y))  # 22 -> 66 rows


LAYERS = {"Shuffles": (lambda: Shuffles(), (2, 3, 22, W)), "Pangu3d": (lambda: Pangu3d(), (2, 2, 4, 22, W))}


def _layers(rank, world, name):
    """The model ``name`` converted on ``world`` ranks: types of its children, output and input gradient gathered,
    the weights of the loss, and this rank's parameter gradients."""
    import halo
    from halo.nn import convert_to_domain_parallel

    build, shape = LAYERS[name]
    m = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(build().double(), m)
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    offs = split_offsets(shape[-2], world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    y = model(x)
    y_full = halo.gather(y.detach())
    wts = torch.randn(y_full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    mo = split_offsets(y_full.shape[-2], world)
    (y * wts[..., mo[rank]:mo[rank + 1], :]).sum().backward()
    return {"types": {n: type(c).__name__ for n, c in model.named_children()}, "rows": y.shape[-2], "out": y_full,
            "grad": halo.gather(x.grad), "wts": wts, "params": {n: p.grad for n, p in model.named_parameters()}}


def _check_layers(name, world):
    """The converted model equals the unsharded one (forward, input and summed parameter gradients); its output is
    the balanced split of its rows."""
    results = run_on_ranks(_layers, world, name, timeout=120)
    build, shape = LAYERS[name]
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    y = model(x)
    (y * results[0]["wts"]).sum().backward()
    mo = split_offsets(y.shape[-2], world)
    for rank, r in enumerate(results):
        assert r["rows"] == mo[rank + 1] - mo[rank]
        assert torch.allclose(r["out"], y.detach(), rtol=0, atol=1e-12), (r["out"] - y).abs().max()
        assert torch.allclose(r["grad"], x.grad, rtol=0, atol=1e-12), (r["grad"] - x.grad).abs().max()
    for n, p in model.named_parameters():
        got = sum(r["params"][n] for r in results)
        assert torch.allclose(got, p.grad, rtol=0, atol=1e-11), n
    return results[0]["types"]


@pytest.mark.parametrize("world", [2, 3])
def test_pixel_shuffle_and_unshuffle_are_exact(world):
    types = _check_layers("Shuffles", world)
    assert (types["up"], types["up3"], types["down"]) == ("DomainPixelShuffle", "DomainPixelShuffle",
                                                          "DomainPixelUnshuffle")


class Pangu3d(nn.Module):
    """Pangu-style 3-d patch embedding and recovery (kernel == stride), and a 3-d decoder step (kernel > stride)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv3d(2, 4, kernel_size=(2, 2, 2), stride=(2, 2, 2))
        self.mix = nn.Conv3d(4, 4, 3, padding=1)
        self.recover = nn.ConvTranspose3d(4, 2, kernel_size=(2, 2, 2), stride=(2, 2, 2))
        self.up = nn.ConvTranspose3d(2, 2, kernel_size=(1, 4, 3), stride=(1, 2, 1), padding=(0, 1, 1),
                                     output_padding=(0, 1, 0))

    def forward(self, x):
        return self.up(self.recover(self.mix(self.embed(x))))


@pytest.mark.parametrize("world", [2, 3])
def test_conv_transpose3d_is_exact(world):
    types = _check_layers("Pangu3d", world)
    assert types["recover"] == types["up"] == "DomainConvTranspose3d"


# -- a layer kind of the user's own, registered with @converts in this file and nothing else -----------------------

class VerticalBlur(nn.Module):
    """A layer of the user's own that reads other rows: each row's mean with its latitude neighbours (zeros beyond
    the domain)."""

    def forward(self, x):
        p = F.pad(x, (0, 0, 1, 1))
        return (p[..., :-2, :] + p[..., 1:-1, :] + p[..., 2:, :]) / 3


class UnregisteredBlur(VerticalBlur.__base__):
    forward = VerticalBlur.forward  # the same computation, no registration: refused


@converts(VerticalBlur)
class HaloVerticalBlur(nn.Module):
    """Its halo form: the neighbours' rows by a halo exchange, then the same arithmetic on the extended shard."""

    def __init__(self, blur, *, group=None):
        super().__init__()
        self.group = group

    def forward(self, x):
        import halo

        p = halo.halo_exchange(x, 1, -2, group=self.group, boundary="zeros")
        with halo.guard.trusted():  # row arithmetic on the extended shard: right by construction
            return (p[..., :-2, :] + p[..., 1:-1, :] + p[..., 2:, :]) / 3


def _registered(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.registry import entries

    group = halo.DomainMesh((world,)).domain_group
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(2, 2, 1), VerticalBlur()).double()
    model = nn.Sequential(nn.Conv2d(2, 2, 1), VerticalBlur()).double()
    model.load_state_dict(ref.state_dict())
    convert_to_domain_parallel(model, group)
    full = torch.randn(2, 2, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    xf = full.clone().requires_grad_(True)
    want = ref(xf)
    (want * want).sum().backward()
    x = halo.shard(full, group=group).requires_grad_(True)
    y = model(x)
    (y * y).sum().backward()
    try:
        convert_to_domain_parallel(nn.Sequential(UnregisteredBlur()), group)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return {"kind": type(model[1]).__name__, "entry": entries()[VerticalBlur].halo_class.__name__,
            "forward": float((halo.gather(y.detach(), group=group) - want.detach()).abs().max()),
            "input grad": float((halo.gather(x.grad, group=group) - xf.grad).abs().max()), "refused": refused}


@pytest.mark.parametrize("world", [2, 3])
def test_a_layer_registered_with_converts_is_converted_with_nothing_else(world):
    for r in run_on_ranks(_registered, world, timeout=120):
        assert r["kind"] == "HaloVerticalBlur" and r["entry"] == "HaloVerticalBlur", r
        assert r["forward"] < 1e-12 and r["input grad"] < 1e-12, r
        assert "UnregisteredBlur" in r["refused"] and "is not a layer halo knows" in r["refused"], r["refused"]


def _pickled(rank, world):
    import io

    import halo
    from halo.nn import convert_to_domain_parallel

    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)).double(),
                                       halo.DomainMesh((world,)))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    return type(model).__qualname__, type(loaded) is type(model), isinstance(loaded, nn.Sequential)


def test_a_converted_torch_container_pickles_and_loads_as_the_same_class():
    """The root's class is derived once per torch class (halo.nn.root.rooted) and found again by name."""
    for r in run_on_ranks(_pickled, 2, timeout=60):
        assert r == ("_RootedSequential", True, True), r
