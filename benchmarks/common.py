"""What every benchmark script shares: a markdown table, a JSON result, the block in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from runtime.manifest import Manifest, read_manifest
from runtime.schedule import placement

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def compile_process(model: str, out: Path, options: Sequence[str], env: dict[str, str] | None = None
                    ) -> tuple[Manifest, float, list[str]]:
    """`python -m partitioner compile MODEL --out OUT OPTIONS` in its own process (one
    thread unless OMP_NUM_THREADS says otherwise): the manifest it wrote, its wall time and
    the command line it ran."""
    argv = [sys.executable, "-m", "partitioner", "compile", model, "--out", str(out), *options]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    return read_manifest(out), wall, argv


def rank_peak_bytes(m: Manifest) -> int:
    """The most predicted memory on one pipeline rank: a device holds every stage of its
    rank (interleaved, zb-v: several)."""
    assert m.predicted is not None
    ranks = placement(m.schedule, len(m.stages), m.mesh.pp)
    return max(sum(s.memory_bytes for k, s in enumerate(m.predicted.stages) if ranks[k] == r) for r in range(m.mesh.pp))


def load_package(directory: str | Path) -> Any:
    """A generated package imported from its folder (its MANIFEST and load_stage)."""
    import importlib.util

    folder = Path(directory)
    spec = importlib.util.spec_from_file_location(f"bench_pkg_{abs(hash(str(folder)))}", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def profiled_here() -> Iterator[Path]:
    """A temporary work folder with a private profile cache and torch on one thread: the
    cpu profile (its gloo alpha-beta included) and the node costs are measured now,
    under the conditions the ranks then run in (one thread each).  Both are restored after."""
    old_cache, old_threads = os.environ.get("PARTITIONER_CACHE"), torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            os.environ["PARTITIONER_CACHE"] = str(work / "cache")
            torch.set_num_threads(1)
            yield work
    finally:
        torch.set_num_threads(old_threads)
        if old_cache is None:
            os.environ.pop("PARTITIONER_CACHE", None)
        else:
            os.environ["PARTITIONER_CACHE"] = old_cache


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple[Any, ...], deadline_s: float) -> None:
    """`worker(rank, *args)` in `world` processes; killed (and TimeoutError) at the deadline."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(worker, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the benchmark's {world} workers did not finish in {deadline_s:g} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def barrier_timed(call: Callable[[], Any]) -> float:
    """Seconds of `call()` between two barriers of the default process group (every rank
    starts together and the slowest one sets the time)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    call()
    dist.barrier()
    return time.perf_counter() - start


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of `rows` over `columns` (floats to 3 significant digits)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def save(name: str, rows: Sequence[dict[str, Any]], **extra: Any) -> Path:
    """Write benchmarks/results/<name>.json with the machine it ran on."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rows": list(rows),
        **extra,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


#: the page whose `<!-- bench:NAME -->` blocks the benchmarks rewrite
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"


def update_docs(block: str, text: str, *, append: bool = False, page: Path | None = None) -> None:
    """Replace docs/benchmarks.md (or `page`) between `<!-- bench:block -->` and
    `<!-- /bench:block -->` (with `append`, a page without the block gets it at its end)."""
    page = page or DOCS_PAGE
    content = page.read_text()
    start, end = f"<!-- bench:{block} -->", f"<!-- /bench:{block} -->"
    if start not in content and append:
        content = content.rstrip("\n") + f"\n\n{start}\n{end}\n"
    elif start not in content:
        return
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    page.write_text(pattern.sub(lambda _m: f"{start}\n{text}\n{end}", content))


def stage_sweep(argv: list[str] | None, doc: str, models: Sequence[str], stage_counts: Sequence[int],
                run: Callable[[str, int, int, int, Path], dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of `run(model, stages, rounds, repeats, work folder)` for every model and
    stage count, torch on a rank's one thread; `--quick` (in `argv`): the first model at
    the first count, 3 rounds of 3 repeats instead of 8 of 5."""
    from partitioner.cost.measure import rank_threads

    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--quick", action="store_true", help="one model, one stage count, fewer rounds")
    quick = parser.parse_args(argv).quick
    rounds, repeats = (3, 3) if quick else (8, 5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, rank_threads():
        for path in models[:1] if quick else models:
            for stages in stage_counts[:1] if quick else stage_counts:
                rows.append(run(path, stages, rounds, repeats, Path(tmp) / f"{Path(path).stem}{stages}"))
    return rows


def publish(name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print `rows` as a table, save them as benchmarks/results/NAME.json and put the table
    in the NAME block of docs/benchmarks.md."""
    text = table(rows, columns)
    print(text)
    save(name, rows)
    update_docs(name, text)
