"""The unsplit model trained as a package of a given `--precision` trains it: what the
precision tests (and their multi-process workers) compare the pipeline with."""

from __future__ import annotations

from typing import Any, Callable

import torch

from runtime.precision import autocast, cast_inputs, cast_model, loss_input, masters_for

__all__ = ["NOISE_FACTOR", "UNIT_ROUNDOFF", "Original", "within_noise"]

# [Note: precision bounds]
#     A bound in the precision tests is derived from what the format guarantees, never one
#     machine's rounding.  bf16 keeps 8 significand bits (unit roundoff u = 2^-8), fp16 11
#     (2^-11); which of two neighbours a value rounds to depends on the fp32 accumulation
#     order of the kernel before it (AMX, AVX512-BF16 and AVX2 kernels block a matmul
#     differently, and a microbatch is another shape than the whole batch), so two runs of
#     the same model under the same autocast agree on the first forward to a few roundings
#     and, a few SGD steps later, differ as much as any two such runs do: each is one draw of
#     the precision's noise around fp32.  The runtime's rule (docs/precision.md) bounds the
#     pipeline by the original's own distance from fp32, the noise floor F (the largest over
#     the original's runs: whole batch, microbatches accumulated).  Two runs each within F of
#     fp32 are within 2 F of each other (triangle inequality): NOISE_FACTOR = 2 bounds the
#     pipeline against any run of the original under the same precision.  A measured F
#     itself varies from machine to machine; the factor is what keeps the bound true where
#     the pipeline's draw lands past the original's (by 1-17% on AMX machines).  An error of
#     the pipeline's own is not noise once it outgrows the rounding: a stage's hand-over off
#     by 8 u on every value moves the weights 3.5 times past the bound, a lost microbatch
#     hundreds of times (test_a_wrong_pipeline_fails_the_noise_bound).  An error of a few u
#     (1e-2 is 2.5 u of bf16) is the size of the rounding of every bf16 operation: at bf16
#     such an error is within what the precision itself promises.
NOISE_FACTOR = 2.0
#: unit roundoff of each precision's compute format (half the gap between 1 and the next value)
UNIT_ROUNDOFF = {"bf16-mixed": 2.0 ** -8, "bf16": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}


def within_noise(off: float, floor: float) -> bool:
    """Whether a distance `off` from a run of the original is within the precision's noise,
    the original's own distance `floor` from fp32 ([Note: precision bounds])."""
    return off <= NOISE_FACTOR * floor


class Original:
    """`model` run as `precision` runs it: under autocast (bf16-mixed, fp16-mixed), or in
    bfloat16 with float32 master weights (bf16: [Note: bf16 with master weights] in
    runtime/precision.py).  Call `loss` (then backward) once per microbatch between
    `begin` and `end`; the optimizer is built over `parameters()`."""

    def __init__(self, model: torch.nn.Module, precision: str) -> None:
        self.masters = masters_for(list(model.parameters()), precision)  # float32 copies, before the cast
        self.model, self.precision = cast_model(model, precision), precision

    def parameters(self) -> list[torch.nn.Parameter]:
        ps = list(self.model.parameters())
        return ps if self.masters is None else [self.masters.of(p) for p in ps]

    def begin(self) -> None:
        if self.masters is not None:
            self.masters.refresh()

    def loss(self, loss_fn: Callable[[Any, Any], torch.Tensor], inputs: tuple[Any, ...] | dict[str, Any],
             target: Any) -> torch.Tensor:
        """`loss_fn` of the model on `inputs` (positional arguments, or keywords) and `target`."""
        inputs = cast_inputs(inputs, self.precision)
        with autocast(self.precision):
            out = self.model(**inputs) if isinstance(inputs, dict) else self.model(*inputs)
            return loss_fn(loss_input(out, self.precision), target)

    def end(self) -> None:
        if self.masters is not None:
            self.masters.take_grads()

    def state_dict(self) -> dict[str, torch.Tensor]:
        held = self.model.state_dict(keep_vars=True)
        return {k: (v if self.masters is None else self.masters.of(v)).detach().clone() for k, v in held.items()}
