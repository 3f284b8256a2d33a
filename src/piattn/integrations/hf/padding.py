"""Left padding as documents: where each row's text lies in a 2D attention mask, and the document ids of
any positions of that row.

π-Attention's pattern is relative positions, so a pad token cannot simply be masked out of a row: the
window and the skip of a real token would still count the pads. Instead the pads become documents of
their own (the operator lets no key cross a document boundary), and the text starts its own document,
with its window, skip and sinks measured from its first token.
"""

from __future__ import annotations

import torch

# Document ids: pads before the text, the text, pads after it (right padding, outside generation), and
# key slots that hold no key at all.
BEFORE, TEXT, AFTER, EMPTY = 0, 1, 2, -1


def text_bounds(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_mask [B, P] (1 = token, 0 = pad) -> (start, end) [B] int64: each row's text is the one run
    of ones start … end − 1 (an all-pad row has start = end = P).

    A row whose ones are not one run (a pad between two tokens) raises: the pattern cannot skip a hole.
    """
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be 2D [batch, positions] (1 = token, 0 = pad), got shape "
                         f"{tuple(attention_mask.shape)}: pi_attention takes no prepared or custom masks")
    mask = attention_mask.bool()
    B, P = mask.shape
    count = mask.sum(1)
    pos = torch.arange(P, device=mask.device)
    start = torch.where(mask, pos, P).amin(1)
    end = torch.where(mask, pos + 1, 0).amax(1)
    start = torch.where(count > 0, start, P)
    end = torch.where(count > 0, end, P)
    if bool((end - start != count).any()):
        raise ValueError("attention_mask must hold each row's tokens as one run of ones (left or right padding "
                         "only): pi_attention cannot skip pads between tokens")
    return start, end


def document_ids(positions: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """positions [T] or [B, T] (absolute), start, end [B] -> [B, T] int64: BEFORE, TEXT or AFTER."""
    positions = positions.expand(start.shape[0], -1)
    return (positions >= start[:, None]).long() + (positions >= end[:, None]).long()
