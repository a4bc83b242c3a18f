"""init_weights of a model with tied weights ([Note: tied init] in runtime/initialize.py):
Hugging Face GPT-2 (`transformer.wte.weight` is `lm_head.weight`, which its packages name
the tied parameter by) and the repo's GPT example get runtime.init_weights' values on the
unsplit model on every plan: the tied copies on one stage or on two, tensor-parallel, and
on 2 gloo ranks."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from runtime import package

from ..conftest import FREE_LINKS, ROOT, compile_example
from .test_checkpoint_dist import _launch, _ok

#: the GPT example initialises no LayerNorm in its own _init_weights: a model-file init covers all
GPT_INIT = '''

def init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)
'''


def _model_file(example: str, tmp_path: Path) -> str:
    if example == "hf_gpt2":
        return str(ROOT / "examples" / "hf_gpt2.py")
    copy = tmp_path / "gpt_init.py"
    copy.write_text((ROOT / "examples" / "gpt.py").read_text() + GPT_INIT)
    return str(copy)


def _reference(pkg: Path, seed: int) -> dict[str, torch.Tensor]:
    mf = package.load_model_file(package.load_manifest(pkg), pkg)
    return runtime.init_weights(mf.build_model(), seed, getattr(mf, "init_weights", None)).state_dict()  # type: ignore[no-any-return]


def _assert_equal(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"


@pytest.mark.parametrize("example, options", [
    ("hf_gpt2", {"stages": 1}),  # the tied copies on one stage
    ("hf_gpt2", {"stages": 2}),  # on the first and the last
    pytest.param("hf_gpt2", {"stages": 3}, marks=pytest.mark.slow),
    pytest.param("hf_gpt2", {"stages": 2, "tp": 2, "hardware": FREE_LINKS}, marks=pytest.mark.slow),
    ("gpt", {"stages": 1}),
    ("gpt", {"stages": 2}),
])
def test_tied_weights_initialise_as_the_unsplit_model(example: str, options: dict[str, Any], tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    compiled = compile_example(_model_file(example, tmp_path), pkg, **options)
    assert compiled.manifest.state_dict_aliases, "the model's weights are tied"
    pipe = runtime.LocalPipeline(pkg)
    pipe.init_weights(seed=3)
    want = _reference(pkg, seed=3)
    _assert_equal(pipe.state_dict(), want)
    tied = [n for n in want if n.endswith(("wte.weight", "lm_head.weight"))]
    assert len(tied) == 2 and torch.equal(want[tied[0]], want[tied[1]]), tied


@pytest.mark.multiproc
@pytest.mark.slow
def test_tied_weights_initialise_alike_on_two_ranks(tmp_path: Path) -> None:
    """The embedding on rank 0 and the head on rank 1 take the same values."""
    pkg = tmp_path / "pkg"
    compile_example(str(ROOT / "examples" / "hf_gpt2.py"), pkg, stages=2, microbatches=2)
    shutil.copy(ROOT / "examples" / "hf_gpt2.py", tmp_path / "hf_gpt2.py")
    got = _ok(*_launch(2, "init", pkg, tmp_path / "unused"), 2)["state_dict"]
    _assert_equal(got, _reference(pkg, seed=5))  # type: ignore[arg-type]
