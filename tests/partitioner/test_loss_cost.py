"""The loss_fn's cost on the last stage (partitioner/cost/loss.py): measured, analytic, and
charged to the block the solver keeps last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from driver.options import CompileOptions
from driver.phases import prepare
from partitioner.cost import hardware
from partitioner.cost.hardware import load_hardware
from partitioner.cost.loss import loss_cost
from partitioner.cost.roofline import roofline_s
from partitioner.solve.problem import coarse_graph, pose
from partitioner.solve.solve import solve, stage_costs

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "tests/model_files/big_vocab_lm.py")


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def test_measured_loss_keeps_the_log_softmax_of_the_logits() -> None:
    logits = torch.randn(4, 16, 4096)
    target = torch.randint(0, 4096, (4, 16))
    cost = loss_cost(_cross_entropy, logits, target, load_hardware("a100"), True, 3)
    assert cost.forward_s > 0 and cost.backward_s > 0
    assert cost.activation_bytes >= logits.numel() * 4  # log_softmax's result, saved for backward


def test_analytic_loss_is_a_few_passes_over_the_output() -> None:
    hw = load_hardware("a100")
    logits = torch.empty(4, 16, 4096, device="meta")
    cost = loss_cost(_cross_entropy, logits, None, hw, True, 3)  # a meta output is never run
    nbytes = logits.numel() * 4
    assert cost.forward_s == pytest.approx(roofline_s(5 * logits.numel(), 3 * nbytes, hw.peak_flops,
                                                      hw.memory_bandwidth))
    assert cost.activation_bytes == nbytes


def test_the_loss_is_charged_to_the_last_stage_and_moves_work_off_it(tmp_path: Path) -> None:
    """On an a100 whose every matmul runs at one peak (a profile without per-dtype peaks, nor
    waves of tiles), so that the LM head is a small enough part of the model for two stages
    to balance."""
    raw = json.loads((hardware._PROFILES / "a100.json").read_text())
    single = tmp_path / "a100_single_peak.json"
    single.write_text(json.dumps({k: v for k, v in raw.items() if k not in ("peak_flops_fp32", "peak_flops_tf32", "sm_count")}))
    p = prepare(CompileOptions(model=MODEL, out=str(tmp_path / "out"), stages=2, analytic=True, hardware=str(single)))
    assert p.loss is not None and p.loss.activation_bytes == p.rows * 32 * 8192 * 4  # a microbatch's logits
    counts = []
    for loss in (None, p.loss):
        problem = pose(coarse_graph(p.traced, p.costs, p.sharded, loss), p.mesh, p.hardware)
        assignment, _ = solve(problem, time_limit_s=5)
        costs = stage_costs(problem, assignment)
        assert problem.block_time_s[-1] >= (loss.time_s if loss else 0.0)
        counts.append(assignment.count(1))
        if loss is not None:
            compute = [c.compute_s for c in costs]
            assert compute[1] >= loss.time_s
            assert max(c.time_s for c in costs) <= 1.05 * min(c.time_s for c in costs)
    assert counts[1] < counts[0]  # the last stage, charged the loss, takes fewer blocks
