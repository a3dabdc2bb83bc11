"""``python benchmarks/halo_bandwidth.py [options]``: the script form of ``halo bench --only bandwidth``.

The benchmark itself is :mod:`halo.tools.benchmarks.halo_bandwidth` (what it measures, its options: its docstring, or
``--help``): it ships inside the package so that ``halo bench`` runs from an installed wheel. This file keeps the
script (and ``torchrun --nproc_per_node=N benchmarks/halo_bandwidth.py``) working from a checkout.
"""

import sys

from halo.tools.benchmarks.halo_bandwidth import main

if __name__ == "__main__":
    sys.exit(main())
