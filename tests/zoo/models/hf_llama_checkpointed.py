"""Hugging Face Llama, a tiny config, with the user's reentrant gradient checkpointing on
(`gradient_checkpointing_enable(use_reentrant=True)`): each decoder layer runs under
torch.utils.checkpoint through the model's `_gradient_checkpointing_func`."""
from transformers import LlamaConfig, LlamaForCausalLM
from zoo_hf import VOCAB, lm_loss, tokens


def build(reentrant: bool = True):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=32, use_cache=False,
                                         num_key_value_heads=2))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def build_model():
    return build(reentrant=True)


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
