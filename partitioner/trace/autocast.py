"""Autocast written inside a model: found while tracing, refused where dropping it would
change what the model computes ([Note: mixed precision] in runtime/precision.py).

fx runs a `with torch.autocast(...)` at trace time and keeps nothing of it in the graph, and
the stages cannot keep it either, so `recording_autocast` notes each region entered and
`refuse_autocast` turns them into one clear error.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..errors import TraceError

__all__ = ["AutocastRefused", "recording_autocast", "refuse_autocast"]


@contextlib.contextmanager
def recording_autocast() -> Iterator[list[bool]]:
    """Record each torch.autocast region entered while fx traces (fx runs the `with` at
    trace time and keeps nothing of it in the graph)."""
    regions: list[bool] = []
    cls = torch.amp.autocast_mode.autocast
    original = cls.__enter__

    def enter(self: Any) -> Any:
        regions.append(bool(self._enabled))
        return original(self)

    cls.__enter__ = enter  # type: ignore[method-assign]
    try:
        yield regions
    finally:
        cls.__enter__ = original  # type: ignore[method-assign]


class AutocastRefused(TraceError):
    """Autocast written inside the model: refused whichever tracer found it."""


def refuse_autocast(regions: tuple[bool, ...], tracer: str, precision: str) -> None:
    """Raise `AutocastRefused` for `regions` (each region's `enabled` flag) where dropping them
    would change the model: an enabled region always, a disabled one unless in fp32."""
    enabled = [e for e in regions if e]
    if not enabled and (not regions or precision == "fp32"):
        return
    what = "an enabled torch.autocast region" if enabled else "a torch.autocast(enabled=False) region"
    raise AutocastRefused(
        f"the model enters {what} inside forward() ({len(regions)} region(s) found by the {tracer} "
        f"tracer), which the traced stages cannot keep, so it would be silently dropped. Remove the autocast from "
        f"the model and compile with --precision bf16-mixed, which runs every stage under autocast"
        + ("" if enabled else f" (a region that disables autocast is allowed only with --precision fp32, "
                              f"not {precision})") + ".")
