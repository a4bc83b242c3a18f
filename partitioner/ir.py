"""The plain-data IR that every package shares.

This module imports nothing of ours but the runtime's schedule registry
(runtime/schedule/registry.py, which loads the schedule IR alone: [Note: lazy runtime] in
runtime/__init__.py), so the runtime can read a plan on a rank that has neither OR-Tools
nor the solver installed.  A `Plan` names graph nodes by their fx names and holds
no `fx.Node`: plain data that codegen writes into the package (manifest.json, plan.txt).

[Note: stage boundaries]
    Stages are numbered 0..S-1 in pipeline order.  Data only flows forward: for every
    graph edge u -> v, stage(u) <= stage(v).  A value that crosses from stage a to a
    later stage b is sent directly from a to b (never relayed through the stages in
    between), and its gradient is sent back from b to a.  Model inputs are never sent:
    every rank holds the whole batch and each stage reads the inputs it consumes
    itself.  The graph's output node always lies in the last stage, so the last stage
    returns the model's whole output, on which the loss is computed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from runtime.schedule.registry import DEFAULT_SCHEDULE, SCHEDULES, ScheduleSpec, schedule_spec

__all__ = ["PARTIAL", "REPLICATED", "BlockCost", "Edge", "GraphNode", "Layout", "NodeCost", "Plan", "PartitionProblem",
           "SolverReport", "StagePlan", "SCHEDULES", "DEFAULT_SCHEDULE", "ScheduleSpec", "schedule_spec",
           "optimizer_state_factor", "OFFLOAD_RESIDENT"]

# SCHEDULES (imported above): the pipeline schedules the runtime can interpret.

#: microbatches whose activations an offloading stage still holds on the device: the one
#: being copied out after its forward and the one brought back ahead of its backward
OFFLOAD_RESIDENT = 2


def optimizer_state_factor(optimizer: str, mixed_precision: bool = False) -> int:
    """Bytes of optimizer state per byte of parameter (Adam keeps m and v; SGD none).

    With 16-bit parameters (`mixed_precision`), the optimizer state is float32, as mixed
    precision training keeps it (Micikevicius et al. 2018; ZeRO's accounting, Rajbhandari
    et al. 2020, section 3.1): a float32 master copy of the weights (2 bytes per 16-bit
    parameter byte) and float32 moments (Adam: 4), so 16-bit weights and gradients plus
    the state make ZeRO's 16 bytes per parameter for Adam.
    """
    factors = {"adam": 2, "adamw": 2, "sgd": 0, "momentum": 1}
    if mixed_precision:
        return 2 + 2 * factors[optimizer]
    return factors[optimizer]


@dataclass(frozen=True, order=True)
class Layout:
    """How a tensor lies across the ranks of a tensor-parallel group.

    `dim is None`: replicated, every rank holds the whole tensor, or with `partial` a
    partial sum, every rank a tensor of the whole shape whose sum over the ranks is the
    value (a row-split linear's output before its all_reduce).  Otherwise sharded:
    dimension `dim` is cut into `tp` equal pieces, rank t holding piece t.  With
    `blocks = b > 1` the dimension is first seen as b equal blocks and each block is cut
    so (a fused q/k/v projection: rank t holds piece t of q, of k and of v).
    """

    dim: int | None = None
    blocks: int = 1
    partial: bool = False

    @property
    def replicated(self) -> bool:
        return self.dim is None and not self.partial

    def local_shape(self, shape: tuple[int, ...] | list[int], tp: int) -> tuple[int, ...]:
        """The shape one rank holds of a tensor of global `shape`."""
        out = list(shape)
        if self.dim is not None:
            out[self.dim] //= tp
        return tuple(out)

    def __str__(self) -> str:
        if self.dim is None:
            return "P" if self.partial else "R"
        return f"S{self.dim}" + (f"x{self.blocks}" if self.blocks > 1 else "")


#: the layout of a tensor every rank holds whole
REPLICATED = Layout()
#: the layout of a partial sum: the value is the sum of every rank's tensor
PARTIAL = Layout(partial=True)


@dataclass(frozen=True)
class NodeCost:
    """What one fx node costs, for one microbatch, on the machine it was measured on.

    Times are seconds; memory is bytes.  `activation_bytes` counts the tensors autograd
    saves for backward that are not parameters (measured with saved_tensors_hooks or,
    analytically, estimated from the op); `output_bytes` is the size of the node's result,
    which is what a stage boundary after this node would send.  `weight_fraction` is the
    part of `backward_s` that is the weights' gradient (what a zero-bubble schedule's W
    runs; the rest is I's: [Note: split backward] in runtime/stage.py): 0 for a node
    without parameters, 1 for one whose only differentiable inputs are parameters.
    `peak_bytes` is the allocator's peak over the node's forward and backward run alone
    (output, saved tensors, gradients, the op's workspace), where the device counts it
    (measured on CUDA: cost/timer.py); None elsewhere.
    """

    name: str
    forward_s: float = 0.0
    backward_s: float = 0.0
    flops: int = 0
    param_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    weight_fraction: float = 0.0
    peak_bytes: int | None = None

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def weight_s(self) -> float:
        """The seconds of backward that compute the weights' gradient (W)."""
        return self.backward_s * self.weight_fraction


@dataclass(frozen=True)
class GraphNode:
    """One compute node of the traced graph, as the coarsener sees it (topological order).

    Graph inputs and get_attr (parameter) nodes are not GraphNodes: `inputs` names other
    GraphNodes only, and `params` the original names of the parameters the node reads.
    A node whose value is not a tensor (`tensor_output=False`, e.g. the tuple of
    torch.split) stays in one block with all its consumers; the node with
    `is_output=True` feeds the graph's output and lies in the last stage.
    """

    name: str
    inputs: tuple[str, ...]
    cost: NodeCost
    module: str
    params: tuple[str, ...]
    tensor_output: bool = True
    is_output: bool = False
    #: works on the data, not only a view or a buffer's update ([Note: every stage computes] in solve/solve.py)
    computes: bool = True
    #: the buffers written in place that it reads or writes: nodes that share one stay in
    #: one block ([Note: a mutated buffer lives on one stage] in trace/buffers.py)
    mutated: tuple[str, ...] = ()
    #: selective recomputation keeps its output, and runs it again otherwise ([Note:
    #: recomputation policies] in runtime/recompute.py)
    saved: bool = True


@dataclass(frozen=True)
class BlockCost:
    """A block of the coarsened graph: a contiguous run of nodes in topological order.

    `param_bytes` counts each parameter once per block, even if several of the block's
    nodes read it (tied parameters are charged to every block that reads them; a plan
    that puts two such blocks on one stage charges them once: see `PartitionProblem`).
    """

    name: str
    nodes: tuple[str, ...]
    time_s: float
    param_bytes: int
    activation_bytes: int
    flops: int = 0
    params: tuple[str, ...] = ()
    forward_s: float = 0.0  # the forward part of time_s (what recomputation repeats)
    computes: bool = True  # one of its nodes computes (`GraphNode.computes`)
    kept_bytes: int = 0  # the outputs selective recomputation keeps per microbatch (`GraphNode.saved`)
    recomputed_s: float = 0.0  # the forward that selective recomputation runs again
    seed_bytes: int = 0  # its weighted ops' outputs: their gradients, kept from a split backward's I to W


@dataclass(frozen=True)
class Edge:
    """A value produced by block `src` and read by block `dst` (src < dst)."""

    src: int
    dst: int
    value: str
    bytes: int


@dataclass(frozen=True)
class PartitionProblem:
    """The stage-assignment problem as arrays: the solver's whole input.

    Blocks are numbered in a topological order.  A solution assigns each block a stage
    in [0, stages) with stage(src) <= stage(dst) for every edge.

    Stage time:
        sum of block times
        + comm_alpha_s * (messages) + comm_beta_s_per_byte * (bytes)
    where a stage exchanges one message with each other stage it sends values to or
    receives values from, carrying all of them, and a value goes once to each later
    stage that reads it ([Note: the cost of a boundary] in cost/costmodel.py); two
    stages on the same pipeline rank (`placement`) hand their values over in memory, for
    free.  Forward activations and backward gradients both travel, so bytes count twice
    and messages twice.  `comm_alpha_s` is what one message costs each end's own time
    (`predict.stage_message_s`: on gloo, where receives are posted ahead, posting it).

    Stage memory:
        param_bytes * (1 + 1 + optimizer_factor)   weights, gradients, optimizer state
        + activation_bytes * inflight(stage)       microbatches whose activations are kept
    with inflight(k) = microbatches for GPipe and min(stages - k, microbatches) for 1F1B,
    each schedule's own in its spec ([Note: activations in flight] in
    runtime/schedule/registry.py).  Where the backward is split (zb-h1, zb-h2, zb-v),
    a stage past the first also keeps its seeds from each I to its W:
        + seed_bytes * awaiting_w(stage)           gradients of its weighted ops' outputs
    ([Note: weight gradients awaited] in runtime/schedule/registry.py).
    Beside these, what the walk of the schedule counts ([Note: the memory walk] in
    partitioner/predict/memory.py) and a stage's own terms can carry:
        + working_bytes                            a forward's working set, until it returns
        + message_bytes * (microbatches + 2)       the sends, held until the step waits on
                                                   them, a receive posted ahead and the
                                                   backward's output gradient
    where message_bytes is what the stage receives from other ranks per microbatch and
    each value it sends them once (with `holds_messages`; `problem.pose` sets it; the
    walk counts a value sent to two stages twice).  After the last backward, with every
    activation freed, a stage holds instead
        param_bytes * (2 + optimizer_factor) + message_bytes * microbatches
        + max(step_bytes, param_bytes if buckets)  the optimizer step's temporaries, dp's buckets
    and its memory is the larger of the two.
    With `recompute` (activation recomputation: a stage keeps only its inputs per
    microbatch in flight and runs its forward again in the backward), the activations
    term is instead
        + activation_bytes                         one microbatch's, during its backward
        + received bytes * inflight(stage)          the values it receives from earlier stages
    and `block_time_s` already includes the forward run again (see `build_problem`).
    Selective recomputation adds `block_kept_bytes` * inflight(stage), the outputs of
    the matmuls kept per microbatch in flight; its `block_activation_bytes` are the rest,
    what one microbatch's backward rebuilds; and its `block_time_s` includes only the
    forward of the other ops again ([Note: recomputation policies] in runtime/recompute.py).

    A pipeline RANK runs its stages one after another and holds them all: `virtual_stages`
    stages each (the interleaved schedule's, 2 for zb-v's V; 1 otherwise), so `stages` is
    always ranks x virtual_stages.  Its time is the sum of its stages' times, and that of
    the slowest rank is what the solver minimises; its memory is the sum of its stages'
    (a parameter that several of them read held once: the runtime shares it), which must
    not exceed `memory_limit_bytes`.  Among plans with the same slowest rank, the solver
    prefers the least sum of the ranks' excess over the mean compute, then the fewest bytes
    sent between ranks; no stage is left without compute (a block of `block_computes`;
    without it, a block of positive time) while the blocks can fill them all.
    """

    block_time_s: tuple[float, ...]
    block_param_bytes: tuple[int, ...]
    block_activation_bytes: tuple[int, ...]
    edges: tuple[Edge, ...]
    stages: int
    microbatches: int
    schedule: str = DEFAULT_SCHEDULE
    memory_limit_bytes: int | None = None
    optimizer_factor: float = 2  # per byte of parameter; 1/dp of it with ZeRO-1 (problem.pose)
    comm_alpha_s: float = 0.0
    comm_beta_s_per_byte: float = 0.0
    block_names: tuple[str, ...] = ()
    #: parameter names read by each block, to charge a tied parameter once per rank
    block_params: tuple[tuple[str, ...], ...] = ()
    param_bytes_by_name: tuple[tuple[str, int], ...] = ()
    #: stages per rank; `stages` is always ranks x virtual_stages
    virtual_stages: int = 1
    #: activation recomputation (see the memory model above)
    recompute: bool = False
    #: with `recompute`, what each block keeps per microbatch in flight: selective
    #: recomputation; empty: full
    block_kept_bytes: tuple[int, ...] = ()
    #: activation offloading: a stage holds `resident(k)` microbatches' activations, not
    #: inflight(k) ([Note: offloaded activations] in partitioner/solve/offload.py)
    offload: bool = False
    #: whether each block computes ([Note: every stage computes] in solve/solve.py); empty:
    #: those of positive time do
    block_computes: tuple[bool, ...] = ()
    #: the gradients of each block's weighted ops' outputs, kept from I to W per microbatch
    #: where the backward is split (see the memory model above); empty: none
    block_seed_bytes: tuple[int, ...] = ()
    #: a forward's working set, what it makes and does not keep until it returns: at least
    #: the graph's largest node output, on every stage (see the memory model above)
    working_bytes: int = 0
    #: the optimizer step's temporaries (the largest parameter twice), after the last backward
    step_bytes: int = 0
    #: data parallelism: after the last backward a stage's gradients are alive twice, beside
    #: their copy in the all-reduce's buckets
    buckets: bool = False
    #: whether a stage holds its messages to and from other ranks (see the memory model
    #: above): what the runtime does; off, a problem's memory is its blocks' alone
    holds_messages: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.block_time_s)

    @property
    def policy(self) -> str | None:
        """The recomputation policy every stage follows: "full", "selective" or None."""
        return ("selective" if self.block_kept_bytes else "full") if self.recompute else None

    @property
    def ranks(self) -> int:
        """Pipeline ranks: `virtual_stages` stages each."""
        return max(1, self.stages // self.virtual_stages)

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's spec in the registry (runtime/schedule/registry.py)."""
        return schedule_spec(self.schedule)

    @property
    def placement(self) -> tuple[int, ...]:
        """The rank of each stage: s % ranks, or a V under zb-v ([Note: V placement] in
        runtime/schedule/registry.py)."""
        return self.spec.placement(self.stages, self.ranks)

    def inflight(self, stage: int) -> int:
        """Microbatches whose activations stage `stage` holds at its peak ([Note: activations
        in flight] in runtime/schedule/registry.py)."""
        return self._inflight[stage]

    @functools.cached_property
    def _inflight(self) -> tuple[int, ...]:
        return self.spec.inflights(self.ranks, self.stages, self.microbatches)

    def awaiting_w(self, stage: int) -> int:
        """Microbatches whose seeds stage `stage` holds at its most: past I, not yet W
        ([Note: weight gradients awaited] in runtime/schedule/registry.py); none on the
        first stage (its I does nothing, its W runs the whole backward) or recomputing."""
        return self._awaiting_w[stage]

    @functools.cached_property
    def _awaiting_w(self) -> tuple[int, ...]:
        if self.recompute or not self.block_seed_bytes:
            return (0,) * self.stages
        ranks = self.stages // (self.spec.stages_per_rank or self.virtual_stages)  # the schedule's, held 1 per rank too
        return (0, *self.spec.awaiting_w(ranks, self.stages, self.microbatches)[1:])

    def resident(self, stage: int) -> int:
        """Microbatches whose activations stage `stage` holds on the device at its peak:
        `inflight`, or with offloading at most the `OFFLOAD_RESIDENT` being copied
        ([Note: offloaded activations] in partitioner/solve/offload.py)."""
        held = self.inflight(stage)
        return min(held, OFFLOAD_RESIDENT) if self.offload and not self.recompute else held


@dataclass(frozen=True)
class SolverReport:
    """How the plan was found: method, objective, the bound CP-SAT proved, and timing."""

    method: str
    objective_s: float
    lower_bound_s: float
    wall_s: float
    status: str = ""
    blocks: int = 0
    nodes: int = 0

    @property
    def gap(self) -> float:
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.lower_bound_s) / self.objective_s)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage of a plan: its nodes by fx name and its predicted cost."""

    index: int
    nodes: tuple[str, ...]
    time_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: int = 0
    param_bytes: int = 0
    activation_bytes: int = 0
    send_bytes: int = 0
    recv_bytes: int = 0
    #: "full" | "selective" | None ([Note: recomputation policies] in runtime/recompute.py)
    recompute: str | None = None


@dataclass(frozen=True)
class Plan:
    """A whole plan: stages, mesh, schedule and what the solver said about it."""

    stages: tuple[StagePlan, ...]
    schedule: str
    microbatches: int
    pp: int
    tp: int = 1
    dp: int = 1
    virtual_stages: int = 1
    report: SolverReport | None = None
    recompute: bool = False  # every stage runs its forward again in backward (else each stage's own policy)
    #: the fraction of each stage's saved activations offloaded to the host (empty: none)
    offload: tuple[float, ...] = ()
    zero: int = 0  # 1: optimizer state sharded across the dp replicas ([Note: ZeRO-1] in runtime/optim.py)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def policy(self, stage: int) -> str | None:
        """Stage `stage`'s recomputation policy: "full" (every stage's, with `recompute`),
        "selective" or None."""
        return "full" if self.recompute else self.stages[stage].recompute

    @property
    def recomputes(self) -> bool:
        """Whether any stage recomputes."""
        return any(self.policy(k) for k in range(self.num_stages))

    def stage_of(self) -> dict[str, int]:
        """fx node name -> stage index."""
        return {n: s.index for s in self.stages for n in s.nodes}

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's spec in the registry (runtime/schedule/registry.py)."""
        return schedule_spec(self.schedule)

    def rank_of(self, stage: int) -> int:
        """The pipeline position that runs `stage`: s % pp, or a V under zb-v ([Note: V
        placement] in runtime/schedule/registry.py)."""
        return self._placement[stage]

    @functools.cached_property
    def _placement(self) -> tuple[int, ...]:
        return self.spec.placement(self.num_stages, self.pp)
