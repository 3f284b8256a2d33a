"""What each rank runs in the multi-process tests (see sp_harness.run_ranks). Results are JSON-able."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from piattn import pi_attention
from piattn.layers.sharding import active_shard, sequence_parallel
from piattn.models import GPT, GPTConfig
from piattn.parallel import sequence_parallel_pi_attention

GATED = ("separate", "adaptive")
# Collectives that would move the whole sequence; the exchange must use none of them.
FORBIDDEN = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "all_to_all",
             "all_to_all_single", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "send", "recv")


class Traffic:
    """Counts what the library hands to torch.distributed: rows and bytes of every P2P op, per phase,
    all-reduce calls, and any call to a forbidden collective."""

    def __init__(self):
        self.phase = "fwd"
        self.counts: Counter = Counter()
        self._saved = {}

    def __enter__(self):
        originals = {name: getattr(dist, name) for name in ("batch_isend_irecv", "all_reduce", "irecv", *FORBIDDEN)}
        self._saved = originals

        def batch(ops):
            for op in ops:
                kind = "recv" if op.op is originals["irecv"] else "send"
                self.counts[f"{self.phase}_{kind}_rows"] += op.tensor.shape[2]
                self.counts[f"{self.phase}_{kind}_bytes"] += op.tensor.numel() * op.tensor.element_size()
            return originals["batch_isend_irecv"](ops)

        def all_reduce(*args, **kwargs):
            self.counts["all_reduce"] += 1
            return originals["all_reduce"](*args, **kwargs)

        def forbidden(name):
            def call(*args, **kwargs):
                self.counts[f"forbidden:{name}"] += 1
                return originals[name](*args, **kwargs)
            return call

        dist.batch_isend_irecv = batch
        dist.all_reduce = all_reduce
        for name in FORBIDDEN:
            setattr(dist, name, forbidden(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():  # (isend / irecv are left alone: P2POp checks their identity)
            setattr(dist, name, fn)


def make_inputs(case: dict, T: int):
    g = torch.Generator().manual_seed(case["seed"])
    B, H, D = case.get("B", 1), case.get("H", 2), case.get("D", 4)
    H_kv = case.get("H_kv", H)  # grouped-query attention when H_kv < H
    q, k, v, dy = (torch.randn(B, heads, T, D, dtype=torch.float64, generator=g) for heads in (H, H_kv, H_kv, H))
    gate = None
    if case["variant"] in GATED:
        gate = 0.05 + 0.9 * torch.rand(B, H, T, dtype=torch.float64, generator=g)
    return q, k, v, gate, dy


def operator_kwargs(case: dict) -> dict:
    kw = dict(window=case["window"], period=case["period"], causal=case["causal"], variant=case["variant"],
              backend=case.get("backend", "reference"), logit_clamp=case.get("logit_clamp", 20.0))
    if case["variant"] == "fixed":
        kw["prior"] = 0.3
    return kw


def full_and_grads(q, k, v, gate, dy, kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if gate is None else [gate.clone().requires_grad_()])
    y = pi_attention(*leaves[:3], leaves[3] if gate is not None else None, **kw)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def _groups(world: int, cases: list[dict]) -> dict:
    """Every process group the cases name, created in the same order on every rank (as new_group needs)."""
    groups = {}
    for case in cases:
        spec = case["ranks"]
        if spec == "self":
            for r in range(world):
                if (r,) not in groups:
                    groups[(r,)] = dist.new_group([r])
        elif spec is not None and tuple(spec) not in groups:
            groups[tuple(spec)] = dist.new_group(list(spec))
    return groups


def equivalence(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case: the sharded call's output and gradients against the single-process operator on the
    whole sequence (computed here from the same seed), plus what the exchange moved."""
    groups = _groups(world, cases)
    results = []
    for case in cases:
        spec = case["ranks"]
        if spec == "self":
            members, group = [rank], groups[(rank,)]
        elif spec is None:
            members, group = list(range(world)), None
        else:
            members, group = list(spec), groups[tuple(spec)]
        if rank not in members:
            continue
        r, P, S = members.index(rank), len(members), case["shard"]
        kw = operator_kwargs(case)
        q, k, v, gate, dy = make_inputs(case, P * S)
        y_full, grads_full = full_and_grads(q, k, v, gate, dy, kw)

        own = slice(r * S, (r + 1) * S)
        shard = [t[:, :, own].clone().requires_grad_() for t in (q, k, v)]
        gshard = None if gate is None else gate[:, :, own].clone().requires_grad_()
        with Traffic() as traffic:
            y = sequence_parallel_pi_attention(*shard, gshard, group=group, **kw)
            traffic.phase = "bwd"
            y.backward(dy[:, :, own])
        errors = {"out": (y.detach() - y_full[:, :, own]).abs().max().item()}
        for name, t, full in zip(("dq", "dk", "dv", "dgate"), [*shard, gshard], [*grads_full, None][:4], strict=True):
            if t is not None:
                errors[name] = (t.grad - full[:, :, own]).abs().max().item()
        scale = max(t[:, :, own].abs().max().item() for t in grads_full)
        results.append(dict(case=case["name"], rank=r, world=P, errors=errors, grad_scale=scale,
                            traffic=dict(traffic.counts)))
    return results


def _attempt(fn) -> str:
    """'ok' or the ValueError message of fn()."""
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "ok"


def mismatch(rank: int, world: int, _payload) -> dict:
    """Wrong calls on some ranks: every rank must get a ValueError (none may hang), and the group must
    still work afterwards."""
    case = dict(seed=1, variant="adaptive", window=2, period=3, causal=True)
    S = 4
    q, k, v, gate, _ = make_inputs(case, world * (S + 1))
    kw = operator_kwargs(case)

    def call(n=S, group=None, gate_value=None, kv_heads=None, **over):
        g = gate[:, :, :n] if gate_value is None else torch.full_like(gate[:, :, :n], gate_value)
        return sequence_parallel_pi_attention(q[:, :, :n], k[:, :kv_heads, :n], v[:, :kv_heads, :n], g,
                                              group=group, **{**kw, **over})

    only_first = dist.new_group([0])
    out = {
        "shard_lengths": _attempt(lambda: call(n=S + (rank == world - 1))),
        "settings": _attempt(lambda: call(window=2 + (rank == world - 1))),
        "causal": _attempt(lambda: call(causal=rank != 0)),
        "invalid_on_one_rank": _attempt(lambda: call(variant="bogus" if rank == 1 else "adaptive")),
        "gate_out_of_range_on_one_rank": _attempt(lambda: call(gate_value=1.5 if rank == 1 else 0.5)),
        "kv_heads": _attempt(lambda: call(kv_heads=1 if rank == 1 else None)),
        "sinks": _attempt(lambda: call(sinks=2)),
        "document_ids": _attempt(lambda: call(document_ids=torch.zeros(1, S, dtype=torch.long))),
        "group_type": _attempt(lambda: call(group="world")),
        "not_a_member": _attempt(lambda: call(group=only_first)) if rank != 0 else "skipped",
    }
    # The ranks are still in step: a correct call now gives the unsharded result.
    T = world * S
    q, k, v, gate, dy = make_inputs(case, T)
    y_full, _ = full_and_grads(q, k, v, gate, dy, kw)
    own = slice(rank * S, (rank + 1) * S)
    y = sequence_parallel_pi_attention(q[:, :, own], k[:, :, own], v[:, :, own], gate[:, :, own], **kw)
    out["after"] = (y - y_full[:, :, own]).abs().max().item()
    return out


def _model(case: dict):
    """A 2-layer, width-32 GPT of `case` in fp64, seeded; gate biases moved away from α = 0.5."""
    torch.manual_seed(case["seed"])
    cfg = GPTConfig.from_name("tiny", **{**dict(vocab_size=50, n_layer=2, d_model=32, n_head=2, dropout=0.0,
                                            backend="reference"), **case["model"]})
    model = GPT(cfg).double()
    for block in model.blocks:
        if getattr(block.attn, "gate", None) is not None:
            torch.nn.init.normal_(block.attn.gate[2].bias, std=2.0)
    return model


def model_shards(rank: int, world: int, cases: list[dict]) -> dict:
    """Model-level sequence parallelism: the world is split into sequence groups of `size` consecutive
    ranks (so group ranks differ from global ones); each rank runs the GPT on its shard of every sequence
    inside `sequence_parallel(group)`. Its logits must be its rows of the unsharded logits, and the
    parameter gradients summed over the group must be the unsharded gradients."""
    out = {}
    for case in cases:
        size = case["size"]
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
        group, r = groups[rank // size], rank % size
        model = _model(case)
        g = torch.Generator().manual_seed(case["seed"] + 1)
        T = size * case["shard"]
        idx = torch.randint(0, 50, (2, T), generator=g)
        weight = torch.randn(2, T, 50, generator=g, dtype=torch.float64)
        logits_full = model(idx)
        (logits_full * weight).sum().backward()
        grads_full = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()

        own = slice(r * case["shard"], (r + 1) * case["shard"])
        try:
            with sequence_parallel(group) as shard:
                inside = active_shard()
                logits = model(idx[:, own])
        except ValueError as e:
            out[case["name"]] = {"error": str(e)}
            continue
        (logits * weight[:, own]).sum().backward()
        errors = {"logits": (logits.detach() - logits_full[:, own]).abs().max().item()}
        for n, p in model.named_parameters():
            dist.all_reduce(p.grad, group=group)
            errors[n] = (p.grad - grads_full[n]).abs().max().item()
        scale = max(t.abs().max().item() for t in grads_full.values())
        decoding = _attempt(lambda: _decode_inside(model, idx[:, own], group))  # noqa: B023
        out[case["name"]] = {"errors": errors, "grad_scale": scale, "group_rank": shard.rank,
                             "inside": inside == shard, "after": active_shard() is None, "decoding": decoding}
    return out


def _decode_inside(model, idx, group):
    with sequence_parallel(group):
        model(idx, model.init_cache(idx.shape[0]))


JOBS = {"equivalence": equivalence, "mismatch": mismatch, "model_shards": model_shards}


def needed_positions(world: int, shard: int, window: int, period: int, causal: bool, rank: int) -> set[int]:
    """Brute force, from the operator's definition: every in-range key position a query of `rank` reads
    that `rank` does not own."""
    T, a, b = world * shard, rank * shard, (rank + 1) * shard
    offsets = set(range(-window, (0 if causal else window) + 1)) | ({-period} if causal else {-period, period})
    return {i + o for i in range(a, b) for o in offsets if 0 <= i + o < T and not a <= i + o < b}


def head_periods(rank: int, world: int, payload: dict) -> dict:
    """Multi-scale π sharded: the operator cases (`equivalence`), the model cases (`model_shards`) and calls
    with bad per-head periods (each must raise the same ValueError on every rank, and the group stay in
    step), in one run of the processes."""
    errors = {}
    case = dict(seed=3, variant="adaptive", window=1, period=(2, 5), causal=True)
    S = 4
    q, k, v, gate, _ = make_inputs(case, world * S)
    kw = operator_kwargs(case)
    calls = {
        "differ_across_ranks": dict(period=(2, 5) if rank else (2, 6)),
        "wrong_length": dict(period=(2, 5, 7)),
        "zero": dict(period=(2, 0)),
        "float": dict(period=(2, 5.0)),
        "float_tensor": dict(period=torch.tensor([2.0, 5.0])),
        "tensor_on_another_device": dict(period=torch.tensor([2, 5], device="meta")),
    }
    for name, over in calls.items():
        errors[name] = _attempt(lambda over=over: sequence_parallel_pi_attention(q, k, v, gate, **{**kw, **over}))
    own = slice(rank * S, (rank + 1) * S)
    y_full = pi_attention(q, k, v, gate, **kw)
    y = sequence_parallel_pi_attention(q[:, :, own], k[:, :, own], v[:, :, own], gate[:, :, own],
                                       **{**kw, "period": torch.tensor([2, 5])})  # a tensor of periods works
    errors["after"] = (y - y_full[:, :, own]).abs().max().item()
    return {"operator": equivalence(rank, world, payload["cases"]),
            "models": model_shards(rank, world, payload["models"]), "errors": errors}


JOBS["head_periods"] = head_periods
