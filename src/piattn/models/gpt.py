"""`GPT`: the causal language model of the paper's experiments (RoPE, Pre-LN, GELU, tied embeddings)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..config import GPTConfig
from ..decoding.cache import Cache
from ..decoding.sampling import sample_next
from .block import Block, dropped, init_weights


class GPT(nn.Module):
    """Token embedding → n_layer Pre-LN blocks with causal attention of kind `cfg.attention` → LN → logits.

    Positions enter only through RoPE inside attention, so there is no position table and `block_size`
    bounds nothing but the data. The output projection is the embedding matrix (tied).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, causal=True, layer=i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg.init_std)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, cache: Cache | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx int64 [B, T] -> logits [B, T, vocab_size].

        With `cache` (from `init_cache`), idx is the continuation of the text the cache has seen: its
        logits equal those of the same positions in one forward over the whole text. With `document_ids`
        [B, T] (integer ids; a new document wherever the id changes: `dense`, `local` and `pi`), idx holds
        documents packed back to back and each document's logits equal those of the document alone.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T] token ids, got shape {tuple(idx.shape)}")
        if cache is not None:
            cache.check(len(self.blocks))
        x = dropped(self.drop, self.embed(idx))
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache.layers[i], document_ids)
        return self.head(self.ln_f(x))

    def init_cache(self, batch_size: int, max_positions: int | None = None) -> Cache:
        """An empty decoding cache: constant size for `pi` and `local`, growing for `dense`. max_positions:
        the most positions it will hold (prompt + new tokens; None: no limit), which caps each ring."""
        p = self.embed.weight
        return Cache([b.attn.init_cache(batch_size, max_positions=max_positions, device=p.device, dtype=p.dtype)
                      for b in self.blocks])

    @torch.no_grad()
    def stream(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, cache: Cache | None = None
               ) -> Iterator[torch.Tensor]:
        """Yields each new token, int64 [B], as it is produced from prompt idx [B, T] (T >= 1).

        The prompt goes through the cache (a fresh one unless `cache` is given) in one forward; each later
        step feeds one token. Call in eval mode for deterministic logits (dropout stays as the module is set).
        """
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"idx must be a non-empty [B, T] prompt, got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        generator = None
        if seed is not None:
            generator = torch.Generator(idx.device).manual_seed(seed)
        if cache is None:
            cache = self.init_cache(idx.shape[0], max_positions=idx.shape[1] + max_new_tokens)
        logits = self(idx, cache)[:, -1]
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            yield token
            if step + 1 < max_new_tokens:  # the last token is never fed back
                logits = self(token[:, None], cache)[:, -1]

    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> torch.Tensor:
        """Prompt idx [B, T] -> idx followed by max_new_tokens sampled tokens, [B, T + max_new_tokens]."""
        new = list(self.stream(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        return torch.cat([idx, *(t[:, None] for t in new)], 1)

    def num_params(self) -> int:
        """Trainable parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())
