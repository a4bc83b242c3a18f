"""Ranks of a multi-process test, forked from one process that imported torch once:
`python dist_worker.py N MODE OUTDIR MODEL_FILE PKG [PKG ...]` (rank r runs PKG[r % len]).

Forking right after `import torch` (nothing computed yet) saves each rank the seconds
of importing it.  Rank r writes OUTDIR/rank<r>.out and .err; the parent prints one line
`rank r: exit code` per rank and exits 0.

MODE check: train_step, forward and 3 SGD steps compared with the reference model run
in this same process; prints "RANK ok" and exits 0, or a traceback and exits 1.
A sharded parameter's gradient is compared with its shard of the reference gradient.
MODE train: clip_grad_norm_ and AdamW through make_optimizer (5 steps) against the
reference, then eval() and evaluate().  MODE drift: step safety (runtime/steps.py).  MODE fault: trains (PIPELINE_FAULT stops one rank); a PipelineError prints its message
and exits 3.  MODE tp: the unit checks of runtime/tp.py (tp_checks.py; PKG unused).
MODE memory: pipe.memory_stats() on this rank's stages (memory_checks.py); prints "RANK ok".
MODE peak: AdamW, a warm-up step, then one tracked step and opt.step(): prints "RANK peak TOTAL
PREDICTED" (memory_checks.tracked_step) and "RANK ok".
MODE short: as check, on the example batch's first SHORT_ROWS rows (a short last batch).
MODE scaler: an fp16-mixed package with runtime.GradScaler: a step with an inf gradient on the
last stage's rank is skipped on every rank, and every rank's scale halves (also when the
gradients are unscaled and clipped before the step).
MODE amp: a bf16-mixed or bf16 package, 3 SGD steps: losses and weights within the noise of the
original trained in that precision: twice its distance from fp32 ([Note: precision bounds] in
tests/precision_reference.py).
MODE dropout: tp = 2 (tests/model_files/tp_dropout.py), train mode: the dropout of the
replicated value draws the same mask on both tp ranks, that of the sharded value its own.
MODE local, localnone: each replica given only its own rows (local_rows_worker.py).
MODE parallelize: partitioner.parallelize on every rank, PKG its out= (parallelize_worker.py).
MODE engines, engine_refused: engine="pipelining" (engine_worker.py).  With PIPELINE_TEST_ENGINE=NAME set,
every mode runs its DistributedPipelines on that engine.
Once a rank fails, the others are killed after GRACE_S (as torchrun does).
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import signal
import sys
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed  # noqa: F401
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (autograd imports it lazily: ~1 s per rank)
import torch.nested._internal.nested_tensor  # noqa: F401
import torch._dynamo  # noqa: F401  (the optimizer's first step imports it: ~2 s per rank)
import torch.distributed.tensor  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import runtime  # noqa: E402
from runtime import outputs, package  # noqa: E402
from runtime.errors import PipelineError  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
GRACE_S = 2.0  # after the first failed rank, the others get this long to stop by themselves


def _model_file(path: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("_tiny_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _amp(pkg: str, model_path: str) -> None:
    from tests.precision_reference import Original, within_noise

    mf = _model_file(model_path)
    inputs, target = mf.example_inputs(), mf.example_target()
    precision = package.load_manifest(pkg).precision
    runs = []
    for mode in ("fp32", precision):
        torch.manual_seed(0)
        model = Original(mf.build_model(), mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            model.begin()
            loss = model.loss(mf.loss_fn, inputs, target)
            loss.backward()
            model.end()
            opt.step()
            losses.append(float(loss))
        runs.append((losses, model.state_dict()))
    torch.manual_seed(0)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(float(pipe.train_step(inputs, target)))
        opt.step()
    got = (losses, pipe.state_dict())

    def far(a, b):  # type: ignore[no-untyped-def]
        return (max(abs(x - y) for x, y in zip(a[0], b[0])),
                max(float((a[1][k].float() - b[1][k].float()).abs().max()) for k in b[1]))

    floor, off = far(runs[1], runs[0]), far(got, runs[1])
    assert floor[0] > 0 and within_noise(off[0], floor[0]) and within_noise(off[1], floor[1]), (off, floor)
    print(f"{pipe.rank} ok", flush=True)


def _scaler(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    torch.manual_seed(0)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = runtime.GradScaler("cpu")
    last = pipe.graph.num_stages - 1 in pipe.runners
    for step in range(3):
        opt.zero_grad()
        pipe.train_step(mf.example_inputs(), mf.example_target(), loss_fn=scaler.loss_fn(mf.loss_fn))
        if step == 1 and last:
            params[0].grad[0, 0] = float("inf")  # only the last stage's rank overflows
        before, scale = [p.detach().clone() for p in params], float(scaler.get_scale())
        if step > 0:  # unscaled (and checked) before clipping, as `partitioner run --clip` does
            scaler.unscale_(opt)
            pipe.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, params))
        assert moved == (step != 1), (step, moved)  # step 1 is skipped on every rank
        assert float(scaler.get_scale()) == (scale / 2 if step == 1 else scale), (step, scaler.get_scale())
    print(f"{pipe.rank} ok", flush=True)


def _dropout(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())
    mine: list[torch.Tensor] = []  # this rank's replicated y, microbatch by microbatch
    pipe.runners[0].module.register_forward_hook(lambda m, a, out: mine.append(out[0].detach()))
    with torch.no_grad():
        _, h = pipe(*mf.example_inputs())
    ys: list[torch.Tensor | None] = [None, None]
    torch.distributed.all_gather_object(ys, torch.cat(mine))
    assert torch.equal(ys[0], ys[1]), "the replicated value's masks differ between the tp ranks"
    first, second = (half == 0 for half in h.chunk(2, dim=1))  # each rank's shard's mask
    assert not torch.equal(first, second), "both shards of the sharded value drew the same mask"
    print(f"{pipe.rank} ok", flush=True)


def _short(pkg: str, model_path: str) -> None:
    _check(pkg, model_path, int(os.environ["SHORT_ROWS"]))


def _first_rows(value: object, rows: int | None) -> object:
    """`value`'s first `rows` rows along dim 0 (every tensor leaf); all of it for None."""
    cut = (lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.dim() else t)
    return value if rows is None else torch.utils._pytree.tree_map(cut, value)


def _check(pkg: str, model_path: str, rows: int | None = None) -> None:
    mf = _model_file(model_path)
    torch.manual_seed(0)
    model = mf.build_model()
    inputs, target = _first_rows(mf.example_inputs(), rows), _first_rows(mf.example_target(), rows)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    # one step: loss on every rank, every local gradient
    ref = mf.loss_fn(_call(model, inputs), target)
    ref.backward()
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    tp_index = pipe.tp_index
    loss = pipe.train_step(inputs, target)
    torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
    for spec, p in _my_parameters(pipe):
        expected = torch.zeros_like(p)  # this rank's shard of the reference gradient, cut as weights are
        package.load_stage_state([(spec, expected)], {spec.source_name: want[spec.source_name]}, pipe.manifest)
        torch.testing.assert_close(p.grad, expected, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"grad {spec.source_name} (tp index {tp_index}): {m}")
    # forward only, on every rank
    with torch.no_grad():
        got_out, want_out = pipe(inputs), _call(model, inputs)
        assert type(got_out).__qualname__ == type(want_out).__qualname__, (type(got_out), type(want_out))
        outputs.register_classes(want_out)  # a dataclass of the reference's model file, flattened as the pipeline's
        torch.testing.assert_close(torch.utils._pytree.tree_leaves(got_out), torch.utils._pytree.tree_leaves(want_out),
                                   rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(pipe.evaluate(inputs, target), mf.loss_fn(_call(model, inputs), target),
                                   rtol=RTOL, atol=ATOL)
    # three SGD steps, then the collective state_dict
    opt_ref = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(pipe.parameters())  # a stage may hold no parameters (only parameter-free ops)
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    for _ in range(3):
        opt_ref.zero_grad()
        mf.loss_fn(_call(model, inputs), target).backward()
        opt_ref.step()
        if opt is not None:
            opt.zero_grad()
        pipe.train_step(inputs, target)
        if opt is not None:
            opt.step()
    got, ref_sd = pipe.state_dict(), model.state_dict()
    assert set(got) == set(ref_sd), sorted(set(got) ^ set(ref_sd))
    for name in ref_sd:
        torch.testing.assert_close(got[name], ref_sd[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    rank = pipe.rank
    print(f"{rank} cpus {','.join(map(str, sorted(os.sched_getaffinity(0))))}", flush=True)
    # dropped, the pipeline is freed at once, process groups included: not left in a cycle
    # for the collection at exit (see runtime/distributed.py, _describer)
    held = weakref.ref(pipe)
    gc.disable()
    try:
        del pipe, params, opt
        assert held() is None, "the DistributedPipeline outlived its last reference (a reference cycle)"
    finally:
        gc.enable()
    print(f"{rank} ok", flush=True)


def _call(model: torch.nn.Module, inputs: object) -> object:
    """The model on example_inputs(): a tuple of positional arguments or a dict of keywords."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)  # type: ignore[arg-type]


def _my_parameters(pipe: runtime.DistributedPipeline) -> list[tuple[package.Held, torch.Tensor]]:
    """(resolved manifest entry, parameter) for this rank's parameters, each once."""
    seen: dict[int, tuple[package.Held, torch.Tensor]] = {}
    for s in pipe.stages:
        r = pipe.runners[s]
        names = {spec.name for spec in r.entry.parameters}
        for spec, t in package.stage_tensors(r.module, r.entry, pipe.tp_index):
            if spec.name in names:
                seen.setdefault(id(t), (spec, t))
    return list(seen.values())


def _train(pkg: str, model_path: str) -> None:
    """clip_grad_norm_ (the norm and the clipped gradients) and 5 AdamW steps through
    make_optimizer with two parameter groups, against the model in this process."""
    mf = _model_file(model_path)
    torch.manual_seed(0)
    model = mf.build_model()
    inputs, target = mf.example_inputs(), mf.example_target()
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    named = dict(model.named_parameters())
    groups = [{"params": [n for n in named if n.endswith("bias")], "weight_decay": 0.0},
              {"params": [n for n in named if not n.endswith("bias")]}]
    opt = pipe.make_optimizer(torch.optim.AdamW, groups, lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW([{**g, "params": [named[n] for n in g["params"]]} for g in groups], lr=1e-3,
                            weight_decay=0.1)
    for step in range(5):
        ref.zero_grad()
        mf.loss_fn(_call(model, inputs), target).backward()
        max_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) / 3
        want = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        ref.step()
        opt.zero_grad()
        pipe.train_step(inputs, target)
        got = pipe.clip_grad_norm_(max_norm)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0, msg=lambda m: f"norm of step {step}: {m}")
        if step == 0:
            grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
            for spec, p in _my_parameters(pipe):
                expected = torch.zeros_like(p)
                package.load_stage_state([(spec, expected)], {spec.source_name: grads[spec.source_name]}, pipe.manifest)
                torch.testing.assert_close(p.grad, expected, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"clipped grad {spec.source_name}: {m}")
            inf = pipe.clip_grad_norm_(1e9, norm_type=float("inf"))
            torch.testing.assert_close(inf, torch.nn.utils.get_total_norm(list(grads.values()), float("inf")),
                                       rtol=RTOL, atol=0.0)
        opt.step()
    if pipe.manifest.options.get("zero"):  # ZeRO-1: this replica keeps the state of its part only
        from torch.distributed.optim import ZeroRedundancyOptimizer

        assert isinstance(opt, ZeroRedundancyOptimizer), type(opt)
        kept = sum(t.numel() for s in opt.optim.state.values() for t in s.values() if t.dim() > 0)
        whole = 2 * sum(p.numel() for p in pipe.parameters())  # AdamW: exp_avg, exp_avg_sq
        print(f"{pipe.rank} optimizer state {kept} of {whole}", flush=True)
        assert 0 < kept < whole, (kept, whole)
    got_sd, want_sd = pipe.state_dict(), model.state_dict()
    for name in want_sd:
        torch.testing.assert_close(got_sd[name], want_sd[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    # evaluate: the whole-batch loss on every rank, no graph, no gradient touched
    assert pipe.eval() is pipe and not pipe.training and not any(r.module.training for r in pipe.runners.values())
    opt.zero_grad()
    loss = pipe.evaluate(inputs, target)
    assert not loss.requires_grad and all(p.grad is None for p in pipe.parameters())
    with torch.no_grad():
        torch.testing.assert_close(loss, mf.loss_fn(_call(model.eval(), inputs), target), rtol=RTOL, atol=ATOL)
    print(f"{pipe.rank} ok", flush=True)


def _drift(pkg: str, model_path: str) -> None:
    """Rank 1's step 2 fails on a bad batch, and rank 1 goes on: both ranks refuse the next
    step at once, naming both steps, and again until recover(); then they train as before."""
    from runtime.steps import StepError

    mf = _model_file(model_path)
    torch.manual_seed(0)
    model = mf.build_model()
    inputs, target = mf.example_inputs(), mf.example_target()
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    rank = pipe.rank
    pipe.train_step(inputs, target)
    if rank == 1:
        try:
            pipe.train_step((), target)  # no input 0: a BatchError before any message
        except PipelineError as exc:
            print(f"{rank} caught: {exc}", flush=True)
    for attempt in ("refused", "refused again"):
        start = time.monotonic()
        try:
            pipe.train_step(inputs, target)
        except StepError as exc:
            print(f"{rank} {attempt} in {time.monotonic() - start:.3f} s: {exc}", flush=True)
        else:
            raise AssertionError(f"rank {rank}: a step after the failed one was not refused")
    pipe.recover()
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.train_step(inputs, target)
    torch.testing.assert_close(loss, mf.loss_fn(_call(model, inputs), target).detach(), rtol=RTOL, atol=ATOL)
    print(f"{rank} ok", flush=True)


def _tp(pkg: str, model_path: str) -> None:
    import tp_checks  # beside this file

    torch.distributed.init_process_group("gloo")
    tp_checks.run(float(os.environ.get("PIPELINE_TIMEOUT_S", "20")))
    print(f"{torch.distributed.get_rank()} ok", flush=True)


def _fault(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    torch.manual_seed(0)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())
    for _ in range(2):
        pipe.train_step(mf.example_inputs(), mf.example_target())


def _memory(pkg: str, model_path: str) -> None:
    import memory_checks  # beside this file

    mf = _model_file(model_path)
    torch.manual_seed(0)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())
    stats = memory_checks.check_memory(pipe, mf.example_inputs(), mf.example_target())
    print(f"{pipe.rank} {stats}", flush=True)
    print(f"{pipe.rank} ok", flush=True)


def _peak(pkg: str, model_path: str) -> None:
    import memory_checks  # beside this file

    sys.path.insert(0, str(Path(model_path).parent))  # a zoo model file's helpers beside it
    mf = _model_file(model_path)
    torch.manual_seed(0)
    pipe = runtime.DistributedPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())
    stats = memory_checks.tracked_step(pipe, mf.example_inputs(), mf.example_target())
    print(f"{pipe.rank} peak {stats.total} {stats.predicted}", flush=True)
    print(f"{pipe.rank} ok", flush=True)


def _rank(r: int, mode: str, pkg: str, model_path: str, outdir: Path) -> int:
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(r)
    out = os.open(outdir / f"rank{r}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(outdir / f"rank{r}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    if os.environ.get("PIPELINE_TEST_ENGINE"):  # every mode on that engine (test_engines.py)
        runtime.DistributedPipeline = functools.partial(runtime.DistributedPipeline,  # type: ignore[misc]
                                                        engine=os.environ["PIPELINE_TEST_ENGINE"])
    try:
        import engine_worker  # beside this file: engine="pipelining"
        import local_rows_worker  # beside this file: the local=True modes
        import parallelize_worker  # beside this file: partitioner.parallelize on every rank

        {**local_rows_worker.MODES, **parallelize_worker.MODES, **engine_worker.MODES,
         "check": _check, "fault": _fault, "tp": _tp, "train": _train, "drift": _drift,
         "short": _short, "amp": _amp, "scaler": _scaler, "dropout": _dropout, "memory": _memory,
         "peak": _peak}[mode](pkg, model_path)
    except PipelineError as exc:
        print(f"PipelineError: {exc}", file=sys.stderr, flush=True)
        return 3
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    sys.stdout.flush()
    return 0


def main() -> int:
    n, mode, outdir, model_path, *pkgs = sys.argv[1:]
    children = {}
    for r in range(int(n)):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(r, mode, pkgs[r % len(pkgs)], model_path, Path(outdir)))  # skip teardown
        children[pid] = r
    codes: dict[int, int] = {}
    failed_at = None
    while children:  # like torchrun: once a rank fails, stop the others after a grace period
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for child in children:
                    os.kill(child, signal.SIGKILL)
            time.sleep(0.05)
            continue
        codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
        if any(codes.values()) and failed_at is None:
            failed_at = time.monotonic()
    for r in sorted(codes):
        print(f"rank {r}: {codes[r]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
