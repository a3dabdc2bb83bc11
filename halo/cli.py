"""Alias of :mod:`halo.tools.cli` for console scripts installed before the tools moved there.

A ``halo`` script written by an older ``pip install`` runs ``from halo.cli import main``; a fresh install points
at ``halo.tools.cli:main``. Thin on purpose (``tests/test_layering.py`` allows exactly this import of the tools).
"""

from .tools.cli import main

__all__ = ["main"]
