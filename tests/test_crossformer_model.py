"""CREDIT's CrossFormer (the WXFormer architecture), a small configuration written to CREDIT's exact structure
(``credit/models/crossformer.py``: CrossEmbedLayer, Transformer of short + long attention, UpBlock decoder,
spectral norm on every conv and linear, the final bilinear interpolation to the image size), converted unchanged by
``convert_to_domain_parallel`` and equal to the unsharded model: forward, backward and two SGD steps, float64."""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_longrange import CREDIT, Transformer

from halo.testing import run_on_ranks


def cast_tuple(val, length=1):
    return val if isinstance(val, tuple) else ((val,) * length)


def apply_spectral_norm(model):
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear, nn.ConvTranspose2d)):
            nn.utils.spectral_norm(module)


class UpBlock(nn.Module):
    def __init__(self, in_chans, out_chans, num_groups, num_residuals=2, upsample_v_conv=False, attention_type=None):
        super().__init__()
        self.upsample_v_conv = upsample_v_conv
        if self.upsample_v_conv:
            self.upsample = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.conv = nn.Conv2d(in_chans, out_chans, kernel_size=3, stride=1, padding=1)
        else:
            self.upsample = None
            self.conv = nn.ConvTranspose2d(in_chans, out_chans, kernel_size=2, stride=2)
        self.output_channels = out_chans
        blk = []
        for _ in range(num_residuals):
            blk.append(nn.Conv2d(out_chans, out_chans, kernel_size=3, stride=1, padding=1))
            blk.append(nn.GroupNorm(num_groups, out_chans))
            blk.append(nn.SiLU())
        self.b = nn.Sequential(*blk)
        self.attention = None  # CREDIT's load_unet_attention(None, ...)

    def forward(self, x):
        if self.upsample_v_conv:
            x = self.upsample(x)
        x = self.conv(x)
        shortcut = x
        x = self.b(x)
        x = x + shortcut
        if self.attention is not None:
            x = self.attention(x)
        return x


class CrossEmbedLayer(nn.Module):
    def __init__(self, dim_in, dim_out, kernel_sizes, stride=2):
        super().__init__()
        kernel_sizes = sorted(kernel_sizes)
        num_scales = len(kernel_sizes)
        dim_scales = [int(dim_out / (2 ** i)) for i in range(1, num_scales)]
        dim_scales = [*dim_scales, dim_out - sum(dim_scales)]
        self.convs = nn.ModuleList([])
        for kernel, dim_scale in zip(kernel_sizes, dim_scales, strict=True):
            self.convs.append(nn.Conv2d(dim_in, dim_scale, kernel, stride=stride, padding=(kernel - stride) // 2))

    def forward(self, x):
        fmaps = tuple(map(lambda conv: conv(x), self.convs))
        return torch.cat(fmaps, dim=1)


class CrossFormer(nn.Module):
    """CREDIT's CrossFormer for one input frame, patch 1, no padding, no post block (its __init__ and forward)."""

    def __init__(self, image_height=128, image_width=64, channels=2, surface_channels=1, input_only_channels=1,
                 levels=2, dim=(8, 16, 32, 64), depth=(1, 1, 1, 1), dim_head=8, global_window_size=(4, 4, 2, 1),
                 local_window_size=(4, 4, 2, 2), cross_embed_kernel_sizes=((4, 8, 16, 32), (2, 4), (2, 4), (2, 4)),
                 cross_embed_strides=(4, 2, 2, 2), use_spectral_norm=True, interp=True, upsample_v_conv=False):
        super().__init__()
        self.image_height, self.image_width = image_height, image_width
        self.frames, self.patch_height, self.patch_width = 1, 1, 1
        self.use_interp, self.use_padding, self.use_post_block = interp, False, False
        input_channels = channels * levels + surface_channels + input_only_channels
        output_channels = channels * levels + surface_channels
        dim, depth = cast_tuple(dim, 4), cast_tuple(depth, 4)
        global_window_size, local_window_size = cast_tuple(global_window_size, 4), cast_tuple(local_window_size, 4)
        last_dim = dim[-1]
        dims = [input_channels, *dim]
        self.layers = nn.ModuleList([])
        for (dim_in, dim_out), num_layers, global_wsize, local_wsize, kernel_sizes, stride in zip(
                tuple(zip(dims[:-1], dims[1:], strict=True)), depth, global_window_size, local_window_size,
                cross_embed_kernel_sizes, cross_embed_strides, strict=True):
            self.layers.append(nn.ModuleList([
                CrossEmbedLayer(dim_in=dim_in, dim_out=dim_out, kernel_sizes=kernel_sizes, stride=stride),
                Transformer(dim=dim_out, local_window_size=local_wsize, global_window_size=global_wsize,
                            depth=num_layers, dim_head=dim_head)]))
        self.up_block1 = UpBlock(1 * last_dim, last_dim // 2, dim[0], upsample_v_conv=upsample_v_conv)
        self.up_block2 = UpBlock(2 * (last_dim // 2), last_dim // 4, dim[0], upsample_v_conv=upsample_v_conv)
        self.up_block3 = UpBlock(2 * (last_dim // 4), last_dim // 8, dim[0], upsample_v_conv=upsample_v_conv)
        self.up_block4 = nn.ConvTranspose2d(2 * (last_dim // 8), output_channels, kernel_size=4, stride=2, padding=1)
        if use_spectral_norm:
            apply_spectral_norm(self)

    def forward(self, x):
        x = x.squeeze(2)
        encodings = []
        for cel, transformer in self.layers:
            x = cel(x)
            x = transformer(x)
            encodings.append(x)
        x = self.up_block1(x)
        x = torch.cat([x, encodings[2]], dim=1)
        x = self.up_block2(x)
        x = torch.cat([x, encodings[1]], dim=1)
        x = self.up_block3(x)
        x = torch.cat([x, encodings[0]], dim=1)
        x = self.up_block4(x)
        if self.use_interp:
            x = F.interpolate(x, size=(self.image_height, self.image_width), mode="bilinear")
        x = x.unsqueeze(2)
        return x


for _cls in (UpBlock, CrossEmbedLayer, CrossFormer):
    _cls.__module__ = CREDIT


def _ranks(rank, world, interp, height):
    os.environ["TRITON_INTERPRET"] = "0"
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import halo
    from halo.dist.comm import unsharded
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    ref = CrossFormer(image_height=height, interp=interp).double()
    model = CrossFormer(image_height=height, interp=interp).double()
    model.load_state_dict(ref.state_dict())
    keys = list(model.state_dict())
    convert_to_domain_parallel(model, manager)
    out = {"keys": keys == list(model.state_dict()), "err": []}
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        full = torch.randn(1, 6, 1, height, 64, generator=gen, dtype=torch.float64)
        target = torch.randn(1, 5, 1, height if interp else height // 2, 64 if interp else 32, generator=gen,
                             dtype=torch.float64)
        xf = full.clone().requires_grad_(True)
        with unsharded():
            yr = ref(xf)
        loss_ref = ((yr - target) ** 2).mean()
        opt_ref.zero_grad()
        loss_ref.backward()
        x = halo.shard(full).requires_grad_(True)
        y = model(x)
        loss = domain_mean((y - halo.shard(target)) ** 2)
        opt.zero_grad()
        loss.backward()
        sync_domain_gradients(model, manager)
        out["err"].append(max([float((halo.gather(y.detach()) - yr.detach()).abs().max()),
                               float((halo.gather(x.grad) - xf.grad).abs().max())]
                              + [float((p.grad - q.grad).abs().max())
                                 for p, q in zip(model.parameters(), ref.parameters(), strict=True)]))
        opt_ref.step()
        opt.step()
    out["params"] = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    revert_domain_parallel(model)
    out["reverted"] = model.use_interp == interp and not model._forward_hooks
    return out


@pytest.mark.parametrize("world, height, interp", [(2, 128, True), (3, 192, True), (2, 128, False)])
def test_crossformer_converts_unchanged(world, height, interp):
    """Windows at every level stay whole on each rank (128 rows: 2 short windows of 2 rows at the deepest level; 192
    rows over 3 ranks: 64 rows each, 2 rows at the deepest level); the final interpolation runs on the shards."""
    for r in run_on_ranks(_ranks, world, interp, height, timeout=300):
        assert r["keys"] and r["reverted"], r
        assert max(r["err"]) <= 1e-10 and r["params"] <= 1e-10, r
