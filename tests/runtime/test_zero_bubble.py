"""The split backward (I then W, [Note: split backward] in runtime/stage.py) under the
zero-bubble schedules gives, after one step, the gradients of the fused backward (B) on
the same compiled package: the examples, recomputation, two tensor-parallel lanes, and
ZB-V's two stages per rank in a V."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from partitioner.trace import model_file
from runtime import split_backward
from runtime.manifest import StageInput, StageOutput, StageSpec
from runtime.schedule import B, I, W, Action, Schedule, zb_v
from runtime.stage import StageRunner

from ..conftest import FREE_LINKS as FREE, compile_example

CASES = [
    ("examples/mlp.py", {"stages": 3, "microbatches": 4}),
    ("examples/skip.py", {"stages": 2, "microbatches": 4}),  # values read by several later stages
    ("examples/gpt.py", {"stages": 2, "microbatches": 4}),
    ("examples/hf_gpt2.py", {"stages": 2, "microbatches": 2}),
    ("examples/gpt.py", {"stages": 2, "microbatches": 2, "recompute": True}),
    ("examples/gpt.py", {"stages": 2, "microbatches": 2, "tp": 2, "hardware": FREE}),  # two lanes
]


def _one_step(pkg: Path, example: str, schedule: str | Schedule
              ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor | None]]]:
    mf = model_file.load(example)
    args, kwargs = mf.example_inputs()
    pipe = runtime.LocalPipeline(pkg, schedule=schedule)
    pipe.load_state_dict(mf.build(0).state_dict())
    loss = pipe.train_step(kwargs if kwargs else args, mf.example_target())
    return loss, [(n, p.grad) for n, p in pipe.named_parameters()]


@pytest.mark.parametrize("example, options", CASES, ids=[f"{Path(e).stem}-" + "-".join(f"{k}{v}" for k, v in o.items()
                                                                                      if k != "hardware")
                                                         for e, o in CASES])
def test_split_backward_gives_the_fused_gradients(example: str, options: dict[str, Any], tmp_path: Path) -> None:
    compiled = compile_example(example, tmp_path / "pkg", schedule="zb-h1", **options)
    assert compiled.manifest.schedule == "zb-h1"
    if "tp" in options:
        assert compiled.manifest.tensor_parallel["rules"], "the free links split the model"
    want_loss, want = _one_step(tmp_path / "pkg", example, "1f1b")
    assert all(g is not None for _, g in want)
    for schedule in ("zb-h1", "zb-h2"):
        loss, got = _one_step(tmp_path / "pkg", example, schedule)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        assert [n for n, _ in got] == [n for n, _ in want]
        for (name, g), (_, w) in zip(got, want):
            assert g is not None, f"{schedule}: {name} has no gradient"
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule}, {name}: {m}")


@pytest.mark.parametrize("example", ["examples/mlp.py", "examples/gpt.py"])
def test_zb_v_gives_the_fused_gradients(example: str, tmp_path: Path) -> None:
    """A zb-v package: 4 stages on 2 ranks in a V ([Note: V placement] in runtime/schedule/registry.py),
    so stages 0 and 3 (gpt's tied embedding's two copies) share rank 0.  Its split order
    against the same order with each I made a fused B and the W's dropped, and against
    1F1B on a package of 2 stages (gradients by original name)."""
    compiled = compile_example(example, tmp_path / "pkg", schedule="zb-v", stages=2, microbatches=4)
    manifest = compiled.manifest
    assert (manifest.schedule, manifest.virtual_stages) == ("zb-v", 2)
    assert [list(s.ranks) for s in manifest.stages] == [[0], [1], [1], [0]]
    compile_example(example, tmp_path / "one", schedule="1f1b", stages=2, microbatches=4)
    loss, got = _one_step(tmp_path / "pkg", example, "zb-v")
    fused = [[Action(a.stage, B, a.microbatch) if a.kind == I else a for a in row if a.kind != W] for row in zb_v(2, 4)]
    for against, (want_loss, want) in (("fused B", _one_step(tmp_path / "pkg", example, fused)),
                                       ("1f1b", _one_step(tmp_path / "one", example, "1f1b"))):
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        wanted = dict(want)
        assert sorted(n for n, _ in got) == sorted(wanted) and all(g is not None for g in wanted.values())
        for name, g in got:
            assert g is not None, f"zb-v: {name} has no gradient"
            torch.testing.assert_close(g, wanted[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"zb-v vs {against}, {name}: {m}")


class _Reused(torch.nn.Module):
    """fc2 runs twice: its weight is below two frontier edges ([Note: weight-gradient seeds])."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.fc2(torch.tanh(self.fc2(self.norm(self.fc1(x))))),)


class _Plain(_Reused):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.fc2(torch.tanh(self.norm(self.fc1(x)))),)


@pytest.mark.parametrize("module, seeded", [(_Plain, True), (_Reused, False)])
def test_w_starts_at_the_weights_edges_or_walks_again(module: type[torch.nn.Module], seeded: bool) -> None:
    """W from the recorded frontier gradients where that is exact, else the whole graph
    again: both give the fused backward's gradients (here bit for bit)."""
    torch.manual_seed(0)
    spec = StageSpec(index=1, module="s", class_name="S", ranks=(1,),
                     inputs=(StageInput(name="x", shape=(4, 6), dtype="float32", source=0, requires_grad=True),),
                     outputs=(StageOutput(name="y", shape=(4, 6), dtype="float32", to=(2,)),), parameters=())
    fused, split = module(), module()
    split.load_state_dict(fused.state_dict())
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    runners = [StageRunner(m, spec) for m in (fused, split)]
    outs = [r.forward(0, [x.clone().requires_grad_()], train=True) for r in runners]
    want = runners[0].backward(0, [g])
    got = runners[1].backward_input(0, [g])
    seeds = runners[1]._saved[0].seeds
    assert (seeds is not None and seeds.complete()) == seeded
    assert all(p.grad is None for p in split.parameters())  # I leaves the weights alone
    runners[1].backward_weight(0)
    assert torch.equal(got[0], want[0]) and outs[0][0].shape == (4, 6)
    for (name, p), q in zip(fused.named_parameters(), split.parameters()):
        assert q.grad is not None and torch.equal(q.grad, p.grad), name
    assert split_backward.plan([], [], []) is None
