"""init_weights (runtime/initialize.py): the same values on every plan and on the unsplit model,
an uncovered parameter named, and no rank holding more than its share plus one module's own
parameters while it initialises (counted with a dispatch mode)."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import runtime
from runtime import package
from runtime.initialize import InitError

from .conftest import Tiny
from .tp_package import write_tp_package


def _reference(pkg: Path, seed: int) -> dict[str, torch.Tensor]:
    mf = package.load_model_file(package.load_manifest(pkg), pkg)
    return runtime.init_weights(mf.build_model(), seed).state_dict()  # type: ignore[no-any-return]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_two_plans_and_the_unsplit_model_get_the_same_values(make_tiny: Callable[..., Tiny]) -> None:
    want = _reference(make_tiny(stages=2).dir, seed=3)
    for options in (dict(stages=2), dict(stages=4, virtual_stages=2, schedule="interleaved"), dict(stages=3, dp=2,
                                                                                                    microbatches=2)):
        pipe = runtime.LocalPipeline(make_tiny(**options).dir)
        pipe.init_weights(seed=3)
        _assert_equal(pipe.state_dict(), want)
    other = _reference(make_tiny(stages=2).dir, seed=4)
    assert not torch.equal(other["fc1.weight"], want["fc1.weight"])


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_get_their_slice(tp: int, tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path, stages=2, tp=tp)
    pipe = runtime.LocalPipeline(pkg)
    pipe.init_weights(seed=0)
    _assert_equal(pipe.state_dict(), _reference(pkg, seed=0))


class _Live(TorchDispatchMode):
    """The bytes of tensor storages made inside the mode and still alive; their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()  # an in-place op's or a view's output is not new
                if id(storage) not in self.seen and storage.nbytes() and storage.data_ptr() not in given:
                    self.seen.add(id(storage))
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.now -= nbytes


def test_a_rank_never_holds_more_than_its_share_plus_one_module(tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path, stages=2, tp=2)
    pipe = runtime.LocalPipeline(pkg)
    model = package.load_model_file(pipe.manifest, pkg).build_model()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    with _Live() as live:
        pipe.init_weights(seed=0)
    # one module's own parameters, its NaN check (a bool per element) and a blocked shard's copy
    assert 0 < live.peak <= largest * 1.5 + largest // 4, (live.peak, largest, whole)
    assert live.peak < whole, (live.peak, whole)


MODEL = '''
import torch
from torch import nn


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.gain


def build_model():
    return nn.Sequential(nn.Linear(4, 4), Scale())
'''


def test_an_uncovered_parameter_is_named_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(MODEL)
    mf = package._import_file(tmp_path / "m.py", "_init_test")
    with pytest.raises(InitError, match=r"parameter 1.gain cannot be initialised: no initialiser ran on its module 1 "
                                        r"\(Scale\)\. Give Scale a reset_parameters\(\), or define init_weights\(module\)"):
        runtime.init_weights(mf.build_model())

    def half_init(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.zeros_(module.weight)  # the bias is left unset

    with pytest.raises(InitError, match=r"parameter 1.gain cannot be initialised: the initialisers of its module 1 "
                                        r"\(Scale\) left it \(partly\) unset"):
        runtime.init_weights(mf.build_model(), model_init=half_init)

    def gain_too(module: torch.nn.Module) -> None:
        half_init(module)
        if isinstance(module, mf.Scale):
            torch.nn.init.constant_(module.gain, 2.0)

    # what the model file's init leaves unset (the Linear's bias) falls back to reset_parameters()
    done = runtime.init_weights(mf.build_model(), 3, gain_too).state_dict()
    assert torch.equal(done["0.weight"], torch.zeros(4, 4)) and torch.equal(done["1.gain"], torch.full((4,), 2.0))
    assert not done["0.bias"].isnan().any() and done["0.bias"].abs().max() <= 0.5  # Linear's U(-1/sqrt(4), 1/sqrt(4))

    def full_init(module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            torch.nn.init.normal_(p)

    a, b = runtime.init_weights(mf.build_model(), 1, full_init), runtime.init_weights(mf.build_model(), 1, full_init)
    _assert_equal(a.state_dict(), b.state_dict())


BARE = "tests/model_files/gpt_bare_positions.py"


@pytest.fixture(scope="module")
def bare_plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """gpt_bare_positions.py compiled into 1, 2 and 3 stages."""
    from ..conftest import compile_example

    root = tmp_path_factory.mktemp("bare")
    for stages in (1, 2, 3):
        compile_example(BARE, root / f"s{stages}", stages=stages)
    return {stages: root / f"s{stages}" for stages in (1, 2, 3)}


def test_a_model_file_init_that_covers_one_bare_parameter_leaves_the_rest_to_the_modules(
        bare_plans: dict[int, Path]) -> None:
    """The model file's init_weights sets only the positions; the embedding, LayerNorms and
    Linears fall back to their own reset_parameters(), on every plan as on the unsplit model
    given the same initialiser (`model_init=`)."""
    from partitioner.trace import model_file

    mf = model_file.load(BARE)
    want = runtime.init_weights(mf.build(0), seed=5, model_init=mf.module.init_weights).state_dict()
    assert not want["pos"].isnan().any() and float(want["pos"].std()) == pytest.approx(0.02, rel=0.3)
    assert torch.equal(want["head.weight"], want["tok.weight"])
    for pkg in bare_plans.values():
        pipe = runtime.LocalPipeline(pkg)
        pipe.init_weights(seed=5)
        _assert_equal(pipe.state_dict(), want)


def test_a_checkpoint_of_one_plan_resumes_on_another_for_a_partial_model_init(bare_plans: dict[int, Path],
                                                                              tmp_path: Path) -> None:
    first = runtime.LocalPipeline(bare_plans[2])
    first.init_weights(seed=1)
    first.save_checkpoint(tmp_path / "ckpt")
    other = runtime.LocalPipeline(bare_plans[3])
    other.load_checkpoint(tmp_path / "ckpt")
    _assert_equal(other.state_dict(), first.state_dict())
