"""`pipe.track_memory` / `pipe.memory_stats()` ([Note: measured memory] in
runtime/memory.py) on examples/gpt.py in 2 stages: in one process (LocalPipeline, the
zero-bubble split backward included) and on 2 gloo ranks (1f1b, gpipe).  The prediction
is only checked to be reported, not to be close."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import runtime
from partitioner.trace import model_file
from runtime.memory import MemoryStats, NotTrackedError

from ..conftest import compile_example
from .memory_checks import check_memory
from .test_distributed import _ok, launch, multiproc

ROOT = Path(__file__).resolve().parents[2]
GPT = "examples/gpt.py"


@pytest.fixture(scope="module")
def zb_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("memory") / "pkg"
    compile_example(GPT, out, stages=2, microbatches=4, schedule="zb-h1")
    return out


def _local(pkg: Path, schedule: str | None = None) -> tuple[runtime.LocalPipeline, object, torch.Tensor]:
    mf = model_file.load(GPT)
    args, kwargs = mf.example_inputs()
    pipe = runtime.LocalPipeline(pkg, schedule=schedule)
    pipe.load_state_dict(mf.build(0).state_dict())
    return pipe, (kwargs if kwargs else args), mf.example_target()


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b", "gpipe"])
def test_local_pipeline_measures_each_kind(zb_package: Path, schedule: str) -> None:
    pipe, inputs, target = _local(zb_package, schedule)
    stats = check_memory(pipe, inputs, target)
    assert pipe.manifest.predicted is not None
    assert stats.predicted == sum(s.memory_bytes for s in pipe.manifest.predicted.stages)  # both stages here


def test_tracking_is_off_by_default_and_stops(zb_package: Path) -> None:
    pipe, inputs, target = _local(zb_package)
    pipe.train_step(inputs, target)
    with pytest.raises(NotTrackedError, match=r"no step ran with memory tracking on"):
        pipe.memory_stats()
    pipe.track_memory(True)
    pipe.evaluate(inputs, target)
    first = pipe.memory_stats()
    pipe.track_memory(False)
    pipe.train_step(inputs, target)  # not tracked: the evaluate's figures stay
    assert pipe.memory_stats() == first and first.activations == 0


def test_one_line() -> None:
    stats = MemoryStats(2**20, 2**20, 0, 3 * 2**20, 2**19, 5 * 2**20 + 2**19, 4 * 2**20)
    assert str(stats) == ("measured 5.50 MiB (1.38x) (parameters 1.00 MiB, gradients 1.00 MiB, optimizer 0.00 MiB, "
                          "activations 3.00 MiB, other 0.50 MiB); predicted 4.00 MiB")


@multiproc
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_rank_measures_its_own_stages(tmp_path: Path, schedule: str) -> None:
    compile_example(GPT, tmp_path / "pkg", stages=2, microbatches=4, schedule=schedule)
    model = tmp_path / "gpt.py"
    shutil.copy(ROOT / GPT, model)
    ranks = launch(2, "memory", [tmp_path / "pkg"], model, deadline_s=120)
    _ok(ranks)
    assert all("predicted" in r.out for r in ranks)
