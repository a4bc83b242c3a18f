"""`compile --zero 1`: recorded in the manifest, and the memory model charges each rank
1/dp of the optimizer state ([Note: ZeRO-1] in runtime/optim.py); `--devices` turns it on
for a mesh that fits in memory only so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from driver import search
from driver.cli import main
from partitioner.cost.hardware import load_hardware
from partitioner.errors import InfeasiblePlanError
from partitioner.ir import PartitionProblem, optimizer_state_factor
from partitioner.predict.predict import zero_broadcast_s
from partitioner.trace import model_file
from runtime import package
from runtime.optim import zero_stage

from ..conftest import compile_example

MLP = "examples/mlp.py"


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_1_charges_one_replica_share_of_the_optimizer_state(dp: int, tmp_path: Path) -> None:
    manifests = {}
    for zero in (0, 1):
        compile_example("examples/gpt.py", tmp_path / f"z{zero}", stages=1, dp=dp, microbatches=2, zero=zero)
        manifests[zero] = package.load_manifest(tmp_path / f"z{zero}")
    assert zero_stage(manifests[0]) == 0 and zero_stage(manifests[1]) == 1
    assert "zero" not in manifests[0].options  # written only when set: earlier packages stay byte-identical
    before, after = (m.predicted.stages[0] for m in (manifests[0], manifests[1]))  # type: ignore[union-attr]
    assert before.param_bytes == after.param_bytes > 0
    adam = 2  # bytes of state (m, v) per byte of parameter
    saved = before.memory_bytes - after.memory_bytes
    assert abs(saved - before.param_bytes * adam * (1 - 1 / dp)) <= 2, (saved, before.param_bytes)


# -- the mesh search turns ZeRO-1 on where a mesh fits only so ------------------------------------


def _peak(compiled: Any) -> int:
    return max(s.memory_bytes for s in compiled.manifest.predicted.stages)


def _limits(tmp_path: Path) -> tuple[int, int]:
    """examples/mlp.py as one stage at dp = 2: the most memory ZeRO-1 needs (the fewest,
    largest microbatches) and the least plain Adam state needs (the most microbatches,
    activations recomputed)."""
    batch = model_file.load(MLP).example_inputs()[0][0].shape[0]
    sharded = compile_example(MLP, tmp_path / "z1", stages=1, dp=2, microbatches=1, zero=1)
    plain = compile_example(MLP, tmp_path / "z0", stages=1, dp=2, microbatches=batch // 2, zero=0, recompute=True)
    return _peak(sharded), _peak(plain)


def test_the_search_shards_the_optimizer_state_where_a_mesh_fits_only_so(tmp_path: Path) -> None:
    need, plain = _limits(tmp_path)
    assert need < plain, "the test needs a mesh that fits with ZeRO-1 and not without"
    compiled = compile_example(MLP, tmp_path / "pkg", devices=2, stages=1, tp=1, memory=need)
    manifest = compiled.manifest
    assert manifest.mesh.dp == 2 and manifest.options["zero"] == 1
    assert all(c["zero"] == 1 for c in manifest.predicted.extra["candidates"])
    assert _peak(compiled) <= need
    assert "optimizer state sharded across the replicas (ZeRO-1)" in (tmp_path / "pkg" / "plan.txt").read_text()
    # ZeRO-1 costs its broadcast of the updated parameters: the same mesh without it is faster
    mesh = dict(stages=1, dp=2, microbatches=manifest.microbatches, recompute=compiled.plan.recompute)
    unsharded = compile_example(MLP, tmp_path / "z0same", zero=0, **mesh).manifest.predicted.step_time_s
    broadcast = zero_broadcast_s(compiled.plan, *load_hardware("a100").ring_link(across_nodes=False))
    assert broadcast > 0
    assert manifest.predicted.step_time_s == pytest.approx(unsharded + broadcast, rel=1e-4)


def test_the_search_keeps_zero_0_where_it_fits(tmp_path: Path) -> None:
    compiled = compile_example(MLP, tmp_path / "pkg", devices=2, stages=1, tp=1)
    assert "zero" not in compiled.manifest.options
    assert all(c["zero"] == 0 for c in compiled.manifest.predicted.extra["candidates"])


def test_an_explicit_zero_0_is_respected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need, _ = _limits(tmp_path)
    other = compile_example(MLP, tmp_path / "other", devices=2, tp=1, memory=need, zero=0)
    assert other.manifest.mesh.dp == 1 and "zero" not in other.manifest.options  # two stages fit
    code = main(["compile", MLP, "--out", str(tmp_path / "pkg"), "--devices", "2", "--stages", "1", "--tp", "1",
                 "--zero", "0", "--memory", str(need), "--analytic", "--hardware", "a100", "--quiet"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "Traceback" not in err
    assert "no mesh of 2 devices fits --memory" in err and "drop --zero 0" in err, err


def _no_mix_fits(_p: Any, **_kw: Any) -> Any:  # the limit is the test's fiction: the joint choice's DP does not see it
    raise InfeasiblePlanError("no mix of policies fits (this test's limit)")


def test_zero_1_and_recomputation_are_each_tried_where_the_plain_plan_does_not_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the plain plan does not fit but ZeRO-1 alone and recomputation alone each do,
    both are candidates and the simulator ranks them; ZeRO-1 with recomputation is solved
    only as the leanest of its policy, which fits ([Note: the leanest variant first]), and
    is no candidate, since each alone costs less."""
    real = search.solve
    tried: list[tuple[bool, bool]] = []

    def plain_too_big(problem: PartitionProblem, **kwargs: Any) -> Any:
        sharded = problem.optimizer_factor < optimizer_state_factor("adam")
        tried.append((sharded, problem.recompute))
        if not sharded and not problem.recompute:
            raise InfeasiblePlanError("the plain plan does not fit (this test's limit)")
        return real(problem, **kwargs)

    monkeypatch.setattr(search, "solve", plain_too_big)
    monkeypatch.setattr(search, "solve_jointly", _no_mix_fits)
    monkeypatch.setattr(search, "step_bound", lambda *_a: (0.0, None))  # both simulated, whichever is faster
    compiled = compile_example(MLP, tmp_path / "pkg", devices=2, stages=1, tp=1, microbatches=4, schedule="1f1b")
    assert sorted(set(tried)) == [(False, False), (False, True), (True, False), (True, True)]
    candidates = compiled.manifest.predicted.extra["candidates"]
    assert sorted((c["zero"], c["recompute"] or "") for c in candidates) == [(0, "selective"), (1, "")]
    assert compiled.manifest.predicted.step_time_s == min(c["step_time_s"] for c in candidates)


def test_where_the_leanest_variant_fits_nothing_its_policy_is_refused_unsolved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the leanest variant first]: where ZeRO-1 with offloading fits no split, the
    variants without them are refused without a DP of their own: of each candidate only
    the leanest is solved without recomputation."""
    real = search.solve
    tried: list[tuple[bool, bool, bool]] = []

    def only_recomputation_fits(problem: PartitionProblem, **kwargs: Any) -> Any:
        sharded = problem.optimizer_factor < optimizer_state_factor("adam")
        tried.append((sharded, problem.offload, problem.recompute))
        if not problem.recompute:
            raise InfeasiblePlanError("only recomputation fits (this test's limit)")
        return real(problem, **kwargs)

    monkeypatch.setattr(search, "solve", only_recomputation_fits)
    monkeypatch.setattr(search, "solve_jointly", _no_mix_fits)
    compiled = compile_example(MLP, tmp_path / "pkg", devices=2, stages=1, tp=1, microbatches=4, schedule="1f1b",
                               offload="auto")
    assert {t for t in tried if not t[2]} == {(True, True, False)}  # the leanest of "no recomputation" alone
    assert all(c["recompute"] for c in compiled.manifest.predicted.extra["candidates"])
