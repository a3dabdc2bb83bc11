"""``python benchmarks/mesh2d.py [options]``: the script form of ``halo bench --only mesh``.

The benchmark itself is :mod:`halo.tools.benchmarks.mesh2d` (what it measures, its options: its docstring, or
``--help``): it ships inside the package so that ``halo bench`` runs from an installed wheel. This file keeps the
script (and ``torchrun --nproc_per_node=N benchmarks/mesh2d.py``) working from a checkout.
"""

import sys

from halo.tools.benchmarks.mesh2d import main

if __name__ == "__main__":
    sys.exit(main())
