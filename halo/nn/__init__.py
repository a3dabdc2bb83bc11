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
