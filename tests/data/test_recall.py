import pytest
import torch

from piattn.data import recall

ARGS = dict(seq_len=32, n_symbols=6, lag_min=3, lag_max=20)


def test_marker_sits_one_before_the_value_lag_tokens_before_the_query():
    data = recall.generate(500, seed=1, **ARGS)
    tokens, answer, lag = data.tokens, data.answer, data.lag
    assert tokens.shape == (500, 32) and answer.shape == lag.shape == (500,) and len(data) == 500
    query = 31
    assert (tokens[:, query] == 7).all()  # the query id, n_symbols + 1
    rows = torch.arange(500)
    assert (tokens[rows, query - lag - 1] == 6).all()  # the marker id, n_symbols
    assert ((tokens == 6).sum(1) == 1).all()  # one marker, nowhere else
    assert torch.equal(answer, tokens[rows, query - lag])
    assert ((answer >= 0) & (answer < 6)).all()


def test_lags_cover_the_range_uniformly_and_answers_are_balanced():
    data = recall.generate(18_000, seed=0, **ARGS)
    counts = torch.bincount(data.lag, minlength=21)[3:]
    assert data.lag.min() == 3 and data.lag.max() == 20
    assert counts.min() > 800 and counts.max() < 1200  # 1000 expected per lag
    assert torch.bincount(data.answer, minlength=6).min() > 2700  # 3000 expected per symbol


def test_stratified_gives_every_lag_the_same_count():
    data = recall.generate(18 * 7 + 5, seed=0, stratified=True, **ARGS)
    counts = torch.bincount(data.lag, minlength=21)[3:]
    assert counts.min() == 7 and counts.max() == 8


def test_deterministic_by_seed():
    a, b, c = (recall.generate(50, seed=s, **ARGS) for s in (4, 4, 5))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lag, b.lag)
    assert not torch.equal(a.tokens, c.tokens)


def test_value_first_puts_the_marker_right_after_the_value():
    data = recall.generate(300, seed=3, value_first=True, **ARGS)
    rows = torch.arange(300)
    assert (data.tokens[rows, 31 - data.lag + 1] == 6).all() and ((data.tokens == 6).sum(1) == 1).all()
    assert torch.equal(data.answer, data.tokens[rows, 31 - data.lag])
    data = recall.generate(4, seed=0, seq_len=5, n_symbols=2, lag_min=2, lag_max=2, value_first=True)
    assert (data.tokens[:, 3] == 2).all() and torch.equal(data.answer, data.tokens[:, 2])


def test_extreme_lags_put_the_marker_first_and_the_value_last():
    data = recall.generate(4, seed=0, seq_len=5, n_symbols=2, lag_min=1, lag_max=1)
    assert (data.tokens[:, 2] == 2).all() and torch.equal(data.answer, data.tokens[:, 3])
    data = recall.generate(4, seed=0, seq_len=5, n_symbols=2, lag_min=3, lag_max=3)
    assert (data.tokens[:, 0] == 2).all() and torch.equal(data.answer, data.tokens[:, 1])


@pytest.mark.parametrize("change, message", [
    (dict(lag_max=31), "lag_max must be <= 30 for seq_len 32"),
    (dict(lag_min=1, value_first=True), "lag_min must be an integer >= 2"),
    (dict(lag_max=32, value_first=True), "lag_max must be <= 31 for seq_len 32"),
    (dict(lag_min=21), "lag_min must be <= lag_max = 20"),
    (dict(lag_min=0), "lag_min must be an integer >= 1"),
    (dict(n_symbols=1), "n_symbols must be an integer >= 2"),
    (dict(seq_len=2, lag_min=1, lag_max=1), "seq_len must be an integer >= 3"),
    (dict(lag_max=4.0), "lag_max must be an integer >= 1"),
])
def test_bad_arguments_are_named(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        recall.generate(3, seed=0, **{**ARGS, **change})


def test_bad_n_is_named():
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        recall.generate(-1, seed=0, **ARGS)
