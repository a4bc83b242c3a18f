"""The engine modes of dist_worker.py: engine="pipelining" against engine="partitioner" and the model.

MODE engines (each package of ENGINE_RUNS in turn, or PKG): the original model and one pipeline per engine on the same package, 2 steps
of SGD with momentum from the same weights: every step's loss and the weights after each
equal the model's (rtol 1e-5) on both engines.  A checkpoint saved by each engine after
step 1 (weights and optimizer state) is loaded by the other, which redoes step 2 and lands
on the model's step-2 weights again.  Then evaluate and pipe(inputs) on the torch engine
against the model.  Prints "RANK ok".
MODE engine_refused: the torch engine on a package it cannot run raises an EngineError
(printed; exit 3 through dist_worker).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

import runtime

RTOL, ATOL = 1e-5, 1e-6
OUT_ATOL = 1e-5  # outputs near 0 against the whole-batch model (logits, not weights)
ENGINES = ("partitioner", "pipelining")


def _model_file(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("_engine_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _same_weights(pipe: runtime.DistributedPipeline, want: dict[str, torch.Tensor], what: str) -> None:
    got = pipe.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


def engines(pkg: str, model_path: str) -> None:
    """Every package of ENGINE_RUNS ("PKG|MODEL;PKG|MODEL", one job for several), else PKG."""
    runs = [tuple(run.split("|")) for run in os.environ.get("ENGINE_RUNS", "").split(";") if run]
    for p, m in runs or [(pkg, model_path)]:
        _engines(p, m)
    print(f"{torch.distributed.get_rank()} ok", flush=True)


def _engines(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    torch.manual_seed(0)
    model = mf.build_model()
    inputs, target = mf.example_inputs(), mf.example_target()
    pipes = {e: runtime.DistributedPipeline(pkg, engine=e) for e in ENGINES}
    assert type(pipes["pipelining"]).__name__ == "PipeliningPipeline", type(pipes["pipelining"])
    for p in pipes.values():
        p.load_state_dict(model.state_dict())
    opts = {e: p.make_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9) for e, p in pipes.items()}
    ref = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Path(pkg).parent / "engine-checkpoints"
    losses = []
    for step in range(2):
        ref.zero_grad()
        want = mf.loss_fn(_call(model, inputs), target)
        want.backward()
        ref.step()
        losses.append(want.detach())
        for e, p in pipes.items():
            opts[e].zero_grad()
            got = p.train_step(inputs, target)
            opts[e].step()
            torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{e} loss {step}: {m}")
            _same_weights(p, model.state_dict(), f"{e} after step {step}:")
            if step == 0:
                p.save_checkpoint(ckpt / e, opts[e], extra={"step": 1})
    # each engine resumes the other's checkpoint and redoes step 2
    for e, other in zip(ENGINES, reversed(ENGINES)):
        assert pipes[e].load_checkpoint(ckpt / other, opts[e]) == {"step": 1}
        opts[e].zero_grad()
        got = pipes[e].train_step(inputs, target)
        opts[e].step()
        torch.testing.assert_close(got, losses[1], rtol=RTOL, atol=ATOL, msg=lambda m: f"{e} resumed: {m}")
        _same_weights(pipes[e], model.state_dict(), f"{e} resumed from {other}'s checkpoint:")
    pipe = pipes["pipelining"]
    with torch.no_grad():
        want_out = _call(model, inputs)
        torch.testing.assert_close(pipe.evaluate(inputs, target), mf.loss_fn(want_out, target), rtol=RTOL, atol=ATOL)
        leaves = [torch.utils._pytree.tree_leaves(x) for x in (pipe(inputs), pipes["partitioner"](inputs), want_out)]
        for got, ours, want in zip(*leaves):  # the engines: the same microbatches; the model: the whole batch
            torch.testing.assert_close(got, ours, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=OUT_ATOL)
    print(f"{pipe.rank} {pipe.manifest.schedule} ok", flush=True)


def engine_refused(pkg: str, model_path: str) -> None:
    runtime.DistributedPipeline(pkg, engine="pipelining")
    raise AssertionError("the torch engine took a package it cannot run")


MODES = {"engines": engines, "engine_refused": engine_refused}
