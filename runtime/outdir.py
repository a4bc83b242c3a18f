"""The folder a command writes its output into: `compile --out`, `parallelize(out=)`,
`export --out` (docs/command-line.md).

[Note: output folders]
    A command writes into a folder that is new, empty, or an earlier output of its own,
    which is then replaced whole; a folder holding anything else is refused (the caller
    names the fix: another folder, or --force) and, forced, gets the new files beside what
    it holds: no file the command did not write is ever deleted or overwritten.  An earlier
    output is recognised by what it says it wrote (`Owned`: a package by its manifest.json,
    an export by its stamp file), never by its names alone.  Python's `__pycache__` counts
    as the output's where it holds only the bytecode of the output's own modules.

    The files are produced in a temporary folder, then moved in: beside the folder and
    renamed over it where it holds nothing but an earlier output (a failure leaves the old
    one as it was); inside it, file by file, where it holds other files or is (or holds) the
    working directory, which is never renamed away.  There `last` (the file that marks the
    output whole, e.g. manifest.json) is removed first and moved in last, and the earlier
    output's files the new one lacks are removed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["Owned", "in_the_way", "listing", "plain", "refusal", "write"]

#: the names an earlier output in a folder wrote (plain file names), or None when it holds none
Owned = Callable[[Path], set[str] | None]
#: the prefix of the temporary folder a write inside an existing folder uses
_TMP = ".partitioner-tmp-"
_PYC = re.compile(r"(?P<stem>[^.]+)\.[^.]+(?:\.opt-\d)?\.pyc")


def plain(name: str) -> bool:
    """A file name without a folder in it (what a manifest or stamp may list)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


def _owned(folder: Path, owned: Owned) -> set[str]:
    """The entries of `folder` an earlier output wrote, its __pycache__ and our own
    leftover temporary folders included."""
    names = {n for n in (owned(folder) or set()) if plain(n)}
    cache = folder / "__pycache__"
    if names and cache.is_dir():
        stems = {n[:-3] for n in names if n.endswith(".py")}
        pycs = [_PYC.fullmatch(p.name) for p in cache.iterdir()]
        if all(m is not None and m.group("stem") in stems for m in pycs):
            names.add("__pycache__")
    return names | {p.name for p in folder.glob(f"{_TMP}*") if p.is_dir()}


def in_the_way(folder: Path, owned: Owned, force: bool, writes: set[str] | None = None) -> list[str]:
    """The entries of `folder` that stop a write: without `force`, everything an earlier
    output did not write; with it, those of them the write would overwrite (`writes`: the
    names it writes, None when not known yet).  [] for a folder that does not exist."""
    if not folder.is_dir():
        return [folder.name] if folder.exists() else []
    stray = sorted(set(os.listdir(folder)) - _owned(folder, owned))
    if not force:
        return stray
    return sorted(set(stray) & (writes or set()))


def listing(names: list[str], most: int = 5) -> str:
    """`names` for a message: the first `most`, and how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def refusal(where: str, blocking: list[str], force: bool, *, output: str, writer: str, flag: str) -> str:
    """The error of an out folder `where` whose `blocking` entries (`in_the_way`) stop a
    write of an `output` (a package, an export) by `writer` (the compiler, export); `flag`:
    how the caller forces."""
    shown = listing(blocking)
    if force:
        return (f"{where} holds {shown}, which the {output} would overwrite, and {writer} did not write them: move "
                f"them away, or give another folder.")
    return (f"{where} holds files that are not an earlier {output} ({shown}), and {writer} never deletes what it "
            f"did not write: give a new or empty folder (or one holding an earlier {output}, which is replaced "
            f"whole), or pass {flag} to write the {output}'s files beside them.")


def write(folder: Path, produce: Callable[[Path], None], owned: Owned, *, force: bool, last: str) -> None:
    """Write an output into `folder`: `produce(tmp)` writes its files into an empty folder,
    then they are moved in ([Note: output folders]).  Raises FileExistsError (naming the
    entries) when `in_the_way` finds any; the callers check first, with their own words."""
    folder = Path(folder).resolve()
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} is a file, not a folder")
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        _swap(folder, produce)
        return
    earlier = _owned(folder, owned)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP, dir=folder))
    try:
        produce(tmp)
        writes = {p.name for p in tmp.iterdir()}
        blocking = in_the_way(folder, owned, force, writes)
        if blocking:
            raise FileExistsError(f"{folder} holds {', '.join(blocking)}, which an output here would delete or "
                                  f"overwrite")
        cwd = Path.cwd().resolve()
        stray = set(os.listdir(folder)) - earlier - {tmp.name}
        if not stray and cwd != folder and folder not in cwd.parents:
            _replace_whole(folder, tmp)
        else:
            _move_in(folder, tmp, earlier, last)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap(folder: Path, produce: Callable[[Path], None]) -> None:
    """A new folder: produced beside it and renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        produce(tmp)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_whole(folder: Path, tmp: Path) -> None:
    """A folder holding only an earlier output (or nothing): the new one renamed over it."""
    fresh = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    os.rmdir(fresh)
    os.replace(tmp, fresh)
    old = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(folder, old)
    os.replace(fresh, folder)
    shutil.rmtree(old, ignore_errors=True)


def _move_in(folder: Path, tmp: Path, earlier: set[str], last: str) -> None:
    """File by file into a folder that holds other files too (or the working directory):
    `last` out first and in last; the earlier output's files the new one lacks removed."""
    names = sorted(p.name for p in tmp.iterdir())
    if last in earlier:
        (folder / last).unlink(missing_ok=True)
    for name in names:
        if name != last:
            _remove(folder / name)
            os.replace(tmp / name, folder / name)
    for name in sorted(earlier - set(names) - {last, tmp.name}):
        _remove(folder / name)
    _drop_bytecode(folder / "__pycache__", {n[:-3] for n in [*names, *earlier] if n.endswith(".py")})
    if last in names:
        os.replace(tmp / last, folder / last)


def _drop_bytecode(cache: Path, stems: set[str]) -> None:
    """The bytecode of the modules just written or removed, in a __pycache__ that holds
    other modules' too (never theirs)."""
    for path in sorted(cache.iterdir()) if cache.is_dir() else []:
        found = _PYC.fullmatch(path.name)
        if found is not None and found.group("stem") in stems and path.is_file():
            path.unlink()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
