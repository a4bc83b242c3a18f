"""State the forward updates itself: a momentum teacher's weights moved toward the student
under `torch.no_grad()` by a loop over the modules' tensors, and spectral norm's power
iteration (`out=` writes into its buffers under `torch.no_grad()`).  With one microbatch
the pipeline trains as the original; with several the compile says the update runs once
per microbatch."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from partitioner.errors import TraceError
from partitioner.trace import model_file
from partitioner.trace.buffers import StateUpdateWarning, TrainOnlyUpdateWarning
from partitioner.trace.state import StateUpdatedWhileTracing
from partitioner.trace.trace import trace

from ..conftest import compile_example

from .harness import trains_like_original

TEACHER = "tests/zoo/models/momentum_teacher.py"


def test_momentum_teacher_trains_like_original(tmp_path: Path) -> None:
    """[Note: state updated outside the graph]: fx would run the teacher's update once while
    tracing; auto traces with export, whose graph updates the teacher on every call."""
    trains_like_original("momentum_teacher", tmp_path / "pkg", steps=3, stages=2, microbatches=1)


def test_momentum_teacher_under_fx_is_refused_and_left_as_it_was() -> None:
    mf = model_file.load(TEACHER)
    model = mf.build(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateUpdatedWhileTracing, match=r"MomentumTeacher\.forward\(\) \(momentum_teacher\.py, line \d+: "
                       r"`t\.mul_\(m\)\.add_\(s, alpha=1 - m\)`\) updates teacher\.0\.weight, .*--tracer export"):
        trace(model, mf.example_inputs()[0], {}, "fx", mf.path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


class ThroughData(torch.nn.Module):
    """A momentum teacher whose update goes through `.data` (MoCo's own `param_k.data = ...`)."""

    def __init__(self, rebind: bool) -> None:
        super().__init__()
        self.rebind = rebind
        self.student, self.teacher = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            if self.rebind:
                t.data = t.data * 0.9 + s.data * 0.1
            else:
                t.data.mul_(0.9).add_(s.data, alpha=0.1)
        return self.student(x) + self.teacher(x)


@pytest.mark.parametrize("rebind", [False, True], ids=["data_mul_", "data_assigned"])
def test_an_update_through_data_is_refused_never_dropped(rebind: bool) -> None:
    """Neither tracer records a write through `.data`: auto says how to write it instead and
    leaves the model as it was."""
    model = ThroughData(rebind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TraceError, match=r"fx: StateUpdatedWhileTracing: ThroughData\.forward\(\).* updates teacher\.weight, "
                       r"teacher\.bias .*not through `\.data`.*export: .*Write the update as the fx failure says"):
        trace(model, (torch.randn(3, 4),), {}, "auto")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_spectral_norm_trains_like_original(tracer: str, tmp_path: Path) -> None:
    """[Note: no_grad regions]: the power iteration's `out=` writes run without gradients,
    its `weight_u` / `weight_v` buffers updated on every call as the original's."""
    trains_like_original("spectral_norm", tmp_path / "pkg", steps=3, stages=2, microbatches=1, tracer=tracer)


@pytest.mark.parametrize("name, written", [("momentum_teacher", r"teacher\.0\.weight, teacher\.0\.bias"),
                                           ("spectral_norm", r"fc1\.weight_v, fc1\.weight_u")])
def test_state_updates_with_several_microbatches_warn(name: str, written: str, tmp_path: Path) -> None:
    path = f"tests/zoo/models/{name}.py"
    with pytest.warns(StateUpdateWarning, match=rf"in place on every call \({written}.*once per microbatch.*"
                                                r"--microbatches 1"):
        compile_example(path, tmp_path / "m2", stages=2, microbatches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StateUpdateWarning)
        compile_example(path, tmp_path / "m1", stages=2, microbatches=1)


def test_an_update_made_in_train_mode_only_warns(tmp_path: Path) -> None:
    """Spectral norm runs its power iteration in train mode only; the stages, traced in train
    mode, run it after `pipe.eval()` too, so the compile says so (and leaves the model's
    buffers as they were); a momentum teacher updates in both modes and is not told."""
    mf = model_file.load("tests/zoo/models/spectral_norm.py")
    with pytest.warns(TrainOnlyUpdateWarning, match=r"updates fc1\.weight_v, fc1\.weight_u.*train mode only.*pipe\.eval"):
        compile_example(mf.path, tmp_path / "spectral", stages=2, microbatches=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainOnlyUpdateWarning)
        compile_example(TEACHER, tmp_path / "teacher", stages=2, microbatches=1)
