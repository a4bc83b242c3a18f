"""`show DIR --timeline FILE.png`: the predicted step drawn, ranks x time."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.cli import main
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
