"""The schedule registry: each spec's properties checked against the schedule its builder
makes, and one error for a name the registry does not hold."""

from __future__ import annotations

import pytest

from runtime import manifest
from runtime.errors import ScheduleError
from runtime.schedule import (AUTO_SCHEDULES, REGISTRY, SCHEDULES, Kind, ScheduleSpec, StageGraph, lower,
                              make_schedule, placement, schedule_spec, validate)
from runtime.schedule.registry import UnknownScheduleError

#: (ranks, microbatches): a pipeline shorter, as long as, and longer than its microbatches
SHAPES = [(2, 2), (3, 6), (4, 8), (4, 12), (3, 7)]


def _stages_per_rank(spec: ScheduleSpec) -> int:
    return spec.stages_on_each_rank(2)


def _cases() -> list[tuple[str, int, int]]:
    return [(name, r, m) for name, spec in REGISTRY.items() for r, m in SHAPES
            if m % spec.microbatch_multiple(r) == 0]


def _peaks(spec: ScheduleSpec, ranks: int, microbatches: int, virtual_stages: int | None = None) -> list[int]:
    """Each stage's most microbatches held at once, walking its rank's row: an F keeps its
    activations, a B (or, split, the W) frees them."""
    v = virtual_stages or _stages_per_rank(spec)
    held, peak = [0] * (ranks * v), [0] * (ranks * v)
    for row in spec.make(ranks, microbatches, v):
        for a in row:
            held[a.stage] += 1 if a.kind == Kind.F else -1 if a.kind in (Kind.B, Kind.W) else 0
            peak[a.stage] = max(peak[a.stage], held[a.stage])
    return peak


def test_the_registry_is_the_list_every_reader_uses() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")
    assert manifest.SCHEDULES is SCHEDULES
    assert AUTO_SCHEDULES == ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v")  # interleaved's stage count is the user's


@pytest.mark.parametrize("name,ranks,microbatches", _cases())
def test_each_spec_builds_a_valid_schedule_of_its_shape(name: str, ranks: int, microbatches: int) -> None:
    spec = schedule_spec(name)
    v = _stages_per_rank(spec)
    compute = make_schedule(name, ranks, microbatches, v)
    graph = StageGraph.chain(ranks * v, ranks, name)
    validate(lower(compute, graph), graph, microbatches)
    kinds = {a.kind for row in compute for a in row}
    assert (kinds == {Kind.F, Kind.I, Kind.W}) == spec.splits_backward
    assert all(graph.rank_of(a.stage) == r for r, row in enumerate(compute) for a in row)


def test_placement_follows_the_spec() -> None:
    assert placement("zb-v", 6, 3) == (0, 1, 2, 2, 1, 0)  # [Note: V placement]
    assert placement("interleaved", 6, 3) == (0, 1, 2, 0, 1, 2)
    assert [name for name, spec in REGISTRY.items() if spec.vee] == ["zb-v"]


@pytest.mark.parametrize("name,ranks,microbatches", _cases())
def test_inflight_is_the_schedules_peak(name: str, ranks: int, microbatches: int) -> None:
    """[Note: activations in flight]: what the memory model charges each stage is what
    the schedule holds there at its peak."""
    spec = schedule_spec(name)
    stages = ranks * _stages_per_rank(spec)
    assert _peaks(spec, ranks, microbatches) == [spec.inflight(ranks, stages, k, microbatches) for k in range(stages)]


def test_interleaved_inflight_is_the_walked_peak_of_every_shape() -> None:
    """Interleaved 1F1B's peaks are counted from the schedule's shape
    (`registry._interleaved_peaks`): the same as walking it, on every shape up to 8 ranks
    of 5 stages, microbatches 1 to 5 times the ranks."""
    spec = schedule_spec("interleaved")
    for ranks in range(1, 9):
        for v in range(1, 6):
            for m in (ranks, 2 * ranks, 3 * ranks, 5 * ranks):
                counted = [spec.inflight(ranks, ranks * v, k, m) for k in range(ranks * v)]
                assert counted == _peaks(spec, ranks, m, v), (ranks, v, m)


def _awaiting_w(spec: ScheduleSpec, ranks: int, microbatches: int) -> list[int]:
    """Walk the schedule: per stage, the most microbatches past I and not yet past W."""
    v = _stages_per_rank(spec)
    held, most = [0] * (ranks * v), [0] * (ranks * v)
    for row in spec.make(ranks, microbatches, v):
        for a in row:
            held[a.stage] += 1 if a.kind == Kind.I else -1 if a.kind == Kind.W else 0
            most[a.stage] = max(most[a.stage], held[a.stage])
    return most


@pytest.mark.parametrize("name", SCHEDULES)
def test_awaiting_w_is_what_the_schedule_holds_back(name: str) -> None:
    """[Note: weight gradients awaited]: on every shape up to 16 ranks and microbatches
    1 to 40 (and 96), what the memory model charges seeds for is the walked count."""
    spec = schedule_spec(name)
    for ranks in range(1, 17):
        stages = ranks * _stages_per_rank(spec)
        for m in [*range(1, 41), 96]:
            if m % spec.microbatch_multiple(ranks):
                continue
            assert list(spec.awaiting_w(ranks, stages, m)) == _awaiting_w(spec, ranks, m), (ranks, m)


def test_microbatch_multiple() -> None:
    assert schedule_spec("interleaved").microbatch_multiple(4) == 4
    assert {schedule_spec(n).microbatch_multiple(4) for n in SCHEDULES if n != "interleaved"} == {1}


def test_an_unknown_schedule_names_the_registry() -> None:
    with pytest.raises(UnknownScheduleError, match=r"^unknown schedule 'zigzag': use gpipe, 1f1b, interleaved, "
                                                   r"zb-h1, zb-h2 or zb-v\.$"):
        make_schedule("zigzag", 2, 4)
    with pytest.raises(ScheduleError, match="unknown schedule 'zigzag'"):
        placement("zigzag", 4, 2)


def test_stages_per_rank_is_checked_against_the_package() -> None:
    with pytest.raises(ScheduleError, match=r"schedule '1f1b' runs one stage per rank but the package has 3: .* "
                                            r"compile with --schedule 1f1b\."):
        make_schedule("1f1b", 2, 4, 3)
    assert len(make_schedule("interleaved", 2, 4, 3)) == 2  # interleaved takes the package's count


def test_interleaved_charges_a_middle_stage_what_the_schedule_holds_there() -> None:
    """Interleaved 1F1B's warm-up runs each rank's chunks in turns of p microbatches, so
    its middle stages hold more than 1F1B's min(S - k, M) would charge them ([Note:
    activations in flight]): rank 1 holds 8 + 4 = 12 microbatches, not 7 + 3 = 10."""
    spec = schedule_spec("interleaved")
    assert [spec.inflight(4, 8, k, 8) for k in range(8)] == [8, 8, 7, 5, 4, 4, 3, 1]
    assert [min(8 - k, 8) for k in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
