"""The models `partitioner.parallelize` is tested on, built as a user's script builds them:
examples/gpt.py's GPT (a class of a user's module, copied into the package) and a Hugging Face
LlamaForCausalLM built here from a config (an installed class; loss_fn read from this module)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

__all__ = ["build", "llama_loss"]


def llama_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def build(name: str) -> tuple[torch.nn.Module, tuple[tuple[Any, ...], dict[str, Any]], torch.Tensor,
                              Callable[..., torch.Tensor]]:
    """(model with seed-0 weights, (args, kwargs) of the example batch, target, loss_fn)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    torch.manual_seed(0)
    if name == "gpt":
        import gpt

        return gpt.build_model(), (gpt.example_inputs(), {}), gpt.example_target(), gpt.loss_fn
    import hf_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**hf_llama.CONFIG))
    return model, ((), hf_llama.example_inputs()), hf_llama.example_target(), llama_loss
