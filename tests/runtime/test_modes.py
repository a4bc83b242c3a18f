"""pipe.train() / pipe.eval() / pipe.evaluate against the original model, on a compiled
model with dropout and batch norm (tests/model_files/dropout_bn.py): the generated code
writes their mode as `self.training` ([Note: modes in generated code] in codegen/source.py)
and each microbatch draws its own seeded stream ([Note: dropout streams] in runtime/modes.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import runtime
from partitioner.trace import model_file

from ..conftest import compile_example

PATH = "tests/model_files/dropout_bn.py"
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The model in 2 stages, with 4 microbatches and with 1."""
    root = tmp_path_factory.mktemp("modes")
    return {m: _compile(root, m) for m in (4, 1)}


def _compile(root: Path, microbatches: int) -> Path:
    out = root / f"m{microbatches}"
    compile_example(PATH, out, stages=2, microbatches=microbatches)
    return out


def _setup(pkg: Path) -> tuple[runtime.LocalPipeline, torch.nn.Module, torch.Tensor, torch.Tensor]:
    mf = model_file.load(PATH)
    model = mf.build(0)
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    (x,), _ = mf.example_inputs()
    return pipe, model, x, mf.example_target()


def test_the_stage_code_follows_the_mode(compiled: dict[int, Path]) -> None:
    code = "".join(p.read_text() for p in sorted(compiled[4].glob("stage_*.py")))
    assert code.count("self.training") == 4  # three dropouts and the batch norm
    assert "0.25, True" not in code and "0.1, True" not in code


def test_eval_mode_equals_the_original_in_eval_mode(compiled: dict[int, Path]) -> None:
    pipe, model, x, target = _setup(compiled[4])
    assert pipe.training and pipe.eval() is pipe and not pipe.training
    assert not any(r.module.training for r in pipe.runners)
    model.eval()
    first, second = pipe(x), pipe(x)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, model(x), rtol=RTOL, atol=ATOL)
    loss = pipe.evaluate(x, target)
    assert not loss.requires_grad and all(p.grad is None for p in pipe.parameters())
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(model(x), target), rtol=RTOL, atol=ATOL)
    assert pipe.train() is pipe and pipe.training and all(r.module.training for r in pipe.runners)


def test_train_mode_drops_a_fraction_p_and_each_call_draws_anew(compiled: dict[int, Path]) -> None:
    pipe, _, x, _ = _setup(compiled[4])
    first, second = pipe(x), pipe(x)
    assert not torch.equal(first, second)
    kept = float((first != 0).float().mean())
    n, p = first.numel(), 0.25
    assert abs(kept - (1 - p)) < 3 * math.sqrt(p * (1 - p) / n), kept


def test_a_rerun_with_the_same_seed_reproduces_the_losses(compiled: dict[int, Path]) -> None:
    runs = []
    for _ in range(2):
        pipe, _, x, target = _setup(compiled[4])
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(float(pipe.train_step(x, target)))
            opt.step()
        runs.append(losses)
        torch.manual_seed(123)  # the caller's RNG does not matter
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3


def test_batch_norm_running_statistics_match_with_one_microbatch(compiled: dict[int, Path]) -> None:
    pipe, model, x, target = _setup(compiled[1])
    model.train()
    model(x)  # the running statistics of one training forward on the whole batch
    pipe.train_step(x, target)
    got, want = pipe.state_dict(), model.state_dict()
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
