"""Dropout, channel dropout, alpha dropout and drop-path whose draws do not depend on the sharding (``halo.random``).

Each is its torch (or timm / torchvision) twin with the masks drawn by global index: a converted model in train mode
gives the same output and gradients on 1, 2, 3 or 7 domain ranks, and the data-parallel replicas draw differently.
``convert_to_domain_parallel`` puts them in place of ``nn.Dropout``, ``nn.Dropout1d/2d/3d``, ``nn.AlphaDropout``,
``nn.FeatureAlphaDropout``, timm's ``DropPath`` and torchvision's ``StochasticDepth``. They also run in one process
without torch.distributed (the whole field), drawing what a sharded run draws.

Elementwise dropouts take a field ``(..., H_local, W)`` or tokens ``(B, H_local * W, C)`` flattened row-major from
one (the sharded dim is -2 either way) and refuse fewer than 3 dims, which cannot be told from a whole (replicated)
``(B, features)`` tensor. ``DomainDropout`` given a tensor halo marked whole and the same on every rank (the result
of a mean over H the guard computes, or of halo's global pools: ``halo.plan.plans.mark_whole``; a classifier head's
dropout after its pool) draws that tensor's mask as one process does, alike on every rank: the unsharded mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import random as hr
from ..autocast import cast_as_torch
from ..plan.plans import mark_whole, whole_source
from .base import DomainLayer
from .registry import converts, public

__all__ = [
    "DomainAlphaDropout",
    "DomainDropPath",
    "DomainDropout",
    "DomainDropout1d",
    "DomainDropout2d",
    "DomainDropout3d",
    "DomainFeatureAlphaDropout",
]


class _DomainRandom(DomainLayer):
    """Mixin: the layer base (the group, resolved at call time; the site of its plans; the mesh, whose blocks the
    draws of ``halo.random`` index globally), and the module path its errors name."""

    def _init_halo(self, group: Any | None, mesh: Any | None = None) -> None:
        self.halo_init(group, mesh)
        self._halo_path = ""

    def _name(self) -> str:
        return self._halo_path or type(self).__name__

    def extra_repr(self) -> str:
        return super().extra_repr() + ", sharding-invariant"


def _adopt_dropout(self: nn.Module, base: type, args: tuple, kwargs: dict) -> None:
    src = args[0] if args and isinstance(args[0], nn.Module) else None
    if src is not None:
        if not isinstance(src, base) or len(args) > 1 or kwargs:
            raise TypeError(f"{type(self).__name__} takes an nn.{base.__name__} (and group=), or nn.{base.__name__}'s "
                            f"own arguments")
        base.__init__(self, src.p, src.inplace)
        self.train(src.training)
    else:
        base.__init__(self, *args, **kwargs)


def _check_tokens(module: _DomainRandom, x: torch.Tensor) -> None:
    if x.dim() < 3:
        raise ValueError(
            f"{module._name()} ({type(module).__name__}): expected a field (B, C, H_local, W) or tokens "
            f"(B, H_local * W, C) split along dim -2, got shape {tuple(x.shape)}. A 2-d (B, features) tensor "
            f"may be whole on every rank (after a global pool) or a shard, and the two need different draws; "
            f"dropout on it is refused rather than guessed (a global mean or pool that halo computes marks its "
            f"result whole, and a dropout directly on that result draws it whole)")


@converts(nn.Dropout, axes=2, example=lambda kind: (kind(0.25), (2, 3, 23, 7)))
class DomainDropout(_DomainRandom, nn.Dropout):
    """``nn.Dropout`` with masks keyed on global indices: ``DomainDropout(dropout, group=...)`` or
    ``DomainDropout(p, inplace, group=...)``."""

    def __init__(self, *args: Any, group: Any | None = None, mesh: Any | None = None, **kwargs: Any) -> None:
        _adopt_dropout(self, nn.Dropout, args, kwargs)
        self._init_halo(group, mesh)

    #: it also takes a tensor whole and the same on every rank (marked so: a global mean or pool's result, as in a
    #: classifier head), drawing that tensor's one-process mask on every rank (``halo.random.dropout(whole=True)``)
    _halo_takes_whole = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        source = None if torch.compiler.is_compiling() else whole_source(x)
        if source is None:
            _check_tokens(self, x)
        x = cast_as_torch("dropout", x)  # torch's dtype under autocast (halo.autocast)
        out = hr.dropout(x, self.p, True, self.inplace, group=self.group, site=self._halo_site, mesh=self.halo_mesh,
                         whole=source is not None)
        if source is not None:
            mark_whole(out, source)  # whole in, whole out (the layers after it know it)
        return out


class _FeatureDropout(_DomainRandom):
    _base: type
    _batched_dims: int  # the dims of a batched input; one fewer is an unbatched one

    def __init__(self, *args: Any, group: Any | None = None, mesh: Any | None = None, **kwargs: Any) -> None:
        _adopt_dropout(self, self._base, args, kwargs)
        self._init_halo(group, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        batched = x.dim() != self._batched_dims - 1 or self._base is nn.Dropout2d  # torch: 3-d is (N, C, L) there
        x = cast_as_torch("dropout", x)  # torch's dtype under autocast (halo.autocast)
        return hr.feature_dropout(x, self.p, True, self.inplace, batched=batched, group=self.group,
                                  site=self._halo_site, mesh=self.halo_mesh)


@converts(nn.Dropout1d, axes=2, example=lambda kind: (kind(0.25), (2, 23, 7)))
class DomainDropout1d(_FeatureDropout, nn.Dropout1d):
    """``nn.Dropout1d``: whole channels, the same on every domain rank."""

    _base, _batched_dims = nn.Dropout1d, 3


@converts(nn.Dropout2d, axes=2, example=lambda kind: (kind(0.25), (2, 3, 23, 7)))
class DomainDropout2d(_FeatureDropout, nn.Dropout2d):
    """``nn.Dropout2d``: whole channels, the same on every domain rank."""

    _base, _batched_dims = nn.Dropout2d, 4


@converts(nn.Dropout3d, axes=2, example=lambda kind: (kind(0.25), (2, 3, 3, 23, 7)))
class DomainDropout3d(_FeatureDropout, nn.Dropout3d):
    """``nn.Dropout3d``: whole channels, the same on every domain rank."""

    _base, _batched_dims = nn.Dropout3d, 5


@converts(nn.AlphaDropout, axes=2, example=lambda kind: (kind(0.2), (2, 3, 23, 7)))
class DomainAlphaDropout(_DomainRandom, nn.AlphaDropout):
    """``nn.AlphaDropout`` with masks keyed on global indices."""

    def __init__(self, *args: Any, group: Any | None = None, mesh: Any | None = None, **kwargs: Any) -> None:
        _adopt_dropout(self, nn.AlphaDropout, args, kwargs)
        self._init_halo(group, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        _check_tokens(self, x)
        x = cast_as_torch("alpha_dropout", x)  # torch's dtype under autocast (halo.autocast)
        return hr.alpha_dropout(x, self.p, True, self.inplace, group=self.group, site=self._halo_site,
                                mesh=self.halo_mesh)


@converts(nn.FeatureAlphaDropout, axes=2, example=lambda kind: (kind(0.2), (2, 3, 23, 7)))
class DomainFeatureAlphaDropout(_DomainRandom, nn.FeatureAlphaDropout):
    """``nn.FeatureAlphaDropout``: whole channels, the same on every domain rank."""

    def __init__(self, *args: Any, group: Any | None = None, mesh: Any | None = None, **kwargs: Any) -> None:
        _adopt_dropout(self, nn.FeatureAlphaDropout, args, kwargs)
        self._init_halo(group, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        x = cast_as_torch("alpha_dropout", x)  # torch's dtype under autocast (halo.autocast)
        return hr.alpha_dropout(x, self.p, True, self.inplace, feature=True, group=self.group,
                                site=self._halo_site, mesh=self.halo_mesh)


@public
class DomainDropPath(_DomainRandom, nn.Module):
    """Stochastic depth per sample (timm's ``DropPath``; ``mode="batch"``: torchvision's ``StochasticDepth`` in
    batch mode): the same draw for a sample on every domain rank, another on each data-parallel replica.

    ``DomainDropPath(drop_prob, scale_by_keep=True, mode="row", group=...)``, or ``DomainDropPath.adopt(module)``
    for a timm ``DropPath`` (``drop_prob``, ``scale_by_keep``) or a torchvision ``StochasticDepth`` (``p``,
    ``mode``)."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True, mode: str = "row", *,
                 group: Any | None = None, mesh: Any | None = None) -> None:
        super().__init__()
        if mode not in ("row", "batch"):
            raise ValueError(f"DomainDropPath: mode must be 'row' or 'batch', got {mode!r}")
        self.drop_prob = float(drop_prob or 0.0)
        self.scale_by_keep = bool(scale_by_keep)
        self.mode = mode
        self._init_halo(group, mesh)

    @classmethod
    def adopt(cls, module: nn.Module, group: Any | None = None, mesh: Any | None = None) -> DomainDropPath:
        if hasattr(module, "drop_prob"):  # timm's DropPath and its many copies
            new = cls(module.drop_prob, getattr(module, "scale_by_keep", True), group=group, mesh=mesh)
        else:  # torchvision.ops.StochasticDepth(p, mode)
            new = cls(module.p, True, module.mode, group=group, mesh=mesh)
        new.train(module.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hr.drop_path(x, self.drop_prob, self.training, self.scale_by_keep, mode=self.mode, group=self.group,
                            site=self._halo_site, mesh=self.halo_mesh)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}, scale_by_keep={self.scale_by_keep}, mode={self.mode!r}, " \
               f"sharding-invariant"
