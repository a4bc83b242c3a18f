"""clip_grad_norm_ and make_optimizer on DistributedPipeline (gloo, 2 and 4 ranks): every
rank compares the norm, its clipped gradients and the weights after 5 AdamW steps with the
original model in that process (dist_worker.py, MODE train)."""

from __future__ import annotations

import json
import re
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


def _with_zero(pkg: Path) -> Path:
    """The package as `compile --zero 1` records it (manifest options)."""
    path = pkg / "manifest.json"
    data = json.loads(path.read_text())
    data["options"]["zero"] = 1
    path.write_text(json.dumps(data, indent=1))
    return pkg


@multiproc
@pytest.mark.timeout(120)
def test_zero_1_shards_the_state_and_trains_the_same(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    """AdamW with --zero 1 at dp = 2 (pp = 2, tied; and tp = 2): the same weights after 5 steps
    as the model, each replica holding part of the optimizer state."""
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2, dp=2)
    ranks = launch(4, "train", [_with_zero(t.dir)], t.dir.parent / "tiny.py")
    _ok(ranks)
    pkg = _with_zero(write_tp_package(tmp_path, stages=1, tp=2, dp=2, microbatches=2, schedule="gpipe"))
    tp_ranks = launch(4, "train", [pkg], tmp_path / "tp_net.py")
    _ok(tp_ranks)
    for rank in ranks + tp_ranks:
        assert re.search(r"optimizer state \d+ of \d+", rank.out), rank.out


@multiproc
@pytest.mark.timeout(120)
def test_a_failed_step_on_one_rank_is_refused_by_every_rank(make_tiny: Callable[..., Tiny]) -> None:
    """Rank 1 catches its failed step 2 and goes on to step 3; rank 0, at step 2, refuses
    within a second naming both steps, rank 1 refuses too, until recover()."""
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2)
    ranks = launch(2, "drift", [t.dir], t.dir.parent / "tiny.py")
    _ok(ranks)
    assert "1 caught: " in ranks[1].out
    refused = [re.search(r"^(\d) refused in ([0-9.]+) s: (.*)$", rank.out, re.M) for rank in ranks]
    assert all(refused), [rank.out for rank in ranks]
    assert all(float(m.group(2)) < 1.0 for m in refused if m)
    assert refused[0] and refused[0].group(3).startswith("rank 0 refuses step 2: rank 1's step 2 failed, it is now at step 3.")
    assert refused[1] and "rank 1 refuses step 3: rank 1's step 2 failed (this rank), it is now at step 3" in refused[1].group(3)
    for r, rank in enumerate(ranks):
        assert re.search(rf"^{r} refused again in [0-9.]+ s: rank {r} refuses step", rank.out, re.M), rank.out
