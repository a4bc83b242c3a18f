"""Training helpers on LocalPipeline against the original model: `clip_grad_norm_` (global
clipping, runtime/clip.py) and `make_optimizer` (groups by original name, runtime/optim.py).

Cases: the hand-written tiny package (pp = 3, its first weight tied to its head across
stages; and dp = 2), the hand-written tensor-parallel package (tp = 2 lanes, a
vocabulary-parallel embedding tied to the head across 2 stages), and examples/gpt.py
compiled with tp = 2 (GPT-2's tied wte / lm_head).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import runtime
from partitioner.trace import model_file
from runtime import package
from runtime.clip import NonFiniteNormError
from runtime.optim import OptimizerError

from ..conftest import FREE_LINKS, compile_example
from .conftest import Tiny
from .tp_package import write_tp_package

RTOL, ATOL = 1e-5, 1e-6


class Case:
    """A package, the model it was compiled from (same weights), one batch and the loss."""

    def __init__(self, pkg: Path, model: torch.nn.Module, inputs: Any, target: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.pkg, self.model, self.inputs, self.target, self.loss_fn = pkg, model, inputs, target, loss_fn

    def reference_loss(self) -> torch.Tensor:
        out = self.model(**self.inputs) if isinstance(self.inputs, dict) else self.model(*self.inputs)
        return self.loss_fn(out, self.target)

    def pipeline(self) -> runtime.LocalPipeline:
        pipe = runtime.LocalPipeline(self.pkg)
        pipe.load_state_dict(self.model.state_dict())
        return pipe


def _case(name: str, make_tiny: Callable[..., Tiny], tmp_path: Path) -> Case:
    if name.startswith("tiny"):
        t = make_tiny(stages=3, microbatches=2, dp=2 if name == "tiny-dp2" else 1)
        mf = t.model_file
        return Case(t.dir, t.build(), mf.example_inputs(), mf.example_target(), mf.loss_fn)
    if name == "tp2-tied":
        pkg = write_tp_package(tmp_path, stages=2, tp=2, microbatches=2)
        mf = package.load_model_file(package.load_manifest(pkg), pkg)
        torch.manual_seed(0)
        return Case(pkg, mf.build_model(), mf.example_inputs(), mf.example_target(), mf.loss_fn)
    assert name == "gpt-tp2"
    compile_example("examples/gpt.py", tmp_path / "pkg", tp=2, stages=2, hardware=FREE_LINKS)
    g = model_file.load("examples/gpt.py")
    args, kwargs = g.example_inputs()
    return Case(tmp_path / "pkg", g.build(0), kwargs if kwargs else args, g.example_target(), g.loss_fn())


def _check_grads(pipe: runtime.LocalPipeline, model: torch.nn.Module) -> None:
    """Every lane's gradient (its shard, where split) equals the model's."""
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    for lane in pipe.lanes:
        for r in lane.runners:
            names = {spec.name for spec in r.entry.parameters}
            for spec, p in package.stage_tensors(r.module, r.entry, lane.index):
                if spec.name in names:
                    expected = torch.zeros_like(p)
                    package.load_stage_state([(spec, expected)], {spec.source_name: want[spec.source_name]},
                                             pipe.manifest)
                    torch.testing.assert_close(p.grad, expected, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"grad {spec.source_name} (lane {lane.index}): {m}")


CASES = ["tiny", "tiny-dp2", "tp2-tied", "gpt-tp2"]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("name", CASES)
def test_clip_grad_norm_matches_the_model(name: str, norm_type: float, make_tiny: Callable[..., Tiny],
                                          tmp_path: Path) -> None:
    case = _case(name, make_tiny, tmp_path)
    pipe = case.pipeline()
    case.reference_loss().backward()
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in case.model.parameters()], norm_type)
    max_norm = float(unclipped) / 3  # so that clipping changes every gradient
    want = torch.nn.utils.clip_grad_norm_(case.model.parameters(), max_norm, norm_type)
    pipe.train_step(case.inputs, case.target)
    got = pipe.clip_grad_norm_(max_norm, norm_type)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
    _check_grads(pipe, case.model)


def test_the_naive_call_would_be_wrong(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    """What the method is for: torch's own function on pipe.parameters() counts tp lanes'
    replicated parameters twice, so it sees another norm."""
    case = _case("tp2-tied", make_tiny, tmp_path)
    pipe = case.pipeline()
    case.reference_loss().backward()
    pipe.train_step(case.inputs, case.target)
    want = torch.nn.utils.get_total_norm([p.grad for p in case.model.parameters()])
    naive = torch.nn.utils.get_total_norm([p.grad for p in pipe.parameters()])
    assert abs(float(naive) - float(want)) > 1e-3 * float(want)
    torch.testing.assert_close(pipe.clip_grad_norm_(1e9), want, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_norm_is_reported_as_torch_does(bad: float, make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=3, microbatches=2)
    model = t.build()
    pipe = runtime.LocalPipeline(t.dir)
    pipe.load_state_dict(model.state_dict())
    pipe.train_step(t.model_file.example_inputs(), t.model_file.example_target())
    model(*t.model_file.example_inputs()).sum().backward()
    for params in (pipe.parameters(), list(model.parameters())):
        params[1].grad[0, 0] = bad  # type: ignore[index]
    with pytest.raises(RuntimeError, match="non-finite") as torch_error:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    with pytest.raises(NonFiniteNormError, match="non-finite") as ours:
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert str(ours.value) == str(torch_error.value)
    got = pipe.clip_grad_norm_(1.0)
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert (math.isnan(float(got)) and math.isnan(float(want))) or float(got) == float(want) == math.inf


def test_a_norm_type_that_cannot_be_reduced_is_refused(tiny: Tiny) -> None:
    pipe = runtime.LocalPipeline(tiny.dir)
    with pytest.raises(runtime.PipelineError, match=r"norm_type=0.0, which the pipeline cannot reduce"):
        pipe.clip_grad_norm_(1.0, norm_type=0.0)


# -- make_optimizer --------------------------------------------------------------------------


def _no_decay(name: str) -> dict[str, Any]:
    """nanoGPT's rule: no weight decay on biases, norms and embeddings' 1-d parameters."""
    return {"weight_decay": 0.0} if name.endswith("bias") or "ln" in name else {}


@pytest.mark.parametrize("name", CASES)
def test_adamw_through_make_optimizer_matches_the_model(name: str, make_tiny: Callable[..., Tiny],
                                                        tmp_path: Path) -> None:
    """5 AdamW steps with two parameter groups, a LambdaLR schedule and clipping.  (lr 1e-3:
    Adam's update is about lr whatever the gradient's size, so float rounding on a gradient
    element near zero moves a weight by a fraction of lr.)"""
    case = _case(name, make_tiny, tmp_path)
    pipe = case.pipeline()
    named = dict(case.model.named_parameters())
    groups = [{"params": [n for n in named if _no_decay(n)], "weight_decay": 0.0},
              {"params": [n for n in named if not _no_decay(n)]}]
    opt = pipe.make_optimizer(torch.optim.AdamW, groups, lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW([{**g, "params": [named[n] for n in g["params"]]} for g in groups],
                            lr=1e-3, weight_decay=0.1)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in (opt, ref)]
    for _ in range(5):
        ref.zero_grad()
        case.reference_loss().backward()
        torch.nn.utils.clip_grad_norm_(case.model.parameters(), 0.5)
        ref.step()
        opt.zero_grad()
        pipe.train_step(case.inputs, case.target)
        pipe.clip_grad_norm_(0.5)
        opt.step()
        for s in schedules:
            s.step()
    got, want = pipe.state_dict(), case.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


def test_a_function_of_the_name_groups_the_same_as_lists(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    case = _case("tp2-tied", make_tiny, tmp_path)
    pipe = case.pipeline()
    by_fn = pipe.make_optimizer(torch.optim.SGD, _no_decay, lr=0.1, weight_decay=0.1)
    assert [g["weight_decay"] for g in by_fn.param_groups] == [0.1, 0.0]
    names = {id(p): n for n, p in pipe.named_parameters()}
    assert {names[id(p)] for p in by_fn.param_groups[1]["params"]} == {"fc1.bias", "fc2.bias", "qkv.bias"}
    assert sum(len(g["params"]) for g in by_fn.param_groups) == len(pipe.parameters())


def test_bad_groups_are_named(tiny: Tiny) -> None:
    pipe = runtime.LocalPipeline(tiny.dir)
    with pytest.raises(OptimizerError, match=r"names \['fc9.weight'\], which the model does not have"):
        pipe.make_optimizer(torch.optim.SGD, [{"params": ["fc9.weight"]}], lr=0.1)
    with pytest.raises(OptimizerError, match=r"'fc1.bias' is in parameter groups 0 and 1"):
        pipe.make_optimizer(torch.optim.SGD, [{"params": ["fc1.bias"]}, {"params": ["fc1.bias"]}], lr=0.1)
    with pytest.raises(OptimizerError, match=r"parameter\(s\) are in no group \(embed.weight, "):
        pipe.make_optimizer(torch.optim.SGD, [{"params": ["fc1.bias"]}], lr=0.1)
    with pytest.raises(OptimizerError, match=r"parameter group 0 must be a dict whose 'params' is a list"):
        pipe.make_optimizer(torch.optim.SGD, [{"params": list(pipe.parameters())}], lr=0.1)
    with pytest.raises(OptimizerError, match=r"takes an optimizer class such as torch.optim.AdamW"):
        pipe.make_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), lr=0.1)  # type: ignore[arg-type]
