"""The zoo's one check: a model file compiled (analytic costs) and trained against the original.

`trains_like_original` compiles the file, loads the original weights into a LocalPipeline,
trains `steps` SGD steps on the example batch and compares every loss and every entry of the
state_dict (parameters and buffers: BatchNorm's running statistics and counters too) with
the original model trained the same way on the whole batch, to rtol 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import runtime
from partitioner.trace import model_file

from ..conftest import compile_example, train_original, train_pipeline

__all__ = ["MODELS", "trains_like_original"]

MODELS = Path(__file__).resolve().parent / "models"


def trains_like_original(name: str, out: Path, steps: int = 2, lr: float = 0.05, **options: Any) -> runtime.LocalPipeline:
    """Compile `tests/zoo/models/<name>.py` with `options`, train, compare; the pipeline."""
    path = str(MODELS.relative_to(Path.cwd()) / f"{name}.py") if MODELS.is_relative_to(Path.cwd()) else str(MODELS / f"{name}.py")
    want_losses, want = train_original(path, steps, lr)
    compile_example(path, out, **options)
    pipe = runtime.LocalPipeline(str(out))
    pipe.load_state_dict(model_file.load(path).build(0).state_dict())
    got_losses = train_pipeline(pipe, path, steps, lr)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    got = pipe.state_dict()
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {key}: {m}")
    return pipe
