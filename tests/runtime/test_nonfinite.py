"""[Note: non-finite steps]: `runtime.finite_step` and `runtime.NonFiniteSteps` in process, and
`partitioner run --on-nonfinite skip|stop [--max-skips K]` on 2 gloo ranks with model files whose
targets make a loss or a gradient not finite at chosen steps."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Callable

import pytest
import torch

import runtime
from runtime import launch
from runtime.errors import NonFiniteError, PipelineError

from ..conftest import ROOT
from .conftest import Tiny

BATCHES = '''

def batches():
    for i in {steps}:
        x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(10 + i))
        y = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(20 + i))
        if i == {nan_at}:
            y[0, 0] = float("nan")
        yield (x,), y
'''


def test_finite_step_skips_or_stops(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, microbatches=2)
    pipe = runtime.LocalPipeline(t.dir)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    inputs, target = t.batch()
    assert runtime.finite_step(pipe.train_step(inputs, target), opt, step=1)
    target[0, 0] = float("nan")
    loss = pipe.train_step(inputs, target)
    with pytest.raises(NonFiniteError, match=r"step 3: the loss \(nan\) is not finite \(nan or inf\), and "
                                             r"--on-nonfinite stop ends the run here .* pass --on-nonfinite skip"):
        runtime.finite_step(loss, opt, step=3, on_nonfinite="stop")
    assert not runtime.finite_step(loss, opt, step=3, on_nonfinite="skip")
    assert all(p.grad is None or not p.grad.any() for p in pipe.parameters())


def test_a_finite_loss_with_a_nonfinite_gradient_names_the_parameter(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, microbatches=2)
    pipe = runtime.LocalPipeline(t.dir)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss = pipe.train_step(*t.batch())
    dict(pipe.named_parameters())["fc2.bias"].grad[3] = float("inf")
    with pytest.raises(NonFiniteError, match=rf"step 4: the gradient of fc2.bias is not finite \(nan or inf\), "
                                             rf"though the loss \({loss.item():g}\) is, and --on-nonfinite stop"):
        runtime.finite_step(loss, opt, step=4, on_nonfinite="stop", names=pipe.named_parameters())
    with pytest.raises(NonFiniteError, match=r"step 4: the gradient of parameter \d+ of the optimizer's group 0 "):
        runtime.finite_step(loss, opt, step=4, on_nonfinite="stop")  # no names given
    steps = runtime.NonFiniteSteps("skip", names=pipe.named_parameters())
    assert not steps(loss, opt, step=4) and steps.skipped == "the gradient of fc2.bias"
    assert runtime.finite_step(loss, opt, step=4)  # zeroed


def test_skips_stop_after_max_skips_in_a_row(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, microbatches=2)
    pipe = runtime.LocalPipeline(t.dir)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    inputs, target = t.batch()
    bad = target.clone()
    bad[0, 0] = float("nan")
    steps = runtime.NonFiniteSteps("skip", max_skips=2)
    taken = [steps(pipe.train_step(inputs, y), opt, step=k) for k, y in enumerate([bad, bad, target, bad, bad], 1)]
    assert taken == [False, False, True, False, False] and steps.skipped == "the loss"  # a finite step starts again
    with pytest.raises(NonFiniteError, match=r"step 6: the loss \(nan\) is not finite \(nan or inf\), nor was "
                                             r"any step since step 4: 3 in a row, more than --max-skips 2 allows, "
                                             r"so the run stops here \(no weight was changed by steps 4-6\)"):
        steps(pipe.train_step(inputs, bad), opt, step=6)
    assert runtime.scaler.MAX_SKIPS == 10 and runtime.NonFiniteSteps().max_skips == 10
    with pytest.raises(runtime.PipelineError, match=r"max_skips=-1: give how many steps in a row may be skipped"):
        runtime.NonFiniteSteps("skip", max_skips=-1)


@pytest.mark.parametrize("args, message", [
    (["--max-skips", "3"], r"--max-skips 3 bounds the steps skipped in a row by --on-nonfinite skip: add "
                           r"--on-nonfinite skip"),
    (["--on-nonfinite", "skip", "--max-skips", "-1"], r"--max-skips -1: give how many non-finite steps in a row"),
])
def test_max_skips_is_checked(make_tiny: Callable[..., Tiny], args: list[str], message: str) -> None:
    t = make_tiny(stages=2, microbatches=2)
    with pytest.raises(PipelineError, match=message):
        launch.main([str(t.dir), "--nproc", "2", *args])


def _run(t: Tiny, steps: list[int], nan_at: int, *args: str) -> tuple[int, str]:
    """`partitioner run` of t's package, its model file's batches() those of `steps`."""
    model = t.dir.parent / "tiny.py"
    model.write_text(model.read_text() + BATCHES.format(steps=steps, nan_at=nan_at))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "30"}
    cmd = [sys.executable, "-m", "partitioner", "run", "pkg", "--nproc", "2", "--optimizer", "adamw",
           "--steps", str(len(steps)), "--checkpoint", "ck", *args]
    proc = subprocess.Popen(cmd, cwd=t.dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return proc.returncode, out


def _final(t: Tiny) -> dict[str, torch.Tensor]:
    pipe = runtime.LocalPipeline(t.dir)
    pipe.load_checkpoint(runtime.latest_checkpoint(t.dir.parent / "ck"))
    return pipe.state_dict()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_skips_or_stops_at_a_nan_loss(make_tiny: Callable[..., Tiny]) -> None:
    skipped, reference, stopped = (make_tiny(stages=2, microbatches=2) for _ in range(3))
    rc, out = _run(skipped, [1, 2, 3, 4], 2, "--on-nonfinite", "skip")
    assert rc == 0 and "step 2  loss nan  skipped (the loss is not finite)" in out, out[-3000:]
    rc, ref_out = _run(reference, [1, 3, 4], 0)  # a run that never saw step 2's batch
    assert rc == 0, ref_out[-3000:]
    want, got = _final(reference), _final(skipped)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    rc, out = _run(stopped, [1, 2, 3, 4], 2, "--on-nonfinite", "stop")
    assert rc != 0 and "error: step 2: the loss (nan) is not finite" in out, out[-3000:]
    assert "step 3" not in out and not (stopped.dir.parent / "ck").exists()


GRADIENT_THEN_LOSS = '''

def batches():
    for i in range(1, 6):
        x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(10 + i))
        y = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(20 + i))
        y[0, 0] = float("inf") if i == 2 else float("nan") if i >= 3 else y[0, 0]
        yield (x,), y


def loss_fn(output, target):
    loss = F.mse_loss(output, torch.where(torch.isinf(target), 0.0, target))
    if bool(torch.isinf(target).any()):  # the loss finite, its gradients nan (sqrt's at 0)
        loss = loss + torch.sqrt((output - output.detach()).pow(2).sum())
    return loss
'''


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_run_names_what_is_not_finite_and_stops_after_max_skips(make_tiny: Callable[..., Tiny]) -> None:
    """Step 2's loss is finite and its gradients are not (named, with the rank, gathered
    across ranks), steps 3 on have a nan loss: with --max-skips 1 step 3 stops the run, and
    the ranks' one message comes once, last, without torchrun's traceback."""
    t = make_tiny(stages=2, microbatches=2)
    model = t.dir.parent / "tiny.py"
    model.write_text(model.read_text() + GRADIENT_THEN_LOSS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", "pkg", "--nproc", "2", "--steps", "5",
                             "--clip", "1.0", "--on-nonfinite", "skip", "--max-skips", "1"], cwd=t.dir.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"^step 2  loss \d+\.\d{6}  skipped \(the gradient of embed\.weight on rank 0 is not finite\)  "
                     r"time ", out, re.M), out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("ranks 0, 1: error: step 3: the loss (nan) is not finite (nan or inf), nor was any step "
                           "since step 2: 2 in a row, more than --max-skips 1 allows"), out
    assert out.count("more than --max-skips 1") == 1 and "step 4" not in out, out
    assert "Traceback" not in out and "ChildFailedError" not in out and "Root Cause" not in out, out
