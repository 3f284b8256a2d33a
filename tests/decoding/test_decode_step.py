"""The single-query decoding path (`pi_decode`) equals the full operator's last rows, and layers use it."""

import pytest
import torch

from piattn.config.pi import VARIANTS
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import pi_attention
from piattn.ops.pi.decode import pi_decode
from piattn.ops.pi.decode_plan import DecodePlan

# (window, period): skip beyond the window, period == window, period inside the window, no window at all
PATTERNS = ((3, 8), (4, 4), (5, 2), (0, 1), (2, 3))
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _inputs(N: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = (3 * torch.randn(2, 3, N, 8, generator=g, dtype=dtype) for _ in range(2))  # scores beyond the clamp
    v = torch.randn(2, 3, N, 8, generator=g, dtype=dtype)
    gate = 0.01 + 0.98 * torch.rand(2, 3, N, generator=g, dtype=dtype)
    return q, k, v, gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window,period", PATTERNS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_rows_equal_the_full_operator(variant, window, period, dtype):
    reach = max(window, period)
    kw = dict(window=window, period=period, variant=variant, prior=0.3, logit_clamp=4.0, eps=1e-4)
    for t in (1, 2, 3, 4):
        # fewer rows than the reach (start of the text), exactly the reach, and a long text
        for N in sorted({t, t + 1, reach, reach + t, reach + t + 7} - set(range(t))):
            q, k, v, gate = _inputs(N, dtype, seed=100 * t + N)
            gated = variant in ("separate", "adaptive")
            full = pi_attention(q, k, v, gate if gated else None, causal=True, **kw)[:, :, -t:]
            fast = pi_decode(q[:, :, -t:], k, v, gate[:, :, -t:] if gated else None, **kw)
            assert fast.dtype == dtype
            torch.testing.assert_close(fast, full, **TOL[dtype], msg=f"t={t} N={N}")


def test_the_comparison_sees_the_clamp_the_priors_and_the_skip():
    """The inputs above exercise every term: dropping any of them changes the rows."""
    q, k, v, gate = _inputs(20, torch.float64, seed=0)
    kw = dict(window=3, period=8, prior=0.3, eps=1e-4)
    base = pi_decode(q[:, :, -2:], k, v, gate[:, :, -2:], variant="adaptive", logit_clamp=4.0, **kw)
    assert not torch.allclose(base, pi_decode(q[:, :, -2:], k, v, gate[:, :, -2:], variant="adaptive",
                                              logit_clamp=None, **kw))
    assert not torch.allclose(base, pi_decode(q[:, :, -2:], k, v, None, variant="union", logit_clamp=4.0, **kw))
    no_skip = dict(kw, period=3)
    assert not torch.allclose(base, pi_decode(q[:, :, -2:], k, v, gate[:, :, -2:], variant="adaptive",
                                              logit_clamp=4.0, **no_skip))


def test_low_precision_accumulates_in_fp32():
    q, k, v, gate = _inputs(20, torch.float32, seed=1)
    kw = dict(window=3, period=8, variant="adaptive", logit_clamp=4.0)
    low = pi_decode(q[:, :, -1:].bfloat16(), k.bfloat16(), v.bfloat16(), gate[:, :, -1:], **kw)
    ref = pi_decode(q[:, :, -1:].bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                    gate[:, :, -1:], **kw)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low, ref.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("change,match", [
    (dict(k=torch.zeros(2, 3, 1, 8), v=torch.zeros(2, 3, 1, 8)), r"^k must hold at least"),
    (dict(k=torch.zeros(2, 3, 9, 4), v=torch.zeros(2, 3, 9, 4)), r"^k must have shape"),
    (dict(v=torch.zeros(2, 3, 8, 8)), r"^k and v must share"),
    (dict(q=torch.zeros(2, 3, 8)), r"^q must have shape \[B, H, \*, D\] \(4 dims\)"),
    (dict(q=torch.zeros(2, 3, 2, 8, dtype=torch.float64)), r"^q, k and v must share one dtype"),
    (dict(gate=None), r"^variant 'adaptive' needs gate"),
    (dict(gate=torch.full((2, 3, 3), 0.5)), r"^gate must have shape"),
    (dict(window=-1), r"^window must be"),
    (dict(period=0), r"^period must be"),
    (dict(variant="both"), r"^variant must be"),
    (dict(scale=0.0), r"^scale must be"),
])
def test_bad_input_is_a_one_line_value_error_naming_the_argument(change, match):
    args = dict(q=torch.zeros(2, 3, 2, 8), k=torch.zeros(2, 3, 9, 8), v=torch.zeros(2, 3, 9, 8),
                gate=torch.full((2, 3, 2), 0.5), window=3, period=8, variant="adaptive")
    args.update(change)
    with pytest.raises(ValueError, match=match) as err:
        pi_decode(**args)
    assert "\n" not in str(err.value)


def _model(attention: str, variant: str = "adaptive", window: int = 3, period: int = 8) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny", attention=attention, variant=variant, vocab_size=50, n_layer=2, d_model=32,
                              n_head=2, window=window, period=period, dropout=0.0)
    model = GPT(cfg).eval()
    # gates away from 0.5 and varying per token, so that the gated variants differ from "union"
    for block in model.blocks:
        if getattr(block.attn, "gate", None) is not None:
            torch.nn.init.normal_(block.attn.gate[2].bias, std=2.0)
            torch.nn.init.normal_(block.attn.gate[2].weight, std=1.0)  # α follows the token
    return model


@pytest.mark.parametrize("window,period", [(3, 8), (4, 2)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_of_one_to_four_tokens_equal_the_full_forward(variant, window, period):
    model = _model("pi", variant, window, period)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(4))
    cache = model.init_cache(2)
    bounds = [0, 1, 3, 6, 10, 11, 13, 16, 20, 21, 22, 26, 40]  # steps of 1, 2, 3, 4 tokens, then a long chunk
    with torch.no_grad():
        pieces = [model(idx[:, a:b], cache) for a, b in zip(bounds, bounds[1:], strict=False)]
        torch.testing.assert_close(torch.cat(pieces, 1), model(idx), rtol=0, atol=1e-5)


def _spy(monkeypatch):
    """Records the rows of each call of a decoding plan that ran: `DecodePlan.rows` (a few tokens against the
    gathered cache, or one read straight from the ring) and `DecodePlan.token` (the layer's whole one-token step
    in one compiled call; counted when it ran, since where it does not apply `rows` runs after it)."""
    calls = []
    for name in ("rows", "token"):
        real = getattr(DecodePlan, name)

        def spy(self, *args, real=real, name=name, **kwargs):
            y = real(self, *args, **kwargs)
            if y is not None:
                calls.append(args[0].shape[1] if name == "token" else args[0].shape[2])
            return y

        monkeypatch.setattr(DecodePlan, name, spy)
    return calls


@pytest.mark.parametrize("attention", ["pi", "local"])
def test_attend_cached_takes_the_fast_path_for_one_token(monkeypatch, attention):
    model = _model(attention)
    idx = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = model.init_cache(1)
    with torch.no_grad():
        expected = model(idx)[:, -1]
        model(idx[:, :11], cache)  # a prompt of 11 > fast_decode_max_tokens: the blocked operator

        def refuse(*args, **kwargs):
            raise AssertionError("a one-token step ran the full operator")

        calls = _spy(monkeypatch)
        for block in model.blocks:
            monkeypatch.setattr(block.attn, "attend", refuse)
        step = model(idx[:, 11:], cache)[:, -1]
    assert calls == [1] * len(model.blocks)
    torch.testing.assert_close(step, expected, rtol=0, atol=1e-5)


def test_long_chunks_and_training_with_dropout_keep_the_full_operator(monkeypatch):
    model = _model("pi")
    calls = _spy(monkeypatch)
    idx = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(idx[:, :5], model.init_cache(1))  # 5 > fast_decode_max_tokens = 4
        assert calls == []
        model(idx[:, :4], model.init_cache(1))
        assert calls == [4] * len(model.blocks)
        calls.clear()
        for block in model.blocks:
            block.attn.dropout = 0.1
        model.train()
        model(idx[:, :1], model.init_cache(1))  # dropout is live: pi_decode has none
        assert calls == []
