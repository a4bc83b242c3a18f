"""One `DistributedPipeline` rank's row of the lowered schedule, per microbatch count: its
training and forward-only actions, the receives it posts ahead, where it arms its gradient
buckets ([Note: short batch] in counts.py: one `Rows` per count, made when first needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from .manifest import Manifest
from .schedule import Action, Kind, Schedule, StageGraph, lower, make_schedule, receives_ahead, validate
from .stage import StageRunner

__all__ = ["Rows", "rows_builder"]


@dataclass(frozen=True)
class Rows:
    """This rank's actions for one microbatch count, and what goes with them."""

    train: list[Action]
    forward: list[Action]
    train_ahead: dict[int, tuple[int, ...]]
    forward_ahead: dict[int, tuple[int, ...]]
    arm_at: dict[int, list[torch.nn.Parameter]]


def rows_builder(schedule: str | Schedule | None, m: Manifest, g: StageGraph, position: int, early: bool,
                  runners: Mapping[int, StageRunner], plain: list[torch.nn.Parameter]) -> Callable[[int], Rows]:
    """count -> this rank's `Rows` (closing over no pipeline: [Note: short batch] in counts.py)."""

    def build(count: int) -> Rows:
        compute = schedule if isinstance(schedule, list) else make_schedule(
            schedule or m.schedule, m.mesh.pp, count, m.virtual_stages)
        fwd = [[a for a in row if a.kind == Kind.F] for row in compute]
        train, forward = _row(lower(compute, g), g, count, position), _row(lower(fwd, g), g, count, position)
        # gloo takes receives early; NCCL matches point-to-point messages in the order they
        # are posted on one stream, so there each is posted where it is waited for
        # ([Note: receives posted ahead] in schedule/lowering.py)
        ahead = (receives_ahead(train), receives_ahead(forward)) if early else ({}, {})
        return Rows(train, forward, *ahead, _arm_points(train, runners, plain))

    return build


def _arm_points(actions: list[Action], runners: Mapping[int, StageRunner],
                plain: list[torch.nn.Parameter]) -> dict[int, list[torch.nn.Parameter]]:
    """Arm each parameter right before the last B or W (of any stage holding it) on this rank."""
    last_b: dict[int, int] = {}
    for t, a in enumerate(actions):
        if a.kind in (Kind.B, Kind.W):
            for spec in runners[a.stage].entry.parameters:
                last_b[id(getattr(runners[a.stage].module, spec.name))] = t
    arm_at: dict[int, list[torch.nn.Parameter]] = {}
    for p in plain:
        if id(p) in last_b:
            arm_at.setdefault(last_b[id(p)], []).append(p)
    return arm_at


def _row(lowered: Schedule, g: StageGraph, microbatches: int, position: int) -> list[Action]:
    validate(lowered, g, microbatches)
    return lowered[position]
