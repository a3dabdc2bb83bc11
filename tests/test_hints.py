"""The converter's hints cannot lead to silence (issue 23): every hint it prints, followed on the model that provoked
it, gives the unsharded model's numbers (forward and backward, float64, 2 gloo ranks, 23 rows: 12 + 11) or a
refusal naming the op — never a silently different result.

- a composite with parameters of its own (a ConvNeXt-like block: ``gamma``, a 7x7 depthwise conv child, LayerNorm
  over channels via permute) is offered ``INSIDE`` first and never ``{T: None}`` (which left its conv unconverted:
  param-grad error 0.74-0.96); declaring it ``None`` anyway is refused at conversion, naming the conv;
- ``ModuleList`` / ``ModuleDict`` / ``None`` slots are containers: never refused;
- a leaf of one's own is offered ``{T: None}``; followed, a pointwise leaf is exact and one that is not (a 3x3
  conv of its own weight, a pad of H, an op halo has not classified) is refused by the guard.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 23, 8, 4


class ConvNeXtLike(nn.Module):
    """timm's ConvNeXtBlock in miniature: dwconv 7x7, LayerNorm over channels (channels-last), MLP, layer scale."""

    def __init__(self):
        super().__init__()
        self.conv_dw = nn.Conv2d(C, C, 7, padding=3, groups=C)
        self.norm = nn.LayerNorm(C)
        self.fc1 = nn.Linear(C, 2 * C)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * C, C)
        self.gamma = nn.Parameter(torch.rand(C) + 0.5)

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x).permute(0, 2, 3, 1)
        x = self.fc2(self.act(self.fc1(self.norm(x))))
        x = x.mul(self.gamma).permute(0, 3, 1, 2)
        return x + shortcut


class ScaledMLP(nn.Module):
    """A composite with own parameters and pointwise children only: INSIDE first, None also safe."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.scale = nn.Parameter(torch.rand(C, 1, 1) + 0.5)

    def forward(self, x):
        return x * self.scale + self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Scale(nn.Module):
    """A leaf with a parameter of its own, pointwise."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(C) + 0.5)

    def forward(self, x):
        return x * self.weight[None, :, None, None]


class Smooth(nn.Module):
    """A leaf with its own 3x3 kernel: not pointwise (declaring it None must not be silent)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(C, C, 3, 3) * 0.2)

    def forward(self, x):
        return F.conv2d(x, self.weight, padding=1)


class PadCrop(nn.Module):
    """A leaf without state that pads H."""

    def forward(self, x):
        return F.pad(x, (0, 0, 1, 1))[:, :, 1:-1] * 2


class Mystery(nn.Module):
    """A leaf without state calling an op halo has not classified."""

    def forward(self, x):
        return x + torch.trapezoid(x, dim=-1)[..., None]


class Net(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.stem = nn.Conv2d(C, C, 3, padding=1)
        self.block = block
        self.empty = nn.ModuleList()
        self.holes = nn.ModuleList([None, nn.ReLU()])  # diffusers' mid block without attention
        self.named = nn.ModuleDict()
        self.head = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        x = self.block(self.stem(x))
        for m in self.holes:
            if m is not None:
                x = m(x)
        return self.head(x)


#: name -> (the block, the hint text the refusal must give first, text it must not give, the hint as a converter
#: map, whether following it is exact (True) or refused with this text)
CASES = {
    "convnext": (ConvNeXtLike, "{ConvNeXtLike: halo.nn.convert.INSIDE}", "{ConvNeXtLike: None}", "INSIDE", True),
    "scaled_mlp_inside": (ScaledMLP, "{ScaledMLP: halo.nn.convert.INSIDE}", None, "INSIDE", True),
    "scaled_mlp_none": (ScaledMLP, "{ScaledMLP: None}", None, None, True),
    "scale": (Scale, "{Scale: None}", None, None, True),
    "smooth": (Smooth, "{Smooth: None}", None, None, "a convolution with kernel 3"),
    "pad": (PadCrop, "{PadCrop: None}", None, None, "pads H"),
    "mystery": (Mystery, "{Mystery: None}", None, None, "not an op halo has classified"),
}


def _inputs():
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    wts = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return full, wts


def _model(name):
    torch.manual_seed(0)
    return Net(CASES[name][0]()).double()


def _follow(rank, world, name):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    manager = halo.initialize_domain_parallel(world, world)
    kind, _, _, hint, _ = CASES[name]
    try:
        convert_to_domain_parallel(_model(name), manager)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    model = convert_to_domain_parallel(_model(name), manager,
                                       custom_converters={kind: INSIDE if hint == "INSIDE" else None})
    full, wts = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    try:
        y = model(x)
    except ValueError as exc:
        return refusal, str(exc)
    (y * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
    grads = {n: halo.parallel.all_reduce(p.grad.clone()) for n, p in model.named_parameters()}
    return refusal, (halo.gather(y.detach()), halo.gather(x.grad), grads)


@pytest.mark.parametrize("name", list(CASES))
def test_every_hint_followed_is_exact_or_refused(name):
    kind, hint, never, _, outcome = CASES[name]
    results = run_on_ranks(_follow, 2, name, timeout=120)
    model = _model(name)
    full, wts = _inputs()
    x = full.clone().requires_grad_(True)
    y = model(x)
    (y * wts).sum().backward()
    for refusal, followed in results:
        assert refusal is not None and f"block ({__name__}.{kind.__name__})" in refusal, refusal
        assert f"custom_converters={hint}" in refusal, refusal
        if never is not None:
            assert f"custom_converters={never}" not in refusal, refusal
        if hint.endswith("INSIDE}"):  # a composite with state: INSIDE is the first way out offered
            first = refusal.index("custom_converters=")
            assert refusal[first:].startswith(f"custom_converters={hint}"), refusal
        if outcome is True:
            got, grad, grads = followed
            assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12), (got - y).abs().max()
            assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12), (grad - x.grad).abs().max()
            for n, p in model.named_parameters():
                assert torch.allclose(grads[n], p.grad, rtol=0, atol=1e-10), (n, (grads[n] - p.grad).abs().max())
        else:
            assert isinstance(followed, str) and outcome in followed, followed
            assert "refuses it on every rank" in followed, followed
    if outcome is not True:
        assert results[0][1] == results[1][1], results  # the same refusal on every rank


def _declared_none(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    out = {}
    from halo.nn.convert import INSIDE

    for label, kinds in (("block", {ConvNeXtLike: None}), ("list", {nn.ModuleList: None, ConvNeXtLike: INSIDE})):
        model = _model("convnext")
        model.more = nn.ModuleList([nn.Conv2d(C, C, 3, padding=1)])
        try:
            convert_to_domain_parallel(model, manager, custom_converters=kinds)
            out[label] = None
        except ValueError as exc:
            out[label] = str(exc)
    return out


def test_declaring_a_composite_with_convertible_layers_pointwise_is_refused():
    for r in run_on_ranks(_declared_none, 2, timeout=60):
        assert "custom_converters={ConvNeXtLike: None} declares block" in r["block"], r["block"]
        assert "conv_dw (Conv2d)" in r["block"] and "INSIDE" in r["block"], r["block"]
        assert "custom_converters={ModuleList: None} declares" in r["list"], r["list"]
        assert "0 (Conv2d)" in r["list"], r["list"]


def _containers(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.ModuleList([None]), nn.Sequential(), nn.ReLU())
    seq.slots = nn.ModuleDict({"a": nn.ModuleList(), "b": nn.ModuleList([None, None])})
    convert_to_domain_parallel(seq, manager)  # containers only around the conv: no refusal
    torch.manual_seed(0)
    net = Net(nn.Identity()).double()
    convert_to_domain_parallel(net, manager)
    full, _ = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    y = net(x)
    y.sum().backward()
    return type(net.stem).__name__ + type(seq[0]).__name__, halo.gather(y.detach()), halo.gather(x.grad)


def test_module_lists_dicts_and_none_slots_are_containers():
    torch.manual_seed(0)
    ref = Net(nn.Identity()).double()
    full, _ = _inputs()
    x = full.clone().requires_grad_(True)
    y = ref(x)
    y.sum().backward()
    for kind, got, grad in run_on_ranks(_containers, 2, timeout=60):
        assert kind == "DomainConv2dDomainConv2d"
        assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12)
        assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12)


def _mesh_linear(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    mesh = halo.DomainMesh((1, 2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.Linear(W // 2, W // 2)).double()
    try:
        convert_to_domain_parallel(model, mesh=mesh)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    convert_to_domain_parallel(model, mesh=mesh, custom_converters={nn.Linear: None})  # the hint, followed
    full, _ = _inputs()
    try:
        model(halo.shard_2d(full, mesh=mesh))  # each rank's 4 columns fit the Linear: it would run per shard
        return refusal, None
    except ValueError as exc:
        return refusal, str(exc)


def test_the_mesh_hint_for_linear_followed_on_a_field_is_refused():
    results = run_on_ranks(_mesh_linear, 2, timeout=60)
    for refusal, followed in results:
        assert refusal is not None and "custom_converters={nn.Linear: None}" in refusal, refusal
        assert followed is not None and followed.startswith("linear at linear.py:"), followed
        assert "acts on W" in followed and "(in the forward of 1 (Linear))" in followed, followed
    assert results[0][1] == results[1][1]


# -- a layer that reads the shard's shape (issue 32, item 2) ---------------------------------------------------------

class Coords(nn.Module):
    """neuraloperator's GridEmbedding2D in miniature: coordinate channels built from the input's own shape (on a
    shard: the shard's rows, 0..1 over each rank's rows; the guard sees only ints)."""

    def forward(self, x):
        h, w = x.shape[-2:]
        gy = torch.linspace(0, 1, h + 1, dtype=x.dtype)[:-1].view(1, 1, h, 1).expand(x.shape[0], 1, h, w)
        return torch.cat([x[:, :-1], x[:, -1:] + gy], dim=1)


class GlobalCoords(nn.Module):
    """The exact form the hint points to: the same coordinates built for the global field, this rank's rows taken
    with halo.local_rows."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def forward(self, x):
        import halo

        gy = torch.linspace(0, 1, self.rows + 1, dtype=x.dtype)[:-1].view(1, 1, self.rows, 1)
        gy = halo.local_rows(gy, x).expand(x.shape[0], 1, x.shape[-2], x.shape[-1])
        return torch.cat([x[:, :-1], x[:, -1:] + gy], dim=1)


def _grid_net(kind):
    torch.manual_seed(0)
    if kind == "coords":
        return Net(Coords()).double()
    from neuralop.layers.embeddings import GridEmbedding2D

    net = Net(GridEmbedding2D(C))
    net.head = nn.Conv2d(C + 2, C, 3, padding=1)
    return net.double()


def _shape_reader(rank, world, kind):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    refusal = None
    try:
        model = convert_to_domain_parallel(_grid_net(kind), manager)
    except ValueError as exc:
        refusal = str(exc)
        model = convert_to_domain_parallel(_grid_net(kind), manager,
                                           custom_converters={Coords: lambda m, ctx: GlobalCoords(H)})
    full, wts = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    y = model(x)
    (y * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
    grads = {n: halo.parallel.all_reduce(p.grad.clone()) for n, p in model.named_parameters()}
    return refusal, type(model.block).__name__, halo.gather(y.detach()), halo.gather(x.grad), grads


@pytest.mark.parametrize("kind, world", [("coords", 2), ("coords", 3), ("neuralop", 2), ("neuralop", 3)])
def test_a_layer_reading_the_shard_shape_is_not_offered_none(kind, world):
    """Its refusal says that it reads the shape (naming the line) and offers the exact form, never {T: None}; the
    exact form followed is exact. neuraloperator's own GridEmbedding2D (whose refusal offered {T: None}: 0.1-0.3
    off) converts, building the global grid's rows."""
    if kind == "neuralop":
        pytest.importorskip("neuralop")
    results = run_on_ranks(_shape_reader, world, kind, timeout=180)
    model = _grid_net(kind)
    full, wts = _inputs()
    x = full.clone().requires_grad_(True)
    y = model(x)
    (y * wts).sum().backward()
    for refusal, block, got, grad, grads in results:
        if kind == "coords":
            assert refusal is not None and "reads its input's shape (at test_hints.py:" in refusal, refusal
            assert "h, w = x.shape[-2:]" in refusal and "halo.local_rows(t, x)" in refusal, refusal
            assert "custom_converters={Coords: fn}" in refusal, refusal
            assert "halo does not offer it" in refusal, refusal
            assert block == "GlobalCoords"
        else:
            assert refusal is None and block == "DomainGridEmbedding2D", (refusal, block)
        assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12), (got - y).abs().max()
        assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12), (grad - x.grad).abs().max()
        for n, p in model.named_parameters():
            assert torch.allclose(grads[n], p.grad, rtol=0, atol=1e-10), (n, (grads[n] - p.grad).abs().max())
