"""Looking inside a model while it runs over data: attention mass per key class, the gate, token flow.

    with Inspector(model, flow_window=64) as inspector:
        run_the_model_over_some_data()          # e.g. task.evaluate(model, "validation", 4)
    report = inspector.result()                  # {"layers": [...], "flow": {...}, "tokens": ...}

Forward hooks on every `AttentionLayer` read the layer input x and the `document_ids` it ran with,
recompute its q, k (RoPE positions restarting per document, as the layer has them) and gate, and add
this batch's sums (`probes.masses`) and, for the token flow, the layer's probabilities restricted to a
window of W positions around one query position; nothing [T, T] is built beyond that window. Queries
on padding tokens (the model's `pad_id`, read from its `embed` input) are left out of the averages.
Cached (incremental) forwards are ignored; a layer running sequence-parallel is refused.

The skip prior by phase (the paper's gate figure (d)): for a gated π layer, 1 − α averaged over heads and
queries by the query's position modulo π, its position counted from the start of its document; with
per-head periods, once per distinct period over the heads that have it.

Token flow ("attention rollout", Abnar & Zuidema 2020): with A_l the layer-l probabilities averaged over
heads and Ã_l = ½(A_l + I) (the residual path), the influence of position j on the query p after layer l
is (Ã_l ⋯ Ã_1)[p, j], composed for each sequence and then averaged over sequences. For a causal model
it is exact on the window [p − W + 1, p]: a path from p to j only passes positions between j and p. For
a bidirectional model paths that leave the window are cut, so the window is centred on p and the
figure says so.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..layers import ATTENTION, AttentionLayer
from ..layers.sharding import active_shard
from ..ops.pi.heads import period_groups
from ..ops.pi.pattern import document_bounds
from ..ops.pi.validate import head_periods
from . import probes

RESIDUAL_MIX = 0.5  # Ã = RESIDUAL_MIX·A + (1 − RESIDUAL_MIX)·I


def kind_name(layer: AttentionLayer) -> str:
    """The registry name of a layer's kind ("pi", "local", "dense", …), else its class name."""
    return next((name for name, cls in ATTENTION.items() if type(layer) is cls), type(layer).__name__)


def default_position(model: nn.Module, causal: bool, T: int) -> int:
    """The query whose flow is drawn: the last position of a causal model (what the next-token logits and
    the reach task read), the first of a "cls"-pooled encoder, else the middle."""
    if causal:
        return T - 1
    return 0 if getattr(getattr(model, "config", None), "pool", None) == "cls" else T // 2


def forward_arguments(layer: AttentionLayer, args: tuple, kwargs: dict) -> tuple:
    """(x, cache, document_ids) of a call of `layer.forward`, however they were passed."""
    call = inspect.signature(layer.forward).bind(*args, **kwargs)
    call.apply_defaults()
    return call.arguments["x"], call.arguments["cache"], call.arguments["document_ids"]


def document_positions(document_ids: torch.Tensor | None, T: int, device) -> torch.Tensor:
    """[B, T] (or [1, T] without documents): each position counted from the start of its document, the
    position RoPE gives it (`AttentionLayer.attend_documents`)."""
    position = torch.arange(T, device=device)[None]
    if document_ids is None:
        return position
    start, _ = document_bounds(document_ids, device=device)
    return position - start


class _LayerSums:
    def __init__(self, heads: int):
        self.mass: dict[str, torch.Tensor] = {}
        self.distance = torch.zeros(heads, dtype=torch.float64)
        self.alpha = torch.zeros(heads, dtype=torch.float64)
        self.alpha_sq = torch.zeros(heads, dtype=torch.float64)
        # Gated layers, per period (one, or each distinct one of per-head periods): Σ (1 − α) and the number of
        # (query, head) pairs summed over that period's heads, by position modulo the period.
        self.skip_prior: dict[int, torch.Tensor] | None = None
        self.skip_prior_count: dict[int, torch.Tensor] = {}
        self.skip_prior_heads: dict[int, list[int]] = {}
        self.tokens = 0.0

    @property
    def gated(self) -> bool:
        return self.skip_prior is not None

    def add_gate(self, gate: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 period: int | tuple[int, ...]) -> None:
        """gate α [B, H, T], mask [B, T] (0 for padding queries), positions [B or 1, T] (from the document start),
        period: the layer's (an int, or one per head)."""
        B, H, T = gate.shape
        if self.skip_prior is None:
            self.skip_prior_heads = {p: heads for p, heads, _ in period_groups(head_periods(period, H), H)}
            self.skip_prior = {p: torch.zeros(p, dtype=torch.float64) for p in self.skip_prior_heads}
            self.skip_prior_count = {p: torch.zeros(p, dtype=torch.float64) for p in self.skip_prior_heads}
        g = gate.double() * mask[:, None, :]
        self.alpha += g.sum((0, 2)).cpu()
        self.alpha_sq += (g * gate.double()).sum((0, 2)).cpu()
        for p, heads in self.skip_prior_heads.items():
            phase = (positions % p).expand(B, T).flatten().cpu()
            skip_prior = ((1 - gate[:, heads].double()) * mask[:, None, :]).sum(1)  # [B, T]: summed over heads
            self.skip_prior[p].index_add_(0, phase, skip_prior.flatten().cpu())
            self.skip_prior_count[p].index_add_(0, phase, (mask.double() * len(heads)).flatten().cpu())

    def skip_prior_by_phase(self, period: int) -> list[float | None]:
        return [float(total / count) if count else None
                for total, count in zip(self.skip_prior[period], self.skip_prior_count[period], strict=True)]


class Inspector:
    """Context manager: hooks `model`'s attention layers; `result()` averages what the forwards showed.

    position: the query of the token flow (None: `default_position`); flow_window: W, the positions the
    flow is computed on (clipped to the sequence length).
    """

    def __init__(self, model: nn.Module, *, position: int | None = None, flow_window: int = 64):
        if flow_window < 1:
            raise ValueError(f"flow window must be >= 1, got {flow_window}")
        self.model, self.position, self.flow_window = model, position, flow_window
        self.layers = [m for m in model.modules() if isinstance(m, AttentionLayer)]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no attention layer to inspect")
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.sums = [_LayerSums(m.n_heads) for m in self.layers]
        self.pad_id = getattr(model, "pad_id", None)
        self._ids: torch.Tensor | None = None
        self._pass: list[torch.Tensor] = []  # per layer of the current forward: [B, W, W] head-averaged
        self._window: tuple[int, int, int, int] | None = None  # (T, position, lo, hi)
        self.flow_sum: torch.Tensor | None = None
        self.flow_sequences = 0.0
        self._hooks: list = []

    def __enter__(self) -> Inspector:
        embed = getattr(self.model, "embed", None)
        if isinstance(embed, nn.Embedding):
            self._hooks.append(embed.register_forward_pre_hook(self._on_ids))
        for layer in self.layers:
            self._hooks.append(layer.register_forward_hook(self._on_layer, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> bool:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False

    def _on_ids(self, module, args) -> None:
        self._ids = args[0]

    def _query_mask(self, B: int, T: int, device) -> torch.Tensor:
        ids = self._ids
        if self.pad_id is None or ids is None or ids.shape != (B, T):
            return torch.ones(B, T, dtype=torch.bool, device=device)
        return ids.to(device) != self.pad_id

    def _resolve_window(self, T: int, causal: bool) -> tuple[int, int, int, int]:
        if self._window is None or self._window[0] != T:
            p = default_position(self.model, causal, T) if self.position is None else self.position
            if not 0 <= p < T:
                raise ValueError(f"flow position must lie in [0, {T - 1}] for sequences of {T} tokens, got {p}")
            W = min(self.flow_window, T)
            lo = max(0, p - W + 1) if causal else min(max(0, p - W // 2), T - W)
            self._window = (T, p, lo, lo + W)
        return self._window

    @torch.no_grad()
    def _on_layer(self, layer: AttentionLayer, args: tuple, kwargs: dict, output) -> None:
        x, cache, document_ids = forward_arguments(layer, args, kwargs)
        if cache is not None:  # a cached decoding step
            return
        if active_shard() is not None:
            raise ValueError("inspection cannot read a layer running sequence-parallel (it sees one shard); "
                             "inspect the model in one process")
        i = self.index[id(layer)]
        if document_ids is None:
            q, k, _ = layer.heads(x)
        else:
            document_ids = document_ids.to(x.device)
            q, k, _ = layer.heads(x, positions=document_positions(document_ids, x.shape[1], x.device))
        B, _, T, _ = q.shape
        mask = self._query_mask(B, T, q.device)
        sums = self.sums[i]
        mass, distance = probes.masses(layer, q, k, x, mask, document_ids)
        for cls, value in mass.items():
            sums.mass[cls] = sums.mass.get(cls, 0) + value.cpu()
        sums.distance += distance.cpu()
        sums.tokens += float(mask.sum())
        gate = probes.layer_gate(layer, x)
        if gate is not None:
            sums.add_gate(gate, mask, document_positions(document_ids, T, x.device), layer.settings.period)
        self._flow_step(i, layer, q, k, x, mask, document_ids)

    def _flow_step(self, i: int, layer: AttentionLayer, q, k, x, mask, document_ids) -> None:
        if i == 0:
            self._pass = []
        if len(self._pass) != i:  # a forward that skipped layers: no flow from it
            return
        T = q.shape[2]
        _, p, lo, hi = self._resolve_window(T, layer.causal)
        window = torch.arange(lo, hi, device=q.device)
        self._pass.append(probes.columns(layer, q, k, x, window, window, document_ids).double().mean(1).cpu())
        if i < len(self.layers) - 1:
            return
        W = hi - lo
        eye = torch.eye(W, dtype=torch.float64)
        product = eye.expand(q.shape[0], W, W)
        rows = []
        for a in self._pass:
            product = (RESIDUAL_MIX * a + (1 - RESIDUAL_MIX) * eye) @ product
            rows.append(product[:, p - lo])  # [B, W]: influence on query p after this layer
        weight = mask[:, p].double().cpu()
        flow = torch.stack(rows, 1) * weight[:, None, None]  # [B, L, W]
        self.flow_sum = flow.sum(0) if self.flow_sum is None else self.flow_sum + flow.sum(0)
        self.flow_sequences += float(weight.sum())
        self._pass = []

    def result(self) -> dict:
        """What the forwards so far showed, averaged over their (non-padding) query tokens.

        {"tokens", "layers": [{"layer", "kind", "heads", "mass": {class: share}, "mass_by_head": [{…}],
        "mean_distance", "mean_distance_by_head", and for gated layers "alpha_mean", "alpha_std",
        "alpha_by_head", "skip_prior_by_phase" [π]: mean 1 − α at positions ≡ 0 … π − 1 (mod π), None
        for a phase no query had, or with per-head periods "skip_prior_by_period": [{"period": π, "heads": [h
        …], "by_phase": [π]} per distinct period, increasing], the same over that period's heads}],
        "flow": {"position", "window": [lo, hi], "causal", "offsets", "influence" [L][W], "sequences",
        "rollout"} or None}
        """
        layers = []
        for i, (layer, s) in enumerate(zip(self.layers, self.sums, strict=True)):
            if s.tokens == 0:
                raise ValueError("no batch reached the model: nothing to inspect")
            per_head_tokens = s.tokens
            classes = [c for c in probes.KEY_CLASSES if c in s.mass]
            entry = {"layer": i, "kind": kind_name(layer), "heads": layer.n_heads,
                     "mass": {c: float(s.mass[c].sum() / (per_head_tokens * layer.n_heads)) for c in classes},
                     "mass_by_head": [{c: float(s.mass[c][h] / per_head_tokens) for c in classes}
                                      for h in range(layer.n_heads)],
                     "mean_distance": float(s.distance.sum() / (per_head_tokens * layer.n_heads)),
                     "mean_distance_by_head": (s.distance / per_head_tokens).tolist()}
            if s.gated:
                n = per_head_tokens * layer.n_heads
                mean = float(s.alpha.sum() / n)
                entry |= {"alpha_mean": mean, "alpha_std": max(float(s.alpha_sq.sum() / n) - mean**2, 0.0) ** 0.5,
                          "alpha_by_head": (s.alpha / per_head_tokens).tolist()}
                if len(s.skip_prior) == 1:
                    entry["skip_prior_by_phase"] = s.skip_prior_by_phase(next(iter(s.skip_prior)))
                else:  # per-head periods: the phases of each period, over its heads
                    entry["skip_prior_by_period"] = [{"period": p, "heads": heads, "by_phase": s.skip_prior_by_phase(p)}
                                                     for p, heads in s.skip_prior_heads.items()]
            layers.append(entry)
        flow = None
        if self.flow_sum is not None and self.flow_sequences > 0:
            T, p, lo, hi = self._window
            flow = {"position": p, "window": [lo, hi], "sequence_length": T, "causal": self.layers[0].causal,
                    "offsets": list(range(lo - p, hi - p)),
                    "influence": (self.flow_sum / self.flow_sequences).tolist(),
                    "sequences": int(self.flow_sequences),
                    "rollout": f"{RESIDUAL_MIX}·A + {1 - RESIDUAL_MIX}·I per layer, heads averaged, "
                               "composed per sequence, then averaged"}
        return {"tokens": int(self.sums[0].tokens), "layers": layers, "flow": flow}
