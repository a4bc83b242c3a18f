"""The predicted step drawn: ranks x time, one bar per F, B, I or W, idle left blank.

`show DIR --timeline FILE.png` simulates the package's step again from its manifest
(`simulate` on each stage's predicted compute per microbatch, split forward 1 : backward
2 as the cost model counts FLOPs; messages free: the manifest keeps no link times, so the
chart shows the schedule's own bubble, not the links') and draws what each rank runs
when, so the bubble, and where a zero-bubble schedule moved it, can be seen.  matplotlib
draws it (the `plot` extra).  `partitioner run DIR --trace FILE --timeline FILE.png`
draws the measured last step the same way (`measured_events`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

from runtime.manifest import Manifest

from ..errors import PackageError
from .simulate import Simulation, simulate

__all__ = ["simulate_manifest", "measured_events", "draw", "COLORS"]

COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def simulate_manifest(m: Manifest) -> Simulation:
    """The package's step simulated from its manifest (see the module's docstring)."""
    if m.predicted is None:
        raise PackageError("the package has no prediction to draw: compile it again.")
    compute = [s.compute_s for s in m.predicted.stages]
    forward, backward = [c / 3 for c in compute], [2 * c / 3 for c in compute]
    links = {(e.source, s.index): 0.0 for s in m.stages for e in s.inputs if e.source != "input"}
    return simulate(forward, backward, links, m.schedule, m.mesh.pp, m.microbatches, m.virtual_stages)


def measured_events(trace: str | Path) -> tuple[list[tuple[int, float, float, str]], int]:
    """The last step's compute of a `partitioner run --trace` file (runtime/tracing.py), as
    `draw` takes it, and the number of ranks (rows: global ranks)."""
    try:
        spans = [e for e in json.loads(Path(trace).read_text())["traceEvents"]
                 if e.get("ph") == "X" and e.get("cat") in COLORS]
    except (OSError, ValueError, KeyError) as exc:
        raise PackageError(f"cannot read the trace {trace} ({exc}): run with --trace FILE again.") from None
    if not spans:
        raise PackageError(f"the trace {trace} holds no forward or backward: run with --trace FILE again.")
    last = max(e["args"]["step"] for e in spans)
    spans = [e for e in spans if e["args"]["step"] == last]
    zero = min(e["ts"] for e in spans)
    events = [(int(e["pid"]), (e["ts"] - zero) / 1e6, (e["ts"] + e["dur"] - zero) / 1e6, str(e["name"])) for e in spans]
    return events, max(r for r, *_ in events) + 1


def draw(events: Sequence[tuple[int, float, float, str]], ranks: int, path: str | Path, title: str) -> None:
    """A PNG of `events` ((rank, start s, end s, action) per compute) on `ranks` rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise PackageError("drawing the timeline needs matplotlib: pip install matplotlib "
                           "(or the project's [plot] extra).") from None
    end = max((e for _, _, e, _ in events), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * ranks))
    for rank, start, stop, label in events:
        kind = re.sub(r"\d", "", label)
        ax.broken_barh([(start * 1e3, (stop - start) * 1e3)], (rank - 0.4, 0.8), facecolors=COLORS.get(kind, "grey"),
                       edgecolor="white", linewidth=0.5)
        if (stop - start) > end / 60:
            ax.text((start + stop) / 2 * 1e3, rank, label, ha="center", va="center", fontsize=7, color="white")
    busy = sum(stop - start for _, start, stop, _ in events)
    idle = 1 - busy / (ranks * end) if end > 0 else 0.0
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("ms")
    ax.set_title(f"{title}: {end * 1e3:.3f} ms, idle {idle * 100:.1f}% (blank)")
    kinds = sorted({re.sub(r"\d", "", label) for *_, label in events})
    ax.legend(handles=[Patch(color=COLORS.get(k, "grey"), label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

