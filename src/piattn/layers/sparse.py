"""Softmax attention over an explicit candidate-key list per query, in O(T·M·D) memory, never [T, T].

The fixed sparse kinds (longformer, bigbird) describe their non-global rows as "query i attends keys
index[i, 0..M-1] where valid"; this module turns such a list into attention by gathering the candidate
k/v rows chunk by chunk. Consecutive queries may share one candidate row (`group`, BigBird's query
blocks): their keys are gathered once and scored by one small matmul, so the gathered k/v cost
O(T/group·M·D) and only the scores O(T·M). Plain autograd differentiates it (gather, matmul, exp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import is_int
from ..ops.pi.dtypes import accumulation_dtype

# elements of one chunk's gathered k (or v) block [B, H, C, M, D] or scores [B, H, C, group, M]; bounds the
# no-grad peak memory
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
                       valid: torch.Tensor, *, group: int = 1, dropout_p: float = 0.0,
                       chunk_size: int | None = None) -> torch.Tensor:
    """softmax(q·k[index]ᵀ/√D over valid candidates)·v[index]: q [B, H, Tq, D], k, v [B, H, Tk, D] -> [B, H, Tq, D].

    index: long [ceil(Tq / group), M], row r the candidate keys of queries r·group … r·group + group - 1
    (shared by batch and heads); valid: bool [Tq, M], which of its row's candidates query i counts. A key
    listed twice in a row counts once; a query with no valid candidate returns 0. Scores, softmax and the
    weighted sum run in fp32 (fp64 stays fp64) and the result is cast back to q's dtype. dropout_p drops
    attention weights after normalisation (scaled by 1/(1-p)). chunk_size: index rows gathered at a time
    (default: as many as keep a chunk's gathered keys and scores near CHUNK_ELEMENTS elements each).
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q [B, H, Tq, D] and k, v [B, H, Tk, D] expected, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not is_int(group) or group < 1:
        raise ValueError(f"group must be an integer >= 1, got {group!r}")
    B, H, Tq, D = q.shape
    Tk, n_rows = k.shape[2], -(-Tq // group)
    if index.dtype != torch.long or index.dim() != 2 or index.shape[0] != n_rows:
        raise ValueError(f"index must be a long tensor [ceil(Tq / group)={n_rows}, M], "
                         f"got {index.dtype} {tuple(index.shape)}")
    M = index.shape[1]
    if valid.dtype != torch.bool or valid.shape != (Tq, M):
        raise ValueError(f"valid must be a bool tensor [Tq={Tq}, M={M}], got {valid.dtype} {tuple(valid.shape)}")
    per_query = index.repeat_interleave(group, dim=0)[:Tq]  # [Tq, M]: O(T·M) integers, no D
    if bool((valid & ((per_query < 0) | (per_query >= Tk))).any()):
        raise ValueError(f"index must lie in [0, Tk={Tk}) wherever valid is True")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(1, B * H * M * max(D, group)))
    elif not is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    if Tq == 0:
        return q.new_zeros(q.shape)

    pad = n_rows * group - Tq  # the last group may be short: pad it with queries that see nothing
    keep = F.pad(first_occurrences(per_query, valid), (0, 0, 0, pad)).view(n_rows, group, M)
    safe_index = index.masked_fill(~keep.any(1), 0)  # an in-range row for candidates no query counts
    compute_dtype = accumulation_dtype(q.dtype)
    q_groups = F.pad(q, (0, 0, 0, pad)).view(B, H, n_rows, group, D)
    outputs = []
    for start in range(0, n_rows, chunk_size):
        rows = slice(start, start + chunk_size)
        q_c = q_groups[:, :, rows].to(compute_dtype)  # [B, H, C, group, D]
        k_c = k[:, :, safe_index[rows]].to(compute_dtype)  # [B, H, C, M, D]
        v_c = v[:, :, safe_index[rows]].to(compute_dtype)
        scores = (q_c @ k_c.transpose(-1, -2)) / D ** 0.5  # [B, H, C, group, M]
        scores = scores.masked_fill(~keep[rows], float("-inf"))
        # the stabiliser cancels in the ratio, so it carries no gradient; empty rows get 0 (not -inf)
        shift = scores.detach().amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        weights = (scores - shift).exp()
        # a non-empty row sums to >= 1 (its max term is exp(0)), so the clamp only turns 0/0 into 0
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, dropout_p)
        outputs.append(weights @ v_c)
    return torch.cat(outputs, dim=2).view(B, H, n_rows * group, D)[:, :, :Tq].to(q.dtype)


def global_rows_then_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_global_rows: int,
                              index: torch.Tensor, valid: torch.Tensor, *, causal: bool, group: int = 1,
                              dropout_p: float = 0.0) -> torch.Tensor:
    """q, k, v [B, H, T, D] -> [B, H, T, D]: the first n_global_rows queries attend every key (causal:
    every key at or before them) by dense SDPA, O(n_global_rows·T); the others attend their candidates
    by `gathered_attention` (index [ceil(T / group), M], valid [T, M], both for all T queries; the global
    rows' entries are unused, so n_global_rows must be a multiple of group), O(T·M).
    """
    if n_global_rows % group:
        raise ValueError(f"n_global_rows ({n_global_rows}) must be a multiple of group ({group})")
    T = q.shape[2]
    n_dense = min(n_global_rows, T)
    parts = []
    if n_dense:
        key_pos = torch.arange(T, device=q.device)
        mask = key_pos[None, :] <= key_pos[:n_dense, None] if causal else None
        parts.append(F.scaled_dot_product_attention(q[:, :, :n_dense], k, v, attn_mask=mask, dropout_p=dropout_p))
    if n_dense < T:
        parts.append(gathered_attention(q[:, :, n_dense:], k, v, index[n_dense // group:], valid[n_dense:],
                                        group=group, dropout_p=dropout_p))
    return torch.cat(parts, dim=2) if parts else q.new_zeros(q.shape)
