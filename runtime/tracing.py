"""Chrome / Perfetto traces of pipeline steps: one pid per rank, one tid per stage, a
complete ("X") event per forward, backward, send and receive, merged on rank 0.

Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

__all__ = ["Tracer"]


class Tracer:
    """Collects this rank's events; `flush()` (collective) gathers them on rank 0 and
    rewrites the whole trace file there."""

    def __init__(self, path: str | Path | None, rank: int, stages: list[int]) -> None:
        self.path = Path(path) if path else None
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.merged: list[dict[str, Any]] = []
        self.step = 0
        if self.path is not None:
            self.events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            self.events += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": s, "args": {"name": f"stage {s}"}}
                            for s in stages]

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @contextlib.contextmanager
    def span(self, name: str, stage: int, kind: str, microbatch: int, **args: Any) -> Iterator[None]:
        """Record the enclosed work as one complete event."""
        if self.path is None:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            self.events.append({
                "ph": "X", "name": name, "cat": kind, "pid": self.rank, "tid": stage,
                "ts": start / 1e3, "dur": (time.time_ns() - start) / 1e3,
                "args": {"stage": stage, "microbatch": microbatch, "step": self.step, **args},
            })

    def flush(self) -> None:
        """Gather every rank's events on rank 0 and write the trace (all ranks call it)."""
        self.step += 1
        if self.path is None:
            return
        gathered: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(self.events, gathered, dst=0)
        self.events = []
        if self.rank != 0:
            return
        assert gathered is not None
        for events in gathered:
            self.merged += events or []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.merged, "displayTimeUnit": "ms"}))
        tmp.replace(self.path)
