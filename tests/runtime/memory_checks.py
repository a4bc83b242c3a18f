"""The checks of `pipe.memory_stats()` ([Note: measured memory] in runtime/memory.py) on
one process's pipeline, shared by tests/runtime/test_memory.py (LocalPipeline) and the
ranks of dist_worker.py (MODE memory): SGD with momentum, one warm-up step, then a
tracked step with the gradients kept (zeroed in place), then a tracked evaluate; and the
training loop the memory model predicts (`tracked_step`, the one benchmarks/memory.py runs)."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.memory import tracked_step  # the benchmark's step, measured alike here
from runtime.memory import MemoryStats, NotTrackedError

__all__ = ["check_memory", "tracked_step"]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check_memory(pipe: Any, inputs: Any, target: Any) -> MemoryStats:
    """Run the steps and check the kinds; the training step's stats."""
    opt = pipe.make_optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    pipe.train_step(inputs, target)  # untracked: nothing is measured
    opt.step()
    try:
        pipe.memory_stats()
        raise AssertionError("memory_stats() answered before any tracked step")
    except NotTrackedError as e:
        assert "track_memory(True)" in str(e), e
    opt.zero_grad(set_to_none=False)
    pipe.track_memory(True)
    pipe.train_step(inputs, target)
    opt.step()
    stats = pipe.memory_stats()
    params = _bytes(pipe.parameters())
    assert stats.parameters == params, (stats, params)
    assert stats.gradients == params, (stats, params)
    assert stats.optimizer == params, (stats, params)  # one momentum buffer per parameter
    assert stats.activations > 0, stats
    assert stats.total >= stats.parameters + stats.gradients + stats.optimizer + stats.activations + stats.other
    assert stats.predicted > 0 and "predicted" in str(stats) and "\n" not in str(stats), str(stats)
    pipe.evaluate(inputs, target)
    evaluated = pipe.memory_stats()
    assert evaluated.activations == 0 and evaluated.parameters == params, evaluated
    pipe.track_memory(False)
    return stats
