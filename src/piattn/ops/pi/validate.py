"""Argument checks for `pi_attention`: every bad input becomes a ValueError naming the argument.

The scalar settings (window, period, variant, prior, logit_clamp, eps) are checked by
`piattn.config.pi.check_pi_settings`, their one home; this module checks the tensors and the rest.
Whether a backend can run a call is not checked here: see `backends.py`.
"""

from __future__ import annotations

import torch

from ...checks import is_int
from ...config.pi import GATED_VARIANTS, PiSettings, check_pi_settings, period_tuple

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

# `pi_attention(layout=...)`: the order of the dimensions of q, k, v (and of the gate, which lacks D).
# "bhtd" is SDPA's and FlexAttention's; "bthd" FlashAttention's and that of most model code, where the heads
# come from splitting the last dimension of [B, T, H·D].
LAYOUTS = {"bhtd": "[B, H, T, D]", "bthd": "[B, T, H, D]"}
GATE_LAYOUTS = {"bhtd": "[B, H, T]", "bthd": "[B, T, H]"}
KV_LAYOUTS = {"bhtd": "[B, H_kv, T, D]", "bthd": "[B, T, H_kv, D]"}


def check_layout(layout) -> None:
    """`layout` is one of LAYOUTS; ValueError naming the allowed values otherwise."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        allowed = ", ".join(f"{name!r} (q, k, v {shape})" for name, shape in LAYOUTS.items())
        raise ValueError(f"layout must be one of {allowed}; got {layout!r}")


def layout_name(layout: str) -> str:
    """How a message names a layout's shape: "[B, T, H, D] (layout='bthd')"."""
    return f"{LAYOUTS[layout]} (layout={layout!r})"


def check_layout_shapes(q, k, v, gate, layout: str) -> None:
    """The shapes of q, k, v and (when a tensor) the gate in `layout`, each message naming the layout; q, k,
    v must already be 4-dim tensors (`check_qkv_tensors`)."""
    h, t = (1, 2) if layout == "bhtd" else (2, 1)
    where = f"(layout={layout!r})"
    if k.shape != v.shape:
        raise ValueError(f"k and v must share one shape {KV_LAYOUTS[layout]} {where}; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    B, H, T, D = q.shape[0], q.shape[h], q.shape[t], q.shape[3]
    if (k.shape[0], k.shape[t], k.shape[3]) != (B, T, D):
        raise ValueError(f"k and v must have shape {KV_LAYOUTS[layout]} {where} with the B, T, D of q "
                         f"{tuple(q.shape)}; got {tuple(k.shape)}")
    H_kv = k.shape[h]
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"k and v have {H_kv} heads (dim {h} in layout {layout!r}), which must divide the {H} "
                         f"query heads of q {tuple(q.shape)}")
    if isinstance(gate, torch.Tensor) and tuple(gate.shape) != tuple(q.shape[:3]):
        raise ValueError(f"gate must have shape {GATE_LAYOUTS[layout]} = {tuple(q.shape[:3])} for q of shape "
                         f"{layout_name(layout)} {tuple(q.shape)}, got {tuple(gate.shape)}")


def check_qkv_tensors(q, k, v, layout: str = "[B, H, T, D]") -> None:
    """q, k, v are 4-dim tensors of a supported dtype, one dtype and one device (shapes: the caller's)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape {layout} (4 dims), got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"{name} has dtype {t.dtype}; allowed: {allowed}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")


def check_arguments(
    q, k, v, gate, *, window, period, causal, variant, prior, logit_clamp, eps, scale, dropout_p, sinks=0,
    document_ids=None, check_gate=True,
) -> None:
    _check_tensors(q, k, v)
    check_pi_settings(window=window, period=period, variant=variant, prior=prior, logit_clamp=logit_clamp,
                      eps=eps, sinks=sinks)
    _check_call(q, gate, variant=variant, causal=causal, scale=scale, dropout_p=dropout_p, document_ids=document_ids,
                check_gate=check_gate)


def check_settings_call(q, k, v, gate, settings: PiSettings, *, causal, scale, dropout_p, document_ids=None,
                        check_gate=True) -> None:
    """`check_arguments` for a call whose operator settings are one `PiSettings`, handed over whole: its ranges
    were checked when it was made, so only the tensors and the call's own arguments are checked here, in the
    same order and with the same messages. Its period (one, or one per query head) is not counted against the
    heads: `head_periods` does that."""
    if not isinstance(settings, PiSettings):
        raise ValueError(f"settings must be a piattn.config.PiSettings, got {type(settings).__name__}")
    _check_tensors(q, k, v)
    _check_call(q, gate, variant=settings.variant, causal=causal, scale=scale, dropout_p=dropout_p,
                document_ids=document_ids, check_gate=check_gate)


def _check_tensors(q, k, v) -> None:
    check_qkv_tensors(q, k, v)
    check_kv_heads(q, k, v)
    if q.shape[2] < 1 or q.shape[3] < 1:
        raise ValueError(f"q must have T >= 1 and D >= 1, got shape {tuple(q.shape)}")


def _check_call(q, gate, *, variant, causal, scale, dropout_p, document_ids, check_gate) -> None:
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be > 0 or None (None means 1/sqrt(D)), got {scale!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p!r}")
    validate_gate(q, gate, variant, values=check_gate)
    check_document_ids(document_ids, q)


def head_periods(period, n_heads: int, *, device: torch.device | None = None, count: str = "H") -> tuple[int, ...]:
    """A period setting -> one period per query head, a tuple of n_heads ints: the one form every period takes
    on its way to the backends (`piattn.pi_attention` normalises its `period` here once, and the layers,
    inspection and sequence parallelism ask the same). An int is n_heads copies of itself (its range is
    `check_pi_settings`'s); a sequence or 1-D integer tensor gives its entries, n_heads of them. ValueError
    naming `period` otherwise (`count`: the caller's name of its head count).

    A tensor must be 1-D, integer and on `device` (q's, where given); reading its values is a host sync (and,
    under torch.compile, a graph break: pass a tuple there).
    """
    if isinstance(period, torch.Tensor):
        if period.dim() != 1 or period.is_floating_point() or period.is_complex() or period.dtype == torch.bool:
            raise ValueError(f"period must be an int >= 1 or one int >= 1 per query head (a sequence or 1-D "
                             f"integer tensor of length {count}={n_heads}); got a tensor of shape "
                             f"{tuple(period.shape)} and dtype {period.dtype}")
        if device is not None and period.device != device:
            raise ValueError(f"period must be on the device of q ({device}), got {period.device}")
        period = period.tolist()
    periods = period_tuple(period)
    if is_int(period):
        return periods * n_heads
    if len(periods) != n_heads:
        raise ValueError(f"period has {len(periods)} entries; per-head periods need one per query head, "
                         f"{count}={n_heads}")
    return periods


def check_kv_heads(q, k, v) -> None:
    """k and v share one shape [B, H_kv, T, D] matching q [B, H, T, D] but for the heads, H % H_kv == 0."""
    if k.shape != v.shape:
        raise ValueError(f"k and v must share one shape [B, H_kv, T, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, T, D = q.shape
    Bk, H_kv, Tk, Dk = k.shape
    if (Bk, Tk, Dk) != (B, T, D):
        raise ValueError(
            f"k and v must have shape [B, H_kv, T, D] with B, T, D of q {tuple(q.shape)}; got {tuple(k.shape)}"
        )
    if H_kv < 1 or H % H_kv:
        raise ValueError(
            f"k and v have {H_kv} heads, which must divide the {H} query heads (grouped-query attention: "
            f"query head h reads key/value head h // (H // H_kv))"
        )


def check_document_ids(document_ids, q: torch.Tensor) -> None:
    """None, or an integer tensor [B, T] on q's device: a new document starts wherever the id changes."""
    if document_ids is None:
        return
    B, T = q.shape[0], q.shape[2]
    if not isinstance(document_ids, torch.Tensor):
        raise ValueError(f"document_ids must be None or an integer torch.Tensor [B, T], got "
                         f"{type(document_ids).__name__}")
    if tuple(document_ids.shape) != (B, T):
        raise ValueError(f"document_ids must have shape [B, T] = {(B, T)}, got {tuple(document_ids.shape)}")
    if document_ids.is_floating_point() or document_ids.is_complex() or document_ids.dtype == torch.bool:
        raise ValueError(f"document_ids must have an integer dtype (e.g. torch.int64), got {document_ids.dtype}")
    if document_ids.device != q.device:
        raise ValueError(f"document_ids must be on the device of q ({q.device}), got {document_ids.device}")


def validate_gate(q: torch.Tensor, gate, variant: str, *, values: bool = True) -> None:
    """The gate's presence, type, shape, device and dtype; and, where `values`, that its values lie in (0, 1):
    a device-to-host sync on a GPU, which a caller vouching for its gate skips with values=False (a layer's
    own gate, clipped into [ε, 1 − ε] by construction: `pi_attention(check_gate=False)`)."""
    from torch._subclasses.fake_tensor import is_fake  # here: this module's imports stay torch's public API

    if variant not in GATED_VARIANTS:
        if gate is not None:
            raise ValueError(
                f"gate is only used by variants {GATED_VARIANTS}; variant {variant!r} takes gate=None"
            )
        return
    if gate is None:
        raise ValueError(f"variant {variant!r} needs gate, a tensor [B, H, T] with values in (0, 1)")
    if not isinstance(gate, torch.Tensor):
        raise ValueError(f"gate must be a torch.Tensor of shape [B, H, T], got {type(gate).__name__}")
    if tuple(gate.shape) != tuple(q.shape[:3]):
        raise ValueError(f"gate must have shape [B, H, T] = {tuple(q.shape[:3])}, got {tuple(gate.shape)}")
    if gate.device != q.device:
        raise ValueError(f"gate must be on the device of q ({q.device}), got {gate.device}")
    if not gate.is_floating_point():
        raise ValueError(f"gate must be a floating-point tensor, got {gate.dtype}")
    if not values or torch.compiler.is_compiling() or gate.device.type == "meta" or is_fake(gate):
        # No values to read: under torch.compile a data-dependent check would break the graph, and meta and
        # fake tensors (shape inference) hold none. Eager calls check them.
        return
    # A device-to-host sync; worth it, since a gate outside (0, 1) silently yields NaN or a wrong prior.
    with torch.no_grad():
        if not bool(((gate > 0) & (gate < 1)).all()):
            lo, hi = gate.min().item(), gate.max().item()
            raise ValueError(f"gate values must lie in the open interval (0, 1); got min {lo}, max {hi}")


def gate_or_prior(q: torch.Tensor, gate: torch.Tensor | None, variant: str,
                  prior: float) -> tuple[str, torch.Tensor | None]:
    """(variant, gate) to run for a call: a gated variant called without a gate takes the constant local
    prior α = `prior` for every query, as SDPA runs on its defaults. "adaptive" is then exactly "fixed"
    (no tensor is made); "separate" mixes its two branches by a gate filled with `prior`, which must then lie
    in (0, 1). Any other call is returned as it is."""
    if gate is not None or variant not in GATED_VARIANTS:
        return variant, gate
    if variant == "adaptive":
        return "fixed", None
    if not isinstance(prior, (int, float)) or not 0 < prior < 1:
        raise ValueError(f"variant {variant!r} without a gate mixes its branches by prior, which must then lie in "
                         f"(0, 1); got prior={prior!r} (or pass gate [B, H, T])")
    return variant, torch.full(q.shape[:3], float(prior), dtype=q.dtype, device=q.device)


def all_finite(*xs: torch.Tensor | None) -> bool:
    """Whether every element of the given tensors (None skipped) is finite; a host sync.

    From the sums (one fast reduction each): a NaN or ±inf element makes its sum NaN or ±inf. A sum that
    overflows from finite elements only answers False, which sends a call down a slower path that gives the
    same results.
    """
    return bool(torch.isfinite(torch.stack([x.sum() for x in xs if x is not None])).all())
