"""Tensor parallelism chosen by a solver: split rules, the choice, the rewrite.

    shard(gm, costs, tp, hardware) -> Sharded
      1. pose     one variable per value, the strategies its split rule allows   (pose.py)
      2. choose   the cheapest strategy per value: CP-SAT, warm-started replicated (choose.py)
      3. rewrite  the graph one rank runs: shards, collectives, local shapes, costs (rewrite.py;
                  what a split node saves: saved.py)

Rules live in a registry (`rules.py`); the built-in ones are in `layers.py` (linear,
embedding, attention) and `shapes.py` (elementwise, views, splits, norms).  Register your
own with `@split_rule(target)`.
"""

from __future__ import annotations

import torch.fx

from ..cost.hardware import Hardware
from ..ir import REPLICATED, Layout, NodeCost
from .choose import brute_force, choose
from .problem import CopyCost, EdgeCost, ShardingProblem, ShardingReport, sharding_cost
from .pose import Posed, collective_s, pose_sharding
from .rewrite import Sharded, rewrite
from .rules import SplitContext, Strategy, replicate, rule_for, split_rule

__all__ = [
    "CopyCost",
    "EdgeCost",
    "Layout",
    "REPLICATED",
    "Posed",
    "Sharded",
    "ShardingProblem",
    "ShardingReport",
    "SplitContext",
    "Strategy",
    "brute_force",
    "choose",
    "collective_s",
    "sharding_cost",
    "pose_sharding",
    "replicate",
    "rewrite",
    "rule_for",
    "shard",
    "split_rule",
]


def shard(gm: torch.fx.GraphModule, costs: dict[str, NodeCost], tp: int, hardware: Hardware,
          time_limit_s: float = 10.0) -> Sharded:
    """The graph one of `tp` ranks runs, with the split the solver finds cheapest."""
    posed = pose_sharding(gm, costs, tp, hardware)
    choice, report = choose(posed.problem, time_limit_s)
    sharded = rewrite(gm, posed, choice, costs, tp, hardware)
    sharded.report = report
    return sharded
