"""Old module paths (before the packages of issue 31), kept for one release: each resolves to the *same module
object* as its new path, so an ``isinstance``, a monkeypatch or a module-level state read through an old path sees
the real thing. Importing one warns (``DeprecationWarning``) with the new path.

The finder is one table: nothing else registers here, and nothing outside this module reads it but the finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> new module path (halo.exchange, halo.io, halo.check, halo.guard, halo.parallel keep their
#: names: they are the packages' faces now)
MOVED: dict[str, str] = {
    "halo.agree": "halo.plan.agree",
    "halo.check_boundary": "halo.check._boundary",
    "halo.check_record": "halo.check._record",
    "halo.check_report": "halo.check._report",
    "halo.comm": "halo.dist.comm",
    "halo.entry": "halo.plan.entry",
    "halo.exchange_ops": "halo.exchange._ops",
    "halo.exchange_registry": "halo.exchange._registry",
    "halo.exchanger": "halo.exchange.exchanger",
    "halo.geometry": "halo.plan.geometry",
    "halo.groups": "halo.dist.groups",
    "halo.guard_follow": "halo.guard._follow",
    "halo.guard_ops": "halo.guard._ops",
    "halo.guard_rules": "halo.guard._policy",
    "halo.io_grid": "halo.io._grid",
    "halo.io_steps": "halo.io._steps",
    "halo.io_watch": "halo.io._watch",
    "halo.io_write": "halo.io._write",
    "halo.mesh": "halo.dist.mesh",
    "halo.partition": "halo.plan.partition",
    "halo.plans": "halo.plan.plans",
    "halo.reduce": "halo.parallel.reduce",
    "halo.reduce_grads": "halo.parallel._grads",
    "halo.reduce_layout": "halo.parallel.layout",
    "halo.reduce_marks": "halo.parallel.marks",
    "halo.reduce_weights": "halo.parallel._weights",
    "halo.replicated": "halo.plan.replicated",
    "halo.reroute": "halo.guard.reroute",
    "halo.sampler": "halo.io.sampler",
    "halo.transport": "halo.dist.transport",
}

#: old public class name -> new (halo.nn's layers took one prefix, ``Domain``; the old names resolve, one release)
RENAMED: dict[str, str] = {
    "HaloAdaptiveAvgPool2d": "DomainAdaptiveAvgPool2d",
    "HaloAdaptiveMaxPool2d": "DomainAdaptiveMaxPool2d",
    "HaloAvgPool2d": "DomainAvgPool2d",
    "HaloAvgPool3d": "DomainAvgPool3d",
    "HaloConv2d": "DomainConv2d",
    "HaloConv2dSame": "DomainConv2dSame",
    "HaloConv3d": "DomainConv3d",
    "HaloConvTranspose2d": "DomainConvTranspose2d",
    "HaloConvTranspose3d": "DomainConvTranspose3d",
    "HaloCreditPatchEmbed": "DomainCreditPatchEmbed",
    "HaloCubeEmbedding": "DomainCubeEmbedding",
    "HaloFPABlock": "DomainFPABlock",
    "HaloLPPool2d": "DomainLPPool2d",
    "HaloLayer": "DomainLayer",
    "HaloMaxPool2d": "DomainMaxPool2d",
    "HaloMaxPool3d": "DomainMaxPool3d",
    "HaloPad2d": "DomainPad2d",
    "HaloPad3d": "DomainPad3d",
    "HaloPartitionAttention": "DomainPartitionAttention",
    "HaloPartitionedAttention": "DomainPartitionedAttention",
    "HaloPatchEmbed": "DomainPatchEmbed",
    "HaloPatchMerging": "DomainPatchMerging",
    "HaloPixelShuffle": "DomainPixelShuffle",
    "HaloPixelUnshuffle": "DomainPixelUnshuffle",
    "HaloSegformerDecoder": "DomainSegformerDecoder",
    "HaloSwinTransformerBlock": "DomainSwinTransformerBlock",
    "HaloSwinV2Block": "DomainSwinV2Block",
    "HaloUTransformer": "DomainUTransformer",
    "HaloUnetDecoder": "DomainUnetDecoder",
    "HaloUnetDecoderBlock": "DomainUnetDecoderBlock",
    "HaloUpsample": "DomainUpsample",
    "HaloWindowAttention": "DomainWindowAttention",
    "HaloWindowAttentionV2": "DomainWindowAttentionV2",
}

__all__ = ["MOVED", "RENAMED"]


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # already executed under its new path; the import system set ``__spec__`` to the alias's: give it back
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
