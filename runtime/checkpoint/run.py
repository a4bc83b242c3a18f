"""What `partitioner run --checkpoint DIR --save-every K --resume --init --load PATH
--max-restarts R --overwrite` does on each rank (runtime/_worker.py calls these;
docs/checkpoints.md).

[Note: one run per checkpoint folder]
    A run saves step-NNNNNN folders under --checkpoint, and --resume, --keep and restarts
    take the newest complete one there, so another run's checkpoints in the same folder
    would be mixed with this run's.  A folder that holds checkpoints already is refused
    before any rank starts unless the run continues from them (--resume, --resume-if-any)
    or --overwrite says to start afresh: that removes the checkpoints this project wrote
    there (folders with its COMPLETE.json, and unfinished .NAME.partial ones) and nothing
    else; a step-NNNNNN folder without the marker is not taken for one, so a run that
    would save over it is refused even then.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from .. import outdir
from ..errors import CheckpointError, CheckpointSpaceError
from ..restarts import announce_resume
from . import commit
from .commit import latest_checkpoint

_STEP = re.compile(r"step-\d+")

__all__ = ["add_arguments", "check_arguments", "worker_arguments", "initial_weights", "resume", "resume_from",
           "maybe_save", "saved_before", "overwrite"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint options of `partitioner run` (the launcher's and the worker's)."""
    parser.add_argument("--checkpoint", help="save checkpoints under this folder (step-000010, ...)")
    parser.add_argument("--save-every", type=int, default=0, help="save every K steps (and after the last)")
    parser.add_argument("--keep", type=int, help="keep only the newest N checkpoints")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint under --checkpoint (an error if none)")
    again.add_argument("--resume-if-any", action="store_true",
                       help="continue from it if there is one, else start afresh (a job restarted in a loop)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in a --checkpoint folder that holds another run's checkpoints: they are "
                             "removed first (nothing else there is)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="a failed job starts again from the newest complete checkpoint, up to R times")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--init", action="store_true", help="initial weights by pipe.init_weights (no whole model)")
    start.add_argument("--load", help="initial weights from a checkpoint, .safetensors file or Hugging Face folder")


def check_arguments(ns: argparse.Namespace) -> None:
    """A clear error for options that do not fit together."""
    if (ns.save_every or ns.resume or ns.resume_if_any or ns.keep is not None) and not ns.checkpoint:
        raise CheckpointError("--save-every, --keep and --resume need --checkpoint DIR: the folder the checkpoints "
                              "are saved in and resumed from.")
    if ns.overwrite and not ns.checkpoint:
        raise CheckpointError("--overwrite needs --checkpoint DIR: the folder whose earlier checkpoints a fresh run "
                              "removes.")
    if ns.overwrite and (ns.resume or ns.resume_if_any):
        raise CheckpointError(f"--overwrite starts afresh and --{'resume' if ns.resume else 'resume-if-any'} "
                              f"continues from the checkpoints in {ns.checkpoint!r}: give one of them.")
    if ns.max_restarts and not ns.checkpoint:
        raise CheckpointError(f"--max-restarts {ns.max_restarts} needs --checkpoint DIR (and --save-every K): a "
                              f"restarted job resumes from the newest complete checkpoint saved there.")
    if ns.max_restarts < 0:
        raise CheckpointError(f"--max-restarts {ns.max_restarts}: give how many times to restart, 0 or more.")
    if ns.save_every < 0 or (ns.keep is not None and ns.keep < 1):
        raise CheckpointError(f"--save-every {ns.save_every} --keep {ns.keep}: give a step count >= 0 and keep >= 1.")
    if ns.load and not Path(ns.load).exists():
        raise CheckpointError(f"--load {ns.load} does not exist: give a checkpoint folder, a .safetensors file or a "
                              f"Hugging Face model folder.")
    resume_from(ns)  # --resume with nothing to resume from: refused before any rank starts
    _check_fresh(ns)


def saved_before(root: Path) -> tuple[list[Path], list[Path]]:
    """What a run finds in its --checkpoint folder ([Note: one run per checkpoint folder]):
    the checkpoints this project wrote there (complete or not), and the step-NNNNNN folders
    without its marker, which a save would replace."""
    ours, others = [], []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        if not child.is_dir() or child.is_symlink():
            continue
        if commit.is_marked(child) or (child.name.startswith(".") and child.name.endswith(".partial")):
            ours.append(child)
        elif _STEP.fullmatch(child.name):
            others.append(child)
    return ours, others


def _check_fresh(ns: argparse.Namespace) -> None:
    """A run that starts afresh in a folder holding checkpoints: refused without --overwrite."""
    if not ns.checkpoint or ns.resume or ns.resume_if_any:
        return
    ours, others = saved_before(Path(ns.checkpoint))
    if others:
        raise CheckpointError(f"--checkpoint {ns.checkpoint!r} holds {_few(others)}, not checkpoints this project "
                              f"saved (no {commit.MARKER}), which this run's saves would replace: move "
                              f"{'it' if len(others) == 1 else 'them'} away, or give another --checkpoint folder.")
    if ours and not ns.overwrite:
        raise CheckpointError(f"--checkpoint {ns.checkpoint!r} holds another run's checkpoints ({_few(ours)}), and a "
                              f"fresh run would mix its own with them: pass --resume to continue from the newest, "
                              f"--overwrite to remove them and start afresh, or give another --checkpoint folder.")


def overwrite(ns: argparse.Namespace) -> list[Path]:
    """--overwrite: remove the checkpoints the folder held ([Note: one run per checkpoint
    folder]), once, before any rank starts; the removed.  Call after `check_arguments`."""
    if not (ns.checkpoint and ns.overwrite):
        return []
    ours, _ = saved_before(Path(ns.checkpoint))
    for path in ours:
        shutil.rmtree(path)
    if ours:
        print(f"--overwrite: removed {len(ours)} earlier checkpoint{'s' if len(ours) > 1 else ''} from "
              f"{ns.checkpoint} ({_few(ours)})", file=sys.stderr, flush=True)
    return ours


def _few(paths: list[Path]) -> str:
    return outdir.listing([p.name for p in paths], most=3)


def worker_arguments(ns: argparse.Namespace) -> list[str]:
    """The options to hand each rank, paths made absolute."""
    out = []
    if ns.checkpoint:
        out += ["--checkpoint", str(Path(ns.checkpoint).resolve()), "--save-every", str(ns.save_every)]
    if ns.keep is not None:
        out += ["--keep", str(ns.keep)]
    if ns.resume or ns.resume_if_any:
        out.append("--resume" if ns.resume else "--resume-if-any")
    if ns.max_restarts:
        out += ["--max-restarts", str(ns.max_restarts)]
    if ns.init:
        out.append("--init")
    if ns.load:
        out += ["--load", str(Path(ns.load).resolve())]
    return out


def initial_weights(pipe: Any, ns: argparse.Namespace, seed: int) -> bool:
    """--init or --load; False when neither was asked for (the caller loads the whole model)."""
    if ns.init:
        pipe.init_weights(seed=seed)
    elif ns.load:
        pipe.load_checkpoint(ns.load)
    return bool(ns.init or ns.load)


def resume_from(ns: argparse.Namespace) -> Path | None:
    """The checkpoint --resume / --resume-if-any continue from: None when neither was asked
    for, or under --resume-if-any when --checkpoint holds no complete checkpoint (or does not
    exist yet); under --resume that is an error naming the folder and the fix."""
    if not (ns.resume or ns.resume_if_any):
        return None
    root = Path(ns.checkpoint)
    if ns.resume_if_any and not root.exists():
        return None
    if not root.exists():  # a typo is not "nothing to resume"
        raise CheckpointError(f"--resume: checkpoint folder {ns.checkpoint!r} does not exist (from {os.getcwd()}): "
                              f"give the folder the checkpoints were saved under (the --checkpoint of the run that "
                              f"saved them). Or pass --resume-if-any to start afresh when there is nothing to resume.")
    try:
        path = latest_checkpoint(root)
    except CheckpointError as exc:
        raise CheckpointError(f"--resume: {exc} Or pass --resume-if-any to start afresh when there is "
                              f"nothing to resume.") from None
    if path is None and ns.resume:
        raise CheckpointError(f"--resume: checkpoint folder {ns.checkpoint!r} holds no complete checkpoint (no "
                              f"step-NNNNNN folder with COMPLETE.json), so there is nothing to resume: check the "
                              f"--checkpoint path, or pass --resume-if-any to start afresh when there is none.")
    return path


def resume(pipe: Any, optimizer: torch.optim.Optimizer | None, ns: argparse.Namespace) -> int:
    """--resume / --resume-if-any: load the newest complete checkpoint under --checkpoint
    (`resume_from`; the one before it when a file of it is corrupt: `load_latest`); the step it was saved after (0 when starting afresh)."""
    if resume_from(ns) is None:
        announce_resume(pipe.rank, None, 0)
        return 0
    from . import load_latest

    loaded = load_latest(pipe, ns.checkpoint, optimizer)  # a corrupt newest one: the one before it
    if loaded is None:
        return 0
    path, extra = loaded
    if pipe.rank == 0:
        print(f"resumed from {path} after step {extra['step']}", flush=True)
    announce_resume(pipe.rank, path, int(extra["step"]))  # after a restart, every rank ([Note: restarts])
    return int(extra["step"])


def maybe_save(pipe: Any, optimizer: torch.optim.Optimizer | None, ns: argparse.Namespace, step: int) -> None:
    """Save CHECKPOINT/step-NNNNNN every --save-every steps and after the last; a full
    disk is reported and training goes on ([Note: a full disk at a save])."""
    if not ns.checkpoint or not ((ns.save_every and step % ns.save_every == 0) or step == ns.steps):
        return
    try:
        path = pipe.save_checkpoint(Path(ns.checkpoint) / f"step-{step:06d}", optimizer, extra={"step": step},
                                    keep=ns.keep)
    except CheckpointSpaceError as exc:  # [Note: a full disk at a save]: training goes on
        if pipe.rank == 0:
            print(f"warning: {exc} Training goes on; the next save tries again.", file=sys.stderr, flush=True)
        return
    if pipe.rank == 0:
        print(f"saved {path}", flush=True)
