"""The predicted step drawn: ranks x time, one bar per F, B, I or W, idle left blank.

`show DIR --timeline FILE.png` runs the package's predicted step again on the inputs the
manifest keeps (`simulate_step` on `predicted.simulation`: [Note: one predicted step], so
its title is the step `show` prints) and draws what each pipeline rank of replica 0 runs
when, the collectives that close the step as one bar (R) on every rank, so the bubble,
and where a zero-bubble schedule moved it, can be seen.  matplotlib draws it (the `plot`
extra).  `partitioner run DIR --trace FILE --timeline FILE.png`
draws the measured last step the same way (`measured_events`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

from runtime.manifest import Manifest
from runtime.schedule import placement

from ..errors import PackageError
from .simulate import Simulation
from .step import StepInputs, simulate_step

__all__ = ["simulate_manifest", "predicted_events", "predicted_title", "rank_labels", "measured_events", "draw",
           "COLORS"]

COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", "R": "#8172b3"}


def simulate_manifest(m: Manifest) -> Simulation:
    """The package's predicted step run again on the manifest's inputs ([Note: one predicted step])."""
    kept = m.predicted.extra.get("simulation") if m.predicted is not None else None
    if not isinstance(kept, dict):
        raise PackageError("the package keeps no simulation of its step to draw (compiled by an older version, "
                           "or not by the planner): compile it again.")
    try:
        return simulate_step(StepInputs.from_dict(kept))
    except (TypeError, ValueError) as exc:
        raise PackageError(f"the package's predicted.simulation is malformed ({exc}): compile it again.") from None


def predicted_events(m: Manifest) -> list[tuple[int, float, float, str]]:
    """What `draw` takes for the predicted step: each pipeline rank's computes, and the
    collectives that close the step (the loss, tied and data-parallel all-reduces, ZeRO-1's
    broadcast) as one R bar on every rank, to the step's end."""
    sim = simulate_manifest(m)
    events = list(sim.events)
    walked = max((end for _, _, end, _ in events), default=0.0)
    if sim.step_time_s > walked:
        events += [(rank, walked, sim.step_time_s, "R") for rank in range(m.mesh.pp)]
    return events


def predicted_title(m: Manifest) -> str:
    """Which ranks the predicted timeline draws, and why those stand for all."""
    mesh, shown = m.mesh, f"{m.schedule}, {m.microbatches} microbatches, predicted"
    if mesh.dp == 1 and mesh.tp == 1:
        return f"{shown}, all {mesh.pp} ranks"
    each = f", each row a stage's {mesh.tp} tensor-parallel ranks" if mesh.tp > 1 else ""
    replicas = f"replica 0 of {mesh.dp} (every replica runs the same steps), " if mesh.dp > 1 else ""
    return f"{shown}, {replicas}{mesh.pp} pipeline ranks{each}"


def rank_labels(m: Manifest) -> list[str]:
    """Each pipeline rank's row: the global ranks of replica 0 that run it."""
    where = placement(m.schedule, len(m.stages), m.mesh.pp)
    labels = []
    for row in range(m.mesh.pp):
        ranks = sorted({r for s in m.stages if where[s.index] == row for r in s.ranks})[:m.mesh.tp]
        labels.append(f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}" if ranks else f"rank {row}")
    return labels


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


def draw(events: Sequence[tuple[int, float, float, str]], ranks: int, path: str | Path, title: str,
         step_s: float | None = None, labels: Sequence[str] | None = None) -> None:
    """A PNG of `events` ((rank, start s, end s, action) per compute) on `ranks` rows
    (named `labels`, else "rank r"); the title's step is `step_s` where given (the
    manifest's predicted step), else where the last event ends."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise PackageError("drawing the timeline needs matplotlib: pip install matplotlib "
                           "(or the project's [plot] extra).") from None
    end = step_s if step_s is not None else max((e for _, _, e, _ in events), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * ranks))
    for rank, start, stop, label in events:
        kind = re.sub(r"\d", "", label)
        ax.broken_barh([(start * 1e3, (stop - start) * 1e3)], (rank - 0.4, 0.8), facecolors=COLORS.get(kind, "grey"),
                       edgecolor="white", linewidth=0.5)
        if (stop - start) > end / 60:
            ax.text((start + stop) / 2 * 1e3, rank, label, ha="center", va="center", fontsize=7, color="white")
    busy = sum(stop - start for _, start, stop, label in events if label != "R")  # collectives are not compute
    idle = 1 - busy / (ranks * end) if end > 0 else 0.0
    ax.set_yticks(range(ranks), list(labels) if labels is not None else [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("ms")
    ax.set_title(f"{title}: {end * 1e3:.3f} ms, idle {idle * 100:.1f}% (no compute)")
    kinds = sorted({re.sub(r"\d", "", label) for *_, label in events})
    ax.legend(handles=[Patch(color=COLORS.get(k, "grey"), label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

