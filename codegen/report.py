"""The plan as a text table: what `plan.txt` holds and `partitioner show` prints.

A pure function of the manifest, so `show` on any package prints what compile wrote.
"""

from __future__ import annotations

from partitioner.trace.checkpointing import describe
from runtime.manifest import Manifest, Predicted, StagePrediction
from runtime.schedule.registry import schedule_spec

__all__ = ["format_plan", "format_bytes", "format_kept"]


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _ranks(ranks: list[int], width: int = 24) -> str:
    """The ranks listed, or when that is longer than `width`, as runs ("0-3,64-67"), or
    the first two runs and the count ("0-3,64-67,... (64 ranks)")."""
    plain = ",".join(str(r) for r in ranks)
    if len(plain) <= width:
        return plain
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    joined = ",".join(text)
    if len(joined) <= width:
        return joined
    return f"{','.join(text[:2])},... ({len(ranks)} ranks)"


def format_plan(manifest: Manifest) -> str:
    """Header lines, then one row per stage: the stage's compute and its messages per
    microbatch add up to its time (the solver's figures, with which the step is predicted),
    and where the compile timed the stages, their measured compute beside them."""
    mesh, predicted = manifest.mesh, manifest.predicted
    per_stage = predicted.stages if predicted is not None else ()
    calibration = predicted.extra.get("calibration", {}) if predicted is not None else {}
    measured = list(calibration.get("measured_compute_s", []))
    modelled = list(calibration.get("model_compute_s", []))
    peaks = list(calibration.get("measured_peak_bytes", []))  # on a GPU: one microbatch's, by the allocator
    rows: list[tuple[str, ...]] = [("stage", "ranks", "nodes", "modules", "compute", "messages", "time/mb")
                                   + (("measured",) if measured else ()) + ("memory",)
                                   + (("peak/mb",) if peaks else ()) + ("params", "send/mb", "recv/mb")]
    for s in manifest.stages:
        p = per_stage[s.index] if s.index < len(per_stage) else StagePrediction(0.0, 0)
        mods = s.modules
        shown = ",".join(mods[:3]) + ("..." if len(mods) > 3 else "")
        rows.append(
            (str(s.index), _ranks(list(s.ranks)), str(s.nodes), shown or "-", _ms(p.compute_s),
             _ms(p.time_s - p.compute_s), _ms(p.time_s))
            + ((_ms(measured[s.index]) if s.index < len(measured) else "-",) if measured else ())
            + (format_bytes(p.memory_bytes),)
            + ((format_bytes(peaks[s.index]) if s.index < len(peaks) else "-",) if peaks else ())
            + (format_bytes(p.param_bytes), format_bytes(p.send_bytes), format_bytes(p.recv_bytes))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) if i == 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    source = manifest.source
    lines = [
        f"model      {source.path} (sha256 {source.sha256[:16]}), traced with {manifest.tracer}",
        f"mesh       pp={mesh.pp} tp={mesh.tp} dp={mesh.dp}, schedule {manifest.schedule}, "
        f"{manifest.microbatches} microbatches, batch {manifest.batch_size}"
        + _recompute_note([s.recompute for s in manifest.stages])
        + (", optimizer state sharded across the replicas (ZeRO-1)" if manifest.options.get("zero") and mesh.dp > 1 else ""),
        _predicted_line(predicted),
        _MEMORY_LINE,
    ]
    checkpointing = _checkpointing_line(manifest)
    if checkpointing:
        lines.append(checkpointing)
    for saving in (_recompute_line(manifest), _offload_line(manifest)):
        if saving:
            lines.append(saving)
    solver = predicted.solver if predicted is not None else {}
    if solver:
        lines.append(
            f"solver     {solver.get('method', '?')}: slowest {_paced(manifest)} "
            f"{solver.get('objective_s', 0.0) * 1e3:.3f} ms, "
            f"proved bound {solver.get('lower_bound_s', 0.0) * 1e3:.3f} ms (gap {solver.get('gap', 0.0) * 100:.1f}% "
            f"against the cost model), "
            f"{solver.get('blocks', 0)} blocks from {solver.get('nodes', 0)} nodes"
        )
    if measured and modelled:
        slow_m, slow_c = max(modelled), max(measured)
        lines.append(
            f"measured   each stage timed as its rank runs it: slowest {slow_c * 1e3:.3f} ms against the model's "
            f"{slow_m * 1e3:.3f} ms ({(slow_c / slow_m - 1) * 100 if slow_m else 0.0:+.0f}%)"
            + ("; solved again with the measured times" if calibration.get("resolved") else "")
        )
    tensor = manifest.tensor_parallel
    if tensor:
        rules: dict[str, int] = {}
        for rule in tensor.get("rules", {}).values():
            family = rule.split(".")[0]
            if family in ("linear", "embedding", "attention", "matmul"):
                rules[rule] = rules.get(rule, 0) + 1
        shown_rules = ", ".join(f"{k} x{v}" for k, v in sorted(rules.items())) or "nothing split (replicated)"
        calls = ", ".join(f"{k} x{v}" for k, v in tensor.get("collectives", {}).items()) or "none"
        lines.append(f"tensor     x{tensor.get('degree')}: {shown_rules}; collectives per microbatch: {calls}")
    candidates = predicted.extra.get("candidates", []) if predicted is not None else []
    if candidates:
        lines_c = ["", "meshes searched (best first):"]
        for c in candidates:
            lines_c.append(
                f"  pp={c['pp']:<3} dp={c['dp']:<3} tp={c['tp']:<2} microbatches={c['microbatches']:<4} "
                f"step {c['step_time_s'] * 1e3:9.3f} ms  MFU {c['mfu'] * 100:5.2f}%  peak {format_bytes(c['memory_bytes'])}"
                + (f"  {c['schedule']}" if c.get("schedule") else "") + ("  recompute" if c.get("recompute") else "")
                + ("  zero-1" if c.get("zero") else "")
                + ("  offload" if c.get("offload") else "")
            )
        table = table + lines_c
    return "\n".join(lines + [""] + table) + "\n"


def _recompute_note(policies: list[str | None]) -> str:
    """The mesh line's note on recomputation: nothing where no stage recomputes, as before
    where all recompute in full, else each stage's policy in stage order."""
    if not any(policies):
        return ""
    if all(p == "full" for p in policies):
        return ", activations recomputed"
    return ", recomputation by stage: " + ", ".join(p or "none" for p in policies)


#: what the memory column counts and what it cannot ([Note: the memory walk] in partitioner/predict/memory.py)
_MEMORY_LINE = ("memory     each rank's peak walked over its schedule (stages on one rank sum to it); not predicted: "
                "an operator's own workspace, a GPU allocator's caching and fragmentation, NCCL buffers")


def _checkpointing_line(manifest: Manifest) -> str:
    """What became of the model's own gradient checkpointing ([Note: the user's checkpointing]
    in partitioner/trace/checkpointing.py), or '' when it has none."""
    regions = tuple(manifest.options.get("checkpointing", ()))
    if not regions:
        return ""
    shown = describe(regions)
    kept = ("kept as the plan's recomputation (every stage runs its forward again in backward)"
            if any(s.recompute for s in manifest.stages) else
            "replaced by the planner's recompute choice: activations kept (--recompute to recompute them)")
    return f"checkpoint the model's gradient checkpointing ({shown}) is traced as the ops it runs and {kept}"


def _recompute_line(manifest: Manifest) -> str:
    """Per stage that recomputes, its policy and the device bytes that saves against keeping
    every activation (the manifest's `predicted.recompute`; an older package's without
    them), or ''."""
    if not any(s.recompute for s in manifest.stages):
        return ""
    saved = {e["stage"]: e["saved_bytes"] for e in (manifest.predicted.extra.get("recompute", [])
                                                    if manifest.predicted is not None else [])}
    parts = [f"stage {s.index} {s.recompute}" + (_less(saved[s.index]) if s.index in saved else "")
             for s in manifest.stages if s.recompute]
    return f"recompute  activations run again in backward instead of kept: {', '.join(parts)}"


def _less(saved: int) -> str:
    """' (1.2 MiB less)', or ' (6.0 KiB more)' where a policy's second forward outweighs
    what it frees (a last stage that holds one microbatch)."""
    return f" ({format_bytes(abs(saved))} {'less' if saved >= 0 else 'more'})"


def _offload_line(manifest: Manifest) -> str:
    """Per stage, the share of its saved activations offloaded to the host and the device
    bytes that saves ([Note: offloaded activations] in partitioner/solve/offload.py), or ''."""
    if not any(s.offload for s in manifest.stages):
        return ""
    saved = {e["stage"]: e["saved_bytes"] for e in (manifest.predicted.extra.get("offload", [])
                                                    if manifest.predicted is not None else [])}
    parts = [f"stage {s.index} {s.offload * 100:.0f}%" + (f" ({format_bytes(saved[s.index])} less)" if s.index in saved else "")
             for s in manifest.stages if s.offload]
    return f"offload    activations saved for backward moved to the host after each forward: {', '.join(parts)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _predicted_line(predicted: Predicted | None) -> str:
    if predicted is None:
        return "predicted  step 0.000 ms, MFU 0.00%, costs ? on ?"
    return (f"predicted  step {predicted.step_time_s * 1e3:.3f} ms, MFU {predicted.mfu * 100:.2f}%"
            f"{_of_peak(predicted)}, costs {predicted.cost_source or '?'} on {predicted.hardware or '?'}")


def _of_peak(predicted: Predicted) -> str:
    """' of the fp32 peak (19.5 TFLOP/s)': which peak the MFU is quoted against ([Note: a
    peak per dtype] in partitioner/cost/hardware.py), or '' for a package that does not say."""
    name, flops = predicted.extra.get("mfu_peak"), predicted.extra.get("mfu_peak_flops")
    if not isinstance(name, str) or not isinstance(flops, (int, float)):
        return ""
    return f" of the {name} peak ({flops / 1e12:.4g} TFLOP/s)"


def format_kept(stage_sources: list[str]) -> str:
    """The modules kept whole (partitioner.trace.kept) and why, one line each, read from the
    `# kept whole: <the line that broke tracing>` comments of the stage sources ('' if none)."""
    lines = []
    for k, source in enumerate(stage_sources):
        for line in source.splitlines():
            if "= kept_module(__file__, " in line and "# kept whole: " in line:
                path = line.split("kept_module(__file__, ", 1)[1].split(")", 1)[0].strip("'\"")
                lines.append(f"  {path} (stage {k}): {line.split('# kept whole: ', 1)[1]}")
    if not lines:
        return ""
    return "\nkept whole (not traceable; placed whole, run as written, never tensor-split):\n" + "\n".join(lines) + "\n"


def _paced(manifest: Manifest) -> str:
    """What the solver's objective times ([Note: what the schedule runs] in
    partitioner/solve/model.py): a stage, a rank of several, or interleaved's virtual stage."""
    if manifest.virtual_stages == 1:
        return "stage"
    return "rank" if schedule_spec(manifest.schedule).vee else "virtual stage"
