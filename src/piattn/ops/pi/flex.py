"""FlexAttention backend: the π pattern as a block-sparse mask, clamp and prior as a score_mod.

`torch.nn.attention.flex_attention` fuses scores, softmax and P·V into one compiled kernel (Triton on
CUDA, C++ on CPU) and skips every key block that the block mask leaves empty. The π pattern is very
sparse (|U| = window + 2 keys per causal query) while flex works in tiles of `block_size` × `block_size`,
so most of the computed scores are thrown away: the smaller the block, the less waste, down to the
smallest tile the kernel accepts (see `run_flex`'s `block_size`).

    mask_mod : key offset kv - q in {-window … 0} ∪ {-period} (causal), {-window … window} ∪ {±period},
               or kv among the first `sinks` keys of q's document (causal: kv <= q); with documents,
               kv in q's document (equal document starts)
    score_mod: z = clamp(q·k·scale) + log max(α, ε) on local and sink keys, + log max(1 - α, ε) on skip
               keys (kv - q = ±period, period > window)

Grouped-query attention (k, v with fewer heads than q) is flex's own `enable_gqa`. With documents the
block mask has one row per batch element (`_build_block_mask`), built for each call; without, it is
shared and cached (`block_mask`).

Variant "separate" runs flex twice, once over the local keys and once over the skip keys, and mixes the
two normalised outputs with α outside the kernel. Gradients reach the gate through the captured prior
tensor (flex's backward scatters into captured buffers) or, for "separate", through the mixing.

Limits (torch's or this backend's), declared in `backends.py` and checked by `pi_attention`:
- CPU: forward only (torch's flex has no CPU backward), and uncompiled (`_flex_kernel`): torch's compiled
  CPU kernel was found to leave output rows unwritten (zeros or NaN) for sliding-window masks (torch 2.13,
  AVX2, e.g. T = 24, 40, 56), while the uncompiled path is right; it materialises the [T, T] scores.
- float64: not supported by flex's kernels.
- dropout_p > 0: flex cannot apply the per-slot keep mask that every other backend shares.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ...caching import untainted
from ...masks import local_mask, pi_mask, skip_mask
from .backends import by_keywords
from .pattern import Pattern, document_bounds, log_priors, slot_keys
from .settings import OpSettings

DEFAULT_BLOCK_SIZE = 128  # flex's own default tile
# Distinct shapes, dtypes and patterns each compile one kernel; dynamo's default limit (8) would send
# the ninth to flex's unfused eager path, which materialises the full [T, T] score matrix.
_RECOMPILE_LIMIT = 128


CPU_NOTICE = (
    "backend 'flex' runs FlexAttention uncompiled on CPU ([T, T] scores in memory): torch's compiled CPU "
    "kernel was found to leave output rows unwritten; use backend='torch' for speed on CPU"
)


@functools.cache
def _compiled_flex():
    """flex_attention under torch.compile (the fused kernel), built once per process."""
    return torch.compile(flex_attention, dynamic=False)


def _flex_kernel(device: torch.device):
    """The flex_attention to call on `device`: the compiled kernel, except on CPU (see the module's Limits),
    where torch's uncompiled path runs instead and says so once per process (`CPU_NOTICE`)."""
    if device.type != "cpu":
        return _compiled_flex()
    _say_once(CPU_NOTICE)

    def uncompiled(*args, **kwargs):
        with warnings.catch_warnings():  # torch's own warning about the same choice, replaced by ours
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return uncompiled


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def _mask_mod(window: int, period: int, causal: bool, part: str, sinks: int = 0, start: torch.Tensor | None = None):
    """mask_mod(b, h, q_idx, kv_idx) -> bool: kv_idx is in U(q_idx); part "all", "local" (with the sinks) or
    "skip". start: long [B, T], each position's document start (None: one document)."""
    if not sinks and start is None:
        if part == "local":
            return local_mask(window, causal)
        return (pi_mask if part == "all" else skip_mask)(window, period, causal)
    local, skip = local_mask(window, causal), skip_mask(window, period, causal)
    last = None if start is None else start.shape[-1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        is_local, is_skip = local(b, h, q_idx, kv_idx), skip(b, h, q_idx, kv_idx)
        if part == "skip":
            hit = is_skip
        else:
            # Sinks: the document's first keys; a key already local or a skip is not a sink (local > skip > sink).
            first = 0 if start is None else start[b, q_idx.clamp(max=last)]
            sink = kv_idx - first < sinks
            if causal:
                sink = sink & (kv_idx <= q_idx)
            hit = is_local | is_skip | sink if part == "all" else is_local | (sink & ~is_skip)
        if start is None:
            return hit
        # clamp: a kernel may evaluate padding positions past T, whose result it discards anyway
        return hit & (start[b, q_idx.clamp(max=last)] == start[b, kv_idx.clamp(max=last)])

    return mask_mod


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B', nq, nk] -> counts int32 [B', 1, nq], indices int32 [B', 1, nq, nk], set columns first."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def _part_slots(pat: Pattern, part: str) -> list[int]:
    """The slots (pattern.py's order: local, skip, sinks) of part "all", "local" (local and sinks) or "skip"."""
    skip = list(range(pat.n_local, pat.n_local + pat.n_skip))
    if part == "skip":
        return skip
    every = list(range(pat.n_slots))
    return every if part == "all" else [m for m in every if m not in skip]


def _build_block_mask(pat: Pattern, T: int, document_ids: torch.Tensor | None, device: torch.device,
                      block_size: int, part: str) -> BlockMask:
    """The BlockMask of U's `part` for T queries and keys: [1, 1, ·] shared by every batch and head without
    documents, [B, 1, ·] with document_ids [B, T].

    Built from the keys each slot reads (`pattern.slot_keys`) rather than with `create_block_mask`, which
    evaluates mask_mod on all T² pairs: here each valid (query, slot) pair marks its tile once, O(T·|U|)
    work and O((T / block_size)²) memory per batch row. Tiles whose every pair is in U are "full" (flex
    skips mask_mod there), the other marked tiles "partial", as `create_block_mask` would classify them.
    """
    key, valid = slot_keys(pat, T, document_ids, device)  # [B', T, |U|]
    slots = torch.tensor(_part_slots(pat, part), dtype=torch.long, device=device)
    key, valid = key.index_select(-1, slots), valid.index_select(-1, slots)
    rows = key.shape[0]
    nb = -(-T // block_size)
    q_pos = torch.arange(T, device=device)[None, :, None]
    batch = torch.arange(rows, device=device)[:, None, None]
    tile = ((batch * nb + q_pos // block_size) * nb + key // block_size)[valid]
    # A key is read through one slot at most (local > skip > sink), so every pair is counted once.
    pairs = torch.zeros(rows * nb * nb, dtype=torch.long, device=device).index_add_(0, tile, torch.ones_like(tile))
    pairs = pairs.view(rows, nb, nb)
    full = pairs == block_size * block_size
    kv_num, kv_idx = _ordered((pairs > 0) & ~full)
    full_num, full_idx = _ordered(full)
    start, _ = document_bounds(document_ids)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
        mask_mod=_mask_mod(pat.window, pat.period, pat.causal, part, pat.sinks, start), seq_lengths=(T, T),
    )


@functools.lru_cache(maxsize=32)  # a mask holds O((T / block_size)²) indices: 64 MiB at T = 32K, block 16
@untainted
def block_mask(
    T: int, window: int, period: int, causal: bool, device: torch.device, block_size: int, part: str = "all",
    sinks: int = 0,
) -> BlockMask:
    """The BlockMask of U (or of its "local" / "skip" part) for T queries and keys of one document, shared by
    every batch and head, cached per argument tuple (`_build_block_mask`)."""
    return _build_block_mask(Pattern(window, period, causal, sinks), T, None, device, block_size, part)


def _score_mod(window: int, period: int, logit_clamp: float | None, priors: torch.Tensor | None):
    """score_mod(score, b, h, q_idx, kv_idx): clamp the scaled score, then add the slot's log prior.

    priors: fp32 [B, H, T, 2], the (local, skip) log priors of each query, or None (no prior). One tensor
    for both priors, read once with is_skip as the last index: two captured tensors, or one read twice,
    are known ways to break flex's compilation. A key of U is a skip exactly when it lies ±period away and
    period > window (sinks take the local prior).
    """
    folded = period <= window

    def mod(score, b, h, q_idx, kv_idx):
        if logit_clamp is not None:
            # min/max rather than .clamp, which is known to give wrong bf16 results in flex on CPU.
            score = torch.minimum(torch.maximum(score, torch.tensor(-logit_clamp)), torch.tensor(logit_clamp))
        if priors is None:
            return score
        is_skip = ((torch.abs(q_idx - kv_idx) == period) & (not folded)).to(torch.int32)
        return score + priors[b, h, q_idx, is_skip]

    return mod


def _kernel_options(device: torch.device, block_size: int) -> dict | None:
    """Triton tile sizes for sparse blocks smaller than flex's default tiles (which must divide them)."""
    if device.type != "cuda" or block_size >= DEFAULT_BLOCK_SIZE:
        return None
    tiles = ("fwd_BLOCK_M", "fwd_BLOCK_N", "bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2")
    return dict.fromkeys(tiles, block_size)


def run_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, settings: OpSettings,
             dropout_keep: torch.Tensor | None = None, document_ids: torch.Tensor | None = None, *,
             block_size: int = DEFAULT_BLOCK_SIZE, kernel_options: dict | None = None) -> torch.Tensor:
    """π-Attention through FlexAttention with sparse tiles of `block_size` rows and columns.

    q, k, v [B, H, T, D] (fp32, bf16 or fp16), gate [B, H, T] or None -> [B, H, T, D]: the contract,
    `backends.BackendRun` (one period), without dropout (dropout_keep must be None). On CUDA, a block_size
    below 128 also sets the kernel's own tiles to it; Triton's matrix products need at least 16, the smallest
    block size to try. kernel_options: entries added to (and overriding) those FlexAttention's kernels get
    (e.g. num_stages, num_warps, tile sizes: benchmarks/gpu_run.py's probe for a configuration that fits a
    GPU's shared memory). `pi_attention` checks the limits declared in `backends.py` before it calls here; a
    direct caller must keep to them (on CPU: no gradients, the inputs are detached).
    """
    window, period, causal, sinks = settings.window, settings.period, settings.causal, settings.sinks
    variant = settings.variant
    if dropout_keep is not None:  # a contract, not a user error: pi_attention never sends flex a mask
        raise ValueError("backend 'flex' applies no dropout mask; call it with dropout_keep=None")
    if q.device.type == "cpu":
        # flex refuses CPU inputs that require grad even under no_grad; detaching there changes nothing.
        q, k, v = q.detach(), k.detach(), v.detach()
    T = q.shape[2]
    options = _kernel_options(q.device, block_size)
    if kernel_options:
        options = {**(options or {}), **kernel_options}
    pat = settings.pattern

    def run(part: str, priors: torch.Tensor | None = None) -> torch.Tensor:
        if document_ids is None:
            mask = block_mask(T, window, period, causal, q.device, block_size, part, sinks)
        else:
            mask = _build_block_mask(pat, T, document_ids, q.device, block_size, part)
        mod = _score_mod(window, period, settings.logit_clamp, priors)
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            return _flex_kernel(q.device)(
                q, k, v, score_mod=mod, block_mask=mask, scale=settings.scale, kernel_options=options,
                enable_gqa=k.shape[1] != q.shape[1],
            )

    if variant == "separate":
        return _separate(run, gate, pat, T, document_ids).to(q.dtype)
    if variant == "union":
        return run("all")
    log_local, log_skip = log_priors(variant, None if gate is None else gate.float(), settings.prior, settings.eps)
    if variant == "adaptive":
        return run("all", torch.stack([log_local, log_skip], -1))
    # "fixed": one prior pair for every query, copied out so that the kernel of "adaptive" (compiled for
    # contiguous priors) serves it too.
    pair = torch.tensor([log_local, log_skip], dtype=torch.float32, device=q.device)
    return run("all", pair.expand(*q.shape[:3], 2).contiguous())


pi_attention_flex = by_keywords(run_flex)


def _separate(run, gate: torch.Tensor, pat: Pattern, T: int, document_ids: torch.Tensor | None) -> torch.Tensor:
    """Variant 1: α·(local branch, with the sinks) + (1 - α)·(skip branch), the local branch alone where no
    skip key exists.

    Flex returns zeros for a query whose keys are all masked; the where() keeps that row, and its
    gradient, out of the mix whatever the kernel puts there.
    """
    y_local = run("local").float()
    if not pat.skip_offsets:
        return y_local
    valid = slot_keys(pat, T, document_ids, gate.device)[1]  # [B', T, |U|]
    has_skip = valid[..., pat.n_local : pat.n_local + pat.n_skip].any(-1)[:, None]  # [B', 1, T]
    y_skip = torch.where(has_skip[..., None], run("skip").float(), 0.0)
    a = torch.where(has_skip, gate.float(), 1.0).unsqueeze(-1)
    return a * y_local + (1 - a) * y_skip
