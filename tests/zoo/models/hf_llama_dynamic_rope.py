"""Hugging Face Llama with dynamic NTK RoPE (`rope_scaling={"rope_type": "dynamic"}`), a tiny config
whose `max_position_embeddings` (4) the batch's 8 positions exceed: `dynamic_rope_update` branches
on `torch.max(position_ids)` and re-registers `inv_freq`, which neither tracer can record, so the
rotary embedding is kept whole under torch.export."""
from transformers import LlamaConfig, LlamaForCausalLM
from zoo_hf import VOCAB, lm_loss, tokens

MAX_POSITIONS = 4


def build_model(max_positions=MAX_POSITIONS):
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=max_positions, use_cache=False,
                                        num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
