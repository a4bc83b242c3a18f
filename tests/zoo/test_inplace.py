"""In-place ops and mutated buffers, profiled, placed and run like
the original (ResNet-18's structure: inplace ReLU, `out += identity`, BatchNorm in train mode)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import runtime
from partitioner.cost.nodes import working_nodes
from partitioner.trace import model_file
from partitioner.trace.buffers import BatchStatisticsWarning, mutated_buffers
from partitioner.trace.trace import trace

from ..conftest import compile_example

from .harness import trains_like_original


@pytest.mark.parametrize("analytic", [True, False])
def test_resnet_profiles_and_trains(analytic: bool, tmp_path: Path) -> None:
    trains_like_original("resnet_tiny", tmp_path / "pkg", stages=2, microbatches=1, analytic=analytic)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_buffers_are_read_from_the_stage_not_frozen(tracer: str, tmp_path: Path) -> None:
    """A buffer read (`self.cval.clone()`), a counter `add_` and a tensor default argument:
    trained like the original, and a state_dict with another `cval` changes the forward."""
    pipe = trains_like_original("buffer_read", tmp_path / "pkg", stages=2, microbatches=1, tracer=tracer)
    model = model_file.load("tests/zoo/models/buffer_read.py").build(0)
    state = model.state_dict()
    state["cval"] = torch.full((8,), -1.5)
    model.load_state_dict(state)
    pipe.load_state_dict(state)
    x = torch.randn(8, 4)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-5, atol=1e-6)


def test_batch_norm_with_several_microbatches_warns(tmp_path: Path) -> None:
    with pytest.warns(BatchStatisticsWarning, match=r"layers\.0\.bn1.*--microbatches 1.*GroupNorm"):
        compile_example("tests/zoo/models/resnet_tiny.py", tmp_path / "m2", stages=2, microbatches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchStatisticsWarning)
        compile_example("tests/zoo/models/resnet_tiny.py", tmp_path / "m1", stages=2, microbatches=1)


def test_compiling_leaves_the_running_statistics_as_they_were(tmp_path: Path) -> None:
    """The package's buffers are the model's: compiling runs the model (checks, profiling),
    which must not move BatchNorm's running statistics or counters."""
    compile_example("tests/zoo/models/resnet_tiny.py", tmp_path / "pkg", stages=2, microbatches=1, analytic=False)
    want = model_file.load("tests/zoo/models/resnet_tiny.py").build(0).state_dict()
    got = runtime.LocalPipeline(str(tmp_path / "pkg")).state_dict()
    for key in [k for k in want if "running" in k or "num_batches" in k]:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def test_fx_keeps_batch_norm_whole_naming_the_library_check(tmp_path: Path) -> None:
    """fx cannot trace BatchNorm's `input.dim()` check; with --tracer fx each BatchNorm is kept
    whole, the reason naming PyTorch's line (not "rewrite the branch"), and trains the same."""
    mf = model_file.load("tests/zoo/models/resnet_tiny.py")
    traced = trace(mf.build(0), mf.example_inputs()[0], {}, "fx", mf.path)
    assert len(traced.kept) == 10 and all(k.split(".")[-1] in ("bn1", "bn2", "1") for k in traced.kept)
    assert re.search(r"line \d+: `out = self\.bn1\(out\)`, inside \(torch/nn/modules/batchnorm\.py, line \d+: "
                     r"`if input\.dim\(\) != 4:`\)", traced.kept["layers.0.bn1"])
    trains_like_original("resnet_tiny", tmp_path / "pkg", stages=2, microbatches=1, tracer="fx")


@pytest.mark.parametrize("name, stages, tracer", [("buffer_read", 2, "export"), ("buffer_read", 2, "fx"),
                                                  ("resnet_tiny", 3, "auto")])
def test_every_stage_computes(name: str, stages: int, tracer: str, tmp_path: Path) -> None:
    """[Note: every stage computes]: plans that gave a stage only a counter's `add_`
    (buffer_read) or only `flatten` (resnet_tiny, 3 stages) now give each stage a node that
    works on the data."""
    compiled = compile_example(f"tests/zoo/models/{name}.py", tmp_path / "pkg", stages=stages, microbatches=1,
                               tracer=tracer)
    working = {n.name for n in working_nodes(compiled.traced.gm)}
    assert all(working.intersection(stage.nodes) for stage in compiled.plan.stages), compiled.plan.stages


def test_fewer_nodes_that_compute_than_stages_warns(tmp_path: Path) -> None:
    """buffer_read has 5 nodes that compute (2 linears, mul, add, relu): 6 stages leave one
    with none, which the compile says, naming the counts."""
    from driver.compile import compile_model
    from driver.options import CompileOptions

    said: list[str] = []
    compile_model(CompileOptions(model="tests/zoo/models/buffer_read.py", out=str(tmp_path / "pkg"), stages=6,
                                 microbatches=1, analytic=True, hardware="a100", time_limit=5.0), log=said.append)
    assert any(re.match(r"warning: the model has 5 nodes that compute .*fewer than the 6 stages.*use fewer stages", m)
               for m in said), said


@pytest.mark.parametrize("stages, time_limit", [(2, 0.0), (3, 0.0), (3, 5.0)], ids=["2-dp", "3-dp", "3-cpsat"])
def test_a_buffer_rebound_in_forward_lives_on_one_stage(stages: int, time_limit: float, tmp_path: Path) -> None:
    """[Note: a mutated buffer lives on one stage]: export records `self.steps += 1` as an
    `add_` and a `copy_` at the end of the graph, which the DP alone (--time-limit 0) put on
    the first and the last stage.  Every node that touches `steps` now shares one stage,
    and the model trains like the original, the counter included."""
    compiled = compile_example("tests/zoo/models/buffer_counter.py", tmp_path / "plan", stages=stages,
                               microbatches=1, tracer="export", time_limit=time_limit)
    touching = mutated_buffers(compiled.traced.gm)
    assert {torch.ops.aten.add_.Tensor, torch.ops.aten.copy_.default} <= {
        n.target for n in compiled.traced.gm.graph.nodes if n.name in touching}
    assert len({s.index for s in compiled.plan.stages for n in s.nodes if n in touching}) == 1, compiled.plan.stages
    trains_like_original("buffer_counter", tmp_path / "pkg", stages=stages, microbatches=1, tracer="export",
                         time_limit=time_limit)
