"""[Note: non-finite steps]: `runtime.finite_step` in process, and `partitioner run
--on-nonfinite skip|stop` on 2 gloo ranks with a model file whose target holds a nan at step 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Callable

import pytest
import torch

import runtime
from runtime.errors import NonFiniteError

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
    with pytest.raises(NonFiniteError, match=r"step 3: the loss \(nan\) or a gradient is not finite .* pass "
                                             r"--on-nonfinite skip"):
        runtime.finite_step(loss, opt, step=3, on_nonfinite="stop")
    assert not runtime.finite_step(loss, opt, step=3, on_nonfinite="skip")
    assert all(p.grad is None or not p.grad.any() for p in pipe.parameters())


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
    assert rc == 0 and "step 2  loss nan  skipped (not finite)" in out, out[-3000:]
    rc, ref_out = _run(reference, [1, 3, 4], 0)  # a run that never saw step 2's batch
    assert rc == 0, ref_out[-3000:]
    want, got = _final(reference), _final(skipped)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    rc, out = _run(stopped, [1, 2, 3, 4], 2, "--on-nonfinite", "stop")
    assert rc != 0 and "error: step 2: the loss (nan) or a gradient is not finite" in out, out[-3000:]
    assert "step 3" not in out and not (stopped.dir.parent / "ck").exists()
