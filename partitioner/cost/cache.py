"""A small JSON cache of measurements, so recompiling the same model gives the same bytes.

Profiles are measured once per (graph, microbatch shapes, machine) and reused: without it,
timing noise would make two compiles of one file differ.  `--reprofile` measures again.
The cache lives in $PARTITIONER_CACHE, else $XDG_CACHE_HOME/partitioner, else
~/.cache/partitioner.  Writes are atomic (a temporary file renamed into place).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["directory", "get", "put"]


def directory() -> Path:
    if "PARTITIONER_CACHE" in os.environ:
        return Path(os.environ["PARTITIONER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "partitioner"


def get(key: str) -> Any | None:
    path = directory() / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def put(key: str, value: Any) -> None:
    folder = directory()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, sort_keys=True)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
