"""``python -m halo demo|bench``: the same as the ``halo`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
