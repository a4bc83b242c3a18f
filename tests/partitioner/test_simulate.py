"""The step simulator against hand-computed makespans and the closed-form bubble."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from partitioner.cost.roofline import message_s, mfu, roofline_s, stage_memory_bytes
from partitioner.predict.simulate import bubble_fraction, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(2, 4), (3, 6), (4, 4), (4, 16)])
def test_balanced_pipeline_takes_m_plus_s_minus_1_slots(schedule: str, stages: int, microbatches: int) -> None:
    """Forward 1, backward 2 on every stage, free links: (M + S - 1) * 3."""
    links = {(k, k + 1): 0.0 for k in range(stages - 1)}
    sim = simulate([1.0] * stages, [2.0] * stages, links, schedule, stages, microbatches)
    assert sim.step_time_s == pytest.approx((microbatches + stages - 1) * 3.0)
    busy = microbatches * 3.0
    assert 1 - busy / sim.step_time_s == pytest.approx(bubble_fraction(stages, microbatches))


def test_two_stage_1f1b_with_uneven_stages_and_a_link() -> None:
    """Stage 0: F 1, B 2; stage 1: F 2, B 4; each message 0.5; M = 2.  A receive ends 0.5
    after both sides posted it: rank 1 posts 1F1's receive only at 7.5 (after 1B0), rank 0
    0B1's at 10 though 1B1's gradient is sent at 14.

    time     0    1   1.5  2   3.5        7.5  8    10        14 14.5  16.5
    rank 0  |0F0 |0F1 |                       |0B0 |              |0B1  |
    rank 1            |1F0 |1B0       |    |1F1 |1B1       |
    """
    sim = simulate([1.0, 2.0], [2.0, 4.0], {(0, 1): 0.5}, "1f1b", 2, 2)
    assert sim.step_time_s == pytest.approx(16.5)
    assert sim.busy_s == (6.0, 12.0)


def test_a_receive_waits_for_both_sides_then_takes_the_message() -> None:
    """GPipe, M = 2, stage 0: F 1, B 1; stage 1: F 3, B 1; message 0.5.  Rank 1 posts 1F1's
    receive at 4.5, when 1F0 ends, long after 0F1 was sent at 2: it still takes 0.5 (the
    old model, producer end + message, had it start at 4.5).  1F1 4.5+0.5..8, 1B0 8..9,
    1B1 9..10; 0B0 posted at 2, sent at 9, ends 9.5+1; 0B1 10.5 vs 10: 11..12."""
    sim = simulate([1.0, 3.0], [1.0, 1.0], {(0, 1): 0.5}, "gpipe", 2, 2)
    assert sim.step_time_s == pytest.approx(12.0)


def test_a_receive_posted_ahead_takes_its_message_during_the_compute_before() -> None:
    """The previous test's pipeline with receives posted a compute ahead (gloo: [Note:
    receives posted ahead]).  Rank 1 posts 1F1's receive at 1.5, before 1F0; 0F1 is sent at
    2, so it is there at 2.5, long before 1F0 ends at 4.5: 1F1 4.5..7.5, 1B0 ..8.5, 1B1
    ..9.5.  Rank 0 posted B0's receive at 1 (before 0F1): sent at 8.5, there at 9, 0B0
    9..10; B1's, posted at 9, sent at 9.5, there at 10: 0B1 10..11, not 12."""
    sim = simulate([1.0, 3.0], [1.0, 1.0], {(0, 1): 0.5}, "gpipe", 2, 2, ahead=True)
    assert sim.step_time_s == pytest.approx(11.0)
    free = simulate([1.0, 3.0], [1.0, 1.0], {(0, 1): 0.0}, "gpipe", 2, 2)
    assert sim.step_time_s >= free.step_time_s


@pytest.mark.parametrize("schedule, stages, microbatches", [("1f1b", 2, 4), ("1f1b", 4, 8), ("gpipe", 3, 6),
                                                             ("zb-h1", 3, 6), ("interleaved", 2, 4)])
def test_receives_posted_ahead_never_slow_a_step_without_posting_costs(schedule: str, stages: int,
                                                                       microbatches: int) -> None:
    """A receive posted earlier ends no later; with free links nothing changes."""
    virtual = 2 if schedule == "interleaved" else 1
    n = stages * virtual
    links = {(k, k + 1): 0.3 for k in range(n - 1)}
    forward, backward = [1.0 + 0.1 * k for k in range(n)], [2.0] * n
    late = simulate(forward, backward, links, schedule, stages, microbatches, virtual)
    early = simulate(forward, backward, links, schedule, stages, microbatches, virtual, ahead=True)
    assert early.step_time_s < late.step_time_s
    free = {pair: 0.0 for pair in links}
    assert simulate(forward, backward, free, schedule, stages, microbatches, virtual, ahead=True).step_time_s == \
        pytest.approx(simulate(forward, backward, free, schedule, stages, microbatches, virtual).step_time_s)


def test_a_send_costs_its_sender() -> None:
    """Free links but each send costs its sender 0.25, and its message leaves once posted:
    2 stages, F 1, B 2, M = 1.  0F0 ends at 1, its send is posted by 1.25; 1F0 1.25..2.25,
    1B0 2.25..4.25 and its send by 4.5; 0B0 4.5..6.5."""
    sim = simulate([1.0, 1.0], [2.0, 2.0], {(0, 1): 0.0}, "1f1b", 2, 1, send_s=0.25)
    assert sim.step_time_s == pytest.approx(6.5)
    sim = simulate([1.0, 1.0], [2.0, 2.0], {(0, 1): 0.0}, "1f1b", 2, 2, send_s=0.25)
    free = simulate([1.0, 1.0], [2.0, 2.0], {(0, 1): 0.0}, "1f1b", 2, 2)
    assert sim.step_time_s > free.step_time_s
    assert sim.busy_s == free.busy_s  # sends are not compute


def test_the_loss_runs_on_the_last_stage() -> None:
    """A loss of (0.5, 1) per microbatch makes the last stage F 1.5, B 3: balanced 2-stage
    1F1B with M = 4 is then stage 0's 4 x 3 plus one slot of the last stage's 4.5."""
    sim = simulate([1.0, 1.0], [2.0, 2.0], {(0, 1): 0.0}, "1f1b", 2, 4, loss_s=(0.5, 1.0))
    assert sim.busy_s == (12.0, 18.0)
    assert sim.step_time_s == pytest.approx(1.0 + 4 * 4.5 + 2.0)


def test_the_final_all_reduce_ends_the_step() -> None:
    base = simulate([1.0] * 2, [2.0] * 2, {(0, 1): 0.0}, "gpipe", 2, 4)
    sim = simulate([1.0] * 2, [2.0] * 2, {(0, 1): 0.0}, "gpipe", 2, 4, final_s=0.125)
    assert sim.step_time_s == pytest.approx(base.step_time_s + 0.125) == pytest.approx(5 * 3.0 + 0.125)


@pytest.mark.parametrize("stages", [2, 4])
def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe(stages: int) -> None:
    links = {(k, k + 1): 0.0 for k in range(stages - 1)}
    one = simulate([1.0] * stages, [2.0] * stages, links, "1f1b", stages, 8)
    gpipe = simulate([1.0] * stages, [2.0] * stages, links, "gpipe", stages, 8)
    assert one.peak_inflight == tuple(stages - k for k in range(stages))
    assert gpipe.peak_inflight == (8,) * stages


def test_interleaved_shrinks_the_bubble() -> None:
    """4 ranks x 2 virtual stages of half the work each, against 4 plain stages."""
    plain = simulate([1.0] * 4, [2.0] * 4, {(k, k + 1): 0.0 for k in range(3)}, "1f1b", 4, 8)
    inter = simulate([0.5] * 8, [1.0] * 8, {(k, k + 1): 0.0 for k in range(7)}, "interleaved", 4, 8, virtual=2)
    assert inter.step_time_s < plain.step_time_s
    assert inter.step_time_s == pytest.approx(8 * 3.0 + 3 * 3.0 / 2)


def test_roofline_and_friends() -> None:
    assert roofline_s(2e12, 1e9, peak_flops=1e12, bandwidth=1e12) == pytest.approx(2.0)  # compute-bound
    assert roofline_s(1e9, 4e12, peak_flops=1e12, bandwidth=1e12) == pytest.approx(4.0)  # memory-bound
    assert roofline_s(1e12, 0, peak_flops=1e12, bandwidth=1e12, efficiency=0.5) == pytest.approx(2.0)
    assert message_s(0, 1e-5, 1e-9) == 0.0
    assert message_s(1e6, 1e-5, 1e-9) == pytest.approx(1e-5 + 1e-3)
    assert stage_memory_bytes(100, 10, inflight=3, optimizer_factor=2) == 100 * 4 + 30
    assert mfu(1e15, 1.0, 8, 1e15) == pytest.approx(1 / 8)


def test_the_data_parallel_all_reduce_hides_behind_backward_only_where_comm_overlaps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On GPUs (NCCL streams) the gradient all-reduce overlaps the last backward; on the CPU
    gloo takes the cores the ranks compute on, so all of it adds to the step."""
    import dataclasses

    from partitioner.cost.hardware import load_hardware
    from partitioner.predict.predict import simulate_plan
    from partitioner.cost.roofline import ring_allreduce_s

    from ..conftest import compile_example

    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=1, dp=2, hardware="a100")
    gpu = load_hardware("a100")
    cpu_like = dataclasses.replace(gpu, overlaps_comm=False)
    overlapped = simulate_plan(compiled.traced.gm, compiled.plan, compiled.costs, gpu).step_time_s
    exposed = simulate_plan(compiled.traced.gm, compiled.plan, compiled.costs, cpu_like).step_time_s
    alpha, beta = gpu.ring_link()
    whole = ring_allreduce_s(compiled.plan.stages[0].param_bytes, 2, alpha, beta)
    assert 0 < exposed - overlapped <= whole * (1 + 1e-9)  # at most the whole all-reduce was hidden


def test_a_receive_costs_its_receiver() -> None:
    """GPipe, 2 stages, 2 microbatches, F = B = 1 s, messages 0.5 s, posting a receive 0.25 s.

        rank 0: 0F0 0..1, 0F1 1..2; posts the receive of B0 by 2.25
        rank 1: posts F0's by 0.25, takes it 1..1.5, 1F0 1.5..2.5; F1's posted by 2.75,
                taken (sent at 2) by 3.25, 1F1 ..4.25; 1B0 ..5.25, 1B1 ..6.25
        rank 0: B0 (sent at 5.25) arrives 5.75, 0B0 ..6.75; B1's posted by 7, arrives
                6.75 vs 7: 7.5, 0B1 ..8.5 (without the receive's cost: 8.0)
    """
    links = {(0, 1): 0.5}
    assert simulate([1, 1], [1, 1], links, "gpipe", 2, 2).step_time_s == pytest.approx(8.0)
    sim = simulate([1, 1], [1, 1], links, "gpipe", 2, 2, recv_s=0.25)
    assert sim.step_time_s == pytest.approx(8.5)
    assert sim.busy_s == (4.0, 4.0)  # posts are not compute


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(stages: int, microbatches: int) -> None:
    """F = I = W = 1 (B = 2, half of it W), free links: 1F1B idles 3 (S - 1) per rank,
    ZB-H1 S - 1 (Qi et al. 2024: (S - 1)(F + I - W)), at 1F1B's peak memory (S in flight)."""
    links = {(k, k + 1): 0.0 for k in range(stages - 1)}
    busy = microbatches * 3.0
    one = simulate([1.0] * stages, [2.0] * stages, links, "1f1b", stages, microbatches)
    h1 = simulate([1.0] * stages, [2.0] * stages, links, "zb-h1", stages, microbatches)
    assert one.step_time_s - busy == pytest.approx(3 * (stages - 1))
    assert h1.step_time_s - busy == pytest.approx((one.step_time_s - busy) / 3)
    assert max(h1.peak_inflight) == max(one.peak_inflight) == min(stages, microbatches)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (3, 6), (4, 8), (4, 16)])
@pytest.mark.parametrize("input_s", [1.0, 2.0])
def test_zb_h2_has_no_bubble_but_the_ramp_with_twice_the_memory(stages: int, microbatches: int,
                                                                input_s: float) -> None:
    """F = W = 1, I = 1 or 2: ZB-H2's step is every rank's work plus the ramp (S - 1) F that
    no synchronous step hides (the last rank's first forward waits for the others'), so no
    rank idles between its first and last action; ZB-H1 pays (S - 1)(F + I - W), the same
    when I = W, twice that when I = 2.  ZB-H2 holds 2S microbatches, twice ZB-H1's S."""
    links = {(k, k + 1): 0.0 for k in range(stages - 1)}
    backward = [input_s + 1.0] * stages
    share = 1.0 / (input_s + 1.0)
    busy = microbatches * (2.0 + input_s)
    h1 = simulate([1.0] * stages, backward, links, "zb-h1", stages, microbatches, weight_share=share)
    h2 = simulate([1.0] * stages, backward, links, "zb-h2", stages, microbatches, weight_share=share)
    assert h2.step_time_s == pytest.approx(busy + (stages - 1))
    assert h1.step_time_s == pytest.approx(busy + (stages - 1) * input_s)
    assert h2.peak_inflight == tuple([min(2 * stages, microbatches)] * stages)
    assert h1.peak_inflight == tuple([min(stages, microbatches)] * stages)


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (3, 6), (4, 8), (4, 16)])
@pytest.mark.parametrize("input_s", [1.0, 2.0])
def test_zb_v_halves_zb_h1s_bubble_at_1f1bs_memory(ranks: int, microbatches: int, input_s: float) -> None:
    """p ranks: 1F1B and ZB-H1 on p stages of F = W = 1, I = 1 or 2; ZB-V on 2p stages of
    half that, in a V.  ZB-V's only idle time is the ramp, (p - 1) half-stage F + I - W:
    half ZB-H1's (p - 1)(F + I - W), with each stage k holding min(2p - k, M) half-stage
    microbatches (1F1B's count on 2p stages; a rank's two stages at most 2p together)."""
    p, m = ranks, microbatches
    share = 1.0 / (input_s + 1.0)
    links = {(k, k + 1): 0.0 for k in range(p - 1)}
    v_links = {(k, k + 1): 0.0 for k in range(2 * p - 1)}
    busy = m * (2.0 + input_s)
    one = simulate([1.0] * p, [input_s + 1.0] * p, links, "1f1b", p, m)
    h1 = simulate([1.0] * p, [input_s + 1.0] * p, links, "zb-h1", p, m, weight_share=share)
    v = simulate([0.5] * (2 * p), [(input_s + 1.0) / 2] * (2 * p), v_links, "zb-v", p, m, 2, weight_share=share)
    bubbles = {name: sim.step_time_s - busy for name, sim in (("1f1b", one), ("zb-h1", h1), ("zb-v", v))}
    print(f"p={p} M={m} I={input_s:g}: idle per rank " + ", ".join(f"{n} {b:g}" for n, b in bubbles.items())
          + f"; zb-v step / 1f1b {v.step_time_s / one.step_time_s:.3f}, / zb-h1 {v.step_time_s / h1.step_time_s:.3f}")
    assert bubbles["zb-v"] == pytest.approx(bubbles["zb-h1"] / 2) == pytest.approx((p - 1) * input_s / 2)
    assert v.peak_inflight == tuple(min(2 * p - k, m) for k in range(2 * p))
    assert v.busy_s == (busy,) * p


def test_w_takes_each_stages_own_weight_share() -> None:
    """A stage's I takes (1 - share) of its backward and its W the share: one share for every
    stage, or each stage its own (a stage without weights has no W to fill a bubble with)."""
    kw = dict(links={(0, 1): 0.0}, schedule="zb-h1", pp=2, microbatches=4)
    even = simulate([1.0, 1.0], [2.0, 2.0], **kw)  # type: ignore[arg-type]
    given = simulate([1.0, 1.0], [2.0, 2.0], weight_share=[0.5, 0.5], **kw)  # type: ignore[arg-type]
    skewed = simulate([1.0, 1.0], [2.0, 2.0], weight_share=[0.0, 1.0], **kw)  # type: ignore[arg-type]
    assert given == even
    took = {name: stop - start for _, start, stop, name in skewed.events}
    assert took["0I0"] == 2.0 and took["0W0"] == 0.0 and took["1I0"] == 0.0 and took["1W0"] == 2.0


def test_the_profile_splits_each_backward_into_its_weight_and_input_parts() -> None:
    """NodeCost.weight_fraction: a Linear's backward is part dW, part dX; an activation's is
    all dX; an embedding of integer ids all dW; measured and analytic alike."""
    from partitioner.cost.hardware import load_hardware
    from partitioner.cost.profile import annotate
    from partitioner.trace.passes import propagate

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.lin = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # as the tracer writes it: functions on weights
            x = torch.nn.functional.embedding(ids, self.emb.weight)
            return torch.relu(torch.nn.functional.linear(x, self.lin.weight, self.lin.bias))

    gm = torch.fx.symbolic_trace(Net())
    values = propagate(gm, [torch.randint(0, 64, (8, 16))])
    for measure in (True, False):
        costs = annotate(gm, values, load_hardware("cpu" if measure else "a100"), measure, repeats=3)
        assert costs["embedding"].weight_fraction == 1.0 and costs["relu"].weight_fraction == 0.0
        # measured, dW alone against dW and dX of a tiny matmul is a ratio of two timings: no
        # bound but the clamp holds on a loaded machine; the roofline's is a true part
        assert 0.0 < costs["linear"].weight_fraction <= 1.0 if measure else 0.0 < costs["linear"].weight_fraction < 1.0, \
            costs["linear"]
        assert costs["linear"].weight_s == costs["linear"].backward_s * costs["linear"].weight_fraction
