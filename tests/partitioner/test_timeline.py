"""`show DIR --timeline FILE.png`: the predicted step drawn, ranks x time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.cli import main
from partitioner.predict import timeline
from partitioner.predict.simulate import simulate

from ..conftest import compile_example


def test_the_simulation_records_every_compute_once_per_rank_in_order() -> None:
    links = {(0, 1): 0.0, (1, 2): 0.0}
    sim = simulate([1.0] * 3, [2.0] * 3, links, "zb-h1", 3, 4)
    assert sorted(label for *_, label in sim.events) == sorted(f"{s}{k}{i}" for s in range(3) for k in "FIW"
                                                             for i in range(4))
    for rank in range(3):
        spans = sorted((start, end) for r, start, end, _ in sim.events if r == rank)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one action at a time
        assert sum(end - start for start, end in spans) == pytest.approx(sim.busy_s[rank])
    assert max(end for _, _, end, _ in sim.events) == pytest.approx(sim.step_time_s)


def test_show_draws_the_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    image = pytest.importorskip("matplotlib.image")
    compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, microbatches=4, schedule="zb-h1")
    png = tmp_path / "step.png"
    assert main(["show", str(tmp_path / "pkg"), "--timeline", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    pixels = image.imread(str(png))
    height, width = pixels.shape[:2]
    assert width >= 800 and height >= 200
    colours = {tuple(round(float(c), 2) for c in px[:3]) for px in pixels.reshape(-1, pixels.shape[-1])[::7]}
    assert len(colours) > 10  # bars, text and axes, not a blank page


def test_a_measured_trace_is_drawn_from_its_last_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    spans = [{"ph": "X", "name": f"{r}{k}0", "cat": k, "pid": r, "tid": r, "ts": 1000.0 * (10 * step + 2 * r + i),
              "dur": 900.0, "args": {"step": step}} for step in (0, 1) for r in (0, 1) for i, k in enumerate("FIW")]
    spans.append({"ph": "X", "name": "0SEND_F0>1", "cat": "SEND_F", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1.0,
                  "args": {"step": 1}})
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": spans}))
    events, ranks = timeline.measured_events(trace)
    assert ranks == 2 and len(events) == 6  # the last step's compute only
    assert min(start for _, start, _, _ in events) == 0.0
    assert max(end for _, _, end, _ in events) == pytest.approx(0.0049)
    timeline.draw(events, ranks, tmp_path / "m.png", "measured")
    assert (tmp_path / "m.png").stat().st_size > 5000


def test_run_timeline_needs_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    compile_example("examples/mlp.py", tmp_path / "pkg", stages=2)
    assert main(["run", str(tmp_path / "pkg"), "--nproc", "2", "--timeline", str(tmp_path / "m.png")]) == 2
    assert "--timeline draws the measured steps from the trace: add --trace" in capsys.readouterr().err
