"""``python -m checkpointer``: the command line (see :mod:`checkpointer.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
