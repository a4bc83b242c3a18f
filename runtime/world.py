"""The world a `DistributedPipeline` rank joins: checked at start-up (the size, the same
package on every rank, the manifest's ranks), its gradient sums across ranks, and the words
for a failed collective."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .comm import GradBuckets, TiedGrads
from .errors import ManifestError, MeshError
from .groups import Groups, Mesh
from .manifest import Manifest
from .schedule import Action, StageGraph

__all__ = ["check_world", "check_same_package", "check_ranks", "describer", "Now", "tp_describer", "grad_sync"]


def check_world(mesh: Mesh, directory: Path, world: int) -> None:
    """The package's pp x tp x dp ranks are the world's size."""
    need = mesh.world
    if world != need:
        raise MeshError(f"{directory} is planned for pp={mesh.pp} x tp={mesh.tp} x dp={mesh.dp} = {need} ranks but "
                        f"WORLD_SIZE is {world}: launch {need} processes (--nproc {need}), or compile the model "
                        f"for {world} devices.")


def check_same_package(manifest: Manifest, directory: Path, rank: int, world: int) -> None:
    """Every rank runs the same package (its hash), collectively."""
    mine = (manifest.hash, str(directory))
    every: list[Any] = [None] * world
    try:
        dist.all_gather_object(every, mine)
    except Exception as exc:
        raise MeshError(f"rank {rank} failed comparing package hashes at start-up ({exc}): another rank "
                        f"stopped or failed; look at its own error.") from None
    odd = [r for r, (h, _) in enumerate(every) if h != every[0][0]]
    if odd:
        lines = "; ".join(f"rank {r}: {d} (hash {h[:12] or 'none'})" for r, (h, d) in enumerate(every))
        raise MeshError(f"the ranks run different packages ({lines}): give every rank the same package DIR.")


def check_ranks(m: Manifest, mesh: Mesh, g: StageGraph) -> None:
    """Each stage's ranks in the manifest are where this runtime places it."""
    for stage in m.stages:
        want = [mesh.rank(r, g.rank_of(stage.index), t) for r in range(mesh.dp) for t in range(mesh.tp)]
        if list(stage.ranks) != want:
            raise ManifestError(f"stage {stage.index} lists ranks {list(stage.ranks)} but this runtime places it on "
                                f"{want} ((replica * pp + position) * tp + t, the position of {m.schedule}'s "
                                f"placement): compile the model again.")


def describer(rank: int, stages: list[int]) -> Callable[[str, Any], Callable[[bool, str], str]]:
    """`describe(what, ranks)`: the words for a failed collective `what` among `ranks`.

    It closes over this rank's numbers, not over the pipeline: error callbacks the pipeline
    keeps (tied gradients, buckets) would otherwise hold it in a reference cycle, and a
    pipeline in a cycle is freed, process groups and all, only by the garbage collection at
    interpreter exit, when a gloo thread still freeing a finished barrier cannot take the
    GIL any more: std::terminate (pytorch/pytorch#179291)."""
    where = ", ".join(map(str, stages))

    def describe(what: str, ranks: Any) -> Callable[[bool, str], str]:
        others = [r for r in ranks if r != rank]

        def say(timed_out: bool, reason: str) -> str:
            who = f"one of ranks {others}" if others else "another rank"
            return (f"rank {rank} (stage {where}) {'timed out' if timed_out else 'failed'} in {what}: {who} "
                    f"stopped or failed ({reason}). Look at that rank's own error.")
        return say
    return describe


@dataclass
class Now:
    """The action this rank is running, or ran last (None before the first)."""

    action: Action | None = None


def tp_describer(now: Now, rank: int, index: int, tp_ranks: Sequence[int], timeout: float
                 ) -> Callable[[str, bool, str], str]:
    """The words for a failed tp.* collective: the action running now is read from `now`, not
    from the pipeline, which tp's module state would otherwise keep alive (see `describer`)."""
    others = ", ".join(f"rank {r} (tp index {u})" for u, r in enumerate(tp_ranks) if r != rank)

    def doing(collective: str, timed_out: bool, reason: str) -> str:
        a = now.action
        during = f" during {a!r} (stage {a.stage}, microbatch {a.microbatch})" if a is not None else ""
        return (f"rank {rank} (tp index {index}) {'timed out' if timed_out else 'failed'} in {collective}"
                f"{during}: {others} of its tensor-parallel group stopped or failed ({reason}). Look at that "
                f"rank's own error; if it is only slow, raise PIPELINE_TIMEOUT_S (now {timeout:g} s).")
    return doing


def grad_sync(named: list[tuple[str, torch.nn.Parameter]], groups: Groups, dp: int, timeout_s: float,
              describe: Callable[[str, Any], Callable[[bool, str], str]]
              ) -> tuple[TiedGrads, GradBuckets | None, list[torch.nn.Parameter]]:
    """Tied gradients summed across ranks, data-parallel buckets, and the parameters the
    buckets hold, for this rank's (original name, parameter) pairs `named`."""
    mine = dict(named)
    tied = [(mine[n], group, n) for n, (group, _) in groups.ties.items() if n in mine and mine[n].requires_grad]
    ties = TiedGrads(tied, dp, timeout_s, lambda name, t, why: describe(
        f"the gradient sum of tied parameter {name}", groups.ties[name][1])(t, why))
    plain = [p for n, p in mine.items() if p.requires_grad and n not in groups.ties]
    buckets = (GradBuckets(plain, groups.dp, dp, timeout_s, describe("the data-parallel gradient all_reduce", groups.dp_ranks))
               if dp > 1 and plain else None)
    return ties, buckets, plain
