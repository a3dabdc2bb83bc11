"""``python -m halo demo|check|bench``: the same as the ``halo`` console script (:mod:`halo.tools.cli`)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
