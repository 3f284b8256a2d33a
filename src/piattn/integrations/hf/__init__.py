"""π-Attention inside Hugging Face transformers (transformers >= 5.24: `check_transformers`).

    model = LlamaForCausalLM(config)                     # any Llama-style *ForCausalLM
    convert_to_pi(model, window=4, period=16, sinks=4)   # gate MLP per attention module, attention switched
    out = model.generate(ids, cache=PiCache(model.config), max_new_tokens=64)
    model.save_pretrained(path)
    model = from_pretrained_pi(path)

How it plugs in:
- `register()` adds `pi_attention_forward` to HF's `AttentionInterface` and `pi_attention_mask` to its
  `AttentionMaskInterface`, both as "pi_attention". The operator knows its own sparse causal pattern, so the
  mask function builds no [T, T] mask: it returns None, or the 2D padding mask when a row is padded.
- The gate reads the attention module's input x, but an HF attention function receives only q, k and v. A
  forward pre-hook on each attention module stores x on the module; the attention function takes it from
  there and computes α̃ = ε + (1 − 2ε)·σ(pi_gate(x)) itself, inside the autograd graph, as `PiAttention` does
  (both with `piattn.layers.gate`); a one-token step through the compiled decoding step hands it the gate's
  first linear layer's output and its last layer instead, and the C step finishes the gate (GELU, linear,
  sigmoid, clip), as the GPT decoding layers do.
- The operator settings live in `config.pi_attention` (a dict), so they travel with save_pretrained; they are
  range-checked when a model is converted or loaded, and a refused conversion leaves the model as it was.
  Read back they are typed, `HFPiSettings`: one `piattn.config.PiSettings` per layer (built and checked once
  per distinct stored content) and the backend; the attention function hands its layer's `PiSettings` to the
  operator whole (`piattn.ops.pi.pi_attention_with_settings`) and to the decoding plans.
- Cached decoding: the new queries are put behind the cached keys (zero queries in front, their outputs
  dropped) and the operator runs on the block, exactly as `AttentionLayer.attend_cached` does. Keys older
  than max(window, period) are never read, so a step costs O(max(window, period)) with any cache;
  `PiCache` also bounds the memory.

- Grouped-query attention: the key/value heads go to the operator unrepeated (it maps query head h to
  key/value head h // (H / H_kv)), and the caches hold H_kv heads.
- Sinks (`sinks=s`): the first s tokens of each row's text stay visible to every later token. In a cached
  step the attention function puts the sink keys older than the window in front of the recent keys (the
  pattern never reaches back to them, so the gap between is invisible); `PiCache` keeps a copy of each row's
  sinks, since its ring drops them.
- Padding: π-Attention's pattern is relative positions, so a pad cannot just be masked out of a window. A
  2D attention_mask becomes `document_ids`: the pads before a row's text, the text, and the pads after it
  are separate documents, so that no token reads a pad and the text's window, skip and sinks start at its
  first token (`padding`). `generate` with left padding gives each row what it gives alone (tested).

Supported: causal decoder LMs whose attention modules have q_proj/k_proj/v_proj/o_proj and dispatch through
`ALL_ATTENTION_FUNCTIONS` (tested with Llama), grouped-query attention, sinks, left (and, without a cache,
right) padding, training (attention dropout), generation with `DynamicCache` (the default; grows) or
`PiCache` (bounded).
Not supported, and rejected with a ValueError: a 2D attention_mask with a pad between two tokens, custom 4D
masks, and packed or non-consecutive position_ids without a mask.

Modules: `attention` (what HF dispatches to, and the stored settings), `convert` (conversion and loading),
`cache` (the bounded cache), `padding` (padding masks as documents), `pretrained` (an optional real model,
SmolLM2-135M, from GGUF), `evaluation` (token losses, loss by position and the pattern-as-mask engine of
`piattn convert-eval`).
"""

from ._requirement import MIN_TRANSFORMERS, check_transformers
from .attention import ATTENTION_NAME, HFPiSettings, pi_attention_forward, pi_attention_mask, register
from .cache import PiCache, PiCacheLayer, cache_nbytes
from .convert import convert_to_pi, from_pretrained_pi
from .heads import copy_probe, copy_scores, duo_attention_scores, retrieval_head_scores, top_dense_heads
from .pretrained import find_gguf, load_gguf_model

__all__ = ["ATTENTION_NAME", "MIN_TRANSFORMERS", "HFPiSettings", "PiCache", "PiCacheLayer", "cache_nbytes",
           "check_transformers", "convert_to_pi", "copy_probe", "copy_scores", "duo_attention_scores", "find_gguf",
           "from_pretrained_pi", "load_gguf_model", "pi_attention_forward", "pi_attention_mask", "register",
           "retrieval_head_scores", "top_dense_heads"]
