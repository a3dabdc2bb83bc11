"""The ``halo`` command and what only it uses: ``demo``, ``demo_data``, ``check`` (the command line of
:func:`halo.check_equivalence`), ``bench`` (and the benchmark scripts, shipped as ``halo.tools.benchmarks``),
``scale`` (the scale model on paper).

Tools sit on top of the library: they import it, it never imports them (``tests/test_layering.py`` checks), so
``import halo`` loads none of this and a tool's dependencies (matplotlib, the launcher) stay out of training jobs.
Importing this package imports nothing: each tool is loaded when its command runs.
"""
