"""Stage calibration (`calibrate.calibrate_stages`) and the tied-gradient all-reduce in the prediction."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner.cost import calibrate
from partitioner.cost.nodes import compute_nodes
from driver.check import CHOOSE_ROUNDS
from driver.options import CompileOptions
from driver.phases import prepare
from partitioner.cost.hardware import load_hardware
from partitioner.predict.predict import tied_allreduce_s
from partitioner.cost.roofline import ring_allreduce_s

from ..conftest import compile_example


def _prepared(tmp_path: Path, model: str) -> Any:
    return prepare(CompileOptions(model=model, out=str(tmp_path / "pkg"), stages=2, hardware="a100", analytic=True,
                                  quiet=True))


def test_a_stage_graph_computes_what_the_stage_computes(tmp_path: Path) -> None:
    """The second stage of a 2-stage GPT, cut out on its own: one placeholder per value it
    reads from the first stage or the batch, and outputs equal to the whole graph's values."""
    compiled = compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, hardware="a100")
    p = _prepared(tmp_path, "examples/gpt.py")
    stage_of = compiled.plan.stage_of()
    names = {n for n, s in stage_of.items() if s == 1}
    sub, values = calibrate._stage_graph(p.traced.gm, p.values, names)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    outside = {x.name for n in p.traced.gm.graph.nodes if n.name in names for x in n.all_input_nodes
               if x.name not in names and x.op != "get_attr"}
    assert {n.name for n in placeholders} == outside and outside
    assert {n.name for n in compute_nodes(sub)} == names
    with torch.no_grad():
        got = sub(*[values[n] for n in placeholders])
    by_name = {n.name: n for n in p.traced.gm.graph.nodes}
    outputs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    assert len(got) == len(outputs) >= 1
    for node, value in zip(outputs, got):
        assert torch.equal(value, p.values[by_name[node.name]]), node.name


def test_each_stage_is_calibrated_on_its_own_after_a_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="a100")
    p = _prepared(tmp_path, "examples/mlp.py")
    calls: list[tuple[set[str], float, float]] = []

    def record(gm: torch.fx.GraphModule, values: Any, costs: Any, repeats: int, wait_s: float = 0.0,
               min_s: float = 0.0, timer: Any = None) -> Any:
        calls.append(({n.name for n in compute_nodes(gm)}, wait_s, min_s))
        return costs

    monkeypatch.setattr(calibrate, "calibrate_graph", record)
    stage_of = compiled.plan.stage_of()
    calibrate.calibrate_stages(p.traced.gm, p.values, p.costs, stage_of, 3, 5e-4)
    assert calls == [({n for n, s in stage_of.items() if s == k}, 5e-4, calibrate.CALIBRATION_MIN_S) for k in (0, 1)]


def test_measured_stage_calibration_keeps_every_node_and_the_weights(tmp_path: Path) -> None:
    """Run for real (mlp, one thread): every node keeps a non-negative cost, and the
    parameters' .grad are left as they were."""
    p = _prepared(tmp_path, "examples/mlp.py")
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg2", stages=2, hardware="a100")
    before = {name: t.grad for name, t in p.traced.gm.named_parameters()}
    out = calibrate.calibrate_stages(p.traced.gm, p.values, p.costs, compiled.plan.stage_of(), 2, 1e-4)
    assert set(out) == set(p.costs)
    assert all(c.forward_s >= 0 and c.backward_s >= 0 for c in out.values())
    assert {name: t.grad for name, t in p.traced.gm.named_parameters()} == before


def test_a_tied_parameter_on_two_stages_costs_one_all_reduce(tmp_path: Path) -> None:
    """GPT ties its embedding to its head: on 2 stages its gradient is all-reduced between
    the 2 copies at the end of the step; a 1-stage plan, or a model without ties, pays nothing."""
    hw = load_hardware("a100")
    compiled = compile_example("examples/gpt.py", tmp_path / "two", stages=2, hardware="a100")
    tied = [t.source_name for t in compiled.manifest.tied_parameters]
    assert tied == ["wte.weight"]
    wte = dict(compiled.traced.gm.named_parameters())
    nbytes = next(t.numel() * t.element_size() for name, t in wte.items() if "wte" in name)
    alpha, beta = hw.ring_link()
    assert tied_allreduce_s(compiled.traced.gm, compiled.plan, hw) == pytest.approx(ring_allreduce_s(nbytes, 2, alpha, beta))
    one = compile_example("examples/gpt.py", tmp_path / "one", stages=1, hardware="a100")
    assert tied_allreduce_s(one.traced.gm, one.plan, hw) == 0.0
    mlp = compile_example("examples/mlp.py", tmp_path / "mlp", stages=2, hardware="a100")
    assert tied_allreduce_s(mlp.traced.gm, mlp.plan, hw) == 0.0


def test_a_forward_and_backward_are_timed_without_the_wait_before_them() -> None:
    """`time_forward_backward` idles before each half but times only the work; the backward
    runs from the outputs that need a gradient, and is 0 where none does."""
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    calls = []

    def forward() -> Any:
        calls.append(1)
        return linear(x), x.sum()  # the second output needs no gradient

    fwd, bwd = calibrate.time_forward_backward(forward, samples=3, wait_s=0.02)
    assert len(calls) == 4  # one warm-up
    assert 0 < fwd < 0.02 and 0 < bwd < 0.02
    assert linear.weight.grad is not None  # the backward ran
    _, none = calibrate.time_forward_backward(lambda: x * 2, samples=2)
    assert none == 0.0


def test_a_stage_is_timed_for_at_least_min_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its samples, `time_forward_backward` goes on sampling until `min_s` has passed
    (a median over a longer stretch of a shared machine's fast and slow spells), on a
    clock that advances 0.01 s per forward: not one sample is taken after min_s."""
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    clock = [0.0]
    calls = []

    def forward() -> Any:
        calls.append(clock[0])
        clock[0] += 0.01
        return linear(x)

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    calibrate.time_forward_backward(forward, samples=3, min_s=0.2)
    assert len(calls) > 4 and max(calls) < 0.2 <= clock[0], calls


def test_measured_costs_are_taken_on_the_threads_a_rank_computes_on(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Node costs and stage calibration run on RANK_THREADS threads whatever the compiling
    process has (the ranks run OMP_NUM_THREADS=1): timed on more, a stage bound to one core
    for its calibration had its threads take turns on it, at a hundredfold cost."""
    from driver import costs
    from partitioner.cost.measure import RANK_THREADS

    seen: list[tuple[str, int]] = []

    def spy(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, torch.get_num_threads()))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(costs, "annotate", spy("nodes", costs.annotate))
    monkeypatch.setattr(costs, "calibrate_stages", spy("stages", costs.calibrate_stages))
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS + 1)
    try:
        compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="cpu", analytic=False,
                        reprofile=True, repeats=1)
        assert torch.get_num_threads() == RANK_THREADS + 1
    finally:
        torch.set_num_threads(before)
    # the stages are timed once, and where the plan solved again differs, both plans
    # CHOOSE_ROUNDS times more in turn (driver/check.py)
    assert seen[0] == ("nodes", RANK_THREADS) and len(seen) in (2, 2 + 2 * CHOOSE_ROUNDS)
    assert all(entry == ("stages", RANK_THREADS) for entry in seen[1:])


def test_ranks_are_calibrated_side_by_side_until_the_last_is_done(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank times its stages in a process of its own, all at once, and keeps running
    its last stage until every rank has finished timing: the slow stage is never timed
    alone.  The answers come back to the parent, stage by stage."""
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="a100")
    p = _prepared(tmp_path, "examples/mlp.py")
    stage_of = compiled.plan.stage_of()
    log = tmp_path / "log"

    def fake(gm: torch.fx.GraphModule, values: Any, costs: Any, repeats: int, wait_s: float = 0.0,
             min_s: float = 0.0, timer: Any = None) -> Any:
        import os
        import time
        names = {n.name for n in compute_nodes(gm)}
        stage = stage_of[next(iter(names))]
        start = time.monotonic()
        time.sleep(0.4 if stage == 0 else 0.05)
        with log.open("a") as f:
            f.write(f"{stage} {repeats} {start} {time.monotonic()} {os.getpid()} {min_s}\n")
        return {n: (dataclasses.replace(c, forward_s=float(stage + 1)) if n in names else c) for n, c in costs.items()}

    monkeypatch.setattr(calibrate, "calibrate_graph", fake)
    cores = set(os.sched_getaffinity(0))
    out = calibrate.calibrate_stages(p.traced.gm, p.values, p.costs, stage_of, 3, 0.0, [([0], cores), ([1], cores)])
    assert {n: c.forward_s for n, c in out.items()} == {n: float(s + 1) for n, s in stage_of.items()}
    rows = [line.split() for line in log.read_text().splitlines()]
    timed = {int(r[0]): (float(r[2]), float(r[3]), r[4]) for r in rows if r[1] == "3"}
    assert timed[0][2] != timed[1][2] != str(os.getpid())  # two processes, neither this one
    assert timed[1][0] < timed[0][1] and timed[0][0] < timed[1][1]  # at the same time
    assert all(float(r[5]) == calibrate.CALIBRATION_MIN_S for r in rows if r[1] == "3")  # timed for long enough
    fillers = [(float(r[3]), float(r[5])) for r in rows if r[0] == "1" and r[1] == "1"]
    assert fillers and max(end for end, _ in fillers) >= timed[0][1]  # stage 1 ran on until stage 0 was timed
    assert all(min_s == 0.0 for _, min_s in fillers)  # in short bursts, so that it stops soon after


# a rank left waiting for the failed one would sit out calibrate._SIDE_BY_SIDE_TIMEOUT_S (300 s):
# the timeout stops that hang, and the match below names the failure, not a broken barrier
@pytest.mark.timeout(120)
def test_a_rank_that_fails_its_calibration_fails_it_for_all_at_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="a100")
    p = _prepared(tmp_path, "examples/mlp.py")

    def broken(gm: torch.fx.GraphModule, values: Any, costs: Any, repeats: int, wait_s: float = 0.0,
               min_s: float = 0.0, timer: Any = None) -> Any:
        raise ValueError("no stage today")

    monkeypatch.setattr(calibrate, "calibrate_graph", broken)
    cores = set(os.sched_getaffinity(0))
    with pytest.raises(calibrate.CalibrationError, match="no stage today"):
        calibrate.calibrate_stages(p.traced.gm, p.values, p.costs, compiled.plan.stage_of(), 3, 0.0,
                              [([0], cores), ([1], cores)])


def test_the_failing_rank_is_named_rather_than_the_barrier_it_broke() -> None:
    """The rank that fails aborts the start barrier; a rank woken by that reports only
    the broken barrier, and may well answer first (CI saw it)."""
    import multiprocessing

    ends = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
    ends[0][1].send(("aborted", "the ranks' start barrier broke"))
    ends[1][1].send(("failed", "ValueError: no stage today"))
    with pytest.raises(calibrate.CalibrationError, match="no stage today"):
        calibrate._answers([mine for mine, _ in ends], [[0], [1]])
    ends = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
    ends[0][1].send(("aborted", "the ranks' start barrier broke"))
    ends[1][1].send(("timed", {}))
    with pytest.raises(calibrate.CalibrationError, match="start barrier broke"):
        calibrate._answers([mine for mine, _ in ends], [[0], [1]])


@pytest.mark.slow
def test_the_compile_falls_back_to_one_stage_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Side by side failing (say, no fork) costs a warning, not the compile."""
    from driver import costs
    from driver.compile import compile_model

    real = costs.calibrate_stages
    calls: list[bool] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        side_by_side = bool(args[6:] and args[6])
        calls.append(side_by_side)
        if side_by_side:
            raise calibrate.CalibrationError("a rank died")
        return real(*args, **kwargs)

    monkeypatch.setattr(costs, "calibrate_stages", flaky)
    monkeypatch.setattr(costs, "_rank_cores", lambda plan: [([0], {0}), ([1], {0})])
    put = costs.cache.put
    stored: list[str] = []
    monkeypatch.setattr(costs.cache, "put", lambda key, value: (stored.append(key), put(key, value)))
    said: list[str] = []
    compile_model(CompileOptions(model="examples/mlp.py", out=str(tmp_path / "pkg"), stages=2,
                                 hardware="cpu", reprofile=True, repeats=1), log=said.append)
    # once, and where the plan solved again differs, both plans CHOOSE_ROUNDS times more (driver/check.py)
    assert calls in ([True, False], [True, False] * (1 + 2 * CHOOSE_ROUNDS))
    assert any("side by side failed (a rank died)" in line for line in said), said
    assert not [key for key in stored if key.startswith("stages-")]  # the fallback is not cached


@pytest.mark.parametrize(("pp", "tp", "dp", "stages", "cores", "want"), [
    (2, 1, 1, 2, 2, [[0], [1]]),
    (2, 1, 1, 4, 4, [[0, 2], [1, 3]]),  # interleaved: stage s on position s % pp
    (2, 1, 2, 2, 4, [[0], [1], [0], [1]]),  # replicas
    (2, 1, 1, 2, 1, None),  # fewer cores than ranks: not bound, so not side by side
])
def test_each_rank_is_calibrated_on_the_cores_it_is_bound_to(monkeypatch: pytest.MonkeyPatch, pp: int, tp: int,
                                                             dp: int, stages: int, cores: int,
                                                             want: list[list[int]] | None) -> None:
    from types import SimpleNamespace

    from driver import costs

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    plan = SimpleNamespace(pp=pp, tp=tp, dp=dp, stages=[None] * stages, rank_of=lambda s: s % pp)
    got = costs._rank_cores(plan)  # type: ignore[arg-type]
    if want is None:
        assert got == []
    else:
        per = cores // (pp * tp * dp)
        assert got == [(w, set(range(r * per, (r + 1) * per))) for r, w in enumerate(want)]
    monkeypatch.setenv("PIPELINE_CPU_BIND", "0")
    assert costs._rank_cores(plan) == []  # type: ignore[arg-type]


def test_calibrations_in_turn_say_which_of_how_many_each_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing two plans in turn says one progress line per calibration with its count, not
    the same "calibrating 2 stages" line six times; a single calibration says it once."""
    from driver import costs

    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="a100")
    said: list[str] = []
    p = dataclasses.replace(_prepared(tmp_path, "examples/mlp.py"), say=said.append)
    monkeypatch.setattr(costs, "_calibrates", lambda *_a: True)
    monkeypatch.setattr(costs, "_side_by_side", lambda *_a: [])
    monkeypatch.setattr(costs, "calibrate_stages", lambda _gm, _v, node_costs, *_a: node_costs)
    monkeypatch.setattr(costs.cache, "get", lambda _key: None)
    monkeypatch.setattr(costs.cache, "put", lambda _key, _value: None)
    costs.calibrated_costs_in_turn(p, [compiled.plan, compiled.plan], CHOOSE_ROUNDS)
    total = 2 * CHOOSE_ROUNDS
    assert len(said) == len(set(said)) == total, said
    assert [line.split("(")[-1].split(":")[0] for line in said] == [f"{k} of {total}" for k in range(1, total + 1)]
    assert said[1].endswith(f"plan 2 of 2, round 1 of {CHOOSE_ROUNDS})") and said[2].endswith("plan 2 of 2, round 2 of 3)")
    said.clear()
    costs.calibrated_costs(p, compiled.plan)
    assert said == ["calibrating 2 stages as the ranks run them"]
