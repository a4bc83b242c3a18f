"""The prepared device check: the GPU paths not yet measured on a GPU, checked in one short run.

    python benchmarks/gpu_check.py [--quick] [--device cuda|cpu]      (or: make gpu-check)

It runs end to end on the CPU as well (the default without CUDA), where the rows that need
CUDA say "not run", so the script itself is tested here (tests/test_gpu_check.py).  On one
H200 it should finish in a few minutes.  Checks:

  a  compile      examples/gpt.py and examples/hf_gpt2.py, 2 stages, measured: on CUDA for
                  the h200 profile, profiled on the GPU (CUDA events, the allocator's peaks:
                  [Note: where the compile runs the model] in driver/phases.py), every stage
                  calibrated and its peak memory counted; on the CPU the same code path on
                  the measured cpu profile, with no peaks (the CPU keeps no count)
  b  equivalence  LocalPipeline on one device, 2 and 4 stages, GPipe and 1F1B, fp32: 3 SGD
                  steps against the original model on the same device (rtol 1e-5; TF32 off)
  c  mfu          one GPT block at d = 4096 in bf16, forward + backward: model FLOPs
                  (torch.utils.flop_counter) over time x 790 TFLOP/s (CUDA only)
  d  prediction   per example and stage: the manifest's predicted compute and peak memory
                  (compiled with costs measured on the GPU) against the stage timed alone
                  and its memory counted by the allocator (weights, gradients, Adam state,
                  its microbatches in flight; CUDA only)
  e  nccl         gpt, 2 stages on two GPUs, 3 SGD steps against the original: a LocalPipeline
                  with a stage on each GPU (runtime/devices.py StageStreams), and 2 ranks of
                  DistributedPipeline over NCCL on each engine (ours, messages on the
                  communication stream; engine="pipelining", docs/engines.md: one stage set
                  per rank, so it has no one-GPU form); only with more than one GPU
  f  offload      the GPT block of c, a GPipe step of 4 microbatches with and without every
                  activation offloaded (benchmarks/gpu_offload.py; CUDA only)

It prints one table and writes benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

if __package__ in (None, ""):  # run as a script: python benchmarks/gpu_check.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import runtime  # noqa: E402
from codegen.report import format_bytes  # noqa: E402
from driver.compile import compile_model  # noqa: E402
from driver.options import CompileOptions  # noqa: E402
from partitioner.cost.timer import DeviceTimer, device_timer  # noqa: E402
from partitioner.trace import model_file  # noqa: E402
from runtime.manifest import read_manifest  # noqa: E402
from runtime.stage import as_leaf  # noqa: E402

from .common import save, table  # noqa: E402
from .gpu_offload import Block as _Block, offload_row  # noqa: E402

COLUMNS = ["check", "case", "status", "figure", "value", "goal"]
H200_BF16_FLOPS = 790e12  # the dense bf16 matmul rate measured on this project's H200 (device KINDS.md)
EXAMPLES = ["mlp", "gpt", "bert", "ncf", "skip", "hf_gpt2", "hf_bert"]
STEPS, LR = 3, 0.05
Row = dict[str, Any]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The prepared device check (see the module's docstring).")
    parser.add_argument("--quick", action="store_true", help="fewer cases (what the CPU test runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = parser.parse_args(argv)
    device = torch.device(ns.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the equivalence checks
    torch.backends.cudnn.allow_tf32 = False
    timer = device_timer(device)
    rows: list[Row] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for check in (_compile_rows, _equivalence_rows, _mfu_rows, _prediction_rows, _nccl_rows, _offload_rows):
            began = time.perf_counter()
            rows += check(work, timer, ns.quick)
            print(f"{check.__name__[1:-5]}: done in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    print(table(rows, COLUMNS))
    failed = [r for r in rows if r["status"] == "FAIL"]
    path = save("gpu_check", rows, device=str(device), device_name=_device_name(device), quick=ns.quick,
                wall_s=round(time.perf_counter() - start, 1))
    print(f"{len(rows)} rows, {len(failed)} failed, {time.perf_counter() - start:.0f} s; wrote {path}")
    return 1 if failed else 0


# -- a: compile ----------------------------------------------------------------------------


def _compile(work: Path, timer: DeviceTimer, example: str, stages: int, measured: bool = False,
             **options: Any) -> Path:
    """examples/<example>.py compiled into `stages` stages for the timer's device: `measured`,
    profiled on it (the h200 profile on CUDA, the measured cpu one on the CPU), else with the
    roofline of the h200 (CUDA) or a100 (CPU) profile."""
    named = "_".join(f"{k}{v}" for k, v in sorted(options.items()))
    out = work / f"{example}_{stages}_{'measured' if measured else 'analytic'}_{named}"
    hardware = "h200" if timer.is_cuda else "cpu" if measured else "a100"
    compile_model(CompileOptions(model=f"examples/{example}.py", out=str(out), stages=stages, analytic=not measured,
                                 hardware=hardware, quiet=True, time_limit=5.0, **options))
    return out


def _compile_rows(work: Path, timer: DeviceTimer, quick: bool) -> list[Row]:
    """The compile profiled on the device: every stage calibrated there, and on CUDA each
    stage's peak memory counted (positive), on the CPU none."""
    rows = []
    for example in ["gpt"] if quick else ["gpt", "hf_gpt2"]:
        start = time.perf_counter()
        out = _compile(work, timer, example, 2, measured=True)
        seconds = time.perf_counter() - start
        step = read_manifest(out).predicted
        calibration = step.extra.get("calibration", {}) if step else {}
        peaks = list(calibration.get("measured_peak_bytes") or [])
        counted = (bool(peaks) and all(b > 0 for b in peaks)) if timer.is_cuda else not peaks
        ok = step is not None and bool(calibration.get("measured_compute_s")) and counted
        said = ", ".join(format_bytes(b) for b in peaks) if peaks else "none"
        rows.append({"check": "a compile", "case": f"{example} 2 stages, profiled on {timer.device.type}",
                     "status": "ok" if ok else "FAIL", "figure": "compile s", "value": round(seconds, 2),
                     "goal": (f"predicted step {step.step_time_s * 1e3:.3g} ms; " if step else "")
                     + f"stages calibrated, peaks {said}"})
    return rows


# -- b: equivalence ------------------------------------------------------------------------


def _equivalence_rows(work: Path, timer: DeviceTimer, quick: bool) -> list[Row]:
    rows = []
    cases = [("gpt", 2, "1f1b")] if quick else [(e, s, k) for e in ("gpt", "hf_gpt2") for s in (2, 4)
                                                for k in ("gpipe", "1f1b")]
    for example, stages, schedule in cases:
        out = _compile(work, timer, example, stages, schedule=schedule)
        error = _training_error(out, f"examples/{example}.py", timer.device)
        rows.append({"check": "b equivalence", "case": f"{example} {stages} stages {schedule} fp32",
                     "status": "ok" if error <= 1e-5 else "FAIL", "figure": "max rel. error", "value": error,
                     "goal": "<= 1e-5"})
    rows.append({"check": "b equivalence", "case": "bf16-mixed", "status": "not scripted",
                 "figure": "", "value": "",
                 "goal": "not scripted here (tests/test_precision.py checks it on the CPU)"})
    return rows


def _training_error(package: Path, path: str, device: torch.device, pipe_device: Any = None) -> float:
    """The largest relative difference, over the losses and every weight, between the package
    (a LocalPipeline on `pipe_device`, else `device`) and the original model trained STEPS SGD
    steps on `device`."""
    mf = model_file.load(path)
    inputs, target = _batch(mf, device)
    pipe = runtime.LocalPipeline(package, device=pipe_device or device)
    pipe.load_state_dict(mf.build(0).state_dict())
    got = _train_pipe(pipe, inputs, target)
    return _error(got, pipe.state_dict(), *_original(mf, device), device)


def _original(mf: model_file.ModelFile, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The original model trained STEPS SGD steps on `device`: its losses and final weights."""
    inputs, target = _batch(mf, device)
    model = mf.build(0).to(device)
    return _train(model.parameters(), lambda: _call(model, inputs), mf.loss_fn(), target), model.state_dict()


def _error(got: list[float], state: dict[str, torch.Tensor], want: list[float], original: dict[str, torch.Tensor],
           device: torch.device) -> float:
    """The largest relative difference over the losses and every weight."""
    errors = [_relative(torch.tensor(got), torch.tensor(want))]
    return max(errors + [_relative(state[name].to(device), value) for name, value in original.items()])


def _batch(mf: model_file.ModelFile, device: torch.device) -> tuple[Any, Any]:
    args, kwargs = mf.example_inputs()
    return _to(kwargs if kwargs else args, device), _to(mf.example_target(), device)


def _train(params: Any, forward: Callable[[], Any], loss_fn: Callable[[Any, Any], torch.Tensor],
           target: Any) -> list[float]:
    opt = torch.optim.SGD(list(params), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(forward(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_pipe(pipe: runtime.LocalPipeline | runtime.DistributedPipeline, inputs: Any, target: Any) -> list[float]:
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(float(pipe.train_step(inputs, target)))
        opt.step()
    return losses


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    if not want.is_floating_point():
        return 0.0 if torch.equal(got.cpu(), want.cpu()) else float("inf")
    scale = want.abs().max().clamp_min(1e-6)
    return float(((got.float() - want.float()).abs().max() / scale).cpu()) if want.numel() else 0.0


# -- c: mfu --------------------------------------------------------------------------------


def _mfu_rows(work: Path, timer: DeviceTimer, quick: bool) -> list[Row]:
    row: Row = {"check": "c mfu", "case": "GPT block d=4096 bf16, 8 x 2048 tokens", "figure": "MFU", "goal": "> 0.5"}
    if not timer.is_cuda:
        return [{**row, "status": "not run", "value": "CUDA only"}]
    block = _Block(4096, 32).to(timer.device, torch.bfloat16)
    x = torch.randn(8, 2048, 4096, device=timer.device, dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        step()
    seconds = timer.median(step, samples=10)
    mfu = counter.get_total_flops() / seconds / H200_BF16_FLOPS
    return [{**row, "status": "ok" if mfu > 0.5 else "below goal", "value": round(mfu, 3)}]


# -- f: offload (benchmarks/gpu_offload.py) -----------------------------------------------


def _offload_rows(work: Path, timer: DeviceTimer, quick: bool) -> list[Row]:
    return [offload_row(timer, quick)]


# -- d: prediction -------------------------------------------------------------------------


def _prediction_rows(work: Path, timer: DeviceTimer, quick: bool) -> list[Row]:
    rows = []
    for example in ["mlp"] if quick else EXAMPLES:
        out = _compile(work, timer, example, 2, measured=timer.is_cuda)
        pipe = runtime.LocalPipeline(out, device=timer.device)
        mf = model_file.load(f"examples/{example}.py")
        pipe.load_state_dict(mf.build(0).state_dict())
        args, kwargs = mf.example_inputs()
        captured = _stage_inputs(pipe, _to(kwargs if kwargs else args, timer.device))
        for k, runner in enumerate(pipe.runners):
            predicted = pipe.manifest.predicted.stages[k] if pipe.manifest.predicted else None
            if predicted is None:
                continue
            measured = timer.median(lambda: _forward_backward(runner.module, captured[k]), samples=20)
            rows.append(_versus("d time", f"{example} stage {k}", "compute s", predicted.compute_s,
                                measured if timer.is_cuda else None))  # on the CPU it predicted an a100
            peak = _stage_memory(timer, runner.module, captured[k], predicted.peak_inflight)
            rows.append(_versus("d memory", f"{example} stage {k}", "peak bytes", predicted.memory_bytes, peak))
    return rows


def _versus(check: str, case: str, figure: str, predicted: float, measured: float | None) -> Row:
    if measured is None:
        return {"check": check, "case": case, "status": "not run", "figure": figure, "value": "CUDA only",
                "goal": "within 10%"}
    error = (predicted - measured) / measured
    return {"check": check, "case": case, "status": "ok" if abs(error) <= 0.10 else "off", "figure": f"{figure} error",
            "value": f"{error:+.1%} ({predicted:.3g} predicted, {measured:.3g} measured)", "goal": "within 10%"}


def _stage_inputs(pipe: runtime.LocalPipeline, inputs: Any) -> list[list[Any]]:
    """Each stage's arguments for its first microbatch, recorded by a forward pass."""
    seen: dict[int, list[Any]] = {}
    hooks = [r.module.register_forward_pre_hook(lambda _m, a, k=k: seen.setdefault(k, list(a)) and None)
             for k, r in enumerate(pipe.runners)]
    try:
        pipe(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return [[a.detach() if isinstance(a, torch.Tensor) else a for a in seen[k]] for k in range(len(pipe.runners))]


def _forward_backward(module: torch.nn.Module, args: list[Any]) -> list[torch.Tensor]:
    """One forward and backward of `module`, from leaves like a stage's; returns what autograd
    keeps alive until the caller drops it (nothing once backward ran)."""
    outs = [o for o in pytree.tree_leaves(module(*_leaves(args))) if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return []


def _leaves(args: list[Any]) -> list[Any]:
    """The stage's arguments as the runtime hands them over: fresh leaves, floating ones
    requiring grad ([Note: stage boundaries at run time] in runtime/stage.py)."""
    return [as_leaf(a, True) for a in args]


def _stage_memory(timer: DeviceTimer, module: torch.nn.Module, args: list[Any], inflight: int) -> int | None:
    """What the stage holds at its peak, counted by the allocator from nothing: its weights,
    their gradients and Adam's two moments, and `inflight` microbatches' activations."""
    if not timer.is_cuda:
        return None
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params)
    _forward_backward(module, args)
    opt.step()  # Adam's state exists now, as it does from the second step on

    def run() -> None:
        kept = []
        for _ in range(max(1, inflight)):
            kept.append([o for o in pytree.tree_leaves(module(*_leaves(args))) if isinstance(o, torch.Tensor)])
        for outs in kept:
            grads = [o for o in outs if o.requires_grad]
            torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])

    torch.cuda.empty_cache()
    activations = timer.peak_bytes(run) or 0
    resident = sum(t.numel() * t.element_size() for t in _resident(module, opt))
    return resident + activations


def _resident(module: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return list(module.parameters()) + list(module.buffers()) + grads + states


# -- e: nccl -------------------------------------------------------------------------------


def _nccl_rows(work: Path, timer: DeviceTimer, quick: bool) -> list[Row]:
    """gpt in 2 stages on two GPUs, trained STEPS SGD steps against the original on the first:
    a LocalPipeline with a stage on each (StageStreams: copies between devices ordered by
    events), and 2 ranks of DistributedPipeline over NCCL (messages on the communication
    stream: [Note: communication stream] in runtime/devices.py)."""
    rows: list[Row] = [{"check": "e nccl", "case": case, "figure": "max rel. error", "goal": "<= 1e-5"} for case in
                       ("gpt 2 stages LocalPipeline on cuda:0 and cuda:1", "gpt 2 stages, 2 ranks over NCCL",
                        "gpt 2 stages, 2 ranks over NCCL, engine=pipelining")]
    if not timer.is_cuda:
        return [{**row, "status": "not run", "value": "CUDA only"} for row in rows]
    if torch.cuda.device_count() < 2:
        return [{**row, "status": "not run", "value": "one GPU: this needs two"} for row in rows]
    out = _compile(work, timer, "gpt", 2)
    errors = [_training_error(out, "examples/gpt.py", timer.device, ["cuda:0", "cuda:1"])] + [
        _distributed_error(out, "examples/gpt.py", work, timer.device, e) for e in ("partitioner", "pipelining")]
    return [{**row, "status": "ok" if error <= 1e-5 else "FAIL", "value": error} for row, error in zip(rows, errors)]


def _distributed_error(package: Path, path: str, work: Path, device: torch.device, engine: str = "partitioner"
                       ) -> float:
    """`_training_error` of 2 ranks of DistributedPipeline, one process per GPU over NCCL
    (on the CPU, gloo: tests/test_gpu_check.py), against the original on `device`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = work / "nccl.pt"
    torch.multiprocessing.start_processes(_nccl_rank, args=(str(package), path, port, str(result), engine), nprocs=2,
                                          start_method="spawn")
    got = torch.load(result)
    return _error(got["losses"], got["state"], *_original(model_file.load(path), device), device)


def _nccl_rank(rank: int, package: str, path: str, port: int, result: str, engine: str) -> None:
    """One rank of `_distributed_error`, in its spawned process; rank 0 saves the losses and weights."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    pipe = runtime.DistributedPipeline(package, engine=engine)
    mf = model_file.load(path)
    pipe.load_state_dict(mf.build(0).state_dict())
    inputs, target = _batch(mf, torch.device("cpu"))
    losses = _train_pipe(pipe, inputs, target)
    state = pipe.state_dict()  # collective
    if rank == 0:
        torch.save({"losses": losses, "state": state}, result)
    torch.distributed.destroy_process_group()


# -- helpers -------------------------------------------------------------------------------


def _to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
