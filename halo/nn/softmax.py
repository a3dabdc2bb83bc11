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
from .base import HaloLayer
from .registry import converts

__all__ = ["DomainLogSoftmax", "DomainSoftmax"]


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
class DomainSoftmax(HaloLayer, nn.Softmax):
    """``nn.Softmax`` on an H-shard (module docstring): the same numbers, or an error naming the module."""

    def __init__(self, softmax: nn.Softmax, path: str = "") -> None:
        super().__init__(softmax.dim)
        self._halo_path = path
        self.halo_init()  # a halo layer: conversion leaves it as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check(self, x)
        return super().forward(cast_as_torch("softmax", x))  # float32 under CUDA autocast: the same values


@converts(nn.LogSoftmax, takes=(), example=lambda kind: (kind(dim=1), (2, 3, 23, 7)))
class DomainLogSoftmax(HaloLayer, nn.LogSoftmax):
    """``nn.LogSoftmax`` on an H-shard (module docstring): the same numbers, or an error naming the module."""

    def __init__(self, softmax: nn.LogSoftmax, path: str = "") -> None:
        super().__init__(softmax.dim)
        self._halo_path = path
        self.halo_init()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check(self, x)
        return super().forward(cast_as_torch("log_softmax", x))
