"""The model zoo: models nobody here wrote, each compiled with analytic costs and
trained 2 SGD steps on LocalPipeline against the original (`harness.trains_like_original`:
every loss and state_dict entry to rtol 1e-5).  docs/model-files.md, "Models that work", lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .harness import trains_like_original

ONE_MB = dict(microbatches=1)  # BatchNorm in train mode: batch statistics need the whole batch

#: (model file in tests/zoo/models, compile options): 2 stages, 1F1B unless said
ZOO: list[tuple[str, dict[str, Any]]] = [
    # Hugging Face decoders, encoders, encoder-decoders, MoE, vision (transformers 5.23, tiny configs)
    ("hf_llama", {}),
    ("hf_mistral", {}),
    ("hf_qwen2", {}),
    ("hf_gemma", {}),
    ("hf_phi", {}),
    ("hf_gpt_neox", {}),
    ("hf_gpt2", dict(schedule="gpipe")),
    ("hf_bert", {}),
    ("hf_roberta", {}),
    ("hf_distilbert", {}),
    ("hf_albert", {}),
    ("hf_clip_text", {}),
    ("hf_t5", {}),
    ("hf_bart", {}),
    ("hf_mixtral", {}),
    ("hf_vit", {}),
    ("hf_clip_vision", {}),
    # torchvision's CNNs re-created (BatchNorm, inplace activations, residual `+=`)
    ("resnet_tiny", dict(stages=3, **ONE_MB)),
    ("mobilenet_tiny", dict(ONE_MB)),
    # PyTorch's pipelining test models re-created
    ("pp_example_code", {}),
    ("pp_model_with_kwargs", {}),
    ("pp_multi_mlp", dict(schedule="interleaved")),
    ("pp_param_alias", {}),
    ("pp_custom_linear", {}),
    # structurally odd: recurrent ops, custom autograd Functions, buffers read and counted
    ("rnn_lstm", {}),
    ("custom_function", {}),
    ("buffer_read", dict(ONE_MB)),
    ("kept_whole", {}),
]

#: more meshes for a few of them (slow: run in CI)
MESHES: list[tuple[str, dict[str, Any]]] = [
    ("hf_llama", dict(stages=3, schedule="gpipe")),
    ("hf_llama", dict(tp=2)),
    ("hf_mixtral", dict(stages=3)),
    ("hf_t5", dict(stages=3, schedule="gpipe")),
    ("hf_clip_text", dict(stages=3)),
    ("pp_custom_linear", dict(stages=3)),
    ("custom_function", dict(tp=2)),
]


def _options(options: dict[str, Any]) -> dict[str, Any]:
    return {"stages": 2, "schedule": "1f1b", **options}


@pytest.mark.parametrize("name,options", ZOO, ids=[z[0] for z in ZOO])
def test_zoo_trains_like_original(name: str, options: dict[str, Any], tmp_path: Path) -> None:
    trains_like_original(name, tmp_path / "pkg", **_options(options))


@pytest.mark.slow
@pytest.mark.parametrize("name,options", MESHES, ids=[f"{z[0]}-{'-'.join(f'{k}{v}' for k, v in z[1].items())}" for z in MESHES])
def test_zoo_on_more_meshes(name: str, options: dict[str, Any], tmp_path: Path) -> None:
    trains_like_original(name, tmp_path / "pkg", **_options(options))
