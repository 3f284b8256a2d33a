"""Softmax attention over an explicit candidate-key list per query, in O(T·M·D) memory, never [T, T].

The fixed sparse kinds (longformer, bigbird) describe their non-global rows as "query i attends keys
index[i, 0..M-1] where valid"; this module turns such a list into attention by gathering the candidate
k/v rows chunk by chunk of queries. Plain autograd differentiates it (gather, einsum, exp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# elements of one chunk's gathered k (or v) block [B, H, chunk, M, D]; bounds the no-grad peak memory
CHUNK_ELEMENTS = 1 << 24


def first_occurrences(index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [T, M]: `valid` with every repeat of a key within its row switched off, first entry kept.

    A key listed twice would otherwise get two softmax terms, i.e. double weight.
    """
    keys = index.masked_fill(~valid, -1)
    sorted_keys, order = keys.sort(dim=-1, stable=True)
    repeat_sorted = torch.zeros_like(valid)
    repeat_sorted[:, 1:] = (sorted_keys[:, 1:] == sorted_keys[:, :-1]) & (sorted_keys[:, 1:] >= 0)
    return valid & ~torch.zeros_like(valid).scatter(-1, order, repeat_sorted)


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                       valid: torch.Tensor, *, dropout_p: float = 0.0, chunk_size: int | None = None
                       ) -> torch.Tensor:
    """softmax(q·k[index]ᵀ/√D over valid candidates)·v[index]: q [B, H, Tq, D], k, v [B, H, Tk, D] -> [B, H, Tq, D].

    index: long [Tq, M], the candidate keys of each query (shared by batch and heads); valid: bool [Tq, M],
    which candidates count. A key listed twice in a row counts once; a row with no valid candidate returns 0.
    Scores, softmax and the weighted sum run in fp32 (fp64 stays fp64) and the result is cast back to q's
    dtype. dropout_p drops attention weights after normalisation (scaled by 1/(1-p)). chunk_size: queries
    gathered at a time (default: as many as keep one gathered block near CHUNK_ELEMENTS elements).
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q [B, H, Tq, D] and k, v [B, H, Tk, D] expected, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if index.dtype != torch.long or index.dim() != 2 or index.shape[0] != Tq:
        raise ValueError(f"index must be a long tensor [Tq={Tq}, M], got {index.dtype} {tuple(index.shape)}")
    if valid.dtype != torch.bool or valid.shape != index.shape:
        raise ValueError(f"valid must be a bool tensor of index's shape {tuple(index.shape)}, "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    if bool((valid & ((index < 0) | (index >= Tk))).any()):
        raise ValueError(f"index: every valid candidate must lie in [0, {Tk})")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    M = index.shape[1]
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(1, B * H * M * D))
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")

    valid = first_occurrences(index, valid)
    safe_index = index.masked_fill(~valid, 0)  # any in-range row; its weight is zeroed below
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outputs = []
    for start in range(0, Tq, chunk_size):
        rows = slice(start, start + chunk_size)
        keep = valid[rows]
        q_c = q[:, :, rows].to(compute_dtype)
        k_c = k[:, :, safe_index[rows]].to(compute_dtype)  # [B, H, C, M, D]
        v_c = v[:, :, safe_index[rows]].to(compute_dtype)
        scores = torch.einsum("bhcd,bhcmd->bhcm", q_c, k_c) / D ** 0.5
        scores = scores.masked_fill(~keep, float("-inf"))
        # the stabiliser cancels in the ratio, so it carries no gradient; empty rows get 0 (not -inf)
        shift = scores.detach().amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        weights = (scores - shift).exp()
        # a non-empty row sums to >= 1 (its max term is exp(0)), so the clamp only turns 0/0 into 0
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, dropout_p)
        outputs.append(torch.einsum("bhcm,bhcmd->bhcd", weights, v_c))
    if not outputs:
        return q.new_zeros(q.shape)
    return torch.cat(outputs, dim=2).to(q.dtype)


def global_rows_then_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_global_rows: int,
                              index: torch.Tensor, valid: torch.Tensor, *, causal: bool,
                              dropout_p: float = 0.0) -> torch.Tensor:
    """q, k, v [B, H, T, D] -> [B, H, T, D]: the first n_global_rows queries attend every key (causal:
    every key at or before them) by dense SDPA, O(n_global_rows·T); the others attend their candidates
    index[i], valid[i] ([T, M], rows < n_global_rows unused) by `gathered_attention`, O(T·M).
    """
    T = q.shape[2]
    n_dense = min(n_global_rows, T)
    parts = []
    if n_dense:
        key_pos = torch.arange(T, device=q.device)
        mask = key_pos[None, :] <= key_pos[:n_dense, None] if causal else None
        parts.append(F.scaled_dot_product_attention(q[:, :, :n_dense], k, v, attn_mask=mask, dropout_p=dropout_p))
    parts.append(gathered_attention(q[:, :, n_dense:], k, v, index[n_dense:], valid[n_dense:], dropout_p=dropout_p))
    return torch.cat(parts, dim=2)
