"""Model step of the GPU run: training throughput of the `small` GPT, and decoding of a SmolLM2-shaped model.

Training (`run`): for each sequence length T and attention kind (dense SDPA, local, π, multi-scale π), in
this order so that a run cut short by its budget still has every kind at the shorter lengths, one AdamW
training step (forward, cross-entropy, backward, step) at batch B = max(2, TOKENS // T): median ms, tokens
per second and the peak memory (torch.cuda.max_memory_allocated after a reset; None on a CPU).

Decoding (`run_decode`): a SmolLM2-135M-shaped Llama (30 layers, d 576, 9 heads, 3 key/value heads, random
weights: speed and memory do not depend on them) through `piattn.integrations.hf`, with HF's dense
`DynamicCache`, and converted (`convert_to_pi`) to local attention with sinks and to π with sinks, each with
`PiCache`: after a prompt of T tokens, the median ms per decoded token, tokens per second, and the cache's
bytes (`cache_nbytes`). Needs transformers; a row says so where it is missing.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from piattn.benchmarking import sync
from piattn.models import GPT, GPTConfig

# kind -> (GPTConfig attention, its overrides): multi-scale π takes the geometric schedule (heads at 16, 32, …).
KINDS = {"dense": ("dense", {}), "local": ("local", {}), "pi": ("pi", {}),
         "pi-ms": ("pi", dict(period="geometric:16"))}
# kind -> convert_to_pi's settings (None: the dense model and DynamicCache). Local: period = window adds no key.
DECODE_KINDS = {"dense": None, "local+sinks": dict(window=64, period=64, sinks=4),
                "pi+sinks": dict(window=64, period=256, sinks=4)}
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0)
SMOLLM2_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)


class ModelPlan:
    """Sizes of the model step: the GPU run's or the CPU smoke's."""

    def __init__(self, smoke: bool):
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.size = "tiny" if smoke else "small"
        self.lengths = (128,) if smoke else (8192, 16384, 32768)
        self.tokens = 256 if smoke else 65536  # per training step: batch max(2, tokens // T)
        self.vocab = 512 if smoke else 50257
        self.repeats = 1 if smoke else 3
        self.decode_lengths = (32,) if smoke else (2048, 4096, 8192, 16384, 32768)
        self.decode_tokens = 2 if smoke else 16
        self.llama = SMOLLM2_SMOKE if smoke else SMOLLM2

    def batch(self, T: int) -> int:
        return max(2, self.tokens // T)


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
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(plan: ModelPlan, kind: str, T: int) -> GPT:
    """The plan's GPT with attention `kind` (a key of KINDS), dropout off (timing, not regularisation)."""
    attention, overrides = KINDS[kind]
    cfg = GPTConfig.from_name(plan.size, attention=attention, vocab_size=plan.vocab, block_size=T, dropout=0.0,
                              **overrides)
    torch.manual_seed(0)
    return GPT(cfg).to(plan.device, plan.dtype)


def time_train(plan: ModelPlan, model: GPT, idx: torch.Tensor) -> dict:
    """One AdamW training step on idx [B, T + 1] (next-token loss): {ms, peak_mib}."""
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


def measure(plan: ModelPlan, kind: str, T: int) -> dict:
    """One training row: kind, T, batch, ms, tokens/s and peak memory, or status saying why not."""
    B = plan.batch(T)
    row = dict(kind=kind, T=T, batch=B, size=plan.size, dtype=str(plan.dtype).removeprefix("torch."))
    model = None
    try:
        model = build(plan, kind, T)
        idx = torch.randint(plan.vocab, (B, T + 1), device=plan.device)
        train = time_train(plan, model, idx)
        row.update(train_ms=train["ms"], train_tokens_per_s=B * T / train["ms"] * 1e3,
                   train_peak_mib=train["peak_mib"], status="ok")
    except torch.OutOfMemoryError:
        row["status"] = "skipped: out of memory"
    except Exception as exc:  # one kind failing must not lose the others
        row["status"] = f"error: {type(exc).__name__}: {str(exc).strip()[:300]}"
    finally:
        del model
        _reset_peak(plan.device)
    return row


def _sweep(lengths, kinds, measure_one, describe, out_of_time, log, label: str) -> list[dict]:
    """measure_one(kind, T) for every (T, kind) until out_of_time() says stop (skipped ones get a row saying so),
    a log line each: `describe(row)` when it ran."""
    rows = []
    for T in lengths:
        for kind in kinds:
            r = dict(kind=kind, T=T, status="skipped: time budget") if out_of_time() else measure_one(kind, T)
            rows.append(r)
            log(f"  {label} {kind:<11} T={T:<6} {describe(r) if r['status'] == 'ok' else r['status']}")
    return rows


def run(plan: ModelPlan, out_of_time, log, kinds=tuple(KINDS)) -> list[dict]:
    """Every (T, kind) of the plan's training rows until out_of_time() says stop."""
    return _sweep(plan.lengths, kinds, lambda kind, T: measure(plan, kind, T),
                  lambda r: f"batch {r['batch']}, {r['train_ms']:.1f} ms, {r['train_tokens_per_s']:.0f} tokens/s",
                  out_of_time, log, "train")


# ------------------------------------------------------------------------------------------------- decoding

def build_llama(plan: ModelPlan, kind: str, T: int):
    """A SmolLM2-shaped LlamaForCausalLM with random weights, converted for `kind` (DECODE_KINDS), in eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from piattn.integrations.hf import convert_to_pi

    torch.manual_seed(0)
    cfg = LlamaConfig(**plan.llama, max_position_embeddings=T + plan.decode_tokens + 8, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    if DECODE_KINDS[kind] is not None:
        model = convert_to_pi(model, **DECODE_KINDS[kind])
    return model.to(plan.device, plan.dtype).eval()


@torch.no_grad()
def measure_decode(plan: ModelPlan, kind: str, T: int) -> dict:
    """Prefill T random tokens into the kind's cache, then decode_tokens single-token steps: median ms per
    token, tokens/s, the cache's MiB after them, the peak memory while decoding."""
    row = dict(kind=kind, T=T, batch=1, dtype=str(plan.dtype).removeprefix("torch."))
    model = None
    try:
        from transformers import DynamicCache

        from piattn.integrations.hf import PiCache, cache_nbytes

        model = build_llama(plan, kind, T)
        cache = DynamicCache() if DECODE_KINDS[kind] is None else PiCache(model.config)
        idx = torch.randint(plan.llama["vocab_size"], (1, T), device=plan.device)
        model(idx, past_key_values=cache, use_cache=True)
        token = idx[:, -1:]
        _reset_peak(plan.device)
        times = []
        for _ in range(plan.decode_tokens):
            sync(plan.device)
            t0 = time.perf_counter()
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            sync(plan.device)
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        row.update(decode_ms_per_token=ms, decode_tokens_per_s=1e3 / ms, cache_mib=cache_nbytes(cache) / 2**20,
                   decode_peak_mib=_peak_mib(plan.device), status="ok")
    except ImportError as exc:
        row["status"] = f"skipped: {exc}"
    except torch.OutOfMemoryError:
        row["status"] = "skipped: out of memory"
    except Exception as exc:
        row["status"] = f"error: {type(exc).__name__}: {str(exc).strip()[:300]}"
    finally:
        del model
        _reset_peak(plan.device)
    return row


def run_decode(plan: ModelPlan, out_of_time, log) -> list[dict]:
    """Every (T, kind) of the plan's decoding rows until out_of_time() says stop."""
    return _sweep(plan.decode_lengths, DECODE_KINDS, lambda kind, T: measure_decode(plan, kind, T),
                  lambda r: f"{r['decode_ms_per_token']:.2f} ms/token, cache {r['cache_mib']:.2f} MiB",
                  out_of_time, log, "decode")
