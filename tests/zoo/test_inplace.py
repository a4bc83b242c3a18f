"""Issue 17, point 1 and 2: in-place ops and mutated buffers, profiled, placed and run like
the original (ResNet-18's structure: inplace ReLU, `out += identity`, BatchNorm in train mode)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import trains_like_original


@pytest.mark.parametrize("analytic", [True, False])
def test_resnet_profiles_and_trains(analytic: bool, tmp_path: Path) -> None:
    trains_like_original("resnet_tiny", tmp_path / "pkg", stages=2, microbatches=1, analytic=analytic)
