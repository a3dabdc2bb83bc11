"""Domain-parallel layers: each equals its torch twin on the full field, forward and backward.

Which torch class becomes which of these, and on which axes, is :func:`converts` (``halo.nn.registry``), beside each
layer's class. This package imports every module :func:`halo.nn.registry.layer_modules` names (each non-private
module of ``halo/nn``), so their decorators fill the registry, and exports exactly the registry's public names
(:func:`halo.nn.registry.exports`: the classes of ``@converts`` and the names marked ``@public``): a new layer is
its module and its test, with no edit here.
"""

import importlib

from .registry import exports, layer_modules

for _module in layer_modules():
    importlib.import_module(f"{__name__}.{_module}")

globals().update(exports())
__all__ = sorted(exports())  # noqa: PLE0605 - the registry's names (module docstring)


def __getattr__(name: str) -> object:
    """A layer's name before the one prefix (``HaloConv2d``: now ``DomainConv2d``), for one release, with a
    ``DeprecationWarning`` naming the new one (:data:`halo._moved.RENAMED`)."""
    import warnings

    from .._moved import RENAMED

    if name in RENAMED and RENAMED[name] in globals():
        warnings.warn(f"halo.nn.{name} is now halo.nn.{RENAMED[name]} (halo.nn's layers have one prefix, Domain); "
                      f"the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return globals()[RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
