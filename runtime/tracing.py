"""Chrome / Perfetto traces of pipeline steps: one pid per rank, one tid per stage, a
complete ("X") event per forward, backward, send and receive, merged on rank 0; two more
rows per rank: the pipeline's collectives (data-parallel and tied gradient all-reduces,
the loss, the gradient norm) and the steps of the optimizer `make_optimizer` built.

Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["Tracer", "COLLECTIVES", "OPTIMIZER"]

#: the rows (Perfetto threads) of each rank beside its stages'
COLLECTIVES, OPTIMIZER = 1000, 1001


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
            rows = [(s, f"stage {s}") for s in stages] + [(COLLECTIVES, "collectives"), (OPTIMIZER, "optimizer")]
            self.events += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
                            for tid, name in rows]

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def span(self, name: str, stage: int, kind: str, microbatch: int, **args: Any
             ) -> contextlib.AbstractContextManager[None]:
        """Record the enclosed work of one action as one complete event on its stage's row."""
        return self._event(name, kind, stage, {"stage": stage, "microbatch": microbatch, **args})

    def collective(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Record the enclosed collective (launch and wait) on the rank's collectives row."""
        return self._event(name, "collective", COLLECTIVES, {})

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Record each `optimizer.step()` (a ZeRO-1 step: with its broadcast) on the optimizer
        row, as part of the step whose gradients it applies."""
        if self.path is None:
            return
        started: list[int] = []
        optimizer.register_step_pre_hook(lambda *_: started.append(time.time_ns()))
        optimizer.register_step_post_hook(lambda *_: self._record(
            "optimizer step", "optimizer", OPTIMIZER, started.pop(), {"step": self.step - 1}))

    @contextlib.contextmanager
    def _event(self, name: str, kind: str, tid: int, args: dict[str, Any]) -> Iterator[None]:
        if self.path is None:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            self._record(name, kind, tid, start, args)

    def _record(self, name: str, kind: str, tid: int, start_ns: int, args: dict[str, Any]) -> None:
        self.events.append({"ph": "X", "name": name, "cat": kind, "pid": self.rank, "tid": tid, "ts": start_ns / 1e3,
                            "dur": (time.time_ns() - start_ns) / 1e3, "args": {"step": self.step, **args}})

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
