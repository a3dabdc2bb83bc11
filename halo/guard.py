"""The guard on spatial ops that a converted model's ``forward`` calls itself (not through a module).

The converter replaces modules; code in a ``forward`` (``F.pad(x1, [.., diffY // 2, diffY - diffY // 2])`` sized
from the *local* shapes, ``F.interpolate``, slicing or a mean over H) runs on the shard as written, and is silently
wrong. While a converted model learns its plans (its first call for each input shape: ``halo.plans``), a
``TorchFunctionMode`` watches every torch function called from user code (calls from torch's or halo's own code
are not checked) and refuses, on every rank, the ops that would act on the sharded dim H of a field:

=====================================================  ===========================================================
op (function or tensor method)                         refused when
=====================================================  ===========================================================
``F.pad``                                              it pads H (any mode): the amounts are local
``F.interpolate`` / ``upsample*``                      it resizes H in a form halo cannot compute (below): a size
                                                       from a shard that is no field's rows, antialias, a mode
                                                       ``halo_interpolate`` lacks, not ``(B, C, H, W)``
``F.conv2d``, ``conv_transpose2d``, pools, ``unfold``  its window, stride or padding along H is not 1 / 1 / 0
``adaptive_*_pool2d``, ``pixel_(un)shuffle``,          they change or mix H
``grid_sample``
``torch.roll``, ``flip``                               along H
``cat``, ``split``, ``chunk``, ``narrow``, indexing,   along H (a slice of H that is not the whole of it); a
                                                       ``cat`` of fields split differently (rows differ)
``index_select``, ``select``, ``unbind``, ...
reductions (``sum``, ``max``, ``std``, ``softmax``,    over H, or over everything (``mean``: computed, below)
``cumsum``, ``sort``, ...)
``view`` / ``reshape`` / ``flatten``                   H is merged with an earlier dim (with later ones, as
                                                       ``flatten(2)`` makes tokens, it is tracked)
``matmul`` / ``@`` / ``bmm``                           H is contracted or becomes a second token dim (attention)
``F.layer_norm`` / ``rms_norm``                        ``normalized_shape`` covers H, with a weight or bias
                                                       (``rms_norm``: always)
``F.group_norm``, ``instance_norm``, ``batch_norm``    their statistics include H and their input does not hold H
                                                       at dim -2 (batch norm in eval: per channel, passes)
``F.normalize``, ``glu``, ``cosine_similarity``,       along H
``diff``, ``cummax``, ``logcumsumexp``, ...
``einsum``                                             H is contracted, or two fields' H become two dims
``torch.fft.*``                                        H is among the transformed dims
``F.scaled_dot_product_attention``, ``baddbmm``        H is a token dim (attention over all tokens)
``F.linear``                                           H is the last dim (contracted)
``F.dropout`` and friends, ``rand_like``, ...          they draw (training, p > 0): each shard would draw its own
``repeat``, ``tile``, ``repeat_interleave``            they repeat H
a pointwise op on two fields or more                   their shards hold different numbers of rows (split
                                                       differently), or one has 1 row on some ranks and more on
                                                       others (its 1-row shard broadcasts over a field's rows; a
                                                       tensor of 1 row on every rank broadcasts, as a bias)
*anything else*                                        always (default deny: an op halo has not classified)
=====================================================  ===========================================================

An op that torch itself refuses on one rank's shard (the others' pass) is agreed on like a refusal: every rank
raises at that op, none is left waiting in the next layer's exchange.

**Computed exactly instead** (:mod:`halo.reroute`), where the rule above finds the op acts on H of a
``(B, C, ..., H, W)`` field, outside forward hooks and on latitude rows (on a latitude x longitude mesh they stay
refused):

=====================================================  ===========================================================
op                                                     computed as
=====================================================  ===========================================================
``F.group_norm``, ``F.instance_norm`` (input stats),   statistics over the whole domain; running stats updated as
``F.batch_norm`` (training or no running stats),       torch updates them; ``layer_norm``: no weight or bias
``F.layer_norm`` over (..., H, W)
``mean`` / ``Tensor.mean`` over dims with H            the global mean, whole on every rank (a halo layer given it
                                                       is refused: it would take it for a shard)
``F.interpolate(size=S)``, ``S[0]`` a field's rows     ``halo_interpolate`` to that field's global rows (a whole
                                                       map: resized to them, this rank's rows kept)
``F.interpolate(scale_factor=s)``                      ``halo_interpolate``; a nearest whole-number scale passes as
                                                       it is where the shards' result is split like the global one
=====================================================  ===========================================================

The guard records each such call's site (module, line, ordinal) under the model's epoch; later calls of that epoch
compute exactly the recorded sites (a small ``TorchFunctionMode`` over those modules' forward only), so they stay
exact after the first call, at no agreement.

**Default deny.** An op given a field passes only when halo knows what it does to H: it acts on each point (the
explicit, grouped allowlist ``_PASS``: elementwise math, activations, comparisons, casts, metadata such as
``.shape`` / ``.size()`` / ``.dtype``, in-place pointwise ops, ``torch.where``), halo follows H through it (the
layout ops), or a rule above reads its arguments and finds that it leaves H alone. Every other torch function
called on a field from user code is refused, naming it; an op torch adds tomorrow is refused until it is classified
here. The guard is off where nothing is sharded (one domain rank).

**Hooks.** Code in a module's forward hook or pre-hook (monitoring: ``(o != 0).float().mean()``) is not refused
where it stands: what an op the guard would refuse computes there is marked, and refused (naming that op and line)
as soon as it flows into the model's computation: an op of the model outside the hook uses it, the hook changed a
model tensor with it in place, or it is the model's output.

H is dim -2 of a field of 3 or more dims, followed through ``permute``/``transpose``/``movedim``, ``(un)squeeze``
and ``view``/``flatten`` (channels-last blocks, tokens). Tensors that are whole on every rank (after a global
pool) are not fields. A refusal raises ``ValueError`` on every rank at the same op, naming the op, the module
whose forward called it, the line of user code and the way out (a halo layer or module that does it exactly). Every
checked op is agreed on by the ranks (one small host all-gather), only during those first calls: afterwards the
model runs without the guard, at no cost but for the modules with sites computed exactly (above). An allowlisted op
on one field passes by its name alone, with no agreement; on two fields or more it is agreed on (are they split
alike).
What it cannot see :func:`halo.check_equivalence` catches by comparing with the unsharded model: a custom autograd
Function's insides, numpy, ops run under ``torch._C.DisableTorchFunction``, and above all *values derived from a
shard's shape*: ``torch.linspace(-1, 1, x.shape[-2])`` or ``torch.arange(h)`` builds coordinates from this rank's
row count, and a function mode sees only the ints it is given (a tensor made from them is not a field; later
arithmetic with fields is pointwise), so such code runs, per rank, silently wrong; a shape decision taken before
the first call, likewise. Code the
guard takes for a field by mistake (a tensor of 3 or more dims made in ``forward`` rather than derived from the
input) can be marked ``with halo.guard.trusted():``.
"""

from __future__ import annotations

import linecache
import os
import re
import string
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import reroute
from .comm import CommGroup, all_gather_object, gather_words
from .plans import TensorMap, use_guard, whole_source
from .reroute import user_frame as _user_frame

__all__ = ["SpatialGuard", "place", "trusted"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_AGREE = 0x47554152  # "GUAR"


def _field(t: Any, dims: TensorMap) -> tuple[int, int] | None:
    """``(dim, rows)``: where ``t`` holds the sharded rows and how many (``dim`` may hold more: rows x the dims
    merged after them, as tokens), or ``None``: not a field, or whole on every rank."""
    if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
        return None
    tracked = dims.get(t)
    if tracked is not None:
        return None if tracked[0] < 0 else tracked
    if whole_source(t) is not None or t.dim() < 3:
        return None
    return t.dim() - 2, int(t.shape[-2])


def _hdim(t: Any, dims: TensorMap) -> int | None:
    """The sharded dim of ``t`` (``None``: not a field, or whole on every rank)."""
    f = _field(t, dims)
    return None if f is None else f[0]


def _dims_arg(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """``dim`` as a tuple of non-negative dims (``None``: all dims)."""
    if dim is None:
        return None
    if isinstance(dim, (list, tuple)):
        return tuple(d % ndim for d in dim) if dim else None
    return (dim % ndim,)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


# -- the rules: (args, kwargs, h) -> a description of what is wrong, or None ---------------------------------------

def _pad(args, kwargs, x, h):
    pad = list(_arg(args, kwargs, 1, "pad", ()))
    k = x.dim() - 1 - h  # pairs run from the last dim backwards
    if len(pad) >= 2 * k + 2 and (pad[2 * k] or pad[2 * k + 1]):
        return (f"pads H (the sharded dim) by ({pad[2 * k]}, {pad[2 * k + 1]}) rows on a shard: every rank pads its "
                f"own edge rows, so inner shards get padding where their neighbours' rows belong (and amounts taken "
                f"from a shard's size differ by rank); to pad one tensor to another's size (a U-Net's skip) use "
                f"halo.nn.pad_like(x, ref) (the same centred pad, from the global sizes); for a fixed pad use a "
                f"padding module (nn.ZeroPad2d, converted to halo.nn.HaloPad2d)")
    return None


def _interpolate(args, kwargs, x, h):
    """Refused unless H keeps its rows, or each row is repeated a whole number of times (nearest): that is exact on
    a shard (its output rows are the global output's, split as the input was)."""
    size = _arg(args, kwargs, 1, "size")
    scale = _arg(args, kwargs, 2, "scale_factor")
    mode = _arg(args, kwargs, 3, "mode", "nearest")
    rows = int(x.shape[h])
    if size is not None:
        sizes = [size] * (x.dim() - 2) if isinstance(size, int) else list(size)
        target = sizes[h - 2] if h >= 2 and len(sizes) > h - 2 else None
        if target is None or target == rows or (mode in ("nearest", "nearest-exact") and rows and target % rows == 0):
            return None
        return (f"resizes H from this rank's {rows} rows to {target} ({mode}; a size computed from a shard); use "
                f"nn.Upsample in the model (converted to halo.nn.HaloUpsample) or halo.nn.halo_interpolate")
    if scale is not None:
        scales = [scale] * (x.dim() - 2) if isinstance(scale, (int, float)) else list(scale)
        s = scales[h - 2] if h >= 2 and len(scales) > h - 2 else 1
        if s == 1 or (mode in ("nearest", "nearest-exact") and float(s).is_integer() and s > 1):
            return None
        return (f"resizes H by {s} ({mode}) on a shard (the rows at the shard's edges need its neighbours'); use "
                f"nn.Upsample in the model (converted exactly) or halo.nn.halo_interpolate")
    return None


def _whole_interpolate(args, kwargs, x, h):
    """A map whole on every rank (a global pool's k x k result) resized: right only if H keeps its rows (a size
    from a shard would resize the whole map to one rank's rows)."""
    size = _arg(args, kwargs, 1, "size")
    scale = _arg(args, kwargs, 2, "scale_factor")
    rows = int(x.shape[h])
    if size is not None:
        target = size if isinstance(size, int) else list(size)[h - 2]
    elif scale is not None:
        target = rows * (scale if isinstance(scale, (int, float)) else list(scale)[h - 2])
    else:
        return None
    if target == rows:
        return None
    return (f"resizes a {rows}-row map that is whole on every rank (a global pool's result) to {target} rows: a "
            f"size taken from a shard would stretch the whole map over one rank's rows; resize it to the global "
            f"size and keep this rank's rows (gather, or halo.shard of the resized map), or pool to 1 row")


#: Which entry of a kernel / stride / padding / size the window rules read: -2 (H), or -1 while W is checked (a
#: latitude x longitude mesh shards W too).
_AXIS = [-2]


def _entry(v: Any) -> Any:
    """``v``'s entry for the axis being checked (an int or a string applies to every axis)."""
    if v is None or isinstance(v, (int, str)):
        return v
    v = list(v)
    return v[_AXIS[0]] if len(v) >= 2 else v[0]


def _window(args, kwargs, x, h, kernel_at, stride_at, padding_at, what):
    """A conv or pool: refuse unless its window, stride and padding along H are 1, 1, 0."""
    def along_h(v, default):
        return default if v is None else _entry(v)

    k = kernel_at(args, kwargs)
    s = along_h(stride_at(args, kwargs), None)
    p = along_h(padding_at(args, kwargs), 0)
    if s is None:
        s = k
    if k != 1 or s != 1 or p not in (0, "valid", "same"):
        return (f"{what} with kernel {k}, stride {s}, padding {p} along H on a shard (its edge rows need a "
                f"neighbour's); use the module (nn.Conv2d / nn.MaxPool2d / ..., converted to its halo layer)")
    return None


def _conv(args, kwargs, x, h):
    weight = _arg(args, kwargs, 1, "weight")
    return _window(args, kwargs, x, h, lambda a, k: int(weight.shape[_AXIS[0]]),
                   lambda a, k: _arg(a, k, 3, "stride", 1), lambda a, k: _arg(a, k, 4, "padding", 0), "a convolution")


def _conv_t(args, kwargs, x, h):
    weight = _arg(args, kwargs, 1, "weight")
    k = int(weight.shape[_AXIS[0]])
    return (f"a transposed convolution (kernel {k} along H) on a shard; use nn.ConvTranspose2d in the model "
            f"(converted to halo.nn.HaloConvTranspose2d)") if k != 1 or _arg(args, kwargs, 3, "stride", 1) not in (
        1, (1, 1), [1, 1]) else None


def _pool(args, kwargs, x, h):
    return _window(args, kwargs, x, h, lambda a, k: _entry(_arg(a, k, 1, "kernel_size")),
                   lambda a, k: _arg(a, k, 2, "stride"), lambda a, k: _arg(a, k, 3, "padding", 0), "a pool")


def _adaptive(args, kwargs, x, h):
    size = _arg(args, kwargs, 1, "output_size")
    rows = _entry(size)
    if rows is not None and rows != x.shape[h]:
        return (f"an adaptive pool to {rows} rows along H on a shard; use nn.AdaptiveAvgPool2d / AdaptiveMaxPool2d "
                f"in the model (converted: exact, and whole on every rank for a global pool)")
    return None


def _always(message):
    return lambda args, kwargs, x, h: message


def _roll(args, kwargs, x, h):
    dims = _arg(args, kwargs, 2, "dims")
    if dims is None or h in (_dims_arg(dims, x.dim()) or ()):
        return ("rolls along H (or the flattened field) on a shard; roll along W only, or gather first "
                "(halo.gather)")
    return None


def _flip(args, kwargs, x, h):
    dims = _arg(args, kwargs, 1, "dims")
    return "flips H on a shard; gather first (halo.gather)" if h in (_dims_arg(dims, x.dim()) or ()) else None


def _along(position: int, name: str, default: Any = 0, what: str = "splits or concatenates"):
    def rule(args, kwargs, x, h):
        d = _arg(args, kwargs, position, name, default)
        if isinstance(d, int) and d % x.dim() == h:
            return f"{what} along H (the sharded dim) on a shard; do it along another dim, or gather first"
        return None
    return rule


def _cat(args, kwargs, x, h):
    d = _arg(args, kwargs, 1, "dim", 0)
    if isinstance(d, int) and d % x.dim() == h:
        return ("concatenates along H (the sharded dim): each rank would stack its own rows; concatenate along "
                "channels, or gather first")
    tensors = _arg(args, kwargs, 0, "tensors", ())
    rows = {int(t.shape[h]) for t in tensors if isinstance(t, torch.Tensor) and t.dim() == x.dim()}
    if len(rows) > 1:
        return (f"concatenates fields whose shards hold different numbers of rows here ({sorted(rows)}): they are "
                f"split differently (one was resized on its shard, e.g. a nearest upsampling of an unevenly split "
                f"field); resize with nn.Upsample in the model (its output is split like the others), or make H "
                f"divisible by the ranks at every level")
    return None


def _reduce(position: int = 1, name: str = "dim", default: Any = None):
    """A reduction (or sort) whose dim sits at ``position`` (``default`` when not given: ``None`` = all dims)."""
    def rule(args, kwargs, x, h):
        d = _arg(args, kwargs, position, name, default)
        if isinstance(d, torch.Tensor):  # torch.max(a, b): elementwise
            return None
        dims = _dims_arg(d, x.dim())
        if dims is None or h in dims:
            return ("reduces over H (or over everything) on a shard: each rank would reduce only its own rows; use "
                    "halo.reduce (domain_sum, domain_mean, all_reduce), or a global pool module "
                    "(nn.AdaptiveAvgPool2d(1), whole on every rank)")
        return None
    rule.along = (position, name, default)  # the guard follows H through it (a dim removed before H shifts it)
    return rule


def _softmax(args, kwargs, x, h):
    d = _arg(args, kwargs, 1, "dim")
    if d is None or d % x.dim() == h:
        return "normalises over H on a shard; normalise over channels, or gather first"
    return None


def _getitem(args, kwargs, x, h):
    index = args[1] if len(args) > 1 else None
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 1 for i in items):
        return "indexes with a mask that covers H on a shard; gather first"
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    pos = 0
    for i in items:
        if i is Ellipsis:
            pos += x.dim() - used
            continue
        if i is None:
            continue
        if pos == h and not (isinstance(i, slice) and i == slice(None)):
            return (f"indexes H (the sharded dim) with {i!r} on a shard: rows are numbered per rank; slice other "
                    f"dims, or gather first")
        pos += 1
    return None


def _split_differently(rows: list[int]) -> str | None:
    """A pointwise op on fields whose shards hold different numbers of rows (more than one: a 1-row tensor
    broadcasts) combines rows of different latitudes."""
    many = sorted({r for r in rows if r != 1})
    if len(many) > 1:
        return (f"combines fields whose shards hold different numbers of rows here ({many}): they are split "
                f"differently (one was resized on its shard, e.g. F.interpolate with a nearest upsampling of an "
                f"unevenly split field), so the rows it pairs are not the same latitudes; resize with nn.Upsample in "
                f"the model (its output is split like the others), or make H divisible by the ranks at every level")
    return None


def _raised(exc: Exception) -> str:
    """An op torch itself refused on this rank's shard (the others may not have: their shards differ), in words."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (f"torch raises on this rank's shard ({type(exc).__name__}: {first}); the other ranks' shards may pass, so "
            f"halo agrees on it first and every rank raises here (the unsharded model may raise here too)")


def _row_masks(rows: list[int] | None) -> tuple[int, int]:
    """A pointwise op's operands on this rank as two bit masks (bit ``k``: operand ``k``): ``ones``, those with 1
    row; ``alike``, those with the rows of the result (every bit set for an op that is not pointwise on fields)."""
    if rows is None:
        return 0, -1
    out = max(rows[:62], default=1)
    ones = sum(1 << k for k, r in enumerate(rows[:62]) if r == 1)
    return ones, ~sum(1 << k for k, r in enumerate(rows[:62]) if r != out)


def _broadcasts(per_rank: list[list[int] | None]) -> str:
    """Why a pointwise op whose operand ``k`` has 1 row on some ranks only is refused (every rank alike): a tensor of
    1 row everywhere broadcasts (a bias, a ``(B, C, 1, 1)`` scale); one with the result's rows everywhere is split
    like it; one with 1 row on some ranks and more on others is a field whose shard of 1 row broadcasts over the
    other field's rows there (an unevenly split level of another extent): the unsharded model pairs no such rows."""
    shown = "; ".join(f"domain rank {r}: {rows}" for r, rows in enumerate(per_rank))
    return (f"combines fields split differently: an operand has 1 row on some ranks and more on others, so on those "
            f"ranks its 1-row shard broadcasts over the other field's rows (rows of the operands along H: {shown}); "
            f"they are fields of different extents along H (the unsharded op would not pair their rows); resize with "
            f"nn.Upsample in the model (its output is split like the others), or make H divisible by the ranks at "
            f"every level")


def _dim_rule(position: int, name: str, default: Any, what: str):
    """An op along one dim (``default`` when not given; ``None``: all dims): refused when that dim is H."""
    def rule(args, kwargs, x, h):
        d = _arg(args, kwargs, position, name, default)
        dims = _dims_arg(d, x.dim())
        if dims is None or h in dims:
            return f"{what} along H (the sharded dim) on a shard: each rank would see only its own rows; gather first"
        return None
    return rule


def _linear(args, kwargs, x, h):
    if h == x.dim() - 1:
        return "multiplies over H (the sharded dim is the last one, which F.linear contracts); gather first"
    return None


def _layer_norm(args, kwargs, x, h):
    shape = _arg(args, kwargs, 1, "normalized_shape", ())
    k = 1 if isinstance(shape, int) else len(tuple(shape))
    if h >= x.dim() - k:
        return (f"normalises over the last {k} dims, which include H (the sharded dim), on a shard: each rank would "
                f"use its own rows' statistics; use nn.LayerNorm in the model (converted to halo.nn.DomainLayerNorm), "
                f"or normalise over channels only (channels-last, normalized_shape=(C,))")
    return None


def _group_norm(args, kwargs, x, h):
    if h >= 1:
        return ("normalises each sample over its groups' channels and all of H x W (the sharded dim) on a shard: "
                "each rank would use its own rows' statistics; use nn.GroupNorm in the model (converted to "
                "halo.nn.DomainGroupNorm)")
    return None


def _instance_norm(args, kwargs, x, h):
    if h >= 2 and _arg(args, kwargs, 5, "use_input_stats", True):
        return ("normalises over H x W (the sharded dim) on a shard: each rank would use its own rows' "
                "statistics; use nn.InstanceNorm2d in the model (converted to halo.nn.DomainInstanceNorm2d)")
    return None


def _batch_norm(args, kwargs, x, h):
    training = _arg(args, kwargs, 5, "training", False)
    stats = _arg(args, kwargs, 1, "running_mean") is None or _arg(args, kwargs, 2, "running_var") is None
    if h != 1 and (training or stats):
        return ("normalises with batch statistics over B x H x W (the sharded dim) on a shard: each rank would use "
                "its own rows' statistics (and update the running stats with them); use nn.BatchNorm2d in the "
                "model (converted to halo.nn.DomainBatchNorm2d)")
    return None


def _dropout(args, kwargs, x, h):
    p = _arg(args, kwargs, 1, "p", 0.5)
    training = _arg(args, kwargs, 2, "training", _arg(args, kwargs, 2, "train", True))
    if training and p:
        return (f"draws a random mask (p={p}) on each shard: each rank would draw its own numbers, unlike the "
                f"unsharded model's one draw; use halo.random.dropout / feature_dropout / alpha_dropout (draws "
                f"keyed on global rows) or an nn.Dropout module (converted)")
    return None


def _draws(args, kwargs, x, h):
    return ("draws random numbers shaped like a shard: each rank would draw its own, unlike the unsharded model's "
            "one draw; use halo.random (draws keyed on global rows)")


def _repeat(args, kwargs, x, h):
    sizes = args[1:] if len(args) > 1 and isinstance(args[1], int) else _arg(args, kwargs, 1, "repeats",
                                                                              _arg(args, kwargs, 1, "dims", ()))
    sizes = [int(s) for s in (sizes if isinstance(sizes, (list, tuple, torch.Size)) else (sizes,))]
    at = len(sizes) - x.dim() + h  # sizes align with the input's dims from the right
    if 0 <= at < len(sizes) and sizes[at] != 1:
        return f"repeats H (the sharded dim) {sizes[at]} times on a shard: each rank would tile its own rows"
    return None


def _repeat_interleave(args, kwargs, x, h):
    d = _arg(args, kwargs, 2, "dim")
    if d is None or d % x.dim() == h:
        return "repeats rows of H (or of the flattened field) on a shard; do it along another dim, or gather first"
    return None


def _where(args, kwargs, x, h):
    if len(args) + len(kwargs) == 1:
        return "finds the indices of a condition (torch.where(cond)): rows are numbered per rank; gather first"
    return None


_FFT_ONE = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
_FFT_TWO = ("fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2")
_FFT_N = ("fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn")


def _fft(default: Any, position: int = 2):
    def rule(args, kwargs, x, h):
        dims = _dims_arg(_arg(args, kwargs, position, "dim", default), x.dim())
        if dims is None or h in dims:
            return ("transforms along H (the sharded dim) on a shard (a Fourier transform over all rows): each rank "
                    "would transform only its own rows; transform along W only, or gather first (halo.gather)")
        return None
    return rule


def _merge(x: torch.Tensor, h: int, rows: int, out: torch.Tensor) -> tuple[int | None, str | None]:
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
            if s % rows == 0:  # H alone, H merged with the dims after it (tokens), or tokens split back to (h, W)
                return j, None
            return None, "splits the sharded rows of H across dims: each rank's rows would be re-cut; keep H whole"
        if acc < before < acc * s:
            return None, ("merges H (the sharded dim) with an earlier dim (e.g. flatten(1), view(B, -1)): the merged "
                          "dim mixes every rank's rows; keep H (or merge it with W only: flatten(2))")
        acc *= s
    return None, "reshapes H (the sharded dim) in a way halo cannot follow; keep H as a dim of its own"


_RULES: dict[Any, Callable] = {}


def _register(funcs: list[Any], rule: Callable) -> None:
    for f in funcs:
        if f is not None:
            _RULES[f] = rule


T = torch.Tensor
_register([F.pad, torch.ops.aten.constant_pad_nd], _pad)
_register([F.interpolate, F.upsample, F.upsample_bilinear, F.upsample_nearest], _interpolate)
_register([F.conv2d, torch.conv2d, F.conv3d, torch.conv3d], _conv)
_register([F.conv_transpose2d, torch.conv_transpose2d], _conv_t)
_register([F.max_pool2d, F.avg_pool2d, torch.max_pool2d, getattr(torch, "avg_pool2d", None), F.lp_pool2d,
           getattr(F, "max_pool2d_with_indices", None)], _pool)
# 3-d pools of (B, C, D, H, W) fields: the window along H (the middle of a (D, H, W) triple) decides, as in 2-d
_register([F.max_pool3d, F.avg_pool3d, torch.max_pool3d, getattr(F, "max_pool3d_with_indices", None)], _pool)
_register([F.adaptive_avg_pool2d, F.adaptive_max_pool2d, torch.adaptive_avg_pool1d], _adaptive)
_register([F.pixel_shuffle, torch.pixel_shuffle, F.pixel_unshuffle, torch.pixel_unshuffle],
          _always("rearranges rows across H (pixel shuffle) on a shard; use nn.PixelShuffle / nn.PixelUnshuffle in "
                  "the model (converted exactly)"))
_register([F.unfold, F.fold], _always("unfolds windows that cross the shard's edge rows; gather first"))
_register([F.grid_sample], _always("samples the field at arbitrary rows on a shard; gather first"))
_register([torch.roll, T.roll], _roll)
_register([torch.flip, T.flip], _flip)
_register([torch.flipud, T.flipud], lambda a, k, x, h: "flips dim 0" if h == 0 else None)
_register([torch.fliplr, T.fliplr], lambda a, k, x, h: "flips dim 1" if h == 1 else None)
_register([torch.cat, torch.concat, torch.concatenate], _cat)
_register([torch.split, T.split, torch.chunk, T.chunk, torch.tensor_split, T.tensor_split],
          _along(2, "dim", 0, "splits"))
_register([torch.unbind, T.unbind], _along(1, "dim", 0, "unbinds"))
_register([torch.narrow, T.narrow, torch.select, T.select, torch.index_select, T.index_select,
           torch.gather, T.gather, torch.take_along_dim, T.take_along_dim],
          _along(1, "dim", None, "selects rows"))
_register([T.__getitem__], _getitem)
_register([torch.sum, T.sum, torch.mean, T.mean, torch.nansum, T.nansum, torch.nanmean, T.nanmean, torch.prod,
           T.prod, torch.amax, T.amax, torch.amin, T.amin, torch.max, T.max, torch.min, T.min, torch.std, T.std,
           torch.var, T.var, torch.std_mean, torch.var_mean, torch.logsumexp, T.logsumexp, torch.argmax, T.argmax,
           torch.argmin, T.argmin, torch.median, T.median, torch.all, T.all, torch.any, T.any, torch.count_nonzero,
           T.count_nonzero, torch.cumsum, T.cumsum, torch.cumprod, T.cumprod], _reduce())
_register([torch.norm, T.norm, torch.linalg.vector_norm], _reduce(2, "dim"))  # (input, p / ord, dim)
_register([torch.sort, T.sort, torch.argsort, T.argsort], _reduce(1, "dim", -1))
_register([torch.topk, T.topk, torch.kthvalue, T.kthvalue], _reduce(2, "dim", -1))  # (input, k, dim=-1)
_register([F.softmax, F.log_softmax, T.softmax, T.log_softmax, torch.softmax, torch.log_softmax], _softmax)

_register([F.softmin], _softmax)
_register([F.linear], _linear)
_register([F.layer_norm, getattr(F, "rms_norm", None)], _layer_norm)
_register([F.group_norm], _group_norm)
_register([F.instance_norm], _instance_norm)
_register([F.batch_norm], _batch_norm)
_register([F.normalize], _dim_rule(2, "dim", 1, "normalises"))
_register([F.glu], _dim_rule(1, "dim", -1, "splits and gates"))
_register([F.cosine_similarity], _dim_rule(2, "dim", 1, "compares vectors"))
_register([torch.diff, T.diff], _dim_rule(2, "dim", -1, "differences neighbouring rows"))
_register([torch.cummax, T.cummax, torch.cummin, T.cummin, torch.logcumsumexp, T.logcumsumexp, torch.nanmedian,
           T.nanmedian, torch.mode, T.mode, torch.aminmax, T.aminmax], _reduce())
_register([torch.quantile, T.quantile, torch.nanquantile, T.nanquantile], _reduce(2, "dim"))
_register([F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout,
           torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout], _dropout)
_register([torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli, T.bernoulli, T.bernoulli_,
           T.uniform_, T.normal_, T.exponential_, T.geometric_, T.cauchy_, T.log_normal_, T.random_,
           torch.normal, torch.poisson, torch.multinomial, T.multinomial], _draws)
_register([T.repeat, torch.tile, T.tile], _repeat)
_register([torch.repeat_interleave, T.repeat_interleave], _repeat_interleave)
_register([torch.where, T.where], _where)
_register([getattr(torch.fft, n) for n in _FFT_ONE], _fft(-1))
_register([getattr(torch.fft, n) for n in _FFT_TWO], _fft((-2, -1)))
_register([getattr(torch.fft, n) for n in _FFT_N], _fft(None))
_register([torch.fft.fftshift, torch.fft.ifftshift], _fft(None, 1))
_register([T.__setitem__], _getitem)  # x[idx] = v: the same rule as x[idx]
_register([T.__iter__], lambda a, k, x, h: "iterates over H (dim 0) on a shard" if h == 0 else None)


def _funcs(names: str, *spaces: Any, inplace: bool = False) -> set:
    """The functions called ``names`` (space separated) in each namespace that has them (and ``name_``)."""
    found = set()
    for name in names.split():
        for space in spaces:
            for n in (name, name + "_") if inplace else (name,):
                f = getattr(space, n, None)
                if f is not None:
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
    "new_zeros new_ones new_empty new_full new_tensor zeros_like ones_like empty_like full_like", torch, T)
_GETTERS = {getattr(T, name).__get__ for name in (
    "shape dtype device ndim requires_grad is_cuda is_cpu is_mps is_xpu is_meta is_sparse is_quantized is_nested "
    "is_mkldnn grad grad_fn data layout names is_leaf output_nr _version itemsize nbytes retains_grad real imag "
    "_base").split() if hasattr(T, name) and hasattr(getattr(T, name), "__get__")}
_PASS = _ELEMENTWISE | _COMPARISONS | _ACTIVATIONS | _DUNDERS | _METADATA | _GETTERS
_PASS -= set(_RULES)  # a rule reads the arguments of the ops that have one
_MT = T.mT.__get__  # x.mT: transpose of the last two dims, followed
_SIZE_READS = {T.shape.__get__, T.size}  # a field's size read by user code: what a size from a shard may name
_INTERPOLATES = {F.interpolate, F.upsample}
_MEANS = {torch.mean, T.mean}

_LAYOUT = {torch.permute, T.permute, torch.transpose, T.transpose, torch.movedim, T.movedim, torch.swapaxes,
           T.swapaxes, torch.swapdims, T.swapdims, torch.unsqueeze, T.unsqueeze, torch.squeeze, T.squeeze, _MT}
_MERGES = {T.view, T.reshape, torch.reshape, torch.flatten, T.flatten, T.view_as, T.reshape_as, T.unflatten,
           torch.unflatten}
_MATMUL = {torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.bmm, T.bmm}
_STACK = {torch.stack}


_TRUSTED = reroute.TRUSTED  # > 0 inside ``trusted()`` (shared with the reroute: it neither counts nor computes there)


def place(t: Any, dim: int, rows: int | None = None) -> None:
    """Tell the guard of a converted model's first call where ``t``, a halo layer's output, holds the sharded rows:
    at ``dim`` (``rows`` of them; more when later dims are merged into it, as tokens). For layers whose output is
    not ``(..., H, W)`` with H at -2: channels-last blocks (Swin, NATTEN), tokens, W-shards (``rows_to_columns``).
    Without it the guard would take dim -2 for H and pass a reduction over the real H (silently wrong). A no-op when
    no guard is watching."""
    from .plans import state

    guard = state().guard
    if guard is None or not isinstance(t, torch.Tensor) or torch.compiler.is_compiling():
        return
    d = dim % t.dim()
    guard.dims[t] = (d, int(t.shape[d]) if rows is None else int(rows))


class trusted:  # noqa: N801 - a context manager, named like one
    """``with halo.guard.trusted():`` the guard does not check the ops in this block (code you know is right on a
    shard: the guard assumes dim -2 of a 3-d or larger tensor is H unless it followed the tensor there)."""

    def __enter__(self) -> trusted:
        _TRUSTED[0] += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _TRUSTED[0] -= 1


def _on_w(rule: Callable, args: tuple, kwargs: dict, x: torch.Tensor) -> str | None:
    """The rule applied to W (the last dim) of a field on a latitude x longitude mesh, worded for W."""
    _AXIS[0] = -1
    try:
        problem = rule(args, kwargs, x, x.dim() - 1)
    finally:
        _AXIS[0] = -2
    if problem is None:
        return None
    problem = re.sub(r"\bH\b", "W", problem).replace("rows", "columns").replace("halo.gather", "halo.gather_2d")
    return f"acts on W, which a latitude x longitude mesh shards too: {problem}"


class SpatialGuard(TorchFunctionMode):
    """The guard of one converted model's first call (module docstring). ``names``: id(module) -> path."""

    def __init__(self, names: dict[int, str], cg: CommGroup, epoch: int, w_sharded: bool = False) -> None:
        super().__init__()
        self.w_sharded = w_sharded  # a latitude x longitude mesh: the last dim of an untracked field is W, sharded
        self.names = names
        self.cg = cg
        self.epoch = epoch
        self.dims = TensorMap()  # tensor -> (its H dim, rows) where that is not (dim -2, all of it); (-1, 0): none
        self.tainted = TensorMap()  # tensor -> the refusal of the op in a forward hook that computed it
        self.checked = 0
        self.off = cg.size == 1  # nothing is sharded: every op computes what the unsharded model does
        self.recorder = reroute.Recorder(cg)  # the calls computed exactly (halo.reroute), by site
        self.sized = reroute.SizeTable()
        self._hook: Any = None

    def __enter__(self) -> SpatialGuard:
        if not self.off:  # a halo layer must not take a whole mean computed here for a shard
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: reroute.refuse_whole_mean(module, args, self.names))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.recorder.close()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if self.tainted._items:
            hooked = self._check_taint(func, args, kwargs)
            if hooked is not None:
                return hooked[0]
        if func in _STACK:
            return self._stack(func, args, kwargs)
        site = None
        if func in reroute.EXACT and not _TRUSTED[0]:  # counted wherever called (the sites' ordinals)
            at = _user_frame()
            if at is not None and not _in_hook(at):
                site = self.recorder.count(at)
        elif func in _SIZE_READS and args:
            self._note_size(args[0])
        rule = None if _TRUSTED[0] else _RULES.get(func)
        layout = func in _LAYOUT or func in _MERGES
        matmul = func in _MATMUL and not _TRUSTED[0]
        tracked = self._tracked(args) if self.dims._items else None
        special = func in _SPECIAL and not _TRUSTED[0]
        unclassified = rule is None and not layout and not matmul and not special and not _TRUSTED[0] \
            and func not in _PASS
        if rule is None and not layout and not matmul and not special and not unclassified:
            if not _TRUSTED[0] and len(args) + len(kwargs) > 1:
                rows = self._rows_of_fields(args, kwargs)
                if rows is not None:  # a pointwise op on two fields or more: are they split alike?
                    frame = _user_frame()
                    if frame is not None:
                        problem = _split_differently(rows)
                        note = self._verdict(func, problem, frame, rows=rows)
                        if note is not None:
                            if not _in_hook(frame):
                                raise ValueError(_message(note))
                            out = func(*args, **kwargs)  # monitoring: marked, refused once it flows on
                            self._taint(func, args, out, _message(note))
                            return out
            if tracked is None:
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            self._carry(tracked, out)
            return out
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, str):  # einsum(equation, *operands)
            x = next((t for t in args[1:] if isinstance(t, torch.Tensor)), x)
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):  # cat
            x = next((t for t in x if _hdim(t, self.dims) is not None), x[0])
        h = _hdim(x, self.dims)
        if rule is _interpolate and h is None and isinstance(x, torch.Tensor) and x.dim() >= 3 \
                and x.shape[-2] > 1 and whole_source(x) is not None:
            rule, h = _whole_interpolate, x.dim() - 2  # a small map whole on every rank (PSP), resized
        if unclassified:
            watch = self._any_field(args, kwargs)
        else:
            watch = h is not None or matmul or special
        frame = _user_frame() if watch else None
        if frame is None and rule is _linear and self.w_sharded and watch and _torch_module_call():
            # a kept nn.Linear on a latitude x longitude mesh (custom_converters={nn.Linear: None}): on a field's
            # last dim, W, it mixes the sharded columns; checked although torch's own module makes the call
            frame = sys._getframe(1)
        if frame is None:  # not a field, or torch's / halo's own code: run it (and follow H through it)
            out = func(*args, **kwargs)
            if layout and h is not None:
                self._follow(func, args, kwargs, x, h, out)
            elif tracked is not None:
                self._carry(tracked, out)
            return out
        if unclassified:
            problem = ("is not an op halo has classified (pointwise in H, a layout op it follows, or one it computes "
                       "exactly), and it is given a field sharded along H: it may read rows of other ranks, so halo "
                       "refuses it until it is classified (halo.guard); compute it with a module halo converts, "
                       "gather first (halo.gather), or, if it acts on each row of H on its own, run it in "
                       "`with halo.guard.trusted():`")
        elif special:
            problem = _SPECIAL[func](self, args, kwargs)
        else:
            problem = rule(args, kwargs, x, h) if rule is not None else self._matmul(args) if matmul else None
        if site is not None and site[0] is not None and not self.w_sharded and isinstance(x, torch.Tensor):
            exact = self._exact(func, args, kwargs, x, h, problem, frame, site)
            if isinstance(exact, str):
                problem = exact
            elif exact is not None:
                return exact[0]
        if problem is None and rule is not None and self.w_sharded and isinstance(x, torch.Tensor) and x.dim() >= 3 \
                and self.dims.get(x) is None:
            problem = _on_w(rule, args, kwargs, x)
        out, ran, failed = None, problem is None, None
        if ran:
            try:
                out = func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - torch refuses this rank's shard: agreed on first (invariant 4)
                failed, ran, problem = exc, False, _raised(exc)
        if ran:
            if layout:
                problem = self._follow(func, args, kwargs, x, h, out)
            elif func in _SPECIAL_FOLLOW:
                _SPECIAL_FOLLOW[func](self, args, kwargs, out)
            elif rule is _getitem and func is T.__getitem__:
                problem = self._follow_index(x, h, args[1] if len(args) > 1 else None, out)
            elif getattr(rule, "along", None) is not None and h is not None:
                self._follow_reduce(rule.along, args, kwargs, x, h, out)
            elif tracked is not None:
                self._carry(tracked, out)
        note = self._verdict(func, problem, frame, checked=not unclassified)
        if note is not None:  # some rank refuses it (all ranks alike from here)
            if not _in_hook(frame) or failed is not None:
                raise ValueError(_message(note)) from failed
            if not ran:  # monitoring code in a hook: refused only once its result flows into the model
                out = func(*args, **kwargs)
            self._taint(func, args, out, _message(note))
        return out

    # -- computed exactly (halo.reroute) ----------------------------------------------------------------------------

    def _note_size(self, t: Any) -> None:
        """User code read the size of ``t``: if it is a field (H at dim -2), a size taken from a shard may name it."""
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.dim() >= 3 \
                and self.dims.get(t) is None and whole_source(t) is None and _user_frame(3) is not None:
            self.sized.note(t)

    def _exact(self, func, args, kwargs, x, h, problem, frame, site) -> tuple[Any] | str | None:
        """An op halo can compute exactly where the rule finds it acts on H: ``(out,)`` computed (and recorded at its
        site for later calls), a refusal (why not here), or ``None``: go on as the rule says."""
        module, key, ordinal = site
        whole = False
        if func in _MEANS:
            dims = reroute.mean_dims(args, kwargs, x) if problem is not None else None
            if dims is None:
                return None
            why = None if h in dims[0] else "it does not reduce over H"
        elif func in _INTERPOLATES:
            whole = whole_source(x) is not None
            sized = _arg(args, kwargs, 1, "size") is not None  # (a size from a shard: gathered on every rank)
            if h != x.dim() - 2 or problem is None and not sized and (
                    whole or reroute.interpolate_change(args, kwargs, x) is None):
                return None
            why = reroute.plan_interpolate(args, kwargs, x, whole)
        else:
            if problem is None:
                return None
            why = reroute.plan_norm(func, args, kwargs, x, h)
        if why is not None:
            return f"{problem}; halo computes it exactly only in a form it can (here: {why})" if problem else None
        note = self._verdict(func, None, frame)
        if note is not None:
            raise ValueError(_message(note))
        gid = self.recorder.gid
        try:  # (collectives: every rank gets here, and an agreement that fails raises the same on every rank)
            if func in _MEANS:
                action = reroute.finish_mean(x, h, *dims, self.cg, gid)
            elif func in _INTERPOLATES:
                action = reroute.finish_interpolate(args, kwargs, x, whole, self.sized, self.cg, gid, _op_name(func))
            else:
                action = reroute.finish_norm(func, x, self.cg, gid)
        except ValueError as exc:
            action = f"halo would compute it over the whole domain, but {exc}"
        if isinstance(action, str):
            raise ValueError(_message((0, action, self._where(frame), _op_name(func))))
        if action is None:  # exact on the shard as it is
            return (func(*args, **kwargs),)
        out = action(args, kwargs)
        self.recorder.record(module, key, ordinal, action)
        return (out,)

    def _rows_of_fields(self, args, kwargs) -> list[int] | None:
        """An op on two fields or more: the sizes of its tensor arguments along the first field's H (aligned from
        the right, as broadcasting aligns them); ``None``: fewer than two fields."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        fields = [(t, f) for t in tensors if (f := _field(t, self.dims)) is not None]
        if len(fields) < 2:
            return None
        ref, (h, _) = fields[0]
        back = ref.dim() - h
        return [int(t.shape[t.dim() - back]) for t in tensors if t.dim() >= back]

    def _any_field(self, args, kwargs) -> bool:
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if _field(t, self.dims) is not None:
                    return True
        return False

    # -- hooks ---------------------------------------------------------------------------------------------------

    def _taint(self, func, args, out, message: str) -> None:
        """Mark what an op the guard refuses computed in a forward hook (and the tensor it changed in place)."""
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor):
                self.tainted[o] = message
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and (name.endswith("_") and not name.endswith("__")
                                                           or name in _IN_PLACE):
            self.tainted[args[0]] = message

    def _check_taint(self, func, args, kwargs) -> tuple[Any] | None:
        """An op given a tensor computed by a refused op in a hook: inside a hook, run it and pass the mark on
        (``(out,)``); outside, the refused result flows into the model: refuse it (the same on every rank: the
        marks come from agreed refusals). ``None``: no marked input."""
        message = None
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    message = message or self.tainted.get(t)
        if message is None:
            return None
        if _in_hook(sys._getframe(2)):
            out = func(*args, **kwargs)
            self._taint(func, args, out, message)
            return (out,)
        raise ValueError(_flows(message))

    def finish(self, output: Any) -> None:
        """The model's output: refuse it if a forward hook computed it with an op the guard refuses."""
        import torch.utils._pytree as pytree

        for t in pytree.tree_leaves(output):
            message = self.tainted.get(t) if isinstance(t, torch.Tensor) else None
            if message is not None:
                raise ValueError(_flows(message))
        reroute.install(self.recorder, self.epoch, self.names)  # later calls of this epoch compute them alike

    def _stack(self, func, args, kwargs):
        """``torch.stack``: the new dim shifts H when it comes before it; follow H to its place."""
        out = func(*args, **kwargs)
        tensors = _arg(args, kwargs, 0, "tensors", ())
        first = next((t for t in tensors if _field(t, self.dims) is not None), None)
        if first is not None and isinstance(out, torch.Tensor):
            h, rows = _field(first, self.dims)
            d = _arg(args, kwargs, 1, "dim", 0) % out.dim()
            new = h + (d <= h)
            if new != out.dim() - 2:
                self.dims[out] = (new, rows)
        return out

    def _tracked(self, args) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """The first argument whose H is tracked away from dim -2, with that dim."""
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    d = self.dims.get(t)
                    if d is not None:
                        return t, d
        return None

    def _carry(self, tracked: tuple[torch.Tensor, tuple[int, int]], out: Any) -> None:
        """An op on a tensor whose H is tracked: outputs of its shape along that dim keep it (elementwise ops)."""
        t, (d, rows) = tracked
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(o, torch.Tensor) or o.dim() < t.dim():
                continue
            e = d + o.dim() - t.dim() if d >= 0 else d  # broadcasting puts new dims in front
            if d < 0 or o.shape[e] == t.shape[d]:
                self.dims[o] = (e, rows)

    def _matmul(self, args) -> str | None:
        a, b = (args + (None, None))[:2]
        ha, hb = _hdim(a, self.dims), _hdim(b, self.dims)
        if (ha is not None and ha == a.dim() - 1) or (hb is not None and b.dim() >= 2 and hb == b.dim() - 1):
            return ("multiplies over H (the sharded dim) or makes it a second token dim (attention over all "
                    "tokens): each rank would see only its own rows; gather first")
        return None

    def _follow(self, func, args, kwargs, x, h, out) -> str | None:
        """Record where H went through a layout op; a merge of H with an earlier dim is a problem."""
        if not isinstance(out, torch.Tensor):
            return None
        nd = x.dim()
        rows = _field(x, self.dims)[1]
        new = None
        if func in (torch.permute, T.permute):
            order = args[1:] if len(args) > 1 and isinstance(args[1], int) else _arg(args, kwargs, 1, "dims")
            order = [d % nd for d in order]
            new = order.index(h)
        elif func in (torch.transpose, T.transpose, torch.swapaxes, T.swapaxes, torch.swapdims, T.swapdims):
            a, b = (_arg(args, kwargs, 1, "dim0") % nd, _arg(args, kwargs, 2, "dim1") % nd)
            new = b if h == a else a if h == b else h
        elif func == _MT:
            new = nd - 2 if h == nd - 1 else nd - 1 if h == nd - 2 else h
        elif func in (torch.movedim, T.movedim):
            src = _dims_arg(_arg(args, kwargs, 1, "source"), nd)
            dst = _dims_arg(_arg(args, kwargs, 2, "destination"), nd)
            order = [d for d in range(nd) if d not in src]
            for s_, d_ in sorted(zip(dst, src, strict=True)):
                order.insert(s_, d_)
            new = order.index(h)
        elif func in (torch.unsqueeze, T.unsqueeze):
            d = _arg(args, kwargs, 1, "dim") % (nd + 1)
            new = h + (d <= h)
        elif func in (torch.squeeze, T.squeeze):
            dim = _arg(args, kwargs, 1, "dim")
            removed = [d for d in range(nd) if x.shape[d] == 1 and out.dim() < nd
                       and (dim is None or d in (_dims_arg(dim, nd) or ()))]
            new = None if h in removed else h - sum(d < h for d in removed)
        else:  # view / reshape / flatten
            new, problem = _merge(x, h, rows, out)
            if problem is not None:
                return problem
        if new is None:
            self.dims[out] = (-1, 0)
        elif new != out.dim() - 2 or out.dim() < 3 or int(out.shape[new]) != rows:
            self.dims[out] = (new, rows)
        return None

    def _record(self, out: Any, new: int | None, rows: int) -> None:
        """``out`` holds H at dim ``new`` (``None``: no longer)."""
        if not isinstance(out, torch.Tensor):
            return
        if new is None:
            self.dims[out] = (-1, 0)
        elif new != out.dim() - 2 or out.dim() < 3 or int(out.shape[new]) != rows:
            self.dims[out] = (new, rows)

    def _follow_reduce(self, along, args, kwargs, x, h, out) -> None:
        """A reduction over other dims than H: H moves down by the dims removed before it (``keepdim=False``)."""
        position, name, default = along
        d = _arg(args, kwargs, position, name, default)
        dims = _dims_arg(d, x.dim()) if not isinstance(d, torch.Tensor) else ()
        rows = _field(x, self.dims)[1]
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(o, torch.Tensor):
                continue
            if o.dim() == x.dim():
                if self.dims.get(x) is not None:
                    self.dims[o] = self.dims.get(x)
            elif dims and o.dim() == x.dim() - len(dims):
                self._record(o, h - sum(1 for e in dims if e < h), rows)

    def _follow_index(self, x, h, index, out) -> str | None:
        """``x[index]`` (H itself kept whole: the rule): where H goes (ints remove dims, ``None`` adds one, an index
        tensor stands in its place with its own dims)."""
        if not isinstance(out, torch.Tensor) or h is None:
            return None
        items = list(index) if isinstance(index, tuple) else [index]

        def consumed(i):
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                return max(i.dim(), 1)
            return 0 if i is None or i is Ellipsis else 1

        used = sum(consumed(i) for i in items)
        pos = at = 0
        new = None
        advanced = 0
        for i in items:
            if i is Ellipsis:
                k = x.dim() - used
                if pos <= h < pos + k:
                    new = at + h - pos
                pos, at = pos + k, at + k
            elif i is None:
                at += 1
            elif isinstance(i, slice):
                if pos == h:
                    new = at
                pos, at = pos + 1, at + 1
            elif isinstance(i, (int, torch.SymInt)) or (isinstance(i, torch.Tensor) and i.dim() == 0
                                                      and i.dtype != torch.bool):
                pos += 1
            else:  # an index tensor or list: its dims stand in the place of the dims it indexes
                advanced += 1
                n = consumed(i)
                made = 1 if isinstance(i, torch.Tensor) and i.dtype == torch.bool else (
                    i.dim() if isinstance(i, torch.Tensor) else len(torch.as_tensor(i).shape))
                pos, at = pos + n, at + made
        if new is None and h >= pos:
            new = at + h - pos
        if advanced > 1:
            return ("indexes with several index tensors or lists (advanced indexing), which moves dims in ways halo "
                    "does not follow; index one dim at a time")
        self._record(out, new, _field(x, self.dims)[1])
        return None

    def _einsum_dims(self, args) -> tuple[str | None, int | None, int]:
        """``torch.einsum``: (a problem, the output dim of H, rows)."""
        equation = str(args[0]).replace(" ", "")
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        lhs, arrow, rhs = equation.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(ops) or not all(isinstance(t, torch.Tensor) for t in ops):
            return "an einsum halo cannot read (operands do not match the equation); gather first", None, 0
        spare = (c for c in string.ascii_letters if c not in equation)
        width = max((t.dim() - len(term) + 3 for term, t in zip(terms, ops, strict=True) if "..." in term), default=0)
        ell = "".join(next(spare) for _ in range(width))
        full = [term.replace("...", ell[width - (t.dim() - len(term) + 3):]) if "..." in term else term
                for term, t in zip(terms, ops, strict=True)]
        if arrow:
            out = rhs.replace("...", ell)
        else:
            letters = "".join(full)
            out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
        marks = {}
        rows = 0
        for term, t in zip(full, ops, strict=True):
            f = _field(t, self.dims)
            if f is not None and f[0] < len(term):
                marks[term[f[0]]] = True
                rows = f[1]
        if not marks:
            return None, None, 0
        if len(marks) > 1:
            return ("makes the sharded H of two fields two dims of its result (attention over all tokens, or an "
                    "outer product of rows): each rank would see only its own rows; gather first"), None, 0
        (c,) = marks
        if c not in out:
            return ("contracts H (the sharded dim): each rank would sum only over its own rows; use halo.reduce "
                    "(domain_sum) on the partial result, or gather first"), None, 0
        return None, out.index(c), rows

    def _einsum(self, args, kwargs) -> str | None:
        problem = self._einsum_dims(args)[0]
        if problem is None and self.w_sharded:  # on a latitude x longitude mesh: W (a field's last dim) too
            ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
            saved = self.dims
            self.dims = TensorMap()
            watched = False
            for t in ops:
                if isinstance(t, torch.Tensor) and t.dim() >= 3 and saved.get(t) is None and _field(t, saved):
                    self.dims[t], watched = (t.dim() - 1, int(t.shape[-1])), True
                elif isinstance(t, torch.Tensor):
                    self.dims[t] = (-1, 0)  # tracked elsewhere (tokens): its W is not the last dim
            try:
                problem = self._einsum_dims(args)[0] if watched else None
            finally:
                self.dims = saved
            if problem is not None:
                problem = "acts on W, which a latitude x longitude mesh shards too: " + re.sub(
                    r"\bH\b", "W", problem).replace("rows", "columns")
        return problem

    def _einsum_follow(self, args, kwargs, out) -> None:
        _, new, rows = self._einsum_dims(args)
        if new is not None:
            self._record(out, new, rows)

    def _sdpa(self, args, kwargs) -> str | None:
        for i, name in enumerate(("query", "key", "value")):
            t = _arg(args, kwargs, i, name)
            f = _field(t, self.dims)
            if f is not None and f[0] >= t.dim() - 2:
                return ("attends over tokens that hold H (the sharded dim): each rank would attend over its own "
                        "rows' tokens only; attention over all tokens needs a halo attention layer (window or "
                        "neighbourhood attention: halo.nn) or a gather first")
        return None

    def _sdpa_follow(self, args, kwargs, out) -> None:
        q = _arg(args, kwargs, 0, "query")
        f = _field(q, self.dims)
        if f is not None and isinstance(out, torch.Tensor) and out.dim() == q.dim():
            self._record(out, f[0], f[1])

    def _baddbmm(self, args, kwargs) -> str | None:
        return self._matmul((_arg(args, kwargs, 1, "batch1"), _arg(args, kwargs, 2, "batch2")))

    def _agree(self, func, problem: str | None, frame, checked: bool = True) -> None:
        """Every rank at the same checked op: all go on, or all raise the first rank's refusal."""
        note = self._verdict(func, problem, frame, checked)
        if note is not None:
            raise ValueError(_message(note))

    def _verdict(self, func, problem: str | None, frame, checked: bool = True,
                 rows: list[int] | None = None) -> tuple[int, str, str, str] | None:
        """The ranks' agreed verdict on an op: ``None`` (every rank goes on), or ``(rank, problem, where, name)`` of
        the first rank that refuses it. An op refused by its name alone (``checked=False``) is refused on every
        rank that reaches it (SPMD), with a collective only to check that they all got there. ``rows``: a pointwise
        op's operand rows on this rank (:meth:`_rows_of_fields`), also judged across ranks (:func:`_broadcasts`)."""
        self.checked += checked
        if self.cg.size == 1 and problem is None:
            return None
        name = _op_name(func)
        tag = zlib.crc32(name.encode()) & 0x7FFFFFFF
        if self.cg.size > 1:
            ones, alike = _row_masks(rows)
            table = gather_words([_AGREE, tag, 1 if problem else 0, ones, alike], self.cg, f"halo guard ({name})")
            split = bool(np.bitwise_and.reduce(table[:, 3]) | np.bitwise_and.reduce(table[:, 4]) != -1)
            if not table[:, 2].any() and (table[:, 1] == tag).all() and not split:
                return None
            notes = all_gather_object((problem, self._where(frame), name, rows), self.cg)
            if split and not any(n[0] for n in notes) and len({n[2] for n in notes}) == 1:
                text = _broadcasts([n[3] for n in notes])
                notes = [(text, *n[1:]) for n in notes]
        else:
            notes = [(problem, self._where(frame), name, rows)]
        if len({n[2] for n in notes}) > 1:
            raise ValueError(
                "halo guard: the ranks of the domain group called different torch functions at the same point of "
                "the model's forward (" + "; ".join(f"rank {r}: {n[2]} at {n[1]}" for r, n in enumerate(notes))
                + "): code that branches on the size of its shard computes something else on each rank")
        r, (text, where, name, _) = next((r, n) for r, n in enumerate(notes) if n[0])
        return r, text, where, name

    def _where(self, frame) -> str:
        """``at file:line `code` (in the forward of path (Type))``: the user line, and the module whose forward ran
        it (the nearest caller that is a module's method)."""
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        where = f"at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} `{line}`"
        f = frame
        while f is not None:
            module = f.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                path = self.names.get(id(module), "(a module)")
                return f"{where} (in the forward of {path} ({type(module).__name__}))"
            f = f.f_back
        return where


_SPECIAL = {torch.einsum: SpatialGuard._einsum, F.scaled_dot_product_attention: SpatialGuard._sdpa,
            torch.baddbmm: SpatialGuard._baddbmm, T.baddbmm: SpatialGuard._baddbmm}
_SPECIAL_FOLLOW = {torch.einsum: SpatialGuard._einsum_follow, F.scaled_dot_product_attention: SpatialGuard._sdpa_follow}


def _op_name(func: Any) -> str:
    """The op's name as users write it (``Tensor.shape``, ``Tensor.add``, ``einsum``)."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor" and getattr(func, "__name__", "") == "__get__":
        return f"Tensor.{owner.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
    return name.replace("TensorBase.", "Tensor.")


def _message(note: tuple[int, str, str, str]) -> str:
    r, text, where, name = note
    return (f"{name} {where}: {text}. halo refuses it on every rank (seen on domain rank {r}) rather than compute each "
            f"shard on its own: the converted model would silently differ from the unsharded one")


def _flows(message: str) -> str:
    return (f"{message}. It ran in a forward hook, where halo lets monitoring code compute what it likes, but its "
            f"result flows into the model's computation (the hook returned it, changed a tensor of the model in "
            f"place, or a later op of the model uses it), so halo refuses it here")


_MODULE_PY = os.path.join(_TORCH_DIR, "nn", "modules", "module.py")
_MODULES_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep


def _torch_module_call() -> bool:
    """Whether the op was called by a torch module's own forward (``nn.Linear.forward``)."""
    return sys._getframe(2).f_code.co_filename.startswith(_MODULES_DIR)
_IN_PLACE = frozenset(("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                       "__imatmul__"))


def _in_hook(frame: Any) -> bool:
    """Whether ``frame`` runs (at any depth) inside a module's forward hook or pre-hook: a frame that
    ``Module._call_impl`` called which is not the module's forward."""
    f = frame
    while f is not None:
        back = f.f_back
        if back is not None and back.f_code.co_filename == _MODULE_PY and f.f_code.co_filename != _MODULE_PY \
                and back.f_code.co_name in ("_call_impl", "inner"):  # hooks run in _call_impl's inner()
            call = back.f_locals.get("forward_call")
            code = getattr(getattr(call, "__func__", call), "__code__", None)
            if code is not None and code is not f.f_code:
                return True
        f = back
    return False


use_guard(SpatialGuard)  # the planner enters it at a converted model's first call of each epoch
