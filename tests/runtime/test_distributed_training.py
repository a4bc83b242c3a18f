"""clip_grad_norm_ and make_optimizer on DistributedPipeline (gloo, 2 and 4 ranks): every
rank compares the norm, its clipped gradients and the weights after 5 AdamW steps with the
original model in that process (dist_worker.py, MODE train)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from .conftest import Tiny
from .test_distributed import _ok, launch, multiproc
from .tp_package import write_tp_package


@multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages, dp", [(2, 1), (2, 2)], ids=["pp2-tied", "pp2-dp2-tied"])
def test_clipping_and_adamw_match_the_model(make_tiny: Callable[..., Tiny], stages: int, dp: int) -> None:
    t = make_tiny(stages=stages, schedule="1f1b", microbatches=2, dp=dp)
    _ok(launch(stages * dp, "train", [t.dir], t.dir.parent / "tiny.py"))


@multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages, dp", [(2, 1), (1, 2)], ids=["pp2-tp2-tied", "dp2-tp2"])
def test_clipping_and_adamw_match_the_model_with_tp(tmp_path: Path, stages: int, dp: int) -> None:
    pkg = write_tp_package(tmp_path, stages=stages, tp=2, dp=dp, microbatches=2, schedule="gpipe")
    _ok(launch(stages * 2 * dp, "train", [pkg], tmp_path / "tp_net.py"))
