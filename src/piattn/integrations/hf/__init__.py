"""π-Attention inside Hugging Face transformers (written against transformers 5.23).

    model = LlamaForCausalLM(config)                     # any Llama-style *ForCausalLM
    convert_to_pi(model, window=4, period=16)            # gate MLP per attention module, attention switched
    out = model.generate(ids, past_key_values=PiCache(model.config), max_new_tokens=64)
    model.save_pretrained(path)
    model = from_pretrained_pi(path)

How it plugs in:
- `register()` adds `pi_attention_forward` to HF's `AttentionInterface` and `pi_attention_mask` to its
  `AttentionMaskInterface`, both as "pi_attention". The operator knows its own sparse causal pattern, so the
  mask function builds no [T, T] mask: it only rejects padding and returns None.
- The gate reads the attention module's input x, but an HF attention function receives only q, k and v. A
  forward pre-hook on each attention module stores x on the module; the attention function takes it from
  there and computes α̃ = ε + (1 − 2ε)·σ(pi_gate(x)) itself, inside the autograd graph, as `PiAttention` does
  (both with `piattn.layers.gate`).
- The operator settings (`piattn.config.PiSettings` and the backend, `HFPiSettings`) live in
  `config.pi_attention` (a dict), so they travel with save_pretrained; they are range-checked when a model
  is converted or loaded, and a refused conversion leaves the model as it was.
- Cached decoding: the new queries are put behind the cached keys (zero queries in front, their outputs
  dropped) and the operator runs on the block, exactly as `AttentionLayer.attend_cached` does. Keys older
  than max(window, period) are never read, so a step costs O(max(window, period)) with any cache;
  `PiCache` also bounds the memory.

Supported: causal decoder LMs whose attention modules have q_proj/k_proj/v_proj/o_proj and dispatch through
`ALL_ATTENTION_FUNCTIONS` (tested with Llama), grouped-query attention, training (attention dropout),
generation with `DynamicCache` (the default; grows) or `PiCache` (bounded).
Not supported, and rejected with a ValueError: padding (any zero in a 2D attention_mask) and packed or
non-consecutive position_ids. π-Attention's pattern is relative positions, so a padded row would attend its
pad tokens as if they were text; batch sequences of equal length instead.

Modules: `attention` (what HF dispatches to, and the stored settings), `convert` (conversion and loading),
`cache` (the bounded cache).
"""

from .attention import ATTENTION_NAME, HFPiSettings, pi_attention_forward, pi_attention_mask, register
from .cache import PiCache, PiCacheLayer, cache_nbytes
from .convert import convert_to_pi, from_pretrained_pi

__all__ = ["ATTENTION_NAME", "HFPiSettings", "PiCache", "PiCacheLayer", "cache_nbytes", "convert_to_pi",
           "from_pretrained_pi", "pi_attention_forward", "pi_attention_mask", "register"]
