"""CREDIT CrossFormer's ``TensorPadding`` (earth: across the poles, rolled by W/2; mirror: reflected) on H-shards:
``halo.compat.credit.TensorPadding`` against CREDIT's own code on the whole field, and a model holding CREDIT's
object converted by ``convert_to_domain_parallel`` (which swaps it) against the unsharded model, float64, forward
and backward, 3 ranks at odd sizes."""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from halo.testing import run_on_ranks


class TensorPadding:
    """CREDIT's class (credit/models/crossformer.py), transcribed: the reference."""

    def __init__(self, mode="earth", pad_lat=(40, 40), pad_lon=(40, 40), **kwargs):
        self.mode = mode
        self.pad_NS = pad_lat
        self.pad_WE = pad_lon

    def pad(self, x):
        return self._mirror_padding(x) if self.mode == "mirror" else self._earth_padding(x)

    def unpad(self, x):
        if any(p > 0 for p in self.pad_NS):
            end = -self.pad_NS[1] if self.pad_NS[1] > 0 else None
            x = x[..., self.pad_NS[0]:end, :]
        if any(p > 0 for p in self.pad_WE):
            end = -self.pad_WE[1] if self.pad_WE[1] > 0 else None
            x = x[..., :, self.pad_WE[0]:end]
        return x

    def _earth_padding(self, x):
        if any(p > 0 for p in self.pad_NS):
            xroll = torch.roll(x, shifts=int(x.shape[-1] // 2), dims=-1)
            top = torch.flip(xroll[..., :self.pad_NS[0], :], (-2,))
            bot = torch.flip(xroll[..., -self.pad_NS[1]:, :], (-2,))
            x = torch.cat([top, x, bot], dim=-2)
        if any(p > 0 for p in self.pad_WE):
            x = F.pad(x, (self.pad_WE[0], self.pad_WE[1], 0, 0, 0, 0), mode="circular")
        return x

    def _mirror_padding(self, x):
        if any(p > 0 for p in self.pad_WE):
            x = F.pad(x, pad=(self.pad_WE[0], self.pad_WE[1], 0, 0, 0, 0), mode="circular")
        if any(p > 0 for p in self.pad_NS):
            x = F.pad(x, pad=(0, 0, self.pad_NS[0], self.pad_NS[1], 0, 0), mode="reflect")
        return x


TensorPadding.__module__ = "credit.models.crossformer"  # as the converter meets it in CREDIT


class PaddedNet(nn.Module):
    """CrossFormer's pattern: pad the field, convolve (valid in latitude), unpad; the padding is a plain object."""

    def __init__(self, mode):
        super().__init__()
        self.padding_opt = TensorPadding(mode=mode, pad_lat=(3, 2), pad_lon=(2, 2))
        self.conv = nn.Conv2d(2, 3, 3, padding=(0, 0))
        self.conv2 = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        x = self.padding_opt.pad(x.unsqueeze(2)).squeeze(2)  # CREDIT pads (B, C, T, H, W)
        x = self.conv2(self.conv(x))
        return self.padding_opt.unpad(x.unsqueeze(2)).squeeze(2)


def _ranks(rank, world, mode):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.compat import credit
    from halo.dist.comm import unsharded
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel
    from halo.parallel.reduce import local_share, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, 2, 1, 21, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = {}
    # The twin alone on a 5-d field, vs CREDIT's code on the whole field: pad, then unpad.
    ref_pad = TensorPadding(mode, (3, 2), (2, 2))
    twin = credit.TensorPadding(mode, (3, 2), (2, 2))
    x = halo.shard(full).requires_grad_(True)
    padded = twin.pad(x)
    want = ref_pad.pad(full)
    out["pad"] = float((halo.gather(padded.detach()) - want).abs().max()) if padded.dim() == 5 else 1.0
    back = twin.unpad(padded)
    out["round trip"] = float((halo.gather(back.detach()) - full).abs().max())
    # A model holding CREDIT's object: the converter swaps it, the model equals the unsharded one.
    torch.manual_seed(0)
    ref = PaddedNet(mode).double()
    model = convert_to_domain_parallel(PaddedNet(mode).double(), manager)
    model.load_state_dict(ref.state_dict())
    out["swapped"] = isinstance(model.padding_opt, credit.TensorPadding)
    f4 = full.squeeze(2)
    xf = f4.clone().requires_grad_(True)
    with unsharded():
        yr = ref(xf)
    g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (yr * g).sum().backward()
    xs = halo.shard(f4).requires_grad_(True)
    y = model(xs)
    local_share((y * halo.shard(g)).sum()).backward()  # this rank's share of the global sum
    sync_domain_gradients(model, manager)
    out["model"] = max([float((halo.gather(y.detach()) - yr.detach()).abs().max()),
                        float((halo.gather(xs.grad) - xf.grad).abs().max())]
                       + [float((p.grad - q.grad).abs().max()) for p, q in
                          zip(model.parameters(), ref.parameters(), strict=True)])
    revert_domain_parallel(model)
    out["reverted"] = type(model.padding_opt) is TensorPadding
    return out


@pytest.mark.parametrize("mode", ["earth", "mirror"])
def test_credit_tensor_padding_on_shards(mode):
    for r in run_on_ranks(_ranks, 3, mode, timeout=180):
        assert r["swapped"] and r["reverted"], r
        for key in ("pad", "round trip", "model"):
            assert r[key] <= 1e-12, (key, r)
