"""`pi_attention`: the public operator, its argument checks and the choice of backend.

`pi_attention` checks a call and builds its one `OpSettings`; every backend is a function of the tensors
and those settings (`backends.BackendRun`); they differ in how they compute, never in what. What each can
run is declared in `backends.py`. `pi_attention_with_settings` is the same operator with its settings as one
`piattn.config.PiSettings`, handed over whole: what the layers, the Hugging Face adapter and sequence
parallelism call.
"""

from __future__ import annotations

from collections.abc import Sequence

# Aliased: importing the submodule `.torch` rebinds the package attribute `torch` to that submodule.
import torch as _torch

from ...config.pi import PI_DEFAULTS, PiSettings
from .backends import AUTO_ORDER, REGISTRY, BackendRun, select
from .compiled import is_symbolic
from .heads import by_period, period_groups
from .pattern import Pattern
from .settings import OpSettings
from .validate import (
    all_finite,
    check_arguments,
    check_layout,
    check_layout_shapes,
    check_qkv_tensors,
    gate_or_prior,
    head_periods,
    layout_name,
)
from .weights import SlotWeights, pi_attention_weights  # noqa: F401 (public: piattn.pi_attention_weights)

# "auto" and the backends this install can run.
BACKENDS: tuple[str, ...] = ("auto", *(name for name, b in REGISTRY.items() if b.available()))


def pi_attention(
    q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    gate: _torch.Tensor | None = None,
    *,
    window: int = PI_DEFAULTS.window,
    period: int | Sequence[int] | _torch.Tensor = PI_DEFAULTS.period,
    causal: bool = True,
    variant: str = PI_DEFAULTS.variant,
    prior: float = PI_DEFAULTS.prior,
    logit_clamp: float | None = PI_DEFAULTS.logit_clamp,
    eps: float = PI_DEFAULTS.eps,
    scale: float | None = None,
    dropout_p: float = 0.0,
    sinks: int = PI_DEFAULTS.sinks,
    document_ids: _torch.Tensor | None = None,
    backend: str = "auto",
    check_gate: bool = True,
    layout: str = "bhtd",
) -> _torch.Tensor:
    """π-Attention: each query attends to a local window plus the keys ±period away, under one softmax.

    Args:
        q: [B, H, T, D] queries (layout "bhtd"; [B, T, H, D] with "bthd", and so for every shape below);
            k, v: [B, H_kv, T, D] keys and values, H_kv dividing H (grouped-query
            attention: query head h reads key/value head h // (H // H_kv); H_kv = H is plain multi-head).
            fp64, fp32, bf16 or fp16; low precision accumulates in fp32.
        gate: [B, H, T] the local prior α in (0, 1), for variants "adaptive" and "separate"; else None.
            None with those variants: α = `prior` for every query ("adaptive" is then "fixed"), so that
            `pi_attention(q, k, v)` runs on its defaults as SDPA does.
        window: local radius k >= 0. Causal queries see i-k … i, bidirectional ones i-k … i+k.
        period: skip distance π >= 1; the key i-π (and i+π when bidirectional). period <= window adds
            nothing beyond the window. Or one period per query head (multi-scale π): a sequence or 1-D
            integer tensor (on q's device) of H ints, head h skipping π_h; with grouped heads, query heads
            that share a key/value head may differ. A backend declaring `per_head_periods` ("fused",
            "triton") takes every head's period in one call. For the others the heads are grouped by
            period and the backend runs once per distinct period on that period's heads (`heads.py`),
            exact in every backend, the outputs put back in head order; cost: one backend call per
            distinct period, one copy of the output and of each gradient (concatenated), and one of q,
            gate, k, v when the periods do not come in increasing head order (reordered); a group whose
            query heads do not make up whole key/value groups reads one copy of its key/value head per
            query head, the only repeat. Entries all equal are the one-period call exactly.
        causal: whether queries see only the past.
        variant: "union" (Eq. beta), "separate" (Variant 1), "fixed" (Variant 2, constant α = prior)
            or "adaptive" (Variant 3, α = gate).
        prior: the constant α of variant "fixed".
        logit_clamp: scores q·k·scale are clamped to [-logit_clamp, logit_clamp]; None disables.
        eps: floor of the priors: log max(α, eps) and log max(1 - α, eps).
        scale: score scale; None means 1/sqrt(D).
        dropout_p: dropout on the attention weights (like SDPA, applied whenever > 0: pass 0 in eval).
            The keep mask is drawn in one layout for every backend (with per-head periods, once per period
            group, in increasing period), so equal seeds give equal results across backends.
        sinks: the first `sinks` keys of each document are seen by every query of it at or after them
            (causal) or by all its queries (bidirectional), with the local prior; a key already in the
            window or at ±period is not counted twice.
        document_ids: [B, T] integer ids, or None (one document). A new document starts wherever the id
            changes; every document gets exactly what it would alone (no key crosses a boundary).
        backend: one of `piattn.BACKENDS`. "auto" picks the first backend that can run the call (variant,
            device, dtype, head dim, gradients, dropout, sinks, documents, grouped heads; `backends.py`): on
            CUDA "triton", then "torch"; on a CPU "fused" (fp32, fp64; where its C kernels build), then
            "torch"; elsewhere "torch"; "reference" last. A backend that cannot run the call raises a
            ValueError saying why. A call with a NaN or ±inf in q, k or v reaches only the outputs (and
            gradients) that read it, on every backend: "flex", whose kernels would carry it further, hands
            such a call to "torch"; "triton"'s kernels keep it local themselves, forward and backward.
        check_gate: whether to check that the gate's values lie in (0, 1) (ValueError otherwise). Reading
            them is a device-to-host sync on a GPU (and would stop a CUDA graph's capture): a caller that
            vouches for its gate passes False. `PiAttention` does so for its own gate, ε + (1 − 2ε)·σ(·) in
            fp32, which lies in (0, 1) by construction (not for a gate MLP with hooks, nor a subclass's
            gate). The gate's shape, device and dtype are checked either way; under torch.compile and on
            meta or fake tensors the values are never read.

        layout: the order of the dimensions of q, k, v, the gate and the result. "bhtd" (the default,
            SDPA's): q [B, H, T, D], gate [B, H, T]. "bthd" (FlashAttention's, and that of model code which
            splits [B, T, H·D] into heads): q [B, T, H, D], k, v [B, T, H_kv, D], gate [B, T, H], and the
            result [B, T, H, D]. "bthd" runs the "bhtd" call on transposed views and returns the result as
            a transposed view: no copy here (a backend whose kernels read contiguous rows copies its inputs,
            as it does for any strided input). document_ids stays [B, T]. Shape errors name the layout.

    Returns:
        [B, H, T, D] in the dtype of q ([B, T, H, D] with layout "bthd").
    """
    check_layout(layout)
    check_qkv_tensors(q, k, v, layout_name(layout))
    check_layout_shapes(q, k, v, gate, layout)
    if layout == "bthd":
        gate = gate.transpose(1, 2) if isinstance(gate, _torch.Tensor) else gate
        y = pi_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate, window=window,
                         period=period, causal=causal, variant=variant, prior=prior, logit_clamp=logit_clamp,
                         eps=eps, scale=scale, dropout_p=dropout_p, sinks=sinks, document_ids=document_ids,
                         backend=backend, check_gate=check_gate)
        return y.transpose(1, 2)
    variant, gate = gate_or_prior(q, gate, variant, prior)
    # The period's one normalisation: one int per query head, whatever form it was given in.
    periods = head_periods(period, q.shape[1], device=q.device)
    check_arguments(
        q, k, v, gate, window=window, period=periods[0], causal=causal, variant=variant, prior=prior,
        logit_clamp=logit_clamp, eps=eps, scale=scale, dropout_p=dropout_p, sinks=sinks, document_ids=document_ids,
        check_gate=check_gate,
    )
    # The one settings object of the call, handed down to the backend (`backends.BackendRun`): heads that all
    # share a period run as the one-period call exactly.
    one = len(set(periods)) == 1
    settings = OpSettings(window=window, period=periods[0] if one else periods, causal=causal, variant=variant,
                          prior=prior, logit_clamp=logit_clamp, eps=eps,
                          scale=q.shape[-1] ** -0.5 if scale is None else scale, dropout_p=dropout_p, sinks=sinks)
    if one or REGISTRY[_chosen(q, k, v, gate, settings, document_ids, backend)].per_head_periods:
        # One call, with every head's period where the backend declares it takes them.
        return _pi_attention(q, k, v, gate, settings, document_ids, backend)

    def run(p: int, q_g: _torch.Tensor, gate_g: _torch.Tensor | None, k_g: _torch.Tensor,
            v_g: _torch.Tensor) -> _torch.Tensor:
        return _pi_attention(q_g, k_g, v_g, gate_g, settings._replace(period=p), document_ids, backend)

    return by_period(periods, k.shape[1], run, [(q, 1), (gate, 1)], [(k, 1), (v, 1)])


def pi_attention_with_settings(
    q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    gate: _torch.Tensor | None,
    settings: PiSettings,
    *,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
    document_ids: _torch.Tensor | None = None,
    backend: str = "auto",
    check_gate: bool = True,
    layout: str = "bhtd",
) -> _torch.Tensor:
    """`pi_attention` with the operator settings (window, period, variant, prior, logit_clamp, eps, sinks) as one
    `piattn.config.PiSettings`, handed over whole, and the call's own arguments by keyword, as there.

    What the layers (`piattn.layers.sharding.pi_operator`), the Hugging Face attention and sequence parallelism
    call, so that none of them spells the settings out or carries them in a dict; the keyword form is for users.
    The settings become the operator's arguments here, field by field, and the call is checked and run as
    `pi_attention` checks and runs every call (the same messages). ValueError for settings that are not a
    `PiSettings`.
    """
    if not isinstance(settings, PiSettings):
        raise ValueError(f"settings must be a piattn.config.PiSettings, got {type(settings).__name__}")
    return pi_attention(q, k, v, gate, window=settings.window, period=settings.period, causal=causal,
                        variant=settings.variant, prior=settings.prior, logit_clamp=settings.logit_clamp,
                        eps=settings.eps, scale=scale, dropout_p=dropout_p, sinks=settings.sinks,
                        document_ids=document_ids, backend=backend, check_gate=check_gate, layout=layout)


def _chosen(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, gate: _torch.Tensor | None, settings: OpSettings,
            document_ids: _torch.Tensor | None, backend: str) -> str:
    """The name of the backend that runs a checked call."""
    H, D = q.shape[1], q.shape[-1]
    inputs = (q, k, v) if gate is None else (q, k, v, gate)
    needs_grad = _torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    features = {name for name, used in (("sinks", settings.sinks > 0), ("documents", document_ids is not None),
                                        ("gqa", k.shape[1] != H)) if used}
    call = (q.device, q.dtype, D, needs_grad, settings.dropout_p, frozenset(features), settings.variant)
    chosen = _backend_name(backend, *call, _torch.compiler.is_compiling())
    if not REGISTRY[chosen].contains_nonfinite and not is_symbolic(q) and not all_finite(*inputs):
        # flex's tiles multiply a masked key's value by a weight of 0 (0·NaN = NaN), which would carry a bad
        # value to rows that never read it; "torch" runs every call flex can (asked like any backend, so
        # that one it did not would be refused with its reason), and keeps it in the rows that read it.
        # The price is this check: one reduction per input and a host sync.
        chosen = _backend_name("torch", *call, False)
    return chosen


def _pi_attention(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, gate: _torch.Tensor | None,
                  settings: OpSettings, document_ids: _torch.Tensor | None, backend: str) -> _torch.Tensor:
    """`pi_attention` on checked settings of one period (or, for a backend with `per_head_periods`, one per
    query head): the backend's choice, the pattern made usable for T, the dropout mask, the call."""
    B, H, T, D = q.shape
    chosen = _chosen(q, k, v, gate, settings, document_ids, backend)
    run = _backend_function(chosen, q)
    s = settings
    if not isinstance(s.period, int):  # each head's pattern made usable as one period's is
        used = [usable_pattern(Pattern(s.window, p, s.causal, s.sinks), T) for p in s.period]
        keep = None if s.dropout_p == 0 else _head_masks(s, k.shape[1], q)
        return run(q, k, v, gate, s._replace(window=used[0].window, period=tuple(u.period for u in used),
                                             sinks=used[0].sinks), keep, document_ids)
    asked = s.pattern
    used = usable_pattern(asked, T)
    keep = None
    if s.dropout_p > 0:
        # One mask layout for every backend, so that equal seeds give equal results across backends; drawn
        # for the pattern asked for, so that clamping it changes no result.
        keep = _torch.rand(B, H, T, asked.n_slots, device=q.device) >= s.dropout_p
        if used != asked:
            keep = _slots_of(keep, asked, used)
    return run(q, k, v, gate, s._replace(window=used.window, period=used.period, sinks=used.sinks), keep, document_ids)


# What runs inside torch.compile, and where q has no values (meta and fake tensors): each backend's declared
# `operator` ("torch", "fused" and "triton" as custom operators: `compiled.py`, the ends of `fused.py` and
# `triton.py`; "reference" traced as is), of those this install can run ("triton" only where it can, so that no
# other install pays for importing triton). Loaded here, since dynamo cannot trace the import in
# `Backend.load`. "fused"'s probe (its C library) is asked while tracing, its answer a constant of the graph
# (`backends._probe`). "flex" declares none (its block mask has data-dependent shapes): under torch.compile
# "auto" picks from these only.
_SYMBOLIC: dict[str, BackendRun] = {name: b.load_operator() for name, b in REGISTRY.items()
                                    if b.operator is not None and b.available()}
COMPILABLE = tuple(_SYMBOLIC)
_COMPILE_ORDER = {device: tuple(n for n in order if n in COMPILABLE) for device, order in AUTO_ORDER.items()}


def _backend_name(requested: str, device: _torch.device, dtype: _torch.dtype, head_dim: int, needs_grad: bool,
                  dropout_p: float, features: frozenset[str], variant: str, compiling: bool) -> str:
    """The name of the backend `select` picks; from `COMPILABLE` only when `compiling`.

    Dynamo traces this. A ValueError raised here under torch.compile reaches the caller inside dynamo's
    error with fullgraph=True (message included); without fullgraph, dynamo runs the call eagerly.
    """
    if compiling and requested in REGISTRY and requested not in COMPILABLE and REGISTRY[requested].available():
        raise ValueError(f"backend {requested!r} cannot run inside torch.compile; backends that can: "
                         f"{', '.join(map(repr, ('auto', *COMPILABLE)))}")
    registry = {name: REGISTRY[name] for name in COMPILABLE} if compiling else REGISTRY
    return select(requested, device=device, dtype=dtype, head_dim=head_dim, needs_grad=needs_grad,
                  dropout_p=dropout_p, features=features, variant=variant, registry=registry,
                  auto_order=_COMPILE_ORDER if compiling else AUTO_ORDER).name


def _backend_function(name: str, q: _torch.Tensor) -> BackendRun:
    """The function of backend `name`. Where q holds no values (torch.compile, meta and fake tensors),
    "torch" and "triton" are their custom operators (`piattn::pi_attention_fwd`, `piattn::pi_triton_fwd`);
    in eager, the autograd.Functions they wrap (the same computation: the operator's dispatch would add about
    0.7 ms to each forward and backward of "torch")."""
    if name in _SYMBOLIC and is_symbolic(q):
        return _SYMBOLIC[name]
    return REGISTRY[name].load()


def usable_pattern(pattern: Pattern, T: int) -> Pattern:
    """The pattern with the same keys inside [0, T) for every query, no wider than T can use.

    A window beyond T - 1 reads nothing more (and costs memory ~window² in blocked backends), so it is
    clamped to T - 1; a period >= T never reaches a key, so it becomes no skip at all: a period within the
    window (1), or where the window is 0, the period T (a skip slot that no query can use). Sinks beyond
    T are clamped to T.

    Under torch.compile T may be symbolic: each comparison becomes a guard, and a field takes T's value
    (int(T) specialises the graph to that length) only where it is clamped, so that the common pattern,
    narrower than T, stays plain ints and one graph serves every longer T.
    """
    window = pattern.window if pattern.window < T else int(T) - 1
    period = pattern.period
    if period >= T:
        period = 1 if window >= 1 else int(T)
    sinks = pattern.sinks if pattern.sinks <= T else int(T)
    return Pattern(window, period, pattern.causal, sinks)


def _head_masks(settings: OpSettings, n_kv_heads: int, q: _torch.Tensor) -> _torch.Tensor:
    """The dropout keep masks of per-head periods (settings.period a tuple), drawn as `by_period` draws them
    (one per period group, in increasing period, laid out for the group's usable pattern), so that a seed
    gives every backend the same masks; in one tensor [B, H, T, S]: head h's mask in the first slots of its
    row (S the most any head has, the rest kept)."""
    B, H, T, _ = q.shape
    groups = [(p, heads, usable_pattern(settings._replace(period=p).pattern, T)) for p, heads, _ in
              period_groups(settings.period, n_kv_heads)]
    keep = _torch.ones(B, H, T, max(used.n_slots for _, _, used in groups), dtype=_torch.bool, device=q.device)
    for p, heads, used in groups:
        asked = settings._replace(period=p).pattern
        mask = _torch.rand(B, len(heads), T, asked.n_slots, device=q.device) >= settings.dropout_p
        if used != asked:
            mask = _slots_of(mask, asked, used)
        keep[:, heads, :, :used.n_slots] = mask
    return keep


def _slots_of(keep: _torch.Tensor, asked: Pattern, used: Pattern) -> _torch.Tensor:
    """A dropout mask [B, H, T, |U|] laid out for `asked` -> laid out for `used`, slot by offset (sink slots
    by their index); a slot `asked` lacks (its key lies outside [0, T) for every query) is kept."""
    slot = {o: m for m, o in enumerate(asked.offsets)}
    n_rel = len(asked.offsets)
    keep = _torch.cat([keep, keep.new_ones(keep.shape[:-1] + (1,))], -1)
    index = [slot.get(o, asked.n_slots) for o in used.offsets] + [n_rel + s for s in range(used.sinks)]
    index = _torch.tensor(index, device=keep.device)
    return keep.index_select(-1, index)
