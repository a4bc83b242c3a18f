"""The plan checked against the machine (driver/check.py): re-solved once where a stage's
measured time is more than 10% off the model's, the plan solved again kept only if it
measures faster timed in turn with the first, and both shown side by side."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import driver.check
import driver.costs
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


def _in_turn(calibrate: Any) -> Any:
    """A stand-in for timing plans in turn: every round as `calibrate` gives it."""
    def in_turn(p: Prepared, plans: list[Plan], rounds: int) -> list[list[dict[str, NodeCost]]]:
        return [[calibrate(p, plan) for _ in range(rounds)] for plan in plans]
    return in_turn


def _stand_in(monkeypatch: pytest.MonkeyPatch, first: Any, in_turn: Any) -> None:
    monkeypatch.setattr(driver.check, "calibrated_costs", first)
    monkeypatch.setattr(driver.check, "calibrated_costs_in_turn", _in_turn(in_turn))


@pytest.mark.parametrize("factor, resolved", [(1.05, False), (3.0, True)])
def test_a_stage_measured_far_off_the_model_is_solved_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           factor: float, resolved: bool) -> None:
    p = _prepared(tmp_path)
    assignment, report = solve_problem(p)
    plan = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    _stand_in(monkeypatch, _slower(0, factor), _slower(0, factor))
    _, again, did, _costs = driver.check.check_plan(p, plan)
    assert did is resolved
    if resolved:  # stage 0 measured 3x slower: the new plan gives it fewer nodes
        assert len(again.stages[0].nodes) < len(plan.stages[0].nodes)
    else:
        assert again is plan


def test_a_stage_measured_faster_than_the_model_is_given_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slowest stage as modelled, the other 30% faster: the plan is solved again and
    the faster stage gets more nodes."""
    p = _prepared(tmp_path)
    assignment, report = solve_problem(p)
    plan = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    _stand_in(monkeypatch, _slower(0, 0.7), _slower(0, 0.7))
    _, again, did, _costs = driver.check.check_plan(p, plan)
    assert did is True and len(again.stages[0].nodes) > len(plan.stages[0].nodes)


def test_show_prints_the_model_and_the_measured_stage_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _prepared(tmp_path)
    assignment, report = solve_problem(p)
    _stand_in(monkeypatch, _slower(0, 3.0), _slower(0, 3.0))
    monkeypatch.setattr(driver.phases, "calibrated_costs", _slower(0, 3.0))
    compiled = finish(p, assignment, report)
    calibration = compiled.manifest.predicted.extra["calibration"]
    assert calibration["resolved"] is True
    model, measured = calibration["model_compute_s"], calibration["measured_compute_s"]
    assert measured[0] == pytest.approx(3 * model[0], rel=1e-4) and measured[1] == pytest.approx(model[1], rel=1e-4)
    text = (tmp_path / "out" / "plan.txt").read_text()
    assert "against the cost model" in text and "solved again with the measured times" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert lines[header].split()[4:8] == ["compute", "messages", "time/mb", "measured"]
    for row in lines[header + 2:header + 4]:  # compute and messages add up to the time shown
        compute, messages, time_mb = (float(v) for v in row.split()[4:10:2])
        assert compute + messages == pytest.approx(time_mb, abs=1.5e-3)


def test_the_plan_solved_again_is_kept_only_if_it_measures_faster_in_turn(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0 read 3x slow once (a busy second), so the problem is solved again; timed in
    turn with the first plan, both measure as the model says, and the first (the model's
    optimum) is kept, with the calibration it was compared by."""
    p = _prepared(tmp_path)
    assignment, report = solve_problem(p)
    plan = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    _stand_in(monkeypatch, _slower(0, 3.0), _slower(0, 1.0))
    _, kept, did, costs = driver.check.check_plan(p, plan)
    assert did is False and kept is plan
    assert costs == p.costs


def test_plans_are_timed_in_turn_a_different_one_first_each_round_and_cached(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    p = _prepared(tmp_path)
    assignment, report = solve_problem(p)
    a = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    b = make_plan(p.problem, p.blocks, tuple(1 - s for s in assignment), report, p.mesh)
    order: list[Plan] = []

    def calibrate(p: Prepared, plan: Plan, count: str = "") -> tuple[dict[str, NodeCost], bool]:
        order.append(plan)
        factor = 1.0 + len(order) / 10  # each calibration its own, to see which is filed where
        return {n: dataclasses.replace(c, forward_s=c.forward_s * factor) for n, c in p.costs.items()}, False

    monkeypatch.setattr(driver.costs, "_calibrates", lambda p, plan: True)
    monkeypatch.setattr(driver.costs, "_calibrate", calibrate)
    timed = driver.costs.calibrated_costs_in_turn(p, [a, b], 3)
    assert order == [a, b, b, a, a, b]
    name = next(n for n, c in p.costs.items() if c.forward_s > 0)
    factors = [[round(got[name].forward_s / p.costs[name].forward_s, 6) for got in per_plan] for per_plan in timed]
    assert factors == [[1.1, 1.4, 1.5], [1.2, 1.3, 1.6]]
    assert driver.costs.calibrated_costs_in_turn(p, [a, b], 3) == timed and len(order) == 6  # from the cache
