"""The model zoo (issue 17): models nobody here wrote, each compiled with analytic costs and
trained 2 SGD steps on LocalPipeline against the original (`harness.trains_like_original`:
every loss and state_dict entry to rtol 1e-5).  README.md, "Model zoo", lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .harness import trains_like_original

#: (model file in tests/zoo/models, compile options)
ZOO: list[tuple[str, dict[str, Any]]] = [
    ("resnet_tiny", dict(stages=3, microbatches=1, schedule="gpipe")),
    ("hf_mixtral", dict(stages=2, schedule="1f1b")),
    ("hf_t5", dict(stages=2, schedule="1f1b")),
    ("hf_clip_text", dict(stages=2, schedule="1f1b")),
]


@pytest.mark.parametrize("name,options", ZOO, ids=[z[0] for z in ZOO])
def test_zoo_trains_like_original(name: str, options: dict[str, Any], tmp_path: Path) -> None:
    trains_like_original(name, tmp_path / "pkg", **options)
