"""The dtype a torch op returns under the autocast in effect: asked of torch itself, once per case.

A halo layer stands in for a torch op (``DomainLayerNorm`` for ``F.layer_norm``, ``halo_interpolate`` for
``F.interpolate``, ...). Under ``torch.autocast`` torch casts that op's inputs by a per-device policy: on CUDA
``layer_norm``, ``group_norm``, ``softmax``, the ``upsample_*`` kernels and ``pow`` (so ``lp_pool2d``) run in
float32 and return float32 for a bf16 input; convolutions run in the lower precision; ``batch_norm``,
``max_pool2d``, ``pad`` keep the input's dtype. CPU autocast has other lists (it leaves the norms alone). A halo op
that keeps the input's dtype instead gives a different result from the unsharded model on a GPU, silently, and the
CPU test suite cannot see it. So halo keeps no list: :func:`result_dtype` runs torch's own op on fake tensors
(``FakeTensorMode``: no memory, no kernel, no device needed; CUDA's autocast kernels are registered on a CPU build
too) on the device whose policy applies, under that device's autocast state, and reads the dtype of the result.
Every halo op that replaces a torch op casts its input to that dtype where it differs (:func:`cast_as_torch`: what
autocast's own cast does, visible to autograd, so gradients come back in the input's dtype) and so computes and
returns what torch's op would.

The answer depends only on the op, the device type, the autocast state (enabled, dtype) and the inputs' dtypes, so it
is computed once per such case (a memo of a pure function: torch's policy does not change while a process runs)
and costs a dict look-up afterwards; under ``torch.compile`` it is a constant of the trace.

Tests fake another device's policy on CPU tensors with :func:`policy_of` (``policy_of("cuda")``: halo's ops follow
CUDA's autocast state and lists, whatever their tensors' device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from . import context
from .plan.plans import carry

__all__ = ["PROBES", "cast_as_torch", "policy_device", "policy_of", "result_dtype"]


@dataclasses.dataclass
class _AutocastState:
    """``device``: the device type whose autocast policy halo's ops follow (``None``: their tensors' own)."""

    device: str | None = None


def _state() -> _AutocastState:
    return context.state("autocast", _AutocastState)


@torch._dynamo.assume_constant_result
def _override() -> str | None:
    """:func:`policy_of`'s device, read outside any trace: dynamo calls this at trace time and keeps the answer as a
    constant, so a compiled graph never traces the context (whose slots a traced first access would add to)."""
    return _state().device


def policy_device(t: torch.Tensor) -> str:
    """The device type whose autocast applies to an op on ``t``: ``t``'s own, unless :func:`policy_of` says another."""
    override = _override() if torch.compiler.is_compiling() else _state().device
    return override or t.device.type


@contextlib.contextmanager
def policy_of(device: str) -> Iterator[None]:
    """Within the block, halo's ops follow ``device``'s autocast (its enabled state, its dtype, its op lists),
    whatever their tensors' device: how a CPU test checks the CUDA policy (enable it there with
    ``torch.set_autocast_enabled("cuda", True)``; ``torch.autocast("cuda")`` turns itself off without a GPU)."""
    st = _state()
    before, st.device = st.device, device
    try:
        yield
    finally:
        st.device = before


# -- how to call each torch op that halo stands in for (not its policy: torch applies that) ------------------------

Make = Callable[[tuple[int, ...], "torch.dtype | None"], "torch.Tensor | None"]


def _x4(make: Make, d: torch.dtype) -> torch.Tensor:
    return make((2, 4, 6, 6), d)


def _x5(make: Make, d: torch.dtype) -> torch.Tensor:
    return make((2, 4, 4, 6, 6), d)


def _conv(fn: Callable, x5: bool = False, transpose: bool = False) -> Callable:
    def probe(make: Make, xd, wd=None, bd=None) -> torch.Tensor:
        x = _x5(make, xd) if x5 else _x4(make, xd)
        w = make((4, 4) + (3,) * (x.dim() - 2), wd or xd)
        return fn(x, w, make((4,), bd))
    return probe


def _norm_wb(make: Make, c: int, wd, bd) -> tuple:
    return make((c,), wd), make((c,), bd)


PROBES: dict[str, Callable[..., torch.Tensor]] = {
    # (make, dtypes of the op's tensors in order, **static) -> torch's op on fake tensors of those dtypes
    "conv2d": _conv(F.conv2d),
    "conv3d": _conv(F.conv3d, x5=True),
    "conv_transpose2d": _conv(F.conv_transpose2d),
    "conv_transpose3d": _conv(F.conv_transpose3d, x5=True),
    "group_norm": lambda make, xd, wd=None, bd=None: F.group_norm(_x4(make, xd), 2, *_norm_wb(make, 4, wd, bd)),
    "instance_norm": lambda make, xd, wd=None, bd=None: F.instance_norm(
        _x4(make, xd), None, None, *_norm_wb(make, 4, wd, bd)),
    "batch_norm": lambda make, xd, wd=None, bd=None: F.batch_norm(
        _x4(make, xd), None, None, *_norm_wb(make, 4, wd, bd), training=True),
    "layer_norm": lambda make, xd, wd=None, bd=None: F.layer_norm(
        _x4(make, xd), (6, 6), make((6, 6), wd), make((6, 6), bd)),
    "softmax": lambda make, xd: F.softmax(_x4(make, xd), -2),
    "log_softmax": lambda make, xd: F.log_softmax(_x4(make, xd), -2),
    "interpolate": lambda make, xd, mode="nearest": F.interpolate(
        _x4(make, xd), scale_factor=2, mode=mode,
        **({"align_corners": False} if mode in ("bilinear", "bicubic") else {})),
    "max_pool2d": lambda make, xd: F.max_pool2d(_x4(make, xd), 2),
    "avg_pool2d": lambda make, xd: F.avg_pool2d(_x4(make, xd), 2),
    "max_pool3d": lambda make, xd: F.max_pool3d(_x5(make, xd), 2),
    "avg_pool3d": lambda make, xd: F.avg_pool3d(_x5(make, xd), 2),
    "adaptive_avg_pool2d": lambda make, xd: F.adaptive_avg_pool2d(_x4(make, xd), 3),
    "adaptive_max_pool2d": lambda make, xd: F.adaptive_max_pool2d(_x4(make, xd), 3),
    "lp_pool2d": lambda make, xd, norm_type=2.0: F.lp_pool2d(_x4(make, xd), norm_type, 2),
    "pad": lambda make, xd, mode="constant": F.pad(_x4(make, xd), (1, 1, 1, 1), mode=mode),
    "pixel_shuffle": lambda make, xd: F.pixel_shuffle(_x4(make, xd), 2),
    "pixel_unshuffle": lambda make, xd: F.pixel_unshuffle(_x4(make, xd), 2),
    "dropout": lambda make, xd: F.dropout(_x4(make, xd), 0.5, True),
    "alpha_dropout": lambda make, xd: F.alpha_dropout(_x4(make, xd), 0.5, True),
    "mean": lambda make, xd: torch.mean(_x4(make, xd), (-2, -1)),
    "sum": lambda make, xd: torch.sum(_x4(make, xd), (-2, -1)),
}


# -- asking torch -------------------------------------------------------------------------------------------------

@functools.cache
def _probe(op: str, device: str, enabled: bool, cast: torch.dtype, dtypes: tuple, static: tuple) -> torch.dtype:
    """The dtype of ``PROBES[op]`` run by torch on fake ``device`` tensors of ``dtypes`` under that autocast state.
    A pure function of its arguments (torch's policy is fixed in a process): memoised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def make(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor | None:
        return None if dtype is None else torch.empty(shape, dtype=dtype, device=device)

    was = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, enabled)
    torch.set_autocast_dtype(device, cast)
    try:
        # no torch-function mode (the guard's, the reroute's) sees the probe, no autograd graph is made
        with torch._C.DisableTorchFunction(), torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=False):
            return PROBES[op](make, *dtypes, **dict(static)).dtype
    finally:
        torch.set_autocast_enabled(device, was[0])
        torch.set_autocast_dtype(device, was[1])


@torch._dynamo.assume_constant_result
def _probe_constant(op: str, device: str, enabled: bool, cast: torch.dtype, dtypes: tuple,
                    static: tuple) -> torch.dtype:
    return _probe(op, device, enabled, cast, dtypes, static)


def result_dtype(op: str, x: torch.Tensor, *others: torch.Tensor | None, **static: Any) -> torch.dtype:
    """The dtype torch's ``op`` (a key of :data:`PROBES`) returns for inputs of ``x``'s and ``others``' dtypes
    (weight, bias, ... as the op takes them; ``None`` for an absent one) under the autocast in effect on
    :func:`policy_device` ``(x)``. ``static``: the op's arguments that can change its policy (``mode=`` of an
    interpolate: ``'area'`` is an adaptive pool, not an upsample)."""
    device = policy_device(x)
    key = (op, device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
           (x.dtype, *(t.dtype if t is not None else None for t in others)), tuple(sorted(static.items())))
    if torch.compiler.is_compiling():
        return _probe_constant(*key)
    return _probe(*key)


def cast_as_torch(op: str, x: torch.Tensor, *others: torch.Tensor | None, **static: Any) -> torch.Tensor:
    """``x`` cast to :func:`result_dtype` where that differs (float32 for a bf16 ``layer_norm`` input under CUDA
    autocast): computing from it gives what torch's op computes, in its dtype. An autograd-visible cast, as
    autocast's own, so the gradient comes back in ``x``'s dtype. Non-floating inputs are returned as they are."""
    if not x.is_floating_point():
        return x
    dtype = result_dtype(op, x, *others, **static)
    if dtype == x.dtype or not dtype.is_floating_point:
        return x
    y = x.to(dtype)
    if not torch.compiler.is_compiling():  # (a trace has no epochs to carry, and must not touch the context)
        carry(y, x)  # a shard halo made keeps its epoch: the layer's plan is recalled, not agreed again
    return y
