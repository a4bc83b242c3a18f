"""Precisions ([Note: mixed precision], [Note: bf16 with master weights] in
runtime/precision.py): `--precision bf16-mixed` trains like the original model under the
same autocast, and `bf16` like the original in bfloat16 with float32 masters, to within
the precision's noise ([Note: precision bounds] in tests/precision_reference.py: twice
the original's own distance from fp32, measured in the same test); an unknown precision
and autocast written inside the model are refused."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import fmean
from typing import Any, Callable

import pytest
import torch
import torch.utils._pytree as pytree

import runtime
from partitioner.errors import PartitionerError
from partitioner.trace import model_file
from runtime.manifest import Manifest

from .conftest import ROOT, compile_example
from .precision_reference import UNIT_ROUNDOFF, Original, within_noise
from .runtime.test_distributed import _ok, launch

STEPS, LR = 5, 0.05


def _train_original(path: str, precision: str, microbatches: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The original model, SGD on the example batch, trained as `precision` trains it
    (fp16-mixed: with torch.amp.GradScaler); with `microbatches` > 1, by gradient
    accumulation over the pipeline's microbatches."""
    mf = model_file.load(path)
    model = Original(mf.build(0), precision)
    (args, kwargs), target, loss_fn = mf.example_inputs(), mf.example_target(), mf.loss_fn()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16-mixed")
    cut = lambda v, i: v.tensor_split(microbatches)[i] if isinstance(v, torch.Tensor) else v  # noqa: E731
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        model.begin()
        total = 0.0
        for i in range(microbatches):
            a, k = pytree.tree_map(lambda v: cut(v, i), (args, kwargs))
            loss = model.loss(loss_fn, k or a, pytree.tree_map(lambda v: cut(v, i), target)) / microbatches
            scaler.scale(loss).backward()
            total += float(loss.detach())
        model.end()
        scaler.step(opt)
        scaler.update()
        losses.append(total)
    return losses, model.state_dict()


def _train_pipeline(path: str, pkg: Path, scaled: bool = False,
                    wrong: Callable[[runtime.LocalPipeline], None] | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The package trained as `_train_original` trains the original; `wrong` breaks the
    pipeline first (hooks on its stages), for the tests that the bounds can fail."""
    mf = model_file.load(path)
    pipe = runtime.LocalPipeline(str(pkg))
    if wrong is not None:
        wrong(pipe)
    pipe.load_state_dict(mf.build(0).state_dict())
    (args, kwargs), target = mf.example_inputs(), mf.example_target()
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    scaler = runtime.GradScaler("cpu", enabled=scaled)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = pipe.train_step(kwargs or args, target, loss_fn=scaler.loss_fn(mf.loss_fn()))
        losses.append(float(loss) / float(scaler.get_scale()) if scaled else float(loss))
        scaler.step(opt)
        scaler.update()
    return losses, pipe.state_dict()


def _distance(a: tuple[list[float], dict[str, torch.Tensor]], b: tuple[list[float], dict[str, torch.Tensor]],
              over_steps: Callable[[list[float]], float] = max) -> tuple[float, float]:
    """(the loss differences over the steps, reduced by `over_steps`; largest weight difference)."""
    loss = over_steps([abs(x - y) for x, y in zip(a[0], b[0])])
    weight = max(float((a[1][k].float() - b[1][k].float()).abs().max()) for k in b[1])
    return loss, weight


def _floor(fp32: tuple[list[float], dict[str, torch.Tensor]], *runs: tuple[list[float], dict[str, torch.Tensor]],
           over_steps: Callable[[list[float]], float] = max) -> tuple[float, float]:
    """The noise floor: the largest distance of the original's `runs` (under the precision)
    from its fp32 run, losses and weights apart ([Note: precision bounds])."""
    spread = [_distance(run, fp32, over_steps) for run in runs]
    return max(d[0] for d in spread), max(d[1] for d in spread)


def _within(got: tuple[list[float], dict[str, torch.Tensor]], ref: tuple[list[float], dict[str, torch.Tensor]],
            floor: tuple[float, float], over_steps: Callable[[list[float]], float] = max) -> bool:
    """Whether `got`'s losses and weights are within the noise `floor` of the run `ref`."""
    off = _distance(got, ref, over_steps)
    return within_noise(off[0], floor[0]) and within_noise(off[1], floor[1])


def _first_gradients(path: str, amp: bool, pkg: Path | None = None) -> dict[str, torch.Tensor]:
    """The gradients of one step on the example batch, by original name: of the original on
    the whole batch (under bf16 autocast or not), or of the pipeline `pkg`."""
    mf = model_file.load(path)
    model = mf.build(0)
    (args, kwargs), target, loss_fn = mf.example_inputs(), mf.example_target(), mf.loss_fn()
    if pkg is not None:
        pipe = runtime.LocalPipeline(str(pkg))
        pipe.load_state_dict(model.state_dict())
        pipe.train_step(kwargs or args, target, loss_fn=loss_fn)
        return {n: p.grad for n, p in pipe.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss_fn(model(*args, **kwargs), target).backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}  # a tied weight by each name


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |b| over a's names (every parameter of the pipeline, once)."""
    diff = torch.cat([(a[n] - b[n]).flatten() for n in a])
    return float(diff.norm() / torch.cat([b[n].flatten() for n in a]).norm())


@pytest.mark.parametrize("example", ["mlp", "gpt", "hf_gpt2"])
def test_bf16_mixed_trains_like_the_original_under_autocast(example: str, tmp_path: Path) -> None:
    """[Note: mixed precision] The pipeline runs each microbatch's forward and backward under
    autocast, so it is the original trained on the same microbatches under autocast, to
    fp32's summation order and the kernels' blocking of a microbatch; against the original
    under autocast on the whole batch, bf16 rounds each microbatch's weight gradient
    instead.  Both runs of the original and the pipeline are draws of bf16's noise around
    fp32: the pipeline is within twice the original's distance from fp32 of either
    ([Note: precision bounds]).  That the pipeline runs under autocast at all is seen where
    the runs have not yet drifted apart: the first loss (one forward, the same bf16 work
    per row) and the first step's gradients are nearer the whole-batch autocast run than
    fp32's (a pipeline that ignored autocast passes the noise bound alone)."""
    path = f"examples/{example}.py"
    compiled = compile_example(path, tmp_path / "pkg", stages=2, microbatches=4, precision="bf16-mixed")
    assert compiled.manifest.precision == "bf16-mixed"
    fp32, amp = _train_original(path, "fp32"), _train_original(path, "bf16-mixed")
    amp_accumulated = _train_original(path, "bf16-mixed", microbatches=4)
    got = _train_pipeline(path, tmp_path / "pkg")
    floor = _floor(fp32, amp, amp_accumulated)
    assert floor[0] > 0 and floor[1] > 0, "autocast changed nothing: the test would prove nothing"
    for ref in (amp_accumulated, amp):
        assert _within(got, ref, floor), (_distance(got, ref), floor)
    _assert_autocast_ran(got, amp, fp32)
    mine = _first_gradients(path, True, tmp_path / "pkg")
    to_whole, to_fp32 = _relative(mine, _first_gradients(path, True)), _relative(mine, _first_gradients(path, False))
    assert to_whole < to_fp32, (to_whole, to_fp32)


def _assert_autocast_ran(got: tuple[list[float], dict[str, torch.Tensor]], amp: tuple[list[float], dict[str, torch.Tensor]],
                         fp32: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    """The first loss nearer the original's under autocast than its fp32 one: the same bf16
    roundings but those a kernel's accumulation order flips (one in about 2^16 values, where
    fp32's last bits decide a bf16 rounding), against autocast's rounding of every value."""
    assert abs(got[0][0] - amp[0][0]) < abs(fp32[0][0] - amp[0][0]) / 2, (got[0][0], amp[0][0], fp32[0][0])


@pytest.mark.parametrize("example", ["mlp", "gpt", "hf_gpt2"])
def test_bf16_with_master_weights_trains_like_the_original_in_bf16(example: str, tmp_path: Path) -> None:
    """--precision bf16: bfloat16 stages, float32 masters ([Note: bf16 with master weights]).

    The original trained the same way (bf16, float32 masters, the pipeline's 4 microbatches
    accumulated) is the reference.  Where every gradient is summed in the same order (the
    MLP) the pipeline equals it bit for bit.  Where the order differs (the tied wte/lm_head
    copies sum on two stages) a last-bit change of one bf16 gradient flips the rounding of
    a weight, and within a few steps the runs differ as much as any two bf16 runs do: the
    pipeline must then be within the noise of the reference ([Note: precision bounds]):
    twice the original's own runs' (bf16 on the whole batch, bf16 accumulated) distance
    from fp32, its weights by the largest difference, its losses by the mean difference
    over the steps (the largest of five such values is one draw of that noise, not a
    bound on it)."""
    path = f"examples/{example}.py"
    manifest = compile_example(path, tmp_path / "pkg", stages=2, microbatches=4, precision="bf16").manifest
    assert {p.dtype for s in manifest.stages for p in s.parameters} == {"bfloat16"}
    fp32, whole = _train_original(path, "fp32"), _train_original(path, "bf16")
    accumulated = _train_original(path, "bf16", microbatches=4)
    got = _train_pipeline(path, tmp_path / "pkg")
    assert all(v.dtype == torch.float32 for v in got[1].values() if v.is_floating_point()), "state_dict: not the masters"
    floor = _floor(fp32, whole, accumulated, over_steps=fmean)
    assert floor[0] > 0 and floor[1] > 0, "bf16 changed nothing: the test would prove nothing"
    assert _within(got, accumulated, floor, fmean), (_distance(got, accumulated, fmean), floor)
    off_loss, off_weight = _distance(got, accumulated, fmean)
    if example == "mlp":  # no tied weights: the same sums in the same order
        assert off_weight == 0 and off_loss <= 1e-6 * abs(accumulated[0][-1]), (off_loss, off_weight)


@pytest.mark.parametrize("example", ["mlp", "gpt"])
def test_fp16_mixed_with_the_scaler_trains_like_the_original(example: str, tmp_path: Path) -> None:
    """runtime.GradScaler against torch.amp.GradScaler on the original under fp16 autocast,
    within fp16's noise ([Note: precision bounds])."""
    path = f"examples/{example}.py"
    compile_example(path, tmp_path / "pkg", stages=2, microbatches=4, precision="fp16-mixed")
    fp32 = _train_original(path, "fp32")
    amp = _train_original(path, "fp16-mixed", microbatches=4)
    got = _train_pipeline(path, tmp_path / "pkg", scaled=True)
    floor = _floor(fp32, _train_original(path, "fp16-mixed"), amp)
    assert floor[0] > 0 and floor[1] > 0
    assert _within(got, amp, floor), (_distance(got, amp), floor)


def _skewer(relative: float) -> Callable[[runtime.LocalPipeline], None]:
    """What breaks a pipeline by stage 0's hand-over off by `relative` on every value, up
    or down by feature (a fixed pattern over the last dimension: a scale of the whole, a
    layer norm would take out again)."""

    def skew(t: torch.Tensor) -> torch.Tensor:
        signs = torch.randint(0, 2, t.shape[-1:], generator=torch.Generator().manual_seed(0)) * 2 - 1  # (features,)
        return t * (1 + relative * signs.to(t.dtype))

    def wrong(pipe: runtime.LocalPipeline) -> None:
        pipe.lanes[0].runners[0].module.register_forward_hook(
            lambda m, a, out: pytree.tree_map(lambda t: skew(t) if torch.is_floating_point(t) else t, out))

    return wrong


def _lose_a_microbatch(pipe: runtime.LocalPipeline) -> None:
    """The last of the 4 microbatches' hand-over lost: zeros arrive at stage 1."""
    calls = [0]

    def hook(m: torch.nn.Module, a: Any, out: Any) -> Any:
        calls[0] += 1
        lost = calls[0] % 4 == 0
        return pytree.tree_map(lambda t: t * 0 if lost and torch.is_floating_point(t) else t, out)

    pipe.lanes[0].runners[0].module.register_forward_hook(hook)


@pytest.mark.parametrize("wrong", ["skewed", "lost"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_wrong_pipeline_fails_the_noise_bound(precision: str, wrong: str, tmp_path: Path) -> None:
    """The bound of [Note: precision bounds] can fail: the GPT's pipeline with stage 0's
    hand-over off by 8 u relative (bf16: 3.1e-2; fp16: 3.9e-3; the weights then land 7-7.5
    times the floor away, 3.5 times past the bound), or with a microbatch lost (hundreds of
    times the floor), is outside it; the same pipeline unbroken is inside (the tests above).
    An error of 2.5 u (1e-2 in bf16) lands near the bound: it is the size of the rounding
    that every bf16 operation makes, which no end-to-end check can tell from noise."""
    path, scaled, u = "examples/gpt.py", precision == "fp16-mixed", UNIT_ROUNDOFF[precision]
    compile_example(path, tmp_path / "pkg", stages=2, microbatches=4, precision=precision)
    fp32, whole = _train_original(path, "fp32"), _train_original(path, precision)
    accumulated = _train_original(path, precision, microbatches=4)
    floor = _floor(fp32, whole, accumulated)
    assert floor[0] < u * abs(fp32[0][-1]), (floor, fp32[0])  # a floor of rounding, not of a bug
    broken = _train_pipeline(path, tmp_path / "pkg", scaled, _skewer(8 * u) if wrong == "skewed" else _lose_a_microbatch)
    assert not _within(broken, accumulated, floor), (_distance(broken, accumulated), floor)


def test_a_pipeline_that_ignores_autocast_is_caught(tmp_path: Path) -> None:
    """An fp32 package where bf16-mixed was asked passes the noise bound alone (the MLP's
    fp32 run is within it), not the first loss's check."""
    path = "examples/mlp.py"
    compile_example(path, tmp_path / "pkg", stages=2, microbatches=4)
    fp32, amp = _train_original(path, "fp32"), _train_original(path, "bf16-mixed")
    with pytest.raises(AssertionError):
        _assert_autocast_ran(_train_pipeline(path, tmp_path / "pkg"), amp, fp32)


def test_bf16_mixed_boundaries_carry_the_autocast_dtype(tmp_path: Path) -> None:
    """The MLP's hand-over is a Linear's output: bfloat16 under autocast, so its message is half the bytes."""
    fp32 = compile_example("examples/mlp.py", tmp_path / "fp32", stages=2).manifest
    bf16 = compile_example("examples/mlp.py", tmp_path / "bf16", stages=2, precision="bf16-mixed").manifest
    assert "precision" not in fp32.to_dict()
    assert [o.dtype for o in bf16.stages[0].outputs] == ["bfloat16"]
    send = [s.send_bytes for s in bf16.predicted.stages], [s.send_bytes for s in fp32.predicted.stages]
    assert send[0][0] * 2 == send[1][0], send


@pytest.mark.multiproc
def test_a_step_skipped_on_one_rank_is_skipped_on_all(tmp_path: Path) -> None:
    """fp16-mixed on 2 ranks: an inf in the last stage's gradients skips the step on both
    ranks, and both halve their scale ([Note: a global loss scale])."""
    compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, precision="fp16-mixed")
    copy = tmp_path / "mlp.py"
    shutil.copy(ROOT / "examples" / "mlp.py", copy)
    _ok(launch(2, "scaler", [tmp_path / "pkg"], copy, deadline_s=90))


@pytest.mark.multiproc
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_bf16_on_two_ranks(precision: str, tmp_path: Path) -> None:
    """Under autocast a stage sends the dtype its manifest names (the MLP once sent bfloat16
    where it said float32); and bf16 with master weights on two ranks."""
    compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, precision=precision)
    copy = tmp_path / "mlp.py"
    shutil.copy(ROOT / "examples" / "mlp.py", copy)
    _ok(launch(2, "amp", [tmp_path / "pkg"], copy, deadline_s=90))


def _clipped_sgd(path: str, clip: float | None, steps: int, lr: float) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of each SGD step of the original in fp32."""
    mf = model_file.load(path)
    model = mf.build(0)
    (args, _), target, loss_fn = mf.example_inputs(), mf.example_target(), mf.loss_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*args), target)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        opt.step()
        out.append((float(loss), float(norm)))
    return out


def test_a_rank_without_parameters_joins_one_check_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """unscale_(None) makes the global check; step(None) after it does not make it again."""
    scaler = runtime.GradScaler("cpu")
    checks: list[float] = []

    def check(found: torch.Tensor) -> torch.Tensor:
        checks.append(float(found))
        return found

    monkeypatch.setattr(scaler, "_global", check)
    for unscale_first in (False, True, False):
        if unscale_first:
            scaler.unscale_(None)
        scaler.step(None)
        scaler.update()
    assert checks == [0.0, 0.0, 0.0]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_run_clips_an_fp16_mixed_package(tmp_path: Path) -> None:
    """`partitioner run --clip` on an fp16-mixed package, 2 ranks: the scaler unscales the
    gradients (and makes its global inf check) before `pipe.clip_grad_norm_`, so the printed
    norm is the true gradient's and the losses follow the original's clipped SGD.  The
    tolerance is steps x u of fp16 (2^-9, about 2e-3): each step's loss and norm carry
    fp16's rounding, and SGD carries it into the next step, so the error grows like n u
    ([Note: precision bounds] in tests/precision_reference.py).  The original under fp16
    autocast is 1e-4 off fp32 here; the unclipped run is more than 1e-2 away (5 times the
    tolerance: the first assert), and a scaled norm 65536 times."""
    path, steps, lr, clip = "examples/mlp.py", 4, 0.5, 0.05
    compile_example(path, tmp_path / "pkg", stages=2, precision="fp16-mixed")
    cmd = [sys.executable, "-m", "partitioner", "run", str(tmp_path / "pkg"), "--nproc", "2", "--steps", str(steps),
           "--lr", str(lr), "--clip", str(clip)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [(float(a), float(b)) for a, b in re.findall(r"^step \d+  loss (\S+)  norm (\S+)  time", proc.stdout, re.M)]
    want, unclipped = _clipped_sgd(path, clip, steps, lr), _clipped_sgd(path, None, steps, lr)
    assert len(got) == steps and all(math.isfinite(x) for pair in got for x in pair), proc.stdout
    assert want[0][1] > clip and abs(unclipped[-1][0] - want[-1][0]) > 1e-2 * want[-1][0]  # clipping matters here
    rel = steps * UNIT_ROUNDOFF["fp16-mixed"]
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(want_loss, rel=rel) and norm == pytest.approx(want_norm, rel=rel), \
            (step, got, want)


def test_an_unknown_precision_is_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "partitioner", "compile", "examples/mlp.py", "--out",
                          str(tmp_path / "pkg"), "--precision", "fp8", "--analytic", "--hardware", "a100"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    said = " ".join(run.stderr.split())  # one paragraph, wrapped
    assert "is unknown" in said and "available are fp32, bf16-mixed, bf16, fp16-mixed" in said
    assert "Traceback" not in said
    assert not (tmp_path / "pkg").exists()


def _boundaries(pkg: Path) -> list[Any]:
    """Each stage's inputs and outputs (name, shape, dtype, from / to) and the bytes it
    sends and receives per microbatch, from the package's manifest."""
    manifest = Manifest.from_json((pkg / "manifest.json").read_text())
    assert manifest.predicted is not None
    return [(s.inputs, s.outputs, p.send_bytes, p.recv_bytes)
            for s, p in zip(manifest.stages, manifest.predicted.stages)]


@pytest.mark.parametrize("path", ["examples/mlp.py", "examples/gpt.py"])
def test_bf16_mixed_on_the_meta_device_gives_the_boundaries_of_real_weights(tmp_path: Path, path: str) -> None:
    """[Note: mixed precision on the meta device]: the analytic package of a model built on
    the meta device carries the dtypes and message sizes of the one compiled with real
    weights (the mlp's boundary is autocast's bfloat16, the GPT's residual stream float32)."""
    meta = compile_example(path, tmp_path / "meta", stages=2, precision="bf16-mixed", meta=True)
    real = compile_example(path, tmp_path / "real", stages=2, precision="bf16-mixed", meta=False)
    assert [s.nodes for s in meta.plan.stages] == [s.nodes for s in real.plan.stages]
    assert _boundaries(tmp_path / "meta") == _boundaries(tmp_path / "real")
    dtypes = {v.dtype for s in Manifest.from_json((tmp_path / "meta" / "manifest.json").read_text()).stages
              for v in s.outputs if v.dtype}
    assert dtypes == ({"bfloat16"} if path.endswith("mlp.py") else {"float32"})


GPT_AT_SCALE = '''
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("_gpt", os.path.join(ROOT, "examples", "gpt.py"))
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)

# GPT-3 175B's layer (examples/gpt3_175b.py), four of them, in float32 weights
CONFIG = _gpt.GPTConfig(n_layer=4, n_embd=12288, n_head=96, vocab_size=51200, block_size=2048)
_gpt.BATCH = 8
loss_fn = _gpt.loss_fn


def build_model():
    return _gpt.build_model(CONFIG)


def example_inputs():
    return _gpt.example_inputs(CONFIG)


def example_target():
    return _gpt.example_target(CONFIG)
'''


def test_bf16_mixed_plans_a_gpt_at_scale_on_the_meta_device(tmp_path: Path) -> None:
    """Four GPT-3 175B layers, built on the meta device, plan in bf16-mixed on a100: the
    matmuls are costed in bfloat16 (the step several times shorter than fp32's, whose
    matmuls run at 19.5 TFLOP/s, not 312), the MFU is of the bf16 peak, and the stages hand
    each other the float32 residual stream and, where the cut falls inside a layer,
    autocast's bfloat16 outputs of its matmuls."""
    model = tmp_path / "gpt_at_scale.py"
    model.write_text(f"ROOT = {str(ROOT)!r}\n" + GPT_AT_SCALE)
    predicted = {}
    for precision in ("bf16-mixed", "fp32"):
        compile_example(str(model), tmp_path / precision, stages=2, microbatches=4, precision=precision, meta=True,
                        memory=160 * 2**30)
        manifest = Manifest.from_json((tmp_path / precision / "manifest.json").read_text())
        assert manifest.predicted is not None and manifest.precision == precision
        predicted[precision] = manifest.predicted
    assert predicted["bf16-mixed"].extra["mfu_peak"] == "bf16"
    assert predicted["fp32"].step_time_s > 8 * predicted["bf16-mixed"].step_time_s
    sent = {(v.shape, v.dtype) for v in
            Manifest.from_json((tmp_path / "bf16-mixed" / "manifest.json").read_text()).stages[0].outputs}
    assert ((2, 2048, 12288), "float32") in sent  # the residual stream
    assert len(sent) > 1 and all(dtype == "bfloat16" for shape, dtype in sent if shape[-1] != 12288)  # matmuls



INNER = '''
import torch

class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ENABLED):
            h = torch.relu(self.a(x))
        return self.b(h.float())

def build_model():
    return Inner()

def example_inputs():
    return (torch.randn(4, 8),)

def example_target():
    return torch.randint(0, 2, (4,))

def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out, target)
'''


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("enabled, precision, refused", [
    (True, "fp32", True), (True, "bf16-mixed", True), (False, "bf16-mixed", True), (False, "fp32", False)])
def test_autocast_inside_the_model_is_refused_not_dropped(tracer: str, enabled: bool, precision: str, refused: bool,
                                                          tmp_path: Path) -> None:
    (tmp_path / "inner.py").write_text(f"ENABLED = {enabled}\n" + INNER)
    options: dict[str, Any] = {"stages": 1, "microbatches": 1, "tracer": tracer, "precision": precision}
    if not refused:  # a disabled region in an fp32 model is a no-op: it compiles
        compile_example(str(tmp_path / "inner.py"), tmp_path / "pkg", **options)
        return
    with pytest.raises(PartitionerError, match=r"enters .*torch.autocast.* inside forward\(\) .* silently dropped"):
        compile_example(str(tmp_path / "inner.py"), tmp_path / "pkg", **options)


def test_bf16_init_checkpoints_and_resume_use_the_float32_masters(tmp_path: Path) -> None:
    """init_weights, state_dict and checkpoints see the masters: float32 values equal to the
    unsplit model's, and a resumed run repeats the uninterrupted one exactly."""
    compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, microbatches=2, precision="bf16")
    mf = model_file.load("examples/mlp.py")
    model = mf.build(0)
    runtime.init_weights(model, seed=3)
    (args, _), target = mf.example_inputs(), mf.example_target()

    def run(pipe: runtime.LocalPipeline, opt: torch.optim.Optimizer, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            losses.append(float(pipe.train_step(args, target)))
            pipe.clip_grad_norm_(1.0)
            opt.step()
        return losses

    pipe = runtime.LocalPipeline(tmp_path / "pkg")
    pipe.init_weights(seed=3)
    got = pipe.state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items() if v.is_floating_point())
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)
    run(pipe, opt, 2)
    pipe.save_checkpoint(tmp_path / "ckpt", opt)
    after = run(pipe, opt, 2)
    resumed = runtime.LocalPipeline(tmp_path / "pkg")
    opt2 = resumed.make_optimizer(torch.optim.AdamW, lr=1e-3)
    resumed.load_checkpoint(tmp_path / "ckpt", opt2)
    assert run(resumed, opt2, 2) == after
    assert all(torch.equal(a, b) for a, b in zip(pipe.state_dict().values(), resumed.state_dict().values()))
