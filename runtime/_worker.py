"""One rank of `partitioner run` (started by torchrun from runtime/launch.py).

Builds the original model (torch.manual_seed(seed); build_model()) for its initial
weights (or, with --init / --load, init_weights / load_checkpoint: checkpoint/run.py),
loads them into this rank's stages and trains K steps (--optimizer sgd | adamw, --lr,
--clip) on the model file's `batches()`, or on its example batch when it has none (with
--resume, from the newest checkpoint's step on; --checkpoint saves); fp16-mixed packages
scale the loss ([Note: a global loss scale]) and, with --clip, unscale the gradients before
clipping them; --on-nonfinite skip|stop skips a step whose loss or gradients are not
finite on every rank (at most --max-skips K in a row), or stops there ([Note: non-finite
steps]), looking before clipping. Rank 0 prints `step k  loss X.XXXXXX  time Y ms` (with
--clip, `step k  loss X.XXXXXX  norm N.NNNNNN  time Y ms`: the gradient norm before
clipping; a skipped step, `skipped (WHAT is not finite)` for the norm), and after the
run's second step (its first when it runs one) `memory rank r  measured ...; predicted
...` for each rank (its peak bytes by kind in that step beside the plan's prediction:
runtime/memory.py).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from runtime import DistributedPipeline, GradScaler, faults, package, restarts
from runtime.checkpoint import run as checkpointing
from runtime.errors import PipelineError
from runtime.launch import add_training_arguments
from runtime.scaler import MAX_SKIPS, NonFiniteSteps

__all__ = ["main", "OPTIMIZERS"]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def _batches(model_file: Any) -> Iterator[tuple[Any, Any]]:
    """The model file's `batches()` (run through again when it ends), or its example batch
    for ever: (inputs, target) pairs, the same on every rank."""
    if not hasattr(model_file, "batches"):
        return itertools.repeat((model_file.example_inputs(), model_file.example_target()))
    return itertools.chain.from_iterable(model_file.batches() for _ in itertools.count())


def _skipped(check: NonFiniteSteps | None, loss: torch.Tensor, opt: torch.optim.Optimizer | None, step: int,
             scaler: GradScaler) -> str | None:
    """--on-nonfinite: what was not finite in step `step`, which is skipped, or None to
    take it ([Note: non-finite steps]); a skipped step leaves the fp16 scale as it was."""
    if check is None or check(loss, opt, step):
        return None
    if scaler.is_enabled():
        scaler.update(scaler.get_scale())
    return check.skipped


def _nonfinite_check(ns: argparse.Namespace, pipe: DistributedPipeline, scaler: GradScaler) -> NonFiniteSteps | None:
    """--on-nonfinite skip|stop [--max-skips K]: the check of every step, or None."""
    if ns.on_nonfinite is None:
        return None
    return NonFiniteSteps(ns.on_nonfinite, max_skips=MAX_SKIPS if ns.max_skips is None else ns.max_skips,
                          grads=not scaler.is_enabled(), names=pipe.named_parameters())


def _train(ns: argparse.Namespace) -> None:
    pipe = DistributedPipeline(ns.dir, trace=ns.trace, engine=ns.engine)
    source = pipe.manifest.source
    model_file = package.load_model_file(pipe.manifest, ns.dir)
    if not checkpointing.initial_weights(pipe, ns, source.seed):
        torch.manual_seed(source.seed)
        model = getattr(model_file, source.entry)()
        pipe.load_state_dict(model.state_dict())
        del model
    opt = pipe.make_optimizer(OPTIMIZERS[ns.optimizer], lr=ns.lr) if pipe.parameters() else None
    # fp16-mixed scales the loss ([Note: a global loss scale]); otherwise the scaler does nothing
    scaler = GradScaler(pipe.device.type, enabled=pipe.manifest.precision == "fp16-mixed")
    loss_fn = scaler.loss_fn(model_file.loss_fn)
    check = _nonfinite_check(ns, pipe, scaler)
    first = checkpointing.resume(pipe, opt, ns) + 1
    measured = min(first + 1, ns.steps)  # the steady state the plan predicts: optimizer state made by the step before
    data = itertools.islice(_batches(model_file), first - 1, None)  # a resumed run goes on with the next batch
    for k, (inputs, target) in zip(range(first, ns.steps + 1), data):
        ns.step = k  # for the error report ([Note: restarts] in runtime/restarts.py)
        restarts.report_step(pipe.rank, k)
        faults.set_step(k)  # test hooks: [Note: injected faults]
        pipe.track_memory(k == measured)  # that step only: [Note: measured memory] in runtime/memory.py
        start = time.perf_counter()
        if opt is not None:
            opt.zero_grad()
        loss = pipe.train_step(inputs, target, loss_fn=loss_fn) / scaler.get_scale()
        norm = ""
        if ns.clip is not None:  # the true gradients (fp16-mixed: unscaled, and the global inf check) are clipped
            scaler.unscale_(opt)
        skipped = _skipped(check, loss, opt, k, scaler)  # before clipping, which makes every gradient nan if one is
        if skipped is not None:
            norm = f"  skipped ({skipped} is not finite)"
        else:
            if ns.clip is not None:
                norm = f"  norm {pipe.clip_grad_norm_(ns.clip).item():.6f}"
            scaler.step(opt)
            scaler.update()
        if pipe.device.type == "cuda":
            torch.cuda.synchronize(pipe.device)
        ms = (time.perf_counter() - start) * 1e3
        if pipe.rank == 0:
            print(f"step {k}  loss {loss.item():.6f}{norm}  time {ms:.1f} ms", flush=True)
        if k == measured:
            _print_memory(pipe, ns.optimizer)
        checkpointing.maybe_save(pipe, opt, ns, k)
    pipe.tracer.flush()  # the last optimizer step's event (collective; nothing without --trace)
    dist.barrier()
    dist.destroy_process_group()


def _print_memory(pipe: DistributedPipeline, optimizer: str) -> None:
    """Rank 0 prints every rank's measured memory of the step just run, beside the plan's
    prediction: `memory rank r  measured ...; predicted ...` (collective), and a line where
    the plan counted another optimizer's state than this run's keeps."""
    lines: list[Any] = [None] * pipe.world
    dist.all_gather_object(lines, str(pipe.memory_stats()), group=pipe.groups.world)
    if pipe.rank != 0:
        return
    for r, line in enumerate(lines):
        print(f"memory rank {r}  {line}", flush=True)
    planned = str(pipe.manifest.options.get("optimizer", "adam"))
    if _STATE.get(planned, planned) != _STATE[optimizer]:
        print(f"memory     the plan counts {planned}'s optimizer state; this run's {optimizer} keeps "
              f"{'none' if optimizer == 'sgd' else 'two moments per parameter'} (compile --optimizer {optimizer} "
              f"plans for it)", flush=True)


#: optimizers by the state they keep per parameter (compile's names and run's)
_STATE = {"sgd": "none", "adamw": "adam", "adam": "adam", "momentum": "momentum"}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="runtime._worker")
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    add_training_arguments(parser)
    parser.add_argument("--trace")
    checkpointing.add_arguments(parser)
    ns = parser.parse_args(argv)
    ns.step = 0
    restarts.start_heartbeat(int(os.environ.get("RANK", "0")))  # [Note: heartbeats] in runtime/restarts.py
    try:
        _train(ns)
    except PipelineError as exc:
        rank = int(os.environ.get("RANK", "0"))
        if not restarts.report_error(rank, ns.step, exc):  # else the launcher says it, once, last
            print(f"rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # do not wait on a process group whose peers are gone
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
