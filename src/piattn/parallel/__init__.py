"""Sequence parallelism for π-Attention: each rank holds a contiguous shard of the sequence.

    from piattn.parallel import sequence_parallel_pi_attention
    y = sequence_parallel_pi_attention(q, k, v, gate, window=4, period=16)   # [B, H, T/P, D] in and out

Only the key/value rows another rank's queries read are sent, point to point (`HaloPlan` says which);
see docs/sequence_parallel.md.
"""

from .plan import HaloPlan, Transfer
from .sequence import plan_for, sequence_parallel_pi_attention, sequence_parallel_pi_attention_with_settings

__all__ = ["HaloPlan", "Transfer", "plan_for", "sequence_parallel_pi_attention",
           "sequence_parallel_pi_attention_with_settings"]
