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

import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from ..dist.mesh import DomainMesh, DomainParallelManager
from ..parallel.marks import watch_model
from ..plan.replicated import check_replicated
from .adapters import adapter
from .credit_padding import TensorPadding, swap_tensor_padding, unswap_tensor_padding
from .diffusers_layers import unpin_upsample_sizes
from .monai_layers import unpin_proj_feat
from .registry import Entry, entries, entry_of, is_pointwise_conv, public
from .root import drop_root, global_pool, guard_whole, make_root, rooted
from .swinv2 import unswap_models
from .target import ConvertContext, convert_context

# re-exported where they lived before: ConvertContext (halo.nn.target), TensorPadding and its swaps (credit_padding)
__all__ = ["INSIDE",
           "MESH_2D",  # noqa: F822 - the module's __getattr__ reads it from the registry when asked
           "ConvertContext", "TensorPadding", "convert_to_domain_parallel", "is_pointwise_conv",
           "revert_domain_parallel", "swap_tensor_padding", "unswap_tensor_padding"]


def _mesh_kinds() -> tuple[type, ...]:
    """The torch classes the registry gives a latitude x longitude form (``axes=2``), in registration order."""
    return tuple(kind for kind, entry in entries().items() if entry.axes >= 2)


# MESH_2D (module __getattr__ below): the layers with a latitude x longitude form (``convert_to_domain_parallel(
# model, DomainMesh((ph, pw)))``), read from the registry (``halo.nn.registry``) when asked, so a layer registered
# after this module was imported counts too: those with a ``mesh_ok`` check (``nn.Upsample`` modes, adaptive pools:
# global ones only) have it for some instances; others that act on H or W are refused on such a mesh, naming them.


#: Leaf modules that act on each grid point independently: kept as they are.
POINTWISE = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.ELU, nn.SELU, nn.CELU,
    nn.PReLU, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.Threshold, nn.Linear,
    nn.Bilinear, nn.Embedding, nn.Softmax2d,
)

#: Leaf modules that need the whole sharded dim and have no domain-parallel form here.
GLOBAL = (
    nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.Transformer,
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
    entry = entries().get(base)
    return entry.halo_class.__name__ if entry is not None else f"layer for nn.{base.__name__}"


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
    shape = _reads_shape(kind)
    if shape is not None and not inner:  # {T: None} would build from the shard's shape, unseen: not offered
        keep = (f"Its forward reads its input's shape ({shape}): on an H-shard that is the shard's, not the field's, "
                f"and what it builds from it (coordinates, a grid, a mask, a size) is made from plain ints the "
                f"guard cannot see, so keeping it as it is (custom_converters={{{kind.__name__}: None}}) could be "
                f"silently wrong and halo does not offer it. The exact form builds such tensors for the global "
                f"field and takes this rank's rows: halo.local_rows(t, x) in a converter custom_converters="
                f"{{{kind.__name__}: fn}} (fn(module, ctx) returning that module), or gather before it (halo.gather)")
        lead = f"{path} ({_name(kind)}) {what}. "
        return f"{lead}{inside}{keep}" if children else f"{lead}{keep}"
    pointwise = (f"A layer is pointwise in latitude when every output row depends only on the input row of the same "
                 f"latitude and the layer keeps the number of rows (an activation, a 1x1 conv, a per-pixel linear "
                 f"map, a softmax over channels) and draws no random numbers; such a layer can be declared with "
                 f"custom_converters={{{kind.__name__}: None}} (its forward is then watched by halo's guard on the "
                 f"first call). A layer that draws random numbers per element or per sample (a dropout or drop-path "
                 f"of your own) would draw differently on each rank: use halo.random.dropout / drop_path in it. ")
    if children:  # a composite: INSIDE first
        return f"{path} ({_name(kind)}) {what}. {inside}{pointwise}{rest}"
    return f"{path} ({_name(kind)}) {what}. {pointwise}{rest}"


_SHAPE = re.compile(r"\.shape\b|\.size\(")


def _reads_shape(kind: type) -> str | None:
    """Where a class of user code reads a tensor's shape (``file:line `code```), or ``None``: its own methods (and
    its bases' outside torch and halo), by their source. A layer that does may build tensors from the shard's
    extent (neuraloperator's ``GridEmbedding2D``: ``torch.linspace`` over ``data.shape[-2]`` rows), which no guard
    sees (a tensor made from ints is no field): the hint then points to the exact form instead of ``{T: None}``."""
    for cls in kind.__mro__:
        if cls is object or (cls.__module__ or "").split(".")[0] in ("torch", "halo", "builtins"):
            continue
        try:
            lines, first = inspect.getsourcelines(cls)
            name = os.path.basename(inspect.getsourcefile(cls) or "?")
        except (OSError, TypeError):
            continue
        for i, line in enumerate(lines):
            code = line.split("#")[0]
            if _SHAPE.search(code) and not code.lstrip().startswith(("def ", "\"\"\"", "'")):
                return f"at {name}:{first + i} `{line.strip()}`"
    return None


def _converted_inside(module: nn.Module, builtin: dict[type, Entry], ctx: ConvertContext) -> list[str]:
    """The submodules of ``module`` that halo replaces (or refuses): kept unconverted inside a module declared
    pointwise (``{T: None}``), they would compute each shard on its own."""
    found = []
    for name, m in module.named_modules():
        if m is module:
            continue
        kind = type(m)
        entry = entry_of(kind, builtin)
        if entry is not None and entry.keeps(m, ctx):
            continue  # a pointwise conv, a LayerNorm over W alone
        if entry is not None or isinstance(m, GLOBAL) or adapter(m) is not None:
            found.append(f"{name} ({_name(kind)})")
    return found


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@public
def convert_to_domain_parallel(
    model: nn.Module,
    manager: DomainParallelManager | DomainMesh | dist.ProcessGroup | None = None,
    custom_converters: dict[type, Callable[[nn.Module, ConvertContext], nn.Module] | None] | None = None,
    *,
    boundary: str | None = None,
    grid: tuple[int, int] | None = None,
    mesh: Any | None = None,
) -> nn.Module:
    """Replace, in place, every layer of ``model`` that crosses latitude rows by its domain-parallel form.

    Args:
        model: any module tree; it is changed in place and returned.
        manager: what to shard over, in this one position: a :class:`halo.DomainParallelManager` (CREDIT's:
            latitude rows), a :class:`halo.DomainMesh` (one domain axis: latitude rows; two: latitude x longitude,
            see ``mesh``) or a ``torch.distributed.ProcessGroup`` (latitude rows over its ranks, no data-parallel
            group); default the initialised manager (a clear error if there is none, a ``TypeError`` naming the
            type for anything else).
        custom_converters: ``{LayerType: fn(module, ctx) -> replacement}`` (checked before the built-ins, so
            it can also override them; the replacement is taken as complete: its children are not converted
            again), or ``{LayerType: None}`` to declare a layer pointwise in latitude.
        boundary: what fills the latitude edges of converted convolutions, e.g. ``"pole"`` for a global
            lat-lon grid; default: each conv's own ``padding_mode``.
        grid: ``(H, W)`` of the global field, if you want to declare it: every field input of the model (a tensor
            one of whose last dims is an extent of the grid or of this rank's share, ``halo.plan.entry``) must then
            hold this rank's share along dims -2, -1 (checked on each rank: a whole field, a W shard, a
            ``(B, H, W, C)`` tensor raise at once; the peers within the timeout), and a call starts without any
            communication (unless an input carries ``halo_sample_key``: then the ranks compare it). Without it the
            grid is taken from a ``halo.shard`` output's spec or learned from the first call's agreement
            (``halo.nn.root.set_grid`` changes it). Default: each call's first act is one
            small agreement on host data (every rank's input shapes), which makes a changed input shape on any
            rank safe. Either way, every layer learns its extents once and a steady step sends only halo
            messages and the reductions the math needs (``halo.plan.plans``). With ``mesh=``, every input whose last
            dim is a block's or the grid's width must be this rank's block (checked on each rank: a latitude
            shard with all longitudes is refused, where the layers would take it for a field ``pw`` times wider).
        mesh: the old keyword for a mesh in ``manager``'s place (kept): a ``halo.DomainMesh((ph, pw))`` with two domain
            axes shards latitude over ``ph`` ranks and longitude over ``pw``. The layers in ``MESH_2D`` get their
            latitude x longitude forms (H exchanged, then W; poles rolled across the W ranks); a layer acting on H or W
            without such a form is refused, naming it — so is ``nn.Linear`` (on a ``(B, C, H, W)`` tensor it mixes the
            sharded W; declare it with ``custom_converters={nn.Linear: None}`` where it acts on channels-last features).
            Code in ``forward`` is watched along W too (``F.pad``/``roll``/``cat``/reductions/windows of a field's last
            dim are refused, naming the line); run :func:`halo.check_equivalence` for what it cannot see.

    Raises:
        ValueError: the manager or mesh shards something other than latitude (dim -2; then longitude), or a
            layer has no domain-parallel form (naming the layer's path and type).
        TypeError: ``manager`` is none of a manager, a mesh or a process group.
    """
    if mesh is not None:  # the keyword of old: the same as passing the mesh in manager's place
        if manager is not None:
            raise ValueError("convert_to_domain_parallel: pass a manager, a mesh or a group once (in the second "
                             "position), not both a manager and mesh=")
        manager = mesh
    ctx, domain_size = convert_context(manager, boundary)
    domain_group = ctx.group
    custom = dict(custom_converters or {})
    builtin = entries()

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
                inner = _converted_inside(child, builtin, ctx)
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
            return builtin[kind].make(child, ctx)
        third_party = adapter(child)  # timm, torchvision, NATTEN, CREDIT, smp: by name (halo.nn.adapters)
        if third_party is not None:
            return third_party(child, ctx)
        base = next((b for b in kind.__mro__[1:] if b in builtin), None)
        if base is not None:  # a subclass of a layer halo converts
            if _same_forward(kind, base):
                return builtin[base].make(child, ctx)  # only __init__ differs (nn.UpsamplingBilinear2d, ...)
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
        raise ValueError(_unknown(path, kind, own, children, _converted_inside(child, builtin, ctx)))

    def visit(parent: nn.Module, prefix: str) -> None:
        whole = False  # a global pool came before in this Sequential: the rest computes on its whole result
        for name, child in list(parent._modules.items()):  # every slot: a module used twice appears twice
            if child is None:
                continue
            path = f"{prefix}{name}"
            if whole:
                tails.append(child)
                continue
            if isinstance(parent, nn.Sequential) and global_pool(child, domain_size):
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
                        and not getattr(replacement, "halo_owns_children", False) \
                        and next(replacement.children(), None) is not None:
                    visited.add(id(replacement))
                    visit(replacement, path + ".")  # children an adapter keeps (an activation after a norm)

    if "_halo_site" not in model.__dict__:  # the model itself: the same rules as for any module in it
        root = convert(model, "the model")
        if root is not None and root is not model:
            raise ValueError(
                f"the model itself is a {_name(type(model))}, which halo replaces by a layer of its own, and a "
                f"module cannot be replaced in place: convert a module that holds it (nn.Sequential(layer)) or "
                f"build the halo layer directly (e.g. halo.nn.DomainConv2d(conv))")
    visit(model, "")
    if ctx.mesh is None:  # on a mesh W is sharded too: CREDIT's own pad() stays, and the guard refuses it
        swap_tensor_padding(model, domain_group)  # CREDIT CrossFormer's padding object (not a module)
    make_root(model, domain_group, grid, w_sharded=ctx.mesh is not None,
               mesh_shape=tuple(ctx.mesh.domain_shape) if ctx.mesh is not None else None)
    guard_whole(model, tails, domain_size)
    watch_model(model)  # gradient provenance for the sync's scale checks; a DDP over domain ranks refused
    # every rank of the domain group must hold the same parameters and buffers (a model built after
    # torch.manual_seed(rank) would otherwise differ silently): one small agreement at conversion
    check_replicated(model, domain_group, op="convert_to_domain_parallel")
    return model


def _check_mesh_2d(child: nn.Module, path: str, builtin: dict[type, Entry]) -> None:
    """On a latitude x longitude mesh: refuse a layer that would act on H or W without a 2-d form (the registry's
    ``axes`` and ``mesh_ok`` say which have one)."""
    kind = type(child)
    entry = entry_of(kind, builtin)
    if entry is not None and entry.on_mesh(child):
        return  # a 2-d form: H over the H ranks, W over the W ranks (dropouts: draws keyed on global indices)
    if entry is None and kind.__name__ in ("DropPath", "StochasticDepth") and adapter(child) is not None:
        return  # draws keyed on global (row, column) indices
    linear = isinstance(child, nn.Linear | nn.Bilinear)
    if not linear and entry is None and adapter(child) is None:
        return  # pointwise, a container, or unknown: the usual rules decide
    kinds = [k for k, e in builtin.items() if e.axes >= 2]
    some = [k.__name__ for k in kinds if builtin[k].mesh_ok is not None]
    setting = (f"; this {kind.__name__}'s settings have none (mode, output size: {', '.join(some)} have a 2-d form "
               f"for some settings only, e.g. global adaptive pools (output 1 x 1))" if entry is not None
               and entry.axes >= 2 else "")
    raise ValueError(
        f"{path} ({_name(kind)}) has no latitude x longitude form in halo{setting}: on a mesh that shards both H and "
        f"W, halo converts {', '.join(k.__name__ for k in kinds if builtin[k].mesh_ok is None)}, {', '.join(some)} "
        f"(global adaptive pools: output 1 x 1), timm's BatchNormAct2d and drop-paths, and keeps pointwise layers; "
        + ("nn.Linear on a (B, C, H, W) tensor mixes the sharded W (declare it with custom_converters="
           "{nn.Linear: None} if it acts on channels-last features only); " if linear else "")
        + "shard latitude only (a manager, a one-axis mesh or a group), or give custom_converters={"
        + kind.__name__ + ": fn}")


@public
def revert_domain_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_to_domain_parallel` in place; parameters and buffers carry over to the originals."""
    drop_root(model)
    unswap_tensor_padding(model)
    unswap_models(model)  # CREDIT's Swin and FuXi models: their class back
    unpin_upsample_sizes(model)  # diffusers' conditional U-Nets: their num_upsamplers back
    unpin_proj_feat(model)  # MONAI UNETR: its own proj_feat back
    for handle in model.__dict__.pop("_halo_whole_hooks", []):
        handle.remove()
    from ..guard.reroute import uninstall  # (at call time: the guard imports the layers, whose face imports this)

    uninstall(model)  # functional ops computed exactly at their sites: the class's forward back
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


def __getattr__(name: str) -> Any:
    """``MESH_2D``: the torch classes with a latitude x longitude form, from the registry as it is now (see above).
    ``_RootedSequential`` and friends (``halo.nn.root``): a converted model pickled before the root moved there
    names this module, and loads in a fresh process."""
    if name == "MESH_2D":
        return _mesh_kinds()
    kind = getattr(nn, name.removeprefix("_Rooted"), None) if name.startswith("_Rooted") else None
    if isinstance(kind, type) and issubclass(kind, nn.Module):
        return rooted(kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
