"""`--devices N` searches stages x tp x dp = N and the microbatch count."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from driver import ranking, search, workers
from driver.cli import main
from driver.ranking import Beaten
from partitioner.trace import model_file
from runtime.manifest import read_manifest
from driver.options import CompileOptions
from partitioner.cost.hardware import load_hardware
from partitioner.errors import BeyondCapError, PlanError
from driver.meshes import AUTO_SCHEDULES, meshes as _meshes, tp_limit as _tp_limit

from ..conftest import compile_example


def test_meshes_cover_every_factorisation_that_splits_the_batch() -> None:
    opts = CompileOptions(model="m.py", out="o", devices=4)
    meshes = _meshes(4, 24, opts)
    assert {(pp, tp, dp) for pp, tp, dp, _ in meshes} == {
        (4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)}
    assert all(24 % (m * dp) == 0 for _, _, dp, m in meshes)
    assert (4, 1, 1, 16) not in meshes  # 16 microbatches do not split 24 rows


def test_a_given_tp_or_stage_count_narrows_the_search() -> None:
    meshes = _meshes(8, 24, CompileOptions(model="m.py", out="o", devices=8, tp=2))
    assert {tp for _, tp, _, _ in meshes} == {2}
    meshes = _meshes(8, 24, CompileOptions(model="m.py", out="o", devices=8, stages=2))
    assert {(pp, tp, dp) for pp, tp, dp, _ in meshes} == {(2, 1, 4), (2, 2, 2), (2, 4, 1)}


@pytest.mark.slow
def test_search_over_tp_keeps_the_fastest_predicted_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _unpruned(monkeypatch)  # every mesh simulated: the tp ones lose, and are shown
    compiled = compile_example("tests/model_files/gpt_wide.py", tmp_path / "pkg", devices=4, stages=None)
    manifest = compiled.manifest
    candidates = manifest.predicted.extra["candidates"]
    assert any(c["tp"] > 1 for c in candidates), "a wide model on an A100 profile splits"
    best = candidates[0]
    assert (manifest.mesh.pp, manifest.mesh.tp, manifest.mesh.dp) == (best["pp"], best["tp"], best["dp"])
    assert [c["step_time_s"] for c in candidates] == sorted(c["step_time_s"] for c in candidates)
    assert all(c["pp"] * c["dp"] * c["tp"] == 4 for c in candidates)


def test_search_picks_the_fastest_mesh_and_trains_like_the_original(tmp_path: Path) -> None:
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", devices=4, stages=None, tp=1)
    manifest = compiled.manifest
    candidates = manifest.predicted.extra["candidates"]
    assert candidates, "the searched meshes are recorded"
    times = [c["step_time_s"] for c in candidates]
    assert times == sorted(times)
    best = candidates[0]
    assert (manifest.mesh.pp, manifest.mesh.dp, manifest.microbatches) == (
        best["pp"], best["dp"], best["microbatches"])
    assert all(c["pp"] * c["dp"] * c["tp"] == 4 for c in candidates)
    assert manifest.predicted.step_time_s == pytest.approx(best["step_time_s"])
    mf = model_file.load("examples/mlp.py")
    model = mf.build(0)
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"))
    pipe.load_state_dict(model.state_dict())
    args, _ = mf.example_inputs()
    target = mf.example_target()
    loss = pipe.train_step(args, target)
    want = mf.loss_fn()(model(*args), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(pipe.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6)


# -- scale: tp inside a node, recomputation when memory needs it, pruned simulation ------------


def test_tp_stays_inside_a_node_unless_asked() -> None:
    opts = CompileOptions(model="m.py", out="o", devices=32)
    assert {tp for _, tp, _, _ in _meshes(32, 64, opts, tp_limit=8)} == {1, 2, 4, 8}
    assert {tp for _, tp, _, _ in _meshes(32, 64, opts)} == {1, 2, 4, 8, 16, 32}
    asked = CompileOptions(model="m.py", out="o", devices=32, tp=16)
    assert {tp for _, tp, _, _ in _meshes(32, 64, asked, tp_limit=8)} == {16}
    assert _tp_limit(load_hardware("h100")) == 8
    assert _tp_limit(load_hardware("cpu")) is None  # one machine: every rank is local


def test_one_row_per_microbatch_is_a_candidate() -> None:
    meshes = _meshes(4, 48, CompileOptions(model="m.py", out="o", devices=4, tp=1))
    assert (2, 1, 2, 24) in meshes and (4, 1, 1, 48) in meshes


def test_the_search_recomputes_activations_when_nothing_else_fits(tmp_path: Path) -> None:
    # examples/gpt.py on 2 devices: every plan needs over 530 kB on its fullest rank without
    # recomputation (the peak walked over its schedule: [Note: the memory walk]); 2 stages of
    # 24 microbatches need 511-521 kB with it
    compiled = compile_example("examples/gpt.py", tmp_path / "pkg", devices=2, stages=None, tp=1, memory=530_000)
    manifest = compiled.manifest
    assert (manifest.mesh.pp, manifest.microbatches) == (2, 24)
    assert any(s.recompute for s in manifest.stages)  # where memory binds: [Note: recomputation chosen per rank]
    candidates = manifest.predicted.extra["candidates"]
    assert all(c["recompute"] for c in candidates)
    assert all(c["memory_bytes"] <= 530_000 for c in candidates)
    assert max(s.memory_bytes for s in manifest.predicted.stages) <= 530_000


def test_a_recomputing_variant_whose_own_floor_is_beaten_is_not_solved(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the search's bounds]: a recomputing variant runs forwards again, so its floor is
    higher than the candidate's; where the best step beats it, the variant is not solved."""
    policies: dict[str, list[str | None]] = {"strict": [], "real": []}
    seen = policies["real"]
    real_one, real_solve = search._solve_one, search._solve

    def solve_one(p: Any, cap_s: float = math.inf) -> Any:
        seen.append(p.problem.policy)
        return real_one(p, cap_s)

    def solve(base: Any, opts: Any, pp: int, m: int, zeros: Any, beaten: Any) -> Any:
        nonlocal seen
        least = search.floor(search._repose(base, opts, pp, m))  # the candidate's, as posed
        seen = policies["strict"]
        real_solve(base, opts, pp, m, zeros, Beaten(lambda: least * 1.0001))  # a best just above it
        seen = policies["real"]
        return real_solve(base, opts, pp, m, zeros, beaten)

    monkeypatch.setattr(search, "_solve_one", solve_one)
    monkeypatch.setattr(search, "_solve", solve)
    monkeypatch.setattr(search, "workers", lambda _count: 1)  # seen in this process
    # the case of test_the_search_recomputes_activations_when_nothing_else_fits
    compile_example("examples/gpt.py", tmp_path / "pkg", devices=2, stages=None, tp=1, memory=530_000)
    assert {"full", "selective"} <= set(policies["real"]), "the case solves recomputing variants"
    assert None in policies["strict"] and not {"full", "selective"} & set(policies["strict"]), policies["strict"]


def _unpruned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither bound prunes, nor the cap on a DP: every candidate is solved and simulated."""
    monkeypatch.setattr(ranking.Beaten, "cap_s", lambda *_a: math.inf)
    monkeypatch.setattr(search, "bound", lambda *_a: 0.0)
    monkeypatch.setattr(search, "floor", lambda *_a: 0.0)
    monkeypatch.setattr(search, "step_bound", lambda *_a: (0.0, None))


@pytest.mark.parametrize("schedule", [pytest.param("auto", marks=pytest.mark.slow), "1f1b"])
def test_pruning_never_drops_the_best_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    # both compiles pose the same problems: each is solved once (test_solve checks that solving is deterministic)
    solved: dict[Any, Any] = {}
    real = search.solve
    monkeypatch.setattr(search, "solve", lambda problem, **kw: solved[problem] if problem in solved
                        else solved.setdefault(problem, real(problem, **kw)))
    sims: list[int] = []
    real_sim = ranking.simulated
    monkeypatch.setattr(ranking, "simulated", lambda *a: sims.append(1) or real_sim(*a))
    monkeypatch.setattr(search, "workers", lambda _count: 1)  # counted in this process
    options = dict(devices=4, stages=None, tp=1, hardware="h100", schedule=schedule)
    pruned = compile_example("examples/gpt.py", tmp_path / "a", **options).manifest.predicted.extra["candidates"]
    simulated_pruned = len(sims)
    _unpruned(monkeypatch)
    full = compile_example("examples/gpt.py", tmp_path / "b", **options).manifest.predicted.extra["candidates"]
    assert pruned[0] == full[0]
    assert simulated_pruned < len(sims), "the bounds skip some candidates"
    assert [c["step_time_s"] for c in pruned] == sorted(c["step_time_s"] for c in pruned)


#: a --memory at which examples/gpt.py on 4 h100s simulates ZeRO-1 variants
MEMORY_BINDS = 700_000
#: where pp2 x dp2 fits only with ZeRO-1 (its walked peak with dp's gradient buckets)
ZERO_BINDS = 560_000


@pytest.mark.slow
def test_the_cap_on_a_dps_compute_changes_no_candidate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a cap on a rank's compute]: every candidate comes to the same splits, or the
    same refusal, with the DPs capped by the best step found as without the cap; and the
    cap refuses some DPs."""
    real_solve, real_one = search._solve, search._solve_one
    refused: list[float] = []

    def solve_one(p: Any, cap_s: float = math.inf) -> Any:
        try:
            return real_one(p, cap_s)
        except BeyondCapError:
            refused.append(cap_s)
            raise

    def outcome(found: Any) -> Any:
        if isinstance(found, list):
            return sorted((str(s.cand), s.assignment) for s in found)
        return found if found is None else dataclasses.replace(found, note="")

    def solve(base: Any, opts: Any, pp: int, m: int, zeros: Any, beaten: Any) -> Any:
        capped = real_solve(base, opts, pp, m, zeros, beaten)
        with monkeypatch.context() as uncapped:
            uncapped.setattr(ranking.Beaten, "cap_s", lambda *_a: math.inf)
            assert outcome(real_solve(base, opts, pp, m, zeros, beaten)) == outcome(capped), (pp, m, opts.schedule)
        return capped

    monkeypatch.setattr(search, "_solve", solve)
    monkeypatch.setattr(search, "_solve_one", solve_one)
    monkeypatch.setattr(search, "workers", lambda _count: 1)  # seen in this process
    compile_example("examples/gpt.py", tmp_path / "pkg", devices=4, stages=None, hardware="h100", schedule="auto",
                    memory=MEMORY_BINDS)
    assert refused, "the cap refuses some DPs"


@pytest.mark.slow
def test_the_bounds_are_below_every_simulated_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[float, float, float, float, float]] = []
    variants: set[tuple[int, str | None, bool]] = set()
    real = ranking.simulated

    def check(item: Any, devices: int) -> Any:
        cand = real(item, devices)
        args = (item.prepared, item.assignment, item.plan)
        seen.append((ranking.bound(*args), ranking.floor(item.prepared), ranking.step_bound(*args)[0],
                     cand.step_time_s, item.bound_s))
        variants.add((cand.zero, cand.recompute, cand.offload))
        return cand

    _unpruned(monkeypatch)
    monkeypatch.setattr(ranking, "simulated", check)
    monkeypatch.setattr(search, "workers", lambda _count: 1)  # seen in this process
    for schedule, devices, memory, zero in (("1f1b", 4, None, None), ("gpipe", 2, None, None),
                                            ("interleaved", 2, None, None), ("auto", 2, None, None),  # auto: zb-* too
                                            ("1f1b", 4, MEMORY_BINDS, None), ("gpipe", 4, MEMORY_BINDS, 0),
                                            ("1f1b", 4, ZERO_BINDS, None)):
        compile_example("examples/gpt.py", tmp_path / f"{schedule}{memory}{zero}", devices=devices, stages=None,
                        hardware="h100", schedule=schedule, memory=memory, zero=zero)
    assert len(seen) > 10
    assert (1, None, False) in variants, "ZeRO-1's broadcast is floored too"
    assert any(offload for _, _, offload in variants), "an offloading split is bounded again with its copies"
    assert all(b <= tight <= step and f <= step and pruned <= step for b, f, tight, step, pruned in seen)
    assert any(f > b for b, f, *_ in seen), "the floor of fill and drain is sometimes the higher"
    assert all(tight > 1.01 * b for b, _, tight, *_ in seen), "the simulator's inputs tighten the bound"


def test_auto_schedule_keeps_the_fastest_predicted_schedule(tmp_path: Path) -> None:
    """`--schedule auto`: every mesh under gpipe, 1f1b, zb-h1, zb-h2 and zb-v, each posed with
    its own memory; the package runs the fastest, which `show` lists with the others."""
    compiled = compile_example("examples/gpt.py", tmp_path / "pkg", devices=2, stages=2, microbatches=4,
                               hardware="h100", schedule="auto")
    manifest = compiled.manifest
    candidates = manifest.predicted.extra["candidates"]
    assert {c["schedule"] for c in candidates} == set(AUTO_SCHEDULES)
    assert manifest.schedule == candidates[0]["schedule"]
    assert candidates[0]["step_time_s"] == min(c["step_time_s"] for c in candidates)
    by = {c["schedule"]: c for c in candidates}
    assert by["zb-h1"]["step_time_s"] < by["1f1b"]["step_time_s"]  # the bubble a third, the rest equal
    assert by["zb-h2"]["memory_bytes"] > by["zb-h1"]["memory_bytes"]  # twice the microbatches in flight
    shown = (tmp_path / "pkg" / "plan.txt").read_text()
    assert all(f"  {s}" in shown for s in AUTO_SCHEDULES)


def test_auto_is_the_default_schedule_with_devices_and_1f1b_without(tmp_path: Path) -> None:
    assert CompileOptions(model="m.py", out="o", devices=2).schedule == "auto"
    assert CompileOptions(model="m.py", out="o").schedule == "1f1b"
    assert CompileOptions(model="m.py", out="o", devices=2, schedule="gpipe").schedule == "gpipe"
    mesh = ["--devices", "2", "--stages", "2", "--tp", "1", "--microbatches", "4", "--analytic", "--quiet"]
    for name, given in (("default", []), ("given", ["--schedule", "1f1b"])):
        assert main(["compile", "examples/mlp.py", "--out", str(tmp_path / name), *mesh, *given]) == 0
    tried = {name: {c["schedule"] for c in read_manifest(tmp_path / name).predicted.extra["candidates"]} for name in ("default", "given")}
    assert tried == {"default": set(AUTO_SCHEDULES), "given": {"1f1b"}}


def test_auto_schedule_needs_devices(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="--schedule auto chooses the schedule while searching"):
        compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, schedule="auto")


def test_the_published_megatron_meshes_are_candidates() -> None:
    """Every row of Megatron-LM's table (benchmarks/published.py): its mesh, one row per
    microbatch and its schedule are among what `--devices` searches, so the search is never
    predicted slower than the published configuration."""
    from benchmarks.published import ROWS
    from driver.meshes import interleaved_schedule as _interleaved, schedules as _schedules

    for row in ROWS:
        opts = CompileOptions(model="m.py", out="o", devices=row.gpus)
        dp = row.gpus // (row.tp * row.pp)
        mesh = (row.pp, row.tp, dp, row.batch // dp)
        assert mesh in _meshes(row.gpus, row.batch, opts, tp_limit=8), row
        assert row.schedule in _schedules(opts.schedule, row.pp) + _interleaved(opts, row.pp, mesh[3], 1), row


@pytest.mark.slow
def test_the_search_in_worker_processes_finds_the_same_best_mesh(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the search in worker processes]: the best by the shared bound is the one found in one process."""
    options = dict(devices=4, stages=None, tp=1, hardware="h100", schedule="auto")
    best = []
    for count in (1, 2):
        monkeypatch.setattr(search, "workers", lambda _count, n=count: n)
        manifest = compile_example("examples/gpt.py", tmp_path / str(count), **options).manifest
        best.append((manifest.mesh, manifest.schedule, manifest.predicted.extra["candidates"][0]))
    assert best[0] == best[1]


def test_the_search_in_worker_processes_after_this_one_ran_on_several_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A search forks its workers after this process computed on two threads: a worker's ops
    (the memory walk runs some) must not wait for OpenMP threads the fork left behind.  The
    first shape's candidates start in the early worker while the rest are posed, and every
    candidate comes back once, from it or from the pool ([Note: the search in worker
    processes])."""
    early: list[int] = []
    ready = workers.Early.ready

    def counted(self: workers.Early, wait: bool) -> Any:
        for outcome in ready(self, wait):
            early.append(outcome.order)
            yield outcome

    every: list[int] = []
    outcomes = search.outcomes

    def each(*args: Any) -> Any:
        for outcome in outcomes(*args):
            every.append(outcome.order)
            yield outcome

    monkeypatch.setattr(workers.Early, "ready", counted)
    monkeypatch.setattr(search, "outcomes", each)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.zeros(1 << 20).index_select(0, torch.arange(1 << 20))  # OpenMP's threads start here
        monkeypatch.setattr(search, "workers", lambda _count: 2)
        mesh = compile_example("tests/model_files/gpt_wide.py", tmp_path / "pkg", devices=4, stages=None).manifest.mesh
    finally:
        torch.set_num_threads(threads)
    assert mesh.pp * mesh.tp * mesh.dp == 4
    assert sorted(every) == list(range(len(every)))
    assert early  # it claims its first candidate in milliseconds; posing the other shapes takes seconds


def test_least_slowest_is_the_best_split_of_blocks_into_runs() -> None:
    """`least_slowest` against every split of small random chains (brute force): never
    above the least slowest run, and within the bisection's precision of it."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        times = tuple(rng.choice([0.5, 1.0, 1.0, 2.0, 3.0]) * rng.random() for _ in range(rng.randint(1, 9)))
        parts = rng.randint(1, len(times))
        best = min(max(sum(times[a:b]) for a, b in zip((0, *cuts), (*cuts, len(times))))
                   for cuts in itertools.combinations(range(1, len(times)), parts - 1))
        got = ranking.least_slowest(times, parts)
        assert got <= best * (1 + 1e-12), (times, parts, got, best)  # a floor: never above it
        assert got >= best * (1 - 1e-9), (times, parts, got, best)


def test_crowded_is_below_every_placement_and_meets_whole_blocks() -> None:
    """`crowded`, the floor of several stages per rank, against every placement of small
    random blocks on ranks (brute force): never above the least busiest rank; and with
    blocks that do not divide, above the mean a rank would take were they divisible."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        times = tuple(rng.choice([0.5, 1.0, 1.0, 2.0]) * rng.random() for _ in range(rng.randint(1, 7)))
        ranks = rng.randint(1, 4)
        best = min(max(sum(t for t, r in zip(times, placed) if r == q) for q in range(ranks))
                   for placed in itertools.product(range(ranks), repeat=len(times)))
        assert ranking.crowded(times, ranks) <= best * (1 + 1e-12), (times, ranks)
    assert ranking.crowded((1.0,) * 5, 2) == 3.0 > 5 / 2  # five equal layers on two ranks: one holds three
