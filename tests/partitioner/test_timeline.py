"""`show DIR --timeline FILE.png`: the predicted step drawn, ranks x time."""

from __future__ import annotations

import json
import re
from typing import Any
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


def test_the_timeline_draws_the_step_show_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: one predicted step] A bf16 GPT on 2 stages x 2 replicas: the timeline's title is
    the step `show` prints (they once said 64 ms and 30 ms), its bars end there, and it
    says which ranks it draws (replica 0's) and why."""
    from runtime.manifest import Manifest

    compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, dp=2, microbatches=4, precision="bf16-mixed",
                    hardware="a100")
    drawn: dict[str, Any] = {}

    def draw(events: Any, ranks: int, path: Any, title: str, step_s: float | None = None, labels: Any = None) -> None:
        drawn.update(events=events, ranks=ranks, title=title, step_s=step_s, labels=labels)

    monkeypatch.setattr(timeline, "draw", draw)
    assert main(["show", str(tmp_path / "pkg"), "--timeline", str(tmp_path / "step.png")]) == 0
    shown = float(re.search(r"predicted  step (\S+) ms", capsys.readouterr().out).group(1))
    m = Manifest.from_json(json.loads((tmp_path / "pkg" / "manifest.json").read_text()), "manifest.json")
    assert drawn["step_s"] is not None and f"{drawn['step_s'] * 1e3:.3f}" == f"{shown:.3f}"
    assert max(end for _, _, end, _ in drawn["events"]) == pytest.approx(m.predicted.step_time_s, rel=1e-5)
    assert drawn["ranks"] == 2 and drawn["labels"] == ["rank 0", "rank 1"]
    assert "replica 0 of 2" in drawn["title"], drawn["title"]
    assert {label for *_, label in drawn["events"]} >= {"0F0", "1B3"}


def test_the_step_kept_in_the_manifest_is_the_step_predicted(tmp_path: Path) -> None:
    """`simulate_step` on the manifest's inputs gives its step: one function for both."""
    from partitioner.predict.step import StepInputs, simulate_step

    m = compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, dp=2, microbatches=4, hardware="a100").manifest
    assert m.predicted is not None
    again = simulate_step(StepInputs.from_dict(m.predicted.extra["simulation"]))
    assert again.step_time_s == pytest.approx(m.predicted.step_time_s, rel=1e-5)
    assert m.predicted.extra["simulation"]["after_s"] > 0  # the gradient all-reduce of 2 replicas


def test_a_package_without_a_kept_simulation_is_refused_with_the_fix(tmp_path: Path) -> None:
    from partitioner.errors import PackageError
    from runtime.manifest import Manifest

    manifest = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="a100").manifest.to_dict()
    del manifest["predicted"]["simulation"]
    with pytest.raises(PackageError, match=r"keeps no simulation of its step to draw .*: compile it again"):
        timeline.simulate_manifest(Manifest.from_json(manifest, "manifest.json"))
