"""Which key/value heads a conversion keeps dense (`convert_to_pi(dense_heads=...)`): a retrieval-head score
measured on a synthetic copy probe, and the top fraction of heads by it."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from ...progress import progress_bar


def copy_probe(batch: int, length: int, vocab: tuple[int, int], seed: int) -> torch.Tensor:
    """[batch, 2·length] token ids: `length` random tokens in vocab[0] … vocab[1] − 1 (from `seed`), twice."""
    low, high = vocab
    if not 0 <= low < high:
        raise ValueError(f"vocab must be a range (low, high) with 0 <= low < high, got {vocab!r}")
    if batch < 1 or length < 2:
        raise ValueError(f"copy_probe needs batch >= 1 and length >= 2, got batch={batch}, length={length}")
    x = torch.randint(low, high, (batch, length), generator=torch.Generator().manual_seed(seed))
    return torch.cat([x, x], 1)


def copy_scores(attentions: list[torch.Tensor] | tuple[torch.Tensor, ...], length: int, n_kv_heads: int,
                measure: str = "mass") -> torch.Tensor:
    """Retrieval score [L, Hkv] of each key/value head from the attention probabilities [B, H, 2n, 2n] of each
    layer on a copy probe (`copy_probe`, n = `length`): the query at n + i (the second copy of token i, i = 0 …
    n − 2) should read position i + 1, the token after its first occurrence (what an induction or retrieval
    head reads). A query head's score is the share of its attention mass on that source ("mass"), or the share
    of its queries whose largest weight is there ("argmax"), averaged over the queries and the rows; a key/value
    head's is the mean over its query heads."""
    if measure not in ("mass", "argmax"):
        raise ValueError(f"measure must be 'mass' or 'argmax', got {measure!r}")
    i = torch.arange(length - 1)
    scores = []
    for probs in attentions:
        H, positions = probs.shape[1], probs.shape[2]
        if positions != 2 * length:
            raise ValueError(f"attention over {positions} positions, but a copy probe of length {length} has "
                             f"{2 * length}")
        rows = probs[:, :, length + i].float()  # [B, H, n − 1, T]
        if measure == "mass":
            on_source = rows[:, :, i, i + 1]
        else:
            on_source = (rows.argmax(-1) == (i + 1)).float()
        per_head = on_source.mean((0, 2))  # [H]
        scores.append(per_head.reshape(n_kv_heads, H // n_kv_heads).mean(1))
    return torch.stack(scores)


@torch.no_grad()
def retrieval_head_scores(model: PreTrainedModel, *, length: int = 64, batch: int = 8, seed: int = 0,
                          vocab: tuple[int, int] | None = None, measure: str = "mass") -> torch.Tensor:
    """Retrieval score [num_hidden_layers, num_key_value_heads] of each key/value head of a transformers causal LM,
    on a copy probe: `batch` rows of `length` random tokens from `seed` (in vocab = (low, high), default the whole
    vocabulary), repeated once (`copy_probe`; `copy_scores` says what is scored). The same model, probe and seed
    give the same scores. Measured with the model's dense attention ("eager", which returns the probabilities;
    the model is switched back after), so on a converted model it scores the heads of the original."""
    config = model.config
    vocab = (0, config.vocab_size) if vocab is None else vocab
    device = next(model.parameters()).device
    ids = copy_probe(batch, length, vocab, seed).to(device)
    previous = config._attn_implementation
    was_training = model.training
    model.eval()
    model.set_attn_implementation("eager")
    try:
        out = model(ids, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return copy_scores(out.attentions, length, n_kv, measure)


def top_dense_heads(scores: torch.Tensor, fraction: float, tiebreak: torch.Tensor | None = None,
                    ) -> dict[int, list[int]]:
    """The round(fraction · L · Hkv) key/value heads of highest score [L, Hkv] as `convert_to_pi`'s
    `dense_heads` ({layer: sorted heads}, only layers with any). Equal scores go to the higher `tiebreak`
    [L, Hkv] if given (DuoAttention's gates clamp many heads at exactly 1, so a second score orders those),
    then to the lower layer, then the lower head, so the choice is a function of the scores alone. fraction 0
    keeps none dense, 1 all."""
    if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
        raise ValueError(f"fraction must lie in [0, 1], got {fraction!r}")
    if scores.dim() != 2:
        raise ValueError(f"scores must be [layers, key/value heads], got shape {tuple(scores.shape)}")
    if tiebreak is not None and tiebreak.shape != scores.shape:
        raise ValueError(f"tiebreak must have the shape of scores {tuple(scores.shape)}, got {tuple(tiebreak.shape)}")
    L, Hkv = scores.shape
    k = round(fraction * L * Hkv)
    values = scores.detach().cpu().double().tolist()
    second = (torch.zeros(L, Hkv) if tiebreak is None else tiebreak).detach().cpu().double().tolist()
    order = sorted(((layer, head) for layer in range(L) for head in range(Hkv)),
                   key=lambda lh: (-values[lh[0]][lh[1]], -second[lh[0]][lh[1]], lh[0], lh[1]))
    chosen: dict[int, list[int]] = {}
    for layer, head in order[:k]:
        chosen.setdefault(layer, []).append(head)
    return {layer: sorted(heads) for layer, heads in sorted(chosen.items())}


def duo_attention_scores(model: PreTrainedModel, *, steps: int = 100, lr: float = 0.02, l1: float = 0.05,
                         length: int = 32, batch: int = 4, seed: int = 0, vocab: tuple[int, int] | None = None,
                         progress: bool = False) -> torch.Tensor:
    """DuoAttention's choice of dense heads, for a model converted with `convert_to_pi` (none dense): one scalar
    m ∈ [0, 1] per key/value head of each layer, whose query heads output m · dense + (1 − m) · converted,
    trained with the model frozen on copy probes (`copy_probe`, fresh rows each step from `seed`) to keep the
    last hidden states of the probes' second copies at those of the all-dense model (= the original), plus
    `l1` · mean(m) pushing heads toward streaming. Adam from m = 1, clipped to [0, 1] after each step. Returns
    the gates [L, Hkv] (higher: the head needs dense attention), for `top_dense_heads`; the same model and
    seed give the same gates. The model's parameters, their requires_grad and its mode are restored.
    `progress`: a bar over the steps (each is two forwards and a backward of the whole model)."""
    config = model.config
    if getattr(config, "pi_attention", None) is None:
        raise ValueError("duo_attention_scores needs a model converted with convert_to_pi")
    if any(getattr(config, "pi_dense_heads", None) or ()):
        raise ValueError("duo_attention_scores needs a conversion without dense_heads (it mixes every head)")
    if steps < 1 or lr <= 0 or l1 < 0:
        raise ValueError(f"need steps >= 1, lr > 0, l1 >= 0; got steps={steps}, lr={lr}, l1={l1}")
    modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "_pi_cache_layer") and hasattr(m, "layer_idx")}
    n_layer = config.num_hidden_layers
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if sorted(modules) != list(range(n_layer)):
        raise ValueError("found no converted attention module per layer (convert the model with convert_to_pi)")
    device = next(model.parameters()).device
    vocab = (0, config.vocab_size) if vocab is None else vocab
    gates = torch.ones(n_layer, n_kv, device=device, requires_grad=True)
    optimizer = torch.optim.Adam([gates], lr=lr)
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    model.eval()
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for step in progress_bar(steps, desc="DuoAttention gates", unit="step", enabled=progress,
                                 iterable=range(steps)):
            ids = copy_probe(batch, length, vocab, seed * 1_000_003 + step).to(device)
            with torch.no_grad():
                for m in modules.values():
                    m._pi_dense_mix = torch.ones(n_kv, device=device)
                want = model(ids, output_hidden_states=True, use_cache=False).hidden_states[-1][:, length:]
            for i, m in modules.items():
                m._pi_dense_mix = gates[i]
            got = model(ids, output_hidden_states=True, use_cache=False).hidden_states[-1][:, length:]
            loss = (got - want).pow(2).mean() + l1 * gates.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                gates.clamp_(0.0, 1.0)
    finally:
        for m in modules.values():
            m._pi_dense_mix = None
        for p, requires_grad in frozen:
            p.requires_grad_(requires_grad)
        model.train(was_training)
    return gates.detach().clone()
