"""`local=True`: each data-parallel replica is given only its own rows (what
`DistributedSampler(num_replicas=pipe.replicas, rank=pipe.replica)` hands it), and a rank
whose stages do not read a value may be given None for it.

[Note: local rows]
    With the global batch every rank derives each replica's rows from the batch's shape
    ([Note: short batch] in counts.py).  With local rows a rank sees its own replica's rows
    at most (none where it was given None), so the ranks first agree on every replica's
    row count with one all-reduce (`Agreement`): replicas may differ (a short last batch
    of 5 rows on replica 0 and 4 on replica 1), the global batch has B = sum of them, and
    every replica runs the microbatch count that the smallest one fits, so that the
    replicas' schedules stay alike.  Replica r's microbatch i of r_i rows then has divisor
    B / (dp r_i) (`scales`): the replicas' gradients are averaged (/ dp) and their losses
    summed and divided by dp, so each row counts 1/B, as [Note: microbatch weights] in
    microbatches.py asks.  With equal rows this is the global form's divisor exactly.  A
    loss_fn that sums over its rows divides by 1 / dp, whatever the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from .errors import BatchError
from .manifest import Manifest
from .microbatches import replica_rows
from .stage import StageRunner

__all__ = ["Needs", "Agreement", "given_rows", "microbatch_rows", "scales"]

_UNKNOWN = -1
_BIG = 2 ** 62


@dataclass(frozen=True)
class Needs:
    """What this process's stages read of a batch: the model inputs, the target."""

    inputs: bool
    target: bool

    @classmethod
    def of(cls, runners: Sequence[StageRunner], with_target: bool) -> "Needs":
        """The inputs where a stage reads a model input, the target where one is the last."""
        reads = any(spec.source == "input" for r in runners for spec in r.entry.inputs)
        return cls(reads, with_target and any(r.is_last for r in runners))

    def missing(self, inputs: Any, target: Any) -> tuple[bool, bool]:
        """(inputs needed but None, target needed but None)."""
        return self.inputs and inputs is None, self.target and target is None


def given_rows(inputs: Any, target: Any, manifest: Manifest) -> int | None:
    """The rows of this replica's local batch: along the first batched input's batch
    dimension, else the target's dim 0; None when neither says."""
    if inputs is not None:
        rows = replica_rows(inputs, manifest, replicas=1)
        if rows is not None:
            return rows
    leaves = [x for x in pytree.tree_leaves(target) if isinstance(x, torch.Tensor) and x.dim()]
    return leaves[0].shape[0] if leaves else None


def microbatch_rows(rows: int, count: int) -> list[int]:
    """`rows` cut into `count` microbatches as `torch.tensor_split` cuts them."""
    if rows < count:
        raise BatchError(f"a replica's {rows} local rows cannot fill {count} microbatches: give every replica at "
                         f"least {count} rows, or compile with fewer --microbatches.")
    return [p.numel() for p in torch.tensor_split(torch.empty(rows), count)]


def scales(rows: list[int], total: int, replicas: int, reduction: str = "mean") -> list[float]:
    """Each microbatch's divisor B / (dp r_i) ([Note: local rows]); 1 / dp for a loss_fn
    that sums over its rows ([Note: microbatch weights] in microbatches.py)."""
    if reduction == "sum":
        return [1 / replicas] * len(rows)
    return [total / (replicas * r) for r in rows]


@dataclass(frozen=True)
class Agreement:
    """What the ranks agree on with one all-reduce (MAX) of `encode`'s vector: every
    replica's rows, and the first rank that lacks a value it needs ([Note: local rows])."""

    replicas: int

    def encode(self, replica: int, rows: int | None, rank: int, missing: tuple[bool, bool]) -> torch.Tensor:
        """[rows of each replica (-1: not known here), minus the same (for the smallest),
        rank + 1 missing its inputs, rank + 1 missing its target]."""
        v = torch.tensor([_UNKNOWN] * self.replicas + [-_BIG] * self.replicas + [0, 0], dtype=torch.int64)
        if rows is not None:
            v[replica], v[self.replicas + replica] = rows, -rows
        v[-2], v[-1] = [rank + 1 if m else 0 for m in missing]
        return v

    def decode(self, v: torch.Tensor, default: int) -> list[int]:
        """Every replica's rows (`default` where no rank knew them, no batched value), or the
        BatchError every rank raises alike."""
        values = [int(x) for x in v.tolist()]
        _check_missing(values[-2], values[-1])
        hi, lo = values[:self.replicas], [-x for x in values[self.replicas:2 * self.replicas]]
        for r, (a, b) in enumerate(zip(hi, lo)):
            if a != _UNKNOWN and a != b:
                raise BatchError(f"the ranks of data-parallel replica {r} were given {b} and {a} rows with "
                                 f"local=True: give every rank of a replica the same rows (the same "
                                 f"DistributedSampler(num_replicas=pipe.replicas, rank=pipe.replica)).")
        return [default if a == _UNKNOWN else a for a in hi]


def _check_missing(inputs_rank: int, target_rank: int) -> None:
    """Raise when a rank (rank + 1 in the agreed vector; 0: none) lacks its inputs or target."""
    for rank, what, who in ((inputs_rank, "inputs", "runs a stage that reads a model input"),
                            (target_rank, "target", "runs the last stage, which computes the loss")):
        if rank:
            raise BatchError(f"rank {rank - 1} {who} but was given None for the {what} with local=True: pass "
                             f"this replica's rows of the {what} on that rank; only a rank whose stages do not "
                             f"read them may pass None.")

