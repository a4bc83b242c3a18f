"""The world a `DistributedPipeline` rank joins: checked at start-up (the size, the same
package on every rank, the manifest's ranks), and the words for a failed collective."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from .errors import ManifestError, MeshError
from .groups import Mesh
from .manifest import Manifest
from .schedule import StageGraph

__all__ = ["check_world", "check_same_package", "check_ranks", "describer"]


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
