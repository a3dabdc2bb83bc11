"""Swap a model's layers for their domain-parallel forms in place, keep the checkpoint, and swap back.

``convert_to_domain_parallel(model)`` walks the module tree and replaces every layer whose receptive field
crosses latitude rows (convolutions, pooling, upsampling, norms with spatial statistics) by the ``halo``
layer that computes the same numbers on an H-shard. The replacements adopt the original parameters and
buffers, so ``state_dict`` keys and tensors are unchanged: a checkpoint moves freely between sharded and
unsharded runs (invariant 6). ``revert_domain_parallel(model)`` puts the torch modules back.

Layers that act on each grid point (1x1 stride-1 convs, activations, a Linear over channels-last features when
W is not sharded) pass through untouched. Layers that draw random numbers (dropout, channel and alpha dropout,
timm's ``DropPath``, torchvision's ``StochasticDepth``) become ``halo.nn.dropout``'s, whose draws are keyed on
global indices: the same on any number of ranks (``halo.random``). A layer that needs the whole sharded dim and
has no domain-parallel form (attention over all tokens, flatten, ...) raises instead of silently computing
something else; so does any leaf module this converter does not know — declare it with
``custom_converters={MyLayer: None}`` (pointwise, keep it) or ``{MyLayer: fn}`` (``fn(module, ctx)`` returns
the replacement).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..mesh import DomainParallelManager, GroupRef, get_domain_parallel_manager, mesh_2d
from ..plans import enter_root, exit_root
from ..replicated import check_replicated

__all__ = ["INSIDE", "MESH_2D", "ConvertContext", "convert_to_domain_parallel", "revert_domain_parallel"]


@dataclass(frozen=True)
class ConvertContext:
    """What a converter needs: the domain group, the data-parallel group, the latitude boundary override."""

    group: Any
    dp_group: Any
    boundary: str | None
    mesh: Any = None  # a latitude x longitude DomainMesh (W sharded too), else None


def is_pointwise_conv(m: nn.Module, dims: int = 1) -> bool:
    """A conv that keeps every sharded dim pointwise (kernel 1, stride 1, no padding): H, or H and W."""
    for d in range(-2, -2 + dims):
        k = m.kernel_size[d] if len(m.kernel_size) >= 2 else 1
        s = m.stride[d] if len(m.stride) >= 2 else 1
        pad = m.padding if isinstance(m.padding, str) else m.padding[d]
        if not (k == 1 and s == 1 and pad in (0, "valid", "same")):
            return False
    return True


#: Layers with a latitude x longitude form (``convert_to_domain_parallel(model, mesh=DomainMesh((ph, pw)))``),
#: and global adaptive pools (output 1 x 1); others that act on H or W are refused on such a mesh, naming the layer.
MESH_2D = (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.LPPool2d, nn.Upsample, nn.GroupNorm,
           nn.BatchNorm2d, nn.InstanceNorm2d, nn.PixelShuffle, nn.PixelUnshuffle)


def _builtin_converters() -> dict[type, Callable[[nn.Module, ConvertContext], nn.Module] | None]:
    from . import conv, dropout, norm, pad, pool, shuffle, softmax, upsample

    def on(cls, **extra):  # the domain group, and the mesh when W is sharded too (None: latitude rows)
        return lambda m, ctx: cls(m, group=ctx.group, mesh=ctx.mesh, **extra)

    def c2d(m, ctx):
        if is_pointwise_conv(m, 2 if ctx.mesh is not None else 1):
            return m
        return conv.HaloConv2d(m, group=ctx.group, boundary=ctx.boundary, mesh=ctx.mesh)

    def c3d(m, ctx):
        return m if is_pointwise_conv(m) else conv.HaloConv3d(m, group=ctx.group, boundary=ctx.boundary)

    def layer_norm(m, ctx):
        if len(m.normalized_shape) == 1:  # over W (or features) only: pointwise in latitude
            return m
        return norm.DomainLayerNorm(m, group=ctx.group)

    return {
        nn.Conv2d: c2d,
        nn.Conv3d: c3d,
        nn.ConvTranspose2d: on(conv.HaloConvTranspose2d),
        nn.ConvTranspose3d: lambda m, ctx: conv.HaloConvTranspose3d(m, group=ctx.group),
        nn.MaxPool2d: on(pool.HaloMaxPool2d),
        nn.AvgPool2d: on(pool.HaloAvgPool2d),
        nn.LPPool2d: on(pool.HaloLPPool2d),
        nn.MaxPool3d: lambda m, ctx: pool.HaloMaxPool3d(m, group=ctx.group),  # latitude rows only (as 3-d convs)
        nn.AvgPool3d: lambda m, ctx: pool.HaloAvgPool3d(m, group=ctx.group),
        nn.AdaptiveAvgPool2d: on(pool.HaloAdaptiveAvgPool2d),
        nn.AdaptiveMaxPool2d: on(pool.HaloAdaptiveMaxPool2d),
        nn.Upsample: on(upsample.HaloUpsample),
        nn.GroupNorm: on(norm.DomainGroupNorm),
        nn.BatchNorm2d: lambda m, ctx: norm.DomainBatchNorm2d(m, group=ctx.group, mesh=ctx.mesh, dp_group=ctx.dp_group),
        nn.InstanceNorm2d: on(norm.DomainInstanceNorm2d),
        nn.LayerNorm: layer_norm,
        nn.Softmax: lambda m, ctx: softmax.DomainSoftmax(m),
        nn.LogSoftmax: lambda m, ctx: softmax.DomainLogSoftmax(m),
        nn.PixelShuffle: on(shuffle.HaloPixelShuffle),
        nn.PixelUnshuffle: on(shuffle.HaloPixelUnshuffle),
        nn.Dropout: on(dropout.DomainDropout),
        nn.Dropout1d: on(dropout.DomainDropout1d),
        nn.Dropout2d: on(dropout.DomainDropout2d),
        nn.Dropout3d: on(dropout.DomainDropout3d),
        nn.AlphaDropout: on(dropout.DomainAlphaDropout),
        nn.FeatureAlphaDropout: on(dropout.DomainFeatureAlphaDropout),
        **{kind: on(pad.HaloPad2d) for kind in pad.PADDING_MODULES},
    }


#: Leaf modules that act on each grid point independently: kept as they are.
POINTWISE = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.ELU, nn.SELU, nn.CELU,
    nn.PReLU, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.Threshold, nn.Linear,
    nn.Bilinear, nn.Embedding, nn.Softmax2d,
)

#: Leaf modules that need the whole sharded dim and have no domain-parallel form here.
GLOBAL = (
    nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.Transformer,
    nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d, nn.Flatten, nn.Unflatten, nn.Unfold, nn.Fold,
    nn.LocalResponseNorm, nn.ConvTranspose1d,
    nn.Conv1d, nn.MaxPool1d, nn.AvgPool1d,
    nn.BatchNorm1d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm3d, nn.SyncBatchNorm,
)

#: The GLOBAL layers that only look at a window of rows (a halo form is possible; none is written yet).
_WINDOWED = (nn.Conv1d, nn.ConvTranspose1d, nn.MaxPool1d, nn.AvgPool1d, nn.LocalResponseNorm, nn.Unfold, nn.Fold)

_ORIGINAL = "_halo_original"

#: ``custom_converters={Block: INSIDE}``: convert the children of ``Block`` and keep ``Block`` itself — for a block
#: with parameters or buffers of its own that it uses pointwise in latitude (a learned scale, a bias), which halo
#: refuses to guess.
INSIDE = object()


def _name(kind: type) -> str:
    module = kind.__module__
    return kind.__name__ if module.startswith("torch.nn") or module == "builtins" else f"{module}.{kind.__name__}"


def _same_forward(kind: type, base: type) -> bool:
    return getattr(kind, "forward", None) is getattr(base, "forward", None)


def _overrides_any_base(kind: type) -> bool:
    """A subclass of a torch layer (not of ``nn.Module`` itself) with a forward of its own."""
    bases = [b for b in kind.__mro__[1:] if b.__module__.startswith("torch.nn.modules") and b is not nn.Module
             and b not in (nn.Sequential, nn.ModuleList, nn.ModuleDict)]
    return bool(bases) and not _same_forward(kind, bases[0])


def _halo_name(base: type) -> str:
    return {nn.Conv2d: "HaloConv2d", nn.Conv3d: "HaloConv3d", nn.ConvTranspose2d: "HaloConvTranspose2d",
            nn.ConvTranspose3d: "HaloConvTranspose3d",
            nn.BatchNorm2d: "DomainBatchNorm2d", nn.GroupNorm: "DomainGroupNorm", nn.LayerNorm: "DomainLayerNorm",
            nn.InstanceNorm2d: "DomainInstanceNorm2d", nn.Upsample: "HaloUpsample", nn.MaxPool2d: "HaloMaxPool2d",
            nn.AvgPool2d: "HaloAvgPool2d", nn.MaxPool3d: "HaloMaxPool3d",
            nn.AvgPool3d: "HaloAvgPool3d", nn.LPPool2d: "HaloLPPool2d"}.get(base, f"layer for nn.{base.__name__}")


def _unknown(path: str, kind: type, own: list[str], children: bool = False, inner: list[str] | None = None) -> str:
    """Why ``path`` is refused, and the ways out that cannot lead to silence: ``{T: None}`` (keep it as it is) only
    for a type that holds no layer halo converts (its children would run unconverted on a shard); a composite with
    state of its own gets ``INSIDE`` (children converted, its own forward kept under the guard) first."""
    what = (f"has parameters or buffers of its own ({', '.join(own)}) and a forward() halo cannot read"
            if own else "is not a layer halo knows")
    inside = (f"If it uses its own parameters only pointwise in latitude (a learned scale, a bias) and its children "
              f"do the rest, pass custom_converters={{{kind.__name__}: halo.nn.convert.INSIDE}}: its children are "
              f"converted and its own forward is kept, watched on the first call by halo's guard (which refuses the "
              f"ops it does not know to be pointwise in latitude). ")
    rest = (f"A layer that reads other rows or changes H (a conv, a pool, a pad, a resize, attention, a reduction "
            f"over H or H x W) cannot be kept: give a converter custom_converters={{{kind.__name__}: fn}} with "
            f"fn(module, ctx) returning a module that computes the same on an H-shard, or gather before it "
            f"(halo.gather)")
    if inner:
        shown = ", ".join(inner[:3]) + (f" and {len(inner) - 3} more" if len(inner) > 3 else "")
        return (f"{path} ({_name(kind)}) {what}. It holds layers halo converts ({shown}), so it cannot be declared "
                f"pointwise and kept as it is (they would run unconverted on each shard). {inside}{rest}")
    pointwise = (f"A layer is pointwise in latitude when every output row depends only on the input row of the same "
                 f"latitude and the layer keeps the number of rows (an activation, a 1x1 conv, a per-pixel linear "
                 f"map, a softmax over channels) and draws no random numbers; such a layer can be declared with "
                 f"custom_converters={{{kind.__name__}: None}} (its forward is then watched by halo's guard on the "
                 f"first call). A layer that draws random numbers per element or per sample (a dropout or drop-path "
                 f"of your own) would draw differently on each rank: use halo.random.dropout / drop_path in it. ")
    if children:  # a composite: INSIDE first
        return f"{path} ({_name(kind)}) {what}. {inside}{pointwise}{rest}"
    return f"{path} ({_name(kind)}) {what}. {pointwise}{rest}"


def _converted_inside(module: nn.Module, builtin: dict) -> list[str]:
    """The submodules of ``module`` that halo replaces (or refuses): kept unconverted inside a module declared
    pointwise (``{T: None}``), they would compute each shard on its own."""
    found = []
    for name, m in module.named_modules():
        if m is module:
            continue
        kind = type(m)
        if isinstance(m, (nn.Conv2d, nn.Conv3d)) and is_pointwise_conv(m):
            continue
        if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
            continue
        if any(b in builtin for b in kind.__mro__) or isinstance(m, GLOBAL) or _adapter(m) is not None:
            found.append(f"{name} ({_name(kind)})")
    return found


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _adapter(module: nn.Module) -> Callable[[nn.Module, ConvertContext], nn.Module] | None:
    """Converters for third-party layers recognised by name (timm, torchvision: not imported here)."""
    from . import dropout, norm

    kind = type(module)
    if kind.__name__ == "BatchNormAct2d" and isinstance(module, nn.BatchNorm2d) \
            and {"drop", "act"} <= set(module._modules):  # timm.layers.BatchNormAct2d: batch norm, drop, act
        return lambda m, ctx: norm.DomainBatchNormAct2d(m, group=ctx.group, dp_group=ctx.dp_group, mesh=ctx.mesh)
    stateless = not module._parameters and not module._buffers and not module._modules
    if stateless and kind.__name__ == "DropPath" and hasattr(module, "drop_prob"):  # timm's and its copies
        return lambda m, ctx: dropout.DomainDropPath.adopt(m, group=ctx.group, mesh=ctx.mesh)
    if stateless and kind.__name__ == "StochasticDepth" and hasattr(module, "p") and hasattr(module, "mode"):
        return lambda m, ctx: dropout.DomainDropPath.adopt(m, group=ctx.group, mesh=ctx.mesh)  # torchvision.ops
    if kind.__name__ == "NeighborhoodAttention2D" and all(  # natten.NeighborhoodAttention2D (any version)
            hasattr(module, a) for a in ("qkv", "proj", "rpb", "num_heads", "kernel_size", "dilation", "scale")):
        from .neighborhood import DomainNeighborhoodAttention2D

        return lambda m, ctx: DomainNeighborhoodAttention2D(m, group=ctx.group)
    # NCAR CREDIT's CrossFormer / WXFormer (miles-credit 2026.2 moved it under credit.models.wxformer)
    if kind.__module__.startswith(("credit.models.crossformer", "credit.models.wxformer.crossformer")):
        if kind.__name__ == "Attention" and all(hasattr(module, a) for a in (
                "attn_type", "window_size", "heads", "scale", "norm", "to_qkv", "to_out", "dpb", "rel_pos_indices")):
            from .longrange import DomainCrossFormerAttention

            return lambda m, ctx: DomainCrossFormerAttention(m, group=ctx.group)
        if kind.__name__ == "LayerNorm" and set(module._parameters) == {"g", "b"} \
                and tuple(module.g.shape[2:]) == (1, 1):  # over channels (dim 1): pointwise in latitude
            return lambda m, ctx: m
        if kind.__name__ == "DynamicPositionBias" and hasattr(module, "layers"):  # an MLP of relative positions
            return lambda m, ctx: m
    from .smp_layers import smp_adapter  # smp's U-Net decoder: resizes to global level sizes
    from .swinv2 import swinv2_adapter  # timm's SwinTransformerV2Block; CREDIT's Swin (V2 Cr) and FuXi
    from .timm_layers import timm_adapter  # timm's channel norms, activations, layer scale, Conv2dSame, heads, ...
    from .window import swin_adapter  # timm's SwinTransformerBlock, PatchMerging (v1), PatchEmbed

    return swinv2_adapter(module) or swin_adapter(module) or timm_adapter(module) or smp_adapter(module)


def convert_to_domain_parallel(
    model: nn.Module,
    manager: DomainParallelManager | None = None,
    custom_converters: dict[type, Callable[[nn.Module, ConvertContext], nn.Module] | None] | None = None,
    *,
    boundary: str | None = None,
    grid: tuple[int, int] | None = None,
    mesh: Any | None = None,
) -> nn.Module:
    """Replace, in place, every layer of ``model`` that crosses latitude rows by its domain-parallel form.

    Args:
        model: any module tree; it is changed in place and returned.
        manager: whose groups to use; default the initialised manager (a clear error if there is none).
        custom_converters: ``{LayerType: fn(module, ctx) -> replacement}`` (checked before the built-ins, so
            it can also override them; the replacement is taken as complete: its children are not converted
            again), or ``{LayerType: None}`` to declare a layer pointwise in latitude.
        boundary: what fills the latitude edges of converted convolutions, e.g. ``"pole"`` for a global
            lat-lon grid; default: each conv's own ``padding_mode``.
        grid: ``(H, W)`` of the global field, if you want to declare it: every tensor input of the model with at
            least 2 dims whose last dim is ``W`` then holds this rank's rows of ``H`` along dim -2 (checked on
            each rank), and a call starts without any communication. Default: each call's first act is one
            small agreement on host data (every rank's input shapes), which makes a changed input shape on any
            rank safe. Either way, every layer learns its extents once and a steady step sends only halo
            messages and the reductions the math needs (``halo.plans``). With ``mesh=``, every input whose last
            dim is a block's or the grid's width must be this rank's block (checked on each rank: a latitude
            shard with all longitudes is refused, where the layers would take it for a field ``pw`` times wider).
        mesh: a ``halo.DomainMesh((ph, pw))`` with two domain axes: shard latitude over ``ph`` ranks and longitude
            over ``pw`` (instead of ``manager``). The layers in ``MESH_2D`` get their latitude x longitude forms
            (H exchanged, then W; poles rolled across the W ranks); a layer acting on H or W without such a form
            is refused, naming it — so is ``nn.Linear`` (on a ``(B, C, H, W)`` tensor it mixes the sharded W;
            declare it with ``custom_converters={nn.Linear: None}`` where it acts on channels-last features).
            Code in ``forward`` is watched along W too (``F.pad``/``roll``/``cat``/reductions/windows of a field's
            last dim are refused, naming the line); run :func:`halo.check_equivalence` for what it cannot see.

    Raises:
        ValueError: the manager shards something other than latitude (dim -2), or a layer has no
            domain-parallel form (naming the layer's path and type).
    """
    mesh2 = mesh_2d(mesh)
    if mesh is not None and mesh2 is None:
        raise ValueError(f"convert_to_domain_parallel: mesh= takes a halo.DomainMesh with two domain axes (latitude "
                         f"x longitude), got {mesh!r}; for latitude only pass a manager")
    if mesh2 is not None:
        if manager is not None:
            raise ValueError("convert_to_domain_parallel: pass a manager (latitude only) or a mesh (latitude x "
                             "longitude), not both")
        if tuple(mesh2.shard_dims) not in ((-2, -1), (2, 3)):
            raise ValueError(f"convert_to_domain_parallel: the mesh must shard dims (-2, -1), got "
                             f"{mesh2.shard_dims}")
        ctx = ConvertContext(mesh2.domain_group, mesh2.dp_group if mesh2.dp_size > 1 else None, boundary, mesh2)
        domain_group, domain_size = mesh2.domain_group, mesh2.domain_size
    else:
        manager = manager if manager is not None else get_domain_parallel_manager()
        if manager is None:
            raise RuntimeError("convert_to_domain_parallel needs a manager: call "
                               "halo.initialize_domain_parallel(world_size, domain_parallel_size) first or pass one")
        if manager.shard_dim not in (-2,):
            raise ValueError(f"the domain-parallel layers shard latitude (shard_dim=-2); the manager has "
                             f"shard_dim={manager.shard_dim}")
        dp_group = manager.data_parallel_group if manager.data_parallel_size > 1 else None
        ctx = ConvertContext(manager.domain_group, dp_group, boundary)
        domain_group, domain_size = manager.domain_group, manager.domain_world_size
    custom = dict(custom_converters or {})
    builtin = _builtin_converters()

    replaced: dict[int, nn.Module] = {}  # id(original) -> its one replacement (a module used in several slots)
    visited: set[int] = set()
    tails: list[nn.Module] = []  # modules after a global pool in a Sequential: kept as they are, on whole tensors
    finished: set[int] = set()  # results of custom converters (their insides are theirs)

    def convert(child: nn.Module, path: str) -> nn.Module | None:
        """The replacement of ``child`` (itself: keep it), or ``None``: a container to convert inside."""
        kind = type(child)
        if kind in custom:
            fn = custom[kind]
            if fn is INSIDE:
                return None
            if fn is None:
                inner = _converted_inside(child, builtin)
                if inner:
                    raise ValueError(
                        f"custom_converters={{{kind.__name__}: None}} declares {path} ({_name(kind)}) pointwise in "
                        f"latitude and keeps it as it is, but it holds layers halo converts ({', '.join(inner[:3])}"
                        f"{' ...' if len(inner) > 3 else ''}): kept unconverted, they would compute each shard on its "
                        f"own (silently wrong). Pass custom_converters={{{kind.__name__}: halo.nn.convert.INSIDE}} "
                        f"(its children converted, its own forward kept and watched by halo's guard) or a converter "
                        f"fn(module, ctx)")
                return child
            made = fn(child, ctx)
            finished.add(id(made))  # a custom converter's result is complete: not converted inside again
            return made
        if ctx.mesh is not None and not (kind.__name__ == "BatchNormAct2d" and isinstance(child, nn.BatchNorm2d)):
            _check_mesh_2d(child, path, builtin)
        if kind in builtin:
            return builtin[kind](child, ctx)
        adapter = _adapter(child)
        if adapter is not None:
            return adapter(child, ctx)
        base = next((b for b in kind.__mro__[1:] if b in builtin), None)
        if base is not None:  # a subclass of a layer halo converts
            if _same_forward(kind, base):
                return builtin[base](child, ctx)  # only __init__ differs (nn.UpsamplingBilinear2d, ...)
            raise ValueError(
                f"{path} ({_name(kind)}) subclasses nn.{base.__name__} but has a forward() of its own, which halo "
                f"cannot make domain-parallel as it is (converting only the nn.{base.__name__} part would run the "
                f"rest on one shard, and leaving it would compute per-shard results: both silently wrong). Pass "
                f"custom_converters={{{kind.__name__}: fn}} with fn(module, ctx) returning a module that computes "
                f"the same on an H-shard (e.g. halo's {_halo_name(base)} followed by the rest of its forward)")
        if isinstance(child, GLOBAL):
            what = ("slides a window over latitude (its edge rows need a neighbour's rows: a halo) and has no "
                    "domain-parallel form in halo yet" if isinstance(child, _WINDOWED) else
                    "mixes values across the whole sharded latitude dim and has no domain-parallel form in halo")
            raise ValueError(
                f"{path} ({_name(kind)}) {what}; gather before it (halo.gather), shard after it, or give "
                f"custom_converters={{{kind.__name__}: fn}} returning a module that computes the same on an H-shard")
        if isinstance(child, POINTWISE) and _same_forward(kind, next(b for b in kind.__mro__ if b in POINTWISE)):
            return child
        own = [n for n, t in (*child._parameters.items(), *child._buffers.items()) if t is not None]
        if isinstance(child, _CONTAINERS) and not own and not _overrides_any_base(kind) \
                and (kind in _CONTAINERS or _same_forward(kind, next(b for b in kind.__mro__ if b in _CONTAINERS))):
            return None  # a container (empty, or holding None slots): nothing of its own to compute
        children = next(child.children(), None) is not None
        if children and not own and not _overrides_any_base(kind):
            return None  # a container or a composite block without state of its own: convert inside it
        raise ValueError(_unknown(path, kind, own, children, _converted_inside(child, builtin)))

    def visit(parent: nn.Module, prefix: str) -> None:
        whole = False  # a global pool came before in this Sequential: the rest computes on its whole result
        for name, child in list(parent._modules.items()):  # every slot: a module used twice appears twice
            if child is None:
                continue
            path = f"{prefix}{name}"
            if whole:
                tails.append(child)
                continue
            if isinstance(parent, nn.Sequential) and _global_pool(child, domain_size):
                whole = True
            if id(child) in replaced:
                if parent._modules[name] is not replaced[id(child)]:
                    parent._modules[name] = replaced[id(child)]
                continue
            if hasattr(child, _ORIGINAL) or "_halo_site" in child.__dict__:  # converted already, or halo's own
                continue
            replacement = convert(child, path)
            if replacement is None:
                if id(child) not in visited:
                    visited.add(id(child))
                    visit(child, path + ".")
                continue
            replaced[id(child)] = replacement
            if replacement is not child:
                if "_halo_path" in replacement.__dict__:
                    replacement._halo_path = path  # its errors name where it sits
                object.__setattr__(replacement, _ORIGINAL, child)
                parent._modules[name] = replacement
                if id(replacement) not in visited and id(replacement) not in finished \
                        and next(replacement.children(), None) is not None:
                    visited.add(id(replacement))
                    visit(replacement, path + ".")  # children an adapter keeps (an activation after a norm)

    if "_halo_site" not in model.__dict__:  # the model itself: the same rules as for any module in it
        root = convert(model, "the model")
        if root is not None and root is not model:
            raise ValueError(
                f"the model itself is a {_name(type(model))}, which halo replaces by a layer of its own, and a "
                f"module cannot be replaced in place: convert a module that holds it (nn.Sequential(layer)) or "
                f"build the halo layer directly (e.g. halo.nn.HaloConv2d(conv))")
    visit(model, "")
    from ..compat.credit import swap_tensor_padding  # CREDIT CrossFormer's padding object (not a module)

    if ctx.mesh is None:  # on a mesh W is sharded too: CREDIT's own pad() stays, and the guard refuses it
        swap_tensor_padding(model, domain_group)
    _make_root(model, domain_group, grid, w_sharded=ctx.mesh is not None,
               mesh_shape=tuple(ctx.mesh.domain_shape) if ctx.mesh is not None else None)
    _guard_whole(model, tails, domain_size)
    # every rank of the domain group must hold the same parameters and buffers (a model built after
    # torch.manual_seed(rank) would otherwise differ silently): one small agreement at conversion
    check_replicated(model, domain_group, op="convert_to_domain_parallel")
    return model


def _check_mesh_2d(child: nn.Module, path: str, builtin: dict) -> None:
    """On a latitude x longitude mesh: refuse a layer that would act on H or W without a 2-d form."""
    kind = type(child)
    base = next((b for b in kind.__mro__ if b in builtin), None)
    if base in MESH_2D:
        if base is nn.Upsample and child.mode not in ("nearest", "nearest-exact", "bilinear", "bicubic", "area"):
            raise ValueError(f"{path} ({_name(kind)}): mode {child.mode!r} has no latitude x longitude form")
        return
    if base in (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d) and child.output_size in (1, (1, 1)):
        return  # a global pool (squeeze-excitation, scSE, CBAM): whole on every rank
    from .pad import PADDING_MODULES

    if base in PADDING_MODULES:
        return  # padding modules: H over the H ranks, W over the W ranks
    random = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
    if base in random or (kind.__name__ in ("DropPath", "StochasticDepth") and _adapter(child) is not None):
        return  # draws keyed on global (row, column) indices
    linear = isinstance(child, nn.Linear | nn.Bilinear)
    if not linear and base is None and _adapter(child) is None:
        return  # pointwise, a container, or unknown: the usual rules decide
    raise ValueError(
        f"{path} ({_name(kind)}) has no latitude x longitude form in halo: on a mesh that shards both H and W, halo "
        f"converts {', '.join(b.__name__ for b in MESH_2D)}, padding modules, dropouts, global adaptive pools "
        f"(output 1 x 1) and timm's BatchNormAct2d, and keeps pointwise layers; "
        + ("nn.Linear on a (B, C, H, W) tensor mixes the sharded W (declare it with custom_converters="
           "{nn.Linear: None} if it acts on channels-last features only); " if linear else "")
        + "shard latitude only (a manager), or give custom_converters={" + kind.__name__ + ": fn}")


def _global_pool(m: nn.Module, domain_size: int) -> bool:
    """An adaptive pool whose ``output_size`` gives fewer rows than there are ranks: its result is whole on every
    rank (``halo.nn.pool``)."""
    if not isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        return False
    size = m.output_size
    rows = size if isinstance(size, int) else size[0]
    return rows is not None and rows < domain_size


def _guard_whole(model: nn.Module, tails: list[nn.Module], domain_size: int) -> None:
    """With a global pool in the model (its result whole on every rank), hooks that keep whole tensors away from
    the layers that split rows: the modules after the pool in its Sequential run as torch's own on the whole
    tensor (and must get one); kept pointwise modules pass the mark on; a halo layer given a whole tensor raises
    (it would take the copies for shards). Nothing is installed in a model without a global pool; under
    ``torch.compile`` the hooks do nothing."""
    from .. import plans
    from . import pool

    for handle in model.__dict__.pop("_halo_whole_hooks", []):  # converting again: install afresh
        handle.remove()
    if not any(_global_pool(m, domain_size) for m in model.modules()):
        return
    handles = model.__dict__.setdefault("_halo_whole_hooks", [])
    tail_ids = {id(m) for m in tails}
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def expect_whole(module, args):
        if torch.compiler.is_compiling() or not args:
            return
        if plans.whole_source(args[0]) is None and isinstance(args[0], torch.Tensor):
            raise ValueError(
                f"{names.get(id(module), type(module).__name__)} ({type(module).__name__}) follows a global pool "
                f"in an nn.Sequential, so halo keeps it as torch's own layer on the pool's result (whole on every "
                f"rank), but its input is not that result (the Sequential's forward does not chain its modules in "
                f"order?): move it out of that Sequential")

    def pass_on(module, args, output):
        if torch.compiler.is_compiling() or not args:
            return
        source = plans.whole_source(args[0])
        if source is not None:
            for t in output if isinstance(output, tuple) else (output,):
                if isinstance(t, torch.Tensor):
                    plans.mark_whole(t, source)

    def refuse_whole(module, args):
        if torch.compiler.is_compiling() or not args:
            return
        source = plans.whole_source(args[0])
        if source is not None:
            raise ValueError(
                f"{names.get(id(module), type(module).__name__)} ({type(module).__name__}) is given the result of a "
                f"global pool ({source}), which is whole and the same on every rank; this layer would take the "
                f"ranks' copies for shards of a field. Put the pool and the layers that use its result in one "
                f"nn.Sequential (halo then keeps those layers as torch's own), or use the result only in pointwise "
                f"ops (as squeeze-excitation does)")

    for m in model.modules():
        if m is model:
            continue
        if id(m) in tail_ids:
            handles.append(m.register_forward_pre_hook(expect_whole))
            handles.append(m.register_forward_hook(pass_on))
        elif "_halo_site" in m.__dict__ and not isinstance(m, (pool.HaloAdaptiveAvgPool2d,
                                                                 pool.HaloAdaptiveMaxPool2d)):
            handles.append(m.register_forward_pre_hook(refuse_whole))
        elif next(m.children(), None) is None and "_halo_site" not in m.__dict__:
            handles.append(m.register_forward_hook(pass_on))  # a kept pointwise layer: whole in, whole out


@dataclass(frozen=True)
class RootConfig:
    """What a converted model's entry needs: the domain group (shared by copies) and the declared grid."""

    group_ref: GroupRef
    grid: tuple[int, int] | None
    w_sharded: bool = False  # a latitude x longitude mesh: the guard watches W too
    mesh_shape: tuple[int, int] | None = None  # with a declared grid: the mesh whose blocks the inputs are

    @property
    def group(self) -> Any:
        return self.group_ref.group


def _make_root(model: nn.Module, group: Any, grid: tuple[int, int] | None, w_sharded: bool = False,
               mesh_shape: tuple[int, int] | None = None) -> None:
    """Make ``model`` a converted model's root: its calls start (or join) a step's epoch (``halo.plans``)."""
    if grid is not None:
        if len(grid) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in grid):
            raise ValueError(f"grid must be (H, W), two positive ints, got {grid!r}")
        grid = (int(grid[0]), int(grid[1]))
    had = "_halo_root" in model.__dict__
    model.__dict__["_halo_root"] = RootConfig(GroupRef(group), grid, w_sharded, mesh_shape)
    if type(model).__module__.startswith("torch.nn"):
        # torch.compile traces a torch.nn container's call *with* its hooks (and the entry hook runs outside any
        # graph: fullgraph=True would fail); the same class under a forward of halo's own makes dynamo run the
        # hooks eagerly and trace the forward, as for a user's model. isinstance, state_dict and repr are unchanged.
        model.__class__ = _rooted(type(model))
    if not had:
        model.register_forward_pre_hook(enter_root, with_kwargs=True)
        model.register_forward_hook(exit_root, with_kwargs=True, always_call=True)


_ROOTED: dict[type, type] = {}


def _rooted(kind: type) -> type:
    """``kind`` with a ``forward`` defined here (module-level, so a model holding it pickles)."""
    cls = _ROOTED.get(kind)
    if cls is None:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return kind.forward(self, *args, **kwargs)

        name = f"_Rooted{kind.__name__}"
        cls = type(kind.__name__, (kind,), {"forward": forward, "__module__": __name__, "__qualname__": name,
                                             "_halo_unrooted": kind})
        _ROOTED[kind] = globals()[name] = cls
    return cls


def __getattr__(name: str) -> Any:
    """``_RootedSequential`` and friends made on demand: a pickled converted model loads in a fresh process."""
    kind = getattr(nn, name.removeprefix("_Rooted"), None) if name.startswith("_Rooted") else None
    if isinstance(kind, type) and issubclass(kind, nn.Module):
        return _rooted(kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _drop_root(model: nn.Module) -> None:
    unrooted = type(model).__dict__.get("_halo_unrooted")
    if unrooted is not None:
        model.__class__ = unrooted
    if model.__dict__.pop("_halo_root", None) is None:
        return
    for hooks, fn in ((model._forward_pre_hooks, enter_root), (model._forward_hooks, exit_root)):
        for key in [k for k, h in hooks.items() if h is fn]:
            del hooks[key]
            for extra in (model._forward_pre_hooks_with_kwargs, model._forward_hooks_with_kwargs,
                          model._forward_hooks_always_called):
                extra.pop(key, None)


def revert_domain_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_to_domain_parallel` in place; parameters and buffers carry over to the originals."""
    _drop_root(model)
    from ..compat.credit import unswap_tensor_padding

    unswap_tensor_padding(model)
    from .swinv2 import unswap_models  # CREDIT's Swin and FuXi models: their class back

    unswap_models(model)
    for handle in model.__dict__.pop("_halo_whole_hooks", []):
        handle.remove()
    from ..reroute import uninstall  # functional ops computed exactly at their sites: the class's forward back

    uninstall(model)
    done: set[int] = set()
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):  # every slot
            original = getattr(child, _ORIGINAL, None) if child is not None else None
            if original is not None:
                if id(child) not in done:
                    done.add(id(child))
                    original.load_state_dict(child.state_dict())
                    original.train(child.training)  # model.eval() after conversion reached only the child
                parent._modules[name] = original
    return model
