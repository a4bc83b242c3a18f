"""An exact solver for sharding problems whose values interact along a path, each
repeated piece solved once: what makes a 96-layer transformer's split take milliseconds.

Order the variables (graph order, each parameter moved just before its first reader).
Cutting the order between two positions, the variables before the cut that still share
a cost term (an edge, a copy) with one after it are *live* at the cut.  Dynamic
programming along the order, with the strategies of the live variables as its state, is
exact (variable elimination, Bertelè & Brioschi, "Nonserial Dynamic Programming", 1972)
and cheap when few variables are live at once: in a transformer, the residual stream and
a layer's few open branches.  Three steps keep it cheap at GPT-3 scale:

  1. global:   a variable live across most of the order (the embedding weight that the
               LM head shares) would multiply every state, so each strategy of such
               variables is tried in turn instead (at most `_MAX_GLOBAL_COMBOS` in all);
  2. segments: the cuts where at most one variable is live split the order into
               segments (a layer's attention half, its MLP half) chained through that
               one variable, the residual stream;
  3. tables:   a segment's table (its best cost for each strategy of the variable that
               enters it and of the one that leaves) depends only on its own cost terms;
               segments with equal terms (identical layers) share one table.

`solve` returns None when more than `max_states` assignments would be live at some cut,
or when too many variables are global: the caller then uses CP-SAT on the whole problem.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

from .problem import ShardingProblem

__all__ = ["solve_chain"]

#: strategy combinations of the global variables tried in turn
_MAX_GLOBAL_COMBOS = 27
#: a variable is global when it stays live over more cuts than this share of the order
_GLOBAL_SHARE = 1 / 8
_GLOBAL_MIN_CUTS = 32


@dataclass(frozen=True)
class _Factor:
    """A cost term over several variables: an edge's matrix (`kind` "pair", members
    (src, dst)) or a copy's cost, paid once when any (variable, strategy) in `readers`
    is chosen (`kind` "copy")."""

    kind: str
    members: tuple[int, ...]
    table: tuple[tuple[float, ...], ...] = ()
    cost: float = 0.0
    readers: tuple[tuple[int, int], ...] = ()

    def value(self, strategy: dict[int, int]) -> float:
        if self.kind == "pair":
            return self.table[strategy[self.members[0]]][strategy[self.members[1]]]
        return self.cost if any(strategy[d] == j for d, j in self.readers) else 0.0


@dataclass
class _Reduced:
    """The problem with some variables fixed: the free ones' unary costs, the terms
    among free variables, and a constant."""

    unary: dict[int, list[float]]
    factors: list[_Factor]
    constant: float


def solve_chain(problem: ShardingProblem, max_states: int = 4096) -> tuple[int, ...] | None:
    """The cheapest strategy per variable, or None when the problem is not path-like
    enough (see the module docstring)."""
    sizes = [len(c) for c in problem.cost_s]
    fixed = {v: 0 for v, n in enumerate(sizes) if n == 1}
    base = _reduce(problem, fixed)
    order = _order(base)
    glob = _globals(base, order, sizes)
    if glob is None:
        return None
    memo: dict[Hashable, _Table | None] = {}
    best: tuple[float, dict[int, int]] | None = None
    for combo in itertools.product(*(range(sizes[v]) for v in glob)):
        pinned = fixed | dict(zip(glob, combo))
        reduced = _reduce(problem, pinned)
        found = _chain(reduced, [v for v in order if v not in pinned], sizes, max_states, memo)
        if found is None:
            return None
        cost, chosen = found
        if best is None or cost + reduced.constant < best[0]:
            best = (cost + reduced.constant, pinned | chosen)
    if best is None or best[0] == math.inf:
        return None
    return tuple(best[1].get(v, 0) for v in range(problem.size))


# -- 0. the terms, with fixed variables folded in ----------------------------------------------


def _reduce(problem: ShardingProblem, fixed: dict[int, int]) -> _Reduced:
    unary = {v: list(c) for v, c in enumerate(problem.cost_s) if v not in fixed}
    constant = sum(problem.cost_s[v][k] for v, k in fixed.items())
    factors: list[_Factor] = []
    for e in problem.edges:
        a, b = fixed.get(e.src), fixed.get(e.dst)
        if a is not None and b is not None:
            constant += e.cost[a][b]
        elif a is not None:
            _add(unary[e.dst], e.cost[a])
        elif b is not None:
            _add(unary[e.src], [row[b] for row in e.cost])
        else:
            factors.append(_Factor("pair", (e.src, e.dst), table=e.cost))
    for c in problem.copies:
        if any(fixed.get(d) == j for d, j in c.readers):
            constant += c.cost_s
            continue
        live = tuple((d, j) for d, j in c.readers if d not in fixed)
        members = tuple(sorted({d for d, _ in live}))
        if len(members) == 1:
            _add(unary[members[0]], [c.cost_s if any(j == k for _, j in live) else 0.0
                                     for k in range(len(unary[members[0]]))])
        elif members:
            factors.append(_Factor("copy", members, cost=c.cost_s, readers=live))
    return _Reduced(unary, factors, constant)


def _add(into: list[float], extra: Sequence[float]) -> None:
    for k, x in enumerate(extra):
        into[k] += x


# -- 1. the order and the global variables -------------------------------------------------------


def _order(reduced: _Reduced) -> list[int]:
    """The free variables in problem order, except that one whose every neighbour comes
    earlier, and not just before it (a parameter, posed after all the nodes), moves to
    just before its first neighbour."""
    neighbours: dict[int, set[int]] = {v: set() for v in reduced.unary}
    for f in reduced.factors:
        for v in f.members:
            neighbours[v].update(u for u in f.members if u != v)

    def key(v: int) -> float:
        near = neighbours[v]
        if near and max(near) < v - 1:
            return min(near) - 0.5
        return float(v)

    return sorted(reduced.unary, key=lambda v: (key(v), v))


def _last_use(reduced: _Reduced, pos: dict[int, int]) -> dict[int, int]:
    """For each variable, the last position that a term it shares reaches."""
    last = {v: p for v, p in pos.items()}
    for f in reduced.factors:
        reach = max(pos[v] for v in f.members)
        for v in f.members:
            last[v] = max(last[v], reach)
    return last


def _globals(reduced: _Reduced, order: list[int], sizes: list[int]) -> list[int] | None:
    """Variables live over a long stretch of the order, or None when trying each of
    their strategy combinations would be too many."""
    pos = {v: i for i, v in enumerate(order)}
    last = _last_use(reduced, pos)
    limit = max(_GLOBAL_MIN_CUTS, int(len(order) * _GLOBAL_SHARE))
    found = sorted((v for v in order if last[v] - pos[v] > limit), key=lambda v: (pos[v] - last[v], v))
    if math.prod(sizes[v] for v in found) > _MAX_GLOBAL_COMBOS:
        return None
    return found


# -- 2. segments and 3. their tables -----------------------------------------------------------------

#: a segment's table: entering strategy (None: no variable enters) -> leaving strategy
#: (None: none leaves) -> (the segment's cost, its own variables' strategies)
_Table = dict[int | None, dict[int | None, tuple[float, tuple[int, ...]]]]


@dataclass(frozen=True)
class _Segment:
    start: int
    end: int
    entering: int | None
    leaving: int | None


def _segments(order: list[int], reduced: _Reduced) -> tuple[list[_Segment], dict[int, list[_Factor]]]:
    """The segments between cuts with at most one live variable, and each position's
    terms (those whose last member sits there)."""
    pos = {v: i for i, v in enumerate(order)}
    last = _last_use(reduced, pos)
    owned: dict[int, list[_Factor]] = {}
    for f in reduced.factors:
        owned.setdefault(max(pos[v] for v in f.members), []).append(f)
    opened: dict[int, list[int]] = {}  # cut -> variables that become live there
    for v, p in pos.items():
        if last[v] > p:
            opened.setdefault(p + 1, []).append(v)
    live: set[int] = set()
    cuts: list[tuple[int, int | None]] = [(0, None)]
    for c in range(1, len(order)):
        live.update(opened.get(c, ()))
        live = {v for v in live if last[v] >= c}
        if len(live) <= 1:
            cuts.append((c, next(iter(live)) if live else None))
    cuts.append((len(order), None))
    segments = [_Segment(a, b, into, out) for (a, into), (b, out) in zip(cuts, cuts[1:])]
    return segments, owned


def _chain(reduced: _Reduced, order: list[int], sizes: list[int], max_states: int,
           memo: dict[Hashable, _Table | None]) -> tuple[float, dict[int, int]] | None:
    """The best cost of the free variables in `order` and their strategies: a DP over
    the segments whose state is the strategy of the one variable live between them."""
    if not order:
        return 0.0, {}
    segments, owned = _segments(order, reduced)
    best: dict[int | None, float] = {None: 0.0}
    steps: list[tuple[list[int], _Table, dict[int | None, int | None]]] = []
    for seg in segments:
        local, key = _local(seg, order, reduced, owned, sizes)
        if key not in memo:
            memo[key] = _table(seg, local, reduced, owned, sizes, max_states)
        table = memo[key]
        if table is None:
            return None
        step: dict[int | None, float] = {}
        came: dict[int | None, int | None] = {}
        for a, cost_a in best.items():
            for b, (cost, _) in table[a].items():
                if b not in step or cost_a + cost < step[b]:
                    step[b], came[b] = cost_a + cost, a
        if not step:
            return math.inf, {}  # no strategy passes this segment (with these globals)
        best = step
        steps.append((local, table, came))
    chosen: dict[int, int] = {}
    state: int | None = None
    for local, table, came in reversed(steps):  # read the strategies back
        a = came[state]
        chosen.update(zip(local, table[a][state][1]))
        state = a
    return best[None], chosen


def _local(seg: _Segment, order: list[int], reduced: _Reduced, owned: dict[int, list[_Factor]],
           sizes: list[int]) -> tuple[list[int], Hashable]:
    """The segment's own variables, and a key that is equal for segments with equal
    terms (numbered locally: 0 the entering variable, then the segment's own)."""
    local = order[seg.start:seg.end]
    ids = {v: i + 1 for i, v in enumerate(local)}
    if seg.entering is not None:
        ids[seg.entering] = 0
    terms = tuple(
        (f.kind, tuple(ids[v] for v in f.members), f.table, f.cost, tuple((ids[d], j) for d, j in f.readers))
        for p in range(seg.start, seg.end) for f in owned.get(p, ())
    )
    entering = sizes[seg.entering] if seg.entering is not None else 0
    leaving = ids[seg.leaving] if seg.leaving is not None else -1
    return local, (entering, tuple(tuple(reduced.unary[v]) for v in local), terms, leaving)


def _table(seg: _Segment, local: list[int], reduced: _Reduced, owned: dict[int, list[_Factor]], sizes: list[int],
           max_states: int) -> _Table | None:
    """For each strategy of the entering variable, the segment's best cost and
    strategies for each strategy of the leaving one."""
    out: _Table = {}
    for a in [None] if seg.entering is None else range(sizes[seg.entering]):
        row = _sweep(seg, local, reduced, owned, sizes, a, max_states)
        if row is None:
            return None
        out[a] = row
    return out


def _sweep(seg: _Segment, local: list[int], reduced: _Reduced, owned: dict[int, list[_Factor]], sizes: list[int],
           a: int | None, max_states: int) -> dict[int | None, tuple[float, tuple[int, ...]]] | None:
    """Variable elimination along the segment, the entering variable at strategy `a`:
    the state is the strategies of the variables whose terms are not all counted yet."""
    pos = {v: seg.start + i for i, v in enumerate(local)}
    last = dict(pos)
    if seg.entering is not None:
        last[seg.entering] = seg.start - 1
    for p in range(seg.start, seg.end):
        for f in owned.get(p, ()):
            for v in f.members:
                last[v] = max(last[v], p)
    if seg.leaving is not None:
        last[seg.leaving] = seg.end  # the next segment reads it
    live: list[int] = [] if seg.entering is None else [seg.entering]
    states: dict[tuple[int, ...], float] = {() if a is None else (a,): 0.0}
    back: list[dict[tuple[int, ...], tuple[tuple[int, ...], int]]] = []
    for v in local:
        p, ext, terms, unary = pos[v], live + [v], owned.get(pos[v], []), reduced.unary[v]
        keep = [i for i, u in enumerate(ext) if last[u] > p]
        new: dict[tuple[int, ...], float] = {}
        came: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        for state, cost in states.items():
            for s in range(sizes[v]):
                full = state + (s,)
                c = cost + unary[s]
                if terms and c < math.inf:
                    assign = dict(zip(ext, full))
                    c += sum(f.value(assign) for f in terms)
                if c == math.inf:
                    continue
                nxt = tuple(full[i] for i in keep)
                if nxt not in new or c < new[nxt]:
                    new[nxt], came[nxt] = c, (state, s)
        if len(new) > max_states:
            return None
        states, live = new, [ext[i] for i in keep]
        back.append(came)
    row: dict[int | None, tuple[float, tuple[int, ...]]] = {}
    for state, cost in states.items():
        leaving = dict(zip(live, state))[seg.leaving] if seg.leaving is not None else None
        if leaving not in row or cost < row[leaving][0]:
            row[leaving] = (cost, _strategies(state, back))
    return row


def _strategies(state: tuple[int, ...], back: list[dict[tuple[int, ...], tuple[tuple[int, ...], int]]]) -> tuple[int, ...]:
    """The strategies of the segment's own variables that led to the final `state`."""
    out: list[int] = []
    for came in reversed(back):
        state, s = came[state]
        out.append(s)
    return tuple(reversed(out))
