"""Generation: greedy equals recomputing the whole prefix; sampling filters and seeds behave."""

import pytest
import torch

from piattn.decoding import sample_next
from utils import tiny_model


@pytest.mark.parametrize("attention", ["pi", "local", "dense"])
def test_greedy_generate_equals_full_recompute(attention):
    model = tiny_model(attention)
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, 30, temperature=0)
    idx = prompt
    for _ in range(30):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, idx)


def test_sampling_is_reproducible_per_seed():
    model = tiny_model("pi")
    prompt = torch.zeros(1, 3, dtype=torch.long)
    a = model.generate(prompt, 20, temperature=1.0, seed=7)
    b = model.generate(prompt, 20, temperature=1.0, seed=7)
    c = model.generate(prompt, 20, temperature=1.0, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, top_k=2, generator=g).tolist()) == {0, 1}
    # p(0) = 0.70, p(1) = 0.26: top_p 0.5 keeps only token 0, 0.9 keeps 0 and 1
    assert set(sample_next(logits, top_p=0.5, generator=g).tolist()) == {0}
    assert set(sample_next(logits, top_p=0.9, generator=g).tolist()) == {0, 1}
    assert set(sample_next(logits, generator=g).tolist()) == {0, 1, 2, 3, 4}
    assert sample_next(logits[:1], temperature=0).item() == 0


@pytest.mark.parametrize("kwargs, name", [({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"),
                                          ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_sampling_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sample_next(torch.zeros(1, 3), **kwargs)
