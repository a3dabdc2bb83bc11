"""Swin V2 window attention on latitude shards: timm's ``SwinTransformerV2Block`` (FuXi's), NCAR CREDIT's Swin
(``credit.models.swin``, a copy of timm's ``swin_transformer_v2_cr``) and FuXi (``credit.models.fuxi``).

What Swin V2 adds to V1 (``halo.nn.window``) is all inside a window: cosine attention scaled per head by
``logit_scale``, and a continuous relative position bias, an MLP (``cpb_mlp`` / ``meta_mlp``) over log-spaced
relative coordinates of the *window* (a buffer of the window's size, not the field's). So a shard made of whole
windows computes its windows on its own, exactly; the attention module is run as the third party wrote it (its own
``forward``, adopted, not transcribed). What crosses ranks is as in V1: the cyclic shift ``torch.roll`` along H (an
exchange, :func:`halo.nn.window.roll_needs`), and the shifted-window mask, whose rows for this rank's windows are
cut from the block's own mask buffer (built by timm / CREDIT from the *global* resolution; CREDIT's labels regions
along H only, and that is what is cut), or built from global rows (timm's ``dynamic_mask``). Padding to a window
multiple (timm) pads the last rank's partial window, sized from the global H. All of this is V1's code, not a copy
of it: :func:`halo.nn.window.shifted_window_attention`, ``shifted_window_plan`` and ``block_window_mask`` serve
both blocks (V2 adds its refusals' hints, CREDIT's blocks do not pad).

===============================  =====================================================  ============================
layer                            replaces (recognised by name and attributes)           what it needs / refuses
===============================  =====================================================  ============================
``DomainSwinV2Block``              timm ``SwinTransformerV2Block``; CREDIT                every rank's shard made of
                                 ``SwinTransformerV2CrBlock`` (post-norm blocks)        whole windows along H (the
                                                                                        last may end in a partial
                                                                                        window, timm only), else a
                                                                                        ``ValueError`` on every rank
                                                                                        naming the block, the window,
                                                                                        the rows per rank and the
                                                                                        world sizes / H that fit
``DomainWindowAttentionV2``        timm ``WindowAttention``, CREDIT                       per window; dropout in it
                                 ``WindowMultiHeadAttention(NoPos)``                    (``p > 0``, training) refused
``DomainCreditPatchEmbed``         CREDIT swin ``PatchEmbed`` (H checked globally)        ``DomainConv2d``
``DomainCubeEmbedding``            FuXi ``CubeEmbedding`` (its reshape to the global      ``DomainConv3d``
                                 patch grid checked globally)
``DomainUTransformer``             FuXi ``UTransformer``: the pad to a window multiple    pad / crop are
                                 and the crop after the Swin stage in global rows       :func:`halo.nn.halo_pad`
CREDIT ``SwinTransformerV2Cr``,  the models themselves: their ``forward`` reshapes to   a shard-aware forward
FuXi ``Fuxi``                    the *global* grid; converted in place (the class       (``revert_domain_parallel``
                                 becomes a subclass whose forward uses the shard's      restores the class)
                                 rows), their children as usual
===============================  =====================================================  ============================

Shard so that windows stay whole at every Swin level: ``H / P`` at that level a multiple of the window (an even
split), or ``halo.shard(x, dim, granularity=g)`` with ``g`` the window times the downsampling to that level (the
patch; FuXi's strided down block re-balances, so FuXi needs the even split). Gradients as in V1: the input
gradient is exact (the roll's adjoint); parameter gradients on each rank are its windows' contribution (sum over the
domain group). The models' outputs are split as their inputs were (the patch head's rows, one row permutation where
they differ). Not converted: timm V2's ``PatchMerging`` (norm after the reduction; halo's guard refuses its reshape
of H into row pairs on the first call) and CREDIT's ``WindowMultiHeadAttention`` bias-MLP dropout in training (it is
built with ``p = 0.125``; refused, set it to 0).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
from torch import nn

from ..context import place
from ..dist.comm import CommGroup
from ..dist.mesh import GroupRef
from ..plan.partition import offsets, split_sizes
from ..plan.plans import Site, carry, resolve, shard_sizes
from .base import DomainLayer
from .longrange import RegroupPlan, regroup, regroup_plan
from .registry import public
from .window import (
    SwinPlan,
    adopt_recognised,
    block_window_mask,
    broken_windows,
    latitude_only,
    shifted_window_attention,
    shifted_window_plan,
)

__all__ = [
    "DomainCreditPatchEmbed",
    "DomainCubeEmbedding",
    "DomainSwinV2Block",
    "DomainUTransformer",
    "DomainWindowAttentionV2",
    "swinv2_adapter",
    "unswap_models",
]


class _unwatched:  # noqa: N801 - a context manager, named like one
    """Torch-function dispatch off while a window attention's own forward runs, so that halo's guard (a
    ``TorchFunctionMode``, active on a converted model's first calls) does not watch it: its tensors are windows and
    the window's position tables (4-d buffers the guard would take for fields), never a field's rows.
    ``halo.guard.trusted`` would be the public way, but it still refuses the layout ops it follows (a ``view`` of
    the position table). Nothing in these forwards creates tensors from a device context or dispatches on a tensor
    subclass; under ``torch.compile`` (no guard) nothing is changed."""

    def __enter__(self) -> None:
        self.off = None if torch.compiler.is_compiling() else torch._C.DisableTorchFunction()
        if self.off is not None:
            self.off.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.off is not None:
            self.off.__exit__(*exc)


def _drops(module: nn.Module) -> list[str]:
    return [f"{n or 'itself'} (p={m.p})" for n, m in module.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]


@public
class DomainWindowAttentionV2(DomainLayer, nn.Module):
    """timm's V2 ``WindowAttention`` or CREDIT's ``WindowMultiHeadAttention`` / ``...NoPos`` (same parameters and
    buffers), run by its own class's ``forward`` on this rank's windows: windows are independent, and the position
    bias depends on the window only. Windows are not fields, so halo's guard does not watch inside. Dropout inside
    (the attention map's, the projection's, the bias MLP's) draws per window or per bias table, which each rank would
    draw differently from the unsharded model: with ``p > 0`` in training it is refused."""

    def __init__(self, attn: nn.Module) -> None:
        adopt_recognised(self, attn, "DomainWindowAttentionV2", ("qkv", "proj", "logit_scale", "num_heads"))
        self._halo_kind = type(attn)
        self.halo_init()

    def __getattr__(self, name: str) -> Any:
        """The adopted class's own methods (its forward calls helpers such as CREDIT's
        ``_relative_positional_encodings``), bound to this module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            kind = self.__dict__.get("_halo_kind")
            value = getattr(kind, name, None) if kind is not None else None
            if callable(value) and not isinstance(value, type):
                return value.__get__(self, type(self))
            raise

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training:
            drops = _drops(self)
            if drops:
                raise ValueError(
                    f"DomainWindowAttentionV2 ({self._halo_kind.__name__}): its dropout {', '.join(drops)} draws per "
                    f"window (or per position-bias table), which each rank would draw differently from the "
                    f"unsharded model; set p to 0 for domain-parallel training (or call .eval())")
        with _unwatched():
            return self._halo_kind.forward(self, x, mask)


def _fits(h: int, window: int, parts: int, pads: bool) -> str:
    """What would work at this level: world sizes whose balanced split of ``h`` keeps windows whole, the nearest
    ``h`` that does for ``parts`` ranks, and the block split."""
    ok = [p for p in range(2, max(2, math.ceil(h / window)) + 1) if not broken_windows(split_sizes(h, p), window, pads)]
    step = parts * window
    near = sorted({m for m in (h // step * step, (h // step + 1) * step) if m > 0})
    out = [f"these {h} rows keep whole windows on "
           + (f"{', '.join(map(str, ok[:8]))} ranks (balanced split)" if ok else "no number of ranks > 1 "
              "(balanced split)"),
           f"on {parts} ranks this level needs a multiple of {step} rows (e.g. {' or '.join(map(str, near))})"]
    if (h % window == 0 or pads) and math.ceil(h / window) >= parts:
        blocks = split_sizes(math.ceil(h / window) * window, parts, window)
        blocks[-1] -= math.ceil(h / window) * window - h
        out.append(f"or, where the layers before it keep a block split (patch embeddings do; a strided conv such "
                   f"as FuXi's down block re-balances), shard with halo.shard(x, dim, granularity=g), g = {window} "
                   f"times the downsampling to this level, for {blocks} rows here")
    return "; ".join(out)


def _v2_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], window: int, shift: int, pads: bool, where: str,
             op: str) -> SwinPlan:
    (sizes,) = extents
    if cg.size == 1:
        return SwinPlan(True)
    h = sum(sizes)
    if not pads and h % window:
        raise ValueError(f"{op} at {where}: its level has {h} rows along H, not a multiple of its window of {window} "
                         f"rows, and the block does not pad (the unsharded block cannot partition them either)")
    bad = broken_windows(sizes, window, pads)
    if bad:
        raise ValueError(
            f"{op} at {where}: its attention windows are {window} rows tall and must stay whole on each rank (a window "
            f"split across ranks would attend to part of itself only), but this level's {h} rows along H are held "
            f"as {list(sizes)} rows by the {cg.size} ranks (ranks {bad} start or end inside a window): "
            f"{_fits(h, window, cg.size, pads)}")
    return shifted_window_plan(cg, sizes, window, shift, pads, op)


@public
class DomainSwinV2Block(DomainLayer, nn.Module):
    """timm's ``SwinTransformerV2Block`` or CREDIT's ``SwinTransformerV2CrBlock`` on an H-shard ``(B, H_r, W, C)``
    made of whole windows (module docstring). Post-norm, as both: ``x + drop_path1(norm1(attn(x)))`` then
    ``x + drop_path2(norm2(mlp(x)))`` (then CREDIT's ``norm3``). The attention rolls the shard by ``-shift`` across
    ranks, pads the last rank's partial window (timm; CREDIT does not pad), attends within this rank's windows with
    the mask rows of those windows, and rolls back. Parameters, buffers and children are the block's (``attn``
    becomes a :class:`DomainWindowAttentionV2` sharing its parameters)."""

    def __init__(self, block: nn.Module, *, group: Any | None = None) -> None:
        adopt_recognised(self, block, "DomainSwinV2Block",
                         ("norm1", "attn", "norm2", "mlp", "window_size", "shift_size", "drop_path1", "drop_path2"))
        if not isinstance(self._modules["attn"], DomainWindowAttentionV2):
            self._modules["attn"] = DomainWindowAttentionV2(self._modules["attn"])
        self._halo_credit = type(block).__name__ == "SwinTransformerV2CrBlock"  # no padding, feat_size, norm3
        self._halo_path = type(block).__name__  # the converter sets the block's path
        self.halo_init(group)

    def _attn(self, x: torch.Tensor, plan: SwinPlan) -> torch.Tensor:
        size = "feat_size" if self._halo_credit else "input_resolution"

        def mask(height: int, width: int, xp: torch.Tensor) -> torch.Tensor | None:
            return block_window_mask(
                plan, height, width, tuple(self.window_size), tuple(self.shift_size), getattr(self, "attn_mask", None),
                dynamic=not self._halo_credit and bool(getattr(self, "dynamic_mask", False)), dtype=xp.dtype,
                device=xp.device, what=lambda: f"DomainSwinV2Block at {self._halo_path}: the block's attn_mask (built "
                                               f"for {size} {tuple(getattr(self, size))})")

        # timm pads to a window multiple (the global H's: the last rank's rows); CREDIT's blocks do not pad
        return shifted_window_attention(x, plan, tuple(self.window_size), tuple(self.shift_size), self.attn, mask,
                                        pads=not self._halo_credit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainSwinV2Block"
        plan = resolve(x, self.group, name, _v2_plan,
                       (int(self.window_size[0]), int(self.shift_size[0]), not self._halo_credit, self._halo_path,
                        name), site=self._halo_site, spec=(1,))
        if x.dim() != 4:  # after the agreement (which refuses ranks that differ): the same error on every rank
            raise ValueError(f"{name} at {self._halo_path}: expected a channels-last (B, H_local, W, C) shard, got "
                             f"shape {tuple(x.shape)}")
        b, h, w, c = x.shape
        y = x + self.drop_path1(self.norm1(self._attn(x, plan)))
        y = y.reshape(b, -1, c)
        y = y + self.drop_path2(self.norm2(self.mlp(y)))
        if self._halo_credit:
            y = self.norm3(y)
        y = y.reshape(b, h, w, c)
        carry(y, x)
        place(y, 1)  # channels-last: the sharded rows are dim 1
        return y


# -- CREDIT's patch embedding and FuXi's cube embedding / U-transformer ----------------------------------------

@dataclasses.dataclass(frozen=True)
class _Global:
    rows: int  # the global extent along the sharded dim
    offset: int  # this rank's first row


def _global_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...]) -> _Global:
    (sizes,) = extents
    return _Global(sum(sizes), offsets(sizes)[cg.index])


@public
class DomainCreditPatchEmbed(DomainLayer, nn.Module):
    """CREDIT Swin's ``PatchEmbed`` (``proj`` conv of kernel = stride = patch, then ``norm`` over channels) on an
    H-shard ``(B, C, H_r, W)``: its check that the height is the model's ``img_size`` is made on the global H (the
    shard's would always fail), and ``proj`` is a :class:`halo.nn.DomainConv2d`."""

    def __init__(self, embed: nn.Module, *, group: Any | None = None) -> None:
        from .conv import DomainConv2d

        adopt_recognised(self, embed, "DomainCreditPatchEmbed", ("proj", "norm", "img_size", "patch_size"))
        if not isinstance(self._modules["proj"], DomainConv2d):
            self._modules["proj"] = DomainConv2d(self._modules["proj"], group=group)
        self.halo_init(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainCreditPatchEmbed"
        rows = resolve(x, self.group, name, _global_plan, site=self._halo_site, spec=(-2,)).rows
        if rows != self.img_size[0]:
            raise ValueError(f"{name}: Input image height ({rows}, all ranks' rows) doesn't match model "
                             f"({self.img_size[0]}).")
        if x.shape[-1] != self.img_size[1]:
            raise ValueError(f"{name}: Input image width ({x.shape[-1]}) doesn't match model ({self.img_size[1]}).")
        y = self.proj(x)
        y = self.norm(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        carry(y, x)
        return y


@public
class DomainCubeEmbedding(DomainLayer, nn.Module):
    """FuXi's ``CubeEmbedding`` (a ``Conv3d`` of kernel = stride = patch over ``(T, H, W)``, then ``norm`` over the
    embedding per token) on an H-shard ``(B, C, T, H_r, W)``: ``proj`` is a :class:`halo.nn.DomainConv3d`, the norm is
    applied per token as FuXi's flatten / transpose does, and its reshape to the *global* patch grid
    (``patches_resolution``) becomes a check of the global extents (the unsharded reshape fails where they differ)."""

    def __init__(self, embed: nn.Module, *, group: Any | None = None) -> None:
        from .conv import DomainConv3d

        adopt_recognised(self, embed, "DomainCubeEmbedding", ("proj", "norm", "embed_dim", "patches_resolution"))
        if not isinstance(self._modules["proj"], DomainConv3d):
            self._modules["proj"] = DomainConv3d(self._modules["proj"], group=group)
        self.halo_init(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = "DomainCubeEmbedding"
        y = self.proj(x)
        rows = resolve(y, self.group, name, _global_plan, site=self._halo_site, spec=(-2,)).rows
        got = (int(y.shape[2]), rows, int(y.shape[4]))
        if got != tuple(self.patches_resolution):
            raise ValueError(f"{name}: the embedded grid (T, H, W) is {got} (H: all ranks' rows), but the model's "
                             f"patches_resolution is {tuple(self.patches_resolution)} (FuXi's reshape to it fails)")
        if self.norm is not None:
            y = self.norm(y.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3).contiguous()
        carry(y, x)
        return y


@public
class DomainUTransformer(DomainLayer, nn.Module):
    """FuXi's ``UTransformer`` (down block, pad to a window multiple, Swin V2 stage, crop, concatenation with the
    shortcut, up block) on an H-shard: the pad (a converted ``ZeroPad2d``: the balanced split of the padded field)
    and the crop are in global rows (:func:`halo.nn.halo_pad` with the negative padding), where FuXi's
    ``x[:, :, top:pad_lat - bottom]`` would cut every shard. Its children are converted as usual."""

    def __init__(self, module: nn.Module, *, group: Any | None = None) -> None:
        adopt_recognised(self, module, "DomainUTransformer", ("down", "pad", "layer", "up", "padding", "use_noise"))
        self.halo_init(group)
        self._halo_crop_site = Site()

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None, forecast_step: Any = None) -> torch.Tensor:
        from .pad import halo_pad

        left, right, top, bottom = self.padding
        x = self.down(x)
        shortcut = x
        x = self.pad(x)
        x = self.layer(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = halo_pad(x, (-left, -right, -top, -bottom), group=self.group, site=self._halo_crop_site,
                     op="DomainUTransformer (crop)")
        if self.use_noise:
            if noise is None:
                raise ValueError("DomainUTransformer: FuXi's use_noise without a noise tensor draws torch.randn per "
                                 "rank (each rank its own); pass noise= (the same (B, noise_latent_dim) on every "
                                 "rank)")
            x = self.noise_inject(x, noise, forecast_step)
        x = torch.cat([shortcut, x], dim=1)
        return self.up(x)


# -- the models: their forward reshapes to the global grid ----------------------------------------------------

def _group(model: nn.Module) -> Any:
    """The domain group a converted model was given (kept in a :class:`halo.dist.mesh.GroupRef`, which pickles)."""
    return model.__dict__["_halo_group"].group


def _resplit_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], target: tuple[int, ...] | None, dim: int,
                  op: str) -> RegroupPlan | None:
    (sizes,) = extents
    if cg.size == 1 or target is None or tuple(sizes) == tuple(target) or sum(sizes) != sum(target):
        return None
    return regroup_plan(cg, dim, sizes, target, tuple(range(sum(sizes))), op)


def _as_split(model: nn.Module, y: torch.Tensor, target: tuple[int, ...] | None, op: str) -> torch.Tensor:
    """``y`` split over the ranks as the model's input was (``target``), when it has the input's rows: the patch
    head turns each rank's ``n`` patch rows into ``n * patch`` rows, which after a balanced split of the patch grid
    is not the input's split (a loss against a target sharded like the input would not line up). One planned row
    permutation (:func:`halo.nn.longrange.regroup`, the identity on the global rows), none when they agree."""
    plan = resolve(y, _group(model), op, _resplit_plan, (target, y.dim() - 2, op),
                   site=model.__dict__["_halo_out_site"], spec=(-2,), split=False)
    return y if plan is None else regroup(y, plan)


def _input_rows(model: nn.Module, x: torch.Tensor, op: str) -> tuple[int, ...]:
    return tuple(shard_sizes(x, -2, _group(model), op=op, site=model.__dict__["_halo_in_site"]))


def _cr_forward_features(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CREDIT ``SwinTransformerV2Cr.forward_features`` with the full position embedding's rows of this shard (and the
    input's split noted for the head)."""
    self.__dict__["_halo_in_rows"] = _input_rows(self, x, "SwinTransformerV2Cr")
    x = self.patch_embed(x)
    if self.full_pos_embed:
        g = resolve(x, _group(self), "SwinTransformerV2Cr (pos_embed)", _global_plan,
                    site=self.__dict__["_halo_pos_site"], spec=(-2,))
        if g.rows != self.pos_embed.shape[-2]:
            raise ValueError(f"SwinTransformerV2Cr: pos_embed has {self.pos_embed.shape[-2]} rows, the embedded "
                             f"field {g.rows} (all ranks' rows)")
        x = x + self.pos_embed.narrow(-2, g.offset, x.shape[-2])
    return self.stages(x)


def _cr_forward_head(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CREDIT ``SwinTransformerV2Cr.forward_head`` with the shard's rows where CREDIT reshapes to ``img_size``."""
    b, _, h, w = x.shape
    p, c = self.patch_size, self.out_chans
    y = self.head(x.permute(0, 2, 3, 1)).reshape(b, h, w, p, p, c)
    y = torch.einsum("nhwpqc->nchpwq", y).reshape(b, c, h * p, w * p)
    carry(y, x)
    return _as_split(self, y, self.__dict__.get("_halo_in_rows"), "SwinTransformerV2Cr (head)")


def _fuxi_forward(self: nn.Module, x: torch.Tensor, noise: torch.Tensor | None = None,
                  forecast_step: Any = None) -> torch.Tensor | dict:
    """CREDIT ``Fuxi.forward`` on an H-shard: the reshape back to the grid uses the shard's rows (CREDIT's uses the
    global ``input_resolution``, checked here), and the final interpolation is :func:`halo.nn.halo_interpolate`."""
    from .upsample import halo_interpolate

    x_copy = x.clone().detach() if self.use_post_block else None
    rows_in = _input_rows(self, x, "Fuxi")
    if self.use_padding:
        x = self.padding_opt.pad(x)
    b = x.shape[0]
    _, patch_lat, patch_lon = self.patch_size
    x = self.cube_embedding(x).squeeze(2)
    x = self.u_transformer(x, noise=noise, forecast_step=forecast_step)
    lat, lon = self.input_resolution
    rows = sum(shard_sizes(x, -2, _group(self), op="Fuxi", site=self.__dict__["_halo_fuxi_site"]))
    if (rows, x.shape[-1]) != (2 * lat, 2 * lon):
        raise ValueError(f"Fuxi: the U-transformer's output is {rows} x {x.shape[-1]} (rows: all ranks'), but FuXi "
                         f"reshapes it to 2 * input_resolution = {2 * lat} x {2 * lon}")
    h = x.shape[-2]
    x = self.fc(x.permute(0, 2, 3, 1))
    x = x.reshape(b, h, lon * 2, patch_lat, patch_lon, self.out_chans).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, h * patch_lat, lon * 2 * patch_lon, self.out_chans).permute(0, 3, 1, 2)
    if self.use_padding:
        x = self.padding_opt.unpad(x)
    if self.use_interp:
        x = halo_interpolate(x, size=list(self.img_size_original)[1:], mode="bilinear",
                             group=_group(self))
    x = _as_split(self, x, rows_in, "Fuxi (head)").unsqueeze(2)
    if self.use_post_block:
        x = self.postblock({"y_pred": x, "x": x_copy})
    return x


_MODEL_STATE = ("_halo_group", "_halo_pos_site", "_halo_fuxi_site", "_halo_in_site", "_halo_out_site",
                "_halo_in_rows")
#: the models converted in place: class name -> (its module, halo's methods) (import-time tables, read-only)
_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "SwinTransformerV2Cr": ("credit.models.swin", {"forward_features": _cr_forward_features,
                                                   "forward_head": _cr_forward_head}),
    "Fuxi": ("credit.models.fuxi", {"forward": _fuxi_forward}),
}


@functools.cache  # a pure function of the class (at most one per entry of _MODELS); not state: the class must stay
def _swapped(kind: type) -> type:  # the same object for isinstance and pickling, so no context reset forgets it
    """The subclass of ``kind`` with halo's methods, named in this module as ``_Halo<name>`` (so that a converted
    model pickles, and loads in a fresh process: this module's ``__getattr__`` returns this same class)."""
    return type(kind.__name__, (kind,), {**_MODELS[kind.__name__][1], "__module__": __name__,
                                         "__qualname__": f"_Halo{kind.__name__}", "_halo_swapped_from": kind})


def __getattr__(name: str) -> Any:
    """``_HaloSwinTransformerV2Cr`` / ``_HaloFuxi`` made on demand (unpickling a converted model)."""
    entry = _MODELS.get(name.removeprefix("_Halo")) if name.startswith("_Halo") else None
    if entry is not None:
        import importlib

        return _swapped(getattr(importlib.import_module(entry[0]), name.removeprefix("_Halo")))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _swap(model: nn.Module, group: Any) -> None:
    """Make ``model`` an instance of a subclass of its class with halo's methods (state, ``isinstance`` and
    ``state_dict`` unchanged); :func:`unswap_models` restores it."""
    if "_halo_swapped_from" not in type(model).__dict__:
        model.__class__ = _swapped(type(model))
    model.__dict__.update({"_halo_group": GroupRef(group), **{k: Site() for k in _MODEL_STATE[1:5]}})


def unswap_models(model: nn.Module) -> None:
    """Undo :func:`_swap` everywhere in ``model`` (``revert_domain_parallel`` calls this)."""
    for m in model.modules():
        kind = type(m).__dict__.get("_halo_swapped_from")
        if kind is not None:
            m.__class__ = kind
            for key in _MODEL_STATE:
                m.__dict__.pop(key, None)


# -- recognising the classes (halo.nn.adapters) -----------------------------------------------------------------

def _v2_only(make: Any) -> Any:
    return latitude_only(make, "Swin V2 layers")


def _model(m: nn.Module, group: Any) -> None:
    _swap(m, group)
    return None  # its children are converted as usual


def _v2_attention(attn: Any) -> bool:
    return isinstance(attn, nn.Module) and all(hasattr(attn, a) for a in ("qkv", "proj", "logit_scale", "num_heads"))


def swinv2_adapter(module: nn.Module) -> Any:
    """The converter for a Swin V2 layer or model recognised by class name and attributes (module docstring), or
    ``None``."""
    base = type(module).__dict__.get("_halo_swapped_from", type(module))  # a model converted before
    kind, mods, where = base.__name__, module._modules, base.__module__
    blocks = {"norm1", "attn", "norm2", "mlp", "drop_path1", "drop_path2"}
    if kind == "SwinTransformerV2Block" and blocks <= set(mods) and _v2_attention(mods["attn"]) \
            and hasattr(mods["attn"], "cpb_mlp") and hasattr(module, "input_resolution"):
        return _v2_only(lambda m, g: DomainSwinV2Block(m, group=g))
    if kind == "SwinTransformerV2CrBlock" and blocks | {"norm3"} <= set(mods) and _v2_attention(mods["attn"]) \
            and hasattr(module, "feat_size"):
        return _v2_only(lambda m, g: DomainSwinV2Block(m, group=g))
    if not where.startswith("credit.models."):
        return None
    if where.startswith("credit.models.swin"):
        if kind == "PatchEmbed" and isinstance(mods.get("proj"), nn.Conv2d) and "norm" in mods \
                and hasattr(module, "img_size"):
            return _v2_only(lambda m, g: DomainCreditPatchEmbed(m, group=g))
        if kind == "SwinTransformerV2Cr" and {"patch_embed", "stages", "head"} <= set(mods):
            return _v2_only(_model)
    if where.startswith("credit.models.fuxi"):
        if kind == "CubeEmbedding" and isinstance(mods.get("proj"), nn.Conv3d):
            return _v2_only(lambda m, g: DomainCubeEmbedding(m, group=g))
        if kind == "UTransformer" and {"down", "pad", "layer", "up"} <= set(mods):
            return _v2_only(lambda m, g: DomainUTransformer(m, group=g))
        if kind == "Fuxi" and {"cube_embedding", "u_transformer", "fc"} <= set(mods):
            return _v2_only(_model)
    return None


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloWindowAttentionV2 = DomainWindowAttentionV2
HaloSwinV2Block = DomainSwinV2Block
HaloCreditPatchEmbed = DomainCreditPatchEmbed
HaloCubeEmbedding = DomainCubeEmbedding
HaloUTransformer = DomainUTransformer
