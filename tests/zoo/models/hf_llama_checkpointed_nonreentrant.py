"""Hugging Face Llama, a tiny config, with the user's non-reentrant gradient checkpointing on
(`gradient_checkpointing_enable(use_reentrant=False)`): each decoder layer runs under
torch.utils.checkpoint through the model's `_gradient_checkpointing_func`."""
from hf_llama_checkpointed import build, example_inputs, example_target, loss_fn  # noqa: F401


def build_model():
    return build(reentrant=False)
