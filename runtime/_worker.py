"""One rank of `partitioner run` (started by torchrun from runtime/launch.py).

Builds the original model (torch.manual_seed(seed); build_model()) for its initial
weights, loads them into this rank's stages and trains K SGD steps on the model file's
example batch; rank 0 prints `step k  loss X.XXXXXX  time Y ms`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from runtime import DistributedPipeline, GradScaler, package
from runtime.errors import PipelineError

__all__ = ["main"]


def _train(ns: argparse.Namespace) -> None:
    pipe = DistributedPipeline(ns.dir, trace=ns.trace)
    source = pipe.manifest.source
    model_file = package.load_model_file(pipe.manifest, ns.dir)
    torch.manual_seed(source.seed)
    model = getattr(model_file, source.entry)()
    pipe.load_state_dict(model.state_dict())
    del model
    inputs, target = model_file.example_inputs(), model_file.example_target()
    params = pipe.parameters()
    opt = torch.optim.SGD(params, lr=ns.lr) if params else None
    # fp16-mixed scales the loss ([Note: a global loss scale]); otherwise the scaler does nothing
    scaler = GradScaler(pipe.device.type, enabled=pipe.manifest.precision == "fp16-mixed")
    loss_fn = scaler.loss_fn(model_file.loss_fn)
    for k in range(1, ns.steps + 1):
        start = time.perf_counter()
        if opt is not None:
            opt.zero_grad()
        loss = pipe.train_step(inputs, target, loss_fn=loss_fn) / scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if pipe.device.type == "cuda":
            torch.cuda.synchronize(pipe.device)
        ms = (time.perf_counter() - start) * 1e3
        if pipe.rank == 0:
            print(f"step {k}  loss {loss.item():.6f}  time {ms:.1f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="runtime._worker")
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--trace")
    ns = parser.parse_args(argv)
    try:
        _train(ns)
    except PipelineError as exc:
        print(f"rank {os.environ.get('RANK', '?')}: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # do not wait on a process group whose peers are gone
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
