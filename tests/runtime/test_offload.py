"""`--offload` at run time ([Note: activation offloading] in runtime/offload.py): training
with the activations on the host gives the weights the original model gives (float32,
rtol 1e-5) on every schedule, with recomputation, tensor parallelism and 2 gloo ranks;
the saved storages are really released, and the measured activation bytes drop."""

from __future__ import annotations

import json
import re
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from partitioner.trace import model_file
from runtime.manifest import ManifestError, read_manifest
from runtime.offload import Offloader, prefetches, prefetches_in_order, share_of
from runtime.schedule import Action, Kind

from ..conftest import FREE_LINKS as FREE, compile_example, train_original, train_pipeline
from .test_distributed import _ok, launch, multiproc

ROOT = Path(__file__).resolve().parents[2]
GPT = "examples/gpt.py"
STEPS, LR = 2, 0.05

_LLAMA = '''
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 61


def build_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        use_cache=False))


def _tokens():
    return torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(3))


def example_inputs():
    return {"input_ids": _tokens()[:, :-1].contiguous()}


def example_target():
    return _tokens()[:, 1:].contiguous()


def loss_fn(out, target):
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))
'''


def _trains_like_the_original(path: str, pkg: Path) -> runtime.LocalPipeline:
    mf = model_file.load(path)
    want_losses, want = train_original(path, STEPS, LR)
    pipe = runtime.LocalPipeline(str(pkg))
    pipe.load_state_dict(mf.build(0).state_dict())
    got_losses = train_pipeline(pipe, path, STEPS, LR)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    got = pipe.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return pipe


def _moved(pipe: runtime.LocalPipeline) -> list[int]:
    return [r.offloader.moved_bytes if r.offloader is not None else 0 for r in pipe.runners]


@pytest.mark.parametrize("schedule, options", [
    ("gpipe", {}), ("1f1b", {}), ("interleaved", {"microbatches": 4}), ("zb-h1", {}), ("zb-h2", {}),
    ("zb-v", {"microbatches": 4}),
])
def test_offloaded_training_matches_the_original(schedule: str, options: dict[str, Any], tmp_path: Path) -> None:
    compile_example(GPT, tmp_path / "pkg", stages=2, schedule=schedule, offload="all", **options)
    assert all(s.offload == 1.0 for s in read_manifest(tmp_path / "pkg").stages)
    pipe = _trains_like_the_original(GPT, tmp_path / "pkg")
    assert all(_moved(pipe)), "every stage copied activations to the host"


@pytest.mark.parametrize("options", [
    {"stages": 2, "schedule": "1f1b"},
    {"stages": 2, "schedule": "zb-h1"},
    {"stages": 2, "tp": 2, "hardware": FREE},  # two tensor-parallel lanes
    {"stages": 2, "schedule": "1f1b", "recompute": True},  # only what checkpoint keeps outside its hooks
    {"stages": 2, "schedule": "1f1b", "recompute": "selective"},
    {"stages": 2, "schedule": "zb-h1", "recompute": "selective"},
], ids=["llama-1f1b", "llama-zb-h1", "gpt-tp2", "gpt-recompute", "gpt-selective", "gpt-selective-zb-h1"])
def test_offloaded_variants_match_the_original(options: dict[str, Any], tmp_path: Path) -> None:
    path = GPT
    if "tp" not in options and "recompute" not in options:
        path = str(tmp_path / "llama_net.py")
        Path(path).write_text(_LLAMA)
    compile_example(path, tmp_path / "pkg", offload="all", **options)
    pipe = _trains_like_the_original(path, tmp_path / "pkg")
    if "tp" in options:
        assert pipe.manifest.tensor_parallel["rules"], "the free links split the model"
    if "recompute" not in options:
        assert all(_moved(pipe))


def _planned(tmp_path: Path, name: str, path: str = GPT, **options: Any) -> Path:
    options = {"stages": 2, "microbatches": 4, "schedule": "gpipe", **options}
    compile_example(path, tmp_path / name, **options)
    return tmp_path / name


def _fullest_rank(m: Any) -> int:
    """The predicted memory of the fullest pipeline rank (the sum of its stages)."""
    assert m.predicted is not None
    ranks: dict[int, int] = {}
    for spec, stage in zip(m.stages, m.predicted.stages):
        ranks[spec.ranks[0]] = ranks.get(spec.ranks[0], 0) + stage.memory_bytes
    return max(ranks.values())


def _binding(tmp_path: Path, path: str = GPT, **options: Any) -> tuple[Path, int]:
    """A package compiled with `--offload auto` and a --memory at which auto offloads a share
    (from midway between the fullest rank's need with every activation offloaded and
    without, down to under the first, where a rebalanced split that keeps every activation
    no longer fits), and that memory."""
    need = _fullest_rank(read_manifest(_planned(tmp_path, "none", path, offload="none", **options)))
    least = _fullest_rank(read_manifest(_planned(tmp_path, "all", path, offload="all", **options)))
    assert least < need, "offloading all lowers the fullest stage's need"
    for share in (0.5, 0.2, 0.05, 0.0, -0.1, -0.2, -0.4, -0.6, -0.8, -1.0):  # lower, until no plan that keeps every activation fits
        limit = least + int(share * (need - least))
        pkg = _planned(tmp_path, f"auto{share}", path, memory=limit, **options)
        if any(s.offload > 0 for s in read_manifest(pkg).stages):
            return pkg, limit
    raise AssertionError(f"no --memory around {least} (all offloaded) to {need} (none) made auto offload")


def test_auto_offloads_where_the_memory_binds(tmp_path: Path) -> None:
    """auto offloads a share on the ranks over --memory (the plan then fits) and trains like
    the original; nothing where nothing binds."""
    pkg, limit = _binding(tmp_path)
    m = read_manifest(pkg)
    assert m.predicted is not None
    shares = [s.offload for s in m.stages]
    assert any(0 < f <= 1 for f in shares), shares
    assert _fullest_rank(m) <= limit, (limit, [s.memory_bytes for s in m.predicted.stages])
    assert "offload    " in (pkg / "plan.txt").read_text()
    _trains_like_the_original(GPT, pkg)
    roomy = (_planned(tmp_path, "roomy") / "manifest.json").read_text()  # auto, the device's memory: nothing binds
    assert '"offload"' not in roomy


_FOUR = {"stages": 4, "microbatches": 8}
_SCHEDULES = [("gpipe", {}), ("1f1b", _FOUR), ("zb-h1", _FOUR), ("zb-h2", {}), ("zb-v", _FOUR)]


#: where the solver's split fits without offloading at every --memory `_binding` tries
#: (the walked peak, [Note: the memory walk], leaves it room), so auto never offloads:
#: --offload all covers these above
_REBALANCED = {("gpt", "1f1b"), ("llama", "zb-v")}


@pytest.mark.slow
@pytest.mark.parametrize("model, schedule, options", [(m, s, o) for m in ("gpt", "llama") for s, o in _SCHEDULES
                                                      if (m, s) not in _REBALANCED and (m, s) != ("llama", "1f1b")])
def test_auto_trains_like_the_original_on_every_schedule(model: str, schedule: str, options: dict[str, Any],
                                                         tmp_path: Path) -> None:
    """A share of the activations offloaded where the memory binds (1F1B, ZB-H1 and ZB-V hold
    more than the two microbatches an offloading stage keeps only on 4 stages; on the Llama
    under 1F1B a split that keeps every activation fits whatever --memory the offloaded plan
    fits, and so does another count of virtual stages under interleaved, so auto never
    offloads there: --offload all covers them above)."""
    path = GPT
    if model == "llama":
        path = str(tmp_path / "llama_net.py")
        Path(path).write_text(_LLAMA)
    pkg, _ = _binding(tmp_path, path, schedule=schedule, hardware=FREE, **options)  # stages of like size
    pipe = _trains_like_the_original(path, pkg)
    assert any(_moved(pipe))


def _activations(pkg: Path, schedule: str) -> tuple[int, int]:
    """(activation bytes, total) measured over one tracked training step."""
    mf = model_file.load(GPT)
    args, kwargs = mf.example_inputs()
    pipe = runtime.LocalPipeline(pkg, schedule=schedule)
    pipe.load_state_dict(mf.build(0).state_dict())
    pipe.train_step(kwargs or args, mf.example_target())
    pipe.track_memory(True)
    pipe.train_step(kwargs or args, mf.example_target())
    stats = pipe.memory_stats()
    return stats.activations, stats.total


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_measured_activations_drop(tmp_path: Path, schedule: str) -> None:
    none = _activations(_planned(tmp_path, "none", offload="none"), schedule)
    offloaded = _activations(_planned(tmp_path, "all", offload="all"), schedule)
    assert offloaded[0] < none[0] / 2, (offloaded, none)  # the loss and the leaves stay
    if schedule != "zb-h1":  # zb-h1 holds a microbatch between I and W either way (module note)
        assert offloaded[1] < none[1], (offloaded, none)


def test_the_saved_storage_is_released_and_its_copy_used() -> None:
    """The pack hook's copy replaces the saved tensor: the activation's storage is freed
    after the forward, and the backward's gradient is the one without offloading."""
    x = torch.randn(64, 64, requires_grad=True)
    want = torch.autograd.grad((x * 2).sin().sum(), x)[0]
    off = Offloader(1.0)
    with off.forward(0, [x]):
        a = x * 2
        gone = weakref.ref(a)
        y = a.sin().sum()  # sin saves a
    del a
    assert gone() is None, "the activation outlived its forward"
    assert off.moved_bytes == 64 * 64 * 4 and off.offloaded_bytes(0) == 64 * 64 * 4
    off.prefetch(0)
    got = torch.autograd.grad(y, x)[0]
    off.release(0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fraction_offloads_the_first_storages_on_every_forward() -> None:
    """A share goes to the storage on every microbatch, the first included: the fewest
    first saved whose bytes reach it; the rest, the inputs' and tiny storages stay, and
    the backward's gradient is the one without offloading."""
    x = torch.randn(64, 64, requires_grad=True)

    def step() -> torch.Tensor:  # three 16 KiB storages saved (sin's, cos's inputs, tanh's output), and tiny ones
        return (x * 2).sin().cos().tanh().sum() + (x * x[:1, :1].exp()).sum()

    want = torch.autograd.grad(step(), x)[0]
    off = Offloader(0.5)
    losses = []
    for mb in range(2):
        with off.forward(mb, [x]):
            losses.append(step())
    assert [off.offloaded_bytes(mb) for mb in range(2)] == [2 * 64 * 64 * 4] * 2
    assert off.moved_bytes == 4 * 64 * 64 * 4
    for mb, loss in enumerate(losses):
        off.prefetch(mb)
        torch.testing.assert_close(torch.autograd.grad(loss, x)[0], want, rtol=0, atol=0)
        off.release(mb)


def test_share_of_takes_the_fewest_first_storages_that_reach_the_share() -> None:
    assert [share_of([64, 64, 4], f) for f in (0.0, 0.3, 0.5, 0.83, 0.98, 1.0)] == [0, 1, 2, 2, 3, 3]
    assert share_of([], 1.0) == 0


def test_prefetches_count_the_compute_actions_of_a_rank() -> None:
    """Each B, I or W is brought back `horizon` compute actions before its own (messages
    not counted), the first ones' at the row's start."""
    f0, f1, b0, b1 = Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)
    row = [f0, Action(0, Kind.SEND_F, 0, 1), f1, Action(0, Kind.SEND_F, 1, 1), Action(0, Kind.RECV_B, 0, 1), b0,
           Action(0, Kind.RECV_B, 1, 1), b1]
    assert prefetches(row, 1) == {2: [b0], 5: [b1]}
    assert prefetches(row, 0) == {5: [b0], 7: [b1]}
    assert prefetches(row, 9) == {0: [b0, b1]}
    order = [(0, f0), (1, Action(1, Kind.F, 0)), (0, b0), (1, Action(1, Kind.B, 0))]
    assert prefetches_in_order(order, 1) == {0: [b0], 1: [Action(1, Kind.B, 0)]}


def test_manifest_writes_offload_only_when_set(tmp_path: Path) -> None:
    plain = json.loads((_planned(tmp_path, "none", offload="none") / "manifest.json").read_text())
    assert not any("offload" in s for s in plain["stages"]) and "offload" not in plain["predicted"]
    text = (_planned(tmp_path, "all", offload="all") / "manifest.json").read_text()
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "all", bad)
    (bad / "manifest.json").write_text(text.replace('"offload": 1.0', '"offload": 2', 1))
    with pytest.raises(ManifestError, match=r"stages\[0\]\.offload: expected a fraction"):
        read_manifest(bad)


@multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule, policy", [("1f1b", "all"), ("zb-h1", "all")])  # auto: test_auto_trains_like_the_original_on_every_schedule
def test_two_gloo_ranks_train_the_same_offloaded(tmp_path: Path, schedule: str, policy: str) -> None:
    if policy == "auto":
        pkg, _ = _binding(tmp_path, schedule=schedule)
    else:
        pkg = _planned(tmp_path, "pkg", schedule=schedule, offload=policy)
    assert all(s.offload > 0 for s in read_manifest(pkg).stages)
    model = tmp_path / "gpt.py"
    shutil.copy(ROOT / GPT, model)
    _ok(launch(2, "check", [pkg], model, deadline_s=120))


@multiproc
@pytest.mark.timeout(240)
def test_each_rank_measures_fewer_activation_bytes(tmp_path: Path) -> None:
    model = tmp_path / "gpt.py"
    shutil.copy(ROOT / GPT, model)
    found = {}
    for policy in ("none", "all"):
        _planned(tmp_path, policy, schedule="1f1b", offload=policy)
        ranks = launch(2, "memory", [tmp_path / policy], model, deadline_s=120)
        _ok(ranks)
        found[policy] = [float(re.search(r"activations ([\d.]+) MiB", r.out).group(1)) for r in ranks]  # type: ignore[union-attr]
    assert all(a < n for a, n in zip(found["all"], found["none"])), found


HEAVY = "tests/model_files/two_heavy_blocks.py"


def _heavy_auto(tmp_path: Path) -> tuple[Path, Path, int]:
    """The two heavy blocks under GPipe on 2 stages, planned for this CPU (where the copies
    are done inside the compute: [Note: offloaded activations]), compiled with every
    activation kept and with `--offload auto` at the fullest rank's need with every
    activation offloaded: no split fits that keeping them (each stage holds a block's
    activations of every microbatch), so auto must offload.  (the kept package, the auto
    one, the limit)"""
    least = _fullest_rank(read_manifest(_planned(tmp_path, "all", HEAVY, offload="all", hardware="cpu")))
    kept = _planned(tmp_path, "none", HEAVY, offload="none", hardware="cpu")
    assert _fullest_rank(read_manifest(kept)) > least
    return kept, _planned(tmp_path, "auto", HEAVY, memory=least, hardware="cpu"), least


def test_auto_offloads_less_on_the_rank_that_holds_less(tmp_path: Path) -> None:
    """Where no split fits with every activation kept, auto offloads on the ranks over
    --memory, the one that holds less (here the first: the last holds the head and the
    loss beside the same activations) the smaller share, and the plan fits."""
    kept, pkg, limit = _heavy_auto(tmp_path)
    need = [stage.memory_bytes for stage in read_manifest(kept).predicted.stages]  # type: ignore[union-attr]
    m = read_manifest(pkg)
    shares = [s.offload for s in m.stages]
    fuller = int(need[1] > need[0])
    assert shares[fuller] == 1.0 and 0 < shares[1 - fuller] < 1, (shares, need)
    assert _fullest_rank(m) <= limit
    saved = {e["stage"]: e["saved_bytes"] for e in m.predicted.extra["offload"]}  # type: ignore[union-attr]
    assert saved[fuller] > saved[1 - fuller] > 0, saved


def _heavy_ranks(tmp_path: Path, mode: str, pkg: Path) -> list[Any]:
    model = tmp_path / "two_heavy_blocks.py"
    shutil.copy(ROOT / HEAVY, model)
    found = launch(2, mode, [pkg], model, deadline_s=120)
    _ok(found)
    return found


@multiproc
@pytest.mark.timeout(240)
def test_auto_offloading_trains_the_same_on_two_gloo_ranks(tmp_path: Path) -> None:
    _, pkg, _ = _heavy_auto(tmp_path)
    assert read_manifest(pkg).stages[0].offload > 0
    _heavy_ranks(tmp_path, "check", pkg)


def _peaks(tmp_path: Path, pkg: Path) -> list[tuple[int, int]]:
    """Each rank's (measured, predicted) peak over one tracked AdamW step."""
    found = _heavy_ranks(tmp_path, "peak", pkg)
    got = [re.search(rf"^{r} peak (\d+) (\d+)$", rank.out, re.M) for r, rank in enumerate(found)]
    return [(int(m.group(1)), int(m.group(2))) for m in got if m]


@multiproc
@pytest.mark.timeout(240)
def test_each_rank_measures_the_drop_auto_predicts(tmp_path: Path) -> None:
    """Each rank's measured peak falls by its predicted drop (within 5%)."""
    kept, auto, _ = _heavy_auto(tmp_path)
    before, after = _peaks(tmp_path, kept), _peaks(tmp_path, auto)
    ratios = [(b[0] - a[0]) / (b[1] - a[1]) for b, a in zip(before, after)]
    assert all(abs(r - 1) <= 0.05 for r in ratios), f"measured/predicted drop per rank: {ratios}"
