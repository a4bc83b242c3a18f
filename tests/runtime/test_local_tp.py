"""Tensor parallelism in one process: `tp.Lanes` and `LocalPipeline` with tp > 1.

The lanes (threads, one per tensor-parallel index) run the same unit checks as the gloo
ranks of test_tp.py (tp_checks.py); compiled examples (split by the free-links profile,
so tiny models are cut) are compared with the original model as dist_worker.py does:
loss, each lane's gradient shards, the forward output and the weights after 3 SGD steps.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.utils._pytree as pytree

import runtime
from partitioner.trace import model_file
from runtime import package, tp
from runtime.errors import PeerError, PipelineError

from ..conftest import FREE_LINKS as FREE, compile_example
from ..fake_gpu import check_stages_on_fake_gpu
from . import tp_checks
from .tp_package import write_tp_package

RTOL, ATOL = 1e-5, 1e-6


def in_lanes(n: int, fn: Callable[[int, int], Any], timeout_s: float = 20.0) -> list[Any]:
    """fn(t, n) in each of n lanes (threads); every result, or the first lane's failure."""
    lanes = tp.Lanes(n, timeout_s)
    results: list[Any] = [None] * n
    failed: list[BaseException] = []

    def work(t: int) -> None:
        try:
            with tp.lane(lanes, t):
                results[t] = fn(t, n)
        except BaseException as exc:
            failed.append(exc)
            lanes.abort(t)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return results


# -- the in-process collectives ---------------------------------------------------------------


@pytest.mark.parametrize("check", [tp_checks.check_rank_and_size, tp_checks.check_all_reduce_and_copy,
                                   tp_checks.check_column_and_row_parallel_linear, tp_checks.check_blocks,
                                   tp_checks.check_vocab_shard, tp_checks.check_partial_sums],
                         ids=lambda c: c.__name__[6:])
def test_lanes_match_one_process(check: Callable[[int, int], None]) -> None:
    """Forward and backward of every function across 2 lanes (blocks=3 included)."""
    in_lanes(2, check)
    assert (tp.rank(), tp.size()) == (0, 1)  # the lanes leave this thread with no group


def test_lane_results_are_bitwise_equal_and_summed_in_lane_order() -> None:
    xs = [torch.randn(64, generator=torch.Generator().manual_seed(t)) * 10 ** t for t in range(3)]

    def run(t: int, n: int) -> tuple[torch.Tensor, ...]:
        x = xs[t].clone().requires_grad_(True)
        y = tp.all_reduce(x)
        w = tp.copy(x)
        (w * (t + 1)).sum().backward()
        return y.detach(), x.grad, tp.all_gather(xs[t].reshape(8, 8), 0, blocks=2)

    got = in_lanes(3, run)
    for y, grad, gathered in got:
        assert torch.equal(y, (xs[0] + xs[1]) + xs[2])
        assert torch.equal(grad, torch.full((64,), 6.0))
        assert torch.equal(gathered, tp.join_shards([x.reshape(8, 8) for x in xs], 0, blocks=2))


def test_backward_runs_in_each_lanes_own_thread() -> None:
    """The assumption lanes rest on: autograd runs a CPU backward in the calling thread."""
    def run(t: int, n: int) -> bool:
        seen: list[int] = []
        x = torch.ones(3, requires_grad=True)
        y = tp.copy(x)
        y.register_hook(lambda g: seen.append(threading.get_ident()))
        y.sum().backward()
        return seen == [threading.get_ident()]

    assert in_lanes(2, run) == [True, True]


def test_a_failed_lane_stops_the_others() -> None:
    def run(t: int, n: int) -> None:
        if t == 1:
            raise ValueError("lane 1 broke")
        tp.all_reduce(torch.ones(2))

    with pytest.raises(ValueError, match="lane 1 broke"):
        in_lanes(2, run)
    lanes = tp.Lanes(2, 20.0)
    lanes.abort(1)
    with tp.lane(lanes, 0), pytest.raises(PeerError, match=r"lane 0 of 2 stopped in the tensor-parallel "
                                                           r"all_reduce: lane 1 failed"):
        tp.all_reduce(torch.ones(2))


def test_a_silent_lane_times_out() -> None:
    def run(t: int, n: int) -> None:
        if t == 0:
            tp.all_gather(torch.ones(2), 0)

    with pytest.raises(PeerError, match=r"lane 0 of 2 timed out in the tensor-parallel all_gather: another lane did "
                                        r"not reach it in 0.2 s"):
        in_lanes(2, run, timeout_s=0.2)


def test_lanes_in_different_collectives_raise() -> None:
    def run(t: int, n: int) -> None:
        tp.all_reduce(torch.ones(2)) if t == 0 else tp.all_gather(torch.ones(2), 0)

    with pytest.raises(PipelineError, match=r"the lanes met in different collectives"):
        in_lanes(2, run)


# -- LocalPipeline with tp > 1 ------------------------------------------------------------------


def _call(model: Any, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def check_pipeline(pkg: Path, mf: Any, model: torch.nn.Module, inputs: Any, target: Any,
                   loss_fn: Callable[[Any, Any], torch.Tensor], **options: Any) -> None:
    """Loss, every lane's gradient shards, forward output, 3 SGD steps: as the model."""
    pipe = runtime.LocalPipeline(pkg, **options)
    T = pipe.manifest.mesh.tp
    assert len(pipe.lanes) == T > 1
    pipe.load_state_dict(model.state_dict())
    # 1. one step: the loss, and each lane's shard of every reference gradient
    ref = loss_fn(_call(model, inputs), target)
    ref.backward()
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    torch.testing.assert_close(pipe.train_step(inputs, target), ref.detach(), rtol=RTOL, atol=ATOL)
    for lane in pipe.lanes:
        for r in lane.runners:
            names = {spec.name for spec in r.entry.parameters}
            for spec, p in package.stage_tensors(r.module, r.entry, lane.index):
                if spec.name not in names:
                    continue
                expected = torch.zeros_like(p)  # this lane's shard of the reference gradient
                package.load_stage_state([(spec, expected)], {spec.source_name: want[spec.source_name]},
                                         pipe.manifest)
                torch.testing.assert_close(p.grad, expected, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"grad {spec.source_name} (lane {lane.index}): {m}")
    # 2. forward only
    with torch.no_grad():
        torch.testing.assert_close(pytree.tree_leaves(pipe(inputs)), pytree.tree_leaves(_call(model, inputs)),
                                   rtol=RTOL, atol=ATOL)
    # 3. three SGD steps on every lane's parameters
    opt_ref, opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        opt_ref.zero_grad()
        loss_fn(_call(model, inputs), target).backward()
        opt_ref.step()
        opt.zero_grad()
        pipe.train_step(inputs, target)
        opt.step()
    got, ref_sd = pipe.state_dict(), model.state_dict()
    assert set(got) == set(ref_sd), sorted(set(got) ^ set(ref_sd))
    for name in ref_sd:
        torch.testing.assert_close(got[name], ref_sd[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    # replicated parameters stay bitwise the same in every lane
    copies: dict[tuple[int, str], list[torch.Tensor]] = {}
    for lane in pipe.lanes:
        for k, r in enumerate(lane.runners):
            for spec in r.entry.parameters:
                if spec.shard.count == 1:
                    copies.setdefault((k, spec.name), []).append(getattr(r.module, spec.name))
    for (k, name), ps in copies.items():
        assert all(torch.equal(p, ps[0]) for p in ps), f"stage {k}'s replicated {name} differs between lanes"


CASES = [
    ("gpt", {"stages": 1}),
    ("gpt", {"stages": 2}),
    ("hf_gpt2", {"stages": 1}),
    ("bert", {"stages": 1, "dp": 2}),
    ("mlp", {"stages": 2, "schedule": "gpipe"}),
    ("mlp", {"stages": 2, "schedule": "1f1b"}),
]


@pytest.mark.parametrize("example, options", CASES,
                         ids=[f"{e}-" + "-".join(f"{k}{v}" for k, v in o.items()) for e, o in CASES])
def test_compiled_example_with_tp2_matches_the_model(example: str, options: dict[str, Any], tmp_path: Path) -> None:
    path = f"examples/{example}.py"
    compiled = compile_example(path, tmp_path / "pkg", tp=2, hardware=FREE, **options)
    assert compiled.manifest.tensor_parallel["rules"], "the test needs something split"
    check_stages_on_fake_gpu(tmp_path / "pkg")  # every device in the stage code follows the stage's
    mf = model_file.load(path)
    args, kwargs = mf.example_inputs()
    check_pipeline(tmp_path / "pkg", mf, mf.build(0), kwargs if kwargs else args, mf.example_target(), mf.loss_fn())


@pytest.mark.parametrize("stages", [1, 2])
def test_hand_written_tp_package_matches_the_model(stages: int, tmp_path: Path) -> None:
    """tp_package.py's TpNet: vocabulary-parallel embedding tied to the head across stages."""
    pkg = write_tp_package(tmp_path, stages=stages, tp=2, microbatches=2)
    mf = package.load_model_file(package.load_manifest(pkg), pkg)
    torch.manual_seed(0)
    model = mf.build_model()
    check_pipeline(pkg, mf, model, mf.example_inputs(), mf.example_target(), mf.loss_fn)


def test_tp_on_cuda_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = write_tp_package(tmp_path, stages=2, tp=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(PipelineError, match=r"compiled with tp=2, which LocalPipeline runs as 2 threads on the CPU "
                                            r"only .* DistributedPipeline under torchrun \(`python -m partitioner "
                                            r"run .* --nproc 4`\)"):
        runtime.LocalPipeline(pkg, device="cuda:0")


def test_a_failing_lane_raises_its_own_error(tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path, stages=1, tp=2)
    mf = package.load_model_file(package.load_manifest(pkg), pkg)
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_state_dict(mf.build_model().state_dict())

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if tp.rank() == 1:
            raise ValueError("the loss of lane 1 failed")
        return torch.nn.functional.cross_entropy(out, target)

    with pytest.raises(ValueError, match="the loss of lane 1 failed"):
        pipe.train_step(mf.example_inputs(), mf.example_target(), loss_fn)
    # the next step runs (the group is reset, nothing is left in flight)
    pipe.train_step(mf.example_inputs(), mf.example_target())
