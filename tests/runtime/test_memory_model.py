"""The memory model against the measured peak of every rank ([Note: the memory walk] in
partitioner/predict/memory.py, [Note: measured memory] in runtime/memory.py): each case
is compiled (analytic costs), trained one tracked step on 2 or 4 gloo ranks
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
