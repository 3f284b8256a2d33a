"""Stand-ins for a pretrained model and its tokenizer, for the convert-eval and passkey tests: a tiny random
Llama and a tokenizer that reads bytes as ids (the interface `load_gguf_model`'s pair offers)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class ByteTokenizer:
    """Bytes as ids below 97 (so a space is its own token), an end-of-sequence id."""

    eos_token_id = 99

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [b % 97 for b in text.encode()]}


def tiny_llama(max_positions: int = 128) -> LlamaForCausalLM:
    """2 layers, width 32, 4 query heads on 2 key/value heads, 100 ids; seeded, in eval mode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=max_positions,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()
