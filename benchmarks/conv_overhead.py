"""``python benchmarks/conv_overhead.py [options]``: the script form of ``halo bench --only conv``.

The benchmark itself is :mod:`halo.tools.benchmarks.conv_overhead` (what it measures, its options: its docstring, or
``--help``): it ships inside the package so that ``halo bench`` runs from an installed wheel. This file keeps the
script (and ``torchrun --nproc_per_node=N benchmarks/conv_overhead.py``) working from a checkout.
"""

import sys

from halo.tools.benchmarks.conv_overhead import main

if __name__ == "__main__":
    sys.exit(main())
