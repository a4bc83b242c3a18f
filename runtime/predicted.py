"""The manifest's `predicted` block as types: the compiler's prediction of a training
step and of each stage, with its reader (re-exported by `runtime.manifest`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ._fields import _Bad, _int, _mapping, _number, _Obj, _str
from .errors import ManifestError

__all__ = ["StagePrediction", "Predicted"]


@dataclass(frozen=True)
class StagePrediction:
    """What the compiler predicts for one stage, per microbatch (time) and at peak (memory)."""

    time_s: float
    memory_bytes: int
    compute_s: float = 0.0
    param_bytes: int = 0
    send_bytes: int = 0
    recv_bytes: int = 0
    peak_inflight: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "compute_s": self.compute_s, "memory_bytes": self.memory_bytes,
                "param_bytes": self.param_bytes, "send_bytes": self.send_bytes, "recv_bytes": self.recv_bytes,
                "peak_inflight": self.peak_inflight}


@dataclass(frozen=True)
class Predicted:
    """The compiler's prediction of a training step; `solver` (the solver's report) and
    `extra` (further entries, e.g. the mesh search's `candidates`) are free-form."""

    step_time_s: float
    mfu: float
    stages: tuple[StagePrediction, ...]
    cost_source: str = ""
    hardware: str = ""
    solver: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "mfu": self.mfu, "cost_source": self.cost_source,
                "hardware": self.hardware, "stages": [s.to_dict() for s in self.stages], "solver": dict(self.solver),
                **self.extra}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Predicted:
        """The block as the planner builds it (a dict), checked as `Manifest.from_json` checks it."""
        try:
            return _predicted(_Obj(data, "predicted"))
        except _Bad as bad:
            raise ManifestError(f"the predicted block is malformed: {bad}.") from None



def _stage_prediction(o: _Obj) -> StagePrediction:
    return StagePrediction(o.get("time_s", _number), o.get("memory_bytes", _int), o.get("compute_s", _number, 0.0),
                           o.get("param_bytes", _int, 0), o.get("send_bytes", _int, 0), o.get("recv_bytes", _int, 0),
                           o.get("peak_inflight", _int, 0))


def _predicted(o: _Obj) -> Predicted:
    known = ("step_time_s", "mfu", "cost_source", "hardware", "stages", "solver")
    return Predicted(o.get("step_time_s", _number), o.get("mfu", _number), o.each("stages", _stage_prediction),
                     o.get("cost_source", _str, ""), o.get("hardware", _str, ""), o.get("solver", _mapping, {}),
                     {k: v for k, v in o.data.items() if k not in known})


