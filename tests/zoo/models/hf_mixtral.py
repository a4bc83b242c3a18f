"""Hugging Face Mixtral (MoE, router `/=`, in-place expert scatter), 2 layers, 4 experts."""
from transformers import MixtralConfig, MixtralForCausalLM
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=32, use_cache=False))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
