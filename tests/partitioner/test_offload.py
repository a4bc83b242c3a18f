"""Activation offloading in the planner ([Note: offloaded activations] in
partitioner/solve/offload.py): what it saves per rank, what its copies cost, `auto`'s
shares (less on later ranks) and the variants the mesh search tries."""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

import pytest

from driver.cli import main
from driver.offloading import variants
from driver.options import CompileOptions
from partitioner.cost.hardware import load_hardware
from partitioner.solve.offload import exposed_s
from runtime.manifest import read_manifest

from ..conftest import FREE_LINKS as FREE, compile_example

GPT = "examples/gpt.py"


def _plan(tmp_path: Path, name: str, **options: Any) -> Any:
    options.setdefault("hardware", FREE)  # four stages of like size
    compile_example(GPT, tmp_path / name, stages=4, microbatches=8, schedule="1f1b", **options)
    return read_manifest(tmp_path / name)


def test_offloading_all_leaves_two_microbatches_on_each_stage(tmp_path: Path) -> None:
    """1F1B on 4 stages holds 4, 3, 2, 1 microbatches: offloading saves (4 - 2) and (3 - 2)
    microbatches' activations on the first two stages, nothing on the others."""
    none, every = _plan(tmp_path, "none", offload="none"), _plan(tmp_path, "all", offload="all")
    assert none.predicted is not None and every.predicted is not None
    saved = [a.memory_bytes - b.memory_bytes for a, b in zip(none.predicted.stages, every.predicted.stages)]
    assert saved[0] > saved[1] > 0 and saved[2] == saved[3] == 0, saved
    block = {e["stage"]: e["saved_bytes"] for e in every.predicted.extra["offload"]}
    assert [block[k] for k in range(4)] == saved


def test_auto_offloads_less_on_later_ranks(tmp_path: Path) -> None:
    """Under 1F1B a later rank holds fewer microbatches: at the first --memory (stepping down
    from the fullest stage's need) where auto offloads at all, the shares fall from rank to
    rank, the last two ranks (two microbatches or fewer) offload nothing, and a rank that
    offloads comes under the limit.  (The solver rebalances the split first, so rank 1 may
    fit without offloading.)"""
    none = _plan(tmp_path, "none", offload="none")
    need = max(s.memory_bytes for s in none.predicted.stages)
    for step in range(1, 10):
        limit = need - step * need // 20
        auto = _plan(tmp_path, f"auto{step}", memory=limit)
        shares = [s.offload for s in auto.stages]
        if any(shares):
            break
    else:
        raise AssertionError(f"auto never offloaded down to {limit} bytes")
    assert shares == sorted(shares, reverse=True) and shares[0] > 0 and shares[2] == shares[3] == 0, shares
    assert all(s.memory_bytes <= limit for s, f in zip(auto.predicted.stages, shares) if f > 0)


@pytest.mark.slow
def test_copies_beyond_the_compute_lengthen_the_step(tmp_path: Path) -> None:
    """On an a100 without waves of tiles ([Note: waves of tiles]), where the tiny model's
    products take their FLOPs' time, not a wave's, and the copies outlast them."""
    raw = json.loads(Path("partitioner/profiles/a100.json").read_text())
    flat = tmp_path / "a100_flat.json"
    flat.write_text(json.dumps({k: v for k, v in raw.items() if k != "sm_count"}))
    none = _plan(tmp_path, "none", offload="none", hardware=str(flat))
    every = _plan(tmp_path, "all", offload="all", hardware=str(flat))
    assert every.predicted.step_time_s > none.predicted.step_time_s  # tiny stages: the copies show
    a100 = load_hardware("a100")
    assert a100.host_link_bandwidth == 25e9 and load_hardware("h100").host_link_bandwidth == 50e9
    assert exposed_s(10**9, 1.0, 0.03, 0.05, a100) == pytest.approx((0.01, 0.0))
    assert exposed_s(10**9, 0.5, 0.03, 0.05, a100) == (0.0, 0.0)


@pytest.mark.parametrize("policy, want", [
    ("auto", [(0, None, False), (0, None, True), (0, "auto", False), (0, "selective", False), (0, "full", False)]),
    ("all", [(0, None, True), (0, "auto", False), (0, "selective", False), (0, "full", False)]),
    ("none", [(0, None, False), (0, "auto", False), (0, "selective", False), (0, "full", False)]),
])
def test_the_search_tries_offloading_beside_recomputation(policy: str, want: list[tuple[int, str | None, bool]]) -> None:
    assert variants(CompileOptions(model=GPT, out="x", offload=policy, devices=2), (0,)) == want  # recompute auto


def test_an_unknown_policy_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compile", GPT, "--out", str(tmp_path / "pkg"), "--stages", "2", "--analytic", "--offload", "some"])
    assert code == 2
    assert "--offload some: choose auto" in capsys.readouterr().err
