"""The memory model against the measured peak of every rank ([Note: the memory walk] in
partitioner/predict/memory.py, [Note: measured memory] in runtime/memory.py): each case
is compiled (analytic costs, or measured ones for this CPU: the split they choose is
another, often through an activation that only the next stage saves), trained one
tracked step on 2 or 4 gloo ranks
(memory_checks.tracked_step), and each rank's `memory_stats().total` must be within 5% of
its prediction (the host buffers offloading fills are not in it, as they would not be in a
GPU's memory)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from partitioner.predict.memory import StageBytes, rank_peaks

from ..conftest import compile_example
from .test_distributed import _ok, launch, multiproc

ROOT = Path(__file__).resolve().parents[2]
GPT = "examples/gpt.py"  # its lm_head is tied to the token embedding
LLAMA = "tests/zoo/models/hf_llama.py"
GEMMA2 = "tests/zoo/models/hf_gemma2.py"  # eager attention, soft-capped: many scores its forward makes and drops
HEAVY = "tests/model_files/two_heavy_blocks.py"
MEASURED = {"analytic": False, "hardware": "cpu"}  # costs measured on this CPU, as `compile` does by default
TOLERANCE = 0.05


CASES = [
    pytest.param(GPT, {"schedule": "1f1b"}, 2, id="gpt-1f1b"),
    pytest.param(GPT, {"schedule": "gpipe"}, 2, id="gpt-gpipe"),
    pytest.param(GPT, {"schedule": "interleaved", "virtual_stages": 2}, 2, id="gpt-interleaved"),
    pytest.param(GPT, {"schedule": "zb-h1"}, 2, id="gpt-zb-h1"),
    pytest.param(GPT, {"schedule": "zb-h2"}, 2, id="gpt-zb-h2"),
    pytest.param(GPT, {"schedule": "zb-v"}, 2, id="gpt-zb-v"),
    pytest.param(GPT, {"schedule": "1f1b", "recompute": "full"}, 2, id="gpt-recompute"),
    pytest.param(GPT, {"schedule": "1f1b", "dp": 2, "zero": 1}, 4, id="gpt-pp2-dp2-zero1"),
    pytest.param(GPT, {"schedule": "1f1b", "tp": 2, "stages": 1}, 2, id="gpt-tp2"),
    pytest.param(GPT, {"schedule": "1f1b", "precision": "bf16-mixed"}, 2, id="gpt-bf16-mixed"),
    pytest.param(LLAMA, {"schedule": "1f1b"}, 2, id="llama-1f1b"),
    pytest.param(LLAMA, {"schedule": "zb-h1"}, 2, id="llama-zb-h1"),
    pytest.param(GPT, {"schedule": "1f1b", "recompute": "selective"}, 2, id="gpt-selective"),
    pytest.param(GPT, {"schedule": "gpipe", "recompute": "selective"}, 2, id="gpt-gpipe-selective"),
    pytest.param(LLAMA, {"schedule": "1f1b", "recompute": "selective"}, 2, id="llama-selective"),
    pytest.param(GPT, {"schedule": "gpipe", "offload": "all", "microbatches": 8}, 2, id="gpt-gpipe-offload"),
    pytest.param(GPT, {"schedule": "1f1b", "offload": "all", "microbatches": 8}, 2, id="gpt-1f1b-offload"),
    pytest.param(GPT, {"schedule": "1f1b", **MEASURED}, 2, id="gpt-1f1b-measured"),
    pytest.param(HEAVY, {"schedule": "gpipe", "offload": "none", **MEASURED}, 2, id="heavy-gpipe-measured"),
    pytest.param(GEMMA2, {"schedule": "1f1b"}, 2, id="gemma2-1f1b"),
    pytest.param(GEMMA2, {"schedule": "1f1b", **MEASURED}, 2, id="gemma2-1f1b-measured"),
]


def _measure(tmp_path: Path, model: str, options: dict[str, Any], ranks: int) -> list[float]:
    """measured / predicted of each rank."""
    compile_example(model, tmp_path / "pkg", **{"stages": 2, "microbatches": 4, **options})
    local = tmp_path / Path(model).name
    shutil.copy(ROOT / model, local)
    if "zoo" in model:
        shutil.copy(ROOT / "tests/zoo/models/zoo_hf.py", tmp_path / "zoo_hf.py")
    found = launch(ranks, "peak", [tmp_path / "pkg"], local, deadline_s=180)
    _ok(found)
    peaks = [re.search(rf"^{r} peak (\d+) (\d+)$", rank.out, re.M) for r, rank in enumerate(found)]
    assert all(peaks), [rank.out for rank in found]
    return [int(m.group(1)) / int(m.group(2)) for m in peaks if m]


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("model", "options", "ranks"), CASES)
def test_each_rank_within_five_percent(tmp_path: Path, model: str, options: dict[str, Any], ranks: int) -> None:
    ratios = _measure(tmp_path, model, options, ranks)
    assert all(abs(r - 1) <= TOLERANCE for r in ratios), f"measured/predicted per rank: {ratios}"


def test_offloaded_microbatches_on_the_device_where_the_copies_are_synchronous() -> None:
    """Where the copies are done inside the compute (the CPU), a GPipe rank holds the kept
    part of every microbatch and the whole of those brought back: at the last forward the
    first backward's (one compute action ahead), at the first backward the second's too;
    with the copies beside the compute, two microbatches whole at every action."""
    stage = StageBytes(persistent=100, gradients=0, held=40, backward=0, offloaded=30)
    assert rank_peaks("gpipe", 2, 4, 1, [stage, stage], ahead=1)[0] == 100 + 2 * 40 + 2 * 10
    assert rank_peaks("gpipe", 2, 4, 1, [stage, stage], ahead=0)[0] == 100 + 40 + 3 * 10
    assert rank_peaks("gpipe", 2, 4, 1, [stage, stage])[0] == 100 + 3 * 40 + 10


def test_gpipe_holds_no_gradient_during_its_forwards() -> None:
    """GPipe's peak is at the end of its forwards: every microbatch held, no gradient yet;
    1F1B's first rank holds two microbatches and then the gradients."""
    stage = StageBytes(persistent=100, gradients=30, held=40, backward=0)
    gpipe = rank_peaks("gpipe", 2, 4, 1, [stage, stage])
    assert gpipe == (100 + 4 * 40, 100 + 4 * 40)
    one = rank_peaks("1f1b", 2, 4, 1, [stage, stage])
    assert one[0] == 100 + 30 + 2 * 40 and one[1] == 100 + 30 + 40


def test_split_backward_keeps_seeds_until_w() -> None:
    """zb-h1's last rank runs I0 then F1 before W0: microbatch 0's seeds are held then."""
    stage = StageBytes(persistent=0, gradients=0, held=10, backward=0, seeds=1000)
    peaks = rank_peaks("zb-h1", 2, 4, 1, [stage, stage])
    assert peaks[1] >= 1000 + 2 * 10


def test_values_passed_in_memory_are_held_until_the_passing_stage_is_done() -> None:
    """zb-v's rank 1 runs stages 1 and 2, and stage 1's outputs reach stage 2 in memory:
    they are held from 1F to 1W (1F0 and 1F1 run before 1W0), their gradients from 2I to
    1W; rank 0 passes nothing."""
    stage = StageBytes(persistent=0, gradients=0, held=10, backward=0)
    plain = rank_peaks("zb-v", 2, 4, 2, [stage] * 4)
    passing = StageBytes(persistent=0, gradients=0, held=10, backward=0, passed=1000, passed_grads=100)
    taking = StageBytes(persistent=0, gradients=0, held=10, backward=0, taken_grads=100)
    peaks = rank_peaks("zb-v", 2, 4, 2, [stage, passing, taking, stage])
    assert peaks[0] == plain[0] and peaks[1] - plain[1] >= 2 * 1000 + 100, (peaks, plain)


def test_tracking_frees_what_a_retained_graph_saved() -> None:
    """A split backward's I runs with retain_graph=True; what the nodes W never runs saved
    must still be freed with the graph while memory is tracked (the pack hook must not
    hold an op's own output: [Note: measured memory] in runtime/memory.py)."""
    import weakref

    import torch

    from runtime.memory import MemoryTracker

    params: list[torch.nn.Parameter] = []

    class Holder:
        def parameters(self) -> list[torch.nn.Parameter]:
            return params

    holder = Holder()
    tracker = MemoryTracker(holder.parameters)
    tracker.on = True
    freed: list[int] = []
    with tracker.window():
        x = torch.randn(64, 64, requires_grad=True)
        y = torch.exp(x)  # saves its own output
        weakref.finalize(y.untyped_storage(), freed.append, 1)
        torch.autograd.grad(y.sum(), x, retain_graph=True)
        del y
    assert freed == [1]


@pytest.mark.parametrize("schedule, stages", [("zb-h1", 3), ("zb-h2", 3), ("zb-v", 4)])
def test_the_solver_charges_the_seeds_the_walk_keeps(tmp_path: Path, schedule: str, stages: int) -> None:
    """[Note: weight gradients awaited]: on a compiled GPT, each stage's seeds in the
    solver's memory are the walk's per microbatch (`StageBytes.seeds`) times the W's the
    schedule holds back there."""
    from driver.options import CompileOptions
    from driver.phases import prepare
    from driver.recompute import planned
    from partitioner.predict import memory_terms
    from partitioner.solve.solve import solve, stage_costs

    pipeline_ranks = stages // (2 if schedule == "zb-v" else 1)
    p = prepare(CompileOptions(model="examples/gpt.py", out=str(tmp_path / "pkg"), analytic=True, hardware="a100",
                               quiet=True, stages=pipeline_ranks, microbatches=8, schedule=schedule))
    assignment, report = solve(p.problem, time_limit_s=0.0)
    plan = planned(p, assignment, report)
    walked = memory_terms.stage_bytes(p.traced.gm, plan, p.costs, p.loss, p.problem.optimizer_factor,
                                      *memory_terms._saved(p.traced.gm, plan, p.costs, p.values))
    charged = stage_costs(p.problem, assignment)
    counts = [p.problem.awaiting_w(k) for k in range(stages)]
    assert counts[0] == 0 and all(counts[1:])
    assert [c.seed_bytes for c in charged] == [s.seeds * n for s, n in zip(walked, counts)]
    assert all(s.seeds for s in walked[1:])


def _heavy_split(first: int) -> tuple[Any, Any, dict[str, int]]:
    """The two heavy blocks' graph, one microbatch's values (64 rows) and a split after
    the first `first` compute nodes."""
    from driver.options import CompileOptions
    from driver.phases import prepare
    from partitioner.cost.nodes import compute_nodes

    p = prepare(CompileOptions(model=HEAVY, out="unused", analytic=True, hardware="cpu", quiet=True, stages=2,
                               microbatches=4, schedule="gpipe"))
    return p.traced.gm, p.values, {n.name: int(i >= first) for i, n in enumerate(compute_nodes(p.traced.gm))}


def test_a_stage_holds_what_it_sends_and_the_message_it_receives() -> None:
    """Split after the second block's up projection (the split measured costs choose): the
    first stage keeps that projection's (64, 256) output, which none of its nodes saves,
    until its backward (the pipeline holds a stage's outputs), beside what it saves; the
    second keeps the message it received whole, the residual's rows too, since they
    are views of one buffer ([Note: what the pipeline holds per microbatch] in
    partitioner/cost/saved.py)."""
    from partitioner.cost.saved import stage_saved_bytes

    wide, narrow = 64 * 256 * 4, 64 * 16 * 4  # float32 (rows, HIDDEN) and (rows, WIDTH)
    saved = stage_saved_bytes(*_heavy_split(5), 2)
    first = narrow + 2 * wide + narrow  # the batch rows, up0 and gelu0's outputs, the residual
    assert saved[0] == first + wide, saved
    assert saved[1] == (wide + narrow) + wide + narrow, saved  # the message, gelu1's output, the residual sum


def test_the_forward_holds_what_it_makes_until_it_returns() -> None:
    """On one stage, the outputs no node saves (the second linear of each block, the
    head's logits) are alive at the forward's end: the generated forward keeps each node's
    output in a local until it returns."""
    from partitioner.cost.saved import stage_unsaved_bytes

    unsaved = stage_unsaved_bytes(*_heavy_split(9), 2)
    assert unsaved[0] == 2 * 64 * 16 * 4 + 64 * 4 * 4, unsaved


def test_a_rank_holds_the_batch_it_splits_and_reads_not() -> None:
    """Every rank splits the whole batch into microbatches, views of the caller's
    tensors: the second rank, which reads no batch input, holds the example batch's
    storage (256 rows of 16 floats) through the step; the first counts it among what it
    saves."""
    from partitioner.cost.saved import stage_batch_bytes

    assert stage_batch_bytes(*_heavy_split(4), 2, lambda k: k) == [0, 256 * 16 * 4]


def test_data_parallel_buckets_hold_a_copy_of_the_gradients() -> None:
    """With data parallelism the gradients are flattened into the all-reduce's buckets at
    the end of the backward, a second copy until the averages are written back
    (runtime/comm.GradBuckets): that, not the optimizer's temporaries, may set the peak."""
    stage = StageBytes(persistent=100, gradients=1000, held=10, backward=0)
    bucketed = StageBytes(persistent=100, gradients=1000, held=10, backward=0, reduced=1000)
    plain = rank_peaks("1f1b", 1, 2, 1, [stage], step_transient=50)
    assert plain[0] == 100 + 1000 + 50
    assert rank_peaks("1f1b", 1, 2, 1, [bucketed], step_transient=50)[0] == 100 + 2 * 1000


def test_a_package_never_exceeds_the_memory_it_was_given(tmp_path: Path) -> None:
    """The solver bounds a stage's memory by its own terms, the manifest reports the peak
    walked over the schedule: under each --memory, a compile either emits a package every
    rank of which fits by the walk (solved again with the bound lowered where the first
    split does not) or refuses, naming the ranks and the fixes; never a package that says
    it exceeds the memory it was given."""
    from partitioner.errors import InfeasiblePlanError
    from runtime.manifest import read_manifest

    emitted = 0
    for kib in range(560, 1000, 40):
        out = tmp_path / f"pkg{kib}"
        try:
            compile_example(HEAVY, out, stages=2, microbatches=4, schedule="gpipe", offload="none", hardware="cpu",
                            memory=kib << 10)
        except InfeasiblePlanError as exc:
            assert "--memory" in str(exc), exc
            continue
        predicted = read_manifest(out).predicted
        assert predicted is not None
        peaks = [stage.memory_bytes for stage in predicted.stages]  # one stage per rank
        assert max(peaks) <= kib << 10, (kib, peaks)
        emitted += 1
    assert emitted  # the largest limits fit
