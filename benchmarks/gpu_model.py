"""Model step of the GPU run: the `small` GPT with dense, local and π attention at long contexts.

For each attention kind and sequence length T (batch 1), in this order so that a run cut short by its budget
still has every kind at the shorter lengths:
- train: one training step (forward, cross-entropy, backward, AdamW step), median ms;
- prefill: forward over a T-token prompt into a fresh `model.init_cache(1)`, median ms;
- decode: median ms per token of feeding one token at a time after that prompt;
each with the peak memory of that phase (torch.cuda.max_memory_allocated after a reset; None on a CPU).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from piattn.models import GPT, GPTConfig

KINDS = ("dense", "local", "pi")


class ModelPlan:
    """Sizes of the model step: the GPU run's or the CPU smoke's."""

    def __init__(self, smoke: bool):
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.size = "tiny" if smoke else "small"
        self.lengths = (128,) if smoke else (4096, 8192, 16384)
        self.vocab = 512 if smoke else 50257
        self.decode_tokens = 4 if smoke else 32
        self.repeats = 1 if smoke else 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def _median_ms(fn, device: torch.device, repeats: int, warm: bool = False) -> float:
    """Median wall time of fn() in ms over `repeats` calls, after one warm-up call (which compiles) unless
    fn has run already (warm)."""
    if not warm:
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(plan: ModelPlan, kind: str, T: int) -> GPT:
    """The plan's GPT with attention `kind`, dropout off (timing, not regularisation), on the plan's device."""
    cfg = GPTConfig.from_name(plan.size, attention=kind, vocab_size=plan.vocab,
                              block_size=T + plan.decode_tokens, dropout=0.0)
    torch.manual_seed(0)
    return GPT(cfg).to(plan.device, plan.dtype)


def time_train(plan: ModelPlan, model: GPT, idx: torch.Tensor) -> dict:
    """One AdamW training step on idx [1, T] (next-token loss): {ms, peak_mib}."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model.train()
    step()  # AdamW's state exists from here on: the peak below includes it, as in training
    _reset_peak(plan.device)
    ms = _median_ms(step, plan.device, plan.repeats, warm=True)
    return dict(ms=ms, peak_mib=_peak_mib(plan.device))


@torch.no_grad()
def time_prefill_decode(plan: ModelPlan, model: GPT, idx: torch.Tensor) -> dict:
    """Prefill of idx [1, T] into a fresh cache, then decode_tokens single-token steps:
    {prefill_ms, prefill_peak_mib, decode_ms_per_token, decode_peak_mib, cache_mib}."""
    model.eval()
    _reset_peak(plan.device)

    def prefill():
        cache = model.init_cache(1)
        model(idx, cache)
        return cache

    prefill_ms = _median_ms(prefill, plan.device, plan.repeats)
    prefill_peak = _peak_mib(plan.device)
    cache = prefill()
    token = idx[:, -1:]
    _reset_peak(plan.device)
    times = []
    for _ in range(plan.decode_tokens):
        _sync(plan.device)
        t0 = time.perf_counter()
        token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
        _sync(plan.device)
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(prefill_ms=prefill_ms, prefill_peak_mib=prefill_peak,
                decode_ms_per_token=statistics.median(times), decode_peak_mib=_peak_mib(plan.device),
                cache_mib=cache.nbytes / 2**20)


def measure(plan: ModelPlan, kind: str, T: int) -> dict:
    """One row: kind, T, and the train / prefill / decode measures, or status saying why not."""
    row = dict(kind=kind, T=T, size=plan.size, dtype=str(plan.dtype).removeprefix("torch."), batch=1)
    model = None
    try:
        model = build(plan, kind, T)
        idx = torch.randint(plan.vocab, (1, T + 1), device=plan.device)
        train = time_train(plan, model, idx)
        row.update(train_ms=train["ms"], train_peak_mib=train["peak_mib"])
        row.update(time_prefill_decode(plan, model, idx[:, :T]))
        row["status"] = "ok"
    except torch.OutOfMemoryError:
        row["status"] = "skipped: out of memory"
    except Exception as exc:  # one kind failing must not lose the others
        row["status"] = f"error: {type(exc).__name__}: {str(exc).strip()[:300]}"
    finally:
        del model
        _reset_peak(plan.device)
    return row


def run(plan: ModelPlan, out_of_time, log) -> list[dict]:
    """Every (T, kind) of the plan until out_of_time() says stop; skipped ones get a row saying so."""
    rows = []
    for T in plan.lengths:
        for kind in KINDS:
            if out_of_time():
                rows.append(dict(kind=kind, T=T, status="skipped: time budget"))
            else:
                rows.append(measure(plan, kind, T))
            r = rows[-1]
            shown = (f"train {r['train_ms']:.1f} ms, prefill {r['prefill_ms']:.1f} ms, decode "
                     f"{r['decode_ms_per_token']:.2f} ms/token" if r["status"] == "ok" else r["status"])
            log(f"  model {kind:<6} T={T:<6} {shown}")
    return rows
