"""The command line: `python -m partitioner compile | show | run | export` (README.md, "Use").

Exit status: 0 done; 2 the user's input is wrong (one paragraph on stderr naming the thing
and the fix, no traceback); 1 an internal error (with its traceback, for a bug report).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Sequence

from runtime import launch
from runtime.checkpoint import run as checkpointing
from runtime.errors import PipelineError
from runtime.manifest import read_manifest
from runtime.schedule.registry import DEFAULT_SCHEDULE, SCHEDULES

from codegen import format_kept, format_plan
from codegen.package import check_out
from partitioner.errors import PackageError, PartitionerError, PlanError

from .compile import compile_model
from .options import AUTO, RECOMPUTE_POLICIES, CompileOptions

__all__ = ["main", "parse", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'16GiB' -> 17179869184; also GB, MiB, plain bytes and 1e9."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise PlanError(f"--memory {text!r} is not a size: write e.g. 16GiB, 512MiB, 80GB or a number of bytes.")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise PlanError(f"--memory {text!r} must be more than zero bytes.")
    return size


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="partitioner", description="An automatic model-parallelism compiler for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile MODEL.py into a pipeline package DIR")
    c.add_argument("model", help="the model file (build_model, example_inputs, ...)")
    c.add_argument("--out", required=True, help="the package directory to write")
    c.add_argument("--stages", type=int, help="pipeline stages (default: searched with --devices, else 2)")
    c.add_argument("--tp", type=int, help="tensor-parallel degree (default: searched with --devices, else 1)")
    c.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    c.add_argument("--devices", type=int, help="total devices: stages x tp x dp")
    c.add_argument("--microbatches", type=int, help="default: 2 x stages")
    c.add_argument("--schedule", default="",
                   help=f"{' | '.join(SCHEDULES)} | {AUTO} (the fastest that fits, searched with the mesh; needs "
                        f"--devices) (default: {AUTO} with --devices, else {DEFAULT_SCHEDULE})")
    c.add_argument("--virtual-stages", type=int,
                   help="stages per rank for interleaved (default: searched, 2 up to 20, the fastest simulated)")
    c.add_argument("--memory", help="memory per device, e.g. 16GiB (default: the device's own)")
    c.add_argument("--hardware", help="cpu | a100 | h100 | h200 | a JSON profile (default: this machine)")
    c.add_argument("--analytic", action="store_true", help="costs from FLOPs and bytes (roofline), deterministic")
    c.add_argument("--tracer", default="auto", help="auto | fx | export (default auto)")
    c.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed | bf16 | fp16-mixed (default fp32)")
    c.add_argument("--time-limit", type=float, default=30.0, help="solver time limit in seconds (default 30)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--entry", default="build_model", help="the function that builds the model")
    c.add_argument("--optimizer", default="adam", help="adam | sgd | momentum: optimizer state in memory")
    c.add_argument("--zero", type=int,
                   help="1: each data-parallel replica keeps 1/dp of the optimizer state (ZeRO-1) (default 0; with "
                        "--devices the search sets 1 for a mesh that fits in memory only so)")
    c.add_argument("--reprofile", action="store_true", help="measure node costs again, ignoring the cache")
    c.add_argument("--meta", action="store_true", default=None,
                   help="build the model on the meta device (implied by --analytic for models too big for this machine)")
    c.add_argument("--recompute", nargs="?", const="full", choices=RECOMPUTE_POLICIES, metavar="POLICY",
                   help="auto | none | full | selective (alone: full; default: auto with --devices, else none): full "
                        "keeps each stage's inputs per microbatch in flight and runs its forward again in backward; "
                        "selective also keeps its matmuls' outputs and runs the rest again (softmax, dropout, "
                        "activation functions); auto: per rank, the fastest that fits in memory")
    c.add_argument("--offload", default="auto",
                   help="move the activations each stage saves for backward to host memory after its forward and "
                        "bring them back ahead of its backward: auto (where the mesh does not fit otherwise), none, "
                        "all (default auto)")
    c.add_argument("--force", action="store_true",
                   help="write into an --out folder that holds other files too: the package's files beside them "
                        "(nothing the compiler did not write is deleted or overwritten)")
    c.add_argument("--quiet", action="store_true")
    s = sub.add_parser("show", help="print a package's plan")
    s.add_argument("dir")
    s.add_argument("--timeline", metavar="FILE.png",
                   help="also draw the predicted step, ranks x time (README, 'Zero-bubble schedules')")
    r = sub.add_parser("run", help="train a package for a few steps under torchrun")
    r.add_argument("dir")
    r.add_argument("--nproc", type=int, required=True)
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--lr", type=float, default=0.01)
    launch.add_training_arguments(r)
    r.add_argument("--trace", help="write a Chrome/Perfetto trace of the steps to this file")
    r.add_argument("--timeline", metavar="FILE.png", help="draw the last step's measured timeline (needs --trace)")
    checkpointing.add_arguments(r)
    e = sub.add_parser("export", help="write a checkpoint's weights as safetensors (--hf: a from_pretrained folder)")
    e.add_argument("ckpt", help="a checkpoint folder of save_checkpoint / run --checkpoint")
    e.add_argument("--out", required=True, help="the folder to write")
    e.add_argument("--hf", action="store_true", help="a Hugging Face model's save_pretrained folder")
    e.add_argument("--max-shard-size", default="5GB", help="split the weights into files of at most this size")
    e.add_argument("--force", action="store_true",
                   help="write into an --out folder that holds other files too: the export's files beside them")
    return parser


def _compile(ns: argparse.Namespace) -> int:
    out = Path(ns.out)
    check_out(out, ns.force, "--force")  # before the compile's work: [Note: output folders]
    opts = CompileOptions(
        model=ns.model, out=ns.out, stages=ns.stages, tp=ns.tp, dp=ns.dp, devices=ns.devices,
        microbatches=ns.microbatches, schedule=ns.schedule, virtual_stages=ns.virtual_stages,
        memory=parse_size(ns.memory) if ns.memory else None, hardware=ns.hardware, analytic=ns.analytic,
        tracer=ns.tracer, time_limit=ns.time_limit, seed=ns.seed, entry=ns.entry, optimizer=ns.optimizer,
        reprofile=ns.reprofile, quiet=ns.quiet, meta=ns.meta, recompute=ns.recompute, zero=ns.zero,
        precision=ns.precision, offload=ns.offload, force=ns.force,
    )
    compile_model(opts)
    if not ns.quiet:
        print((out / "plan.txt").read_text(), end="")
    return 0


def _show(ns: argparse.Namespace) -> int:
    typed = read_manifest(ns.dir)
    sources = [p.read_text() for p in (Path(ns.dir) / f"{s.module}.py" for s in typed.stages) if p.is_file()]
    print(format_plan(typed) + format_kept(sources), end="")
    if ns.timeline:
        from partitioner.predict import timeline

        events = timeline.predicted_events(typed)  # [Note: one predicted step]
        assert typed.predicted is not None  # else predicted_events raised
        timeline.draw(events, typed.mesh.pp, ns.timeline, timeline.predicted_title(typed),
                      step_s=typed.predicted.step_time_s, labels=timeline.rank_labels(typed))
        print(f"wrote {ns.timeline}")
    return 0


def _run(ns: argparse.Namespace) -> int:
    read_manifest(ns.dir)
    argv = [ns.dir, "--nproc", str(ns.nproc), "--steps", str(ns.steps), "--lr", str(ns.lr)] + launch.training_arguments(ns)
    if ns.timeline and not ns.trace:
        raise PackageError("--timeline draws the measured steps from the trace: add --trace FILE.json.")
    if ns.trace:
        argv += ["--trace", ns.trace]
    checkpointing.check_arguments(ns)
    overwrite = ["--overwrite"] if ns.overwrite else []  # done by the launcher once its checks pass
    rc = launch.main(argv + checkpointing.worker_arguments(ns) + overwrite)
    if rc == 0 and ns.timeline:
        from partitioner.predict import timeline

        events, ranks = timeline.measured_events(ns.trace)
        timeline.draw(events, ranks, ns.timeline, f"{ns.dir}, last step measured")
        print(f"wrote {ns.timeline}")
    return rc


def _export(ns: argparse.Namespace) -> int:
    from runtime.checkpoint.export import export

    try:
        limit = parse_size(ns.max_shard_size)
    except PlanError:
        raise PlanError(f"--max-shard-size {ns.max_shard_size!r} is not a size: write e.g. 5GB or 500MiB.") from None
    for path in export(ns.ckpt, ns.out, hf=ns.hf, max_shard_bytes=limit, force=ns.force):
        print(path)
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, where `--recompute` alone may stand before the model file
    (`compile --recompute model.py`): a Python file or a path that exists after it is the
    model, not a policy, which argparse would take it for."""
    args = list(sys.argv[1:] if argv is None else argv)
    for k, arg in enumerate(args[:-1]):
        after = args[k + 1]
        if arg == "--recompute" and after not in RECOMPUTE_POLICIES and (after.endswith(".py") or Path(after).exists()):
            args[k] = "--recompute=full"
    return _parser().parse_args(args)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse(argv)
    try:
        return {"compile": _compile, "show": _show, "run": _run, "export": _export}[ns.command](ns)
    except (PartitionerError, PipelineError) as exc:
        _fail(str(exc))
        return 2
    except Exception as exc:
        traceback.print_exc()
        print(f"partitioner: internal error ({type(exc).__name__}); please report it with the traceback above.",
              file=sys.stderr)
        return 1


def _fail(message: str) -> None:
    print(textwrap.fill(f"partitioner: error: {message}", width=100, break_long_words=False,
                        break_on_hyphens=False), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
