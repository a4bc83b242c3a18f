"""The stage-assignment solver against brute force, its errors, and its determinism."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any, Sequence

import pytest

from partitioner.cost.costmodel import pair_bytes, stage_pairs, values
from partitioner.errors import InfeasiblePlanError, PlanError
from partitioner.ir import Edge, PartitionProblem, SolverReport
from partitioner.solve.cpsat import solve_cpsat
from partitioner.solve.solve import evaluate, fills_with_compute, objective, plan_key, solve, stage_costs, violations

MiB = 1 << 20


def problem(times: Sequence[float], edges: Sequence[tuple[int, int]], stages: int, **options: Any) -> PartitionProblem:
    """Blocks with the given times; an edge (i, j) carries value f"v{i}" of 100 bytes
    unless `bytes` says otherwise; params: a tuple of parameter names per block."""
    sizes = options.pop("bytes", {})
    params = options.pop("params", ())
    param_size = options.pop("param_size", {})
    block_bytes = tuple(sum(param_size[p] for p in names) for names in params) or (0,) * len(times)
    options.setdefault("microbatches", 4)
    return PartitionProblem(
        block_time_s=tuple(times), block_param_bytes=options.pop("param_bytes", block_bytes),
        block_activation_bytes=options.pop("acts", (0,) * len(times)),
        edges=tuple(Edge(i, j, f"v{i}", sizes.get(i, 100)) for i, j in edges), stages=stages,
        block_params=tuple(params), param_bytes_by_name=tuple(sorted(param_size.items())), **options)


def brute_force(p: PartitionProblem) -> float:
    """The optimum over every assignment of every block to every stage."""
    return min(objective(p, a) for a in itertools.product(range(p.stages), repeat=p.num_blocks))


def solve_or_refuse(p: PartitionProblem) -> tuple[tuple[int, ...], SolverReport, float] | None:
    """`solve(p)`'s (assignment, report) and brute force's optimum; None where brute force
    finds no plan that fits, after checking that `solve` refuses with InfeasiblePlanError."""
    best = brute_force(p)
    if math.isinf(best):
        with pytest.raises(InfeasiblePlanError):
            solve(p, time_limit_s=5)
        return None
    assignment, report = solve(p, time_limit_s=5)
    return assignment, report, best


CHAIN = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
DIAMOND = [(0, 1), (0, 2), (1, 3), (2, 3)]
SKIPS = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 2), (0, 4), (1, 4)]
TWO_TOWERS = [(0, 1), (1, 2), (0, 3), (3, 4), (2, 5), (4, 5)]
MULTI_OUT = [(0, 1), (0, 2), (1, 3), (2, 4), (0, 5), (3, 5)]  # block 4 is a sink too
TIED = {"params": (("wte",), (), (), (), ("wte",)), "param_size": {"wte": 40 * MiB}}

SEEDS = {"acts": (2, 1, 1, 1, 1, 2), "block_seed_bytes": (1, 2, 1, 2, 1, 1), "microbatches": 6}

CASES: dict[str, tuple[list[tuple[int, int]], list[float], int, dict[str, Any]]] = {
    "chain": (CHAIN, [3, 1, 4, 1, 5, 9], 3, {}),
    "chain-comm": (CHAIN, [3, 1, 4, 1, 5, 9], 3, {"comm_alpha_s": 0.5, "comm_beta_s_per_byte": 0.01}),
    "chain-memory": (CHAIN, [3, 1, 4, 1, 5, 9], 3, {"acts": (2, 1, 1, 1, 1, 2), "memory_limit_bytes": 8}),
    "diamond": (DIAMOND, [1, 5, 4, 1], 2, {"comm_alpha_s": 0.3}),
    "diamond-gpipe": (DIAMOND, [1, 5, 4, 1], 3, {"acts": (4, 4, 4, 1), "memory_limit_bytes": 30,
                                                  "schedule": "gpipe"}),
    "skips": (SKIPS, [2, 2, 3, 1, 2], 3, {"comm_beta_s_per_byte": 0.02, "bytes": {0: 50, 1: 30}}),
    "two-towers": (TWO_TOWERS, [1, 4, 4, 4, 4, 1], 3, {"comm_alpha_s": 0.1}),
    "multi-output": (MULTI_OUT, [2, 3, 1, 2, 4, 1], 3, {"comm_alpha_s": 0.2}),
    "tied": ([(0, 1), (1, 2), (2, 4), (0, 3), (3, 4)], [1, 3, 3, 3, 2], 2,  # 1 of 1, 2, 3 fits on stage 0
             {**TIED, "acts": (0, 30 * MiB, 30 * MiB, 30 * MiB, 0), "memory_limit_bytes": 230 * MiB}),
    "tied-chain": (CHAIN, [1, 2, 2, 2, 2, 1], 2, {"params": (("wte",), (), (), (), (), ("wte",)),
                                                  "param_size": {"wte": 10}, "acts": (1,) * 6,
                                                  "memory_limit_bytes": 45}),
    # the W's a split backward holds back keep their seeds: [Note: weight gradients awaited]
    "zb-h1-seeds": (CHAIN, [3, 1, 4, 1, 5, 2], 3, {**SEEDS, "schedule": "zb-h1", "memory_limit_bytes": 12}),
    "zb-h2-seeds": (CHAIN, [3, 1, 4, 1, 5, 2], 3, {**SEEDS, "schedule": "zb-h2", "memory_limit_bytes": 24}),
    "zb-v-seeds": (CHAIN, [3, 1, 4, 1, 5, 9], 4, {**SEEDS, "schedule": "zb-v", "virtual_stages": 2,
                                                  "memory_limit_bytes": 14}),
    # what the walk counts beside the blocks: messages held, a working set, the step after
    "chain-held-messages": (CHAIN, [3, 1, 4, 1, 5, 9], 3, {"acts": (2, 1, 1, 1, 1, 2), "bytes": {1: 1, 3: 3},
                                                          "holds_messages": True, "working_bytes": 2,
                                                          "memory_limit_bytes": 34}),
    "dag-held-messages-buckets": (SKIPS, [2, 2, 3, 1, 2], 3, {"acts": (1,) * 5, "bytes": {0: 1, 1: 2, 2: 1, 3: 1},
                                                              "holds_messages": True, "working_bytes": 1,
                                                              "step_bytes": 3, "buckets": True,
                                                              "param_bytes": (1, 2, 1, 2, 1), "microbatches": 3,
                                                              "memory_limit_bytes": 40}),
    "two-towers-zb-h2-seeds": (TWO_TOWERS, [1, 4, 4, 4, 4, 1], 3,  # CP-SAT's model charges them too
                               {"acts": (1,) * 6, "block_seed_bytes": (1, 2, 3, 4, 5, 6), "microbatches": 4,
                                "schedule": "zb-h2", "memory_limit_bytes": 28}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_optimum_equals_brute_force(name: str) -> None:
    edges, times, stages, options = CASES[name]
    p = problem(times, edges, stages, **options)
    assignment, report = solve(p, time_limit_s=5)
    best = brute_force(p)
    assert not violations(p, assignment)
    assert report.objective_s == pytest.approx(best, rel=1e-9)
    assert report.objective_s == pytest.approx(max(evaluate(p, assignment)[0]), rel=1e-12)
    assert report.lower_bound_s <= report.objective_s
    assert report.gap < 1e-6


def _random_problem(seed: int) -> PartitionProblem:
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    stages = rng.randint(1, min(n, 3))
    edges = [(i, j) for j in range(1, n) for i in range(j) if rng.random() < 0.35]
    names = ["p0", "p1", "p2"]
    params = tuple(tuple(sorted(rng.sample(names, rng.randint(0, 2)))) for _ in range(n))
    return problem([rng.random() for _ in range(n)], edges, stages,
                   acts=tuple(rng.randint(0, 50) for _ in range(n)), microbatches=rng.randint(1, 4),
                   schedule=rng.choice(["1f1b", "gpipe"]), memory_limit_bytes=rng.choice([None, 250, 400]),
                   comm_alpha_s=rng.choice([0.0, 0.05]), comm_beta_s_per_byte=rng.choice([0.0, 1e-3]),
                   bytes={i: rng.randint(0, 100) for i in range(n)}, params=params,
                   param_size={"p0": 10, "p1": 20, "p2": 5})


@pytest.mark.parametrize("seed", range(60))
def test_random_dags_equal_brute_force(seed: int) -> None:
    p = _random_problem(seed)
    solved = solve_or_refuse(p)
    if solved is None:
        return
    _, report, best = solved
    assert report.objective_s == pytest.approx(best, rel=1e-9)


# -- the cost model, by hand -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_stage_pairs_are_pair_bytes_of_the_values_in_their_order(seed: int) -> None:
    """`stage_pairs` (the values' readers at once) is `pair_bytes` over the values, key
    for key and in the same order, under every assignment: DAGs whose values have several
    readers, and stages that run backward too."""
    p = dataclasses.replace(_random_problem(seed), stages=3)
    for assignment in itertools.product(range(3), repeat=p.num_blocks):
        plain = pair_bytes((assignment[v.producer], [assignment[r] for r in v.readers], v.bytes) for v in values(p))
        assert list(stage_pairs(p, assignment).items()) == list(plain.items())


def test_cost_model_counts_values_once_and_tied_params_once_per_stage() -> None:
    # 0 -> 1, 0 -> 2, 1 -> 2; stages (0, 1, 1): stage 0 sends v0 once though 1 and 2 read it
    p = problem([1.0, 2.0, 3.0], [(0, 1), (0, 2), (1, 2)], 2, comm_alpha_s=0.5, comm_beta_s_per_byte=0.01,
                params=(("w",), ("w", "b"), ("w",)), param_size={"w": 100, "b": 10},
                acts=(7, 8, 9), microbatches=4, optimizer_factor=2)
    costs = stage_costs(p, (0, 1, 1))
    assert [(c.messages, c.traffic_bytes) for c in costs] == [(2, 200), (2, 200)]
    assert costs[0].time_s == pytest.approx(1.0 + 0.5 * 2 + 0.01 * 200)
    assert costs[1].time_s == pytest.approx(5.0 + 0.5 * 2 + 0.01 * 200)
    assert [c.weight_bytes for c in costs] == [100, 110]  # w held once by stage 1
    assert [c.inflight for c in costs] == [2, 1]
    assert evaluate(p, (0, 1, 1))[1] == (100 * 4 + 7 * 2, 110 * 4 + 17 * 1)


def test_seeds_bind_where_the_backward_is_split() -> None:
    """Each zb case's limit admits a plan that ignoring the seeds would be faster: the
    seeds are what the optimum above respects; and a stage past the first is charged its
    seeds once per W held back."""
    for name in ("zb-h1-seeds", "zb-h2-seeds", "zb-v-seeds", "two-towers-zb-h2-seeds"):
        edges, times, stages, options = CASES[name]
        p = problem(times, edges, stages, **options)
        assert brute_force(dataclasses.replace(p, block_seed_bytes=())) < brute_force(p), name
    p = problem([1, 1, 1], [(0, 1), (1, 2)], 3, schedule="zb-h2", acts=(1, 1, 1), block_seed_bytes=(1, 2, 1),
                microbatches=6)
    assert p.spec.awaiting_w(3, 3, 6) == (1, 3, 5)
    costs = stage_costs(p, (0, 1, 2))
    assert [c.seed_bytes for c in costs] == [0, 2 * 3, 1 * 5]  # none on the first stage: its I does nothing
    assert [c.memory_bytes for c in costs] == [6, 6 + 6, 6 + 5]  # ZB-H2 holds min(2S, M) = 6 in flight
    with pytest.raises(InfeasiblePlanError, match=r"stage 1 \(.*weight-gradient seeds 6 B for the W's held back\)"):
        solve(dataclasses.replace(p, memory_limit_bytes=11))


@pytest.mark.parametrize("assignment, problem_found", [
    ((1, 0, 1), "goes backward"),
    ((0, 0, 0), "stage 1 is empty"),
    ((0, 1, 0), "not in the last stage"),
    ((0, 1), "need 3 stages"),
])
def test_violations(assignment: tuple[int, ...], problem_found: str) -> None:
    p = problem([1, 1, 1], [(0, 1), (1, 2)], 2)
    assert any(problem_found in v for v in violations(p, assignment))
    assert objective(p, assignment) == math.inf


# -- errors ------------------------------------------------------------------------------


def test_more_stages_than_blocks() -> None:
    with pytest.raises(PlanError, match=r"--stages 4 is more than the 3 blocks .* use --stages 3 or fewer"):
        solve(problem([1, 1, 1], [(0, 1), (1, 2)], 4))


@pytest.mark.parametrize("stages, options, error, message", [
    # 3 ranks x 2 virtual stages over 4 blocks: 2 ranks x 2 is the most
    (6, {}, PlanError, r"^--stages 3 \(x 2 virtual stages per rank\) makes 6 stages, which is more than the 4 "
                       r"blocks .* use --stages 2 \(x 2 virtual stages per rank\) or fewer\.$"),
    # 1 rank x 2 virtual stages holds all 4 MiB of weights (16 MiB with gradients and Adam); 2 ranks x 2 hold
    # 2 MiB each (8 MiB): the limit is per rank.  Interleaved: CP-SAT proves it; zb-v: the V DP on a chain
    (2, {"param_bytes": (MiB,) * 4, "memory_limit_bytes": 9 * MiB}, InfeasiblePlanError,
     r"^CP-SAT proved that no plan into 2 stages \(1 x 2 virtual stages per rank\) fits: the leanest found puts "
     r"16\.0 MiB on rank 0 \(stages 0 and 1: weights 4\.0 MiB, .* for 2 and 1 microbatches in flight\) but "
     r"--memory is 9\.0 MiB per rank: use --stages 2 \(x 2 virtual stages per rank\), which fits, or raise "
     r"--memory to 16\.0 MiB\.$"),
    (2, {"param_bytes": (MiB,) * 4, "memory_limit_bytes": 9 * MiB, "schedule": "zb-v"}, InfeasiblePlanError,
     r"^every plan into 2 stages \(1 x 2 virtual stages per rank\) needs at least 16\.0 MiB on one rank: the "
     r"leanest puts 16\.0 MiB on rank 0 \(stages 0 and 1: .*\) but --memory is 9\.0 MiB per rank: use "
     r"--stages 2 \(x 2 virtual stages per rank\), which fits, or raise --memory to 16\.0 MiB\.$"),
])
def test_virtual_stages_suggest_stages_per_rank(stages: int, options: dict[str, Any], error: type[Exception],
                                                message: str) -> None:
    with pytest.raises(error, match=message):
        solve(problem([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)], stages, virtual_stages=2, **options))


def test_chain_over_memory_names_both_sides_and_the_stages_that_fit() -> None:
    # 1F1B, 4 microbatches: stage 0 of 2 holds 2 in flight, of 3 holds 3; 4 x 1 MiB of weights each
    p = problem([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)], 2, param_bytes=(MiB,) * 4, acts=(0,) * 4,
                memory_limit_bytes=5 * MiB)
    message = (r"every plan into 2 stages needs at least 8\.0 MiB on one stage: the leanest puts 8\.0 MiB on "
               r"stage 0 \(weights 2\.0 MiB, gradients 2\.0 MiB, optimizer 4\.0 MiB, activations 0 B for 2 "
               r"microbatches in flight\) but --memory is 5\.0 MiB per stage: use --stages 4 \(fits\) or raise "
               r"--memory to 8\.0 MiB\.")
    with pytest.raises(InfeasiblePlanError, match=message):
        solve(p)


def test_no_stage_count_fits_asks_for_memory() -> None:
    p = problem([1, 1], [(0, 1)], 2, acts=(3 * MiB, 0), memory_limit_bytes=MiB, microbatches=2)
    with pytest.raises(InfeasiblePlanError, match=r"activations 6\.0 MiB for 2 microbatches .* raise --memory to 6\.0 MiB"):
        solve(p)


def test_dag_over_memory_is_proved_by_cpsat() -> None:
    p = problem([1, 1, 1, 1], DIAMOND, 2, acts=(MiB,) * 4, memory_limit_bytes=MiB, microbatches=1)
    with pytest.raises(InfeasiblePlanError, match=r"CP-SAT proved that no plan into 2 stages fits: .* use --stages 4"):
        solve(p)


# -- methods, determinism and speed ------------------------------------------------------


def test_chain_skips_cpsat_and_reports_no_gap() -> None:
    _, report = solve(problem([3, 1, 4, 1, 5], [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)], 2))
    assert (report.method, report.status, report.gap) == ("dp", "OPTIMAL", 0.0)


def test_cpsat_improves_on_the_contiguous_plan() -> None:
    # towers 0 -> 1 (cheap) and 2 -> 3 (dear) meet at 4: the best plan takes the head of
    # each into stage 0, which no contiguous run of 0..4 does (its best is 6)
    p = problem([1, 1, 4, 4, 0.5], [(0, 1), (1, 4), (2, 3), (3, 4)], 2)
    assignment, report = solve(p, time_limit_s=5)
    assert (report.method, report.status, assignment) == ("cpsat", "OPTIMAL", (0, 1, 0, 1, 1))
    assert report.objective_s == pytest.approx(5.5)


def test_solve_is_deterministic() -> None:
    rng = random.Random(3)
    n = 16
    edges = [(i, i + 1) for i in range(0, n - 1, 2)] + [(i, j) for j in range(2, n) for i in range(j - 1)
                                                         if rng.random() < 0.15]
    p = problem([rng.uniform(1, 3) for _ in range(n)], edges + [(n - 2, n - 1)], 4, comm_alpha_s=0.1,
                acts=(3,) * n, memory_limit_bytes=40)
    runs = [solve(p, time_limit_s=2) for _ in range(2)]
    (a1, r1), (a2, r2) = runs
    assert a1 == a2 and dataclasses.replace(r1, wall_s=0) == dataclasses.replace(r2, wall_s=0)


def test_long_chain_is_solved_by_the_dp() -> None:
    """A 2,000-node chain goes to the exact DP (how long it takes: benchmarks/solver_scaling.py)."""
    rng = random.Random(0)
    n = 2000
    p = problem([rng.uniform(0.5, 2) for _ in range(n)], [(i, i + 1) for i in range(n - 1)], 8,
                comm_alpha_s=0.01, acts=tuple(rng.randint(0, 9) for _ in range(n)), memory_limit_bytes=10**9)
    assignment, report = solve(p)
    assert report.method == "dp" and len(set(assignment)) == 8


_SCRIPT = """
import dataclasses, random
from partitioner.ir import Edge, PartitionProblem
from partitioner.solve.solve import solve
rng = random.Random(5)
n = 14
edges = sorted({(i, j) for j in range(1, n) for i in range(j) if rng.random() < 0.2} | {(n - 2, n - 1)})
p = PartitionProblem(tuple(rng.uniform(1, 3) for _ in range(n)), (8,) * n, (3,) * n,
                     tuple(Edge(i, j, f"v{i}", 64) for i, j in edges), 4, 4, memory_limit_bytes=200,
                     comm_alpha_s=0.05, block_params=tuple(("w",) if i % 5 == 0 else () for i in range(n)),
                     param_bytes_by_name=(("w", 8),))
assignment, report = solve(p, time_limit_s=1)
print(assignment, dataclasses.replace(report, wall_s=0))
"""


def test_solve_is_deterministic_across_processes() -> None:
    import os
    import subprocess
    import sys

    outputs = {subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1 and "method='" in outputs.pop()


# -- [Note: the cost of a boundary] ------------------------------------------------------


def _layers(n: int, stages: int, per_boundary: int, **options: Any) -> PartitionProblem:
    """A chain of `n` equal layers, each handing the next `per_boundary` values of 100 bytes."""
    edges = tuple(Edge(i, i + 1, f"v{i}_{j}", 100) for i in range(n - 1) for j in range(per_boundary))
    return PartitionProblem(block_time_s=(1.0,) * n, block_param_bytes=(0,) * n, block_activation_bytes=(0,) * n,
                            edges=edges, stages=stages, microbatches=4, **options)


def test_a_boundary_is_one_message_per_stage_pair() -> None:
    p = _layers(4, 2, 4, comm_alpha_s=0.5, comm_beta_s_per_byte=0.001)
    costs = stage_costs(p, (0, 0, 1, 1))
    assert [(c.messages, c.traffic_bytes) for c in costs] == [(2, 800), (2, 800)]  # 4 values, one message each way
    assert costs[0].time_s == pytest.approx(2.0 + 2 * (0.5 + 0.001 * 400))
    assert costs[1].time_s == pytest.approx(2.0 + 2 * (0.5 + 0.001 * 400))


def test_a_value_read_on_two_later_stages_costs_its_sender_twice() -> None:
    # v0 is read on stages 1 and 2: two messages from stage 0, each with its bytes
    p = problem([1.0, 1.0, 1.0], [(0, 1), (0, 2), (1, 2)], 3, comm_alpha_s=0.5, comm_beta_s_per_byte=0.01)
    costs = stage_costs(p, (0, 1, 2))
    assert [(c.messages, c.traffic_bytes) for c in costs] == [(4, 400), (4, 400), (4, 400)]
    assert costs[0].time_s == pytest.approx(1.0 + 2 * 2 * (0.5 + 0.01 * 100))
    assert costs[2].time_s == pytest.approx(1.0 + 2 * (0.5 + 0.01 * 100) + 2 * (0.5 + 0.01 * 100))
    assert costs[2].input_bytes == 200


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_equal_layers_with_four_values_per_boundary_split_evenly(stages: int) -> None:
    # Charged per value, a middle stage paid 4x the latency and the ends took more layers
    # (3 stages: 5, 2, 5); one message per stage pair makes the even split the best.
    p = _layers(12, stages, 4, comm_alpha_s=0.3)
    assignment, report = solve(p, time_limit_s=5)
    assert [assignment.count(k) for k in range(stages)] == [12 // stages] * stages
    assert report.objective_s == pytest.approx(12 / stages + 2 * 0.3 * (2 if stages > 2 else 1))
    assert report.gap < 1e-6


def test_where_receives_go_ahead_a_middle_stage_is_not_starved_for_its_messages() -> None:
    """12 layers of 1 ms into 3 stages on a CPU-like profile (a 0.9 ms round trip, posting a
    send 0.3 ms and a receive 0.1 ms): charged the posts ([Note: receives posted ahead]),
    the middle stage with its two boundaries gets its third of the layers; charged the
    round trip at each end, as before receives went ahead, it got fewer than the ends."""
    from partitioner.cost.hardware import load_hardware
    from partitioner.predict.predict import stage_message_s

    cpu = dataclasses.replace(load_hardware("a100"), name="cpu", devices_per_node=8, intra_node_latency_s=9e-4,
                              p2p_send_post_s=3e-4, p2p_recv_post_s=1e-4)
    counts = {}
    for name, alpha in [("posts", stage_message_s(cpu, 3, 1)), ("round trip", cpu.p2p_alpha_s)]:
        layers = dataclasses.replace(_layers(12, 3, 4, comm_alpha_s=alpha), block_time_s=(1e-3,) * 12)
        assignment, _ = solve(layers, time_limit_s=5)
        counts[name] = [assignment.count(k) for k in range(3)]
    assert counts["posts"] == [4, 4, 4]
    assert counts["round trip"][1] < 4


def test_a_chain_with_skips_and_latency_equals_brute_force() -> None:
    # values that skip stages: the DP's bound is not met, CP-SAT finishes the search
    p = problem([2, 2, 3, 1, 2, 2], SKIPS + [(4, 5), (0, 5)], 3, comm_alpha_s=0.4, comm_beta_s_per_byte=0.01)
    assignment, report = solve(p, time_limit_s=5)
    assert report.objective_s == pytest.approx(brute_force(p), rel=1e-9)
    assert report.lower_bound_s <= report.objective_s * (1 + 1e-9)


# -- ties: balance, then traffic ---------------------------------------------------------


def _lex_brute_force(p: PartitionProblem) -> tuple[float, float, int]:
    """The least `plan_key` over every assignment (times rounded, so ties are ties)."""
    keys = (plan_key(p, a) for a in itertools.product(range(p.stages), repeat=p.num_blocks))
    return min((round(k[0], 9), round(k[1], 9), k[2]) for k in keys)


def _rounded_key(p: PartitionProblem, assignment: Sequence[int]) -> tuple[float, float, int]:
    k = plan_key(p, assignment)
    return round(k[0], 9), round(k[1], 9), k[2]


def test_ties_pick_the_balanced_plan_then_the_fewest_bytes() -> None:
    # block 0 sets the slowest stage (5) whatever the rest does; of the plans with that
    # max, (5 | 1 | 4) leaves stage 1 a lone cheap node, (5 | 2 | 3) and (5 | 3 | 2) are
    # as balanced, and the first cuts the smaller value (v2, 50 bytes against v3's 100)
    p = problem([5, 1, 1, 1, 1, 1], CHAIN, 3, bytes={2: 50})
    assignment, report = solve(p, time_limit_s=5)
    assert assignment == (0, 1, 1, 2, 2, 2)
    assert report.objective_s == pytest.approx(5.0)


@pytest.mark.parametrize("name", ["chain", "diamond", "two-towers", "multi-output", "skips"])
def test_second_and_third_objectives_equal_brute_force(name: str) -> None:
    edges, times, stages, options = CASES[name]
    p = problem(times, edges, stages, **options)
    assignment, _ = solve(p, time_limit_s=5)
    assert _rounded_key(p, assignment) == _lex_brute_force(p)


def test_a_dag_tie_is_broken_by_cpsat_too() -> None:
    # 1 and 2 both read 0 and feed 3: not a chain, so CP-SAT searches; max 5 is fixed by block 0
    p = problem([5, 1, 1, 1, 1, 1], [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (4, 5)], 3)
    assignment, report = solve(p, time_limit_s=5)
    assert report.method in ("dp+cpsat", "cpsat")
    assert _rounded_key(p, assignment) == _lex_brute_force(p)
    assert sorted(assignment.count(k) for k in range(3)) == [1, 2, 3]


def test_no_stage_without_compute_while_the_blocks_can_fill_them() -> None:
    p = problem([0.0, 3.0, 0.0, 3.0, 0.0], CHAIN[:4], 2)
    assert fills_with_compute(p)
    assert "stage 0 has no compute" in violations(p, (0, 1, 1, 1, 1))
    assignment, _ = solve(p, time_limit_s=5)
    assert {assignment[1], assignment[3]} == {0, 1}
    more = problem([0.0, 3.0, 0.0, 3.0, 0.0], CHAIN[:4], 3)  # 3 stages, 2 blocks that compute
    assert not fills_with_compute(more)
    assignment, _ = solve(more, time_limit_s=5)
    assert not violations(more, assignment)


def test_a_block_of_positive_time_that_does_not_compute_fills_no_stage() -> None:
    # a view (4 s, computes nothing), then 10 s and 1 s of compute: alone on stage 0 the
    # view would make the fastest plan (11 s), which leaves stage 0 without compute
    p = problem([4.0, 10.0, 1.0], CHAIN[:2], 2, block_computes=(False, True, True))
    assert "stage 0 has no compute" in violations(p, (0, 1, 1))
    assignment, report = solve(p, time_limit_s=5)
    assert assignment == (0, 0, 1) and report.objective_s == pytest.approx(14.0)


def _problem_with_idle_blocks(seed: int, chain: bool) -> PartitionProblem:
    """Blocks of positive time, some of which compute nothing (views, buffer updates)."""
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    stages = rng.randint(2, 3)
    edges = [(i, i + 1) for i in range(n - 1)] if chain else [
        (i, j) for j in range(1, n) for i in range(j) if rng.random() < 0.4]
    return problem([rng.choice([0.01, 0.5, 3.0]) * rng.random() + 1e-3 for _ in range(n)], edges, stages,
                   block_computes=tuple(rng.random() < 0.5 for _ in range(n)), comm_alpha_s=rng.choice([0.0, 0.05]),
                   acts=tuple(rng.randint(0, 50) for _ in range(n)), memory_limit_bytes=rng.choice([None, 300]))


@pytest.mark.parametrize("chain", [True, False], ids=["chain-dp", "dag-cpsat"])
@pytest.mark.parametrize("seed", range(30))
def test_blocks_that_do_not_compute_equal_brute_force(seed: int, chain: bool) -> None:
    """[Note: every stage computes]: the DP (a chain, solved by it alone) and CP-SAT (on
    its own, not warm-started) find the brute-force optimum of the plans that give every
    stage a block that computes, when there are enough of them."""
    p = _problem_with_idle_blocks(seed, chain)
    solved = solve_or_refuse(p)
    if solved is None:
        return
    assignment, report, best = solved
    assert not violations(p, assignment)
    assert report.objective_s == pytest.approx(best, rel=1e-9)
    if chain:
        assert report.method == "dp"
    cp = solve_cpsat(p, 5)
    assert cp.assignment is not None and not violations(p, cp.assignment)
    assert objective(p, cp.assignment) == pytest.approx(best, rel=1e-6)
