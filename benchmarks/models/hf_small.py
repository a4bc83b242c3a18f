"""Small Hugging Face transformers nobody here wrote: Qwen2, Llama with a tied head,
Mistral and BART, 4 layers of width 64 (BART: 2 + 2) over a 2048-token vocabulary, a batch
of 4 x 32 tokens.  At this shape the LM head weighs about as much as two to three layers,
as in small real models, so a balanced split exists and the stage-balance benchmark asks
whether the compile finds it.  `contract(kind)` gives a model file its four functions;
hf_qwen2_small.py, hf_llama_tied_small.py, hf_mistral_small.py and hf_bart_small.py use it."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

BATCH, SEQ, LAYERS, WIDTH, VOCAB = 4, 32, 4, 64, 2048


def _build(kind: str) -> torch.nn.Module:
    import transformers as hf

    decoder = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)
    if kind == "qwen2":
        return hf.Qwen2ForCausalLM(hf.Qwen2Config(**decoder))
    if kind == "llama_tied":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**decoder, tie_word_embeddings=True))
    if kind == "mistral":
        return hf.MistralForCausalLM(hf.MistralConfig(**decoder, sliding_window=8))
    return hf.BartForConditionalGeneration(hf.BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS // 2, decoder_layers=LAYERS // 2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * WIDTH, decoder_ffn_dim=4 * WIDTH,
        max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False))


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def contract(kind: str) -> tuple[Callable[..., Any], ...]:
    """build_model, example_inputs, example_target and loss_fn for one `kind`."""

    def build_model() -> torch.nn.Module:
        return _build(kind)

    def example_inputs() -> dict[str, torch.Tensor]:
        given = {"input_ids": _tokens(0)[:, :-1].contiguous()}
        if kind == "bart":
            given["decoder_input_ids"] = _tokens(1)[:, :-1].contiguous()
        return given

    def example_target() -> torch.Tensor:
        return _tokens(1 if kind == "bart" else 0)[:, 1:].contiguous()

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output.logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

    return build_model, example_inputs, example_target, loss_fn
