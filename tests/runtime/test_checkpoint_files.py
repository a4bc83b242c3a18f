"""load_checkpoint of a .safetensors file and a Hugging Face folder (runtime/checkpoint/files.py):
each process reads only its tensors and tensor-parallel slices; missing, unexpected and
mis-shaped tensors are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import runtime
from driver.cli import main as cli
from runtime import package
from runtime.checkpoint import View
from runtime.checkpoint.files import load_weights
from runtime.errors import CheckpointError

from ..conftest import FREE_LINKS, compile_example
from .tp_package import write_tp_package


def _model(pkg: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    return package.load_model_file(package.load_manifest(pkg), pkg).build_model()  # type: ignore[no-any-return]


def _without_alias(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors stores no shared tensors: the tied head is left out, as save_pretrained does."""
    return {k: v.contiguous() for k, v in sd.items() if k != "head.weight"}


def test_a_safetensors_file_loads_onto_tensor_parallel_lanes(tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path / "pkg", stages=2, tp=2)
    model = _model(pkg)
    save_file(_without_alias(model.state_dict()), tmp_path / "w.safetensors")
    pipe = runtime.LocalPipeline(pkg)
    assert pipe.load_checkpoint(tmp_path / "w.safetensors") is None
    got, want = pipe.state_dict(), model.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_rank_reads_only_its_own_slices(tmp_path: Path) -> None:
    """Lane 1 of tp 2 alone (as rank 1 would): the bytes read are those of its own shards."""
    pkg = write_tp_package(tmp_path / "pkg", stages=2, tp=2)
    sd = _without_alias(_model(pkg).state_dict())
    save_file(sd, tmp_path / "w.safetensors")
    pipe = runtime.LocalPipeline(pkg)
    held = [p for r in pipe.lanes[1].runners for p in package.stage_tensors(r.module, r.entry, 1)]
    own = {id(t): t.numel() * t.element_size() for _, t in held}
    read = load_weights(View(pipe.manifest, held, 0, 1, False), tmp_path / "w.safetensors")
    assert read == sum(own.values()) < sum(v.numel() * v.element_size() for v in sd.values())


def test_missing_unexpected_and_mis_shaped_tensors_are_named(tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path / "pkg", stages=2, tp=2)
    sd = _without_alias(_model(pkg).state_dict())
    pipe = runtime.LocalPipeline(pkg)
    save_file({k: v for k, v in sd.items() if k != "fc1.bias"}, tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.safetensors does not hold the package's model \(missing 1: "
                                              r"fc1.bias\): .* or pass strict=False"):
        pipe.load_checkpoint(tmp_path / "missing.safetensors")
    pipe.load_checkpoint(tmp_path / "missing.safetensors", strict=False)
    save_file({**sd, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"\(unexpected 1: extra.weight\)"):
        pipe.load_checkpoint(tmp_path / "extra.safetensors")
    save_file({**sd, "fc1.bias": torch.zeros(7)}, tmp_path / "shape.safetensors")
    with pytest.raises(CheckpointError, match=r"shape.safetensors: fc1.bias has shape \[7\] but the package's model "
                                              r"has \[32\]"):
        pipe.load_checkpoint(tmp_path / "shape.safetensors")


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/hf_gpt2.py compiled into 2 stages x tp 2."""
    out = tmp_path_factory.mktemp("hf") / "pkg"
    compile_example("examples/hf_gpt2.py", out, stages=2, tp=2, hardware=FREE_LINKS)
    return out


def test_a_hugging_face_folder_loads_on_two_stages_by_tp_2(hf_gpt2: Path, tmp_path: Path) -> None:
    """GPT-2 saved with save_pretrained, whole and sharded (an index): the pipeline's logits
    are the Hugging Face model's."""
    _check_folder(hf_gpt2, tmp_path, "20KB")


@pytest.mark.slow
def test_a_llama_folder_loads_on_two_stages_by_tp_2(tmp_path: Path) -> None:
    compile_example("examples/hf_llama.py", tmp_path / "pkg", stages=2, tp=2, hardware=FREE_LINKS)
    _check_folder(tmp_path / "pkg", tmp_path, "40KB")


def _check_folder(pkg: Path, tmp_path: Path, shard_size: str) -> None:
    mf = package.load_model_file(package.load_manifest(pkg), pkg)
    torch.manual_seed(0)
    model = mf.build_model().eval()
    inputs = mf.example_inputs()
    with torch.no_grad():
        want = model(**inputs).logits
    model.save_pretrained(tmp_path / "whole")
    model.save_pretrained(tmp_path / "sharded", max_shard_size=shard_size)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for folder in ("whole", "sharded"):
        pipe = runtime.LocalPipeline(pkg)
        pipe.load_checkpoint(tmp_path / folder)
        torch.testing.assert_close(pipe(inputs).logits, want, rtol=1e-5, atol=1e-6)
    # tp rank 1 alone reads the bytes of its own tensors and shards, a part of the files
    held = [p for r in pipe.lanes[1].runners for p in package.stage_tensors(r.module, r.entry, 1)]
    own = {id(t): t.numel() * t.element_size() for _, t in held}
    read = load_weights(View(pipe.manifest, held, 0, 1, False), tmp_path / "sharded")
    stored = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert read == sum(own.values()) < 0.75 * stored, (read, sum(own.values()), stored)


def test_export_writes_safetensors_and_a_from_pretrained_folder(hf_gpt2: Path, tmp_path: Path) -> None:
    """A trained pipeline's checkpoint, exported: the sharded safetensors load back into it, and
    the --hf folder loads with from_pretrained and gives the pipeline's logits."""
    from transformers import GPT2LMHeadModel

    pipe = runtime.LocalPipeline(hf_gpt2)
    mf = package.load_model_file(pipe.manifest, hf_gpt2)
    pipe.init_weights(seed=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    inputs = mf.example_inputs()
    pipe.train_step(inputs, mf.example_target())
    opt.step()
    pipe.save_checkpoint(tmp_path / "ck")
    assert cli(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "st"), "--max-shard-size", "40KB"]) == 0
    assert (tmp_path / "st" / "model.safetensors.index.json").is_file()
    again = runtime.LocalPipeline(hf_gpt2)
    again.load_checkpoint(tmp_path / "st")
    want = pipe.state_dict()
    for name, value in again.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert cli(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, pipe(inputs).logits, rtol=1e-5, atol=1e-6)
