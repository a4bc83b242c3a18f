"""The split backward (I then W, [Note: split backward] in runtime/stage.py) under the
zero-bubble schedules gives, after one step, the gradients of the fused backward (B) on
the same compiled package: the examples, recomputation, and two tensor-parallel lanes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from partitioner.trace import model_file

from ..conftest import FREE_LINKS as FREE, compile_example

CASES = [
    ("examples/mlp.py", {"stages": 3, "microbatches": 4}),
    ("examples/skip.py", {"stages": 2, "microbatches": 4}),  # values read by several later stages
    ("examples/gpt.py", {"stages": 2, "microbatches": 4}),
    ("examples/hf_gpt2.py", {"stages": 2, "microbatches": 2}),
    ("examples/gpt.py", {"stages": 2, "microbatches": 2, "recompute": True}),
    ("examples/gpt.py", {"stages": 2, "microbatches": 2, "tp": 2, "hardware": FREE}),  # two lanes
]


def _one_step(pkg: Path, example: str, schedule: str) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor | None]]]:
    mf = model_file.load(example)
    args, kwargs = mf.example_inputs()
    pipe = runtime.LocalPipeline(pkg, schedule=schedule)
    pipe.load_state_dict(mf.build(0).state_dict())
    loss = pipe.train_step(kwargs if kwargs else args, mf.example_target())
    return loss, [(n, p.grad) for n, p in pipe.named_parameters()]


@pytest.mark.parametrize("example, options", CASES, ids=[f"{Path(e).stem}-" + "-".join(f"{k}{v}" for k, v in o.items()
                                                                                      if k != "hardware")
                                                         for e, o in CASES])
def test_split_backward_gives_the_fused_gradients(example: str, options: dict[str, Any], tmp_path: Path) -> None:
    compiled = compile_example(example, tmp_path / "pkg", schedule="zb-h1", **options)
    assert compiled.manifest["schedule"] == "zb-h1"
    if "tp" in options:
        assert compiled.manifest["tensor_parallel"]["rules"], "the free links split the model"
    want_loss, want = _one_step(tmp_path / "pkg", example, "1f1b")
    assert all(g is not None for _, g in want)
    for schedule in ("zb-h1", "zb-h2"):
        loss, got = _one_step(tmp_path / "pkg", example, schedule)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        assert [n for n, _ in got] == [n for n, _ in want]
        for (name, g), (_, w) in zip(got, want):
            assert g is not None, f"{schedule}: {name} has no gradient"
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule}, {name}: {m}")
