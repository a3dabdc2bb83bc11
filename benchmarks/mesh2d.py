"""``python benchmarks/mesh2d.py [options]``: the script form of ``halo bench --only mesh``; with ``--patch``, of
``halo bench --only mesh-patch`` (one conv layer: compute-then-patch on blocks vs pad-then-conv vs rows).

The benchmarks themselves are :mod:`halo.tools.benchmarks.mesh2d` and :mod:`halo.tools.benchmarks.mesh2d_patch`
(what they measure, their options: their docstrings, or ``--help``): they ship inside the package so that ``halo
bench`` runs from an installed wheel. This file keeps the script (and ``torchrun --nproc_per_node=N
benchmarks/mesh2d.py``) working from a checkout.
"""

import sys

if __name__ == "__main__":
    if "--patch" in sys.argv[1:]:
        from halo.tools.benchmarks.mesh2d_patch import main as patch_main

        sys.exit(patch_main(sys.argv[1:]))
    from halo.tools.benchmarks.mesh2d import main

    sys.exit(main())
