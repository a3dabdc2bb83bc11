"""One place that says which torch class halo converts to which of its layers, and on which axes.

A halo layer registers itself with a class decorator beside its definition::

    @converts(nn.PixelShuffle, axes=2)
    class DomainPixelShuffle(DomainLayer, nn.PixelShuffle):
        ...

and :func:`halo.nn.convert_to_domain_parallel` reads this table; nothing else lists halo's layers. What comes from
here: ``halo.nn``'s exports (:func:`exports`: every halo class registered with :func:`converts` and every name marked
:func:`public`), the converter's tables (the latitude x longitude list, the pools :func:`halo.nn.pool.halo_pool`
knows, the names in its messages), the hint for a torch function with a layer as its exact twin
(:func:`functional_twins`, :func:`twin_hint`: the guard's to read), the modes matrix's cases (``example=``,
tests/test_modes.py) and the docs' layer lists (docs/hooks/registry.py). The modules that fill it are found by
:func:`layer_modules` (every non-private module of ``halo.nn``, which the package imports): a new layer is its module
and its test, no other edit.

``axes``: how many domain axes the layer handles — 1: latitude rows only; 2: also a latitude x longitude mesh.
``make(module, ctx)``: the replacement of ``module`` (``ctx`` a :class:`halo.nn.convert.ConvertContext`).
Default: ``module`` itself where ``keep(module, ctx)`` says the instance needs no halo form (a pointwise conv, a
LayerNorm over W alone), else the halo class's ``from_torch(module, ctx)`` if it has one, else
``cls(module, **{f: ctx.f for f in takes})`` — ``takes`` the :class:`ConvertContext` fields the class's constructor
takes by keyword (default ``("group",)``, with ``"mesh"`` for a layer with ``axes=2``; a conv adds ``"boundary"``,
a batch norm ``"dp_group"``, a softmax takes none). ``mesh_ok(module)``: on a latitude x longitude mesh, whether
this instance has its 2-d form (an ``nn.Upsample`` mode, a global adaptive pool); default every instance.
``functional``: the torch functions the layer is the exact form of (``F.pixel_shuffle`` for ``nn.PixelShuffle``):
:func:`twin_hint` says which module to use instead, for the guard to name when it refuses such a call on a shard
(the guard's own rule messages still carry their hints until it reads this; issue 31 item 5).
``example(kind)``: ``(module, shape)``, a small instance of the torch class ``kind`` (one of ``torch_classes``) and
the shape of a field it takes (H at dim -2, odd sizes): the modes matrix (tests/test_modes.py) runs it, converted,
against the unsharded module, so a registered layer is in the matrix with no edit there.

The table is filled when halo's layer modules are imported and read-only afterwards (not state: it is code).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

__all__ = ["Entry", "converts", "entries", "entry_of", "exports", "functional_twins", "is_pointwise_conv",
           "layer_modules", "pointwise_conv", "public", "twin_hint"]

Maker = Callable[[nn.Module, Any], nn.Module]
#: ``example(kind)`` of a registered layer: a small ``kind`` module and the shape of a field it takes
Example = Callable[[type], tuple[nn.Module, tuple[int, ...]]]
T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """A torch class, the halo class that replaces it, and how."""

    torch_class: type
    halo_class: type
    make: Maker
    axes: int = 1
    mesh_ok: Callable[[nn.Module], bool] | None = None
    keep: Callable[[nn.Module, Any], bool] | None = None
    functional: tuple[Callable, ...] = ()
    example: Example | None = None

    def on_mesh(self, module: nn.Module) -> bool:
        """Whether ``module`` has a latitude x longitude form."""
        return self.axes >= 2 and (self.mesh_ok is None or self.mesh_ok(module))

    def keeps(self, module: nn.Module, ctx: Any) -> bool:
        """Whether ``module`` stays as it is under ``ctx`` (pointwise over the sharded dims: no halo form needed)."""
        return self.keep is not None and self.keep(module, ctx)


_TABLE: dict[type, Entry] = {}  # filled at import by @converts, read-only afterwards
_EXPORTS: dict[str, Any] = {}  # halo.nn's public names: filled at import by @converts and @public, read-only after


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


def _export(obj: Any, name: str) -> None:
    known = _EXPORTS.get(name)
    if known is not None and known is not obj:
        raise ValueError(f"halo.nn exports {name} from {known.__module__} already, not also from {obj.__module__}")
    _EXPORTS[name] = obj


def public(obj: T) -> T:
    """Decorator: ``obj`` (a function, or a layer made from a third-party class by name) is one of ``halo.nn``'s
    public names (:func:`exports`). A class registered with :func:`converts` is public already."""
    name = getattr(obj, "__name__", None)
    if not isinstance(name, str) or name.startswith("_"):
        raise ValueError(f"public: a public name needs a __name__ without a leading underscore, got {obj!r}")
    _export(obj, name)
    return obj


def converts(*torch_classes: type, axes: int = 1, make: Maker | None = None,
             mesh_ok: Callable[[nn.Module], bool] | None = None,
             keep: Callable[[nn.Module, Any], bool] | None = None,
             takes: tuple[str, ...] | None = None, functional: tuple[Callable, ...] = (),
             example: Example | None = None) -> Callable[[type], type]:
    """Class decorator: the decorated halo class replaces instances of ``torch_classes`` (module docstring), and is
    one of ``halo.nn``'s public names."""
    if not torch_classes or axes not in (1, 2):
        raise ValueError(f"converts: give at least one torch class and axes 1 or 2, got {torch_classes}, {axes}")
    if make is not None and (keep is not None or takes is not None):
        raise ValueError("converts: make= builds the replacement itself; keep= and takes= shape the default make only")
    if not isinstance(functional, tuple) or not all(callable(f) for f in functional):
        raise TypeError(f"converts: functional= takes a tuple of torch functions, got {functional!r}")
    takes = takes if takes is not None else (("group", "mesh") if axes >= 2 else ("group",))

    def register(cls: type) -> type:
        fn = make if make is not None else _default_make(cls, takes, keep)
        twins = functional_twins()
        for f in functional:
            if twins.get(f, cls) is not cls:
                raise ValueError(f"converts: {getattr(f, '__name__', f)} is the functional twin of "
                                 f"{twins[f].__name__} already, not also of {cls.__name__}")
        for kind in torch_classes:
            known = _TABLE.get(kind)
            if known is not None and known.halo_class is not cls:
                raise ValueError(f"converts: {kind.__name__} is converted by {known.halo_class.__name__} already, "
                                 f"not also by {cls.__name__}")
            _TABLE[kind] = Entry(kind, cls, fn, axes, mesh_ok, keep, functional, example)
        if _ours(cls):  # a user's own registration converts, but is not one of halo.nn's names
            _export(cls, cls.__name__)
        return cls

    return register


def _ours(obj: Any) -> bool:
    return getattr(obj, "__module__", "").startswith("halo.")


def entries(ours: bool = False) -> dict[type, Entry]:
    """Every registered torch class -> its entry (a copy), in registration order. Complete once ``halo.nn`` is
    imported, which importing this module implies (the package imports every module :func:`layer_modules` names;
    the registry imports none: they import it). ``ours``: halo's own registrations only (not a user's
    ``@converts`` of a layer of their own)."""
    return {k: e for k, e in _TABLE.items() if not ours or _ours(e.halo_class)}


def exports() -> dict[str, Any]:
    """``halo.nn``'s public names -> their objects (a copy): the halo classes of :func:`converts` and the names
    marked :func:`public`. ``halo.nn`` exports exactly these (its ``__all__``)."""
    return dict(_EXPORTS)


def functional_twins() -> dict[Callable, type]:
    """Torch function -> the halo class that is its exact form (``F.pixel_shuffle`` -> ``DomainPixelShuffle``), from
    the ``functional=`` of :func:`converts`."""
    return {f: e.halo_class for e in _TABLE.values() for f in e.functional}


def twin_hint(func: Callable) -> str | None:
    """What the guard says to do instead of ``func`` on a shard, or ``None`` (no registered twin): the torch modules
    that are converted to its exact form, e.g. ``"use nn.PixelShuffle in the model (converted exactly, to
    halo.nn.DomainPixelShuffle)"``."""
    kinds = [k for k, e in _TABLE.items() if func in e.functional]
    if not kinds:
        return None
    halo = _TABLE[kinds[0]].halo_class.__name__
    return f"use {' / '.join(f'nn.{k.__name__}' for k in kinds)} in the model (converted exactly, to halo.nn.{halo})"


def layer_modules() -> tuple[str, ...]:
    """The modules of ``halo.nn`` that the package imports (so that their decorators fill this registry): every
    module of the package folder whose name does not start with ``_``, by name. Nothing is imported here."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                        if not m.name.startswith("_")))


def entry_of(kind: type, table: dict[type, Entry] | None = None) -> Entry | None:
    """The entry of ``kind`` or of its nearest registered base class (in ``table``: default :func:`entries`)."""
    table = entries() if table is None else table
    return next((table[b] for b in kind.__mro__ if b in table), None)


public(converts)  # halo.nn.converts: how a layer of one's own registers
