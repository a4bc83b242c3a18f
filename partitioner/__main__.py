"""`python -m partitioner compile | show | run`: the command line lives in the driver
(`driver.cli`), the package above the planner and the code generator; this entry point
only hands over to it."""

from __future__ import annotations

import sys

from driver.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
