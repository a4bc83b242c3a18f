"""What a failed trace says: every tracer's failure, the line of the user's model file
that broke it, and the advice that fits (a data-dependent branch, a library check)."""

from __future__ import annotations

import traceback
from pathlib import Path

from .model_file import user_frame
from .state import StateUpdatedWhileTracing

__all__ = ["failure_message", "library_frame"]


def failure_message(failures: list[tuple[str, BaseException]], model_path: str) -> str:
    parts = []
    line = ""
    for name, exc in failures:
        where = user_frame(exc, model_path) if model_path else ""
        line = line or where
        first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
        limit = 1000 if isinstance(exc, StateUpdatedWhileTracing) else 300  # its fix comes last
        parts.append(f"{name}: {type(exc).__name__}: {first[:limit]}")
    data_dependent = any(
        "control flow" in str(e) or "data-dependent" in str(e).lower() or "GuardOnDataDependent" in type(e).__name__
        for _, e in failures
    )
    library = library_frame(failures[0][1], model_path) if len(failures) == 1 and failures[0][0] == "fx" else ""
    advice = (
        f"fx stopped inside library code{library}, a Python check torch.fx cannot "
        f"evaluate (BatchNorm testing `input.dim()`, say), not a branch in the model: use --tracer export "
        f"(or auto, which falls back to it)."
        if library
        else "The model's Python control flow depends on tensor values; rewrite the branch with "
        "tensor ops (torch.where, masking) or move it out of forward()."
        if data_dependent
        else "Write the update as the fx failure says (in-place ops, not through `.data`)."
        if any(isinstance(e, StateUpdatedWhileTracing) for _, e in failures)
        else "Make forward() traceable (no Python branching on tensor values, no unsupported "
        "calls), or force the other tracer with --tracer."
    )
    return (
        f"could not trace the model{line or ''}. Tried {'; '.join(parts)}. {advice}"
    )


def library_frame(exc: BaseException, model_path: str) -> str:
    """' (<file>, line N: `<source>`)' when the deepest frame of an fx failure, below fx's own
    frames, lies outside the model file (PyTorch's BatchNorm checking `input.dim()`), else ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "torch/fx/" not in f.filename.replace("\\", "/")]
    if not frames or (model_path and Path(frames[-1].filename).resolve() == Path(model_path).resolve()):
        return ""
    last = frames[-1]
    if "site-packages" not in last.filename and "/torch/" not in last.filename:
        return ""
    name = last.filename.replace("\\", "/")  # no folder of this machine ([Note: the model file's copy])
    short = name.split("site-packages/")[-1] if "site-packages/" in name else "torch/" + name.split("/torch/")[-1]
    return f" ({short}, line {last.lineno}: `{(last.line or '').strip()}`)"
