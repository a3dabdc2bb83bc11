"""Softmax and log-softmax on an H-shard: pointwise in latitude when they normalise over a dim other than H.

``nn.Softmax(dim)`` / ``nn.LogSoftmax(dim)`` over channels (dim 1 of ``(B, C, H, W)``) mix no latitude rows: every
rank computes its rows exactly. Over H (dim 2), or over a dim that a model made by flattening H with W
(``(B, C, H * W)``, MAnet's attention; the keys of an attention map ``(B, heads, H * W, H * W)``), the
normalisation runs over the whole field: computing it per shard is silently wrong, so these raise, naming the
module. Which is which is decided from the input at each call (the module cannot know how its input was made): a
4-d input with ``dim`` 0 or 1, or a 3-d input ``(C, H, W)`` / ``(B, C, L)`` with ``dim`` 0 (channels or batch either
way); anything else is refused. That refuses a softmax over longitude (dim 3 of a field) too, which cannot be told
from an attention map's keys: declare such a model's softmax with ``custom_converters={nn.Softmax: None}``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..autocast import cast_as_torch
from .base import DomainLayer
from .registry import converts, public

__all__ = ["DomainLogSoftmax", "DomainSoftmax", "domain_softmax"]


@public
def domain_softmax(x: torch.Tensor, dim: int, *, log: bool = False, dtype: torch.dtype | None = None,
                   group: object | None = None) -> torch.Tensor:
    """``softmax`` (``log=True``: ``log_softmax``) over ``dim``, the dim of ``x`` that is split over ``group`` (a
    field's rows, or tokens that hold them): the unsharded op's numbers on this rank's part. The global maximum (an
    all-reduce; a shift the result does not depend on, so no gradient flows through it) and the global sum of the
    exponentials (an all-reduce with its plain adjoint, which makes the backward exact: every rank's share of
    ``sum(g * y)`` reaches every rank). bf16 / fp16 are computed in float32 and returned in their dtype (torch's
    own kernel accumulates so); under autocast the dtype is torch's (:func:`halo.autocast.cast_as_torch`). A rank
    holding none of the dim takes part with an empty share. What the guard computes for ``F.softmax`` and
    ``F.log_softmax`` over H (:mod:`halo.guard.reroute`)."""
    from ..parallel.reduce import accumulation_dtype, all_reduce

    x = cast_as_torch("log_softmax" if log else "softmax", x) if dtype is None else x.to(dtype)
    out_dtype = x.dtype
    x = x.to(accumulation_dtype(x.dtype))
    d = dim % x.dim()
    with torch.no_grad():
        shape = [1 if i == d else s for i, s in enumerate(x.shape)]
        local = x.amax(d, keepdim=True) if x.shape[d] else x.new_full(shape, float("-inf"))
        m = all_reduce(local, "max", group=group)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: torch's NaN comes out as torch's
    z = x - m
    total = all_reduce(torch.exp(z).sum(d, keepdim=True), group=group)
    out = z - torch.log(total) if log else torch.exp(z) / total
    return out.to(out_dtype)


def _check(module: nn.Module, x: torch.Tensor) -> None:
    dim = module.dim
    if dim is None:  # torch's legacy choice of dim
        dim = 0 if x.dim() in (0, 1, 3) else 1
    d = dim % max(x.dim(), 1)
    if (x.dim() == 4 and d in (0, 1)) or (x.dim() == 3 and d == 0):
        return
    name = type(module).__name__.removeprefix("Domain")
    if x.dim() == 4 and d == 2:
        what = "H"
    elif x.dim() == 4:
        what = ("the last dim, which is longitude in a (B, C, H, W) field but the keys of an attention map "
                "(B, heads, H x W, H x W), and halo cannot tell them apart (if it is longitude, declare "
                f"custom_converters={{nn.{name}: None}}: it then applies to every nn.{name} of the model)")
    else:
        what = "a dim that may hold H (e.g. H x W flattened)"
    raise ValueError(
        f"{module._halo_path or name} (nn.{name}(dim={module.dim})) on an input of shape {tuple(x.shape)}: "
        f"halo shards latitude (dim -2 of (B, C, H, W)), and this would normalise over {what}, which a shard "
        f"cannot do on its own. Normalise over channels, or gather the field first (halo.gather)")


@converts(nn.Softmax, takes=(), example=lambda kind: (kind(dim=1), (2, 3, 23, 7)))  # over H: refused
class DomainSoftmax(DomainLayer, nn.Softmax):
    """``nn.Softmax`` on an H-shard (module docstring): the same numbers, or an error naming the module."""

    def __init__(self, softmax: nn.Softmax, path: str = "") -> None:
        super().__init__(softmax.dim)
        self._halo_path = path
        self.halo_init()  # a halo layer: conversion leaves it as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check(self, x)
        return super().forward(cast_as_torch("softmax", x))  # float32 under CUDA autocast: the same values


@converts(nn.LogSoftmax, takes=(), example=lambda kind: (kind(dim=1), (2, 3, 23, 7)))
class DomainLogSoftmax(DomainLayer, nn.LogSoftmax):
    """``nn.LogSoftmax`` on an H-shard (module docstring): the same numbers, or an error naming the module."""

    def __init__(self, softmax: nn.LogSoftmax, path: str = "") -> None:
        super().__init__(softmax.dim)
        self._halo_path = path
        self.halo_init()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check(self, x)
        return super().forward(cast_as_torch("log_softmax", x))
