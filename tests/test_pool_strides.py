"""Pools on fields of any strides (issue 32, item 3): ``nn.AdaptiveAvgPool2d(s)`` / ``nn.AdaptiveMaxPool2d(s)`` and
the window pools on a field with channels-last strides (what smp's LayerNorm2d's permutes produce, pooled by
UPerNet's pyramid), at P = 3 and 5, including outputs with fewer rows than ranks (H = 5, 6, 7, 10; s = 2, 3).

Each case runs the converted pool on the shards and torch's pool on the whole field in the same test: float64,
forward, the input's gradient and, through a 1x1 conv after the pool, parameter gradients (summed over ranks).
The sharded input is made channels-last (``x.contiguous(memory_format=torch.channels_last)``) and, in a second
form, by a ``permute`` of a (B, H, W, C) tensor (the layout LayerNorm2d returns).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

B, C, W = 2, 3, 5
CASES = [(h, s) for h in (5, 6, 7, 10) for s in (2, 3)] + [(11, (1, 4)), (9, 5)]


class Pools(nn.Module):
    """Adaptive average and max pools (an output of fewer rows than ranks among them), then a 1x1 conv."""

    def __init__(self, size, window=True):
        super().__init__()
        self.avg = nn.AdaptiveAvgPool2d(size)
        self.max = nn.AdaptiveMaxPool2d(size)
        self.win = nn.AvgPool2d(3, stride=2, padding=1) if window else nn.Identity()  # (refused below 1 row a rank)
        self.proj = nn.Conv2d(2 * C, C, 1)

    def forward(self, x):
        y = self.proj(torch.cat([self.avg(x), self.max(x)], dim=1))
        return y, self.win(x)


def _field(h):
    g = torch.Generator().manual_seed(h)
    return torch.randn(B, C, h, W, dtype=torch.float64, generator=g), torch.Generator().manual_seed(100 + h)


def _strided(t, form):
    if form == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    return t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # a (B, H, W, C) tensor seen as (B, C, H, W)


def _weights(y, gen):
    return torch.randn(y.shape, dtype=torch.float64, generator=gen)


def _run(rank, world, cases, form):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    out = {}
    for h, s in cases:
        torch.manual_seed(0)
        model = Pools(s, _window(h, world)).double()
        convert_to_domain_parallel(model, manager)
        full, gen = _field(h)
        offs = split_offsets(h, world)
        x = _strided(full[..., offs[rank]:offs[rank + 1], :].clone(), form).requires_grad_(True)
        y, z = model(x)
        wy = _weights(F.adaptive_avg_pool2d(full, s), gen)
        wz = _weights(F.avg_pool2d(full, 3, 2, 1) if _window(h, world) else full, gen)
        zo = split_offsets(wz.shape[-2], world)
        whole = y.shape[-2] == wy.shape[-2]  # fewer output rows than ranks: the result is whole on every rank
        yo = split_offsets(wy.shape[-2], world)
        (y * wy).sum().div(world).backward(retain_graph=True) if whole else \
            (y * wy[..., yo[rank]:yo[rank + 1], :]).sum().backward(retain_graph=True)
        (z * wz[..., zo[rank]:zo[rank + 1], :]).sum().backward()
        out[(h, s)] = {"y": y.detach() if whole else halo.gather(y.detach()), "z": halo.gather(z.detach()),
                       "grad": halo.gather(x.grad),
                       "params": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


def _window(h, world):
    return (h - 1) // 2 + 1 >= world  # the window pool's output rows: one at least on every rank


def _reference(h, s, form, world):
    torch.manual_seed(0)
    model = Pools(s, _window(h, world)).double()
    full, gen = _field(h)
    x = _strided(full.clone(), form).requires_grad_(True)
    y, z = model(x)
    wy, wz = _weights(y, gen), _weights(z, gen)
    ((y * wy).sum() + (z * wz).sum()).backward()
    return y.detach(), z.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("form", ["channels_last", "permuted"])
@pytest.mark.parametrize("world", [3, 5])
def test_pools_exact_on_any_strides(world, form):
    results = run_on_ranks(_run, world, CASES, form, timeout=600)
    for h, s in CASES:
        y, z, grad, params = _reference(h, s, form, world)
        for r in results:
            got = r[(h, s)]
            assert torch.allclose(got["y"], y, rtol=0, atol=1e-12), (h, s, (got["y"] - y).abs().max())
            assert torch.allclose(got["z"], z, rtol=0, atol=1e-12), (h, s, (got["z"] - z).abs().max())
            assert torch.allclose(got["grad"], grad, rtol=0, atol=1e-12), (h, s, (got["grad"] - grad).abs().max())
        for n, want in params.items():
            total = sum(r[(h, s)]["params"][n] for r in results)
            assert torch.allclose(total, want, rtol=0, atol=1e-11), (h, s, n, (total - want).abs().max())
