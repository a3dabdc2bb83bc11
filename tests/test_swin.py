"""Swin window attention on latitude shards (``halo.nn.window``) vs an unsharded reference with timm's structure.

timm cannot be imported here (its torchvision import fails), so the reference below copies the structure, class
names and attribute names of recent timm's ``SwinTransformerBlock`` / ``WindowAttention`` / ``PatchMerging`` /
``SwinTransformerStage`` (``timm/models/swin_transformer.py``) and ``PatchEmbed`` (``timm/layers/patch_embed.py``):
channels-last ``(B, H, W, C)``, ``_attn`` rolls by ``-shift``, pads to a window multiple, partitions, attends with
the relative position bias and ``attn_mask``, reverses, crops and rolls back; ``always_partition`` and
``dynamic_mask`` as timm. The converter recognises these classes by name and attributes.

- Pure: split granularity (``split_sizes(n, p, g)``, errors naming N, g and P), the patch-embedding row plan, the
  shifted-window mask of a rank's window rows against the whole mask of the reference block.
- ``halo_roll`` on 2 and 3 ranks, uneven and non-balanced shards, shifts of either sign and beyond N: forward equal
  to ``torch.roll``, backward a roll the other way, and the dot-product test of the adjoint.
- One block, float64, on 2 and 3 ranks: shifted and not, 5 windows over 3 ranks, a partial last window (H not a
  multiple of the window), ``dynamic_mask``, a shift in W only: output, input gradient and the parameter gradients
  summed over the domain group equal the unsharded block's (1e-12).
- A converted small Swin (PatchEmbed -> stage of 2 blocks -> PatchMerging + stage of 2 blocks), 2 and 3 ranks:
  ``state_dict`` keys unchanged, exact forward and backward, then 3 SGD-with-momentum steps match the unsharded model's.
- Pixel unshuffle / shuffle keep a block split (8, 8, 4 rows -> 4, 4, 2 -> 8, 8, 4), bitwise, with the gradient; the
  converted model's output gathers to the unsharded one.
- Errors on every rank alike: ``shard(granularity=)`` with N % g != 0; a shard not made of whole windows; a
  ``strict_img_size`` height that is not the global one.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import offsets, split_sizes
from halo.testing import run_on_ranks

TIMEOUT = 240


# -- the reference: timm's structure and names ---------------------------------------------------------------

def to_2tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x, x)


def window_partition(x, window_size):
    B, H, W, C = x.shape
    x = x.view(B, H // window_size[0], window_size[0], W // window_size[1], window_size[1], C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size[0], window_size[1], C)


def window_reverse(windows, window_size, H, W):
    C = windows.shape[-1]
    x = windows.view(-1, H // window_size[0], W // window_size[1], window_size[0], window_size[1], C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, H, W, C)


def get_relative_position_index(win_h, win_w):
    coords = torch.stack(torch.meshgrid(torch.arange(win_h), torch.arange(win_w), indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()
    relative_coords[:, :, 0] += win_h - 1
    relative_coords[:, :, 1] += win_w - 1
    relative_coords[:, :, 0] *= 2 * win_w - 1
    return relative_coords.sum(-1)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class WindowAttention(nn.Module):
    def __init__(self, dim, num_heads, head_dim=None, window_size=7, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.dim = dim
        self.window_size = to_2tuple(window_size)
        win_h, win_w = self.window_size
        self.window_area = win_h * win_w
        self.num_heads = num_heads
        head_dim = head_dim or dim // num_heads
        attn_dim = head_dim * num_heads
        self.scale = head_dim ** -0.5
        self.fused_attn = False  # timm: use_fused_attn(experimental=True), off by default
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * win_h - 1) * (2 * win_w - 1), num_heads))
        self.register_buffer("relative_position_index", get_relative_position_index(win_h, win_w), persistent=False)
        self.qkv = nn.Linear(dim, attn_dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(attn_dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.softmax = nn.Softmax(dim=-1)

    def _get_rel_pos_bias(self):
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.window_area, self.window_area, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        x = attn @ v
        x = x.transpose(1, 2).reshape(B_, N, -1)
        return self.proj_drop(self.proj(x))


class SwinTransformerBlock(nn.Module):
    def __init__(self, dim, input_resolution, num_heads=4, head_dim=None, window_size=7, shift_size=0,
                 always_partition=False, dynamic_mask=False, mlp_ratio=4.0, qkv_bias=True, proj_drop=0.0,
                 attn_drop=0.0, drop_path=0.0, act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.dim = dim
        self.input_resolution = input_resolution
        self.target_shift_size = to_2tuple(shift_size)
        self.always_partition = always_partition
        self.dynamic_mask = dynamic_mask
        self.window_size, self.shift_size = self._calc_window_shift(window_size, shift_size)
        self.window_area = self.window_size[0] * self.window_size[1]
        self.mlp_ratio = mlp_ratio
        self.norm1 = norm_layer(dim)
        self.attn = WindowAttention(dim, num_heads=num_heads, head_dim=head_dim, window_size=self.window_size,
                                    qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.drop_path1 = nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = nn.Identity()
        self.register_buffer("attn_mask", None if dynamic_mask else self.get_attn_mask(), persistent=False)

    def get_attn_mask(self, x=None):
        if any(self.shift_size):
            if x is not None:
                H, W, dtype = x.shape[1], x.shape[2], x.dtype
            else:
                (H, W), dtype = self.input_resolution, torch.float32
            H = math.ceil(H / self.window_size[0]) * self.window_size[0]
            W = math.ceil(W / self.window_size[1]) * self.window_size[1]
            img_mask = torch.zeros((1, H, W, 1), dtype=dtype)
            cnt = 0
            for h in ((0, -self.window_size[0]), (-self.window_size[0], -self.shift_size[0]),
                      (-self.shift_size[0], None)):
                for w in ((0, -self.window_size[1]), (-self.window_size[1], -self.shift_size[1]),
                          (-self.shift_size[1], None)):
                    img_mask[:, h[0]:h[1], w[0]:w[1], :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, self.window_size).view(-1, self.window_area)
            attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
            return attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)
        return None

    def _calc_window_shift(self, target_window_size, target_shift_size=None):
        target_window_size = to_2tuple(target_window_size)
        target_shift_size = to_2tuple(target_shift_size)
        if self.always_partition:
            return target_window_size, target_shift_size
        window_size = [r if r <= w else w for r, w in zip(self.input_resolution, target_window_size, strict=True)]
        shift_size = [0 if r <= w else s for r, w, s in zip(self.input_resolution, window_size, target_shift_size,
                                                            strict=True)]
        return tuple(window_size), tuple(shift_size)

    def _attn(self, x):
        B, H, W, C = x.shape
        has_shift = any(self.shift_size)
        if has_shift:
            shifted_x = torch.roll(x, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2))
        else:
            shifted_x = x
        pad_h = (self.window_size[0] - H % self.window_size[0]) % self.window_size[0]
        pad_w = (self.window_size[1] - W % self.window_size[1]) % self.window_size[1]
        shifted_x = F.pad(shifted_x, (0, 0, 0, pad_w, 0, pad_h))
        _, Hp, Wp, _ = shifted_x.shape
        x_windows = window_partition(shifted_x, self.window_size).view(-1, self.window_area, C)
        attn_mask = self.get_attn_mask(shifted_x) if self.dynamic_mask else self.attn_mask
        attn_windows = self.attn(x_windows, mask=attn_mask)
        attn_windows = attn_windows.view(-1, self.window_size[0], self.window_size[1], C)
        shifted_x = window_reverse(attn_windows, self.window_size, Hp, Wp)
        shifted_x = shifted_x[:, :H, :W, :].contiguous()
        return torch.roll(shifted_x, shifts=self.shift_size, dims=(1, 2)) if has_shift else shifted_x

    def forward(self, x):
        B, H, W, C = x.shape
        x = x + self.drop_path1(self._attn(self.norm1(x)))
        x = x.reshape(B, -1, C)
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x.reshape(B, H, W, C)


class PatchMerging(nn.Module):
    def __init__(self, dim, out_dim=None, norm_layer=nn.LayerNorm):
        super().__init__()
        self.dim = dim
        self.out_dim = out_dim or 2 * dim
        self.norm = norm_layer(4 * dim)
        self.reduction = nn.Linear(4 * dim, self.out_dim, bias=False)

    def forward(self, x):
        B, H, W, C = x.shape
        x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        _, H, W, _ = x.shape
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class SwinTransformerStage(nn.Module):
    def __init__(self, dim, out_dim, input_resolution, depth, downsample=True, num_heads=4, window_size=7,
                 always_partition=False, dynamic_mask=False, mlp_ratio=4.0):
        super().__init__()
        self.dim = dim
        self.input_resolution = input_resolution
        self.output_resolution = tuple(i // 2 for i in input_resolution) if downsample else input_resolution
        self.depth = depth
        self.grad_checkpointing = False
        window_size = to_2tuple(window_size)
        shift_size = tuple(w // 2 for w in window_size)
        self.downsample = PatchMerging(dim=dim, out_dim=out_dim) if downsample else nn.Identity()
        self.blocks = nn.Sequential(*[
            SwinTransformerBlock(dim=out_dim, input_resolution=self.output_resolution, num_heads=num_heads,
                                 window_size=window_size, shift_size=0 if i % 2 == 0 else shift_size,
                                 always_partition=always_partition, dynamic_mask=dynamic_mask, mlp_ratio=mlp_ratio)
            for i in range(depth)])

    def forward(self, x):
        return self.blocks(self.downsample(x))


class PatchEmbed(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None, flatten=True,
                 output_fmt=None, bias=True, strict_img_size=True, dynamic_img_pad=False):
        super().__init__()
        self.patch_size = to_2tuple(patch_size)
        self.img_size = None if img_size is None else to_2tuple(img_size)
        if output_fmt is not None:
            self.flatten, self.output_fmt = False, output_fmt
        else:
            self.flatten, self.output_fmt = flatten, "NCHW"
        self.strict_img_size = strict_img_size
        self.dynamic_img_pad = dynamic_img_pad
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x):
        B, C, H, W = x.shape
        if self.img_size is not None and self.strict_img_size:
            assert H == self.img_size[0], f"Input height ({H}) doesn't match model ({self.img_size[0]})."
            assert W == self.img_size[1], f"Input width ({W}) doesn't match model ({self.img_size[1]})."
        x = self.proj(x)
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)
        elif self.output_fmt == "NHWC":
            x = x.permute(0, 2, 3, 1)
        return self.norm(x)


class SmallSwin(nn.Module):
    """PatchEmbed (patch 2) -> stage (2 blocks, window 4) -> stage (PatchMerging, 2 blocks, window 2)."""

    def __init__(self, img_size, in_chans=3, embed_dim=8, dynamic_mask=False):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=2, in_chans=in_chans, embed_dim=embed_dim,
                                      norm_layer=nn.LayerNorm, output_fmt="NHWC")
        res = (img_size[0] // 2, img_size[1] // 2)
        self.layers = nn.Sequential(
            SwinTransformerStage(embed_dim, embed_dim, res, depth=2, downsample=False, num_heads=2, window_size=4,
                                 dynamic_mask=dynamic_mask, mlp_ratio=2.0),
            SwinTransformerStage(embed_dim, 2 * embed_dim, res, depth=2, downsample=True, num_heads=2,
                                 window_size=2, dynamic_mask=dynamic_mask, mlp_ratio=2.0))

    def forward(self, x):
        return self.layers(self.patch_embed(x))


def _randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


# -- pure ------------------------------------------------------------------------------------------------------

def test_split_granularity():
    assert split_sizes(40, 3, 8) == [16, 16, 8]
    assert split_sizes(20, 3, 4) == [8, 8, 4]
    assert split_sizes(721, 4, 1) == split_sizes(721, 4) == [181, 180, 180, 180]
    for n, p, g in [(30, 3, 2), (5 * 7, 4, 7), (720, 7, 3)]:
        sizes = split_sizes(n, p, g)
        assert sum(sizes) == n and all(s % g == 0 for s in sizes)
        assert [s // g for s in sizes] == split_sizes(n // g, p)
    with pytest.raises(ValueError, match=r"cannot split 42 rows into blocks of granularity 4 over 3 ranks: 42 is "
                                         r"not a multiple of 4"):
        split_sizes(42, 3, 4)
    with pytest.raises(ValueError, match=r"only 2 blocks of 4 rows, so ranks \[2, 3\] would get no block"):
        split_sizes(8, 4, 4)
    with pytest.raises(ValueError, match="granularity must be a positive int"):
        split_sizes(8, 2, 0)


def test_swin_layers_refuse_a_latitude_x_longitude_mesh():
    """The Swin layers keep W whole on each rank: their converters (one ``latitude_only`` for V1 and V2) refuse a
    mesh, and build the halo layer on latitude rows."""
    import types

    from halo.nn.window import DomainPatchMerging, DomainSwinTransformerBlock, swin_adapter

    block = SwinTransformerBlock(8, (8, 8), num_heads=2, window_size=4, shift_size=2)
    merge = PatchMerging(8)
    for layer, halo_class in ((block, DomainSwinTransformerBlock), (merge, DomainPatchMerging)):
        convert = swin_adapter(layer)
        with pytest.raises(ValueError, match="shard latitude only"):
            convert(layer, types.SimpleNamespace(mesh=object(), group=None))
        assert isinstance(convert(layer, types.SimpleNamespace(mesh=None, group=None)), halo_class)


def test_patch_embedding_row_plan_keeps_block_splits():
    from halo.nn.conv import conv_row_plan

    # kernel == stride, no padding, shards multiples of the stride: sizes // stride, each rank its own rows
    assert conv_row_plan((16, 16, 8), 2, 2, 1, (0, 0)) == ((8, 8, 4), ((0, 16), (16, 32), (32, 40)))
    assert conv_row_plan((8, 4), 4, 4, 1, (0, 0)) == ((2, 1), ((0, 8), (8, 12)))
    # a balanced input: the same as before (the balanced split of the output)
    assert conv_row_plan((8, 8, 8), 4, 4, 1, (0, 0)) == ((2, 2, 2), ((0, 8), (8, 16), (16, 24)))
    assert conv_row_plan((5, 4), 2, 2, 1, (0, 0))[0] == tuple(split_sizes(4, 2))  # not multiples: balanced
    assert conv_row_plan((8, 4), 3, 2, 1, (1, 1))[0] == tuple(split_sizes(6, 2))  # not a patch embedding


@pytest.mark.parametrize("h,w,ws,shift", [(16, 12, (4, 4), (2, 2)), (18, 10, (4, 4), (2, 2)), (20, 8, (4, 4), (0, 2)),
                                          (12, 9, (3, 3), (1, 1)), (10, 8, (4, 2), (3, 1))])
def test_window_mask_rows_equal_the_whole_mask(h, w, ws, shift):
    from halo.nn.window import window_attention_mask

    block = SwinTransformerBlock(4, (h, w), num_heads=1, window_size=ws, shift_size=shift, always_partition=True)
    full = block.get_attn_mask()
    assert torch.equal(window_attention_mask(h, w, ws, shift), full)
    n_h, n_w = math.ceil(h / ws[0]), math.ceil(w / ws[1])
    for first, stop in [(0, 1), (1, n_h), (n_h - 1, n_h), (0, n_h)]:
        assert torch.equal(window_attention_mask(h, w, ws, shift, (first, stop)), full[first * n_w:stop * n_w])
    assert window_attention_mask(h, w, ws, (0, 0)) is None


# -- halo_roll -------------------------------------------------------------------------------------------------

def _roll_worker(rank, world, sizes_list, shifts):
    import halo
    from halo.nn import halo_roll

    halo.initialize_domain_parallel(world, world)
    out = []
    for sizes in sizes_list:
        offs = offsets(sizes)
        n = offs[-1]
        gen = torch.Generator().manual_seed(n)
        full = torch.randn(2, 3, n, 5, generator=gen, dtype=torch.float64)
        y = torch.randn(2, 3, n, 5, generator=gen, dtype=torch.float64)
        for shift in shifts:
            for dim in (2, -2):
                x = full[:, :, offs[rank]:offs[rank + 1]].clone().requires_grad_(True)
                got = halo_roll(x, shift, dim)
                ref = torch.roll(full, shift, 2)[:, :, offs[rank]:offs[rank + 1]]
                y_loc = y[:, :, offs[rank]:offs[rank + 1]]
                (got * y_loc).sum().backward()
                grad_ref = torch.roll(y, -shift, 2)[:, :, offs[rank]:offs[rank + 1]]
                # dot product: <A x, y> and <x, A^T y>, each summed over ranks
                dots = torch.stack([(got.detach() * y_loc).sum(), (x.detach() * x.grad).sum()])
                torch.distributed.all_reduce(dots)
                out.append({"case": (sizes, shift, dim), "fwd": torch.equal(got.detach(), ref),
                            "bwd": torch.equal(x.grad, grad_ref),
                            "adjoint": abs(dots[0].item() - dots[1].item()) / max(1.0, abs(dots[0].item()))})
    return out


@pytest.mark.parametrize("world,sizes_list", [(2, [(5, 6), (8, 3)]), (3, [(4, 4, 3), (7, 1, 2), (2, 9, 4)])])
def test_halo_roll_equals_torch_roll_and_is_adjoint(world, sizes_list):
    shifts = [1, -1, 2, -3, 5, 13, -17, 0, 11]
    for res in zip(*run_on_ranks(_roll_worker, world, sizes_list, shifts, timeout=TIMEOUT), strict=True):
        assert all(r["fwd"] and r["bwd"] for r in res), res
        assert max(r["adjoint"] for r in res) < 1e-12, res


# -- one block ---------------------------------------------------------------------------------------------

def _grads(module):
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def _block_worker(rank, world, cases):
    import halo
    from halo.nn import DomainSwinTransformerBlock

    halo.initialize_domain_parallel(world, world)
    out = []
    for case in cases:
        h, w, ws, shift, sizes, kwargs = case
        torch.manual_seed(0)
        ref = _randomize(SwinTransformerBlock(8, (h, w), num_heads=2, window_size=ws, shift_size=shift,
                                              mlp_ratio=2.0, **kwargs).double(), 1)
        block = DomainSwinTransformerBlock(copy.deepcopy(ref))
        gen = torch.Generator().manual_seed(2)
        full = torch.randn(2, h, w, 8, generator=gen, dtype=torch.float64)
        weights = torch.randn(2, h, w, 8, generator=gen, dtype=torch.float64)
        offs = offsets(sizes)
        lo, hi = offs[rank], offs[rank + 1]
        x = full[:, lo:hi].clone().requires_grad_(True)
        xf = full.clone().requires_grad_(True)
        try:
            y = block(x)
        except ValueError as exc:
            out.append({"error": str(exc)})
            continue
        yf = ref(xf)
        (yf * weights).sum().backward()
        (y * weights[:, lo:hi]).sum().backward()
        grads = _grads(block)
        torch.distributed.all_reduce(grads)
        out.append({"fwd": rel_err(y.detach(), yf.detach()[:, lo:hi]), "dx": rel_err(x.grad, xf.grad[:, lo:hi]),
                    "dw": rel_err(grads, _grads(ref)), "keys": list(block.state_dict()) == list(ref.state_dict())})
    return out


BLOCK_CASES = {
    2: [(16, 12, 4, 2, (8, 8), {}), (16, 12, 4, 0, (12, 4), {}), (16, 8, 4, 2, (4, 12), {"dynamic_mask": True})],
    3: [(20, 8, 4, 2, (8, 8, 4), {}),  # 5 windows over 3 ranks
        (20, 8, 4, 0, (8, 8, 4), {}),
        (18, 10, 4, 2, (8, 4, 6), {}),  # a partial last window (H not a multiple of the window), W padded
        (18, 10, 4, 2, (4, 8, 6), {"dynamic_mask": True}),
        (12, 12, (3, 4), (0, 2), (3, 6, 3), {"always_partition": True}),  # a shift in W only
        (9, 8, 3, 1, (3, 3, 3), {"always_partition": True, "dynamic_mask": True})],
}


@pytest.mark.parametrize("world", [2, 3])
def test_block_matches_unsharded(world):
    cases = BLOCK_CASES[world]
    for i, res in enumerate(zip(*run_on_ranks(_block_worker, world, cases, timeout=TIMEOUT), strict=True)):
        assert all("error" not in r for r in res), (cases[i], res)
        assert all(r["keys"] for r in res)
        assert max(max(r["fwd"], r["dx"], r["dw"]) for r in res) < 1e-12, (cases[i], res)


def test_block_refuses_shards_that_split_windows():
    cases = [(20, 8, 4, 2, (7, 7, 6), {}), (20, 8, 4, 0, (8, 6, 6), {})]
    for res in zip(*run_on_ranks(_block_worker, 3, cases, timeout=TIMEOUT), strict=True):
        errors = [r.get("error") for r in res]
        assert errors[0] is not None and len(set(errors)) == 1, errors
        assert "whole attention windows of 4 rows" in errors[0] and "granularity=4" in errors[0], errors[0]


# -- a converted small Swin, a few optimizer steps ---------------------------------------------------------------

def _model_worker(rank, world, img, dynamic_mask, steps):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import local_share, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    ref = _randomize(SmallSwin(img, dynamic_mask=dynamic_mask).double(), 3)
    model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
    types = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Domain")})
    keys = list(model.state_dict()) == list(ref.state_dict())
    # SGD with momentum: linear in the gradients, so the steps stay exact. (Adam divides each entry by its own
    # running RMS, which turns the 1e-17 round-off of gradient entries that are ~0 into ~1e-8 differences.)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    gen = torch.Generator().manual_seed(4)
    errs = []
    for _ in range(steps):
        full = torch.randn(2, 3, *img, generator=gen, dtype=torch.float64)
        x = halo.shard(full, -2, granularity=8)
        xf = full.clone().requires_grad_(True)
        x.requires_grad_(True)
        yf = ref(xf)
        y = model(x)
        weights = torch.randn(yf.shape, generator=gen, dtype=torch.float64)
        o = offsets(split_sizes(yf.shape[1], world, 2))
        (yf * weights).sum().backward()
        local_share((y * weights[:, o[rank]:o[rank + 1]]).sum()).backward()  # this rank's share
        sync_domain_gradients(model, manager)
        errs.append({"fwd": rel_err(y.detach(), yf.detach()[:, o[rank]:o[rank + 1]]),
                     "gather": rel_err(halo.gather(y.detach(), 1), yf.detach()),  # a block split gathers
                     "dw": max(rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(),
                                                                     strict=True))})
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    params = max(rel_err(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return {"types": types, "keys": keys, "errs": errs, "params": params}


@pytest.mark.parametrize("world,img,dynamic_mask", [(2, (32, 16), False), (3, (40, 24), True)])
def test_converted_small_swin_trains_like_unsharded(world, img, dynamic_mask):
    """40 image rows over 3 ranks with granularity 8 (patch 2 x window 4): 16, 16, 8 rows -> 8, 8, 4 tokens (2, 2, 1
    windows of 4) -> 4, 4, 2 rows after the merge (2, 2, 1 windows of 2)."""
    for r in run_on_ranks(_model_worker, world, img, dynamic_mask, 3, timeout=TIMEOUT):
        assert r["types"] == ["DomainConv2d", "DomainDropout", "DomainPatchEmbed", "DomainPatchMerging",
                              "DomainSwinTransformerBlock", "DomainWindowAttention"], r["types"]
        assert r["keys"]
        for e in r["errs"]:
            assert max(e["fwd"], e["gather"], e["dw"]) < 1e-12, r["errs"]
        assert r["params"] < 1e-12, r["params"]


# -- errors on every rank ---------------------------------------------------------------------------------------

def _error_worker(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    errors = []
    full = torch.randn(1, 3, 42, 8, dtype=torch.float64)
    try:
        halo.shard(full, -2, granularity=4)
    except ValueError as exc:
        errors.append(str(exc))
    try:
        halo.scatter(full if rank == 0 else None, -2, granularity=4)
    except ValueError as exc:
        errors.append(str(exc))
    model = convert_to_domain_parallel(SmallSwin((40, 24)).double(), manager)
    try:
        model(halo.shard(torch.randn(1, 3, 48, 24, dtype=torch.float64), -2, granularity=8))
    except ValueError as exc:
        errors.append(str(exc))
    try:  # the right height, balanced (not whole windows): 14, 13, 13 image rows -> 7, 7, 6 tokens
        model(halo.shard(torch.randn(1, 3, 40, 24, dtype=torch.float64), -2))
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_errors_are_the_same_on_every_rank():
    results = run_on_ranks(_error_worker, 3, timeout=TIMEOUT)
    assert all(len(r) == 4 for r in results), results
    assert all(r == results[0] for r in results), results
    shard_err, scatter_err, height_err, window_err = results[0]
    assert shard_err.startswith("shard: cannot split 42 rows into blocks of granularity 4 over 3 ranks"), shard_err
    assert scatter_err.startswith("scatter: cannot split 42 rows"), scatter_err
    assert "Input height (48, all ranks' rows) doesn't match model (40)" in height_err, height_err
    assert "whole attention windows of 4 rows" in window_err and "[7, 7, 6]" in window_err, window_err


# -- pixel (un)shuffle keep a block split ------------------------------------------------------------------------

def _shuffle_worker(rank, world):
    import halo
    from halo.nn import DomainPixelShuffle, DomainPixelUnshuffle

    halo.initialize_domain_parallel(world, world)
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2, 4, 20, 6, generator=gen, dtype=torch.float64)
    x = halo.shard(full, -2, granularity=4).requires_grad_(True)  # 8, 8, 4 rows
    down = DomainPixelUnshuffle(nn.PixelUnshuffle(2))(x)  # 4, 4, 2
    up = DomainPixelShuffle(nn.PixelShuffle(2))(down * 2)  # 8, 8, 4 again
    xf = full.clone().requires_grad_(True)
    ref_down = F.pixel_unshuffle(xf, 2)
    ref_up = F.pixel_shuffle(ref_down * 2, 2)
    weights = torch.randn(ref_up.shape, generator=gen, dtype=torch.float64)
    o_in, o_down = offsets(split_sizes(20, world, 4)), offsets(split_sizes(10, world, 2))
    (ref_up * weights).sum().backward()
    (up * weights[..., o_in[rank]:o_in[rank + 1], :]).sum().backward()
    return {"down": (tuple(down.shape), torch.equal(down, ref_down[..., o_down[rank]:o_down[rank + 1], :])),
            "up": torch.equal(up, ref_up[..., o_in[rank]:o_in[rank + 1], :]),
            "grad": torch.equal(x.grad, xf.grad[..., o_in[rank]:o_in[rank + 1], :])}


def test_pixel_shuffles_keep_a_block_split():
    res = run_on_ranks(_shuffle_worker, 3, timeout=TIMEOUT)
    assert [r["down"] for r in res] == [((2, 16, 4, 3), True), ((2, 16, 4, 3), True), ((2, 16, 2, 3), True)], res
    assert all(r["up"] and r["grad"] for r in res), res
