"""The unsplit model trained as a package of a given `--precision` trains it: what the
precision tests (and their multi-process workers) compare the pipeline with."""

from __future__ import annotations

from typing import Any, Callable

import torch

from runtime.precision import autocast, cast_inputs, cast_model, loss_input, masters_for


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
