"""Alias of :mod:`halo.tools.demo` (``halo demo``'s model), for scripts that build the demo's model by its old name.

``from halo.demo import DemoNet`` keeps working; the demo lives with the other tools in :mod:`halo.tools.demo`.
Thin on purpose (``tests/test_layering.py`` allows exactly this import of the tools).
"""

from .tools.demo import DemoNet, PolePadConv, make_field, pole_pad, run_demo

__all__ = ["DemoNet", "PolePadConv", "make_field", "pole_pad", "run_demo"]
