"""The schedule IR: actions, schedule generators, lowering to SEND/RECV, validation.

A schedule is one list of `Action`s per pipeline RANK (pipeline position), run in order.
Generators (`gpipe`, `one_f_one_b`, `interleaved_1f1b`, `zb_h1`, `zb_h2`, `zb_v`: zero_bubble.py)
return compute-only schedules (F and B, or F, I and W where the backward is split);
`lower` adds the point-to-point actions from the stage graph; `validate`
simulates the ranks step by step and returns the rank-by-step grid that the runtimes
interpret.  Nothing here runs a tensor: the runtimes only interpret what this module says.

[Note: schedule semantics]
    Sends never block (they are asynchronous and waited on at the end of the step); a
    receive blocks until its matching send has run on the peer rank in an EARLIER step.
    Within one rank actions run in list order, one per step.  A value passed between two
    stages on the same rank (interleaved schedules) needs no send: it is handed over in
    memory, so F of the consumer only needs F of the producer to have run before it.
    Between two stages, activations and gradients go in microbatch order, so a channel
    per stage edge is first-in first-out (what NCCL needs).

[Note: V placement]
    Stage s runs on pipeline rank s % p (`placement`), so the interleaved schedule's
    stages go round the ranks; under zb-v the 2p stages go down the ranks and back up
    in a V: stage s on rank s for s < p, on rank 2p-1-s after, so rank r holds stages r
    and 2p-1-r, the first and last stage are both on rank 0, and stages p-1 and p hand
    over on rank p-1 in memory.  The solver's split into 2p stages is the same; codegen
    writes each stage's `ranks` from `placement`, and `StageGraph.from_manifest` places
    the stages by the manifest's schedule (the runtime checks the two agree).

[Note: receives posted ahead]
    `lower` puts each receive right before the compute that needs it, which is where a
    rank WAITS for it.  Where the transport lets a receive be posted early (gloo), the
    runtime posts the receives of a rank's next compute before it starts the current one
    (`receives_ahead`): gloo moves a message only once both sides have posted it, so a
    receive posted just in time costs its rank the whole round trip (about a millisecond
    on a 2-core CPU machine's loopback, as much as a small stage's compute), while one posted a compute
    ahead arrives during that compute.  The order of the actions, and so every schedule's
    validity, is unchanged: only the posting moves.  The simulator posts them where the
    runtime does (partitioner/predict/simulate.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence

from . import zero_bubble
from .errors import ScheduleError
from .manifest import SCHEDULES, Manifest

__all__ = [
    "SCHEDULES",
    "Kind",
    "Action",
    "Schedule",
    "StageGraph",
    "COMPUTE",
    "COMM",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_h2",
    "zb_v",
    "placement",
    "make_schedule",
    "lower",
    "receives_ahead",
    "validate",
    "execution_order",
    "format_schedule",
    "parse_schedule",
    "format_grid",
]



class Kind(str, Enum):
    """What an action does: compute (F, B) or move a value to or from a peer stage."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741  (the input-gradient half of B: [Note: split backward] in stage.py)
    W = "W"  # the weight-gradient half of B, after the I of the same stage and microbatch
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:  # "F", in messages and traces, as the action's repr writes it
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_backward(self) -> bool:
        """B, I, W, or a message of the backward pass (a gradient)."""
        return self in (Kind.B, Kind.I, Kind.W, Kind.SEND_B, Kind.RECV_B)

    @property
    def sends_grads(self) -> bool:
        """B or I: the action that makes the stage's input gradients (what SEND_B sends)."""
        return self in (Kind.B, Kind.I)


F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
COMPUTE = (F, B, I, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:([<>])(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One step of one stage: `2F0` is stage 2, forward, microbatch 0.

    Point-to-point actions name the peer stage: `0SEND_F1>2` sends stage 0's activations
    of microbatch 1 to stage 2; `2RECV_F1<0` receives them there.
    """

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):  # a name ("F", "SEND_B") is accepted and stored as its Kind
            if self.kind not in Kind.__members__:
                raise ScheduleError(f"unknown action kind {self.kind!r}: use one of {', '.join(Kind.__members__)}.")
            object.__setattr__(self, "kind", Kind(self.kind))
        if (self.kind in COMM) != (self.peer is not None):
            raise ScheduleError(f"action {self.kind.value} of stage {self.stage}: SEND/RECV actions and only they name a peer stage.")

    def __repr__(self) -> str:
        base = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.peer is None:
            return base
        return f"{base}{'>' if self.kind.is_send else '<'}{self.peer}"

    __str__ = __repr__

    @staticmethod
    def from_str(text: str) -> "Action":
        """Parse `2F0`, `1B3`, `0SEND_F1>2`, `2RECV_B0<3`."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"{text!r} is not an action: write e.g. 2F0, 1B3, 0SEND_F1>2 or 2RECV_F1<0.")
        stage, kind, mb, arrow, peer = match.groups()
        if peer is not None and (arrow == ">") != kind.startswith("SEND"):
            raise ScheduleError(f"{text!r}: a SEND points to its peer with '>', a RECV from it with '<'.")
        return Action(int(stage), Kind(kind), int(mb), None if peer is None else int(peer))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


Schedule = list[list[Action]]


@dataclass(frozen=True)
class StageGraph:
    """Which stage feeds which, where gradients flow back, and which rank runs each stage:
    what lowering needs.  `ranks` is each stage's pipeline rank (`placement`); empty:
    stage s on rank `s % num_ranks` ([Note: V placement]).
    """

    num_stages: int
    num_ranks: int
    edges: tuple[tuple[int, int], ...]  # (producer, consumer), sorted
    grad_edges: frozenset[tuple[int, int]]  # edges with at least one value that needs a gradient
    ranks: tuple[int, ...] = ()

    def rank_of(self, stage: int) -> int:
        return self.ranks[stage] if self.ranks else stage % self.num_ranks

    def producers(self, stage: int) -> list[int]:
        return [p for p, c in self.edges if c == stage]

    def consumers(self, stage: int) -> list[int]:
        return [c for p, c in self.edges if p == stage]

    @staticmethod
    def chain(num_stages: int, num_ranks: int | None = None, schedule: str = "1f1b") -> "StageGraph":
        """A plain chain 0 -> 1 -> ... -> S-1, gradients on every edge, placed for `schedule`."""
        edges = tuple((s, s + 1) for s in range(num_stages - 1))
        ranks = num_ranks or num_stages
        return StageGraph(num_stages, ranks, edges, frozenset(edges), placement(schedule, num_stages, ranks))

    @staticmethod
    def from_manifest(manifest: Manifest | Mapping[str, Any]) -> "StageGraph":
        """The stage graph of a package manifest (a parsed one is read with `Manifest.from_json`)."""
        m = manifest if isinstance(manifest, Manifest) else Manifest.from_json(manifest)
        pp = m.mesh.pp
        if pp < 1 or len(m.stages) % pp:
            raise ScheduleError(f"the manifest has {len(m.stages)} stages, which is not a multiple of mesh.pp={pp}: compile the model again.")
        outputs = {s.index: {o.name: o for o in s.outputs} for s in m.stages}
        edges: set[tuple[int, int]] = set()
        grads: set[tuple[int, int]] = set()
        for s in m.stages:
            for entry in s.inputs:
                if entry.source == "input":
                    continue
                p, c = entry.source, s.index
                if not 0 <= p < c:
                    raise ScheduleError(f"stage {c} input {entry.name!r} comes from stage {p}: values must flow to later stages only.")
                edges.add((p, c))
                produced = outputs[p].get(entry.name)
                if produced is None:
                    raise ScheduleError(f"stage {c} reads {entry.name!r} from stage {p}, which has no such output: compile again.")
                if entry.requires_grad and produced.requires_grad:
                    grads.add((p, c))
        return StageGraph(len(m.stages), pp, tuple(sorted(edges)), frozenset(grads), placement(m.schedule, len(m.stages), pp))


def placement(schedule: str, num_stages: int, ranks: int) -> tuple[int, ...]:
    """The pipeline rank of each stage: s % ranks, or a V under zb-v ([Note: V placement])."""
    if schedule == "zb-v":
        return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages))
    return tuple(s % ranks for s in range(num_stages))


# -- generators ----------------------------------------------------------------------------


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward (Huang et al. 2019)."""
    _check_counts(stages, microbatches)
    return [[Action(k, F, i) for i in range(microbatches)] + [Action(k, B, i) for i in range(microbatches)]
            for k in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Narayanan et al. 2021): rank k warms up with S-1-k forwards,
    then alternates one forward and one backward, then cools down with the backwards left."""
    _check_counts(stages, microbatches)
    schedule = []
    for k in range(stages):
        warmup = min(stages - 1 - k, microbatches)
        row = [Action(k, F, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            row += [Action(k, F, warmup + i), Action(k, B, i)]
        row += [Action(k, B, i) for i in range(microbatches - warmup, microbatches)]
        schedule.append(row)
    return schedule


def interleaved_1f1b(ranks: int, virtual_stages: int, microbatches: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2).

    Stage s lives on rank s % ranks; each rank runs its `virtual_stages` model chunks in
    groups of `ranks` microbatches.  Warm-up on rank r: (ranks-r-1)*2 + (v-1)*ranks
    forwards (all of them when microbatches == ranks), then 1F1B, then cool-down.
    """
    _check_counts(ranks, microbatches)
    if virtual_stages < 1:
        raise ScheduleError(f"virtual_stages={virtual_stages}: give at least 1 stage per rank.")
    if microbatches % ranks:
        raise ScheduleError(f"the interleaved schedule needs microbatches ({microbatches}) to be a multiple of "
                            f"the pipeline ranks ({ranks}): use {ranks * max(1, round(microbatches / ranks))} microbatches.")
    group, total = ranks * virtual_stages, microbatches * virtual_stages

    def action(r: int, k: int, kind: Kind) -> Action:
        chunk = (k % group) // ranks
        if kind == B:
            chunk = virtual_stages - 1 - chunk
        return Action(chunk * ranks + r, kind, (k // group) * ranks + k % ranks)

    schedule = []
    for r in range(ranks):
        warmup = total if microbatches == ranks else min((ranks - r - 1) * 2 + (virtual_stages - 1) * ranks, total)
        row = [action(r, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            row += [action(r, k + warmup, F), action(r, k, B)]
        row += [action(r, k, B) for k in range(total - warmup, total)]
        schedule.append(row)
    return schedule


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with B split in I and W, W's deferred (zero_bubble.py)."""
    _check_counts(stages, microbatches)
    return _actions(zero_bubble.zb_h1_order(stages, microbatches))


def zb_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024): twice ZB-H1's warm-up, no idle slot inside a rank's span (zero_bubble.py)."""
    _check_counts(stages, microbatches)
    return _actions(zero_bubble.zb_h2_order(stages, microbatches))


def zb_v(ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024): 2 stages per rank in a V ([Note: V placement]), W's in its gaps (zero_bubble.py)."""
    _check_counts(ranks, microbatches)
    return [[Action(r if chunk == 0 else 2 * ranks - 1 - r, Kind(kind), i) for kind, chunk, i in row]
            for r, row in enumerate(zero_bubble.zb_v_order(ranks, microbatches))]


def _actions(order: list[list[tuple[str, int]]]) -> Schedule:
    return [[Action(r, Kind(kind), i) for kind, i in row] for r, row in enumerate(order)]


def make_schedule(name: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The compute schedule a manifest names: gpipe | 1f1b | interleaved | zb-h1 | zb-h2 | zb-v."""
    if name in ("gpipe", "1f1b", "zb-h1", "zb-h2") and virtual_stages != 1:
        raise ScheduleError(f"schedule {name!r} runs one stage per rank but the package has {virtual_stages}: compile with --schedule interleaved.")
    if name == "zb-v" and virtual_stages != 2:
        raise ScheduleError(f"schedule 'zb-v' runs two stages per rank but the package has {virtual_stages}: compile with --schedule zb-v.")
    if name == "gpipe":
        return gpipe(ranks, microbatches)
    if name == "1f1b":
        return one_f_one_b(ranks, microbatches)
    if name == "interleaved":
        return interleaved_1f1b(ranks, virtual_stages, microbatches)
    if name in ("zb-h1", "zb-h2"):
        return zb_h1(ranks, microbatches) if name == "zb-h1" else zb_h2(ranks, microbatches)
    if name == "zb-v":
        return zb_v(ranks, microbatches)
    raise ScheduleError(f"unknown schedule {name!r}: use {', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]}.")


def _check_counts(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"a schedule needs at least one stage and one microbatch, got {stages} and {microbatches}.")


# -- lowering ------------------------------------------------------------------------------


def lower(schedule: Schedule, graph: StageGraph | Manifest | Mapping[str, Any]) -> Schedule:
    """Add the SEND/RECV actions: receives right before the compute that needs them,
    sends right after the compute that produced them (one per peer stage on another rank)."""
    g = graph if isinstance(graph, StageGraph) else StageGraph.from_manifest(graph)
    lowered = []
    for r, row in enumerate(schedule):
        out: list[Action] = []
        for a in row:
            s, i = a.stage, a.microbatch
            if a.kind == F:
                out += [Action(s, RECV_F, i, p) for p in g.producers(s) if g.rank_of(p) != r]
                out.append(a)
                out += [Action(s, SEND_F, i, c) for c in g.consumers(s) if g.rank_of(c) != r]
            elif a.kind == W:
                out.append(a)  # no message: W only needs this stage's own I
            elif a.kind.sends_grads:
                out += [Action(s, RECV_B, i, c) for c in g.consumers(s) if g.rank_of(c) != r and (s, c) in g.grad_edges]
                out.append(a)
                out += [Action(s, SEND_B, i, p) for p in g.producers(s) if g.rank_of(p) != r and (p, s) in g.grad_edges]
            else:
                raise ScheduleError(f"lower() takes a compute-only schedule but rank {r} already has {a!r}.")
        lowered.append(out)
    return lowered


def receives_ahead(row: Sequence[Action]) -> dict[int, tuple[int, ...]]:
    """For each compute action of a lowered `row`, by index, the indices of the receives
    of the rank's next compute (those between the two): what the runtime posts before
    running it ([Note: receives posted ahead])."""
    ahead: dict[int, tuple[int, ...]] = {}
    computes = [t for t, a in enumerate(row) if a.is_compute]
    for t, nxt in zip(computes, computes[1:]):
        recvs = tuple(j for j in range(t + 1, nxt) if row[j].kind in (RECV_F, RECV_B))
        if recvs:
            ahead[t] = recvs
    return ahead


# -- validation ----------------------------------------------------------------------------

Grid = list[list[Action | None]]


def validate(schedule: Schedule, graph: StageGraph | Manifest | Mapping[str, Any], microbatches: int | None = None) -> Grid:
    """Check that `schedule` runs every action exactly once, each on its stage's rank, and
    finishes; return the simulated rank-by-step grid (None where a rank waits).

    Works on compute-only and lowered schedules (see [Note: schedule semantics]).  Raises
    `ScheduleError` with the grid printed and the bad or stuck cells marked with `*`.
    """
    g = graph if isinstance(graph, StageGraph) else StageGraph.from_manifest(graph)
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


# -- text ----------------------------------------------------------------------------------


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, actions separated by spaces (the inverse of `parse_schedule`)."""
    return "\n".join(" ".join(repr(a) for a in row) for row in schedule)


def parse_schedule(text: str) -> Schedule:
    """Lines of actions, one line per rank; blank lines are skipped."""
    return [[Action.from_str(tok) for tok in line.split()] for line in text.strip().splitlines() if line.strip()]


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
