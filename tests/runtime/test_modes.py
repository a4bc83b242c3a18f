"""pipe.train() / pipe.eval() / pipe.evaluate against the original model, on a compiled
model with dropout and batch norm (tests/model_files/dropout_bn.py): the generated code
writes their mode as `self.training` ([Note: modes in generated code] in partitioner/trace/modes.py)
and each microbatch draws its own seeded stream ([Note: dropout streams] in runtime/modes.py)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import runtime
from partitioner.trace import model_file

from ..conftest import compile_example
from .test_distributed import _ok, launch, multiproc

PATH = "tests/model_files/dropout_bn.py"
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The model in 2 stages, with 4 microbatches and with 1."""
    root = tmp_path_factory.mktemp("modes")
    return {m: _compile(root, m) for m in (4, 1)}


def _compile(root: Path, microbatches: int) -> Path:
    out = root / f"m{microbatches}"
    compile_example(PATH, out, stages=2, microbatches=microbatches)
    return out


def _setup(pkg: Path) -> tuple[runtime.LocalPipeline, torch.nn.Module, torch.Tensor, torch.Tensor]:
    mf = model_file.load(PATH)
    model = mf.build(0)
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    (x,), _ = mf.example_inputs()
    return pipe, model, x, mf.example_target()


def test_the_stage_code_follows_the_mode(compiled: dict[int, Path]) -> None:
    code = "".join(p.read_text() for p in sorted(compiled[4].glob("stage_*.py")))
    assert code.count("self.training") == 5  # three dropouts, the batch norm and its counter
    assert "0.25, True" not in code and "0.1, True" not in code


def test_eval_mode_equals_the_original_in_eval_mode(compiled: dict[int, Path]) -> None:
    pipe, model, x, target = _setup(compiled[4])
    assert pipe.training and pipe.eval() is pipe and not pipe.training
    assert not any(r.module.training for r in pipe.runners)
    model.eval()
    first, second = pipe(x), pipe(x)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, model(x), rtol=RTOL, atol=ATOL)
    loss = pipe.evaluate(x, target)
    assert not loss.requires_grad and all(p.grad is None for p in pipe.parameters())
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(model(x), target), rtol=RTOL, atol=ATOL)
    assert pipe.train() is pipe and pipe.training and all(r.module.training for r in pipe.runners)


def test_train_mode_drops_a_fraction_p_and_each_call_draws_anew(compiled: dict[int, Path]) -> None:
    pipe, _, x, _ = _setup(compiled[4])
    first, second = pipe(x), pipe(x)
    assert not torch.equal(first, second)
    kept = float((first != 0).float().mean())
    n, p = first.numel(), 0.25
    assert abs(kept - (1 - p)) < 3 * math.sqrt(p * (1 - p) / n), kept


def test_a_rerun_with_the_same_seed_reproduces_the_losses(compiled: dict[int, Path]) -> None:
    runs = []
    for _ in range(2):
        pipe, _, x, target = _setup(compiled[4])
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(float(pipe.train_step(x, target)))
            opt.step()
        runs.append(losses)
        torch.manual_seed(123)  # the caller's RNG does not matter
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3


def test_batch_norm_running_statistics_match_with_one_microbatch(compiled: dict[int, Path]) -> None:
    pipe, model, x, target = _setup(compiled[1])
    model.train()
    model(x)  # the running statistics of one training forward on the whole batch
    pipe.train_step(x, target)
    got, want = pipe.state_dict(), model.state_dict()
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


BN_PATH = "tests/model_files/batch_norm.py"  # batch norm and no dropout: training is deterministic


@pytest.fixture(scope="module")
def bn_compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """batch_norm.py in 2 stages, 4 microbatches of 8 rows."""
    out = tmp_path_factory.mktemp("bn") / "pkg"
    compile_example(BN_PATH, out, stages=2, microbatches=4)
    return out


def _train_bn(pkg: Path, steps: int, lr: float, split: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """`steps` SGD steps of the pipeline and of the original model, which runs the batch in
    `split` parts one after another, each part's mean loss / split (gradient accumulation)."""
    mf = model_file.load(BN_PATH)
    model = mf.build(0).train()
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    (x,), _ = mf.example_inputs()
    target = mf.example_target()
    ref, opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(pipe.parameters(), lr=lr)
    for _ in range(steps):
        ref.zero_grad()
        for xs, ts in zip(x.chunk(split), target.chunk(split)):
            (torch.nn.functional.mse_loss(model(xs), ts) / split).backward()
        ref.step()
        opt.zero_grad()
        pipe.train_step(x, target)
        opt.step()
    return pipe.state_dict(), model


def test_batch_norm_with_microbatches_is_the_original_run_on_each_microbatch(bn_compiled: Path) -> None:
    """Exact: with M = 4 each microbatch normalises by, and updates the running statistics
    with, its own mean and variance, as the original run on the 4 microbatches one after another."""
    got, model = _train_bn(bn_compiled, steps=5, lr=0.1, split=4)
    want = model.state_dict()
    assert int(got["bn.num_batches_tracked"]) == 20  # one update per microbatch
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_batch_norm_running_statistics_with_microbatches_are_close_to_the_original(bn_compiled: Path) -> None:
    """Close, not equal, to the original trained on the whole batch: once the running
    averages have forgotten their start (50 steps, momentum 0.1), the original's running
    mean and variance are the whole batch's, the pipeline's an exponential average of the 4
    microbatches' own, which lies between the smallest and the largest of them.  So the
    tolerance, per channel, is how far the microbatches' statistics lie from the whole
    batch's (taken from the original's batch-norm input at the end; the two trainings'
    weights differ a little, and this bound, exact for fixed weights, holds here with a
    margin of more than 2)."""
    got, model = _train_bn(bn_compiled, steps=50, lr=0.05, split=1)
    want = model.state_dict()
    (x,), _ = model_file.load(BN_PATH).example_inputs()
    with torch.no_grad():
        features = model.fc1(x)  # the batch norm's input
    for stat, of in (("running_mean", torch.mean), ("running_var", torch.var)):
        whole = of(features, 0)
        spread = torch.stack([(of(part, 0) - whole).abs() for part in features.chunk(4)]).amax(0)
        off = (got[f"bn.{stat}"] - want[f"bn.{stat}"]).abs()
        assert bool((off <= spread).all()), f"{stat}: {float((off / spread).max()):.2f} times the spread"
        assert not torch.equal(got[f"bn.{stat}"], want[f"bn.{stat}"])  # per microbatch: not the same
    start = torch.ones_like(want["bn.running_var"])  # the untrained running variance is far outside
    assert float(((start - want["bn.running_var"]).abs() > spread).float().mean()) > 0.5


# -- tensor parallelism: a stream per rank for a sharded value -----------------------------------

TP_PATH = "tests/model_files/tp_dropout.py"


@pytest.fixture(scope="module")
def tp_compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tp_dropout.py at tp = 2 in one stage: fc1 column-parallel, fc2 row-parallel (a100 costs)."""
    out = tmp_path_factory.mktemp("tp_modes") / "pkg"
    compile_example(TP_PATH, out, stages=1, tp=2)
    return out


def _tp_outputs(pkg: Path, train: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each lane's stage output (y, h made whole) of one `pipe(x)` on a fresh pipeline, and lane 0's first."""
    mf = model_file.load(TP_PATH)
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_state_dict(mf.build(0).state_dict())
    pipe.train(train)
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in pipe.lanes]
    for lane in pipe.lanes:
        lane.runners[0].module.register_forward_hook(
            lambda m, a, out, t=lane.index: seen[t].append(tuple(o.detach() for o in out)))
    (x,), _ = mf.example_inputs()
    with torch.no_grad():
        pipe(x)
    return [tuple(torch.cat(parts, dim=0) for parts in zip(*lane)) for lane in seen]  # microbatches joined


def test_the_dropout_of_a_shard_is_written_in_its_ranks_stream(tp_compiled: Path) -> None:
    code = (tp_compiled / "stage_0.py").read_text()
    assert code.count("with tp.rank_stream(") == 1, code  # the first dropout's input is sharded, the second's not
    shard = code.index("with tp.rank_stream(add.device, self.training):\n            dropout = F.dropout(add")
    assert code.index("dropout_1 = F.dropout(add_1") > shard
    assert "fc2_linear_partial = F.linear(dropout, " in code  # fc2 is row-parallel: dropout's input is sharded


def test_a_sharded_value_draws_a_mask_per_rank_and_a_replicated_one_the_same(tp_compiled: Path) -> None:
    (y0, h0), (y1, h1) = _tp_outputs(tp_compiled)
    assert torch.equal(y0, y1)  # replicated: the same mask on both tp ranks, so the lanes agree
    assert torch.equal(h0, h1)  # made whole by an all_gather
    mine, theirs = h0.chunk(2, dim=1)  # the two ranks' shards (fc1's rows split in two)
    assert not torch.equal(mine == 0, theirs == 0)  # one stream for both would give equal masks
    for dropped in (y0 == 0, mine == 0, theirs == 0):  # every value is >= 1 before its dropout (p = 0.5)
        n = dropped.numel()
        assert abs(float(dropped.float().mean()) - 0.5) < 3 * math.sqrt(0.25 / n)
    agree = float(((mine == 0) == (theirs == 0)).float().mean())
    assert abs(agree - 0.5) < 3 * math.sqrt(0.25 / mine.numel()), agree  # independent masks agree half the time


def test_tp_dropout_reruns_reproduce_and_eval_mode_drops_nothing(tp_compiled: Path) -> None:
    first, second = _tp_outputs(tp_compiled), _tp_outputs(tp_compiled)
    torch.manual_seed(123)  # the caller's RNG does not matter
    third = _tp_outputs(tp_compiled)
    for a, b, c in zip(first, second, third):
        assert all(torch.equal(u, v) and torch.equal(u, w) for u, v, w in zip(a, b, c))
    (y, h), _ = _tp_outputs(tp_compiled, train=False)
    model = model_file.load(TP_PATH).build(0).eval()
    (x,), _ = model_file.load(TP_PATH).example_inputs()
    want_y, want_h = model(x)
    assert bool((h >= 1).all())
    torch.testing.assert_close((y, h), (want_y, want_h), rtol=RTOL, atol=1e-5)


@multiproc
@pytest.mark.timeout(120)
def test_tp_ranks_in_processes_draw_a_mask_per_shard(tp_compiled: Path, tmp_path: Path) -> None:
    """The same on 2 gloo ranks (DistributedPipeline), one process per tp index (dist_worker.py, MODE dropout)."""
    model = tmp_path / "tp_dropout.py"
    shutil.copy(TP_PATH, model)
    _ok(launch(2, "dropout", [tp_compiled], model))


def test_a_cpu_forward_is_seeded_without_torch_manual_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """modes.seeded on the CPU draws what torch.manual_seed(seed) would, restores the
    caller's stream, and never calls torch.manual_seed, which on a CPU-only process
    records the caller's stack for CUDA's lazy seeding (0.5 ms a forward)."""
    from runtime import modes

    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    monkeypatch.setattr(torch, "manual_seed", lambda seed: pytest.fail("torch.manual_seed was called"))
    with modes.seeded(7, torch.device("cpu")):
        got = torch.rand(3)
    assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), before)
