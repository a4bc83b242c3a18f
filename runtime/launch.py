"""`partitioner run DIR --nproc N [--steps K] [--lr LR] [--trace FILE] [--on-nonfinite skip|stop [--max-skips K]]`
(and the checkpoint options of checkpoint/run.py: --checkpoint DIR --save-every K --keep N --resume --init --load
PATH --max-restarts R: a failed job restarts from its newest checkpoint, restarts.py): train a package for a few steps, one process per rank, through torchrun (the
user-facing contract: README.md, "Use", and docs/checkpoints.md).

The lead's command line calls `main(argv)` with the arguments after `run`; it turns a
`PipelineError` into exit status 2 and one paragraph.  `python -m runtime.launch ...`
does the same on its own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import package, restarts
from .checkpoint import run as checkpointing
from .engines import DEFAULT_ENGINE, ENGINES
from .errors import ManifestError, MeshError, PipelineError
from .manifest import Manifest
from .scaler import MAX_SKIPS

__all__ = ["add_training_arguments", "check_max_skips", "main", "shared_cores", "torchrun_command", "training_arguments"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="partitioner run", description="train a package under torchrun")
    parser.add_argument("dir", help="the compiled package directory")
    parser.add_argument("--nproc", type=int, required=True, help="processes (ranks): pp x tp x dp of the plan")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    parser.add_argument("--trace", help="write a Chrome/Perfetto trace of the steps to this file")
    add_training_arguments(parser)
    checkpointing.add_arguments(parser)
    return parser


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """`partitioner run`'s choices of how to train (beside --steps and --lr)."""
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="the optimizer (default sgd)")
    parser.add_argument("--clip", type=float, help="clip the whole model's gradient norm to this (pipe.clip_grad_norm_)")
    parser.add_argument("--on-nonfinite", choices=["skip", "stop"],
                        help="a step whose loss or gradients are not finite: skip it on every rank, or stop the run")
    parser.add_argument("--max-skips", type=int, metavar="K",
                        help=f"with --on-nonfinite skip: skip at most K steps in a row, the next one in a row stops "
                             f"the run (default {MAX_SKIPS})")
    parser.add_argument("--engine", choices=list(ENGINES), default=DEFAULT_ENGINE,
                        help="what runs the schedule: our runtime, or torch.distributed.pipelining (docs/engines.md)")


def check_max_skips(ns: argparse.Namespace) -> None:
    """--max-skips K counts the steps --on-nonfinite skip skipped: K >= 0, and only with it."""
    if ns.max_skips is None:
        return
    if ns.on_nonfinite != "skip":
        raise PipelineError(f"--max-skips {ns.max_skips} bounds the steps skipped in a row by --on-nonfinite skip: "
                            f"add --on-nonfinite skip, or leave --max-skips out.")
    if ns.max_skips < 0:
        raise PipelineError(f"--max-skips {ns.max_skips}: give how many non-finite steps in a row to skip before the "
                            f"run stops, 0 or more.")


def training_arguments(ns: argparse.Namespace) -> list[str]:
    """The worker's arguments for `add_training_arguments`' choices."""
    return (["--optimizer", ns.optimizer] + (["--clip", repr(ns.clip)] if ns.clip is not None else [])
            + (["--on-nonfinite", ns.on_nonfinite] if ns.on_nonfinite else [])
            + (["--max-skips", str(ns.max_skips)] if ns.max_skips is not None else [])
            + (["--engine", ns.engine] if ns.engine != DEFAULT_ENGINE else []))


def torchrun_command(directory: str, nproc: int, steps: int, lr: float, trace: str | None,
                     more: list[str] | None = None) -> list[str]:
    """The torchrun command line that runs `_worker.py` on every rank (`more`: its checkpoint options),
    through runtime/_torchrun.py: each rank's error said once, last, without torchrun's traceback."""
    cmd = [sys.executable, "-m", "runtime._torchrun", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "runtime._worker", directory, "--steps", str(steps), "--lr", repr(lr)]
    return cmd + (["--trace", trace] if trace else []) + (more or [])


def main(argv: list[str]) -> int:
    """Check the request against the package, then run torchrun; its exit status (0 or 1).

    Raises `PipelineError` when the request is wrong (bad package, --nproc off the mesh,
    a model file without what training needs)."""
    ns = _parser().parse_args(argv)
    manifest = package.load_manifest(ns.dir)
    mesh = manifest.mesh
    need = mesh.pp * mesh.tp * mesh.dp
    if ns.nproc != need:
        raise MeshError(f"{ns.dir} is planned for pp={mesh.pp} x tp={mesh.tp} x dp={mesh.dp} = {need} ranks "
                        f"but --nproc is {ns.nproc}: run it with --nproc {need}, or compile the model for "
                        f"{ns.nproc} devices (--devices {ns.nproc}).")
    if ns.steps < 1 or not ns.lr > 0:
        raise PipelineError(f"--steps {ns.steps} --lr {ns.lr}: give at least one step and a positive learning rate.")
    if ns.clip is not None and not ns.clip > 0:
        raise PipelineError(f"--clip {ns.clip}: give the largest gradient norm to keep, a positive number.")
    check_max_skips(ns)
    _check_model_file(manifest, ns.dir)
    note = shared_cores(manifest, ns.nproc)
    if note:
        print(f"partitioner run: {note}", file=sys.stderr, flush=True)
    checkpointing.check_arguments(ns)
    checkpointing.overwrite(ns)  # once every check has passed, before any rank: [Note: one run per checkpoint folder]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = str(Path(__file__).resolve().parents[1])  # so that every rank imports this runtime
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    trace = str(Path(ns.trace).resolve()) if ns.trace else None

    def command(attempt: int) -> list[str]:  # attempt > 1: resume ([Note: restarts] in restarts.py)
        more = checkpointing.worker_arguments(ns)
        if attempt > 1:
            more = [a for a in more if a not in ("--resume", "--resume-if-any")] + ["--resume-if-any"]
        return torchrun_command(str(Path(ns.dir).resolve()), ns.nproc, ns.steps, ns.lr, trace,
                                training_arguments(ns) + more)

    if ns.max_restarts:
        return restarts.run_attempts(command, env, ns.max_restarts, Path(ns.checkpoint))
    with tempfile.TemporaryDirectory(prefix="partitioner-status-") as folder:  # rank errors told once, last
        return 0 if subprocess.call(command(1), env={**env, restarts.STATUS_ENV: folder}) == 0 else 1


def shared_cores(manifest: Manifest, nproc: int) -> str | None:
    """Where `nproc` CPU ranks outnumber the cores this process may use, what that does to
    the step times ([Note: binding CPU ranks to cores] in affinity.py); else None."""
    if torch.cuda.is_available() or not hasattr(os, "sched_getaffinity"):
        return None
    cores = len(os.sched_getaffinity(0))
    if nproc <= cores:
        return None
    predicted = f" ({manifest.predicted.step_time_s * 1e3:.1f} ms)" if manifest.predicted else ""
    return (f"{nproc} ranks share the {cores} cores this run may use (os.sched_getaffinity), so they take turns on "
            f"them and each step takes longer than the plan's prediction{predicted}, which gives every rank a core of "
            f"its own: run it where it may use {nproc} cores or more, or compile for {cores} devices "
            f"(--devices {cores}).")


def _check_model_file(manifest: Manifest, directory: str) -> None:
    module = package.load_model_file(manifest, directory)
    entry = manifest.source.entry
    for name in (entry, "example_inputs", "example_target", "loss_fn"):
        if not callable(getattr(module, name, None)):
            raise ManifestError(f"model file {manifest.source.path} defines no {name}(), which "
                                f"`partitioner run` needs to train (see README.md, 'Use').")


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except PipelineError as exc:
        print(f"partitioner run: error: {exc}", file=sys.stderr)
        sys.exit(2)
