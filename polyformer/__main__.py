"""`python -m polyformer COMMAND`: the command line (see `train/cli.py`)."""

from __future__ import annotations

import sys

from .train.cli import main

if __name__ == "__main__":
    sys.exit(main())
