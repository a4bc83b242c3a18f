"""The predicted step as one function of plain inputs, kept in the manifest.

[Note: one predicted step]
    `simulate_step(StepInputs)` is the only place the predicted step time is computed:
    `predict` stores its result as the manifest's `predicted.step_time_s` (what `show`
    prints) and its inputs as `predicted.simulation`, and `show --timeline` runs it again
    on those inputs to draw the step, so the picture and the figure are one simulation.
    The step is the schedule's walk (`simulate`: compute, messages, the loss all-reduce)
    and then what no compute hides: the all-reduce of tied parameters' gradients, the
    data-parallel gradient all-reduce the last backward cannot cover, ZeRO-1's broadcast
    (`after_s`).  Every data-parallel replica runs the same schedule on the same times, so
    the walk has one row per pipeline rank: the ranks of replica 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .simulate import Simulation, simulate

__all__ = ["StepInputs", "simulate_step"]


@dataclass(frozen=True)
class StepInputs:
    """What `simulate` takes for one plan's step, and the seconds added after it."""

    forward_s: tuple[float, ...]  # per stage, per microbatch
    backward_s: tuple[float, ...]
    links: tuple[tuple[int, int, float], ...]  # (stage a, stage b, seconds of one message)
    schedule: str
    pp: int
    microbatches: int
    virtual: int = 1
    send_s: float = 0.0
    recv_s: float = 0.0
    loss_s: tuple[float, float] = (0.0, 0.0)
    final_s: float = 0.0
    weight_share: tuple[float, ...] = ()
    ahead: bool = False
    after_s: float = 0.0  # tied and data-parallel all-reduces, ZeRO-1's broadcast

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _listed(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> StepInputs:
        """The manifest's `predicted.simulation` block (lists back to tuples)."""
        names = {f.name for f in dataclasses.fields(StepInputs)}
        return StepInputs(**{k: _tupled(v) for k, v in data.items() if k in names})


def simulate_step(inputs: StepInputs) -> Simulation:
    """The predicted step ([Note: one predicted step]): the schedule walked, then `after_s`."""
    i = inputs
    sim = simulate(i.forward_s, i.backward_s, {(a, b): s for a, b, s in i.links}, i.schedule, i.pp, i.microbatches,
                   i.virtual, send_s=i.send_s, recv_s=i.recv_s, loss_s=i.loss_s, final_s=i.final_s,
                   weight_share=i.weight_share or 0.5, ahead=i.ahead)
    return dataclasses.replace(sim, step_time_s=sim.step_time_s + i.after_s)


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
