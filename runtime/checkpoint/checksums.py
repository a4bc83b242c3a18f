"""A sha256 of every file of a checkpoint, written before its commit and checked at load.

[Note: checkpoint checksums]
    After every rank wrote its files, and before COMPLETE.json ([Note: checkpoint commit]),
    the coordinator writes CHECKSUMS.json beside DCP's .metadata: the sha256 of every file
    of the checkpoint (the model's, train/'s), by path inside it.  `load` checks them all
    on every process before it reads a tensor, so a flipped byte is named (file and fix)
    instead of loading wrong weights, and nothing was changed when the error is raised
    (`load_latest` can then load the previous checkpoint instead).  CHECKSUMS.json is not
    in the marker's list of files: a checkpoint written before checksums existed (without
    it) loads as before, unchecked.  Cost: every byte is read once more at save (by the
    coordinator) and at load (by every process).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import CheckpointCorruptError

__all__ = ["CHECKSUMS", "write", "check"]

CHECKSUMS = "CHECKSUMS.json"
CHUNK = 1 << 20


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def write(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Write folder/CHECKSUMS.json (synced): the sha256 of every file under `folder` but
    itself and those named in `skip`; returns them."""
    sums = {str(p.relative_to(folder)): _sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != CHECKSUMS and str(p.relative_to(folder)) not in skip}
    with open(folder / CHECKSUMS, "w") as f:
        json.dump({"algorithm": "sha256", "files": sums}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return sums


def check(folder: Path) -> int:
    """Raise CheckpointCorruptError naming the first file of `folder` whose sha256 is not
    the one saved; the number of files checked (0 for a checkpoint without CHECKSUMS.json)."""
    file = folder / CHECKSUMS
    if not file.is_file():
        return 0
    fix = (f"load the previous checkpoint (runtime.load_latest(pipe, {str(folder.parent)!r}) or `partitioner run "
           f"--resume` do so by themselves), or copy {folder} again from where it was saved")
    try:
        sums = dict(json.loads(file.read_text())["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"checkpoint {folder} is corrupt: {file} is not a list of checksums ({exc}): "
                                     f"{fix}.", file) from None
    for name, want in sums.items():
        path = folder / name
        got = _sha256(path) if path.is_file() else "missing"
        if got != want:
            raise CheckpointCorruptError(f"checkpoint {folder} is corrupt: {path} has sha256 {got[:16]}... but was "
                                         f"saved with {want[:16]}... (the file changed after the save: a disk or copy "
                                         f"error): {fix}.", path)
    return len(sums)
