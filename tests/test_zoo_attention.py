"""A real model with attention over all tokens, converted end to end: diffusers' ``UNet2DModel`` with its
attention block (``UNetMidBlock2D``'s ``Attention``: group norm, ``AttnProcessor2_0``, residual), the zoo's tiny
configuration (``tests/_thirdparty.py``), at 2 and 3 ranks (38 and 40 rows: uneven splits at the halved level),
against the unsharded model in float64: the output, the input gradient and every parameter's gradient (summed over
the domain group). The attention runs as ``halo.nn.attention_layers.DomainDiffusersAttention`` (the ring); the
model's other layers convert as in the zoo (``tests/test_zoo_real.py``).
"""

from __future__ import annotations

import _thirdparty as tp
import pytest
import torch

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

_MISSING = tp.missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"the zoo's packages are not installed: {_MISSING}")

NAME = "diffusers.UNet2DModel+attention"
TOL = 1e-11  # float64; the group norms and the ring reorder sums over ranks: rounding only


def _model():
    tp.load()
    torch.manual_seed(0)
    return tp.SPECS[NAME].build().double().train()


def _rel(a, b):
    scale = b.abs().max()
    return ((a - b).abs().max() / (scale if scale >= 1e-12 else 1.0)).item() if a.numel() else 0.0


def _unet(rank, world):
    import halo
    from halo.nn.attention_layers import attention_converters

    manager = halo.initialize_domain_parallel(world, world)
    spec = tp.SPECS[NAME]
    ref, model = _model(), _model()
    keys = list(model.state_dict())
    converters = {**spec.converters(), **attention_converters(model)}
    halo.nn.convert_to_domain_parallel(model, manager, custom_converters=converters)
    kinds = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
    h = spec.rows[world]
    full = torch.randn(2, spec.channels, h, spec.width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xf = full.clone().requires_grad_(True)
    out_ref = spec.call(ref, xf)
    weight = torch.randn(out_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (out_ref * weight).sum().backward()
    offs = split_offsets(h, world)
    lo, hi = offs[rank], offs[rank + 1]
    x = full[:, :, lo:hi].clone().requires_grad_(True)
    out = spec.call(model, x)
    (out * weight[:, :, lo:hi]).sum().backward()
    e = {"out": _rel(out.detach(), out_ref.detach()[:, :, lo:hi]), "dx": _rel(x.grad, xf.grad[:, :, lo:hi])}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        g = p.grad.clone()
        torch.distributed.all_reduce(g)
        e[name] = _rel(g, q.grad)
    return kinds, list(model.state_dict()) == keys, e


@pytest.mark.parametrize("world", [2, 3])
def test_unet2d_with_attention_is_exact(world):
    for kinds, same_keys, e in run_on_ranks(_unet, world, timeout=300):
        assert kinds == ["DomainDiffusersAttention"], kinds
        assert same_keys
        worst = max(e, key=e.get)
        assert e[worst] < TOL, (worst, e[worst])
