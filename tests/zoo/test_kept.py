"""A submodule neither tracer can trace (a data-dependent `if`) is kept
whole inside a larger model: placed on one stage, run as the user wrote it, trained like
the original; a top-level module with one is refused (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import FREE_LINKS
from .harness import trains_like_original


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_submodule_with_data_dependent_control_flow_is_kept_whole(schedule: str, tmp_path: Path) -> None:
    trains_like_original("kept_whole", tmp_path / "pkg", stages=2, schedule=schedule)
    stages = [p.read_text() for p in sorted((tmp_path / "pkg").glob("stage_*.py"))]
    holding = [s for s in stages if "kept_module(__file__, 'gate')" in s]
    assert len(holding) == 1 and "kept_whole.py, line 17: `if torch.isfinite(h).all():`" in holding[0]
    assert "torch.func.functional_call(self.gate_module, {'fc.weight': self.gate_fc_weight" in holding[0]


def test_a_kept_module_is_never_tensor_split(tmp_path: Path) -> None:
    """With tp = 2 on free links (where the solver splits all it can) the kept module's
    weights stay whole on each rank and training still matches."""
    trains_like_original("kept_whole", tmp_path / "pkg", stages=2, tp=2, hardware=FREE_LINKS)
    held = next(s for s in (p.read_text() for p in sorted((tmp_path / "pkg").glob("stage_*.py"))) if "gate_module" in s)
    assert "self.gate_fc_weight = torch.nn.Parameter(torch.zeros(16, 16))" in held


def test_a_top_level_module_with_data_dependent_control_flow_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "partitioner", "compile", "tests/model_files/data_dependent.py",
                           "--out", str(tmp_path / "pkg"), "--stages", "2", "--analytic"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    said = " ".join(done.stderr.split())
    assert "data_dependent.py, line 17: `if h.sum() > 0:`" in said and "Traceback" not in said
