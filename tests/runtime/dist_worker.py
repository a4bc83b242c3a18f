"""One rank of a multi-process test: `python dist_worker.py MODE PKG MODEL_FILE`.

MODE check: train_step, forward and 3 SGD steps compared with the reference model run
in this same process; prints "RANK ok" and exits 0, or a traceback and exits 1.
MODE fault: trains (PIPELINE_FAULT stops one rank); a PipelineError prints its message
and exits 3.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import runtime  # noqa: E402
from runtime.errors import PipelineError  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def _model_file(path: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("_tiny_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    torch.manual_seed(0)
    model = mf.build_model()
    inputs, target = mf.example_inputs(), mf.example_target()
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    # one step: loss on every rank, every local gradient
    ref = mf.loss_fn(model(*inputs), target)
    ref.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    loss = pipe.train_step(inputs, target)
    torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
    # forward only, on every rank
    with torch.no_grad():
        torch.testing.assert_close(pipe(inputs), model(*inputs), rtol=RTOL, atol=ATOL)
    # three SGD steps, then the collective state_dict
    opt_ref = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        opt_ref.zero_grad()
        mf.loss_fn(model(*inputs), target).backward()
        opt_ref.step()
        opt.zero_grad()
        pipe.train_step(inputs, target)
        opt.step()
    got, ref_sd = pipe.state_dict(), model.state_dict()
    assert set(got) == set(ref_sd), sorted(set(got) ^ set(ref_sd))
    for name in ref_sd:
        torch.testing.assert_close(got[name], ref_sd[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    print(f"{pipe.rank} ok", flush=True)


def _fault(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    torch.manual_seed(0)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())
    for _ in range(2):
        pipe.train_step(mf.example_inputs(), mf.example_target())


def main() -> int:
    mode, pkg, model_path = sys.argv[1:4]
    try:
        {"check": _check, "fault": _fault}[mode](pkg, model_path)
    except PipelineError as exc:
        print(f"PipelineError: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: nothing left to wait for


if __name__ == "__main__":
    sys.exit(main())
