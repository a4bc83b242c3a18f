"""Validation: a schedule simulated rank by rank, step by step; the grid the runtimes interpret.

`validate` checks that a schedule (compute-only or lowered) runs every action exactly
once, each on its stage's rank, and finishes; a schedule that fails is printed as a
rank-by-step grid with the bad or stuck cell marked (`format_grid`).

[Note: schedule semantics]
    Sends never block (they are asynchronous and waited on at the end of the step); a
    receive blocks until its matching send has run on the peer rank in an EARLIER step.
    Within one rank actions run in list order, one per step.  A value passed between two
    stages on the same rank (interleaved schedules) needs no send: it is handed over in
    memory, so F of the consumer only needs F of the producer to have run before it.
    Between two stages, activations and gradients go in microbatch order, so a channel
    per stage edge is first-in first-out (what NCCL needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..errors import ScheduleError
from .actions import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule
from .graph import StageGraph, as_graph

if TYPE_CHECKING:
    from ..manifest import Manifest

__all__ = ["Grid", "validate", "execution_order", "format_grid"]

Grid = list[list[Action | None]]


def validate(schedule: Schedule, graph: "StageGraph | Manifest | Mapping[str, Any]", microbatches: int | None = None) -> Grid:
    """Check that `schedule` runs every action exactly once, each on its stage's rank, and
    finishes; return the simulated rank-by-step grid (None where a rank waits).

    Works on compute-only and lowered schedules (see [Note: schedule semantics]).  Raises
    `ScheduleError` with the grid printed and the bad or stuck cells marked with `*`.
    """
    g = as_graph(graph)
    if len(schedule) != g.num_ranks:
        raise ScheduleError(f"the schedule has {len(schedule)} ranks but the stage graph has {g.num_ranks}.")
    _check_actions(schedule, g, microbatches)
    return _simulate(schedule, g)


def execution_order(grid: Grid) -> list[tuple[int, Action]]:
    """(rank, action) pairs step by step, ranks in order within a step: a legal serial order."""
    steps = max((len(row) for row in grid), default=0)
    return [(r, row[t]) for t in range(steps) for r, row in enumerate(grid) if t < len(row) and row[t] is not None]  # type: ignore[misc]


def _expected(schedule: Schedule, g: StageGraph, microbatches: int) -> dict[Action, int]:
    """Every action the schedule must hold, with the rank it belongs on."""
    acts = [a for row in schedule for a in row]
    split = any(a.kind in (I, W) for a in acts)
    kinds = [F, I, W] if split else [F, B] if any(a.kind == B for a in acts) else [F]
    lowered = any(not a.is_compute for a in acts)
    want: dict[Action, int] = {}
    for s in range(g.num_stages):
        for i in range(microbatches):
            for kind in kinds:
                want[Action(s, kind, i)] = g.rank_of(s)
            if not lowered:
                continue
            for c in g.consumers(s):
                if g.rank_of(c) != g.rank_of(s):
                    want[Action(s, SEND_F, i, c)] = g.rank_of(s)
                    want[Action(c, RECV_F, i, s)] = g.rank_of(c)
                    if len(kinds) > 1 and (s, c) in g.grad_edges:
                        want[Action(c, SEND_B, i, s)] = g.rank_of(c)
                        want[Action(s, RECV_B, i, c)] = g.rank_of(s)
    return want


def _check_actions(schedule: Schedule, g: StageGraph, microbatches: int | None) -> None:
    acts = [a for row in schedule for a in row]
    m = microbatches if microbatches is not None else max((a.microbatch for a in acts), default=-1) + 1
    want = _expected(schedule, g, m)
    seen: set[Action] = set()
    for r, row in enumerate(schedule):
        for t, a in enumerate(row):
            if a not in want and a.kind in (B, I, W) and Action(a.stage, F, a.microbatch) in want:
                why = "mixes B with I and W: split every backward of the schedule in I and W, or none"
            elif a not in want:
                why = "is not part of this pipeline (stage, microbatch or peer out of range)"
            elif want[a] != r:
                why = f"belongs on rank {want[a]}, not rank {r}"
            elif a in seen:
                why = "appears twice"
            else:
                seen.add(a)
                continue
            raise ScheduleError(f"action {a!r} on rank {r}, step {t} {why}:\n{format_grid(schedule, marks={(r, t)})}")
    missing = [a for a in want if a not in seen]
    if missing:
        shown = ", ".join(repr(a) for a in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ScheduleError(f"the schedule misses {len(missing)} action(s): {shown}:\n{format_grid(schedule)}")


def _simulate(schedule: Schedule, g: StageGraph) -> Grid:
    lowered = any(not a.is_compute for row in schedule for a in row)
    grid: Grid = [[] for _ in schedule]
    pos = [0] * len(schedule)
    done: set[Action] = set()
    while any(p < len(row) for p, row in zip(pos, schedule)):
        ready = {r: row[pos[r]] for r, row in enumerate(schedule)
                 if pos[r] < len(row) and _ready(row[pos[r]], r, done, g, lowered)}
        if not ready:
            stuck = [row[pos[r]] if pos[r] < len(row) else None for r, row in enumerate(schedule)]
            step = max(len(row) for row in grid)
            for r, row in enumerate(grid):
                row.extend([None] * (step - len(row)) + [stuck[r]])
            marks = {(r, step) for r, a in enumerate(stuck) if a is not None}
            waiting = "; ".join(f"rank {r} waits in {a!r}" for r, a in enumerate(stuck) if a is not None)
            raise ScheduleError(f"the schedule deadlocks at step {step} ({waiting}):\n{format_grid(grid, marks=marks)}")
        for r, row in enumerate(grid):
            row.append(ready.get(r))
        for r, a in ready.items():
            done.add(a)
            pos[r] += 1
    return grid


def _ready(a: Action, r: int, done: set[Action], g: StageGraph, lowered: bool) -> bool:
    s, i = a.stage, a.microbatch
    if a.kind == F:
        return all(Action(p, F, i) in done if (g.rank_of(p) == r or not lowered) else Action(s, RECV_F, i, p) in done
                   for p in g.producers(s))
    if a.kind.sends_grads:
        return Action(s, F, i) in done and all(
            (Action(c, B, i) in done or Action(c, I, i) in done) if (g.rank_of(c) == r or not lowered)
            else Action(s, RECV_B, i, c) in done
            for c in g.consumers(s) if (s, c) in g.grad_edges)
    if a.kind == W:
        return Action(s, I, i) in done
    assert a.peer is not None
    if a.kind == SEND_F:
        return Action(s, F, i) in done
    if a.kind == SEND_B:
        return Action(s, B, i) in done or Action(s, I, i) in done
    if a.kind == RECV_F:
        return Action(a.peer, SEND_F, i, s) in done
    return Action(a.peer, SEND_B, i, s) in done



def format_grid(grid: Sequence[Sequence[Action | None]], marks: Iterable[tuple[int, int]] = ()) -> str:
    """Rows = ranks, columns = steps; `.` where a rank waits, `*x*` on marked cells."""
    marked = set(marks)
    steps = max((len(row) for row in grid), default=0)
    cells = [[("." if t >= len(row) or row[t] is None else repr(row[t])) for t in range(steps)] for row in grid]
    for r, t in marked:
        cells[r][t] = f"*{cells[r][t]}*"
    widths = [max([len(str(t))] + [len(row[t]) for row in cells]) for t in range(steps)]
    label = max(len(f"rank {len(grid) - 1}"), len("step"))
    lines = ["step".ljust(label) + "  " + "  ".join(str(t).ljust(w) for t, w in enumerate(widths))]
    lines += [f"rank {r}".ljust(label) + "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) for r, row in enumerate(cells)]
    out = "\n".join(line.rstrip() for line in lines)
    return out + ("\n(* marks the bad or stuck action)" if marked else "")
