"""The package's copy of its model file and of the modules of the model file's folder that
it imports ([Note: the model file's copy] in runtime/manifest.py)."""

from __future__ import annotations

import re

from runtime.manifest import MODEL_COPY

__all__ = ["model_copies"]

#: file names the package writes itself: a module of the model's folder so named is not copied
_GENERATED = re.compile(r"stage_\d+\.py|__init__\.py|" + re.escape(MODEL_COPY))


def model_copies(text: bytes, modules: dict[str, bytes]) -> dict[str, bytes]:
    """file name in the package -> bytes: the model file as MODEL_COPY, and each module of its
    folder beside it under its own name, unless the package writes a file of that name (then
    it is found on sys.path when the package loads, as any other import)."""
    beside = {name: data for name, data in sorted(modules.items()) if not _GENERATED.fullmatch(name)}
    return {MODEL_COPY: text} | beside
