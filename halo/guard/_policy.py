"""The guard's one op policy (:mod:`halo.guard`): :data:`POLICY`, torch function (or tensor method) -> a
:class:`Policy`: its kind (``pass``, ``follow``, ``exact``, ``refuse``), its rule (a pure function of the call and
the :class:`Axis`, written once and applied to H and, on a latitude x longitude mesh, to W alike), the guard's check
for ops whose operands' axes decide, how the guard follows the axis to the result, and for ``exact`` the layer
tier's functional that computes it. An op not in the table, given a field from user code, is refused (default
deny). The dispatcher that applies it is :meth:`halo.guard.SpatialGuard._checked`. A rule never communicates: the
guard agrees on its verdict across ranks. What is refused, and when:

=====================================================  ===========================================================
op (function or tensor method)                         refused when
=====================================================  ===========================================================
``F.pad``                                              it pads H (any mode): the amounts are local
``F.interpolate`` / ``upsample*``                      it resizes H in a form halo cannot compute (below): a size
                                                       from a shard that is no field's rows, antialias, a mode
                                                       ``halo_interpolate`` lacks, not ``(B, C, H, W)``
``F.conv2d``, ``conv_transpose2d``, pools, ``unfold``  its window, stride or padding along H is not 1 / 1 / 0
``F.conv1d``                                           over a field's tokens (``flatten(2)``): its kernel, stride,
                                                       padding or dilation is not 1 / 1 / 0 / 1 (a window over
                                                       flattened tokens); H in its channels (contracted)
``adaptive_*_pool2d``, ``pixel_(un)shuffle``,          they change or mix H
``grid_sample``
``torch.roll``, ``flip``                               along H
``cat``, ``split``, ``chunk``, ``narrow``, indexing,   along H (a slice of H that is not the whole of it); a
                                                       ``cat`` of fields split differently (rows differ)
``index_select``, ``select``, ``unbind``, ...
reductions (``max``, ``std``, ``prod``, ``cumsum``,    over H, or over everything (``mean``, ``sum`` of a
``sort``, ...)                                          floating field, ``softmax``: computed, below)
``view`` / ``reshape`` / ``flatten``                   H is merged with an earlier dim (with later ones, as
                                                       ``flatten(2)`` makes tokens, it is tracked)
``matmul`` / ``@`` / ``bmm``                           H becomes a second token dim (attention), or one operand
                                                       contracts its H with no H in the other's (contracting both
                                                       fields' H, ``k.mT @ v``: computed, below)
``F.layer_norm`` / ``rms_norm``                        ``normalized_shape`` covers H, with a weight or bias
                                                       (``rms_norm``: always)
``F.group_norm``, ``instance_norm``, ``batch_norm``    their statistics include H and their input does not hold H
                                                       at dim -2 (batch norm in eval: per channel, passes)
``F.normalize``, ``glu``, ``cosine_similarity``,       along H
``diff``, ``cummax``, ``logcumsumexp``, ...
``einsum``                                             H is contracted, or two fields' H become two dims
``torch.fft.*``                                        H is among the transformed dims
``baddbmm``                                           H is a token dim (attention over all tokens)
``F.scaled_dot_product_attention``                    H is a token dim and halo cannot compute it by ring
                                                       attention (dropout, grouped-query, a mesh; below)
``F.linear``                                           H is the last dim (contracted)
``F.dropout`` and friends, ``rand_like``, ...          they draw (training, p > 0): each shard would draw its own
                                                       (``F.dropout`` of a global pool's or a mean over H's own
                                                       result, whole on every rank: drawn whole, halo.guard.reroute)
``repeat``, ``tile``, ``repeat_interleave``            they repeat H
a pointwise op on two fields or more                   their shards hold different numbers of rows (split
                                                       differently), or one has 1 row on some ranks and more on
                                                       others (its 1-row shard broadcasts over a field's rows; a
                                                       tensor of 1 row on every rank broadcasts, as a bias)
``torch.ops.<ns>.<op>`` (extension, custom ops)        given a field from user code (unclassified, as below)
``torch.nn.attention.flex_attention``, higher-order    given a field from user code: torch compiles their body into
ops (``torch._higher_order_ops``)                      one op the guard cannot see (a HOP that torch's own compiled
                                                       code runs on a field: at the next eager op or the call's end)
a custom ``torch.autograd.Function``                   applied to a field (an output of 3 dims or more) with a graph:
                                                       its backward is code halo cannot check (found after the call,
                                                       walking the call's autograd graph; halo's and torch's own
                                                       Functions and ``trusted()`` blocks pass)
*anything else*                                        always (default deny: an op halo has not classified)
=====================================================  ===========================================================

``F.group_norm``, ``instance_norm``, ``batch_norm`` and ``layer_norm`` (no weight), ``mean``, ``sum`` (of a
floating field), ``softmax`` and ``log_softmax`` over H (:func:`halo.nn.softmax.domain_softmax`), a ``matmul`` that
contracts two fields' H (``k.transpose(-1, -2) @ v``, linear attention's: the local product summed over the domain,
whole on every rank), the vector norms
(``torch.norm``, ``Tensor.norm``, ``torch.linalg.vector_norm``, ``linalg.norm`` of vectors), ``F.interpolate`` and
``F.scaled_dot_product_attention`` whose query, key and value hold fields' tokens (by
:func:`halo.nn.ring.ring_sdpa`: masks with the global key dim, ``is_causal`` in global positions) are ``exact``:
where their rule finds they act on H of a latitude-split field, the guard computes them over the whole domain
instead (:mod:`halo.guard.reroute`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# the exact functionals, imported from the layer tier (below the guard)
from ..nn.norm import domain_var_mean, domain_vector_norm
from ..nn.pool import halo_pool
from ..nn.ring import ring_sdpa
from ..nn.softmax import domain_softmax
from ..nn.upsample import halo_interpolate
from ..parallel.reduce import all_reduce
from ..plan.plans import TensorMap, whole_source
from ..random import dropout as random_dropout

__all__ = ["H", "POLICY", "W", "Axis", "Policy", "broadcasts", "dims_arg", "field_of", "get_arg", "getitem_rule",
           "global_extents", "h_dim", "interpolate_rule", "linear_rule", "merge_dims", "merge_fastest", "policy",
           "row_masks", "split_differently", "torch_raised", "whole_interpolate_rule"]


# -- the axis a rule is written for --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Axis:
    """The sharded axis a rule is applied to: its name in messages, which entry of a per-dim argument (kernel,
    stride, padding, size) it reads, what its slices are called, the gather that makes it whole, and the words
    that introduce a refusal on it."""

    name: str
    index: int
    unit: str
    gather: str
    prefix: str


H = Axis("H", -2, "rows", "halo.gather", "")
W = Axis("W", -1, "columns", "halo.gather_2d", "acts on W, which a latitude x longitude mesh shards too: ")

def field_of(t: Any, dims: TensorMap, a: Axis = H, h_dims: TensorMap | None = None) -> tuple[int, int] | None:
    """``(dim, rows)``: where ``t`` holds the sharded rows of axis ``a`` and how many (``dim`` may hold more: rows x
    the dims merged after them, as tokens), or ``None``: not a field, or whole on every rank. ``dims`` follows
    ``a``; an untracked field holds it at ``a.index`` (H: dim -2, W: dim -1). ``h_dims`` (W only): H's map; a
    tensor whose H was tracked (a layer placed it, or an op moved it) and whose W was not has no known W."""
    if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
        return None
    tracked = dims.get(t)
    if tracked is not None:
        return None if tracked[0] < 0 else tracked
    if whole_source(t) is not None or t.dim() < 3 or h_dims is not None and h_dims.get(t) is not None:
        return None
    return t.dim() + a.index, int(t.shape[a.index])


def h_dim(t: Any, dims: TensorMap) -> int | None:
    """The sharded dim of ``t`` (``None``: not a field, or whole on every rank)."""
    f = field_of(t, dims)
    return None if f is None else f[0]


def dims_arg(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """``dim`` as a tuple of non-negative dims (``None``: all dims)."""
    if dim is None:
        return None
    if isinstance(dim, (list, tuple)):
        return tuple(d % ndim for d in dim) if dim else None
    return (dim % ndim,)


def get_arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


# -- the rules: (args, kwargs, h) -> a description of what is wrong, or None ---------------------------------------

def _pad(args, kwargs, x, h, a):
    pad = list(get_arg(args, kwargs, 1, "pad", ()))
    k = x.dim() - 1 - h  # pairs run from the last dim backwards
    if len(pad) >= 2 * k + 2 and (pad[2 * k] or pad[2 * k + 1]):
        return (f"pads {a.name} (the sharded dim) by ({pad[2 * k]}, {pad[2 * k + 1]}) {a.unit} on a shard: every rank "
                "pads its "
                f"own edge {a.unit}, so inner shards get padding where their neighbours' {a.unit} belong (and amounts "
                "taken "
                f"from a shard's size differ by rank); to pad one tensor to another's size (a U-Net's skip) use "
                f"halo.nn.pad_like(x, ref) (the same centred pad, from the global sizes); for a fixed pad use a "
                f"padding module (nn.ZeroPad2d, converted to halo.nn.DomainPad2d)")
    return None


def interpolate_rule(args, kwargs, x, h, a):
    """Refused unless H keeps its rows, or each row is repeated a whole number of times (nearest): that is exact on
    a shard (its output rows are the global output's, split as the input was)."""
    size = get_arg(args, kwargs, 1, "size")
    scale = get_arg(args, kwargs, 2, "scale_factor")
    mode = get_arg(args, kwargs, 3, "mode", "nearest")
    rows = int(x.shape[h])
    if size is not None:
        sizes = [size] * (x.dim() - 2) if isinstance(size, int) else list(size)
        target = sizes[h - 2] if h >= 2 and len(sizes) > h - 2 else None
        if target is None or target == rows or (mode in ("nearest", "nearest-exact") and rows and target % rows == 0):
            return None
        return (f"resizes {a.name} from this rank's {rows} {a.unit} to {target} ({mode}; a size computed from a "
                "shard); use "
                f"nn.Upsample in the model (converted to halo.nn.DomainUpsample) or halo.nn.halo_interpolate")
    if scale is not None:
        scales = [scale] * (x.dim() - 2) if isinstance(scale, (int, float)) else list(scale)
        s = scales[h - 2] if h >= 2 and len(scales) > h - 2 else 1
        if s == 1 or (mode in ("nearest", "nearest-exact") and float(s).is_integer() and s > 1):
            return None
        return (f"resizes {a.name} by {s} ({mode}) on a shard (the {a.unit} at the shard's edges need its "
                "neighbours'); use "
                f"nn.Upsample in the model (converted exactly) or halo.nn.halo_interpolate")
    return None


def whole_interpolate_rule(args, kwargs, x, h, a):
    """A map whole on every rank (a global pool's k x k result) resized: right only if H keeps its rows (a size
    from a shard would resize the whole map to one rank's rows)."""
    size = get_arg(args, kwargs, 1, "size")
    scale = get_arg(args, kwargs, 2, "scale_factor")
    rows = int(x.shape[h])
    if size is not None:
        target = size if isinstance(size, int) else list(size)[h - 2]
    elif scale is not None:
        target = rows * (scale if isinstance(scale, (int, float)) else list(scale)[h - 2])
    else:
        return None
    if target == rows:
        return None
    return (f"resizes a {rows}-row map that is whole on every rank (a global pool's result) to {target} {a.unit}: a "
            f"size taken from a shard would stretch the whole map over one rank's {a.unit}; resize it to the global "
            f"size and keep this rank's {a.unit} (gather, or halo.shard of the resized map), or pool to 1 row")


def _entry(v: Any, a: Axis) -> Any:
    """``v``'s entry for the axis being checked (an int or a string applies to every axis)."""
    if v is None or isinstance(v, (int, str)):
        return v
    v = list(v)
    return v[a.index] if len(v) >= 2 else v[0]


def _window(args, kwargs, x, h, a, kernel_at, stride_at, padding_at, what):
    """A conv or pool: refuse unless its window, stride and padding along H are 1, 1, 0."""
    def along_h(v, default):
        return default if v is None else _entry(v, a)

    k = kernel_at(args, kwargs)
    s = along_h(stride_at(args, kwargs), None)
    p = along_h(padding_at(args, kwargs), 0)
    if s is None:
        s = k
    if k != 1 or s != 1 or p not in (0, "valid", "same"):
        return (f"{what} with kernel {k}, stride {s}, padding {p} along {a.name} on a shard (its edge {a.unit} need a "
                f"neighbour's); use the module (nn.Conv2d / nn.MaxPool2d / ..., converted to its halo layer)")
    return None


def _conv(args, kwargs, x, h, a):
    weight = get_arg(args, kwargs, 1, "weight")
    return _window(args, kwargs, x, h, a, lambda g, k: int(weight.shape[a.index]),
                   lambda g, k: get_arg(g, k, 3, "stride", 1), lambda g, k: get_arg(g, k, 4, "padding", 0),
                   "a convolution")


def _conv1d(args, kwargs, x, h, a):
    """``F.conv1d`` of ``(B, C, L)``: over tokens (the axis merged with the dims after it by ``flatten(2)``, at the
    last dim) a kernel of 1 (stride 1, padding 0, dilation 1) acts on each token alone: it passes; a wider window
    reads the tokens of the next rows, on the neighbour's shard. The axis at dim 1 is contracted with the channels."""
    weight = get_arg(args, kwargs, 1, "weight")

    def one(v: Any, default: Any) -> Any:
        v = default if v is None else v
        return v if isinstance(v, (int, str)) else list(v)[0]

    if h != x.dim() - 1:
        return (f"a 1-d convolution whose channels hold {a.name} (the sharded dim): it contracts them, so each rank "
                f"would sum only over its own {a.unit}; gather first ({a.gather})")
    k, s = int(weight.shape[-1]), one(get_arg(args, kwargs, 3, "stride"), 1)
    p, d = one(get_arg(args, kwargs, 4, "padding"), 0), one(get_arg(args, kwargs, 5, "dilation"), 1)
    if k == 1 and s == 1 and d == 1 and p in (0, "valid", "same"):
        return None
    return (f"a 1-d convolution with kernel {k}, stride {s}, padding {p}, dilation {d} over flattened tokens "
            f"({a.name} merged with the dims after it): a window over flattened tokens runs from the end of one of "
            f"{a.name}'s {a.unit} into the next, and at a shard's edges into a neighbour's; use a kernel of 1 "
            f"(pointwise over tokens), or a 2-d convolution on the (B, C, H, W) field (nn.Conv2d, converted)")


def _conv_t(args, kwargs, x, h, a):
    weight = get_arg(args, kwargs, 1, "weight")
    k = int(weight.shape[a.index])
    unit = get_arg(args, kwargs, 3, "stride", 1) in (1, (1, 1), [1, 1], (1, 1, 1), [1, 1, 1])
    # (the way out, the module to use, is the registry's: halo.guard.with_twin_hint)
    return f"a transposed convolution (kernel {k} along {a.name}) on a shard" if k != 1 or not unit else None


def _pool(args, kwargs, x, h, a):
    return _window(args, kwargs, x, h, a, lambda g, k: _entry(get_arg(g, k, 1, "kernel_size"), a),
                   lambda g, k: get_arg(g, k, 2, "stride"), lambda g, k: get_arg(g, k, 3, "padding", 0), "a pool")


def _lp_pool(args, kwargs, x, h, a):
    """``F.lp_pool2d(input, norm_type, kernel_size, stride)``: its window is its third argument (no padding)."""
    return _window(args, kwargs, x, h, a, lambda g, k: _entry(get_arg(g, k, 2, "kernel_size"), a),
                   lambda g, k: get_arg(g, k, 3, "stride"), lambda g, k: 0, "a pool")


def _adaptive1d(args, kwargs, x, h, a):
    """``adaptive_avg_pool1d`` of ``(B, C, L)``: it pools the last dim only (the axis elsewhere is left alone)."""
    return _adaptive(args, kwargs, x, h, a) if h == x.dim() - 1 else None


def _adaptive(args, kwargs, x, h, a):
    size = get_arg(args, kwargs, 1, "output_size")
    rows = _entry(size, a)
    if rows is not None and rows != x.shape[h]:
        return (f"an adaptive pool to {rows} {a.unit} along {a.name} on a shard; use nn.AdaptiveAvgPool2d / "
                "AdaptiveMaxPool2d "
                f"in the model (converted: exact, and whole on every rank for a global pool)")
    return None


def _always(message: str):
    """Refused whenever it is given a field (``message``: a template of the axis ``a``)."""
    return lambda args, kwargs, x, h, a: message.format(a=a)


def _roll(args, kwargs, x, h, a):
    dims = get_arg(args, kwargs, 2, "dims")
    if dims is None or h in (dims_arg(dims, x.dim()) or ()):
        return (f"rolls along {a.name} (or the flattened field) on a shard; roll along W only, or gather first "
                f"({a.gather})")
    return None


def _flip(args, kwargs, x, h, a):
    dims = get_arg(args, kwargs, 1, "dims")
    return f"flips {a.name} on a shard; gather first ({a.gather})" if h in (dims_arg(dims, x.dim()) or ()) else None


def _along(position: int, name: str, default: Any = 0, what: str = "splits or concatenates"):
    """An op along the dim at ``position`` (or keyword ``name``); ``None`` (``take_along_dim`` without a dim): of
    the flattened field, H included."""
    def rule(args, kwargs, x, h, a):
        d = get_arg(args, kwargs, position, name, default)
        if d is None or isinstance(d, int) and d % x.dim() == h:
            return (f"{what.format(a=a)} along {a.name} (the sharded dim) on a shard; do it along another dim, or "
                    "gather first")
        return None
    return rule


def _cat(args, kwargs, x, h, a):
    d = get_arg(args, kwargs, 1, "dim", 0)
    if isinstance(d, int) and d % x.dim() == h:
        return (f"concatenates along {a.name} (the sharded dim): each rank would stack its own {a.unit}; concatenate "
                "along "
                "channels, or gather first")
    tensors = get_arg(args, kwargs, 0, "tensors", ())
    rows = {int(t.shape[h]) for t in tensors if isinstance(t, torch.Tensor) and t.dim() == x.dim()}
    if len(rows) > 1:
        return (f"concatenates fields whose shards hold different numbers of {a.unit} here ({sorted(rows)}): they are "
                f"split differently (one was resized on its shard, e.g. a nearest upsampling of an unevenly split "
                f"field); resize with nn.Upsample in the model (its output is split like the others), or make {a.name} "
                f"divisible by the ranks at every level")
    return None


def _reduce(position: int = 1, name: str = "dim", default: Any = None):
    """A reduction (or sort) whose dim sits at ``position`` (``default`` when not given: ``None`` = all dims)."""
    def rule(args, kwargs, x, h, a):
        d = get_arg(args, kwargs, position, name, default)
        if isinstance(d, torch.Tensor):  # torch.max(a, b): elementwise
            return None
        dims = dims_arg(d, x.dim())
        if dims is None or h in dims:
            return (f"reduces over {a.name} (or over everything) on a shard: each rank would reduce only its own "
                    f"{a.unit}; use "
                    "halo.parallel.reduce (domain_sum, domain_mean, all_reduce), or a global pool module "
                    "(nn.AdaptiveAvgPool2d(1), whole on every rank)")
        return None
    rule.along = (position, name, default)  # the guard follows H through it (a dim removed before H shifts it)
    return rule


def _softmax(args, kwargs, x, h, a):
    d = get_arg(args, kwargs, 1, "dim")
    if d is None or d % x.dim() == h:
        return f"normalises over {a.name} on a shard; normalise over channels, or gather first"
    return None


def getitem_rule(args, kwargs, x, h, a):
    index = args[1] if len(args) > 1 else None
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 1 for i in items):
        return f"indexes with a mask that covers {a.name} on a shard; gather first"
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    pos = 0
    for i in items:
        if i is Ellipsis:
            pos += x.dim() - used
            continue
        if i is None:
            continue
        if pos == h and not (isinstance(i, slice) and i == slice(None)):
            return (f"indexes {a.name} (the sharded dim) with {i!r} on a shard: {a.unit} are numbered per rank; slice "
                    "other "
                    f"dims, or gather first")
        pos += 1
    return None


def split_differently(rows: list[int], a: Axis = H, made: list[bool] | None = None) -> str | None:
    """A pointwise op on fields whose shards hold different numbers of rows (more than one: a 1-row tensor
    broadcasts) along axis ``a`` combines rows of different latitudes (or columns of different longitudes).
    ``made``: per operand, whether it is a halo layer's field (:func:`halo.context.made`), whose 1 row is a row of
    a field split over the ranks (at least one each), never a tensor that broadcasts."""
    made = made if made is not None and len(made) == len(rows) else [False] * len(rows)
    many = sorted({r for r, m in zip(rows, made, strict=True) if r != 1 or m})
    if len(many) > 1:
        return (f"{a.prefix}combines fields whose shards hold different numbers of {a.unit} here ({many}): they are "
                f"split differently (one was resized on its shard, e.g. F.interpolate with a nearest upsampling of an "
                f"unevenly split field, or fields of different extents along {a.name}), so the {a.unit} it pairs are "
                f"not the same ones; resize with nn.Upsample in the model (its output is split like the others), or "
                f"make {a.name} divisible by the ranks at every level")
    return None


def global_extents(per_rank: list[list[int] | None], a: Axis = H) -> str:
    """What a refused pointwise op on fields adds when its operands' *global* extents along ``a`` differ (each
    operand's rows summed over the ranks; one of 1 row on every rank broadcasts and is left out): the unsharded
    model raises there too, so the model does not run at this input size, sharded or not; else ``""``."""
    if not per_rank or any(r is None for r in per_rank) or len({len(r) for r in per_rank}) != 1:
        return ""
    totals = [sum(col) for col in zip(*per_rank, strict=True) if any(v != 1 for v in col)]
    if len(set(totals)) < 2:
        return ""
    return (f"; its operands' global extents along {a.name} differ ({' vs '.join(map(str, sorted(set(totals))))} "
            f"{a.unit}), so the unsharded model raises here too: this input size does not fit the model (pick one "
            f"its down- and upsampling levels divide)")


def torch_raised(exc: Exception) -> str:
    """An op torch itself refused on this rank's shard (the others may not have: their shards differ), in words."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (f"torch raises on this rank's shard ({type(exc).__name__}: {first}); the other ranks' shards may pass, so "
            f"halo agrees on it first and every rank raises here (the unsharded model may raise here too)")


def row_masks(rows: list[int] | None) -> tuple[int, int]:
    """A pointwise op's operands on this rank as two bit masks (bit ``k``: operand ``k``): ``ones``, those with 1
    row; ``alike``, those with the rows of the result (every bit set for an op that is not pointwise on fields)."""
    if rows is None:
        return 0, -1
    out = max(rows[:62], default=1)
    ones = sum(1 << k for k, r in enumerate(rows[:62]) if r == 1)
    return ones, ~sum(1 << k for k, r in enumerate(rows[:62]) if r != out)


def broadcasts(per_rank: list[list[int] | None], a: Axis = H) -> str:
    """Why a pointwise op whose operand ``k`` has 1 row on some ranks only is refused (every rank alike): a tensor of
    1 row everywhere broadcasts (a bias, a ``(B, C, 1, 1)`` scale); one with the result's rows everywhere is split
    like it; one with 1 row on some ranks and more on others is a field whose shard of 1 row broadcasts over the
    other field's rows there (an unevenly split level of another extent): the unsharded model pairs no such rows.
    ``a``: the axis (H, or W on a latitude x longitude mesh)."""
    one = a.unit[:-1]
    shown = "; ".join(f"domain rank {r}: {rows}" for r, rows in enumerate(per_rank))
    return (f"{a.prefix}combines fields split differently: an operand has 1 {one} on some ranks and more on others, "
            f"so on those ranks its 1-{one} shard broadcasts over the other field's {a.unit} ({a.unit} of the "
            f"operands along {a.name}: {shown}); they are fields of different extents along {a.name} (the unsharded "
            f"op would not pair their {a.unit}); resize with nn.Upsample in the model (its output is split like the "
            f"others), or make {a.name} divisible by the ranks at every level")


def _dim_rule(position: int, name: str, default: Any, what: str):
    """An op along one dim (``default`` when not given; ``None``: all dims): refused when that dim is H."""
    def rule(args, kwargs, x, h, a):
        d = get_arg(args, kwargs, position, name, default)
        dims = dims_arg(d, x.dim())
        if dims is None or h in dims:
            return (f"{what.format(a=a)} along {a.name} (the sharded dim) on a shard: each rank would see only its own "
                    f"{a.unit}; gather first")
        return None
    return rule


def linear_rule(args, kwargs, x, h, a):
    if h == x.dim() - 1:
        return f"multiplies over {a.name} (the sharded dim is the last one, which F.linear contracts); gather first"
    return None


def _layer_norm(args, kwargs, x, h, a):
    shape = get_arg(args, kwargs, 1, "normalized_shape", ())
    k = 1 if isinstance(shape, int) else len(tuple(shape))
    if h >= x.dim() - k:
        return (f"normalises over the last {k} dims, which include {a.name} (the sharded dim), on a shard: each rank "
                "would "
                f"use its own {a.unit}' statistics; use nn.LayerNorm in the model (converted to "
                "halo.nn.DomainLayerNorm), "
                f"or normalise over channels only (channels-last, normalized_shape=(C,))")
    return None


def _group_norm(args, kwargs, x, h, a):
    if h >= 1:
        return (f"normalises each sample over its groups' channels and all of {a.name} x W (the sharded dim) on a "
                "shard: "
                f"each rank would use its own {a.unit}' statistics; use nn.GroupNorm in the model (converted to "
                "halo.nn.DomainGroupNorm)")
    return None


def _instance_norm(args, kwargs, x, h, a):
    if h >= 2 and get_arg(args, kwargs, 5, "use_input_stats", True):
        return (f"normalises over {a.name} x W (the sharded dim) on a shard: each rank would use its own {a.unit}' "
                "statistics; use nn.InstanceNorm2d in the model (converted to halo.nn.DomainInstanceNorm2d)")
    return None


def _batch_norm(args, kwargs, x, h, a):
    training = get_arg(args, kwargs, 5, "training", False)
    stats = get_arg(args, kwargs, 1, "running_mean") is None or get_arg(args, kwargs, 2, "running_var") is None
    if h != 1 and (training or stats):
        return (f"normalises with batch statistics over B x {a.name} x W (the sharded dim) on a shard: each rank "
                "would use "
                f"its own {a.unit}' statistics (and update the running stats with them); use nn.BatchNorm2d in the "
                "model (converted to halo.nn.DomainBatchNorm2d)")
    return None


def _dropout(args, kwargs, x, h, a):
    p = get_arg(args, kwargs, 1, "p", 0.5)
    training = get_arg(args, kwargs, 2, "training", get_arg(args, kwargs, 2, "train", True))
    if training and p:
        return (f"draws a random mask (p={p}) on each shard: each rank would draw its own numbers, unlike the "
                f"unsharded model's one draw; use halo.random.dropout / feature_dropout / alpha_dropout (draws "
                f"keyed on global {a.unit}) or an nn.Dropout module (converted)")
    return None


def _draws(args, kwargs, x, h, a):
    return ("draws random numbers shaped like a shard: each rank would draw its own, unlike the unsharded model's "
            f"one draw; use halo.random (draws keyed on global {a.unit})")


def _repeat(args, kwargs, x, h, a):
    sizes = args[1:] if len(args) > 1 and isinstance(args[1], int) else get_arg(args, kwargs, 1, "repeats",
                                                                              get_arg(args, kwargs, 1, "dims", ()))
    sizes = [int(s) for s in (sizes if isinstance(sizes, (list, tuple, torch.Size)) else (sizes,))]
    at = len(sizes) - x.dim() + h  # sizes align with the input's dims from the right
    if 0 <= at < len(sizes) and sizes[at] != 1:
        return f"repeats {a.name} (the sharded dim) {sizes[at]} times on a shard: each rank would tile its own {a.unit}"
    return None


def _repeat_interleave(args, kwargs, x, h, a):
    d = get_arg(args, kwargs, 2, "dim")
    if d is None or d % x.dim() == h:
        return (f"repeats {a.unit} of {a.name} (or of the flattened field) on a shard; do it along another dim, or "
                "gather first")
    return None


def _where(args, kwargs, x, h, a):
    if len(args) + len(kwargs) == 1:
        return f"finds the indices of a condition (torch.where(cond)): {a.unit} are numbered per rank; gather first"
    return None


_FFT_ONE = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
_FFT_TWO = ("fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2")
_FFT_N = ("fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn")


def _fft(default: Any, position: int = 2):
    def rule(args, kwargs, x, h, a):
        dims = dims_arg(get_arg(args, kwargs, position, "dim", default), x.dim())
        if dims is None or h in dims:
            return (f"transforms along {a.name} (the sharded dim) on a shard (a Fourier transform over all {a.unit}): "
                    "each rank "
                    f"would transform only its own {a.unit}; transform along W only, or gather first ({a.gather})")
        return None
    return rule


def merge_dims(x: torch.Tensor, h: int, rows: int, out: torch.Tensor) -> tuple[int | None, str | None]:
    """view / reshape / flatten: the output dim whose slowest part is the sharded rows (alone, merged with the dims
    after them as tokens, or split back out of such tokens), or why they cannot be followed."""
    shape_in, shape_out = [int(s) for s in x.shape], [int(s) for s in out.shape]
    before = 1
    for s in shape_in[:h]:
        before *= s
    acc = 1
    for j, s in enumerate(shape_out):
        if acc == before:
            if s == 1 and rows != 1:  # a size-1 dim before H's block
                continue
            if rows == 0:  # an empty shard (a rank holding none of the rows): H is the empty dim
                return (j, None) if s == 0 else (None, "reshapes H (the sharded dim) in a way halo cannot follow "
                                                       "on an empty shard; keep H as a dim of its own")
            if s % rows == 0:  # H alone, H merged with the dims after it (tokens), or tokens split back to (h, W)
                return j, None
            return None, "splits the sharded rows of H across dims: each rank's rows would be re-cut; keep H whole"
        if acc < before < acc * s:
            return None, ("merges H (the sharded dim) with an earlier dim (e.g. flatten(1), view(B, -1)): the merged "
                          "dim mixes every rank's rows; keep H (or merge it with W only: flatten(2))")
        acc *= s
    return None, "reshapes H (the sharded dim) in a way halo cannot follow; keep H as a dim of its own"


def merge_fastest(x: torch.Tensor, w: int, cols: int, out: torch.Tensor) -> tuple[int | None, str | None]:
    """view / reshape / flatten, followed for W (the fastest part of the dim that holds it: alone, or merged after
    the dims before it, as ``flatten(2)`` makes tokens): the output dim that ends with its columns, or why not."""
    shape_in, shape_out = [int(s) for s in x.shape], [int(s) for s in out.shape]
    after = 1
    for s in shape_in[w + 1:]:
        after *= s
    acc = 1
    for j in range(len(shape_out) - 1, -1, -1):
        s = shape_out[j]
        if acc == after:
            if s == 1 and cols != 1:  # a size-1 dim after W's block
                continue
            if cols == 0:  # an empty shard: W is the empty dim
                return (j, None) if s == 0 else (None, "reshapes W (the sharded dim) in a way halo cannot follow "
                                                       "on an empty shard; keep W as a dim of its own")
            if s % cols == 0:
                return j, None
            return None, ("splits the sharded columns of W across dims: each rank's columns would be re-cut; keep W "
                          "whole")
        if acc > after:
            break
        acc *= s
    return None, ("merges W (a sharded dim on a latitude x longitude mesh) with a later dim: the merged dim mixes "
                  "every rank's columns; keep W the last of the dims it is merged with")


# -- the one table ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Policy:
    """What the guard does with one torch function (or tensor method) given a field.

    ``kind``: ``"pass"`` (by its name alone), ``"follow"`` (a layout op: the guard follows the axis through it,
    refusing what it cannot follow), ``"exact"`` (computed exactly over the domain where the rule finds it acts on
    the axis: ``how`` says which form, ``exact`` is the layer tier's functional that computes it), ``"refuse"``
    (refused where the rule finds it acts on the axis, passed where it leaves it alone). ``rule(args, kwargs, x, h,
    a)``: a pure function of the call and the axis ``a`` (never communicates) giving what is wrong on a shard, the
    way out included, or ``None``; ``check``: the guard's method for ops whose operands' axes decide (matmul,
    einsum, attention); ``after``: how the guard follows the axis to the result (``"layout"``, ``"stack"``,
    ``"index"``, ``"reduce"``, ``"einsum"``, ``"sdpa"``); ``sizes``: it reads a field's size (a size taken from a
    shard may name that field)."""

    kind: str
    rule: Callable | None = None
    check: str | None = None
    after: str | None = None
    how: str | None = None
    exact: Callable | None = None
    sizes: bool = False

    def problem(self, args: tuple, kwargs: dict, x: Any, h: int, a: Axis = H) -> str | None:
        """The rule's verdict on axis ``a`` at dim ``h`` of ``x`` (worded for it), or ``None``."""
        if self.rule is None:
            return None
        found = self.rule(args, kwargs, x, h, a)
        return None if found is None else a.prefix + found


#: torch function -> :class:`Policy`. Default deny: a function not here given a field from user code is refused,
#: naming it.
POLICY: dict[Any, Policy] = {}


def _add(funcs: Any, policy: Policy) -> None:
    for f in funcs:
        if f is not None:
            POLICY[f] = policy


def _refuse(funcs: Any, rule: Callable) -> None:
    _add(funcs, Policy("refuse", rule, after="reduce" if getattr(rule, "along", None) else None))


def policy(func: Any) -> Policy | None:
    """The policy of ``func`` (``None``: unclassified, refused on a field)."""
    return POLICY.get(func)


T = torch.Tensor
def _funcs(names: str, *spaces: Any, inplace: bool = False) -> set:
    """The functions called ``names`` (space separated) in each namespace that has them (and ``name_``)."""
    found = set()
    for name in names.split():
        for space in spaces:
            for n in (name, name + "_") if inplace else (name,):
                f = getattr(space, n, None)
                # (not a dtype, a submodule or a method of the namespace module itself: torch.bool, torch.cpu,
                # torch.__repr__ are no torch functions, and would be table entries no call ever reaches)
                if f is not None and callable(f) and not isinstance(f, type(torch)) \
                        and getattr(f, "__self__", None) is not space:
                    found.add(f)
    return found


#: The ops that pass on a field by their name alone (default deny: everything else that is given a field and has no
#: rule above is refused). Each acts on every point independently, or reads only metadata, or makes a tensor of the
#: field's shape. In groups; an op goes here only if it is pointwise in every dim a rank may shard.
_ELEMENTWISE = _funcs(
    "abs absolute neg negative positive sign sgn signbit add sub subtract rsub mul multiply div divide true_divide "
    "floor_divide remainder fmod pow float_power reciprocal rsqrt sqrt square exp exp2 expm1 log log2 log10 log1p "
    "logaddexp logaddexp2 sin cos tan asin acos atan atan2 arcsin arccos arctan arctan2 sinh cosh tanh asinh acosh "
    "atanh arcsinh arccosh arctanh sinc hypot lerp addcmul addcdiv clamp clip clamp_min clamp_max maximum minimum "
    "fmax fmin floor ceil round trunc fix frac copysign nextafter ldexp xlogy erf erfc erfinv lgamma digamma "
    "polygamma mvlgamma i0 sigmoid logit nan_to_num heaviside gcd lcm deg2rad rad2deg angle conj conj_physical "
    "resolve_conj resolve_neg bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift "
    "bitwise_right_shift logical_and logical_or logical_not logical_xor masked_fill complex polar frexp",
    torch, T, inplace=True) | _funcs(
    "expit logit erf erfc erfinv erfcx gammaln digamma psi polygamma multigammaln i0 i0e i1 i1e ndtr ndtri "
    "log_ndtr sinc entr xlogy xlog1py exp2 expm1 log1p round", torch.special)
_COMPARISONS = _funcs(
    "eq ne lt le gt ge greater less greater_equal less_equal not_equal isnan isinf isfinite isposinf isneginf isreal "
    "isclose", torch, T, inplace=True)
_ACTIVATIONS = _funcs(
    "relu relu6 elu selu celu gelu silu mish hardswish hardsigmoid hardtanh leaky_relu logsigmoid softplus "
    "softshrink hardshrink tanhshrink softsign threshold sigmoid tanh prelu", F, torch, T, inplace=True)
_DUNDERS = _funcs(
    "__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ "
    "__itruediv__ __div__ __rdiv__ __idiv__ __floordiv__ __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__ "
    "__pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__ __invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__ "
    "__xor__ __rxor__ __ixor__ __lshift__ __rlshift__ __ilshift__ __rshift__ __rrshift__ __irshift__ __eq__ __ne__ "
    "__lt__ __le__ __gt__ __ge__", T)
#: Casts, copies and metadata: the same values (or none), the same shape.
_METADATA = _funcs(
    "to type type_as float double half bfloat16 int long bool short char byte cfloat cdouble cpu cuda contiguous "
    "clone detach detach_ requires_grad_ retain_grad size dim ndimension numel nelement stride storage_offset "
    "is_contiguous is_floating_point is_complex is_signed element_size data_ptr get_device register_hook "
    "untyped_storage pin_memory is_pinned dim_order __len__ __repr__ __format__ __bool__ __float__ __int__ "
    "__index__ __hash__ item __deepcopy__ __reduce_ex__ __setstate__ copy_ fill_ zero_ expand expand_as broadcast_to "
    "new_zeros new_ones new_empty new_full new_tensor zeros_like ones_like empty_like full_like as_tensor asarray",
    torch, T)
_GETTERS = {getattr(T, name).__get__ for name in (
    "shape dtype device ndim requires_grad is_cuda is_cpu is_mps is_xpu is_meta is_sparse is_quantized is_nested "
    "is_mkldnn grad grad_fn data layout names is_leaf output_nr _version itemsize nbytes retains_grad real imag "
    "_base").split() if hasattr(T, name) and hasattr(getattr(T, name), "__get__")}
_add(_ELEMENTWISE | _COMPARISONS | _ACTIVATIONS | _DUNDERS | _METADATA | _GETTERS, Policy("pass"))
_add([T.shape.__get__, T.size], Policy("pass", sizes=True))  # a size read by user code: what a size from a shard names
_add([torch.permute, T.permute, torch.transpose, T.transpose, torch.movedim, T.movedim, torch.swapaxes, T.swapaxes,
      torch.swapdims, T.swapdims, torch.unsqueeze, T.unsqueeze, torch.squeeze, T.squeeze, T.mT.__get__, T.view,
      T.reshape, torch.reshape, torch.flatten, T.flatten, T.view_as, T.reshape_as, T.unflatten, torch.unflatten],
     Policy("follow", after="layout"))
_add([torch.stack], Policy("follow", after="stack"))
_add([torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.bmm, T.bmm],
     Policy("exact", check="_matmul", how="contract", exact=all_reduce))  # (contracting H: a domain sum, below)
_add([torch.baddbmm, T.baddbmm], Policy("refuse", check="_baddbmm"))
_add([torch.einsum], Policy("follow", check="_einsum", after="einsum"))
_add([F.scaled_dot_product_attention],  # over a field's tokens: ring attention (halo.nn.ring.ring_sdpa)
     Policy("exact", check="_sdpa", after="sdpa", how="attention", exact=ring_sdpa))
_refuse([F.pad, torch.ops.aten.constant_pad_nd], _pad)
_refuse([F.upsample_bilinear, F.upsample_nearest], interpolate_rule)
_refuse([F.conv2d, torch.conv2d, F.conv3d, torch.conv3d], _conv)
_refuse([F.conv1d, torch.conv1d], _conv1d)
_refuse([F.conv_transpose2d, torch.conv_transpose2d, F.conv_transpose3d, torch.conv_transpose3d], _conv_t)
# a functional max / average pool with a window along H: the halo layer of the nn module the call describes
# (halo.guard.reroute.Pool); with return_indices, refused (the rule)
_add([F.max_pool2d, F.avg_pool2d, torch.max_pool2d, F.max_pool3d, F.avg_pool3d, torch.max_pool3d],
     Policy("exact", _pool, how="pool", exact=halo_pool))
_refuse([getattr(torch, "avg_pool2d", None), getattr(F, "max_pool2d_with_indices", None),
         getattr(F, "max_pool3d_with_indices", None)], _pool)
_refuse([F.lp_pool2d], _lp_pool)
# (3-d pools of (B, C, D, H, W) fields: the window along H, the middle of a (D, H, W) triple, decides, as in 2-d)
_refuse([F.adaptive_avg_pool2d, F.adaptive_max_pool2d], _adaptive)
_refuse([torch.adaptive_avg_pool1d], _adaptive1d)
_refuse([F.pixel_shuffle, torch.pixel_shuffle, F.pixel_unshuffle, torch.pixel_unshuffle],
          _always("rearranges {a.unit} across {a.name} (pixel shuffle) on a shard"))  # (the way out: the registry)
_refuse([F.unfold, F.fold], _always("unfolds windows that cross the shard's edge {a.unit}; gather first"))
_refuse([F.grid_sample], _always("samples the field at arbitrary {a.unit} on a shard; gather first"))
_refuse([torch.roll, T.roll], _roll)
_refuse([torch.flip, T.flip], _flip)
_refuse([torch.flipud, T.flipud], lambda args, kwargs, x, h, a: "flips dim 0" if h == 0 else None)
_refuse([torch.fliplr, T.fliplr], lambda args, kwargs, x, h, a: "flips dim 1" if h == 1 else None)
_refuse([torch.cat, torch.concat, torch.concatenate], _cat)
_refuse([torch.split, T.split, torch.chunk, T.chunk, torch.tensor_split, T.tensor_split],
          _along(2, "dim", 0, "splits"))
_refuse([torch.unbind, T.unbind], _along(1, "dim", 0, "unbinds"))
_refuse([torch.narrow, T.narrow, torch.select, T.select, torch.index_select, T.index_select,
           torch.gather, T.gather],
          _along(1, "dim", None, "selects {a.unit}"))
_refuse([torch.take_along_dim, T.take_along_dim], _along(2, "dim", None, "selects {a.unit}"))  # (input, indices, dim)
_add([T.__getitem__], Policy("follow", getitem_rule, after="index"))
_refuse([torch.sum, T.sum, torch.mean, T.mean, torch.nansum, T.nansum, torch.nanmean, T.nanmean, torch.prod,
           T.prod, torch.amax, T.amax, torch.amin, T.amin, torch.max, T.max, torch.min, T.min, torch.std, T.std,
           torch.var, T.var, torch.std_mean, torch.var_mean, torch.logsumexp, T.logsumexp, torch.argmax, T.argmax,
           torch.argmin, T.argmin, torch.median, T.median, torch.all, T.all, torch.any, T.any, torch.count_nonzero,
           T.count_nonzero, torch.cumsum, T.cumsum, torch.cumprod, T.cumprod], _reduce())
_add([torch.norm, T.norm, torch.linalg.vector_norm, torch.linalg.norm],  # (input, p / ord, dim)
     Policy("exact", _reduce(2, "dim"), after="reduce", how="vector_norm", exact=domain_vector_norm))
_refuse([torch.sort, T.sort, torch.argsort, T.argsort], _reduce(1, "dim", -1))
_refuse([torch.topk, T.topk, torch.kthvalue, T.kthvalue], _reduce(2, "dim", -1))  # (input, k, dim=-1)
_refuse([F.softmax, F.log_softmax, T.softmax, T.log_softmax, torch.softmax, torch.log_softmax], _softmax)

_refuse([F.softmin], _softmax)
_refuse([F.linear], linear_rule)
_refuse([getattr(F, "rms_norm", None)], _layer_norm)
_refuse([F.normalize], _dim_rule(2, "dim", 1, "normalises"))
_refuse([F.glu], _dim_rule(1, "dim", -1, "splits and gates"))
_refuse([F.cosine_similarity], _dim_rule(2, "dim", 1, "compares vectors"))
_refuse([torch.diff, T.diff], _dim_rule(2, "dim", -1, "differences neighbouring {a.unit}"))
_refuse([torch.cummax, T.cummax, torch.cummin, T.cummin, torch.logcumsumexp, T.logcumsumexp, torch.nanmedian,
           T.nanmedian, torch.mode, T.mode, torch.aminmax, T.aminmax], _reduce())
_refuse([torch.quantile, T.quantile, torch.nanquantile, T.nanquantile], _reduce(2, "dim"))
# F.dropout of a whole tensor (a global pool's or a mean over H's own result): drawn whole (halo.guard.reroute);
# of a field, refused (the rule)
_add([F.dropout], Policy("exact", _dropout, how="dropout", exact=random_dropout))  # (whole=True)
_refuse([F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout,
           torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout], _dropout)
_refuse([torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli, T.bernoulli, T.bernoulli_,
           T.uniform_, T.normal_, T.exponential_, T.geometric_, T.cauchy_, T.log_normal_, T.random_,
           torch.normal, torch.poisson, torch.multinomial, T.multinomial], _draws)
_refuse([T.repeat, torch.tile, T.tile], _repeat)
_refuse([torch.repeat_interleave, T.repeat_interleave], _repeat_interleave)
_refuse([torch.where, T.where], _where)
_refuse([getattr(torch.fft, n) for n in _FFT_ONE], _fft(-1))
_refuse([getattr(torch.fft, n) for n in _FFT_TWO], _fft((-2, -1)))
_refuse([getattr(torch.fft, n) for n in _FFT_N], _fft(None))
_refuse([torch.fft.fftshift, torch.fft.ifftshift], _fft(None, 1))
_refuse([T.__setitem__], getitem_rule)  # x[idx] = v: the same rule as x[idx]
_refuse([T.__iter__], lambda args, kwargs, x, h, a: f"iterates over {a.name} (dim 0) on a shard" if h == 0 else None)

_add([F.group_norm], Policy("exact", _group_norm, how="norm", exact=domain_var_mean))
_add([F.instance_norm], Policy("exact", _instance_norm, how="norm", exact=domain_var_mean))
_add([F.batch_norm], Policy("exact", _batch_norm, how="norm", exact=domain_var_mean))
_add([F.layer_norm], Policy("exact", _layer_norm, how="norm", exact=domain_var_mean))
_add([torch.mean, T.mean], Policy("exact", _reduce(), after="reduce", how="mean", exact=all_reduce))
_add([torch.sum, T.sum], Policy("exact", _reduce(), after="reduce", how="sum", exact=all_reduce))
_add([F.softmax, F.log_softmax, T.softmax, T.log_softmax, torch.softmax, torch.log_softmax],
     Policy("exact", _softmax, how="softmax", exact=domain_softmax))
_add([F.interpolate, F.upsample], Policy("exact", interpolate_rule, how="interpolate", exact=halo_interpolate))
