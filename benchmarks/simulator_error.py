"""How far the compiler's predicted step time is from the step the runtime really takes.

For every example model and the GPipe and 1F1B schedules, the model is compiled into 2
stages with measured costs (profiled afresh, `reprofile=True`), and the manifest's
`predicted.step_time_s` (the event simulation of the schedule over the profiled node
costs and the cpu profile's gloo alpha-beta) is compared with the median of N real
`runtime.DistributedPipeline.train_step` calls on 2 gloo processes on 127.0.0.1, after
warm-up steps, with a barrier before and after each step.  The cost of an empty step
(the two barriers alone) is measured the same way and subtracted, so the figure is the
step, not the harness.

The workers are spawned once, so the processes' start-up (importing torch, transformers)
is paid once, and run the packages in rounds (STEPS_PER_ROUND steps of each in turn): on
a shared VM the cost of a message drifts over seconds, and rounds let every package meet
the same slow and fast spells.  After every round the workers also measure the messages'
costs again, as the cpu profile did before the compile (`partitioner.cost.measure._loaded_exchange`).
Next to the step, each rank records the median forward and backward of its own
stage per microbatch (TRACED_STEPS traced steps after the timed ones), so a large error
can be traced to compute or to communication.  Columns:

- `error_pct`: (predicted - measured) / measured;
- `drift_x`: the stages' forward+backward per microbatch, timed on their own between the
  rounds exactly as the compile timed them (`cost.calibrate.time_forward_backward`, after the same
  idle), over what the compile measured: how much faster or slower the machine ran during
  the measurement than during the compile (a shared VM's speed drifts by a fifth over
  seconds);
- `reprofiled_error_pct`: the compile's own simulation fed with the profile taken during
  the run instead (`reprofiled_ms`): those stage times and the messages' costs measured
  between the rounds (medians over the rounds): the error of the cost model and
  simulator when the profile is taken in the same minutes as the steps, the machine's
  drift between compile and run taken out;
- `compute_x`: the stages' forward+backward as the runtime ran them inside the pipeline
  (traced; the last stage's loss included) over the same stages timed on their own during
  the run;
- `replay_error_pct`: the simulator fed with the traced stage times: what remains is the
  simulator's structure and message model, not node costs;
- `halves_pct`: how far apart the medians of the even and the odd rounds are, over the
  median (how well one run pins the step down: no error can be trusted below it);
- `spread_pct`: the interquartile range of the timed steps over their median (the noise).

`stage_ms` in the JSON holds the per-stage numbers, `samples_ms` every timed step.

Twice: at the examples' own batch (24 rows: steps of 7-25 ms, where a 1-4 ms stall of
one message on a shared 2-core CPU is a large share), and at LARGE_BATCH (`simulator_error_batch192`:
the same models with 8x the rows, through a model file of ours that sets the example's
`BATCH`), where the stages' compute outweighs the messages as it does in real training.

    python -m benchmarks.simulator_error [--quick] [--batch N] [--examples mlp,gpt] [--schedules 1f1b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .common import barrier_timed, free_port, profiled_here, save, spawn_ranks, table, update_docs

EXAMPLES = ("mlp", "gpt", "bert", "ncf", "skip", "hf_gpt2", "hf_bert")
SCHEDULES = ("gpipe", "1f1b")
WORLD = 2
DEADLINE_S = 900.0  # the workers, all packages together: killed after this
STEPS_PER_ROUND = 8  # timed steps of one package before the next one's
TRACED_STEPS = 4  # traced steps per package for the stage times
PROFILE_SAMPLES = 15  # per round, of each stage on its own (as calibrate_stages takes)
LARGE_BATCH = 192  # the second table: 8x the examples' batch, so that compute outweighs messages


# -- compile -------------------------------------------------------------------------------


def model_file(example: str, batch: int | None, work: Path) -> str:
    """The example's model file; at another batch, a file of ours that imports the
    example and sets its `BATCH` (every example's inputs and target are made of it)."""
    source = Path("examples") / f"{example}.py"
    if batch is None:
        return str(source)
    wrapper = work / f"{example}_batch{batch}.py"
    wrapper.write_text(
        f'"""{source} at batch {batch} (written by benchmarks.simulator_error)."""\n'
        "import importlib.util\n\n"
        f"_spec = importlib.util.spec_from_file_location('_example_{example}', {str(source.resolve())!r})\n"
        "_example = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_example)\n"
        f"_example.BATCH = {batch}\n"
        "build_model, example_inputs = _example.build_model, _example.example_inputs\n"
        "example_target, loss_fn = _example.example_target, _example.loss_fn\n")
    return str(wrapper)


def compile_case(example: str, schedule: str, work: Path, batch: int | None = None) -> dict[str, Any]:
    """Compile one example into 2 stages with measured costs; what the prediction says."""
    from driver.compile import compile_model
    from driver.options import CompileOptions
    from partitioner.cost.hardware import load_hardware
    from partitioner.predict.predict import tied_allreduce_s

    directory = work / f"{example}_{schedule}"
    start = time.perf_counter()
    compiled = compile_model(CompileOptions(model=model_file(example, batch, work), out=str(directory), stages=WORLD,
                                            schedule=schedule, quiet=True, reprofile=True))
    seconds = time.perf_counter() - start
    m = compiled.manifest
    costs = compiled.costs
    assert m.predicted is not None
    sent = {(int(i.source), st.index): 0 for st in m.stages for i in st.inputs if not i.from_batch}
    for st in m.stages:
        for i in st.inputs:
            if not i.from_batch:
                nbytes = torch.empty(0, dtype=getattr(torch, str(i.dtype))).element_size()
                for d in i.shape or ():
                    nbytes *= int(d)
                sent[(int(i.source), st.index)] += nbytes
    stages = [{"forward_ms": 1e3 * sum(costs[n].forward_s for n in s.nodes),
               "backward_ms": 1e3 * sum(costs[n].backward_s for n in s.nodes),
               "nodes": len(s.nodes)} for s in compiled.plan.stages]
    return {"example": example, "schedule": schedule, "dir": str(directory), "microbatches": m.microbatches,
            "predicted_ms": 1e3 * m.predicted.step_time_s, "compile_s": seconds, "batch": m.batch_size, "stages": stages,
            "tied_ms": 1e3 * tied_allreduce_s(compiled.traced.gm, compiled.plan, load_hardware("cpu")),
            "edges": [[a, b, n] for (a, b), n in sorted(sent.items())]}


def replay_ms(case: dict[str, Any], measured: dict[str, float], hw: Any) -> float | None:
    """The simulator fed with other stage times (`measured`: F0, B0, F1... in ms, the
    forward and backward of each stage per microbatch) and the profile's links, post
    costs, final all-reduce and tied-gradient all-reduces, as the compile predicted with
    its own stage times: what changes is only where the stage times come from."""
    from partitioner.predict.simulate import simulate

    n = len(case["stages"])
    try:
        fwd = [measured[f"F{k}"] / 1e3 for k in range(n)]
        bwd = [measured[f"B{k}"] / 1e3 for k in range(n)]
    except KeyError:
        return None
    alpha, beta = hw.p2p_alpha_s, hw.p2p_beta_s_per_byte
    links = {(a, b): alpha + nbytes * beta for a, b, nbytes in case["edges"]}
    final = hw.allreduce_latency_s or alpha
    return case["tied_ms"] + 1e3 * simulate(fwd, bwd, links, case["schedule"], n, case["microbatches"],
                                            send_s=hw.send_post_s, recv_s=hw.p2p_recv_post_s, final_s=final).step_time_s


# -- run -----------------------------------------------------------------------------------


def _worker(rank: int, port: int, store_port: int, dirs: list[str], warmup: int, steps: int, wait_s: float,
            out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), PIPELINE_TIMEOUT_S="60")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from datetime import timedelta

    from partitioner.cost.measure import _loaded_exchange

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    runs = [_Run(rank, d) for d in dirs]
    for run in runs:
        for _ in range(warmup):
            run.step()
    empty = [barrier_timed(lambda: None) for _ in range(max(steps, 10))]
    store = dist.TCPStore("127.0.0.1", store_port, WORLD, rank == 0, timedelta(seconds=60))
    group: Any = dist.group.WORLD
    links = []
    rounds = max(1, steps // STEPS_PER_ROUND)
    for _ in range(rounds):  # in rounds: every package meets the machine's slow and fast spells alike
        for run in runs:
            for _ in range(STEPS_PER_ROUND):
                run.samples.append(run.step())
            run.profile_now(wait_s)  # this rank's stages, timed as the compile timed them
        links.append(_loaded_exchange(group, store, rank, timedelta(seconds=60)))  # the messages, as the cpu profile
    link = [statistics.median(column) for column in zip(*links)] if rank == 0 else []
    results = [run.traced(Path(out).with_suffix(f".{i}.trace.json")) for i, run in enumerate(runs)]
    profiles: list[Any] = [None] * WORLD
    dist.all_gather_object(profiles, [run.profiled() for run in runs])
    for i, result in enumerate(results):
        result["profile_ms"] = {k: v for mine in profiles for k, v in mine[i].items()}
    if rank == 0:
        Path(out).write_text(json.dumps({"runs": results, "barrier_ms": 1e3 * statistics.median(empty),
                                         "link_us": [1e6 * x for x in link]}))
    dist.barrier()
    dist.destroy_process_group()


class _Run:
    """One package on this rank: its pipeline, inputs and timed steps."""

    def __init__(self, rank: int, directory: str) -> None:
        import runtime
        from runtime import package

        self.rank, self.directory = rank, directory
        self.pipe = runtime.DistributedPipeline(directory)
        source = self.pipe.manifest.source
        model_file = package.load_model_file(self.pipe.manifest, directory)
        torch.manual_seed(source.seed)
        model = getattr(model_file, source.entry)()
        self.pipe.load_state_dict(model.state_dict())
        self.inputs, self.target = model_file.example_inputs(), model_file.example_target()
        self.params = self.pipe.parameters()
        self.samples: list[float] = []
        # each stage's arguments of one microbatch, caught on their way in, to time the
        # stage on its own between rounds (profile_now)
        self.args: dict[int, tuple[Any, ...]] = {}
        self.profiles: dict[str, list[float]] = {}
        for s, runner in self.pipe.runners.items():
            runner.module.register_forward_pre_hook(_catch(self.args, s))

    def profile_now(self, wait_s: float) -> None:
        """Time this rank's stages on their own, as the compile's `calibrate_stages` timed
        their graphs (`cost.calibrate.time_forward_backward`, same idle before each): the profile the
        compile would have measured had it run now.  Gradients it leaves are cleared by the
        next step."""
        from partitioner.cost.calibrate import time_forward_backward

        for s, runner in self.pipe.runners.items():
            args = self.args.get(s)
            if args is None:
                continue
            fwd, bwd = time_forward_backward(lambda: runner.module(*args), PROFILE_SAMPLES, wait_s)
            self.profiles.setdefault(f"F{s}", []).append(1e3 * fwd)
            self.profiles.setdefault(f"B{s}", []).append(1e3 * bwd)

    def profiled(self) -> dict[str, float]:
        """The median over rounds of `profile_now`'s times (ms), F{s} and B{s}."""
        return {k: statistics.median(v) for k, v in self.profiles.items()}

    def step(self) -> float:
        """Seconds of one train_step between barriers, gradients cleared first."""
        for p in self.params:  # as optimizer.zero_grad(set_to_none=True) leaves them
            p.grad = None
        return barrier_timed(lambda: self.pipe.train_step(self.inputs, self.target))

    def traced(self, trace: Path) -> dict[str, Any]:
        """The timed steps, and (rank 0) the median forward and backward of each stage per
        microbatch over TRACED_STEPS traced steps, run by a second pipeline (the tracer's
        gather would distort the timed ones)."""
        import runtime

        traced = runtime.DistributedPipeline(self.directory, trace=str(trace))
        traced.load_state_dict(dict(self.pipe.state_dict()))
        for _ in range(TRACED_STEPS + 1):
            traced.train_step(self.inputs, self.target)
        stage_ms: dict[str, float] = {}
        if self.rank == 0:
            events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e["args"]["step"] >= 1]
            for kind in ("F", "B"):
                for s in sorted({e["tid"] for e in events}):
                    durs = [e["dur"] / 1e3 for e in events if e["cat"] == kind and e["tid"] == s]
                    if durs:
                        stage_ms[f"{kind}{s}"] = statistics.median(durs)
        return {"samples_ms": [1e3 * s for s in self.samples], "median_ms": 1e3 * statistics.median(self.samples),
                "stage_ms": stage_ms}


def _catch(caught: dict[int, tuple[Any, ...]], stage: int) -> Any:
    """A forward pre-hook keeping the first arguments `stage` meets in `caught` (detached).
    It holds the dict, not the _Run: a hook on the pipeline's module that held its owner
    would put the pipeline in a reference cycle (see runtime/distributed.py, _describer)."""
    def hook(_module: Any, args: tuple[Any, ...]) -> None:
        if stage not in caught:
            caught[stage] = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                                  for a in args)
    return hook


def run_all(dirs: list[str], warmup: int, steps: int, wait_s: float, work: Path) -> dict[str, Any]:
    """Spawn the 2 ranks once; every package in rounds; killed at the deadline."""
    out = work / "times.json"
    spawn_ranks(_worker, WORLD, (free_port(), free_port(), dirs, warmup, steps, wait_s, str(out)), DEADLINE_S)
    return dict(json.loads(out.read_text()))


# -- report --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated examples/ names")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--batch", type=int, default=None,
                        help=f"only this batch (default: the examples' own, then {LARGE_BATCH})")
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true", help="do not rewrite the block in docs/benchmarks.md")
    ns = parser.parse_args(argv)
    examples = [e for e in ns.examples.split(",") if e]
    schedules = [s for s in ns.schedules.split(",") if s]
    for batch in [ns.batch] if ns.batch else [None, LARGE_BATCH]:
        measure(examples, schedules, batch, ns.quick, not ns.no_docs)
    return 0


def measure(examples: list[str], schedules: list[str], batch: int | None, quick: bool, readme: bool) -> None:
    """Compile, run and compare every example and schedule at `batch` (None: the
    examples' own); print the table, save it and (`readme`) put it in docs/benchmarks.md as
    `simulator_error`, or `simulator_error_batch{batch}`."""
    name = "simulator_error" if batch is None else f"simulator_error_batch{batch}"
    warmup, steps = (2, 2 * STEPS_PER_ROUND) if quick else (3, 8 * STEPS_PER_ROUND)
    with profiled_here() as work:  # the cpu profile and node costs (reprofile) measured now, one thread
        from partitioner.cost.hardware import load_hardware

        hw = load_hardware("cpu")
        cases = []
        for example in examples:
            for schedule in schedules:
                cases.append(compile_case(example, schedule, work, batch))
                print(f"compiled {example} {schedule}: predicted {cases[-1]['predicted_ms']:.2f} ms "
                      f"({cases[-1]['compile_s']:.1f} s)", file=sys.stderr, flush=True)
        load_before = os.getloadavg()[0]
        measured = run_all([c["dir"] for c in cases], warmup, steps, hw.idle_before_compute_s, work)
        load = [load_before, os.getloadavg()[0]]
    send_us, recv_us, message_us = measured["link_us"]
    hw_run = dataclasses.replace(hw, p2p_send_post_s=send_us / 1e6, p2p_recv_post_s=recv_us / 1e6,
                                 intra_node_latency_s=message_us / 1e6)  # the messages as the run met them
    rows = []
    barrier_ms = measured["barrier_ms"]
    for case, got in zip(cases, measured["runs"]):
        step = got["median_ms"] - barrier_ms
        replay = replay_ms(case, got["stage_ms"], hw)
        ordered = sorted(got["samples_ms"])
        q1, q3 = ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]
        rounds = [got["samples_ms"][i:i + STEPS_PER_ROUND] for i in range(0, len(got["samples_ms"]), STEPS_PER_ROUND)]
        halves = [statistics.median([t for r in rounds[k::2] for t in r]) for k in (0, 1)] if len(rounds) > 1 else None
        reprofiled = replay_ms(case, got["profile_ms"], hw_run)
        n = len(case["stages"])
        compiled = sum(st["forward_ms"] + st["backward_ms"] for st in case["stages"])
        now, traced = ([got[key].get(f"{kind}{k}") for kind in "FB" for k in range(n)] for key in ("profile_ms", "stage_ms"))
        drift_x = sum(now) / compiled if None not in now else None
        compute_x = sum(traced) / sum(now) if None not in traced and None not in now else None
        rows.append({"example": case["example"], "schedule": case["schedule"], "microbatches": case["microbatches"],
                     "predicted_ms": case["predicted_ms"], "measured_ms": step,
                     "error_pct": 100.0 * (case["predicted_ms"] - step) / step,
                     "spread_pct": 100.0 * (q3 - q1) / step,
                     "halves_pct": None if halves is None else 100.0 * abs(halves[0] - halves[1]) / step,
                     "drift_x": drift_x, "reprofiled_ms": reprofiled,
                     "reprofiled_error_pct": None if reprofiled is None else 100.0 * (reprofiled - step) / step,
                     "replay_ms": replay, "replay_error_pct": None if replay is None else 100.0 * (replay - step) / step,
                     "compute_x": compute_x,
                     "raw_median_ms": got["median_ms"], "barrier_ms": barrier_ms,
                     "samples_ms": got["samples_ms"],
                     "stage_ms": {"predicted": case["stages"], "profiled_in_run": got["profile_ms"],
                                  "measured": got["stage_ms"]},
                     "edges": case["edges"], "tied_ms": case["tied_ms"]})
    mean_abs = statistics.fmean(abs(r["error_pct"]) for r in rows) if rows else 0.0
    halves = [r["halves_pct"] for r in rows if r["halves_pct"] is not None]
    mean_halves = statistics.fmean(halves) if halves else float("nan")
    text = table(rows, ["example", "schedule", "predicted_ms", "measured_ms", "error_pct", "drift_x",
                        "reprofiled_error_pct", "compute_x", "replay_error_pct", "halves_pct", "spread_pct"])

    def mean_abs_of(column: str) -> float:
        values = [abs(r[column]) for r in rows if r[column] is not None]
        return statistics.fmean(values) if values else float("nan")

    mean_replay, mean_reprofiled = mean_abs_of("replay_error_pct"), mean_abs_of("reprofiled_error_pct")
    bias = statistics.fmean(r["error_pct"] for r in rows) if rows else 0.0
    around = statistics.fmean(abs(r["error_pct"] - bias) for r in rows) if rows else 0.0
    sizes = sorted({c["batch"] for c in cases})
    at = f"the examples' own batch ({', '.join(map(str, sizes))})" if batch is None else f"batch {batch}"
    text += (f"\n\nAt {at}: mean absolute error of the prediction: **{mean_abs:.1f}%** over {len(rows)} runs (mean "
             f"signed error {bias:+.1f}%, and {around:.1f}% around it); with the stages and messages profiled again "
             f"during the run: **{mean_reprofiled:.1f}%**; of the simulator replaying the "
             f"stage times the runtime measured: {mean_replay:.1f}%; between the two halves of the measurement: "
             f"{mean_halves:.1f}%. Measured: median of "
             f"{steps} steps per package after {warmup} warm-up, in rounds of {STEPS_PER_ROUND} (every package in "
             f"turn), barrier cost subtracted; load average {load[0]:.1f} on {os.cpu_count()} CPUs. "
             f"Pipeline messages under load (posting a send / a receive / the message), as the cpu profile "
             f"measured them before the run: {hw.send_post_s * 1e6:.0f} / {hw.p2p_recv_post_s * 1e6:.0f} / "
             f"{hw.p2p_alpha_s * 1e6:.0f} us; measured again by the workers between the rounds (medians): "
             f"{send_us:.0f} / {recv_us:.0f} / {message_us:.0f} us.")
    print(text)
    save(name, rows, batch=batch, mean_abs_error_pct=mean_abs, mean_abs_replay_error_pct=mean_replay,
         mean_abs_reprofiled_error_pct=mean_reprofiled,
         mean_halves_pct=mean_halves, steps=steps,
         warmup=warmup,
         load_average=load, cpus=os.cpu_count(),
         link_in_run_us=measured["link_us"], mean_error_pct=bias, mean_abs_around_mean_pct=around,
         hardware={"p2p_alpha_s": hw.p2p_alpha_s, "p2p_bandwidth": hw.intra_node_bandwidth,
                   "p2p_send_post_s": hw.p2p_send_post_s, "p2p_recv_post_s": hw.p2p_recv_post_s,
                   "allreduce_alpha_s": hw.allreduce_latency_s, "allreduce_bandwidth": hw.allreduce_bandwidth,
                   "peak_flops": hw.peak_flops, "sources": list(hw.sources)})
    if readme:
        update_docs(name, text)


if __name__ == "__main__":
    sys.exit(main())
