"""The plan checked against the machine (driver/check.py): re-solved once where the measured
slowest stage is more than 10% off the model's, and both shown side by side."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import driver.check
import driver.phases
from driver.options import CompileOptions
from driver.phases import finish, prepare, solve_problem
from driver.prepared import Prepared
from partitioner.ir import NodeCost, Plan
from partitioner.solve.problem import make_plan

ROOT = Path(__file__).resolve().parents[2]


def _prepared(tmp_path: Path) -> Prepared:
    return prepare(CompileOptions(model=str(ROOT / "examples/gpt.py"), out=str(tmp_path / "out"), stages=2,
                                  analytic=True, hardware="a100", quiet=True))


def _slower(stage: int, factor: float) -> Any:
    """A stand-in for the stage calibration: stage `stage`'s nodes `factor` times slower."""
    def calibrate(p: Prepared, plan: Plan) -> dict[str, NodeCost]:
        mine = set(plan.stages[stage].nodes)
        return {n: dataclasses.replace(c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor)
                if n in mine else c for n, c in p.costs.items()}
    return calibrate


@pytest.mark.parametrize("factor, resolved", [(1.05, False), (3.0, True)])
def test_a_stage_measured_far_off_the_model_is_solved_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           factor: float, resolved: bool) -> None:
    p = _prepared(tmp_path)
    assignment, report = solve_problem(p)
    plan = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    monkeypatch.setattr(driver.check, "stage_costs", _slower(0, factor))
    _, again, did, _costs = driver.check.check_plan(p, plan)
    assert did is resolved
    if resolved:  # stage 0 measured 3x slower: the new plan gives it fewer nodes
        assert len(again.stages[0].nodes) < len(plan.stages[0].nodes)
    else:
        assert again is plan


def test_show_prints_the_model_and_the_measured_stage_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _prepared(tmp_path)
    assignment, report = solve_problem(p)
    monkeypatch.setattr(driver.check, "stage_costs", _slower(0, 3.0))
    monkeypatch.setattr(driver.phases, "stage_costs", _slower(0, 3.0))
    compiled = finish(p, assignment, report)
    calibration = compiled.manifest["predicted"]["calibration"]
    assert calibration["resolved"] is True
    model, measured = calibration["model_compute_s"], calibration["measured_compute_s"]
    assert measured[0] == pytest.approx(3 * model[0], rel=1e-4) and measured[1] == pytest.approx(model[1], rel=1e-4)
    text = (tmp_path / "out" / "plan.txt").read_text()
    assert "against the cost model" in text and "solved again with the measured times" in text
    header = next(line for line in text.splitlines() if line.startswith("stage"))
    assert header.split()[4:7] == ["time/mb", "compute", "measured"]
