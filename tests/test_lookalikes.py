"""Layers recognised by name cannot be impostors (found probing: a look-alike was replaced by halo's form silently).

halo recognises some third-party layers by class name and attributes (it never imports timm or torchvision). A class
of that name defined elsewhere — another repository's ``PatchMerging`` with its own order of the four sub-patches, a
``PatchEmbed`` that scales its output, a ``BatchNormAct2d`` that adds a bias, an old ``DropPath`` that scales by the
keep rate in eval mode — used to be replaced by halo's form of the real class: the converted model then computed
halo's forward, not the user's, with no error (0.6-1.9 off even on one rank). Now a look-alike outside timm and
torchvision must compute what halo's form computes on a probe input (``halo.nn.adapters._checked``), else halo says
so and converts it by the usual rules. Each case below, over 2 gloo ranks in float64 (12 rows: 6 + 6), is either
the unsharded model's numbers (forward and input gradient) or refused on every rank alike; faithful copies still get
halo's forms.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W, C = 12, 8, 4


class PatchMerging(nn.Module):
    """Named and built like timm's, with another order of the sub-patches (h-major where timm's is w-major)."""

    def __init__(self, dim=C, faithful=False):
        super().__init__()
        self.faithful = faithful
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):  # (B, H, W, C)
        B, Hh, Ww, Cc = x.shape
        if self.faithful:  # timm's own
            x = x.reshape(B, Hh // 2, 2, Ww // 2, 2, Cc).permute(0, 1, 3, 4, 2, 5).flatten(3)
        else:
            x = x.reshape(B, Hh // 2, 2, Ww // 2, 2, Cc).permute(0, 1, 3, 2, 4, 5).flatten(3)
        return self.reduction(self.norm(x))


class PatchEmbed(nn.Module):
    """timm's attributes; its forward doubles the embedding."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(C, C, 1)
        self.norm = nn.Identity()
        self.patch_size, self.img_size, self.strict_img_size = (1, 1), None, False
        self.flatten, self.output_fmt = False, "NCHW"

    def forward(self, x):
        return self.norm(self.proj(x) * 2)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's structure; its forward adds one after the activation."""

    def __init__(self):
        super().__init__(C)
        self.drop, self.act = nn.Identity(), nn.ReLU()

    def forward(self, x):
        return self.act(self.drop(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                               self.training, self.momentum, self.eps))) + 1


class DropPath(nn.Module):
    """An old drop-path: identity in training here, scaled by the keep rate in eval mode."""

    def __init__(self, drop_prob=0.25):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return x if self.training else x * (1 - self.drop_prob)


class Net(nn.Module):
    def __init__(self, layer, channels_last):
        super().__init__()
        self.stem = nn.Conv2d(C, C, 3, padding=1)
        self.layer = layer
        self.channels_last = channels_last

    def forward(self, x):
        x = self.stem(x)
        if self.channels_last:
            return self.layer(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.layer(x)


CASES = {
    "patch_merging": (lambda: PatchMerging(), True),
    "patch_merging_faithful": (lambda: PatchMerging(faithful=True), True),
    "patch_embed": (PatchEmbed, False),
    "batch_norm_act": (BatchNormAct2d, False),
    "drop_path": (DropPath, False),
}


def _net(name):
    make, channels_last = CASES[name]
    torch.manual_seed(0)
    return Net(make(), channels_last).double().eval()


def _inputs():
    return torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _worker(rank, world):
    import warnings

    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    offs = split_offsets(H, world)
    out = {}
    for name in CASES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                net = convert_to_domain_parallel(_net(name), manager)
            except ValueError as exc:
                out[name] = ("refused", str(exc), [])
                continue
        said = [str(w.message) for w in caught if "has the name and attributes of" in str(w.message)]
        x = _inputs()[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        try:
            y = net(x)
            (y * y).sum().backward()
        except ValueError as exc:
            out[name] = ("refused", str(exc), said)
            continue
        out[name] = ("ran", (type(net.layer).__name__, halo.gather(y.detach()), halo.gather(x.grad)), said)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 2, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_a_look_alike_is_exact_or_refused_never_replaced(results, name):
    net = _net(name)
    x = _inputs().requires_grad_(True)
    y = net(x)
    (y * y).sum().backward()
    outcomes = [r[name] for r in results]
    assert len({o[0] for o in outcomes}) == 1, outcomes  # every rank alike
    kind, what, said = outcomes[0]
    if kind == "refused":
        assert len({o[1] for o in outcomes}) == 1, outcomes
        assert "faithful" not in name, what  # a faithful copy converts
        return
    layer, got, grad = what
    assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12), (name, float((got - y).abs().max()))
    assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12), (name, float((grad - x.grad).abs().max()))
    if "faithful" in name:
        assert layer == "DomainPatchMerging" and said == [], (layer, said)  # halo's form, no warning
    else:
        assert not layer.startswith("Domain") and len(said) == 1, (layer, said)  # its own forward, said so


def test_look_alikes_are_said_or_refused_and_nothing_silent(results):
    """Which way each impostor went (a guard against every case drifting into "refused" by accident)."""
    kinds = {name: results[0][name][0] for name in CASES}
    assert kinds["patch_merging_faithful"] == "ran", kinds
    assert sum(k == "ran" for n, k in kinds.items() if "faithful" not in n) >= 1, kinds


def test_swin_blocks_copied_are_taken_and_a_changed_one_is_not():
    """timm's Swin block as a copy (test_swin's transcription) is halo's; the same class with a forward of its own
    is not (said), and neither is a copy whose probe fails."""
    import warnings

    from test_swin import SmallSwin

    from halo.nn.adapters import adapter

    blocks = [m for m in SmallSwin((32, 16)).modules() if type(m).__name__ == "SwinTransformerBlock"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert all(adapter(b) is not None for b in blocks)
        assert not [w for w in caught if "name and attributes" in str(w.message)]

        class SwinTransformerBlock(type(blocks[0])):
            def forward(self, x):
                return super().forward(x) * 1.5

        blocks[0].__class__ = SwinTransformerBlock
        assert adapter(blocks[0]) is None
    said = [str(w.message) for w in caught if "name and attributes" in str(w.message)]
    assert len(said) == 1 and "computes otherwise" in said[0] and "SwinTransformerBlock" in said[0], said
