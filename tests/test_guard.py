"""Spatial ops in a converted model's forward: exact, or refused on every rank (``halo.guard``), and caught by
``halo.check_equivalence`` where the guard cannot see.

Each op sits in the forward of a tiny model between two 3x3 convs (so the field is a real shard), converted on 3
gloo ranks at 23 rows (uneven shards: 8, 8, 7). Refused ops raise the same ``ValueError`` on every rank naming the
op, the module, the line of user code and the way out; allowed ops (along W or channels, channels-last blocks,
tokens made with ``flatten(2)``) equal the unsharded model, forward and backward, float64. A Pytorch-UNet-style
``Up`` block (pad the upsampled tensor to the skip's size) is refused as written and exact with
``halo.nn.pad_like``; the same bug hidden in a custom autograd Function (which the guard cannot see) is caught by
``check_equivalence``, which names the first module whose output differs.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 23, 10, 4


def _tokens_linear(m, x):
    b, c, h, w = x.shape
    t = m.lin(x.flatten(2).transpose(1, 2))  # (B, h*W, C): tokens, row-major
    return t.transpose(1, 2).reshape(b, c, h, w)


def _channels_last_norm(m, x):
    return m.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


ALLOWED = {
    "pad_w": lambda m, x: F.pad(x, (1, 2, 0, 0), mode="circular")[..., 1:-2],
    "roll_w": lambda m, x: torch.roll(x, 3, dims=-1),
    "flip_w": lambda m, x: x.flip(-1),
    "cat_channels": lambda m, x: torch.cat([x, x * 2], dim=1)[:, :C],
    "slice_channels": lambda m, x: x[:, :2].repeat(1, 2, 1, 1),
    "slice_w": lambda m, x: F.pad(x[..., 1:-1], (1, 1)),
    "mean_channels": lambda m, x: x * torch.sigmoid(x.mean(1, keepdim=True)),
    "max_channels": lambda m, x: x - x.amax(dim=1, keepdim=True),
    "softmax_channels": lambda m, x: F.softmax(x, dim=1),
    "conv1x1": lambda m, x: F.conv2d(x, m.w1),
    "interpolate_w": lambda m, x: F.interpolate(x, scale_factor=(1, 2), mode="nearest")[..., ::2],
    "tokens_linear": _tokens_linear,
    "channels_last_norm": _channels_last_norm,
    "split_channels": lambda m, x: torch.cat(torch.split(x, 2, dim=1)[::-1], dim=1),
    "norm_channels": lambda m, x: x / (1 + x.norm(2, dim=1, keepdim=True)),  # p=2 is not a dim
    "sort_w": lambda m, x: x.sort(dim=-1)[0] + x.topk(2)[0].sum(-1, keepdim=True),  # default dims: W
    "stack_last": lambda m, x: torch.stack([x, 2 * x], dim=-1).sum(-1),  # H stays at dim 2 of the 5-d stack
    "trusted_made_here": lambda m, x: x + _trusted_mean(x),
    "nearest_x2": lambda m, x: m.pool(F.interpolate(x, scale_factor=2) * 0.5 + 0.25),  # rows repeated: exact
    # means over H: computed over the whole domain (halo.guard.reroute; every call: tests/test_guard_exact.py)
    "mean_hw": lambda m, x: x * x.mean((2, 3), keepdim=True),
    "tokens_mean": lambda m, x: x * x.flatten(2).mean(-1)[..., None, None],
    "stack_then_mean_h": lambda m, x: x * torch.stack([x, x], dim=-1).mean((2, 4))[:, :, None, :],
    "channels_last_mean": lambda m, x: x * x.permute(0, 2, 3, 1).mean(1, keepdim=True).permute(0, 3, 1, 2),
    "interpolate_scale": lambda m, x: m.pool(F.interpolate(x, scale_factor=2.0, mode="bilinear")),  # halo_interpolate
}

REFUSED = {
    "pad_h": (lambda m, x: F.pad(x, (0, 0, 1, 1)), "pads H"),
    "interpolate_antialias": (lambda m, x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True),
                              "antialias=True"),
    "interpolate_size": (lambda m, x: F.interpolate(x, size=(x.shape[2] + 1, x.shape[3]))[..., :-1, :],
                         "resizes H"),
    "roll_h": (lambda m, x: torch.roll(x, 1, dims=2), "rolls along H"),
    "flip_h": (lambda m, x: torch.flip(x, [2]), "flips H"),
    "cat_h": (lambda m, x: torch.cat([x, x], dim=2)[:, :, ::2], "concatenates along H"),
    "split_h": (lambda m, x: torch.cat(x.split(2, dim=-2), dim=-2), "splits"),
    "slice_h": (lambda m, x: F.pad(x[:, :, 1:], (0, 0, 1, 0)), "indexes H"),
    "prod_all": (lambda m, x: x / x.abs().prod(), "reduces over H"),
    # (x / x.norm(): computed exactly over the domain since issue 32 item 6, tests/test_guard_rows.py; sums and
    # softmaxes over H too, tests/test_guard_exact.py)
    "norm_nuclear": (lambda m, x: x / x.norm(p="nuc", dim=(2, 3), keepdim=True), "reduces over H"),
    "sort_h": (lambda m, x: x.sort(dim=2)[0], "reduces over H"),
    "softmin_h": (lambda m, x: F.softmin(x, dim=2), "normalises over H"),
    # (F.avg_pool2d / F.max_pool2d: computed exactly since issue 32, tests/test_guard_exact.py; with its indices,
    # refused)
    "max_pool_indices": (lambda m, x: F.interpolate(F.max_pool2d(x, 2, return_indices=True)[0], size=x.shape[-2:]),
                         "a pool"),
    "conv3x3": (lambda m, x: F.conv2d(x, m.w3, padding=1), "a convolution"),
    "flatten_all": (lambda m, x: x.flatten(1).view(x.shape), "merges H"),
    "attention": (lambda m, x: (lambda t: (t @ t.transpose(1, 2)).softmax(-1) @ t)(
        x.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(x.shape), "multiplies over H"),
    "tokens_amax": (lambda m, x: x * x.flatten(2).amax(-1)[..., None, None], "reduces over H"),
    "stack_then_amax_h": (lambda m, x: x * torch.stack([x, x], dim=-1).amax((2, 4))[:, :, None, :],
                          "reduces over H"),
    "channels_last_std": (lambda m, x: x * x.permute(0, 2, 3, 1).std(1, keepdim=True).permute(0, 3, 1, 2),
                          "reduces over H"),
}


def _trusted_mean(x):
    """A (B, C, K) tensor made in forward, not a field: its mean over dim 1 is right; the guard would take dim 1
    for H, so the block is marked trusted."""
    import halo.guard

    table = torch.arange(x.shape[1] * 6, dtype=x.dtype).view(1, x.shape[1], 6).expand(x.shape[0], -1, -1)
    with halo.guard.trusted():
        return table.mean(1, keepdim=True)[..., :1, None] * 0 + table.mean() * 0


class OpNet(nn.Module):
    """One op between two 3x3 convs; its own weights (w1, w3) are used by the functional convs only."""

    def __init__(self, name):
        super().__init__()
        self.name = name
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.b = nn.Conv2d(C, C, 3, padding=1)
        self.lin = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.pool = nn.MaxPool2d(2)
        self.w1 = nn.Parameter(torch.randn(C, C, 1, 1) * 0.3)
        self.w3 = nn.Parameter(torch.randn(C, C, 3, 3) * 0.3)

    def forward(self, x):
        fn = ALLOWED.get(self.name) or REFUSED[self.name][0]
        return self.b(fn(self, self.a(x)))


def _inside():
    from halo.nn.convert import INSIDE

    return {OpNet: INSIDE}


def _inputs():
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    wts = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return full, wts


def _allowed(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    full, wts = _inputs()
    offs = split_offsets(H, world)
    out = {}
    for name in ALLOWED:
        torch.manual_seed(0)
        model = convert_to_domain_parallel(OpNet(name).double(), manager, custom_converters=_inside())
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        y = model(x)
        (y * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
        out[name] = (halo.gather(y.detach()), halo.gather(x.grad))
    return out


def test_ops_along_other_dims_are_exact():
    results = run_on_ranks(_allowed, 3, timeout=120)
    full, wts = _inputs()
    for name in ALLOWED:
        torch.manual_seed(0)
        model = OpNet(name).double()
        x = full.clone().requires_grad_(True)
        y = model(x)
        (y * wts).sum().backward()
        for r in results:
            got, grad = r[name]
            assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12), (name, (got - y).abs().max())
            assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12), (name, (grad - x.grad).abs().max())


def _refused(rank, world, name):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(OpNet(name).double(), manager, custom_converters=_inside())
    full, _ = _inputs()
    offs = split_offsets(H, world)
    try:
        model(full[..., offs[rank]:offs[rank + 1], :])
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", list(REFUSED))
def test_ops_on_the_sharded_dim_are_refused_on_every_rank(name):
    errors = run_on_ranks(_refused, 3, name, timeout=60)
    want = REFUSED[name][1]
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors  # the same message everywhere
    assert want in errors[0], errors[0]
    assert "(in the forward of (the model) (OpNet))" in errors[0] and "at test_guard.py:" in errors[0], errors[0]
    assert "refuses it on every rank" in errors[0], errors[0]


class UpLocal(nn.Module):
    """Pytorch-UNet's Up block as written: pad x1 by the difference of the *local* sizes."""

    def __init__(self, how="local"):
        super().__init__()
        self.how = how
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv = nn.Conv2d(2 * C, C, 3, padding=1)

    def forward(self, x1, x2):
        import halo.nn

        x1 = self.up(x1)
        if self.how == "pad_like":
            x1 = halo.nn.pad_like(x1, x2)  # one rank (or no torch.distributed): F.pad's own result
        elif self.how == "hidden":  # ops run with torch function modes off: the guard cannot see them (a custom
            with torch._C.DisableTorchFunction():  # autograd.Function it refuses since issue 32: test_unseen_ops)
                dy, dx = x2.shape[2] - x1.shape[2], x2.shape[3] - x1.shape[3]
                x1 = torch.constant_pad_nd(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        else:
            x1 = _local_pad(x1, x2)
        return self.conv(torch.cat([x2, x1], dim=1))


def _local_pad(x1, x2):
    dy, dx = x2.size(2) - x1.size(2), x2.size(3) - x1.size(3)
    return F.pad(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])


class UNet(nn.Module):
    def __init__(self, how="local"):
        super().__init__()
        self.inc = nn.Conv2d(C, C, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(C, C, 3, padding=1)
        self.up = UpLocal(how)

    def forward(self, x):
        a = F.relu(self.inc(x))
        return self.up(F.relu(self.mid(self.down(a))), a)


def _unet(rank, world, how, h):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, C, h, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if how == "check":
        report = halo.check_equivalence(lambda: UNet("hidden"), full)
        try:
            halo.check_equivalence(lambda: UNet("local"), full)
            refused = None
        except ValueError as exc:  # the guard's refusal, raised inside the check's sharded run
            refused = str(exc)
        return str(report), report.ok, report.first_mismatch.what if report.first_mismatch else None, refused
    torch.manual_seed(0)
    model = convert_to_domain_parallel(UNet(how).double(), manager)
    offs = split_offsets(h, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    try:
        y = model(x)
    except ValueError as exc:
        return str(exc)
    y.sum().backward()
    return halo.gather(y.detach()), halo.gather(x.grad)


@pytest.mark.parametrize("world, h", [(2, 23), (3, 73)])
def test_unet_pad_to_match_is_refused_as_written_and_exact_with_pad_like(world, h):
    errors = run_on_ranks(_unet, world, "local", h, timeout=120)
    assert all(isinstance(e, str) and "pads H" in e and "halo.nn.pad_like" in e for e in errors), errors
    assert "`return F.pad(x1, [dx // 2" in errors[0] and "(in the forward of up (UpLocal))" in errors[0], errors[0]
    results = run_on_ranks(_unet, world, "pad_like", h, timeout=120)
    torch.manual_seed(0)
    model = UNet("pad_like").double()
    full = torch.randn(2, C, h, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = full.clone().requires_grad_(True)
    y = model(x)
    y.sum().backward()
    for got, grad in results:
        assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12), (got - y).abs().max()
        assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12), (grad - x.grad).abs().max()


def test_check_equivalence_catches_what_the_guard_cannot_see():
    results = run_on_ranks(_unet, 2, "check", 23, timeout=120)
    for text, ok, first, refused in results:
        assert not ok, text
        assert first == "output of up.conv (Conv2d)", (first, text)
        assert "FIRST DIFFERENCE" in text, text
        assert refused is not None and "pads H" in refused, refused  # the visible bug: refused by the guard
    assert len({r[0] for r in results}) == 1  # the same report on every rank


def _check_good(rank, world):
    import halo

    halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, C, 73, W, generator=torch.Generator().manual_seed(1))
    report = halo.check_equivalence(lambda: UNet("pad_like"), full, raise_on_failure=True)
    return report.ok, len(report.checks)


def test_check_equivalence_passes_an_exact_model():
    for ok, n in run_on_ranks(_check_good, 3, timeout=120):
        assert ok and n > 10, (ok, n)


def _hidden_first_call_only(rank, world):
    """The guard watches the first call of each input shape only; a second call costs no agreement."""
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(OpNet("tokens_linear").double(), manager, grid=(H, W),
                                       custom_converters=_inside())
    full, _ = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :]
    counts = []
    for _ in range(3):
        with HostWorkCounter() as c:
            model(x)
        counts.append(c.summary().get("agreement", 0) + c.summary().get("c10d.all_gather", 0))
    return counts


def test_guard_costs_nothing_after_the_first_call():
    for counts in run_on_ranks(_hidden_first_call_only, 3, timeout=60):
        assert counts[0] > 0 and counts[1] == counts[2] == 0, counts
