"""local=True on DistributedPipeline (gloo, 2 and 4 ranks): each replica given only the rows
a DistributedSampler gives it, None where a rank's stages do not read them, trains as the
global-batch form and the original model do, a short uneven last batch included
(local_rows_worker.py); a rank that needs its inputs and gets None fails clearly on every rank.
LocalPipeline runs every replica in one process: local=True there only with dp = 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch

import runtime
from runtime.errors import BatchError

from .conftest import Tiny
from .test_distributed import _ok, launch, multiproc
from .tp_package import write_tp_package


def _free_batch(pkg: Path) -> Path:
    """The package as compiled with a free batch: every value crossing stages scales with the rows."""
    path = pkg / "manifest.json"
    data = json.loads(path.read_text())
    data["free_dims"] = ["batch"]
    for stage in data["stages"]:
        for value in stage["inputs"] + stage["outputs"]:
            if value.get("shape"):
                value["batch_dim"] = 0
    path.write_text(json.dumps(data, indent=1))
    return pkg


@multiproc
@pytest.mark.timeout(120)
def test_local_rows_train_as_the_global_batch_pp2_dp2_tied(make_tiny: Callable[..., Tiny]) -> None:
    """Stage 1 reads the model input too (so every rank is given inputs); stage 0's ranks pass
    None for the target."""
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2, dp=2)
    _ok(launch(4, "local", [_free_batch(t.dir)], t.dir.parent / "tiny.py", deadline_s=100))


@multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [2, 1], ids=["pp2-dp2-no-inputs-on-stage-1", "pp1-dp2"])
def test_local_rows_train_as_the_global_batch(tmp_path: Path, stages: int) -> None:
    """With pp = 2 the second stage reads no model input: its ranks pass None for inputs."""
    pkg = _free_batch(write_tp_package(tmp_path, stages=stages, tp=1, dp=2, microbatches=2, schedule="1f1b"))
    _ok(launch(stages * 2, "local", [pkg], tmp_path / "tp_net.py", deadline_s=100))


@multiproc
@pytest.mark.timeout(120)
def test_none_inputs_on_a_rank_that_reads_them_fail_on_every_rank(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2)
    ranks = launch(2, "localnone", [t.dir], t.dir.parent / "tiny.py")
    for rank in ranks:
        assert rank.rc == 3, rank.err[-3000:]
        assert ("rank 1 runs a stage that reads a model input but was given None for the inputs with local=True"
                in rank.err), rank.err[-3000:]


def test_local_pipeline_takes_local_rows_with_one_replica(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2)
    model, (inputs, target) = t.build(), t.batch()
    pipe = runtime.LocalPipeline(t.dir)
    pipe.load_state_dict(model.state_dict())
    assert (pipe.replica, pipe.replicas) == (0, 1)
    loss = pipe.train_step(inputs, target, local=True)
    ref = t.loss_fn(model(*inputs), target)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(zip([n for n, _ in pipe.named_parameters()], [p.grad for p in pipe.parameters()]))
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(BatchError, match="rank 0 runs a stage that reads a model input but was given None"):
        pipe.train_step(None, target, local=True)


def test_local_pipeline_refuses_local_rows_with_two_replicas(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2, dp=2)
    inputs, target = t.batch()
    pipe = runtime.LocalPipeline(t.dir)
    assert (pipe.replica, pipe.replicas) == (0, 2)
    with pytest.raises(BatchError, match="runs all 2 data-parallel replicas in one process.*DistributedPipeline"):
        pipe.evaluate(inputs, target, local=True)
