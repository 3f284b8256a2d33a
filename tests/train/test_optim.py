"""The optimiser: the warmup-cosine schedule, which parameters decay, global gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from piattn.models import GPT, GPTConfig
from piattn.train.optim import build_optimizer, clip_gradients, lr_at, param_groups, warmup_cosine

PEAK, MINIMUM, WARMUP, TOTAL = 3e-4, 3e-5, 10, 110


def tiny_gpt(**overrides) -> GPT:
    return GPT(GPTConfig.from_name("tiny", n_layer=2, d_model=32, n_head=2, vocab_size=64, block_size=64,
                                   **overrides))


def test_schedule_at_warmup_peak_and_end():
    kw = dict(peak=PEAK, minimum=MINIMUM, warmup=WARMUP, total=TOTAL)
    assert lr_at(0, **kw) == pytest.approx(PEAK / WARMUP)
    assert lr_at(4, **kw) == pytest.approx(PEAK * 5 / WARMUP)
    assert lr_at(WARMUP - 1, **kw) == pytest.approx(PEAK)
    assert lr_at(WARMUP, **kw) == pytest.approx(PEAK)  # the cosine starts at the peak
    assert lr_at((WARMUP + TOTAL) // 2, **kw) == pytest.approx((PEAK + MINIMUM) / 2)  # half way down
    assert lr_at(TOTAL, **kw) == pytest.approx(MINIMUM)
    assert lr_at(TOTAL + 50, **kw) == pytest.approx(MINIMUM)


def test_scheduler_sets_the_optimizer_lr_every_step():
    model = tiny_gpt()
    optimizer = build_optimizer(model, PEAK, 0.1)
    scheduler = warmup_cosine(optimizer, peak=PEAK, minimum=MINIMUM, warmup=WARMUP, total=TOTAL)
    seen = []
    for _ in range(TOTAL + 1):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    for step, lrs in enumerate(seen):
        # independent closed form: linear ramp, then a half cosine from PEAK to MINIMUM
        want = PEAK * (step + 1) / WARMUP if step < WARMUP else \
            MINIMUM + (PEAK - MINIMUM) * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP))) / 2
        assert lrs == pytest.approx([want, want], rel=1e-9)


def test_decay_only_on_linear_weights_not_norms_biases_or_tied_embedding():
    model = tiny_gpt()
    decay, no_decay = (g["params"] for g in param_groups(model, 0.1))
    decay_ids, no_decay_ids = {id(p) for p in decay}, {id(p) for p in no_decay}
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        expect_decay = isinstance(module, nn.Linear) and name.endswith("weight") and name != "embed.weight"
        assert (id(p) in decay_ids) == expect_decay, name
        assert (id(p) in no_decay_ids) != expect_decay, name
    assert model.head.weight is model.embed.weight and id(model.embed.weight) in no_decay_ids
    assert len(decay) + len(no_decay) == len(list(model.parameters()))  # the tied weight once
    assert any(".gate.0.weight" in n for n, p in model.named_parameters() if id(p) in decay_ids)


def test_weight_decay_shrinks_only_decayed_parameters():
    """With zero gradients, AdamW's step is decay alone: p ← p·(1 − lr·wd) on decayed weights, none elsewhere."""
    model = tiny_gpt()
    lr, wd = 1e-2, 0.1
    optimizer = build_optimizer(model, lr, wd)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    for name, p in model.named_parameters():
        want = before[name] * (1 - lr * wd) if id(p) in decayed else before[name]
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-7)
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["eps"] == 1e-8


def test_clipping_scales_all_gradients_to_the_global_norm():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,), (2, 2, 2))]
    grads = [torch.randn_like(p) * 3 for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert norm > 1.0
    assert float(clip_gradients(params, 1.0)) == pytest.approx(norm, rel=1e-6)
    for p, g in zip(params, grads, strict=True):  # same direction, scaled by 1/norm
        torch.testing.assert_close(p.grad, g / norm, rtol=1e-5, atol=1e-7)
    clipped = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    assert clipped == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("max_norm", [0.0, 1e9])
def test_no_clipping_when_disabled_or_below_the_limit(max_norm):
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert float(clip_gradients([p], max_norm)) == pytest.approx(5.0)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0]))


def test_bad_schedule_arguments_name_the_flag():
    optimizer = build_optimizer(tiny_gpt(), PEAK, 0.1)
    with pytest.raises(ValueError, match="--min-lr"):
        warmup_cosine(optimizer, peak=PEAK, minimum=2 * PEAK, warmup=1, total=10)
    with pytest.raises(ValueError, match="--lr"):
        build_optimizer(tiny_gpt(), 0.0, 0.1)
