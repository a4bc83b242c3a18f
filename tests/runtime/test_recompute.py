"""`--recompute` at run time: every stage's forward runs again in its backward, and
training gives the weights the original model gives (float32, rtol 1e-5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from partitioner.trace import model_file

from ..conftest import FREE_LINKS as FREE, compile_example, train_original, train_pipeline

STEPS, LR = 3, 0.05


@pytest.mark.parametrize("example, options", [
    ("examples/gpt.py", {"stages": 2, "schedule": "1f1b"}),
    ("examples/gpt.py", {"stages": 3, "schedule": "gpipe"}),
    ("examples/skip.py", {"stages": 2, "schedule": "interleaved", "microbatches": 4}),
    ("examples/hf_gpt2.py", {"stages": 2, "schedule": "1f1b"}),
    ("examples/gpt.py", {"stages": 2, "tp": 2, "hardware": FREE}),  # two tensor-parallel lanes
])
def test_recomputed_training_matches_the_original(example: str, options: dict[str, Any], tmp_path: Path) -> None:
    compile_example(example, tmp_path / "pkg", recompute=True, **options)
    mf = model_file.load(example)
    want_losses, want = train_original(example, STEPS, LR)
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"))
    assert all(r.recompute for r in pipe.runners)
    if "tp" in options:
        assert pipe.manifest.tensor_parallel["rules"], "the free links split the model"
    pipe.load_state_dict(mf.build(0).state_dict())
    got_losses = train_pipeline(pipe, example, STEPS, LR)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    got = pipe.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_each_stage_runs_its_forward_again_in_backward(tmp_path: Path) -> None:
    counts: dict[bool, list[int]] = {}  # calls seen by a pre-hook: a recomputation may stop early
    for recompute in (False, True):
        compile_example("examples/gpt.py", tmp_path / str(recompute), stages=2, microbatches=4, recompute=recompute)
        pipe = runtime.LocalPipeline(str(tmp_path / str(recompute)))
        calls = [0] * len(pipe.runners)
        for k, r in enumerate(pipe.runners):
            r.module.register_forward_pre_hook(lambda *_a, k=k: calls.__setitem__(k, calls[k] + 1))
        mf = model_file.load("examples/gpt.py")
        pipe.load_state_dict(mf.build(0).state_dict())
        train_pipeline(pipe, "examples/gpt.py", 1, LR)
        args, _ = mf.example_inputs()
        with torch.no_grad():
            pipe(args)  # forward only: never recomputed
        counts[recompute] = calls
    assert counts[False] == [4 + 4, 4 + 4]
    assert counts[True] == [2 * 4 + 4, 2 * 4 + 4]


_DROPOUT = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x):
        x = F.dropout(F.gelu(self.a(x)), p=0.3, training=True)
        x = F.dropout(F.gelu(self.b(x)), p=0.3, training=True)
        return self.c(x)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))


def loss_fn(out, target):
    return F.cross_entropy(out, target)
'''


def test_dropout_masks_are_the_same_when_recomputed(tmp_path: Path) -> None:
    """Recomputation restores the RNG state, so a stage with dropout gets the gradients
    it gets without recomputation."""
    path = tmp_path / "dropout_net.py"
    path.write_text(_DROPOUT)
    mf = model_file.load(str(path))
    grads = {}
    for recompute in (False, True):
        compile_example(str(path), tmp_path / f"pkg{recompute}", stages=2, microbatches=4, recompute=recompute)
        pipe = runtime.LocalPipeline(str(tmp_path / f"pkg{recompute}"))
        pipe.load_state_dict(mf.build(0).state_dict())
        torch.manual_seed(123)
        args, _ = mf.example_inputs()
        pipe.train_step(args, mf.example_target())
        grads[recompute] = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
