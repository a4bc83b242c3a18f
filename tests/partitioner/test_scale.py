"""Planning at GPT-3 scale: the tracer's parameter table, one trace for every microbatch
shape, costs counted once per distinct call on the meta device, attention's saved bytes,
and (slow) the 1024-device compile of examples/gpt3_175b.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from partitioner.cost import profile
from partitioner.trace import model_file
from runtime.manifest import read_manifest
from driver.options import CompileOptions
from driver.phases import load_source, prepare
from partitioner.trace.trace import _ThroughTracer

from ..conftest import ROOT


class _ScanningTracer(_ThroughTracer):
    """fx's own attribute lookup (a scan over every parameter per access)."""

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        return torch.fx.Tracer.getattr(self, attr, attr_val, parameter_proxy_cache)


@pytest.mark.parametrize("example", ["examples/gpt.py", "examples/bert.py", "examples/skip.py"])
def test_the_parameter_table_traces_what_fx_traces(example: str) -> None:
    model = model_file.load(example).build(0)
    ours = torch.fx.GraphModule(model, _ThroughTracer().trace(model))
    theirs = torch.fx.GraphModule(model, _ScanningTracer().trace(model))
    assert ours.code == theirs.code
    assert [n.target for n in ours.graph.nodes if n.op == "get_attr"] == \
        [n.target for n in theirs.graph.nodes if n.op == "get_attr"]


def _options(model: str, microbatches: int, **extra: Any) -> CompileOptions:
    return CompileOptions(model=model, out="unused", stages=2, tp=1, microbatches=microbatches, analytic=True,
                          hardware="h100", quiet=True, **extra)


@pytest.mark.parametrize("meta", [False, True])
def test_one_fx_trace_serves_every_microbatch_shape(meta: bool) -> None:
    opts = _options("examples/gpt.py", 2, meta=meta or None)
    source = load_source(opts)
    first = prepare(opts, source=source)
    assert source.generic is not None
    again = prepare(dataclasses.replace(opts, microbatches=8), source=source)
    fresh = prepare(dataclasses.replace(opts, microbatches=8))
    assert again.rows != first.rows
    assert again.traced.gm.code == fresh.traced.gm.code
    assert again.costs == fresh.costs and again.problem == fresh.problem


def test_equal_calls_on_the_meta_device_are_costed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = _options("examples/gpt48.py", 4, meta=True)
    calls: list[int] = []
    real = profile._flops_and_saved
    monkeypatch.setattr(profile, "_flops_and_saved", lambda *a: calls.append(1) or real(*a))
    counted = prepare(opts).costs
    assert 0 < len(calls) < len(counted) / 10, "48 identical blocks"
    monkeypatch.setattr(profile, "_meta_signature", lambda *_a: None)
    assert prepare(opts).costs == counted


def test_attention_on_the_meta_device_saves_what_a_fused_kernel_saves() -> None:
    p = prepare(_options("examples/gpt.py", 2, meta=True))
    node = next(n for n in p.traced.gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    q = node.args[0].meta["tensor_meta"]
    b, heads, length, dim = (int(d) for d in q.shape)
    element = torch.empty((), dtype=q.dtype).element_size()
    # q, k, v and the output, and a float32 log-sum-exp per query row
    assert p.costs[node.name].activation_bytes == 4 * b * heads * length * dim * element + 4 * b * heads * length


# -- the 1024-device compile -------------------------------------------------------------------


@pytest.mark.slow
def test_gpt3_175b_on_1024_h100s_compiles(tmp_path: Path) -> None:
    """The command of docs/planning-at-scale.md, as a process: every device used, every
    device's memory within 80 GiB, and an MFU in the range large-scale training reaches.
    How long the compile takes is benchmarks/scale.py's figure, not a bound here."""
    argv = [sys.executable, "-m", "partitioner", "compile", "examples/gpt3_175b.py", "--out", str(tmp_path / "gpt3"),
            "--analytic", "--devices", "1024", "--hardware", "h100", "--memory", "80GiB", "--quiet"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    m = read_manifest(tmp_path / "gpt3")
    mesh = m.mesh
    assert mesh.pp * mesh.tp * mesh.dp == 1024
    assert mesh.tp <= 8, "tensor parallelism inside an 8-GPU node"
    assert len({r for s in m.stages for r in s.ranks}) == 1024
    peak = max(s.memory_bytes for s in m.predicted.stages)
    assert peak <= 80 * 2**30
    assert 0.25 < m.predicted.mfu < 0.6
