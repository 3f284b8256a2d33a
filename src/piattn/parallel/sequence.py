"""`sequence_parallel_pi_attention`: π-Attention over a sequence split into contiguous shards across ranks.

Each rank receives, point to point, only the key/value rows its queries read (its halos and skip blocks,
see `plan.py`), runs the ordinary operator on [received rows + own rows] with zero queries in the received
rows, and keeps its own rows' outputs. In backward the gradients of the received rows go back to their
owners and are added to theirs. The only collective is one all-reduce of five integers per call, which
checks that the ranks agree on the shard length and the settings (and that none of them failed its own
argument checks), so that a mistake raises the same ValueError on every rank instead of a hang.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.pi import PiSettings
from ..ops.pi import BACKENDS, pi_attention, pi_attention_with_settings
from ..ops.pi.heads import operator_by_period
from ..ops.pi.validate import check_qkv_tensors, check_settings_call, head_periods
from .plan import HaloPlan, Transfer

# The operator's keyword arguments and their defaults, read from its signature so they cannot drift: the
# keywords `sequence_parallel_pi_attention` and `plan_for` accept (`_given` reads them).
OPERATOR_DEFAULTS = {
    name: p.default for name, p in inspect.signature(pi_attention).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}
_INT64_MASK = (1 << 62) - 1


@dataclass(frozen=True)
class _Call:
    """A checked sequence-parallel call's arguments besides its tensors and its group: the operator settings
    whole (`PiSettings`: the same object a layer hands over, or the one built from a user's keywords) and the
    call's own arguments (no sinks and no documents: refused before a call is made)."""

    settings: PiSettings
    causal: bool
    scale: float | None
    dropout_p: float
    backend: str
    check_gate: bool

    def fingerprint(self, q: torch.Tensor, H_kv: int, gate: torch.Tensor | None) -> int:
        """A 62-bit fingerprint of what must agree across ranks: every field of the settings, the call's own
        arguments but the backend (which may differ per device), B, H, H_kv, D, dtypes and whether a gate is
        given. (The settings' period is one int where the heads share it, else one per head: with H, the same
        per-head periods.)"""
        B, H, _, D = q.shape
        settings = tuple((f.name, getattr(self.settings, f.name)) for f in dataclasses.fields(PiSettings))
        key = repr((settings, self.causal, self.scale, self.dropout_p, self.check_gate, B, H, H_kv, D, str(q.dtype),
                    None if gate is None else str(gate.dtype)))
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & _INT64_MASK


def _given(pi_attention_kwargs: dict):
    """name -> the value a caller passed among `pi_attention`'s keywords, else its default."""
    return lambda name: pi_attention_kwargs.get(name, OPERATOR_DEFAULTS[name])


def _resolve_group(group):
    """(group, rank in it, its size), or None where the plain operator applies (no process group)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    else:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group was given, but no torch.distributed process group is initialised; "
                             "call dist.init_process_group first, or pass group=None for one process")
        if not isinstance(group, dist.ProcessGroup):
            if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # new_group's answer
                raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group")
            raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group")
    return group, rank, dist.get_world_size(group)


def _agree(shard: int, fingerprint: int, error: Exception | None, group, device: torch.device) -> None:
    """One all-reduce (max) of [S, −S, h, −h, failed]: raise on every rank if any rank failed its checks,
    if shard lengths differ, or if settings differ."""
    t = torch.tensor([shard, -shard, fingerprint, -fingerprint, int(error is not None)], dtype=torch.int64,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi_s, lo_s, hi_h, lo_h, failed = (int(x) for x in t.tolist())
    if error is not None:
        raise error
    if failed:
        raise ValueError("sequence_parallel_pi_attention: another rank of the group passed invalid arguments "
                         "(its error names them); every rank must pass a valid shard")
    if hi_s != -lo_s:
        raise ValueError(f"q: shard lengths differ across the ranks of the group (from {-lo_s} to {hi_s} "
                         "positions); every rank must hold T / P positions, so T must be divisible by the "
                         "group size")
    if hi_h != -lo_h:
        raise ValueError("pi_attention_kwargs differ across the ranks of the group (window, period, causal, "
                         "variant, prior, logit_clamp, eps, scale, dropout_p), or the shapes B, H, H_kv, D, the "
                         "dtypes or the presence of a gate do; every rank must pass the same")


def _exchange(sends: dict[int, torch.Tensor], recv_rows: dict[int, int], like: torch.Tensor, width: int, group
              ) -> dict[int, torch.Tensor]:
    """Point-to-point: send each tensor to its peer (group rank); from each peer receive `rows` rows of
    [B, H, rows, width] (B, H, dtype and device of `like`)."""
    B, H, C = like.shape[0], like.shape[1], width
    received = {peer: like.new_empty(B, H, rows, C) for peer, rows in recv_rows.items() if rows}
    ops = [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, peer), group) for peer, buf in received.items()]
    ops += [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group)
            for peer, t in sends.items() if t.shape[2]]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def _by_peer(transfers: tuple[Transfer, ...], peer_of) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(peer_of(t), []).append(t)
    return out


def _pack(parts: list[torch.Tensor], transfers: list[Transfer], rows_of) -> torch.Tensor:
    """One message: for each transfer, the rows `rows_of(t)` of every tensor in `parts`, side by side."""
    return torch.cat([torch.cat([x[:, :, rows_of(t)] for x in parts], -1) for t in transfers], 2)


class _HaloExchange(torch.autograd.Function):
    """k, v [B, H_kv, S, D] -> the received rows of k and of v [B, H_kv, N, D], in the order of the plan's
    `receives(rank)`. Only the rows that travel are copied into messages (keys and values side by side).
    Backward: the received rows' gradients go back to their owners, which add them to their own."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, plan: HaloPlan, rank: int, group):
        ctx.plan, ctx.rank, ctx.group = plan, rank, group
        base, D = rank * plan.shard, k.shape[3]
        outgoing = _by_peer(plan.sends(rank), lambda t: t.dst)
        incoming = _by_peer(plan.receives(rank), lambda t: t.src)
        local_rows = lambda t: slice(t.start - base, t.end - base)
        sends = {dst: _pack([k, v], ts, local_rows) for dst, ts in outgoing.items()}
        got = _exchange(sends, {src: sum(t.rows for t in ts) for src, ts in incoming.items()}, k, 2 * D, group)
        B, H, N = k.shape[0], k.shape[1], plan.rows_received(rank)
        k_recv, v_recv = k.new_empty(B, H, N, D), v.new_empty(B, H, N, D)
        for src, ts in incoming.items():
            row = 0
            for t in ts:
                block = got[src][:, :, row:row + t.rows]
                k_recv[:, :, t.at:t.at + t.rows] = block[..., :D]
                v_recv[:, :, t.at:t.at + t.rows] = block[..., D:]
                row += t.rows
        return k_recv, v_recv

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor, grad_v: torch.Tensor):
        plan, rank, group = ctx.plan, ctx.rank, ctx.group
        base, D = rank * plan.shard, grad_k.shape[3]
        outgoing = _by_peer(plan.sends(rank), lambda t: t.dst)  # their gradients come back from dst
        incoming = _by_peer(plan.receives(rank), lambda t: t.src)  # their gradients go back to src
        sends = {src: _pack([grad_k, grad_v], ts, lambda t: slice(t.at, t.at + t.rows))
                 for src, ts in incoming.items()}
        got = _exchange(sends, {dst: sum(t.rows for t in ts) for dst, ts in outgoing.items()}, grad_k, 2 * D,
                        group)
        B, H = grad_k.shape[:2]
        dk, dv = grad_k.new_zeros(B, H, plan.shard, D), grad_v.new_zeros(B, H, plan.shard, D)
        for dst, ts in outgoing.items():
            row = 0
            for t in ts:  # a row sent to several ranks collects a gradient from each
                block = got[dst][:, :, row:row + t.rows]
                dk[:, :, t.start - base:t.end - base] += block[..., :D]
                dv[:, :, t.start - base:t.end - base] += block[..., D:]
                row += t.rows
        return dk, dv, None, None, None


def plan_for(q: torch.Tensor, group=None, **pi_attention_kwargs) -> tuple[HaloPlan, ...] | None:
    """The exchange plans a call with this local shard would use, one per distinct period of its heads in
    increasing period (the call runs one exchange each; one plan for one period), or None where the plain
    operator runs."""
    resolved = _resolve_group(group)
    if resolved is None or resolved[2] == 1:
        return None
    given = _given(pi_attention_kwargs)
    periods = head_periods(given("period"), q.shape[1], device=q.device)
    return tuple(HaloPlan(resolved[2], q.shape[2], given("window"), p, given("causal"))
                 for p in sorted(set(periods)))


def sequence_parallel_pi_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None = None, *, group=None,
    **pi_attention_kwargs,
) -> torch.Tensor:
    """`piattn.pi_attention` on a sequence sharded contiguously over the ranks of `group`.

    Args:
        q: [B, H, S, D] this rank's shard: group rank r holds positions r·S … (r+1)·S − 1 of a sequence
            of T = P·S positions (P = group size). S must be the same on every rank.
        k, v: [B, H_kv, S, D], the same positions, with H_kv dividing H (grouped-query attention): only
            the H_kv key/value heads travel, none is repeated.
        gate: [B, H, S] this rank's gate (variants "adaptive", "separate"), else None.
        group: a torch.distributed ProcessGroup; None means the default (world) group. With no process
            group initialised, or a group of one rank, this is `pi_attention` itself.
        **pi_attention_kwargs: window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_p,
            backend, as for `pi_attention`; every rank must pass the same (the backend may differ). period
            may give one period per query head (multi-scale π): the heads are grouped by period
            (`piattn.ops.pi.heads.operator_by_period`) and each group runs its own exchange of its key/value heads'
            rows (the plan of its period), so every group is exact and moves only the rows it reads. The
            operator settings among them become one `PiSettings` (checked there), and the call runs as
            `sequence_parallel_pi_attention_with_settings` runs it.

    Returns:
        [B, H, S, D]: this rank's shard of the output of `pi_attention` on the whole sequence. Backward
        gives each rank its shard of the gradients (q, k, v, gate). Every rank of the group must call this
        (and, when gradients are needed, run backward through it) the same number of times in the same
        order, as with any collective. With dropout_p > 0 each rank draws its own dropout mask, so the
        result is a valid dropout sample but not the one the unsharded call would draw.
    """
    unknown = sorted(set(pi_attention_kwargs) - set(OPERATOR_DEFAULTS))
    if unknown:
        raise ValueError(f"pi_attention_kwargs: unknown argument(s) {unknown}; allowed: {sorted(OPERATOR_DEFAULTS)}")
    resolved = _resolve_group(group)
    if resolved is None or resolved[2] == 1:
        return pi_attention(q, k, v, gate, **pi_attention_kwargs)
    given = _given(pi_attention_kwargs)
    if given("layout") != "bhtd":  # shards are slices of T in [B, H, T, D]; every rank is given the same
        raise ValueError(f"layout must be 'bhtd' for sequence-parallel pi_attention (shards of [B, H, T, D] "
                         f"along T), got {given('layout')!r}; transpose the shards")
    settings, error = None, None
    try:  # the verdict is shared (`_sharded_call`), so that a bad rank cannot leave others waiting
        check_qkv_tensors(q, k, v)
        # One period per query head (a tensor becomes a tuple), then the operator settings typed, and checked, once.
        periods = head_periods(given("period"), q.shape[1], device=q.device)
        settings = PiSettings(window=given("window"), period=periods, variant=given("variant"), prior=given("prior"),
                              logit_clamp=given("logit_clamp"), eps=given("eps"), sinks=given("sinks"))
    except ValueError as e:
        error = e
    return _sharded_call(q, k, v, gate, settings, resolved, error, causal=given("causal"), scale=given("scale"),
                         dropout_p=given("dropout_p"), document_ids=given("document_ids"), backend=given("backend"),
                         check_gate=given("check_gate"))


def sequence_parallel_pi_attention_with_settings(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, settings: PiSettings, *,
    group=None, causal: bool = True, scale: float | None = None, dropout_p: float = 0.0,
    document_ids: torch.Tensor | None = None, backend: str = "auto", check_gate: bool = True,
) -> torch.Tensor:
    """`sequence_parallel_pi_attention` with the operator settings as one `PiSettings`, handed over whole (as
    `piattn.ops.pi.pi_attention_with_settings` takes them): what a layer runs inside
    `piattn.layers.sharding.sequence_parallel`. Its period is one int or one per query head; every rank must
    pass equal settings and call arguments (the backend may differ). Without a process group, or in a group of
    one rank, this is `pi_attention_with_settings` itself."""
    resolved = _resolve_group(group)
    if resolved is None or resolved[2] == 1:
        return pi_attention_with_settings(q, k, v, gate, settings, causal=causal, scale=scale, dropout_p=dropout_p,
                                          document_ids=document_ids, backend=backend, check_gate=check_gate)
    return _sharded_call(q, k, v, gate, settings, resolved, None, causal=causal, scale=scale, dropout_p=dropout_p,
                         document_ids=document_ids, backend=backend, check_gate=check_gate)


def _sharded_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                  settings: PiSettings | None, resolved: tuple, error: ValueError | None, *, causal, scale, dropout_p,
                  document_ids, backend, check_gate) -> torch.Tensor:
    """The checks of a sharded call (unless `error` already failed them), their verdict shared by every rank of
    the group (`_agree`), then one exchange and operator call per period group."""
    group, rank, world = resolved
    call, periods, shard, fingerprint = None, (), 0, 0
    if error is None:
        try:  # local checks first, but the verdict is shared, so that a bad rank cannot leave others waiting
            check_settings_call(q, k, v, gate, settings, causal=causal, scale=scale, dropout_p=dropout_p,
                                document_ids=document_ids, check_gate=check_gate)
            # One period per query head: what is grouped (the fingerprint holds the settings' own form, and H).
            periods = head_periods(settings.period, q.shape[1], device=q.device)
            if settings.sinks or document_ids is not None:
                # The exchange carries window and skip rows only: sink keys and documents would cross shards.
                raise ValueError("sequence_parallel_pi_attention supports neither sinks > 0 nor document_ids, got "
                                 f"sinks={settings.sinks!r}, document_ids of type {type(document_ids).__name__}")
            if backend not in BACKENDS:
                raise ValueError(f"backend must be one of {BACKENDS} on this install, got {backend!r}")
            call = _Call(settings, causal=causal, scale=scale, dropout_p=dropout_p, backend=backend,
                         check_gate=check_gate)
            shard, fingerprint = q.shape[2], call.fingerprint(q, k.shape[1], gate)
        except ValueError as e:
            error = e
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    _agree(shard, fingerprint, error, group, device)

    def run(p: int, q_g: torch.Tensor, gate_g: torch.Tensor | None, k_g: torch.Tensor,
            v_g: torch.Tensor) -> torch.Tensor:
        return _sharded(q_g, k_g, v_g, gate_g, p, call, world, rank, group)

    # Every rank has the same periods (the fingerprint agreed), so every rank runs the same exchanges in order.
    return operator_by_period(periods, run, q, gate, k, v)


def _sharded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, period: int,
             call: _Call, world: int, rank: int, group) -> torch.Tensor:
    """The exchange and the operator of one period, on a checked call agreed by every rank."""
    shard = q.shape[2]
    plan = HaloPlan(world, shard, call.settings.window, period, call.causal)
    k_recv, v_recv = _HaloExchange.apply(k, v, plan, rank, group)
    before = plan.own_offset(rank)  # received rows that precede the own rows in the extended array
    after = plan.rows_received(rank) - before
    # The received tensors always take part (even with no rows), so that every rank runs the backward
    # exchange and returns the gradients its peers are waiting for.
    k_ext = torch.cat([k_recv[:, :, :before], k, k_recv[:, :, before:]], 2)
    v_ext = torch.cat([v_recv[:, :, :before], v, v_recv[:, :, before:]], 2)
    B, H, _, D = q.shape
    q_ext = torch.cat([q.new_zeros(B, H, before, D), q, q.new_zeros(B, H, after, D)], 2)
    gate_ext = None
    if gate is not None:
        gate_ext = torch.cat([gate.new_full((B, H, before), 0.5), gate, gate.new_full((B, H, after), 0.5)], 2)
    # The settings of this period's heads on the extended array: `plan.ext_period` in place of the period.
    settings = dataclasses.replace(call.settings, period=plan.ext_period)
    y = pi_attention_with_settings(q_ext, k_ext, v_ext, gate_ext, settings, causal=call.causal, scale=call.scale,
                                   dropout_p=call.dropout_p, backend=call.backend, check_gate=call.check_gate)
    return y[:, :, before:before + shard]
