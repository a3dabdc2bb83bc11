"""One place that says which torch class halo converts to which of its layers, and on which axes.

A halo layer registers itself with a class decorator beside its definition::

    @converts(nn.PixelShuffle, axes=2)
    class HaloPixelShuffle(HaloLayer, nn.PixelShuffle):
        ...

and :func:`halo.nn.convert_to_domain_parallel` reads this table; nothing else lists halo's layers (the converter's
table, the latitude x longitude list, the names in its messages and ``halo.nn``'s exports all come from here).

``axes``: how many domain axes the layer handles — 1: latitude rows only; 2: also a latitude x longitude mesh.
``make(module, ctx)``: the replacement of ``module`` (``ctx`` a :class:`halo.nn.convert.ConvertContext`).
Default: ``module`` itself where ``keep(module, ctx)`` says the instance needs no halo form (a pointwise conv, a
LayerNorm over W alone), else the halo class's ``from_torch(module, ctx)`` if it has one, else
``cls(module, **{f: ctx.f for f in takes})`` — ``takes`` the :class:`ConvertContext` fields the class's constructor
takes by keyword (default ``("group",)``, with ``"mesh"`` for a layer with ``axes=2``; a conv adds ``"boundary"``,
a batch norm ``"dp_group"``, a softmax takes none). ``mesh_ok(module)``: on a latitude x longitude mesh, whether
this instance has its 2-d form (an ``nn.Upsample`` mode, a global adaptive pool); default every instance.

The table is filled when halo's layer modules are imported and read-only afterwards (not state: it is code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Entry", "converts", "entries", "entry_of", "is_pointwise_conv", "pointwise_conv"]

Maker = Callable[[nn.Module, Any], nn.Module]


@dataclass(frozen=True)
class Entry:
    """A torch class, the halo class that replaces it, and how."""

    torch_class: type
    halo_class: type
    make: Maker
    axes: int = 1
    mesh_ok: Callable[[nn.Module], bool] | None = None
    keep: Callable[[nn.Module, Any], bool] | None = None

    def on_mesh(self, module: nn.Module) -> bool:
        """Whether ``module`` has a latitude x longitude form."""
        return self.axes >= 2 and (self.mesh_ok is None or self.mesh_ok(module))

    def keeps(self, module: nn.Module, ctx: Any) -> bool:
        """Whether ``module`` stays as it is under ``ctx`` (pointwise over the sharded dims: no halo form needed)."""
        return self.keep is not None and self.keep(module, ctx)


_TABLE: dict[type, Entry] = {}  # filled at import by @converts, read-only afterwards


def is_pointwise_conv(m: nn.Module, dims: int = 1) -> bool:
    """A conv that keeps every sharded dim pointwise (kernel 1, stride 1, no padding): H, or H and W."""
    for d in range(-2, -2 + dims):
        k = m.kernel_size[d] if len(m.kernel_size) >= 2 else 1
        s = m.stride[d] if len(m.stride) >= 2 else 1
        pad = m.padding if isinstance(m.padding, str) else m.padding[d]
        if not (k == 1 and s == 1 and pad in (0, "valid", "same")):
            return False
    return True


def pointwise_conv(m: nn.Module, ctx: Any) -> bool:
    """``keep=`` of the convs: pointwise over the dims ``ctx`` shards (H; H and W on a latitude x longitude mesh)."""
    return is_pointwise_conv(m, 2 if ctx.mesh is not None else 1)


def _default_make(cls: type, takes: tuple[str, ...], keep: Callable[[nn.Module, Any], bool] | None) -> Maker:
    from_torch = getattr(cls, "from_torch", None)

    def make(m: nn.Module, ctx: Any) -> nn.Module:
        if keep is not None and keep(m, ctx):
            return m
        if from_torch is not None:
            return from_torch(m, ctx)
        return cls(m, **{name: getattr(ctx, name) for name in takes})

    return make


def converts(*torch_classes: type, axes: int = 1, make: Maker | None = None,
             mesh_ok: Callable[[nn.Module], bool] | None = None,
             keep: Callable[[nn.Module, Any], bool] | None = None,
             takes: tuple[str, ...] | None = None) -> Callable[[type], type]:
    """Class decorator: the decorated halo class replaces instances of ``torch_classes`` (module docstring)."""
    if not torch_classes or axes not in (1, 2):
        raise ValueError(f"converts: give at least one torch class and axes 1 or 2, got {torch_classes}, {axes}")
    if make is not None and (keep is not None or takes is not None):
        raise ValueError("converts: make= builds the replacement itself; keep= and takes= shape the default make only")
    takes = takes if takes is not None else (("group", "mesh") if axes >= 2 else ("group",))

    def register(cls: type) -> type:
        fn = make if make is not None else _default_make(cls, takes, keep)
        for kind in torch_classes:
            known = _TABLE.get(kind)
            if known is not None and known.halo_class is not cls:
                raise ValueError(f"converts: {kind.__name__} is converted by {known.halo_class.__name__} already, "
                                 f"not also by {cls.__name__}")
            _TABLE[kind] = Entry(kind, cls, fn, axes, mesh_ok, keep)
        return cls

    return register


def entries() -> dict[type, Entry]:
    """Every registered torch class -> its entry (a copy). Complete once ``halo.nn`` is imported, which importing
    this module implies (the package imports every layer module; the registry imports none: they import it)."""
    return dict(_TABLE)


def entry_of(kind: type, table: dict[type, Entry] | None = None) -> Entry | None:
    """The entry of ``kind`` or of its nearest registered base class (in ``table``: default :func:`entries`)."""
    table = entries() if table is None else table
    return next((table[b] for b in kind.__mro__ if b in table), None)
