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
``F.interpolate`` / ``upsample*``                      it resizes H, unless each row is repeated a whole number
                                                       of times (nearest): exact on a shard, split like its input
``F.conv2d``, ``conv_transpose2d``, pools, ``unfold``  its window, stride or padding along H is not 1 / 1 / 0
``adaptive_*_pool2d``, ``pixel_(un)shuffle``,          they change or mix H
``grid_sample``
``torch.roll``, ``flip``                               along H
``cat``, ``split``, ``chunk``, ``narrow``, indexing,   along H (a slice of H that is not the whole of it); a
                                                       ``cat`` of fields split differently (rows differ)
``index_select``, ``select``, ``unbind``, ...
reductions (``sum``, ``mean``, ``max``, ``std``,       over H, or over everything
``softmax``, ``cumsum``, ``sort``, ...)
``view`` / ``reshape`` / ``flatten``                   H is merged with an earlier dim (with later ones, as
                                                       ``flatten(2)`` makes tokens, it is tracked)
``matmul`` / ``@`` / ``bmm``                           H is contracted or becomes a second token dim (attention)
=====================================================  ===========================================================

H is dim -2 of a field of 3 or more dims, followed through ``permute``/``transpose``/``movedim``, ``(un)squeeze``
and ``view``/``flatten`` (channels-last blocks, tokens). Tensors that are whole on every rank (after a global
pool) are not fields. A refusal raises ``ValueError`` on every rank at the same op, naming the op, the module
whose forward called it, the line of user code and the way out (a halo layer or module that does it exactly). Every
checked op is agreed on by the ranks (one small host all-gather), only during those first calls: afterwards the
model runs without the guard, at no cost. What it cannot see (a custom autograd Function, numpy, a shape decision
taken before the first call) :func:`halo.check_equivalence` catches by comparing with the unsharded model. Code the
guard takes for a field by mistake (a tensor of 3 or more dims made in ``forward`` rather than derived from the
input) can be marked ``with halo.guard.trusted():``.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .comm import CommGroup, all_gather_object, gather_words
from .plans import _TensorMap, whole_source

__all__ = ["SpatialGuard", "place", "trusted"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_HALO_DIRS = (os.path.dirname(os.path.abspath(__file__)),
              os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
_AGREE = 0x47554152  # "GUAR"


def _field(t: Any, dims: _TensorMap) -> tuple[int, int] | None:
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


def _hdim(t: Any, dims: _TensorMap) -> int | None:
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
        return (f"pads H (the sharded dim) by ({pad[2 * k]}, {pad[2 * k + 1]}) rows on a shard, amounts computed "
                f"from this rank's rows; to pad one tensor to another's size (a U-Net's skip connection) use "
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

_LAYOUT = {torch.permute, T.permute, torch.transpose, T.transpose, torch.movedim, T.movedim, torch.swapaxes,
           T.swapaxes, torch.swapdims, T.swapdims, torch.unsqueeze, T.unsqueeze, torch.squeeze, T.squeeze}
_MERGES = {T.view, T.reshape, torch.reshape, torch.flatten, T.flatten, T.view_as, T.reshape_as}
_MATMUL = {torch.matmul, T.matmul, T.__matmul__, torch.bmm, T.bmm}
_STACK = {torch.stack}


#: torch's files of user-facing functions and their dispatch: a call through them is the caller's. A call from any
#: other torch file is torch's own work (a module's internals, spectral norm's or a parametrization's weight
#: arithmetic): not a field op of the user's. The converter keeps only torch modules that are pointwise in latitude.
_TORCH_API = tuple(os.path.join(_TORCH_DIR, *p) for p in (("overrides.py",), ("functional.py",), ("_tensor.py",),
                                                          ("nn", "functional.py"), ("_jit_internal.py",),
                                                          ("_compile.py",), ("_dynamo",)))


def _user_frame():
    """The innermost frame of user code that led to this call (``None``: torch's or halo's own code called it)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_TORCH_DIR):
            if not name.startswith(_TORCH_API):
                return None  # torch's own code (module internals, weight hooks) made this call
            f = f.f_back
            continue
        if name.startswith(_HALO_DIRS):
            return None
        return f
    return None


_TRUSTED = [0]


def place(t: Any, dim: int, rows: int | None = None) -> None:
    """Tell the guard of a converted model's first call where ``t``, a halo layer's output, holds the sharded rows:
    at ``dim`` (``rows`` of them; more when later dims are merged into it, as tokens). For layers whose output is
    not ``(..., H, W)`` with H at -2: channels-last blocks (Swin, NATTEN), tokens, W-shards (``rows_to_columns``).
    Without it the guard would take dim -2 for H and pass a reduction over the real H (silently wrong). A no-op when
    no guard is watching."""
    from .plans import _STATE

    guard = _STATE.guard
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
        self.dims = _TensorMap()  # tensor -> (its H dim, rows) where that is not (dim -2, all of it); (-1, 0): none
        self.checked = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if func in _STACK:
            return self._stack(func, args, kwargs)
        rule = None if _TRUSTED[0] else _RULES.get(func)
        layout = func in _LAYOUT or func in _MERGES
        matmul = func in _MATMUL and not _TRUSTED[0]
        tracked = self._tracked(args) if self.dims._items else None
        if rule is None and not layout and not matmul and tracked is None:
            return func(*args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):  # cat
            x = next((t for t in x if _hdim(t, self.dims) is not None), x[0])
        h = _hdim(x, self.dims)
        if rule is _interpolate and h is None and isinstance(x, torch.Tensor) and x.dim() >= 3 \
                and x.shape[-2] > 1 and whole_source(x) is not None:
            rule, h = _whole_interpolate, x.dim() - 2  # a small map whole on every rank (PSP), resized
        frame = _user_frame() if (rule is not None or layout or matmul) and (h is not None or matmul) else None
        if frame is None:  # not a field, or torch's / halo's own code: run it (and follow H through it)
            out = func(*args, **kwargs)
            if layout and h is not None:
                self._follow(func, args, kwargs, x, h, out)
            elif tracked is not None:
                self._carry(tracked, out)
            return out
        problem = rule(args, kwargs, x, h) if rule is not None else self._matmul(args) if matmul else None
        if problem is None and rule is not None and self.w_sharded and isinstance(x, torch.Tensor) and x.dim() >= 3 \
                and self.dims.get(x) is None:
            problem = _on_w(rule, args, kwargs, x)
        out = None
        if problem is None:
            out = func(*args, **kwargs)
            if layout:
                problem = self._follow(func, args, kwargs, x, h, out)
            elif tracked is not None:
                self._carry(tracked, out)
        self._agree(func, problem, frame)
        return out

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
            if isinstance(o, torch.Tensor) and o.dim() == t.dim() and (d < 0 or o.shape[d] == t.shape[d]):
                self.dims[o] = (d, rows)

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

    def _agree(self, func, problem: str | None, frame) -> None:
        """Every rank at the same checked op: all go on, or all raise the first rank's refusal."""
        self.checked += 1
        if self.cg.size == 1 and problem is None:
            return
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        tag = zlib.crc32(name.encode()) & 0x7FFFFFFF
        if self.cg.size > 1:
            table = gather_words([_AGREE, tag, 1 if problem else 0], self.cg, f"halo guard ({name})")
            if not table[:, 2].any() and (table[:, 1] == tag).all():
                return
            notes = all_gather_object((problem, self._where(frame), name), self.cg)
        else:
            notes = [(problem, self._where(frame), name)]
        if len({n[2] for n in notes}) > 1:
            raise ValueError(
                "halo guard: the ranks of the domain group called different torch functions at the same point of "
                "the model's forward (" + "; ".join(f"rank {r}: {n[2]} at {n[1]}" for r, n in enumerate(notes))
                + "): code that branches on the size of its shard computes something else on each rank")
        r, (text, where, name) = next((r, n) for r, n in enumerate(notes) if n[0])
        raise ValueError(f"{name} {where}: {text}. halo refuses it on every rank (seen on domain rank {r}) rather "
                         f"than compute each shard on its own: the converted model would silently differ from the "
                         f"unsharded one")

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
