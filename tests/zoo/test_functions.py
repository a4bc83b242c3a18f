"""Custom autograd Functions keep their own backward: the stage calls the
user's `Function.apply` (from the model file), or the compile refuses naming the Function."""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.errors import TraceError

from ..conftest import compile_example
from .harness import trains_like_original


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_functions_keep_their_backward(schedule: str, tmp_path: Path) -> None:
    """A straight-through round (whose derivative would be zero) and a gradient reversal
    (whose sign would flip): trained like the original, so the stages ran their backward."""
    trains_like_original("custom_function", tmp_path / "pkg", stages=2, microbatches=2, schedule=schedule)
    source = "".join(p.read_text() for p in sorted((tmp_path / "pkg").glob("stage_*.py")))
    assert "model.RoundSTE.apply(" in source and "model.GradReverse.apply(" in source


def test_export_refuses_a_function_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"Function RoundSTE.*--tracer fx"):
        compile_example("tests/zoo/models/custom_function.py", tmp_path / "pkg", stages=2, tracer="export")


def test_a_function_called_through_an_alias_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"custom_function\.RoundSTE.*traced into.*RoundSTE\.apply\(\.\.\.\)"):
        compile_example("tests/zoo/models/custom_function_alias.py", tmp_path / "pkg", stages=2)
