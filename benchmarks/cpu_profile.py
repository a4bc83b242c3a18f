"""How long measuring this machine's `cpu` hardware profile takes (gloo between 2
processes, the 1F1B exchange under load), and what the cached load then costs: the
figures that tests/partitioner/test_hardware.py checks for correctness only.

Each row loads the profile into an empty cache (measured), then again (cached).

    python -m benchmarks.cpu_profile [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from partitioner.cost.hardware import load_hardware

from .common import save, table

__all__ = ["main", "measure_once"]


def measure_once() -> dict[str, Any]:
    """Seconds to measure the profile into an empty cache, and to load it back."""
    with tempfile.TemporaryDirectory() as cache:
        before = os.environ.get("PARTITIONER_CACHE")
        os.environ["PARTITIONER_CACHE"] = cache
        try:
            start = time.perf_counter()
            load_hardware("cpu")
            measured = time.perf_counter() - start
            load_hardware("cpu")
            cached = time.perf_counter() - start - measured
        finally:
            os.environ.pop("PARTITIONER_CACHE")
            if before is not None:
                os.environ["PARTITIONER_CACHE"] = before
    return {"measured_s": measured, "cached_s": cached}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one measurement instead of three")
    ns = parser.parse_args(argv)
    rows = [measure_once() for _ in range(1 if ns.quick else 3)]
    print(table(rows, ["measured_s", "cached_s"]))
    print(f"\nmedian to measure: {statistics.median(r['measured_s'] for r in rows):.2f} s "
          f"({os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    save("cpu_profile", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
