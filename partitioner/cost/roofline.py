"""Pure cost formulas: the roofline, backward-pass factors and memory per stage.

- Roofline (Williams, Waterman & Patterson, "Roofline: an insightful visual performance
  model", CACM 2009): an op takes max(FLOPs / achievable FLOP/s, bytes moved / bandwidth).
- Backward costs about twice the forward in FLOPs for matmul-dominated layers (one matmul
  for the input gradient, one for the weight gradient): the `6N` FLOPs per token of
  Kaplan et al. 2020, appendix, used by nanoGPT's `estimate_mfu` and Megatron's MFU.
- The alpha-beta model of a message (Hockney 1994): time = alpha + bytes * beta.
- MFU as in PaLM (Chowdhery et al. 2022, appendix B): model FLOPs of a step over
  step time x devices x peak FLOP/s.
"""

from __future__ import annotations

__all__ = [
    "BACKWARD_FLOP_FACTOR",
    "roofline_s",
    "message_s",
    "stage_memory_bytes",
    "mfu",
    "ring_allreduce_s",
    "ring_broadcast_s",
]

#: backward FLOPs per forward FLOP for layers with weights (Kaplan et al. 2020)
BACKWARD_FLOP_FACTOR = 2.0


def roofline_s(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float, efficiency: float = 1.0) -> float:
    """Seconds for an op: compute-bound or memory-bound, whichever is slower."""
    compute = flops / (peak_flops * efficiency) if peak_flops > 0 else 0.0
    memory = bytes_moved / bandwidth if bandwidth > 0 else 0.0
    return max(compute, memory)


def message_s(nbytes: float, alpha_s: float, beta_s_per_byte: float) -> float:
    """Seconds to send one message of `nbytes` (zero bytes: no message, no latency)."""
    return alpha_s + nbytes * beta_s_per_byte if nbytes > 0 else 0.0


def stage_memory_bytes(param_bytes: int, activation_bytes: int, inflight: int, optimizer_factor: float, *,
                       recompute: bool = False, input_bytes: int = 0, kept_bytes: int = 0, working_bytes: int = 0,
                       message_bytes: int = 0, microbatches: int = 0, after_bytes: int = 0) -> int:
    """Peak bytes of a stage: weights + gradients + optimizer state + activations in flight,
    with a forward's working set (`working_bytes`) and its messages to and from other
    ranks (`message_bytes` per microbatch: the sends held until the step waits on them,
    `microbatches` of them, a receive posted ahead and the backward's output gradient);
    or, after the last backward, the weights' terms, the sends and `after_bytes` (the
    optimizer step's temporaries or dp's buckets), where more.

    With activation recomputation (Chen et al., "Training deep nets with sublinear memory
    cost", 2016; Megatron-LM's full recomputation), a microbatch in flight keeps only the
    stage's inputs (`input_bytes`), and one microbatch's activations live while its
    forward runs again in the backward.  Selective recomputation (Korthikanti et al., 2023)
    also keeps `kept_bytes` per microbatch in flight: the outputs of its matmuls.
    """
    weights = round(param_bytes * (2 + optimizer_factor))
    if recompute:
        activations = activation_bytes + (input_bytes + kept_bytes) * inflight
    else:
        activations = activation_bytes * inflight
    during = weights + activations + working_bytes + message_bytes * (microbatches + 2)
    return max(during, weights + message_bytes * microbatches + after_bytes)


def mfu(model_flops_per_step: float, step_time_s: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation (PaLM, appendix B)."""
    if step_time_s <= 0 or devices <= 0 or peak_flops <= 0:
        return 0.0
    return model_flops_per_step / (step_time_s * devices * peak_flops)


def ring_allreduce_s(nbytes: float, ranks: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """Ring all-reduce of `nbytes` over `ranks`: 2(p-1) steps of nbytes/p each (Patarasuk &
    Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * alpha_s + steps / ranks * nbytes * beta_s_per_byte


def ring_broadcast_s(nbytes: float, ranks: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """Broadcast of `nbytes` from one rank to the other `ranks - 1`, pipelined along a ring in
    small chunks (as NCCL's ring broadcast): every byte crosses each link once, so the last
    rank has it all after ranks - 1 latencies and nbytes x beta."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * alpha_s + nbytes * beta_s_per_byte
