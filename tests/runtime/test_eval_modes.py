"""After `pipe.eval()` every mode-dependent op of a compiled model computes what the original
computes after `model.eval()`, under both tracers ([Note: modes in generated code] in
partitioner/trace/modes.py): SDPA's dropout rate (Hugging Face GPT-2, attn_pdrop 0.1), an
LSTM's dropout between layers, batch norm's and instance norm's running statistics, RReLU's
slope."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from partitioner.trace import model_file

from ..conftest import compile_example

RTOL, ATOL = 1e-5, 1e-6

CASES = [
    pytest.param("tests/model_files/hf_gpt2_dropout.py", "export", id="gpt2-export"),
    pytest.param("tests/model_files/lstm_dropout.py", "export", id="lstm-export"),
    pytest.param("tests/model_files/lstm_dropout.py", "fx", id="lstm-fx"),
    pytest.param("tests/model_files/batch_norm.py", "export", id="batchnorm-export"),
    pytest.param("tests/model_files/batch_norm.py", "fx", id="batchnorm-fx"),
    pytest.param("tests/model_files/instance_norm.py", "export", id="instancenorm-export"),
    pytest.param("tests/model_files/instance_norm.py", "fx", id="instancenorm-fx"),
    pytest.param("tests/model_files/rrelu.py", "export", id="rrelu-export"),
    pytest.param("tests/model_files/rrelu.py", "fx", id="rrelu-fx"),
]


def _compiled(path: str, tracer: str, root: Path) -> Path:
    out = root / f"{Path(path).stem}_{tracer}"
    compile_example(path, out, stages=2, microbatches=2, tracer=tracer)
    return out


def _inputs(mf: Any) -> tuple[Any, Any]:
    """The example batch as `pipe(...)` takes it, and as the original's call."""
    args, kwargs = mf.example_inputs()
    return (kwargs if kwargs else args), (args, kwargs)


def _tensor(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


@pytest.mark.parametrize(("path", "tracer"), CASES)
def test_eval_mode_equals_the_original_in_eval_mode(path: str, tracer: str, tmp_path: Path) -> None:
    mf = model_file.load(path)
    model = mf.build(0)
    pipe = runtime.LocalPipeline(_compiled(path, tracer, tmp_path))
    pipe.load_state_dict(model.state_dict())
    inputs, (args, kwargs) = _inputs(mf)
    target = mf.example_target()
    pipe.eval()
    model.eval()
    with torch.no_grad():
        want = _tensor(model(*args, **kwargs))
        first, second = _tensor(pipe(inputs)), _tensor(pipe(inputs))
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # nothing random left in eval mode
    torch.testing.assert_close(first, want, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        loss = mf.loss_fn()(model(*args, **kwargs), target)
    torch.testing.assert_close(pipe.evaluate(inputs, target), loss, rtol=RTOL, atol=ATOL)
    got = pipe.state_dict()  # eval mode moves no running statistic, no counter
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_batch_norm_trained_then_evaluated_uses_the_running_statistics(tracer: str, tmp_path: Path) -> None:
    """Running statistics moved by train-mode steps (one microbatch: the original's exactly),
    then used in eval mode as model.eval() uses them."""
    path = "tests/model_files/batch_norm.py"
    out = tmp_path / "bn1"
    compile_example(path, out, stages=2, microbatches=1, tracer=tracer)
    mf = model_file.load(path)
    model = mf.build(0).train()
    pipe = runtime.LocalPipeline(out)
    pipe.load_state_dict(model.state_dict())
    (x,), _ = mf.example_inputs()
    with torch.no_grad():
        for _ in range(3):
            pipe(x)
            model(x)
    pipe.eval()
    model.eval()
    got = pipe.state_dict()
    assert int(got["bn.num_batches_tracked"]) == 3
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=RTOL, atol=ATOL)
