"""Nested inputs and outputs ([Note: input leaves] in partitioner/trace/inputs.py): tuples,
lists and dicts of tensors, at any depth, are split into microbatches along each leaf's batch
dimension, carried between stages and joined again, as top-level tensors are.  The
word-language LSTM (`forward(x, (h0, c0))` -> `(output, (h, c))`, batch dim 1 in the hidden
state) and a dict-of-lists model train like the original (loss, every gradient, the weights
after SGD) in one process and on 2 gloo ranks, and `pipe(inputs)` has the original's structure."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import runtime
from driver.cli import main
from partitioner.errors import ModelFileError
from partitioner.trace import model_file
from partitioner.trace.inputs import leaf_batch_dims

from .conftest import ROOT, compile_example
from .runtime.test_distributed import _ok, launch

RTOL, ATOL = 1e-5, 1e-6
LSTM = str(ROOT / "tests" / "model_files" / "word_lstm.py")
DICT_OF_LISTS = str(ROOT / "tests" / "model_files" / "dict_of_lists.py")


def _train_like_the_original(path: str, pkg: Path, steps: int = 2) -> None:
    """The pipeline's loss and every gradient at each of `steps` SGD steps, the weights
    after them, and the forward's structure and values, against the original model."""
    mf = model_file.load(path)
    model = mf.build(0)
    args, kwargs = mf.example_inputs()
    inputs, target, loss_fn = kwargs or args, mf.example_target(), mf.loss_fn()
    pipe = runtime.LocalPipeline(str(pkg))
    pipe.load_state_dict(model.state_dict())
    opt_ref = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(steps):
        opt_ref.zero_grad()
        opt.zero_grad()
        want = loss_fn(model(*args, **kwargs), target)
        want.backward()
        got = pipe.train_step(inputs, target)
        torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"loss {step}: {m}")
        grads = dict(pipe.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
        opt_ref.step()
        opt.step()
    got_sd, want_sd = pipe.state_dict(), model.state_dict()
    for name in want_sd:
        torch.testing.assert_close(got_sd[name], want_sd[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        out, ref = pipe(inputs), model(*args, **kwargs)
    assert pytree.tree_structure(out) == pytree.tree_structure(ref)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_word_lstm_with_a_hidden_state_tuple_trains_like_the_original(tracer: str, tmp_path: Path) -> None:
    compile_example(LSTM, tmp_path / "pkg", stages=2, tracer=tracer)
    manifest = runtime.LocalPipeline(str(tmp_path / "pkg")).manifest
    assert [(i.key, i.batch_dim) for i in manifest.inputs] == [(0, 0), ((1, 0), 1), ((1, 1), 1)]
    assert manifest.output_batch_dims == (0, 1, 1)  # output, h, c
    _train_like_the_original(LSTM, tmp_path / "pkg")


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_dict_of_lists_input_trains_like_the_original(tracer: str, tmp_path: Path) -> None:
    compile_example(DICT_OF_LISTS, tmp_path / "pkg", stages=2, tracer=tracer)
    _train_like_the_original(DICT_OF_LISTS, tmp_path / "pkg")


def test_a_batch_missing_a_nested_input_is_refused(tmp_path: Path) -> None:
    compile_example(LSTM, tmp_path / "pkg", stages=2)
    mf = model_file.load(LSTM)
    x, (h0, _c0) = mf.example_inputs()[0]
    with pytest.raises(runtime.errors.BatchError, match=r"reads input 1\.1 .* nested inputs included"):
        runtime.LocalPipeline(str(tmp_path / "pkg"))((x, (h0,)))


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_word_lstm_on_two_gloo_ranks(tmp_path: Path) -> None:
    model = tmp_path / "word_lstm.py"
    shutil.copy(LSTM, model)
    compile_example(str(model), tmp_path / "pkg", stages=2, microbatches=4)
    _ok(launch(2, "check", [tmp_path / "pkg"], model, deadline_s=150))


# -- BATCH_DIMS for nested inputs ----------------------------------------------------------

T, X = torch.zeros(3, 8, 12), torch.zeros(8, 5)
NAMES = ["x", "hidden"]


@pytest.mark.parametrize("declared", [{"hidden": 1}, {1: 1}, {"hidden": (1, 1)}, {"1": [1, 1]},
                                      {"hidden.0": 1, "hidden.1": 1}, {"1.0": 1, 1: (None, 1)}])
def test_batch_dims_name_a_nested_input_in_any_form(declared: dict[Any, Any]) -> None:
    assert leaf_batch_dims(declared, NAMES, (X, (T, T)), {}, "m.py") == {(1, 0): 1, (1, 1): 1}
    assert leaf_batch_dims(declared, NAMES, (), {"x": X, "hidden": (T, T)}, "m.py") == \
        {("hidden", 0): 1, ("hidden", 1): 1}


def test_the_old_batch_dims_form_still_works() -> None:
    assert leaf_batch_dims({0: 1}, NAMES, (X, T), {}, "m.py") == {0: 1}
    assert leaf_batch_dims({"x": 1}, NAMES, (), {"x": X}, "m.py") == {"x": 1}


@pytest.mark.parametrize("declared, pattern", [
    ({"hid": 1}, r"BATCH_DIMS names input 'hid' but example_inputs\(\) gives 0, 1"),
    ({"hidden": (1,)}, r"BATCH_DIMS\['hidden'\] is \(1,\) but the input is \(tensor\[3, 8, 12\], tensor\[3, 8, 12\]\)"),
    ({"hidden.2": 1}, r"path 'hidden.2' stops at '2'"),
])
def test_batch_dims_that_do_not_fit_the_input_are_refused(declared: dict[Any, Any], pattern: str) -> None:
    with pytest.raises(ModelFileError, match=pattern):
        leaf_batch_dims(declared, NAMES, (X, (T, T)), {}, "m.py")


def test_a_mismatched_batch_dims_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "lstm.py"
    model.write_text(Path(LSTM).read_text().replace('BATCH_DIMS = {"hidden": 1}', 'BATCH_DIMS = {"hidden": (1,)}'))
    assert main(["compile", str(model), "--out", str(tmp_path / "pkg"), "--quiet", "--analytic"]) == 2
    err = capsys.readouterr().err
    assert "BATCH_DIMS['hidden'] is (1,)" in err and "Traceback" not in err
