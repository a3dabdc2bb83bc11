"""Functional ops that a converted model's ``forward`` calls on a field, computed exactly instead of refused.

The guard of a model's first call (:mod:`halo.guard`) refuses what would act on the sharded dim H of a field. A few
such ops halo can compute exactly and cheaply (kind ``"exact"`` in the one table, :data:`halo.guard._policy.POLICY`),
so there the guard computes them instead, and remembers where:

=====================================================  ===========================================================
op on a field sharded along H                           computed as
=====================================================  ===========================================================
``F.group_norm``, ``F.instance_norm`` (input stats),    the domain statistics (:func:`halo.nn.norm.domain_var_mean`:
``F.batch_norm`` (training, or without running stats),  every rank's ``(mean, M2)`` combined), running stats updated
``F.layer_norm`` over dims that include H (no weight)   as torch updates them (unbiased variance of the global count)
``mean`` / ``Tensor.mean`` over dims that include H     local sum, all-reduce (plain adjoint), / the global count: the
                                                        result is whole on every rank (marked so)
``F.interpolate(size=S)`` that resizes H to ``S[0]``    ``halo_interpolate`` to the *global* size: that of a field
                                                        (whose size the forward read) holding ``S[0]`` rows on every
                                                        rank, the sum of the ranks' ``S[0]`` (refused when no field
                                                        has them); a whole map (a global pool's) resized to it and
                                                        this rank's rows kept
``F.interpolate(scale_factor=s)`` that resizes H        ``halo_interpolate`` (split as the global output is); a
                                                        nearest whole-number scale whose per-shard result is split
                                                        like the global output passes as it is
``F.dropout`` (training, ``p > 0``) of a tensor no      ``halo.random.dropout(whole=True)``: the whole tensor's
field: a global pool's or a mean over H's own result    one-process mask, alike on every rank (the unsharded
(timm ResNet / EfficientNet ``forward_head``)           model's); of a tensor computed from one: refused
=====================================================  ===========================================================

Where. The guard records each such call under the model's plan key (the epoch of the input shapes: the guard runs
once per epoch) at its *site*: the module whose ``__call__`` runs the code (the innermost one), the code's file,
first line and line, and the op's ordinal at that site within one call of that module. On later calls of the same
epoch, a module with sites runs its ``forward`` under :class:`_Reroute`, a ``TorchFunctionMode`` that looks only at
the few functions above and computes exactly the recorded ordinals; everything else passes straight through. An
epoch's sites are one entry with the model's guarded epoch (:func:`halo.plan.plans.guarded_epochs`), bounded
(``halo.plan.plans.set_limits(epochs=)``) and dropped together, so a call never finds its epoch guarded and its sites
gone (it would run unrouted: silently different); the next call of a dropped epoch is guarded and learns again.
Modules without sites are untouched and pay nothing; a module with sites pays a Python call per torch function its
forward (children included) calls (~1-2 us each), a frame walk per call of one of those few functions (~3 us), and
~8 us per call for its wrapper (measured on CPU, one thread: a 150 us block with one rerouted mean costs ~31 us
more; in an epoch without sites, ~8 us).

Under ``torch.compile`` such a module's forward runs eagerly (``torch.compiler.disable``: a graph break there; with
``fullgraph=True`` dynamo raises naming the module and why): the mode walks Python frames, which a graph cannot.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import context
from ..autocast import cast_as_torch
from ..dist.comm import CommGroup, all_gather_object, group_by_id, group_id
from ..nn.norm import domain_var_mean, domain_vector_norm  # the exact functionals: the layers sit below the guard
from ..nn.ring import ring_sdpa
from ..nn.softmax import domain_softmax
from ..nn.upsample import SUPPORTED_MODES, halo_interpolate
from ..plan.partition import split_sizes
from ..plan.plans import Site, guarded_epochs, mark_whole, shard_sizes
from ..plan.plans import state as plans_state
from ._policy import POLICY

__all__ = ["WHOLE_MEAN", "WHOLE_NORM", "WHOLE_SUM", "Recorder", "calling_module", "install", "site_key", "state",
           "uninstall", "user_frame"]

T = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__)
_HALO_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # halo/, above this package
              os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels"))
#: torch's files of user-facing functions and their dispatch: a call through them is the caller's. ``_ops.py`` and
#: ``_library`` dispatch ``torch.ops.<namespace>.<op>`` (extension and custom ops): called from user code, they are
#: the user's op (unclassified: refused on a field), not torch's own.
_TORCH_API = tuple(os.path.join(_TORCH_DIR, *p) for p in (("overrides.py",), ("functional.py",), ("_tensor.py",),
                                                          ("nn", "functional.py"), ("_jit_internal.py",),
                                                          ("_compile.py",), ("_dynamo",), ("_ops.py",),
                                                          ("_library",)))
_MODULE_PY = os.path.join(_TORCH_DIR, "nn", "modules", "module.py")


def state() -> context.Watch:
    """The trusted depth and the guard watching, in the context in use (:func:`halo.context.watch`): the reroute
    computes no site inside ``halo.guard.trusted()``."""
    return context.watch()


#: The source of the mark a mean over H computed here leaves on its (whole) result.
WHOLE_MEAN = "a mean over H computed over the domain (halo.guard.reroute)"
#: ... a sum over H ...
WHOLE_SUM = "a sum over H computed over the domain (halo.guard.reroute)"
#: ... and a vector norm over H.
WHOLE_NORM = "a vector norm over H computed over the domain (halo.guard.reroute)"
#: A tensor computed in a guarded call from whole ones only (``mean * 2.0``): whole too, marked only in that call
WHOLE_DERIVED = "a tensor computed from a whole result (a mean or norm over H, a global pool's) and no field"

# -- where a call comes from ---------------------------------------------------------------------------------------

def user_frame(depth: int = 2) -> Any:
    """The innermost frame of user code that led to this call (``None``: torch's or halo's own code called it);
    ``depth``: frames to skip (2: the caller of the ``__torch_function__`` that calls this)."""
    f = sys._getframe(depth)
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


def halo_called(depth: int = 2) -> bool:
    """Whether halo's own code made this call: the nearest frame outside torch, skipping ``depth`` frames (2: the
    caller of the ``__torch_function__`` that calls this), is halo's (or there is none). Torch's layers run by user
    code count as the user's."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
        f = f.f_back
    return f is None or f.f_code.co_filename.startswith(_HALO_DIRS)


def site_key(frame: Any) -> tuple[str, int, int]:
    """A call site: the code's file and first line, and the line (picklable, unlike a code object)."""
    code = frame.f_code
    return code.co_filename, code.co_firstlineno, frame.f_lineno


def calling_module(frame: Any) -> tuple[torch.nn.Module | None, Any]:
    """The innermost module whose ``__call__`` runs ``frame`` and the frame that ``__call__`` called (its forward,
    a hook, or the wrapper :func:`install` puts there); ``(None, None)`` outside any module call."""
    f = frame
    while f is not None:
        back = f.f_back
        if back is not None and back.f_code.co_filename == _MODULE_PY and f.f_code.co_filename != _MODULE_PY \
                and back.f_code.co_name in ("_call_impl", "inner"):
            module = back.f_locals.get("self")
            return (module, f) if isinstance(module, torch.nn.Module) else (None, None)
        f = back
    return None, None


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


# -- the exact computations (what a site does on every call) ----------------------------------------------------------

def _var_mean(x: torch.Tensor, dims: tuple[int, ...], sizes: tuple[int, ...], gid: int, op: str):
    return domain_var_mean(x, dims, group_by_id(gid).group, sizes=sizes, op=op)[:2]


def _normalized(x: torch.Tensor, var: torch.Tensor, mean: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.to(mean.dtype) - mean) * torch.rsqrt(var + eps)


def _channel_affine(y: torch.Tensor, weight: Any, bias: Any) -> torch.Tensor:
    view = (1, -1) + (1,) * (y.dim() - 2)
    if weight is not None:
        y = y * weight.to(y.dtype).view(view)
    if bias is not None:
        y = y + bias.to(y.dtype).view(view)
    return y


def _update_running(running_mean: Any, running_var: Any, mean: torch.Tensor, var: torch.Tensor, count: int,
                    momentum: float) -> None:
    """``running = (1 - m) running + m stat`` with the unbiased variance of the global ``count``, as torch."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.detach().reshape(running_mean.shape).to(running_mean.dtype),
                                                 alpha=momentum)
        if running_var is not None:
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.reshape(running_var.shape).to(running_var.dtype),
                                                alpha=momentum)


class GroupNorm(NamedTuple):
    """``F.group_norm`` over the whole domain (statistics per sample and group)."""

    sizes: tuple[int, ...]
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x, groups = args[0], _arg(args, kwargs, 1, "num_groups")
        weight, bias = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias")
        eps = _arg(args, kwargs, 4, "eps", 1e-5)
        x = cast_as_torch("group_norm", x, weight, bias)  # torch's dtype under autocast (float32 on CUDA)
        b, c = x.shape[:2]
        xv = x.reshape(b, groups, c // groups, *x.shape[2:])
        var, mean = _var_mean(xv, tuple(range(2, xv.dim())), self.sizes, self.gid, "F.group_norm")
        y = _normalized(xv, var, mean, eps).reshape(x.shape)
        return _channel_affine(y, weight, bias).to(x.dtype)


class InstanceNorm(NamedTuple):
    """``F.instance_norm`` with input statistics over the whole domain (per sample and channel)."""

    sizes: tuple[int, ...]
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x = args[0]
        rm, rv = _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")
        weight, bias = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias")
        momentum, eps = _arg(args, kwargs, 6, "momentum", 0.1), _arg(args, kwargs, 7, "eps", 1e-5)
        x = cast_as_torch("instance_norm", x, weight, bias)  # torch's dtype under autocast
        var, mean = _var_mean(x, tuple(range(2, x.dim())), self.sizes, self.gid, "F.instance_norm")
        if rm is not None or rv is not None:  # torch: the batch mean of each instance's statistics
            count = math.prod(x.shape[2:-2]) * sum(self.sizes) * x.shape[-1]
            _update_running(rm, rv, mean.mean(0), var.mean(0), count, momentum)
        return _channel_affine(_normalized(x, var, mean, eps), weight, bias).to(x.dtype)


class BatchNorm(NamedTuple):
    """``F.batch_norm`` with batch statistics over B and the whole domain (per channel)."""

    sizes: tuple[int, ...]
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x = args[0]
        rm, rv = _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")
        weight, bias = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias")
        training = _arg(args, kwargs, 5, "training", False)
        momentum, eps = _arg(args, kwargs, 6, "momentum", 0.1), _arg(args, kwargs, 7, "eps", 1e-5)
        x = cast_as_torch("batch_norm", x, weight, bias)  # torch's dtype under autocast
        var, mean = _var_mean(x, (0, *range(2, x.dim())), self.sizes, self.gid, "F.batch_norm")
        if training and (rm is not None or rv is not None):
            count = x.shape[0] * math.prod(x.shape[2:-2]) * sum(self.sizes) * x.shape[-1]
            _update_running(rm, rv, mean, var, count, momentum)
        return _channel_affine(_normalized(x, var, mean, eps), weight, bias).to(x.dtype)


class LayerNorm(NamedTuple):
    """``F.layer_norm`` over trailing dims that include H, without weight and bias."""

    sizes: tuple[int, ...]
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x, shape = args[0], _arg(args, kwargs, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(tuple(shape))
        eps = _arg(args, kwargs, 4, "eps", 1e-5)
        x = cast_as_torch("layer_norm", x)  # float32 under CUDA autocast, as torch's layer_norm (halo.autocast)
        var, mean = _var_mean(x, tuple(range(x.dim() - k, x.dim())), self.sizes, self.gid, "F.layer_norm")
        return _normalized(x, var, mean, eps).to(x.dtype)


class Mean(NamedTuple):
    """``mean`` (``op="sum"``: ``sum``, of a floating field) over dims that include H: the global mean (sum), whole
    on every rank (the plain all-reduce adjoint: each rank's consumers use it on their own rows, and their partial
    gradients add up)."""

    dims: tuple[int, ...]
    keepdim: bool
    count: int
    gid: int
    op: str = "mean"

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        from ..parallel.reduce import accumulation_dtype, all_reduce

        x, dtype = args[0], kwargs.get("dtype")
        if dtype is None:
            x = cast_as_torch(self.op, x)  # torch's dtype under autocast (mean: the input's; sum: float32 on CUDA)
        acc = accumulation_dtype(dtype or x.dtype)
        local = x.sum(dim=self.dims, keepdim=self.keepdim, dtype=acc)
        out = all_reduce(local, group=group_by_id(self.gid).group)
        out = (out / self.count if self.count != 1 else out).to(dtype or x.dtype)
        if not torch.compiler.is_compiling():
            mark_whole(out, WHOLE_MEAN if self.op == "mean" else WHOLE_SUM)
        return out


class Contract(NamedTuple):
    """``a @ b`` (``matmul``, ``bmm``; ``rmatmul``: ``b.__rmatmul__(a)``) contracting both fields' H (``a``'s last
    dim, ``b``'s dim -2: linear attention's ``k.transpose(-1, -2) @ v``): each rank's product over its own rows,
    summed over the domain (the plain all-reduce adjoint), whole on every rank."""

    rmatmul: bool
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        from ..parallel.reduce import all_reduce

        a, b = (args[1], args[0]) if self.rmatmul else (args[0], args[1])
        out = all_reduce(torch.matmul(a, b), group=group_by_id(self.gid).group)
        if not torch.compiler.is_compiling():
            mark_whole(out, WHOLE_SUM)
        return out


def contract_form(a: Any, b: Any, ha: int | None, hb: int | None, made: bool) -> str | None:
    """Why ``a @ b`` (``a``'s H at ``ha``, ``b``'s at ``hb``) is no contraction of both fields' H (``None``: it is).
    ``made``: both are fields halo's layers made (or computed from such), so that neither is a tensor built from a
    shard's size (``torch.eye(x.shape[-2])``), which a sum over the ranks would take for rows of a field."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 3 and b.dim() >= 3):
        return "an operand of fewer than 3 dims"
    if ha == a.dim() - 1 and hb == b.dim() - 2:
        if a.shape[-1] != b.shape[-2]:
            return f"the contracted dims differ on this rank ({a.shape[-1]} and {b.shape[-2]} rows)"
        if not made:
            return ("an operand is not a field made by halo's layers (or computed from one): it may not hold the "
                    "rows of the other's")
        return None
    if ha == a.dim() - 2 and hb == b.dim() - 1:
        return ("H becomes a second token dim: attention over all tokens; use F.scaled_dot_product_attention, which "
                "halo computes by ring attention")
    return "only one operand's H is contracted (a field times a tensor that is not split alike)"


#: softmax and log-softmax, as the guard sees them; ``F.softmax`` takes ``_stacklevel`` before its ``dtype``
_LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)
_F_SOFTMAX = (F.softmax, F.log_softmax)


def softmax_form(func: Any, args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[int, bool] | str:
    """``(dim, log)`` of a softmax call over H, or why halo does not compute it here."""
    d = _arg(args, kwargs, 1, "dim")
    if d is None:
        return "an implicit dim (dim=None: torch's legacy choice)"
    if not (x.is_floating_point() or _arg(args, kwargs, 3 if func in _F_SOFTMAX else 2, "dtype") is not None):
        return f"a {x.dtype} input"
    return int(d) % x.dim(), func in _LOG_SOFTMAX


class Softmax(NamedTuple):
    """``F.softmax`` / ``F.log_softmax`` (their ``torch`` and ``Tensor`` forms) over H:
    :func:`halo.nn.softmax.domain_softmax`, this rank's rows of the global normalisation (a field, as its input)."""

    dim: int
    log: bool
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x = args[0]
        d = _arg(args, kwargs, 1, "dim")
        if d is None or int(d) % x.dim() != self.dim:
            raise ValueError(f"halo computes this softmax over dim {self.dim} (H) at this call site, as its first "
                             f"call did; this call normalises over dim {d}: keep one dim per call site")
        dtype = kwargs.get("dtype", args[3] if len(args) > 3 and isinstance(args[3], torch.dtype) else
                           args[2] if len(args) > 2 and isinstance(args[2], torch.dtype) else None)
        return domain_softmax(x, self.dim, log=self.log, dtype=dtype, group=group_by_id(self.gid).group)


class VectorNorm(NamedTuple):
    """``torch.norm`` / ``Tensor.norm`` / ``torch.linalg.vector_norm`` (``linalg.norm``'s vector cases) over dims
    that include H: :func:`halo.nn.norm.domain_vector_norm`, whole on every rank (marked so)."""

    ord: float
    dims: tuple[int, ...]
    keepdim: bool
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        out = domain_vector_norm(args[0], self.ord, self.dims, self.keepdim, group=group_by_id(self.gid).group,
                                 dtype=kwargs.get("dtype"))
        if not torch.compiler.is_compiling():
            mark_whole(out, WHOLE_NORM)
        return out


class WholeDropout(NamedTuple):
    """``F.dropout`` (training, ``p > 0``) of a tensor whole and the same on every rank, a global pool's or a mean
    over H's own result (timm's ResNet and EfficientNet ``forward_head``: ``F.dropout(self.global_pool(x))``):
    :func:`halo.random.dropout` with ``whole=True``, the whole tensor's one-process mask drawn alike on every rank
    (the unsharded model's, as ``DomainDropout`` draws it for such a tensor), instead of torch's draw on each rank
    (each rank's own generator: a different mask per rank, silently, unless every rank was seeded alike)."""

    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        from .. import random as hr

        x, p, training, inplace = (_arg(args, kwargs, i, n, d) for i, (n, d) in
                                   enumerate((("input", None), ("p", 0.5), ("training", True), ("inplace", False))))
        if not training or not p:
            return F.dropout(x, p, training, inplace)
        source = None if torch.compiler.is_compiling() else plans_state().whole.get(x)
        out = hr.dropout(cast_as_torch("dropout", x), float(p), True, bool(inplace),
                         group=group_by_id(self.gid).group, whole=True)
        if source is not None:
            mark_whole(out, source)
        return out


#: The functional pools' arguments after the input, in order, with their defaults (``F.max_pool2d`` is also
#: ``torch.max_pool2d``'s order; the 3-d forms take the same).
_POOL_ARGS = {"max": (("kernel_size", None), ("stride", None), ("padding", 0), ("dilation", 1), ("ceil_mode", False),
                      ("return_indices", False)),
              "avg": (("kernel_size", None), ("stride", None), ("padding", 0), ("ceil_mode", False),
                      ("count_include_pad", True), ("divisor_override", None))}


def pool_form(func: Any, args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[type, tuple] | str:
    """The ``nn`` pooling module a functional max / average pool call describes, and its arguments, or why halo does
    not compute it as that module's halo layer."""
    name = getattr(func, "__name__", "")
    kind, nd = ("max" if "max" in name else "avg"), (3 if "3d" in name else 2)
    if x.dim() != nd + 2:
        return f"a {nd}-d pool of a {x.dim()}-d tensor (halo's pools take batched (B, C, ...) fields)"
    params = tuple((n, _arg(args, kwargs, i + 1, n, d)) for i, (n, d) in enumerate(_POOL_ARGS[kind]))
    if dict(params).get("return_indices"):
        return "return_indices=True: the indices would be into this rank's shard"
    cls = {("max", 2): torch.nn.MaxPool2d, ("avg", 2): torch.nn.AvgPool2d, ("max", 3): torch.nn.MaxPool3d,
           ("avg", 3): torch.nn.AvgPool3d}[kind, nd]
    return cls, tuple((n, v) for n, v in params if n != "return_indices")


class Pool(NamedTuple):
    """``F.max_pool2d`` / ``F.avg_pool2d`` (their 3-d forms, ``torch.max_pool2d``) of a field with a window along H:
    the halo layer of the ``nn`` module the call describes (:func:`halo.nn.pool.halo_pool`: the neighbours' rows
    exchanged, the output the balanced split of the global output rows), made at the guarded call and kept for the
    site's later calls, which must pass the same arguments (a pool whose window changes between calls is refused,
    rather than pooled with the first call's)."""

    layer: torch.nn.Module
    params: tuple
    name: str

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x = _arg(args, kwargs, 0, "input")
        cls, params = pool_form(getattr(F, self.name), args, kwargs, x) if isinstance(x, torch.Tensor) else (0, ())
        if params != self.params:
            raise ValueError(f"{self.name}: called with {dict(params)} at a site whose guarded call passed "
                             f"{dict(self.params)}; halo computes a functional pool with the window of that call: "
                             f"use the module (nn.MaxPool2d / nn.AvgPool2d, converted) for a window that changes")
        return self.layer(x)


def finish_pool(func: Any, args: tuple, kwargs: dict, x: torch.Tensor, gid: int) -> Pool:
    """The :class:`Pool` of this call (its layer's plans are made at its first call, on every rank alike)."""
    from ..nn.pool import halo_pool

    cls, params = pool_form(func, args, kwargs, x)
    layer = halo_pool(cls(**dict(params)), group=group_by_id(gid).group)
    return Pool(layer, params, getattr(func, "__name__", "max_pool2d"))


class Attention(NamedTuple):
    """``F.scaled_dot_product_attention`` whose query, key and value are fields' tokens (self-attention over all
    tokens, or attention to another field's tokens): :func:`halo.nn.ring.ring_sdpa` over the domain group, each
    rank's output rows as SDPA gives them on the whole field."""

    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        q, k, v, mask, p, causal = (_arg(args, kwargs, i, n, None if i < 4 else (0.0 if i == 4 else False))
                                    for i, n in enumerate(names))
        return ring_sdpa(q, k, v, mask, p, causal, kwargs.get("scale"), group=group_by_id(self.gid).group)


def attention_form(args: tuple, kwargs: dict, dims: Any) -> str | None:
    """Why halo does not compute this ``scaled_dot_product_attention`` by ring attention (``None``: it does): the
    query, key and value must each hold a field's tokens at dim -2 (their rank order is the global token order),
    no dropout, no grouped-query form."""
    from ._policy import field_of

    if _arg(args, kwargs, 4, "dropout_p", 0.0):
        return "dropout_p > 0: each rank would draw its own weights"
    if kwargs.get("enable_gqa"):
        return "enable_gqa=True"
    for i, name in enumerate(("query", "key", "value")):
        t = _arg(args, kwargs, i, name, None)
        f = field_of(t, dims)
        if f is None or f[0] != t.dim() - 2:
            return f"its {name} does not hold a field's tokens at dim -2"
    return None


def norm_form(func: Any, args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[float, tuple[int, ...], bool] | str:
    """``(ord, dims, keepdim)`` of a vector norm call, or why halo does not compute this form exactly."""
    if kwargs.get("out") is not None:
        return "out="
    linalg = func is torch.linalg.norm
    default = None if linalg else 2 if func is torch.linalg.vector_norm else "fro"
    ord_ = _arg(args, kwargs, 1, "ord" if func in (torch.linalg.vector_norm, torch.linalg.norm) else "p", default)
    d = _arg(args, kwargs, 2, "dim")
    if isinstance(d, torch.Tensor):
        return "a dim given as a tensor"
    dims = tuple(range(x.dim())) if d is None or d == () or d == [] else tuple(
        sorted({e % x.dim() for e in (d if isinstance(d, (list, tuple)) else (d,))}))
    if linalg and isinstance(d, (list, tuple)) and len(d) == 2 and ord_ not in (None, "fro"):
        return f"a matrix norm (ord={ord_!r} over two dims)"
    if linalg and d is None and ord_ is not None and x.dim() > 1:
        return f"a matrix or flattened norm with ord={ord_!r} and no dim"
    if ord_ in (None, "fro"):
        ord_ = 2
    if isinstance(ord_, bool) or not isinstance(ord_, (int, float)):
        return f"ord/p={ord_!r}"
    if x.dim() < 3 or x.dim() - 2 not in dims:
        return "its input does not hold H at dim -2"
    return float(ord_), dims, bool(_arg(args, kwargs, 3, "keepdim", False))


def _interp_args(args: tuple, kwargs: dict) -> tuple:
    return (args[0], _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 2, "scale_factor"),
            _arg(args, kwargs, 3, "mode", "nearest"), _arg(args, kwargs, 4, "align_corners"),
            _arg(args, kwargs, 5, "recompute_scale_factor"), _arg(args, kwargs, 6, "antialias", False))


def _last_size(x: torch.Tensor, size: Any) -> Any:
    return size if isinstance(size, int) else list(size)[-1]


class Resize(NamedTuple):
    """``F.interpolate`` of a field as ``halo_interpolate`` of the global field: to ``rows`` global rows (a size
    taken from a shard, resolved) or by the call's own scale factor (``rows`` 0)."""

    rows: int
    site: Site
    gid: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x, size, scale, mode, align, recompute, antialias = _interp_args(args, kwargs)
        if self.rows:
            size, scale = (self.rows, _last_size(x, size)), None
        return halo_interpolate(x, size, scale, mode, align, recompute, antialias, group=group_by_id(self.gid).group,
                                site=self.site)


class WholeResize(NamedTuple):
    """A map whole on every rank (a global pool's result) resized to a field's global rows; this rank keeps its
    rows (``offset``, ``rows``) of the result, split like that field."""

    global_rows: int
    offset: int
    rows: int

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x, size, scale, mode, align, recompute, antialias = _interp_args(args, kwargs)
        out = F.interpolate(x, (self.global_rows, _last_size(x, size)), None, mode, align, recompute, antialias)
        return out.narrow(-2, self.offset, self.rows)


# -- deciding, on the guarded first call ---------------------------------------------------------------------------

class Recorder:
    """What a guard of one first call found it can compute exactly: per module, its sites' actions by ordinal."""

    def __init__(self, cg: CommGroup) -> None:
        self.cg = cg
        self.gid = group_id(cg)
        self.modules: dict[int, tuple[torch.nn.Module, dict]] = {}
        self._ordinals: dict[tuple, list] = {}  # (id(module), site) -> [the invocation's frame, calls so far]

    def count(self, frame: Any) -> tuple[torch.nn.Module | None, tuple, int]:
        """Count a call of a function computed exactly (kind ``"exact"`` in :data:`halo.guard._policy.POLICY`) at
        ``frame``: ``(module, site, ordinal)``."""
        module, entry = calling_module(frame)
        key = site_key(frame)
        if module is None:
            return None, key, -1
        slot = self._ordinals.get((id(module), key))
        if slot is None or slot[0] is not entry:  # a new call of the module: ordinals restart
            slot = self._ordinals[(id(module), key)] = [entry, 0]
        slot[1] += 1
        return module, key, slot[1] - 1

    def record(self, module: torch.nn.Module, key: tuple, ordinal: int, action: Any) -> None:
        self.modules.setdefault(id(module), (module, {}))[1].setdefault(key, {})[ordinal] = action

    def close(self) -> None:
        self._ordinals.clear()  # (frames)


def _sizes(x: torch.Tensor, h: int, cg: CommGroup, op: str) -> tuple[int, ...]:
    """Every rank's extent of ``x`` along ``h``, agreed (the other dims checked equal on every rank), under a site
    of its own (so the sequence of site-less calls of later calls, which do not agree, is the same)."""
    return tuple(shard_sizes(x, h, cg.group, op=op, site=Site()))


def plan_norm(func: Any, args: tuple, kwargs: dict, x: torch.Tensor, h: int) -> str | None:
    """Why a norm that normalises over H cannot be computed exactly here (``None``: it can)."""
    name = func.__name__
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or h != x.dim() - 2:
        return "its input does not hold H at dim -2 (halo computes it exactly for (B, C, ..., H, W) fields)"
    if func is F.group_norm and x.dim() < 4:
        return "a group norm of a 3-d input"
    if func is F.layer_norm:
        shape = _arg(args, kwargs, 1, "normalized_shape", ())
        k = 1 if isinstance(shape, int) else len(tuple(shape))
        if _arg(args, kwargs, 2, "weight") is not None or _arg(args, kwargs, 3, "bias") is not None:
            return (f"{name} with a weight or bias over (..., H, W): elementwise parameters over a shard's rows "
                    f"cannot be matched to the global rows here")
        if k < 2:
            return "its normalized_shape does not cover W"
    if func is F.batch_norm and _arg(args, kwargs, 6, "momentum", 0.1) is None:
        return "a batch norm with momentum=None"
    return None


def finish_norm(func: Any, x: torch.Tensor, cg: CommGroup, gid: int) -> Any:
    """The action of an exact norm (agrees on every rank's rows: a collective, after the guard's verdict)."""
    sizes = _sizes(x, x.dim() - 2, cg, f"F.{func.__name__}")
    kind = {F.group_norm: GroupNorm, F.instance_norm: InstanceNorm, F.batch_norm: BatchNorm,
            F.layer_norm: LayerNorm}[func]
    return kind(sizes, gid)


def mean_dims(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple[int, ...], bool] | None:
    """``(dims, keepdim)`` of a ``mean`` call (``None``: a form not handled, e.g. ``out=``)."""
    if kwargs.get("out") is not None:
        return None
    d = _arg(args, kwargs, 1, "dim")
    if isinstance(d, torch.Tensor):
        return None
    dims = tuple(range(x.dim())) if d is None or d == () or d == [] else tuple(
        sorted({e % x.dim() for e in (d if isinstance(d, (list, tuple)) else (d,))}))
    return dims, bool(_arg(args, kwargs, 2, "keepdim", False))


def finish_mean(x: torch.Tensor, h: int, dims: tuple[int, ...], keepdim: bool, cg: CommGroup, gid: int,
                op: str = "mean") -> Mean:
    if op == "sum":
        return Mean(dims, keepdim, 1, gid, "sum")
    sizes = _sizes(x, h, cg, "Tensor.mean")
    count = math.prod(int(x.shape[d]) for d in dims if d != h) * sum(sizes)
    return Mean(dims, keepdim, count, gid)


def interpolate_change(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[str, Any] | None:
    """How an ``F.interpolate`` call sets H: ``("size", local target)``, ``("scale", factor)``; ``None``: H kept
    (or no resize along it)."""
    _, size, scale, *_ = _interp_args(args, kwargs)
    rows = int(x.shape[-2])
    if size is not None:
        sizes = [size] * (x.dim() - 2) if isinstance(size, int) else list(size)
        target = int(sizes[-2]) if len(sizes) >= 2 else None
        return None if target is None or target == rows else ("size", target)
    if scale is not None:
        scales = [scale] * (x.dim() - 2) if isinstance(scale, (int, float)) else list(scale)
        s = scales[-2] if len(scales) >= 2 else 1
        return None if s == 1 else ("scale", s)
    return None


def plan_interpolate(args: tuple, kwargs: dict, x: torch.Tensor, whole: bool) -> str | None:
    _, size, scale, mode, align, recompute, antialias = _interp_args(args, kwargs)
    if x.dim() != 4:
        return f"a {x.dim()}-d input (halo resizes (B, C, H, W) fields)"
    if antialias:
        return "antialias=True"
    if whole:
        return None if size is not None else "a whole map resized by a scale factor (its size is not a field's)"
    if mode not in SUPPORTED_MODES:
        return f"mode {mode!r}"
    return None


class SizeTable:
    """Fields whose size user code read in this first call (``x.shape``, ``x.size()``), in order (the same on every
    rank), with their local rows: what a size taken from a shard may name."""

    def __init__(self) -> None:
        from ..plan.plans import TensorMap

        self.index = TensorMap()
        self.rows: list[int] = []

    def note(self, t: torch.Tensor) -> None:
        if self.index.get(t) is None:
            self.index[t] = len(self.rows)
            self.rows.append(int(t.shape[-2]))


def resolve_size(table: SizeTable, target: int, rows: int, whole: bool, cg: CommGroup,
                 op: str) -> tuple[int, tuple[int, ...]] | str | None:
    """The global rows of the field whose local rows are ``target`` on every rank, with that field's split (every
    rank's ``target``, its own rows and its table gathered: the same answer on every rank); ``None``: H is left as
    it is (a field resized to its own rows on every rank); or why it is refused.

    The size is taken for a field's when one field whose size the forward read holds ``target`` rows on every rank:
    its global rows are then the sum of the targets (so two fields cannot disagree: the ranks' rows together name
    one global size; a size computed otherwise, ``x.shape[2] + 1``, matches no field and is refused). A map whole
    on every rank resized to a field's rows is resized to its global rows (left alone only when no field has
    them)."""
    gathered = all_gather_object((target, rows, table.rows), cg, f"halo guard ({op}: a size from a shard)")
    targets = [t for t, _, _ in gathered]
    same = all(t == r for t, r, _ in gathered)
    if same and not whole:
        return None
    n = min(len(fields) for _, _, fields in gathered)
    if any(all(fields[i] == t for t, _, fields in gathered) for i in range(n)):
        return sum(targets), tuple(targets)  # that field's global rows, and its split
    if same:
        return None
    return (f"resizes H to {targets} rows on the ranks (a size taken from a shard), which are not the rows of one "
            f"field whose size the forward read; resize to the global size with halo.nn.halo_interpolate, or take "
            f"the size from a field (F.interpolate(x, size=skip.shape[-2:]))")


def finish_interpolate(args: tuple, kwargs: dict, x: torch.Tensor, whole: bool, table: SizeTable, cg: CommGroup,
                       gid: int, op: str) -> Any:
    """The action of an interpolate that may resize H (``None``: it is exact on the shard as it is), or why it is
    refused (the same string on every rank). Every rank takes the same steps (a size from a shard differs by
    rank: it is gathered before anything is decided)."""
    _, size, scale, mode, *_ = _interp_args(args, kwargs)
    if size is not None:
        sizes = [size] * (x.dim() - 2) if isinstance(size, int) else list(size)
        found = resolve_size(table, int(sizes[-2]), int(x.shape[-2]), whole, cg, op)
        if found is None or isinstance(found, str):
            return found
        total, split = found
        if whole:
            return WholeResize(total, sum(split[:cg.index]), split[cg.index])
        return Resize(total, Site(), gid)
    change = interpolate_change(args, kwargs, x)
    if change is None:
        return None
    value = change[1]
    if mode in ("nearest", "nearest-exact") and float(value).is_integer() and value > 1:
        sizes = _sizes(x, 2, cg, op)  # every rank's rows repeated k times: exact if split like the output
        k = int(value)
        if [k * s for s in sizes] == split_sizes(k * sum(sizes), cg.size):
            return None
    return Resize(0, Site(), gid)


# -- later calls: the modules with sites run under the reroute -------------------------------------------------------

_CALL_CODES = frozenset([torch.nn.Module._call_impl.__code__] + [
    c for c in torch.nn.Module._call_impl.__code__.co_consts if hasattr(c, "co_name") and c.co_name == "inner"])


class _Reroute(TorchFunctionMode):
    """One call of a module with sites: the recorded ordinals of its sites computed exactly, all else passed.
    ``entry``: the frame of the module's rerouted forward (its wrapper's), below the module's ``__call__``."""

    def __init__(self, module: torch.nn.Module, sites: dict, entry: Any) -> None:
        super().__init__()
        self.module, self.sites, self.entry, self.counts = module, sites, entry, {}

    def _innermost(self, frame: Any) -> bool:
        """Whether the module is the innermost one whose ``__call__`` runs ``frame`` (:func:`calling_module`, by
        frame identity: no other module's call lies between the frame and this module's wrapper)."""
        f = frame
        while f is not None:
            if f is self.entry:
                return True
            if f.f_code in _CALL_CODES:
                return False
            f = f.f_back
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = POLICY.get(func)
        if entry is None or entry.kind != "exact" or state().trusted:
            return func(*args, **kwargs)
        frame = user_frame()
        if frame is None:
            return func(*args, **kwargs)
        key = site_key(frame)
        actions = self.sites.get(key)
        if actions is None or not self._innermost(frame):
            return func(*args, **kwargs)
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        action = actions.get(n)
        return func(*args, **kwargs) if action is None else action(args, kwargs)


class _Rerouted:
    """A module's ``forward`` (an instance attribute, so ``state_dict`` and the class are untouched) that runs the
    class's forward under :class:`_Reroute` in the epochs where it has sites."""

    def __init__(self, module: torch.nn.Module, name: str, inner: Any = None) -> None:
        self.module, self.name, self.inner = module, name, inner
        self._disabled()

    def _disabled(self) -> None:
        self._run = torch.compiler.disable(self.run, reason=(
            f"halo: {self.name} ({type(self.module).__name__}) calls functional ops on a field sharded along H "
            f"(a norm, a mean or an interpolate over H) that halo computes exactly at their call sites, found by "
            f"walking Python frames, which a graph cannot; it runs eagerly. To compile it whole use the modules "
            f"(nn.GroupNorm, nn.AdaptiveAvgPool2d, nn.Upsample) or halo's functions (halo.parallel.reduce, "
            f"halo.nn.halo_interpolate) in its forward"))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_run"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._disabled()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # (true while dynamo traces: a graph break, or fullgraph's error)
            return self._run(*args, **kwargs)
        return self.run(*args, **kwargs)  # eager: without the disable wrapper's own cost

    def run(self, *args: Any, **kwargs: Any) -> Any:
        _STATE = plans_state()
        module = self.module
        forward = self.inner if self.inner is not None else type(module).forward.__get__(module)
        epoch = _STATE.epoch
        if epoch is None and torch._C._current_graph_task_id() != -1:
            # recomputed in backward (activation checkpointing): the sites of its last forward, kept themselves (not
            # their epoch, whose sites may be dropped since) and set by every forward (one without sites: none)
            sites = module.__dict__.get("_halo_reroute_last")
            sites = sites if isinstance(sites, dict) else None
        else:
            sites = module.__dict__.get("_halo_reroute", {}).get(epoch) if _STATE.guard is None else None
            module.__dict__["_halo_reroute_last"] = sites  # (a guarded call: install() sets its sites)
        if not sites:
            return forward(*args, **kwargs)
        with _Reroute(module, sites, sys._getframe()):
            return forward(*args, **kwargs)


def install(recorder: Recorder, epoch: int, names: dict[int, str], root: torch.nn.Module) -> None:
    """After a guarded first call of converted model ``root``: ``epoch`` is guarded (``guarded_epochs``)
    with its sites, recorded on their modules, whose forward is rerouted (once).

    An epoch and its sites are one entry, dropped together past ``halo.plan.plans.set_limits(epochs=)`` (least recently
    called first; the same calls on every rank, so the same entries on every rank): its next call is guarded again
    and learns its sites again. Dropping sites alone would let a call of a still-guarded epoch run its modules
    unrouted (``F.group_norm`` of a shard: silently different)."""
    guarded = guarded_epochs(root)
    _forget(epoch, guarded.pop(epoch, ()))  # (guarded again under validation "always": its sites made anew)
    for module, sites in recorder.modules.values():
        module.__dict__.setdefault("_halo_reroute", {})[epoch] = sites
        module.__dict__["_halo_reroute_last"] = sites  # (a recompute in this call's backward: checkpointing)
        current = module.__dict__.get("forward")
        if not isinstance(current, _Rerouted):
            module.__dict__["forward"] = _Rerouted(module, names.get(id(module), "(a module)"), current)
    guarded[epoch] = tuple(module for module, _ in recorder.modules.values())
    cap = plans_state().max_epochs
    while len(guarded) > cap:
        _forget(*guarded.popitem(last=False))


def _forget(epoch: int, modules: tuple) -> None:
    """Drop ``epoch``'s sites from the modules that had them (its guarded entry is dropped with them)."""
    for module in modules:
        module.__dict__.get("_halo_reroute", {}).pop(epoch, None)


def uninstall(model: torch.nn.Module) -> None:
    """Forget every site in ``model`` and give its modules their class's forward back (``revert_domain_parallel``)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _Rerouted):
            inner = module.__dict__.pop("forward").inner
            if inner is not None:
                module.__dict__["forward"] = inner
        module.__dict__.pop("_halo_reroute", None)
        module.__dict__.pop("_halo_reroute_last", None)
        module.__dict__.pop("_halo_guarded", None)  # (converted again, its first calls must be guarded again)
        module.__dict__.pop("_halo_unguarded", None)


def refuse_whole_mean(module: torch.nn.Module, args: tuple, names: dict[int, str]) -> None:
    """A halo layer (it splits rows) handed the whole result of a mean over H computed here: it would take the
    ranks' copies for shards of a field. A global forward pre-hook during guarded first calls. A layer that knows
    a whole tensor when given one (``_halo_takes_whole``: ``DomainDropout``) is let through the mean's or norm's
    own result, which is marked at every call; never a tensor computed from it (:data:`WHOLE_DERIVED`), whose mark
    only this guarded call makes (a later call would take it for a shard)."""
    if "_halo_site" not in module.__dict__ or not args or not isinstance(args[0], torch.Tensor):
        return
    from ..plan.plans import whole_source

    source = whole_source(args[0])
    what = f"{names.get(id(module), '(a module)')} ({type(module).__name__})"
    if source == WHOLE_DERIVED:
        raise ValueError(
            f"{what} is given a tensor computed from a whole result only (a mean or norm over H computed over the "
            f"domain, or a global pool's result, then e.g. scaled or reshaped: whole and the same on every rank), "
            f"but it is a halo layer that takes its input for a shard of a field (a dropout would draw a different "
            f"mask on each rank, a conv exchange the copies as rows): apply the layer to the mean or pool's result "
            f"itself (a dropout then draws the unsharded model's mask), or compute on this tensor with pointwise ops "
            f"and torch's own layers")
    if source in (WHOLE_MEAN, WHOLE_SUM, WHOLE_NORM) and not getattr(module, "_halo_takes_whole", False):
        raise ValueError(
            f"{what} is given the result of a mean over H "
            f"(computed over the whole domain, whole and the same on every rank), but it is a halo layer that takes "
            f"its input for a shard of a field: use the result in pointwise ops or in torch's own functions (they "
            f"compute on the whole tensor), or pool with nn.AdaptiveAvgPool2d(1) in an nn.Sequential with the layers "
            f"that use it")
