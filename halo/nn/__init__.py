"""Domain-parallel layers: each equals its torch twin on the full field, forward and backward.

Which torch class becomes which of these, and on which axes, is :func:`converts` (``halo.nn.registry``), beside each
layer's class. This package imports every module :func:`halo.nn.registry.layer_modules` names (each non-private
module of ``halo/nn``), so their decorators fill the registry, and exports exactly the registry's public names
(:func:`halo.nn.registry.exports`: the classes of ``@converts`` and the names marked ``@public``): a new layer is
its module and its test, with no edit here.
"""

import importlib

from .registry import exports, layer_modules, public

for _module in layer_modules():
    importlib.import_module(f"{__name__}.{_module}")

#: Public names of modules that do not mark them with ``@public`` yet (issue 31 item 5: each is marked beside its
#: definition at the merge, and this table goes). Listed here by module, marked with the same decorator.
_UNTIL_MARKED = {
    "norm": ("DomainBatchNormAct2d",),
    "upsample": ("halo_interpolate",),
}
for _module, _names in _UNTIL_MARKED.items():
    for _name in _names:
        _obj = getattr(importlib.import_module(f"{__name__}.{_module}"), _name)
        if _obj not in exports().values():
            public(_obj)

globals().update(exports())
__all__ = sorted(exports())  # noqa: PLE0605 - the registry's names (module docstring)
