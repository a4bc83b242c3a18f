"""Making a checkpoint visible only once it is whole, and finding and pruning complete ones.

[Note: checkpoint commit]
    A save of PATH writes into PARENT/.NAME.partial (every rank, in parallel), then, after
    a barrier (every rank has written its files and DCP's coordinator its .metadata), the
    coordinator writes CHECKSUMS.json ([Note: checkpoint checksums]), then COMPLETE.json
    (each file's size, the time, the world size), syncs it and renames the folder to PATH;
    a second barrier ends the save.  A rank killed at any point before the rename leaves PATH as it was (the previous checkpoint, or nothing) and
    a .partial folder without a marker, which `verify` refuses and `latest_checkpoint`
    skips; the next save of the same PATH clears it.  Overwriting an existing PATH moves
    it to .NAME.old first, so for an instant neither name holds it; give each save its
    own name (step-000100) to never meet that.

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
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

__all__ = ["MARKER", "partial_dir", "begin", "commit", "verify", "write_checksums", "check_checksums", "complete", "latest_checkpoint", "prune",
           "clean_partial", "is_marked"]

MARKER = "COMPLETE.json"
FORMAT = 1
Barrier = Callable[[], None]


def partial_dir(final: Path) -> Path:
    """Where a save of `final` is written until it is complete."""
    return final.parent / f".{final.name}.partial"


def begin(final: Path, coordinator: bool, barrier: Barrier) -> Path:
    """Clear and create the partial folder (coordinator), then wait for every rank."""
    tmp = partial_dir(final)
    if coordinator:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def commit(final: Path, tmp: Path, coordinator: bool, barrier: Barrier, info: dict[str, Any]) -> None:
    """After every rank wrote into `tmp`: the marker, then the rename (coordinator)."""
    barrier()
    if coordinator:
        write_checksums(tmp, skip=(MARKER,))
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*"))
                 if p.is_file() and p.name != CHECKSUMS}  # [Note: checkpoint checksums]
        marker = tmp / MARKER
        with open(marker, "w") as f:
            json.dump({"format": FORMAT, "saved_at": time.time(), **info, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = final.parent / f".{final.name}.old"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        _sync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)
    barrier()


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(path: Path) -> dict[str, Any]:
    """The marker of a complete checkpoint at `path`; raise CheckpointError naming what is
    missing, truncated or unreadable."""
    marker = path / MARKER
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a folder): give a folder written by "
                              f"save_checkpoint, or find the newest with runtime.latest_checkpoint(ROOT).")
    earlier = f"load an earlier one (runtime.latest_checkpoint({str(path.parent)!r}) finds the newest complete one)"
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {marker} is missing, so its save did not finish "
                              f"(a rank stopped during it): {earlier}.")
    try:
        info = json.loads(marker.read_text())
        files = dict(info["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt: {marker} is not a completion marker ({exc}): "
                              f"{earlier}.") from None
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupt: {file} is missing: {earlier}.")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is corrupt: {file} has {file.stat().st_size} bytes but was "
                                  f"written with {size}: {earlier}.")
    return info  # type: ignore[no-any-return]


def is_marked(path: Path) -> bool:
    """`path` holds a completion marker this project wrote (the checkpoint may be corrupt)."""
    try:
        info = json.loads((path / MARKER).read_text())
        return isinstance(info, dict) and "format" in info and "files" in info
    except (OSError, ValueError):
        return False


def _complete(root: Path) -> list[tuple[float, Path]]:
    """(saved_at, path) of every complete checkpoint directly under `root`."""
    out = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        if child.name.startswith(".") or not (child / MARKER).is_file():
            continue
        try:
            out.append((float(verify(child)["saved_at"]), child))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return sorted(out)


def complete(root: str | os.PathLike[str]) -> list[Path]:
    """Every complete checkpoint directly under `root`, newest first (as `latest_checkpoint`)."""
    return [path for _, path in reversed(_complete(Path(root)))]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directly under `root` (by the time its save
    finished), or None when there is none: the folder holds none, or does not exist yet (a
    script's first start, before its first save made it); incomplete and corrupt ones are
    skipped.  Raises CheckpointNotFoundError when `root` is a file."""
    path = Path(root)
    if not path.exists():
        return None
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint folder {str(root)!r} is a file, not a folder (from "
                                      f"{os.getcwd()}): give the folder the checkpoints were saved under (the "
                                      f"--checkpoint of the run that saved them; step-NNNNNN folders are inside it).")
    found = _complete(path)
    return found[-1][1] if found else None


def clean_partial(root: Path) -> list[Path]:
    """Remove the .NAME.partial folders under `root` (saves that did not finish: [Note:
    checkpoint commit]); the removed.  Only for a caller that knows no save is writing
    there now (`partitioner run --max-restarts` holds the folder's lock: [Note: restarts])."""
    found = sorted(p for p in root.glob(".*.partial") if p.is_dir() and not (p / MARKER).is_file()) \
        if root.is_dir() else []
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints under `root`; the removed."""
    if keep < 1:
        raise CheckpointError(f"keep={keep}: keep at least 1 checkpoint (or pass keep=None to keep all).")
    old = [p for _, p in _complete(root)[:-keep]]
    for path in old:
        shutil.rmtree(path)
    return old


# -- [Note: checkpoint checksums] --------------------------------------------------------

CHECKSUMS = "CHECKSUMS.json"
CHUNK = 1 << 20


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Write folder/CHECKSUMS.json (synced): the sha256 of every file under `folder` but
    itself and those named in `skip`; returns them."""
    sums = {str(p.relative_to(folder)): _sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != CHECKSUMS and str(p.relative_to(folder)) not in skip}
    with open(folder / CHECKSUMS, "w") as f:
        json.dump({"algorithm": "sha256", "files": sums}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return sums


def check_checksums(folder: Path) -> int:
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
