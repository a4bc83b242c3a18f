"""Run every benchmark: `python -m benchmarks [--quick] [NAME ...]`.

Each prints its table, writes benchmarks/results/<name>.json and refreshes its block of
docs/benchmarks.md.  Benchmarks that a checkout lacks (or that fail) are reported and skipped, so
one broken benchmark does not hide the others' figures.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

ALL = ["partition_quality", "split_quality", "solver_scaling", "runtime_vs_peer", "cpu_binding", "simulator_error",
       "mesh_search", "scale", "checkpoint_io", "zero_memory", "cpu_profile"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", default=ALL, help=f"benchmarks to run (default: {' '.join(ALL)})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ns = parser.parse_args(argv)
    failed = []
    for name in ns.names:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            module.main(["--quick"] if ns.quick else [])
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - start:.1f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
