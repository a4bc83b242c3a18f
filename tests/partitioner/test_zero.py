"""`compile --zero 1`: recorded in the manifest, and the memory model charges each rank
1/dp of the optimizer state ([Note: ZeRO-1] in runtime/optim.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime import package
from runtime.optim import zero_stage

from ..conftest import compile_example


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_1_charges_one_replica_share_of_the_optimizer_state(dp: int, tmp_path: Path) -> None:
    manifests = {}
    for zero in (0, 1):
        compile_example("examples/gpt.py", tmp_path / f"z{zero}", stages=1, dp=dp, microbatches=2, zero=zero)
        manifests[zero] = package.load_manifest(tmp_path / f"z{zero}")
    assert zero_stage(manifests[0]) == 0 and zero_stage(manifests[1]) == 1
    assert "zero" not in manifests[0].options  # written only when set: earlier packages stay byte-identical
    before, after = (m.predicted.stages[0] for m in (manifests[0], manifests[1]))  # type: ignore[union-attr]
    assert before.param_bytes == after.param_bytes > 0
    adam = 2  # bytes of state (m, v) per byte of parameter
    saved = before.memory_bytes - after.memory_bytes
    assert abs(saved - before.param_bytes * adam * (1 - 1 / dp)) <= 2, (saved, before.param_bytes)
