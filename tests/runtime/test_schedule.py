"""The schedule IR: generators laid out visually (as torchgpipe does for clock_cycles),
lowering, and validation errors with their marked grids."""

from __future__ import annotations

import textwrap

import pytest

from runtime.errors import ScheduleError
from runtime.schedule import (
    Action,
    StageGraph,
    execution_order,
    format_grid,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    lower,
    make_schedule,
    one_f_one_b,
    parse_schedule,
    placement,
    receives_ahead,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)
from runtime.schedule import F, I, W

# stage 0 feeds stages 1 and 2 (a skip value), stage 1 feeds stage 2
SKIP = StageGraph(3, 3, ((0, 1), (0, 2), (1, 2)), frozenset({(0, 1), (0, 2), (1, 2)}))


def _layout(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def test_action_repr_and_from_str() -> None:
    assert repr(Action(2, "F", 0)) == "2F0"
    assert repr(Action(0, "SEND_F", 1, 2)) == "0SEND_F1>2"
    assert repr(Action(2, "RECV_B", 3, 1)) == "2RECV_B3<1"
    for text in ["2F0", "11B12", "0SEND_F1>2", "2RECV_F1<0", "1SEND_B0>0", "0RECV_B4<3"]:
        assert repr(Action.from_str(text)) == text
    with pytest.raises(ScheduleError, match="'2X0' is not an action"):
        Action.from_str("2X0")
    with pytest.raises(ScheduleError, match="a SEND points to its peer with '>'"):
        Action.from_str("0SEND_F1<2")
    with pytest.raises(ScheduleError, match="only they name a peer"):
        Action(0, "F", 0, 1)


def test_gpipe_clock_cycles() -> None:
    grid = validate(gpipe(3, 3), StageGraph.chain(3))
    assert format_grid(grid) == _layout("""
        step    0    1    2    3    4    5    6    7    8    9
        rank 0  0F0  0F1  0F2  .    .    .    .    0B0  0B1  0B2
        rank 1  .    1F0  1F1  1F2  .    .    1B0  1B1  1B2  .
        rank 2  .    .    2F0  2F1  2F2  2B0  2B1  2B2  .    .
    """)


def test_one_f_one_b() -> None:
    assert format_schedule(one_f_one_b(4, 6)) == _layout("""
        0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5
        1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5
        2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5
        3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5
    """)
    grid = validate(one_f_one_b(3, 4), StageGraph.chain(3))
    assert format_grid(grid) == _layout("""
        step    0    1    2    3    4    5    6    7    8    9    10   11
        rank 0  0F0  0F1  0F2  .    .    0B0  0F3  0B1  .    0B2  .    0B3
        rank 1  .    1F0  1F1  .    1B0  1F2  1B1  1F3  1B2  .    1B3  .
        rank 2  .    .    2F0  2B0  2F1  2B1  2F2  2B2  2F3  2B3  .    .
    """)


def test_one_f_one_b_with_fewer_microbatches_than_stages() -> None:
    assert format_schedule(one_f_one_b(3, 1)) == "0F0 0B0\n1F0 1B0\n2F0 2B0"


def test_interleaved_megatron() -> None:
    # 2 ranks x 2 chunks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert format_schedule(interleaved_1f1b(2, 2, 4)) == _layout("""
        0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """)
    # Megatron's figure 4 (4 ranks, 2 chunks, 8 microbatches): rank 0 warms up with 10 forwards
    row0 = interleaved_1f1b(4, 2, 8)[0]
    assert " ".join(map(repr, row0[:14])) == "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1"
    with pytest.raises(ScheduleError, match=r"microbatches \(6\) to be a multiple of the pipeline ranks \(4\)"):
        interleaved_1f1b(4, 2, 6)


def test_lower_sends_a_skip_value_to_each_reader() -> None:
    assert format_schedule(lower(gpipe(3, 1), SKIP)) == _layout("""
        0F0 0SEND_F0>1 0SEND_F0>2 0RECV_B0<1 0RECV_B0<2 0B0
        1RECV_F0<0 1F0 1SEND_F0>2 1RECV_B0<2 1B0 1SEND_B0>0
        2RECV_F0<0 2RECV_F0<1 2F0 2B0 2SEND_B0>0 2SEND_B0>1
    """)


def test_the_receives_of_the_next_compute_are_posted_before_the_current_one() -> None:
    """[Note: receives posted ahead]: each compute maps to the receives between it and the
    rank's next compute (the first compute's own receives are posted where they stand)."""
    row = lower(gpipe(3, 1), SKIP)[2]  # 2RECV_F0<0 2RECV_F0<1 2F0 2B0 2SEND_B0>0 2SEND_B0>1
    assert receives_ahead(row) == {}
    rows = lower(one_f_one_b(2, 3), StageGraph.chain(2))
    assert format_schedule(rows) == _layout("""
        0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0F2 0SEND_F2>1 0RECV_B1<1 0B1 0RECV_B2<1 0B2
        1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1RECV_F2<0 1F2 1B2 1SEND_B2>0
    """)
    assert receives_ahead(rows[0]) == {2: (4,), 6: (8,), 9: (10,)}  # 0B0's before 0F1, ...
    assert receives_ahead(rows[1]) == {2: (4,), 6: (8,)}  # 1F1's before 1B0, 1F2's before 1B1


def test_the_distributed_runtime_posts_them_there() -> None:
    """DistributedPipeline._run, with its posts and actions recorded: each receive of the
    next compute is posted before the current compute runs, and waited for in its place."""
    from types import SimpleNamespace

    from runtime.distributed import DistributedPipeline, _Step

    row = lower(one_f_one_b(2, 3), StageGraph.chain(2))[0]
    log: list[str] = []
    runner = SimpleNamespace(prefetch=lambda microbatch: None)  # nothing offloaded
    rank = SimpleNamespace(_buckets=None, _post_recv=lambda a, step: log.append(f"post {a!r}"),
                           _execute=lambda a, *rest: log.append(repr(a)), runners={0: runner, 1: runner})
    DistributedPipeline._run(rank, row, receives_ahead(row), _Step(train=True), [], None, None)  # type: ignore[arg-type]
    assert log == ["0F0", "0SEND_F0>1", "post 0RECV_B0<1", "0F1", "0SEND_F1>1", "0RECV_B0<1", "0B0",
                   "post 0RECV_B1<1", "0F2", "0SEND_F2>1", "0RECV_B1<1", "post 0RECV_B2<1", "0B1", "0RECV_B2<1", "0B2"]


def test_lower_keeps_same_rank_values_in_memory() -> None:
    # 4 stages on 2 ranks: 0 -> 2 is on rank 0, so no send
    g = StageGraph(4, 2, ((0, 1), (0, 2), (1, 2), (2, 3)), frozenset({(0, 1), (0, 2), (1, 2), (2, 3)}))
    lowered = lower(interleaved_1f1b(2, 2, 2), g)
    assert not any(a.peer == 2 and a.stage == 0 for a in lowered[0])
    assert not any(a.peer == 0 and a.stage == 2 for a in lowered[0])
    validate(lowered, g)


def test_lower_skips_gradients_that_do_not_flow() -> None:
    g = StageGraph(2, 2, ((0, 1),), frozenset())
    assert format_schedule(lower(gpipe(2, 1), g)) == "0F0 0SEND_F0>1 0B0\n1RECV_F0<0 1F0 1B0"


@pytest.mark.parametrize("name, ranks, virtual, m", [
    ("gpipe", 1, 1, 3), ("gpipe", 3, 1, 5), ("1f1b", 3, 1, 2), ("1f1b", 4, 1, 8),
    ("interleaved", 2, 2, 4), ("interleaved", 3, 2, 6), ("interleaved", 2, 3, 2), ("interleaved", 4, 2, 8),
    ("zb-h1", 1, 1, 2), ("zb-h1", 3, 1, 2), ("zb-h1", 4, 1, 8), ("zb-h2", 2, 1, 1), ("zb-h2", 3, 1, 6), ("zb-h2", 4, 1, 8),
    ("zb-v", 1, 2, 3), ("zb-v", 2, 2, 1), ("zb-v", 3, 2, 4), ("zb-v", 4, 2, 8),
])
def test_every_schedule_validates_lowered(name: str, ranks: int, virtual: int, m: int) -> None:
    stages = ranks * virtual
    edges = tuple(sorted({(s, s + 1) for s in range(stages - 1)} | {(0, s) for s in range(1, stages)}))
    g = StageGraph(stages, ranks, edges, frozenset(edges), placement(name, stages, ranks))
    lowered = lower(make_schedule(name, ranks, m, virtual), g)
    grid = validate(lowered, g, m)
    order = execution_order(grid)
    assert len(order) == sum(len(row) for row in lowered)


def test_round_trip_text() -> None:
    s = lower(one_f_one_b(3, 2), SKIP)
    assert parse_schedule(format_schedule(s)) == s


def test_deadlock_is_shown_on_a_grid() -> None:
    bad = parse_schedule("""
        0F0 0B0 0F1 0B1
        1F0 1F1 1B0 1B1
    """)
    with pytest.raises(ScheduleError) as err:
        validate(bad, StageGraph.chain(2))
    assert str(err.value) == _layout("""
        the schedule deadlocks at step 2 (rank 0 waits in 0B0; rank 1 waits in 1F1):
        step    0    1    2
        rank 0  0F0  .    *0B0*
        rank 1  .    1F0  *1F1*
        (* marks the bad or stuck action)
    """)


def test_lowered_deadlock() -> None:
    # rank 0 waits for the gradient before sending the activation that would produce it
    bad = parse_schedule("""
        0F0 0RECV_B0<1 0SEND_F0>1 0B0
        1RECV_F0<0 1F0 1B0 1SEND_B0>0
    """)
    with pytest.raises(ScheduleError) as err:
        validate(bad, StageGraph.chain(2))
    assert str(err.value) == _layout("""
        the schedule deadlocks at step 1 (rank 0 waits in 0RECV_B0<1; rank 1 waits in 1RECV_F0<0):
        step    0    1
        rank 0  0F0  *0RECV_B0<1*
        rank 1  .    *1RECV_F0<0*
        (* marks the bad or stuck action)
    """)


def test_duplicate_and_foreign_actions() -> None:
    with pytest.raises(ScheduleError, match=r"action 1RECV_B0<1 on rank 1, step 1 is not part of this pipeline"):
        validate(parse_schedule("0F0 0SEND_F0>1 0RECV_B0<1 0B0\n1RECV_F0<0 1RECV_B0<1 1F0 1B0 1SEND_B0>0"),
                 StageGraph.chain(2))
    twice = parse_schedule("""
        0F0 0SEND_F0>1 0RECV_B0<1 0B0
        1RECV_F0<0 1F0 1B0 1RECV_F0<0 1SEND_B0>0
    """)
    with pytest.raises(ScheduleError, match=r"appears twice:\n.*\n.*\nrank 1 .*\*1RECV_F0<0\*"):
        validate(twice, StageGraph.chain(2))


def test_missing_and_misplaced_actions() -> None:
    with pytest.raises(ScheduleError, match=r"misses 1 action\(s\): 1B1:\nstep"):
        validate(parse_schedule("0F0 0F1 0B0 0B1\n1F0 1F1 1B0"), StageGraph.chain(2))
    with pytest.raises(ScheduleError, match=r"action 1F0 on rank 0, step 1 belongs on rank 1, not rank 0:\n.*\nrank 0  0F0  \*1F0\*"):
        validate(parse_schedule("0F0 1F0\n1F1"), StageGraph.chain(2))


def test_stage_graph_from_manifest(tiny: object) -> None:
    import json

    manifest = json.loads((tiny.dir / "manifest.json").read_text())  # type: ignore[attr-defined]
    g = StageGraph.from_manifest(manifest)
    assert g.edges == ((0, 1), (0, 2), (1, 2)) and g.grad_edges == frozenset(g.edges) and g.num_ranks == 3


def test_zb_h1_defers_w_into_the_cool_down() -> None:
    """[Note: zero-bubble orders] in runtime/zero_bubble.py: 1F1B's warm-up, I in B's place,
    rank r holds back its first r W's; each gradient waits for I only, not for a whole B."""
    grid = validate(zb_h1(3, 4), StageGraph.chain(3))
    assert format_grid(grid) == _layout("""
        step    0    1    2    3    4    5    6    7    8    9    10   11   12   13
        rank 0  0F0  0F1  0F2  .    .    0I0  0W0  0F3  0I1  0W1  0I2  0W2  0I3  0W3
        rank 1  .    1F0  1F1  .    1I0  1F2  1I1  1W0  1F3  1I2  1W1  1I3  1W2  1W3
        rank 2  .    .    2F0  2I0  2F1  2I1  2F2  2I2  2W0  2F3  2I3  2W1  2W2  2W3
    """)


def test_zb_h2_warms_up_with_twice_the_forwards() -> None:
    """Rank r runs 2(S - r) - 1 forwards first, then I, F, and W held back by 2r."""
    grid = validate(zb_h2(3, 6), StageGraph.chain(3))
    assert format_grid(grid) == _layout("""
        step    0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17   18   19
        rank 0  0F0  0F1  0F2  0F3  0F4  0I0  0F5  0W0  0I1  0W1  0I2  0W2  0I3  0W3  0I4  0W4  0I5  0W5  .    .
        rank 1  .    1F0  1F1  1F2  1I0  1F3  1I1  1F4  1I2  1F5  1W0  1I3  1W1  1I4  1W2  1I5  1W3  1W4  1W5  .
        rank 2  .    .    2F0  2I0  2F1  2I1  2F2  2I2  2F3  2I3  2F4  2I4  2F5  2W0  2I5  2W1  2W2  2W3  2W4  2W5
    """)


def test_split_backward_lowers_gradients_after_i() -> None:
    assert format_schedule(lower(zb_h1(2, 1), StageGraph.chain(2))) == _layout("""
        0F0 0SEND_F0>1 0RECV_B0<1 0I0 0W0
        1RECV_F0<0 1F0 1I0 1SEND_B0>0 1W0
    """)
    assert repr(Action.from_str("3I12")) == "3I12" and repr(Action.from_str("0W0")) == "0W0"


def test_bad_split_schedules_show_their_grid() -> None:
    with pytest.raises(ScheduleError) as w_first:
        validate(parse_schedule("0F0 0W0 0I0\n1F0 1I0 1W0"), StageGraph.chain(2))
    assert str(w_first.value) == _layout("""
        the schedule deadlocks at step 4 (rank 0 waits in 0W0):
        step    0    1    2    3    4
        rank 0  0F0  .    .    .    *0W0*
        rank 1  .    1F0  1I0  1W0  .
        (* marks the bad or stuck action)
    """)
    with pytest.raises(ScheduleError, match="mixes B with I and W"):
        validate(parse_schedule("0F0 0I0 0W0\n1F0 1B0"), StageGraph.chain(2))
    with pytest.raises(ScheduleError, match="runs one stage per rank but the package has 2"):
        make_schedule("zb-h1", 2, 4, 2)
    with pytest.raises(ScheduleError, match="'zb-v' runs two stages per rank but the package has 1"):
        make_schedule("zb-v", 2, 4, 1)


def test_zb_v_places_the_stages_in_a_v() -> None:
    """[Note: V placement]: down the ranks, then back up; interleaved goes round."""
    assert placement("zb-v", 8, 4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert placement("interleaved", 8, 4) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert placement("1f1b", 3, 3) == (0, 1, 2)


def test_zb_v_fills_the_v() -> None:
    """[Note: zero-bubble orders] in runtime/zero_bubble.py, p = 2, M = 4: rank 0 runs three
    forwards of stage 0 until stage 3's first input comes back up the V, then F, I, W of
    stage 3 while the gradients go down; the step is 6 M + p - 1 = 25 slots, one idle per rank."""
    grid = validate(zb_v(2, 4), StageGraph.chain(4, 2, "zb-v"))
    assert format_grid(grid) == _layout("""
        step    0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17   18   19   20   21   22   23   24
        rank 0  0F0  0F1  0F2  3F0  3I0  3W0  3F1  3I1  3W1  0F3  0I0  0W0  3F2  3I2  3W2  0I1  0W1  3F3  3I3  3W3  0I2  0W2  0I3  0W3  .
        rank 1  .    1F0  2F0  1F1  2F1  2I0  2W0  1F2  1I0  1W0  2F2  2I1  2W1  1F3  1I1  1W1  2F3  2I2  2W2  1I2  2I3  1I3  1W2  2W3  1W3
    """)


def test_zb_v_lowers_the_turn_of_the_v_in_memory() -> None:
    """Stages 1 and 2 sit on rank 1: 1 -> 2 needs no message, nor its gradient 2 -> 1."""
    assert format_schedule(lower(zb_v(2, 1), StageGraph.chain(4, 2, "zb-v"))) == _layout("""
        0F0 0SEND_F0>1 3RECV_F0<2 3F0 3I0 3SEND_B0>2 3W0 0RECV_B0<1 0I0 0W0
        1RECV_F0<0 1F0 2F0 2SEND_F0>3 2RECV_B0<3 2I0 2W0 1I0 1SEND_B0>0 1W0
    """)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 12])
def test_zb_v_keeps_1f1b_memory_and_a_ramp_of_p_minus_1(ranks: int, m: int) -> None:
    """Every (p, M) validates lowered; each rank holds at most 2p stage-microbatches (F
    run, W not yet: p whole ranks' worth, 1F1B's first-rank peak), stage k at most
    min(2p - k, M) (1F1B's on 2p stages, what the memory model charges); with M >= 2p - 1
    the step is 6 M + p - 1 slots, rank p - 1's late start its only idle time."""
    g = StageGraph.chain(2 * ranks, ranks, "zb-v")
    schedule = zb_v(ranks, m)
    validate(lower(schedule, g), g, m)
    stage_peak = [0] * (2 * ranks)
    for row in schedule:
        held, rank_peak = [0] * (2 * ranks), 0
        for a in row:
            held[a.stage] += {F: 1, I: 0, W: -1}[a.kind]
            stage_peak[a.stage] = max(stage_peak[a.stage], held[a.stage])
            rank_peak = max(rank_peak, sum(held))
        assert rank_peak <= 2 * ranks
    assert stage_peak == [min(2 * ranks - k, m) for k in range(2 * ranks)]
    steps = len(validate(schedule, g, m)[0])
    print(f"zb-v p={ranks} M={m}: {steps} slots for {6 * m} of work")
    if m >= 2 * ranks - 1:
        assert steps == 6 * m + ranks - 1
