"""What the driver carries between the phases of one compile: the model file loaded
(`Source`), the model traced, costed and posed (`Prepared`), and the result (`Compiled`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from partitioner.ir import NodeCost, PartitionProblem, Plan
from partitioner.cost.hardware import Hardware
from partitioner.cost.timer import CPU_TIMER, DeviceTimer
from partitioner.solve.problem import Coarse, Setting
from partitioner.tp import Sharded
from partitioner.trace import model_file
from partitioner.trace.passes import Seen, seen_run
from partitioner.trace.trace import Traced
from runtime.manifest import Manifest

from .options import CompileOptions

__all__ = ["Compiled", "Prepared", "Source"]


@dataclass
class Compiled:
    """What a compile produced, for the CLI and for tests."""

    manifest: Manifest  # as the package's manifest.json has it
    plan: Plan
    traced: Traced
    costs: dict[str, NodeCost]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Prepared:
    """A model traced, costed and posed as a partition problem: everything before solving
    (built by keyword: its fields are many, and several share a type)."""

    opts: CompileOptions
    mf: model_file.ModelFile
    model: torch.nn.Module
    traced: Traced
    costs: dict[str, NodeCost]
    hardware: Hardware
    problem: PartitionProblem
    blocks: list[Any]
    batch: int
    rows: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    mesh: Setting  # the mesh, schedule and limits `problem` was posed for
    timings: dict[str, float] = field(default_factory=dict)
    #: the graph before tensor parallelism and its costs (what --devices re-shards)
    whole: tuple[Traced, dict[str, NodeCost]] | None = None
    sharded: Sharded | None = None
    coarse: Coarse | None = None  # the blocks `problem` was posed from
    values: dict[torch.fx.Node, Any] | None = None  # one microbatch's value of every node (tp = 1)
    say: Callable[[str], None] = field(default=lambda _m: None, repr=False)  # progress and warnings
    free_batch: bool = False  # the batch dimension is left free ([Note: free batch])
    loss: NodeCost | None = None  # the loss_fn on one microbatch's output (partitioner.cost.loss)
    loss_reduction: str = "mean"  # how loss_fn reduces over the batch (driver/loss_check.py)
    timer: DeviceTimer = CPU_TIMER  # times every measurement, on the device the model runs on
    #: each stage's recomputation policy where it was chosen with the split ([Note:
    #: recomputation chosen per rank] in driver/recompute.py); None: the problem's own
    policies: tuple[str | None, ...] | None = None


@dataclass
class Source:
    """A model file loaded, its model built and its example batch: what every microbatch
    shape of one compile (or `--devices` search) shares."""

    mf: model_file.ModelFile
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch: int
    #: where the model and its batch are ([Note: where the compile runs the model] in phases.py)
    device: torch.device = torch.device("cpu")
    #: the model's fx trace before specialisation, which serves any microbatch shape
    generic: Traced | None = None
    #: the runs of copies of `generic` so far, by rows: each shape's probes ([Note: free batch])
    seen: dict[int, Seen | None] = field(default_factory=dict)

    def probes(self) -> dict[int, Seen | None] | None:
        """The runs a shape's `probe` may read and joins: where each shape's graph is a copy
        of `generic` (an fx trace); None where each is traced anew."""
        return self.seen if self.generic is not None else None

    def ran(self, rows: int, values: dict[torch.fx.Node, Any]) -> None:
        """Remember the run of a shape of `rows` rows (`propagate`'s values) for the next
        shapes' probes."""
        if self.generic is not None:
            self.seen[rows] = seen_run(values)
