"""The stage graph: which stage feeds which, where gradients flow back, and which rank runs
each stage.  It is what lowering and validation need of a package."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ScheduleError
from .registry import DEFAULT_SCHEDULE, placement

if TYPE_CHECKING:
    from ..manifest import Manifest

__all__ = ["StageGraph", "as_graph"]


@dataclass(frozen=True)
class StageGraph:
    """Which stage feeds which, where gradients flow back, and which rank runs each stage:
    what lowering needs.  `ranks` is each stage's pipeline rank (`placement`); empty:
    stage s on rank `s % num_ranks` ([Note: V placement] in registry.py).
    """

    num_stages: int
    num_ranks: int
    edges: tuple[tuple[int, int], ...]  # (producer, consumer), sorted
    grad_edges: frozenset[tuple[int, int]]  # edges with at least one value that needs a gradient
    ranks: tuple[int, ...] = ()

    def rank_of(self, stage: int) -> int:
        return self.ranks[stage] if self.ranks else stage % self.num_ranks

    def producers(self, stage: int) -> tuple[int, ...]:
        return self._ends[0].get(stage, ())

    def consumers(self, stage: int) -> tuple[int, ...]:
        return self._ends[1].get(stage, ())

    @cached_property
    def _ends(self) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
        """Each stage's producers and consumers, in edge order (found once: lowering asks per action)."""
        into: dict[int, tuple[int, ...]] = {}
        out: dict[int, tuple[int, ...]] = {}
        for p, c in self.edges:
            into[c] = into.get(c, ()) + (p,)
            out[p] = out.get(p, ()) + (c,)
        return into, out

    @staticmethod
    def chain(num_stages: int, num_ranks: int | None = None, schedule: str = DEFAULT_SCHEDULE) -> "StageGraph":
        """A plain chain 0 -> 1 -> ... -> S-1, gradients on every edge, placed for `schedule`."""
        edges = tuple((s, s + 1) for s in range(num_stages - 1))
        ranks = num_ranks or num_stages
        return StageGraph(num_stages, ranks, edges, frozenset(edges), placement(schedule, num_stages, ranks))

    @staticmethod
    def from_manifest(manifest: "Manifest | Mapping[str, Any]") -> "StageGraph":
        """The stage graph of a package manifest (a parsed one is read with `Manifest.from_json`)."""
        from ..manifest import Manifest  # the manifest reads the registry: imported here, once both exist

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


def as_graph(graph: "StageGraph | Manifest | Mapping[str, Any]") -> StageGraph:
    """`graph` itself, or the stage graph of a manifest."""
    return graph if isinstance(graph, StageGraph) else StageGraph.from_manifest(graph)
