"""A loss_fn that sums over the batch trains as the original does, its sum; one that is
neither a mean nor a sum over rows (a mean over a token count that differs between rows)
is refused at compile time, naming the fix ([Note: the loss's reduction] in
driver/loss_check.py; [Note: microbatch weights] in runtime/microbatches.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from partitioner.errors import ModelFileError
from partitioner.trace import model_file
from runtime.errors import ManifestError
from runtime.manifest import Manifest

from .conftest import compile_example
from .runtime.test_distributed import _ok, launch, multiproc

RTOL, ATOL = 1e-5, 1e-6

_MLP = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def example_inputs():
    return (torch.randn(16, 8, generator=torch.Generator().manual_seed(0)),)


def example_target():
    return torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return {loss}
'''

SUM = _MLP.format(loss='F.cross_entropy(output, target, reduction="sum")')
#: a sum divided by a constant is a sum too (the fix the refusal names for a token mean)
SUM_SCALED = _MLP.format(loss='F.mse_loss(output, F.one_hot(target, 4).float(), reduction="sum") / 64.0')

_LM = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

B, T, V = 8, 6, 11


def build_model():
    return nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, V))


def example_inputs():
    return (torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0)),)


def example_target():
    target = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    for row in range(B):
        target[row, T - row % 4:] = -100  # rows padded by 0 to 3 tokens
    return target


def loss_fn(output, target):
{body}
'''

#: cross_entropy's default: the mean over the real tokens of the whole batch
TOKEN_MEAN = _LM.format(body="    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100)")
#: the fix the refusal names: each row's mean over its real tokens, then the mean over rows
ROW_MEAN = _LM.format(body="""    per_token = F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none")
    real = (target != -100).float()
    return ((per_token.view_as(real) * real).sum(1) / real.sum(1)).mean()""")


def _model_file(tmp_path: Path, text: str, name: str = "loss_model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _compile(path: Path, out: Path, lines: list[str] | None = None, **options: Any) -> Manifest:
    from driver.compile import compile_model
    from driver.options import CompileOptions

    opts = CompileOptions(model=str(path), out=str(out), analytic=True, hardware="a100", quiet=True, time_limit=1.0,
                          **options)
    return compile_model(opts, log=(lines.append if lines is not None else None)).manifest


def _train_both(path: Path, pkg: Path, batches: list[int]) -> None:
    """One SGD step on each of `batches` (the example batch's first rows) through LocalPipeline
    and the original model with the same loss_fn: loss, evaluate() and every weight after
    each step agree."""
    mf = model_file.load(str(path))
    model = mf.build(0)
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    x, y, loss_fn = mf.example_inputs()[0][0], mf.example_target(), mf.loss_fn()
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.01), torch.optim.SGD(model.parameters(), lr=0.01)
    for rows in batches:
        opt.zero_grad()
        ref_opt.zero_grad()
        got = pipe.train_step((x[:rows],), y[:rows])
        ref = loss_fn(model(x[:rows]), y[:rows])
        ref.backward()
        torch.testing.assert_close(got, ref.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{rows} rows: {m}")
        with torch.no_grad():
            torch.testing.assert_close(pipe.evaluate((x[:rows],), y[:rows]), ref.detach(), rtol=RTOL, atol=ATOL)
        opt.step()
        ref_opt.step()
        got_state = pipe.state_dict()
        for name, want in model.state_dict().items():
            torch.testing.assert_close(got_state[name], want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name} after {rows} rows: {m}")


def test_a_sum_loss_is_found_said_and_recorded(tmp_path: Path) -> None:
    lines: list[str] = []
    manifest = _compile(_model_file(tmp_path, SUM), tmp_path / "pkg", lines, stages=2, microbatches=4)
    assert manifest.loss_reduction == "sum"
    said = [line for line in lines if line.startswith("loss_fn sums over the batch")]
    assert len(said) == 1 and "4 microbatches" in said[0], lines
    data = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert data["loss_reduction"] == "sum"
    assert Manifest.from_json(data).loss_reduction == "sum"


@pytest.mark.parametrize("stages,microbatches,dp,batches", [
    (2, 4, 1, [16, 16, 7]),  # a short batch of 7 rows: microbatches of 2, 2, 2, 1
    (2, 2, 2, [16, 10]),     # two replicas in one process; 5 rows each: microbatches of 3 and 2
], ids=["pp2-m4", "pp2-m2-dp2"])
def test_a_sum_loss_trains_as_the_original(tmp_path: Path, stages: int, microbatches: int, dp: int,
                                           batches: list[int]) -> None:
    path = _model_file(tmp_path, SUM)
    _compile(path, tmp_path / "pkg", stages=stages, microbatches=microbatches, dp=dp)
    _train_both(path, tmp_path / "pkg", batches)


def test_a_sum_divided_by_a_constant_trains_as_the_original(tmp_path: Path) -> None:
    path = _model_file(tmp_path, SUM_SCALED)
    assert _compile(path, tmp_path / "pkg", stages=2, microbatches=4).loss_reduction == "sum"
    _train_both(path, tmp_path / "pkg", [16, 6])


def test_a_token_weighted_mean_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = _model_file(tmp_path, TOKEN_MEAN)
    with pytest.raises(ModelFileError) as info:
        _compile(path, tmp_path / "pkg", stages=2, microbatches=4)
    text = str(info.value)
    assert text.startswith(f"{path}: loss_fn is neither a mean nor a sum over the batch's rows"), text
    assert "4 microbatches of 2 rows" in text and "ignore_index=-100" in text and 'reduction="sum"' in text, text
    assert not (tmp_path / "pkg").exists()


def test_the_fix_a_mean_over_rows_trains_as_the_original(tmp_path: Path) -> None:
    path = _model_file(tmp_path, ROW_MEAN)
    manifest = _compile(path, tmp_path / "pkg", stages=2, microbatches=4)
    assert manifest.loss_reduction == "mean"
    assert "loss_reduction" not in json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    _train_both(path, tmp_path / "pkg", [8, 5])


def test_one_microbatch_has_nothing_to_check(tmp_path: Path) -> None:
    """A token-weighted mean over a batch the package never cuts is the original's loss."""
    path = _model_file(tmp_path, TOKEN_MEAN)
    assert compile_example(str(path), tmp_path / "pkg", stages=1, microbatches=1).manifest.loss_reduction == "mean"


def test_the_manifest_refuses_an_unknown_reduction(tmp_path: Path) -> None:
    _compile(_model_file(tmp_path, SUM), tmp_path / "pkg", stages=2, microbatches=2)
    data = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    data["loss_reduction"] = "token_mean"
    with pytest.raises(ManifestError, match="loss_reduction: expected one of mean, sum"):
        Manifest.from_json(data)


@multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,engine", [("local", "partitioner"), ("check", "pipelining")])
def test_a_sum_loss_trains_on_two_replicas(tmp_path: Path, mode: str, engine: str) -> None:
    """DistributedPipeline, gloo, dp = 2: mode local gives each replica only its rows (3, 3,
    then a short 2 per replica, then 5 and 4 rows), mode check the global batch (loss,
    gradients, forward, evaluate, 3 SGD steps), on torch.distributed.pipelining's engine."""
    path = _model_file(tmp_path, SUM)
    _compile(path, tmp_path / "pkg", stages=1, microbatches=2, dp=2)
    _ok(launch(2, mode, [tmp_path / "pkg"], path, deadline_s=200, env={"PIPELINE_TEST_ENGINE": engine}))
