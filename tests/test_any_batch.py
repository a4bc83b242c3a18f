"""Any batch ([Note: free batch], [Note: microbatch weights]): a package compiled for the
example batch trains on a batch of any size the data-parallel degree divides, a short last
batch included, exactly as the original model on that batch (loss and every gradient, rtol
1e-5), in one process and on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import runtime
from partitioner.trace import model_file
from runtime.errors import BatchError

from .conftest import FREE_LINKS, ROOT, compile_example
from .runtime.test_distributed import _ok, launch

RTOL, ATOL = 1e-5, 1e-6


def _first_rows(value: Any, rows: int) -> Any:
    return pytree.tree_map(lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.dim() else t, value)


def _check_short_batch(path: str, pkg: Path, rows: int) -> None:
    """The pipeline's loss, every gradient (tp = 1), the weights after 2 SGD steps and the
    output on `rows` rows, against the original."""
    mf = model_file.load(path)
    model = mf.build(0)
    args, kwargs = _first_rows(mf.example_inputs(), rows)
    target = _first_rows(mf.example_target(), rows)
    pipe = runtime.LocalPipeline(str(pkg))
    pipe.load_state_dict(model.state_dict())
    opt_ref = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    aliases = pipe.manifest.state_dict_aliases
    for _ in range(2):
        opt_ref.zero_grad()
        opt.zero_grad()
        want = mf.loss_fn()(model(*args, **kwargs), target)
        want.backward()
        got = pipe.train_step(kwargs or args, target)
        torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL)
        grads = dict(pipe.named_parameters()) if pipe.manifest.mesh.tp == 1 else {}  # tp: weights below
        for name, p in model.named_parameters() if grads else ():
            torch.testing.assert_close(grads[aliases.get(name, name)].grad, p.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"grad {name}: {m}")
        opt_ref.step()
        opt.step()
    got, want_sd = pipe.state_dict(), model.state_dict()
    for name in want_sd:
        torch.testing.assert_close(got[name], want_sd[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(pytree.tree_leaves(pipe(kwargs or args)),
                                   pytree.tree_leaves(model(*args, **kwargs)), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(pipe.evaluate(kwargs or args, target),
                                   mf.loss_fn()(model(*args, **kwargs), target), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("example", ["mlp", "gpt", "hf_gpt2"])
def test_short_last_batch_trains_like_the_original(example: str, tmp_path: Path) -> None:
    path = f"examples/{example}.py"
    compiled = compile_example(path, tmp_path / "pkg", stages=2, microbatches=4)
    assert list(compiled.manifest.free_dims) == ["batch"]
    source = (tmp_path / "pkg" / "stage_0.py").read_text()
    rows = compiled.manifest.inputs[0].shape[0]  # the compiled microbatch's rows
    assert "batch = " in source or example == "mlp", source  # sizes read from the inputs
    if example == "gpt":
        assert f".view({rows}, " not in source and ".view(batch, " in source
    _check_short_batch(path, tmp_path / "pkg", 5)  # 4 microbatches of 2, 1, 1, 1 rows


@pytest.mark.parametrize("example", ["gpt", "hf_gpt2"])
def test_short_batch_with_tensor_parallelism(example: str, tmp_path: Path) -> None:
    """Sizes the tensor-parallel split rewrites (a view's heads) keep following the batch."""
    compiled = compile_example(f"examples/{example}.py", tmp_path / "pkg", stages=2, tp=2, microbatches=2,
                               hardware=FREE_LINKS)
    assert compiled.manifest.tensor_parallel["rules"] and list(compiled.manifest.free_dims) == ["batch"]
    _check_short_batch(f"examples/{example}.py", tmp_path / "pkg", 5)


def test_short_batch_with_two_replicas(tmp_path: Path) -> None:
    compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, dp=2, microbatches=2)
    _check_short_batch("examples/gpt.py", tmp_path / "pkg", 6)  # 3 rows a replica: microbatches of 2 and 1


@pytest.mark.parametrize("options, rows", [
    ({"stages": 2, "microbatches": 4}, 3),  # 3 microbatches of 1 row
    ({"stages": 2, "microbatches": 4}, 2),  # a 2-row batch on a 4-microbatch package
    ({"stages": 2, "dp": 2, "microbatches": 2}, 2),  # 1 row a replica: 1 microbatch
    ({"stages": 2, "virtual_stages": 2, "schedule": "interleaved", "microbatches": 4}, 3),  # 2: a multiple of 2 ranks
    ({"stages": 2, "virtual_stages": 2, "schedule": "zb-v", "microbatches": 4}, 3),
    ({"stages": 2, "schedule": "zb-h1", "microbatches": 4}, 3),
])
def test_fewer_rows_than_microbatches_run_fewer_microbatches(options: dict[str, Any], rows: int,
                                                              tmp_path: Path) -> None:
    """[Note: short batch]: as many microbatches as the schedule allows with the rows there are."""
    compile_example("examples/gpt.py", tmp_path / "pkg", **options)
    _check_short_batch("examples/gpt.py", tmp_path / "pkg", rows)


def test_a_schedule_that_cannot_shrink_is_named(tmp_path: Path) -> None:
    from runtime.schedule import make_schedule

    compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, microbatches=4)
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"), schedule=make_schedule("1f1b", 2, 4))
    mf = model_file.load("examples/gpt.py")
    (idx,), _ = mf.example_inputs()
    with pytest.raises(BatchError, match=r"3 rows per replica, fewer than the package's 4 microbatches, and the "
                                         r"schedule was given as a fixed list of actions: give at least 4 rows"):
        pipe.train_step((idx[:3],), mf.example_target()[:3])
    # interleaved on 4 ranks runs a multiple of 4 microbatches: none fits 3 rows
    compile_example("examples/gpt.py", tmp_path / "v", stages=4, virtual_stages=2, schedule="interleaved",
                    microbatches=4)
    pipe = runtime.LocalPipeline(str(tmp_path / "v"))
    with pytest.raises(BatchError, match=r"3 rows per replica, fewer than the package's 4 microbatches, and the "
                                         r"package's schedule runs with no count that small \(the interleaved "
                                         r"schedule needs microbatches \(3\) to be a multiple of .* \(4\)"):
        pipe.evaluate((idx[:3],), mf.example_target()[:3])


def test_bad_batches_are_refused(tmp_path: Path) -> None:
    compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, dp=2, microbatches=2)
    mf = model_file.load("examples/gpt.py")
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"))
    (idx,), _ = mf.example_inputs()
    target = mf.example_target()
    with pytest.raises(BatchError, match=r"5 rows .* do not split evenly across 2 data-parallel replicas"):
        pipe.train_step((idx[:5],), target[:5])
    with pytest.raises(BatchError, match=r"only its batch dimension is free"):
        pipe.train_step((idx[:, :4],), target[:, :4])


FIXED = '''
import torch

class Fixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).reshape(3, 8))  # the batch written as a literal

def build_model():
    return Fixed()

def example_inputs():
    return (torch.randn(6, 8),)

def example_target():
    return torch.randint(0, 2, (6,))

def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out, target)
'''


def test_a_model_with_a_literal_batch_keeps_it_fixed(tmp_path: Path) -> None:
    (tmp_path / "fixed.py").write_text(FIXED)
    compiled = compile_example(str(tmp_path / "fixed.py"), tmp_path / "pkg", stages=2, microbatches=2)
    assert "free_dims" not in compiled.manifest.to_dict()
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"))
    with pytest.raises(BatchError, match=r"its batch is fixed at 6 rows"):
        pipe.train_step((torch.randn(4, 8),), torch.randint(0, 2, (4,)))


NAMED = '''
import torch

class Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, batch):  # an input named as the stages name the rows
        return self.b(self.a(batch).view(batch.shape[0], 2, 8).sum(1))

def build_model():
    return Named()

def example_inputs():
    return (torch.randn(8, 8),)

def example_target():
    return torch.randint(0, 2, (8,))

def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out, target)
'''


def test_an_input_named_batch_keeps_its_name(tmp_path: Path) -> None:
    (tmp_path / "named.py").write_text(NAMED)
    compile_example(str(tmp_path / "named.py"), tmp_path / "pkg", stages=1, microbatches=2)
    source = (tmp_path / "pkg" / "stage_0.py").read_text()
    assert "batch_rows = batch.shape[0]" in source and "view(batch_rows, 2, 8)" in source, source
    _check_short_batch(str(tmp_path / "named.py"), tmp_path / "pkg", 5)


@pytest.mark.multiproc
@pytest.mark.parametrize("example, options, rows", [
    pytest.param("mlp", {"stages": 2}, 5, marks=pytest.mark.slow),  # as gpt's below
    ("gpt", {"stages": 2}, 5),
    pytest.param("hf_gpt2", {"stages": 2}, 5, marks=pytest.mark.slow),  # ~25 s
    ("gpt", {"stages": 1, "dp": 2}, 6),
    ("gpt", {"stages": 2, "microbatches": 4}, 3),  # fewer rows than microbatches: 3 microbatches
    ("gpt", {"stages": 1, "dp": 2, "microbatches": 4}, 2),  # 1 row a replica: 1 microbatch
])
def test_short_batch_on_two_ranks(example: str, options: dict[str, Any], rows: int, tmp_path: Path) -> None:
    options.setdefault("microbatches", 2)
    compile_example(f"examples/{example}.py", tmp_path / "pkg", **options)
    copy = tmp_path / f"{example}.py"
    shutil.copy(ROOT / "examples" / f"{example}.py", copy)
    _ok(launch(2, "short", [tmp_path / "pkg"], copy, deadline_s=90, env={"SHORT_ROWS": str(rows)}))


@pytest.mark.parametrize("model", ["examples/gpt.py", "examples/mlp.py", "named.py"])
def test_a_shape_probed_by_earlier_shapes_folds_as_by_its_own_probes(model: str, tmp_path: Path) -> None:
    """[Note: free batch]: a search's second shape reads the first shape's runs (its own and
    its probes') instead of running probes of its own, and folds every size and batch dim
    as a compile of that shape alone does."""
    from driver.options import CompileOptions
    from driver.phases import load_source, prepare
    from partitioner.trace.batch import BatchInt

    (tmp_path / "named.py").write_text(NAMED)
    path = model if model.startswith("examples/") else str(tmp_path / model)
    opts = CompileOptions(model=path, out=str(tmp_path / "o"), analytic=True, hardware="a100", quiet=True, stages=2)

    def folded(p: Any) -> tuple[bool, dict[str, Any]]:
        def leaf(x: Any) -> Any:
            return (int(x), x.coef, x.offset) if isinstance(x, BatchInt) else repr(x)
        return p.free_batch, {n.name: ([leaf(x) for x in pytree.tree_leaves((n.args, n.kwargs))],
                                       n.meta.get("batch_dim")) for n in p.traced.gm.graph.nodes}

    source = load_source(opts)
    first = prepare(dataclasses.replace(opts, microbatches=1), source=source)
    runs = set(source.seen)
    assert len(runs) == 3, "the first shape runs, and probes at two other row counts"
    second = prepare(dataclasses.replace(opts, microbatches=2), source=source)
    assert set(source.seen) == runs | {second.rows}, "the second shape ran no probe of its own"
    assert folded(second) == folded(prepare(dataclasses.replace(opts, microbatches=2)))
    assert first.free_batch and second.free_batch


def test_a_failed_probe_keeps_the_batch_of_later_shapes_fixed() -> None:
    """A probe run that failed for one shape keeps the batch fixed for the shapes that read
    its runs ([Note: free batch]): a row count some run could not take is not free."""
    from partitioner.trace.passes import probe

    gm = torch.fx.symbolic_trace(torch.nn.Linear(8, 2))
    x = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    out = next(n.name for n in gm.graph.nodes if n.op == "call_function")
    ran = ({}, {x: (5, 8), out: (5, 2)})
    assert probe(gm, {"x": torch.randn(4, 8)}, [("x", "x")], {}, 4, {5: ran, 7: None}) is None
    seen: dict[int, Any] = {5: ran}
    free = probe(gm, {"x": torch.randn(4, 8)}, [("x", "x")], {}, 4, seen)
    assert free is not None and free.rows == [5, 7], "the run seen at 5 rows, one of its own at 4 + 3"
    assert set(seen) == {5, 7}
