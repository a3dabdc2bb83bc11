"""One place that says which torch class halo converts to which of its layers, and on which axes.

A halo layer registers itself with a class decorator beside its definition::

    @converts(nn.PixelShuffle, axes=2)
    class HaloPixelShuffle(HaloLayer, nn.PixelShuffle):
        ...

and :func:`halo.nn.convert_to_domain_parallel` reads this table; nothing else lists halo's layers (the converter's
table, the latitude x longitude list, the names in its messages and ``halo.nn``'s exports all come from here).

``axes``: how many domain axes the layer handles — 1: latitude rows only; 2: also a latitude x longitude mesh.
``make(module, ctx)``: the replacement of ``module`` (``ctx`` a :class:`halo.nn.convert.ConvertContext`); it may
return ``module`` itself where the instance needs no halo form (a pointwise conv, a LayerNorm over W alone).
Default: the halo class's ``from_torch(module, ctx)`` if it has one, else ``cls(module, group=ctx.group)`` (with
``mesh=ctx.mesh`` for a layer with ``axes=2``). ``mesh_ok(module)``: on a latitude x longitude mesh, whether this
instance has its 2-d form (e.g. an ``nn.Upsample`` mode); default every instance.

The table is filled when halo's layer modules are imported and read-only afterwards (not state: it is code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Entry", "converts", "entries", "entry_of"]

Maker = Callable[[nn.Module, Any], nn.Module]


@dataclass(frozen=True)
class Entry:
    """A torch class, the halo class that replaces it, and how."""

    torch_class: type
    halo_class: type
    make: Maker
    axes: int = 1
    mesh_ok: Callable[[nn.Module], bool] | None = None

    def on_mesh(self, module: nn.Module) -> bool:
        """Whether ``module`` has a latitude x longitude form."""
        return self.axes >= 2 and (self.mesh_ok is None or self.mesh_ok(module))


_TABLE: dict[type, Entry] = {}  # filled at import by @converts, read-only afterwards


def _default_make(cls: type, axes: int) -> Maker:
    from_torch = getattr(cls, "from_torch", None)
    if from_torch is not None:
        return from_torch
    if axes >= 2:
        return lambda m, ctx: cls(m, group=ctx.group, mesh=ctx.mesh)
    return lambda m, ctx: cls(m, group=ctx.group)


def converts(*torch_classes: type, axes: int = 1, make: Maker | None = None,
             mesh_ok: Callable[[nn.Module], bool] | None = None) -> Callable[[type], type]:
    """Class decorator: the decorated halo class replaces instances of ``torch_classes`` (module docstring)."""
    if not torch_classes or axes not in (1, 2):
        raise ValueError(f"converts: give at least one torch class and axes 1 or 2, got {torch_classes}, {axes}")

    def register(cls: type) -> type:
        fn = make if make is not None else _default_make(cls, axes)
        for kind in torch_classes:
            known = _TABLE.get(kind)
            if known is not None and known.halo_class is not cls:
                raise ValueError(f"converts: {kind.__name__} is converted by {known.halo_class.__name__} already, "
                                 f"not also by {cls.__name__}")
            _TABLE[kind] = Entry(kind, cls, fn, axes, mesh_ok)
        return cls

    return register


def entries() -> dict[type, Entry]:
    """Every registered torch class -> its entry (a copy; halo's layer modules are imported first)."""
    from . import conv, dropout, norm, pad, pool, shuffle, softmax, upsample  # noqa: F401  (they register)

    return dict(_TABLE)


def entry_of(kind: type) -> Entry | None:
    """The entry of ``kind`` or of its nearest registered base class."""
    table = entries()
    return next((table[b] for b in kind.__mro__ if b in table), None)
