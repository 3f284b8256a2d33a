"""`piattn eval --compare B --by-copy-distance`: both models' loss by copy-distance class, paired.

The classes and per-class losses are checked against an oracle written here from the definitions alone: the
bare models run window by window over the test files, each target's copy lag found by a loop over earlier
positions, and each kind's reachable lags by summing one hop per layer. Each kind's reach is what the kind
declares (`AttentionLayer.lag_reach`): a kind registered here, with a reach of its own, is classed by it, and
is refused, naming the declaration, while it declares none.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_eval_positions import SEQ, TINY, evaluate  # the same tiny runs and eval call
from torch.nn import functional as F

from piattn.analysis.copy_distance import Reach
from piattn.cli import main
from piattn.commands import train as train_command
from piattn.layers import ATTENTION, AttentionLayer, attention_registry
from piattn.models import GPT, GPTConfig
from piattn.train.checkpoint import load_weights, read_config, read_latest
from utils import write_word_corpus

N = 4  # the copy context (COPY_N)


class DilatedAttention(AttentionLayer):
    """Causal attention on keys i, i − 2, …, i − 2·window only: a kind these tests register, which declares
    no reach."""

    def __init__(self, d_model: int, n_heads: int, *, window: int = 2, **shared):
        super().__init__(d_model, n_heads, **shared)
        self.window = window

    @classmethod
    def config_kwargs(cls, cfg, layer: int) -> dict:
        return dict(window=cfg.window)

    def attend(self, q, k, v, x):
        T = q.shape[2]
        lag = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        mask = (lag >= 0) & (lag % 2 == 0) & (lag <= 2 * self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), dropout_p=self.attention_dropout)


class DeclaredDilatedAttention(DilatedAttention):
    """The same kind, declaring its reach: the even lags up to 2·window·n_layer."""

    @classmethod
    def lag_reach(cls, model, max_lag: int) -> Reach:
        span = 2 * model["window"] * model["n_layer"]
        lags = torch.arange(max_lag + 1)
        return Reach((lags % 2 == 0) & (lags <= span), span)


@pytest.fixture
def dilated(monkeypatch):
    """"dilated" registered (declaring its reach) for one test only."""
    monkeypatch.setitem(ATTENTION, "dilated", DeclaredDilatedAttention)
    return "dilated"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder}: byte-level LMs (local k = 3, π k = 2 π = 5, dense, longformer, and dilated k = 3, a kind
    registered while it trains) and the corpus."""
    root = tmp_path_factory.mktemp("copy")
    corpus = write_word_corpus(root / "corpus", {"train": [120, 160], "validation": [60], "test": [150, 200]})
    lm = ["--data", str(corpus), "--seq-len", str(SEQ), *TINY]
    argvs = {"local": [*lm, "--attention", "local", "--window", "3"],
             "pi": [*lm, "--attention", "pi", "--window", "2", "--period", "5"],
             "dense": [*lm, "--attention", "dense"],
             "longformer": [*lm, "--attention", "longformer", "--window", "3"],
             "dilated": [*lm, "--attention", "dilated", "--window", "3"]}
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(ATTENTION, "dilated", DeclaredDilatedAttention)
        # `piattn train` took the kinds' names when it was imported; a kind registered now is known from here on
        patch.setitem(train_command.REGISTRIES, "attention", attention_registry())
        for name, argv in argvs.items():
            out[name] = root / name
            assert main(["train", "--out", str(out[name]), *argv]) == 0
    out["corpus"] = corpus
    return out


def oracle(run, corpus) -> tuple[torch.Tensor, list[list[int]]]:
    """([windows, SEQ] loss of every target, [windows][SEQ] copy lag of every target, None without a match)."""
    folder = read_latest(run / "checkpoints")
    model = GPT(GPTConfig(**read_config(folder)["model"])).eval()
    load_weights(model, folder)
    losses, lags = [], []
    for path in sorted((corpus / "test").glob("*.txt")):
        data = list(path.read_text(encoding="utf-8").encode("utf-8"))
        for start in range(0, len(data) - SEQ, SEQ):
            w = data[start:start + SEQ + 1]
            window = torch.tensor(w).unsqueeze(0)
            with torch.no_grad():
                losses.append(F.cross_entropy(model(window[:, :-1])[0], window[0, 1:], reduction="none"))
            row = []
            for t in range(1, SEQ + 1):  # target w[t], predicted by the query at t − 1
                match = [s for s in range(N, t) if t >= N and w[s - N:s] == w[t - N:t]]
                row.append(t - 1 - max(match) if match else None)
            lags.append(row)
    return torch.stack(losses).double(), lags


def reachable(window: int, period: int | None, layers: int) -> set[int]:
    """Lags a query reaches through `layers` layers of one hop each: 0 … window, or the period."""
    hops = set(range(window + 1)) | ({period} if period else set())
    lags = {0}
    for _ in range(layers):
        lags = {a + b for a in lags for b in hops}
    return lags


def expected_class(lag, kind: set[int], local: set[int], span: int) -> str:
    if lag is None:
        return "N"
    if lag in local:
        return "A"
    if lag in kind:
        return "B"
    return "C" if lag < span else "D"


def test_classes_and_losses_match_the_oracle(runs, capsys, tmp_path):
    result = evaluate(capsys, tmp_path, "--checkpoint", str(runs["pi"]), "--compare", str(runs["local"]),
                      "--by-copy-distance")
    c = result["copy_distance"]
    loss_pi, lags = oracle(runs["pi"], runs["corpus"])
    loss_local, _ = oracle(runs["local"], runs["corpus"])
    kind, local = reachable(2, 5, 2), reachable(3, None, 2)
    codes = [[expected_class(lag, kind, local, span=2 * 5) for lag in row] for row in lags]
    assert c["windows"] == len(lags) and c["classes_of"]["span"] == 10 and c["reference"]["span"] == 6
    seen = set()
    for name, row in c["classes"].items():
        mask = torch.tensor([[code == name for code in r] for r in codes])
        assert row["count"] == int(mask.sum()), name
        if row["count"]:
            seen.add(name)
            assert row["loss"] == pytest.approx(loss_pi[mask].mean().item(), rel=1e-5)
            assert row["reference_loss"] == pytest.approx(loss_local[mask].mean().item(), rel=1e-5)
            assert row["diff"] == pytest.approx(row["loss"] - row["reference_loss"], abs=1e-9)
            assert row["low"] <= row["diff"] <= row["high"]
    assert {"A", "N"} <= seen and len(seen) >= 3  # the corpus repeats words: several classes are populated
    assert c["classes"]["B"]["lags"] == "7, 10" and c["classes"]["A"]["lags"] == "0–6"
    assert result["compare"]["loss"] == pytest.approx(loss_local.mean().item(), rel=1e-5)


def test_classes_of_another_checkpoint_and_a_self_comparison(runs, capsys, tmp_path):
    result = evaluate(capsys, tmp_path, "--checkpoint", str(runs["dense"]), "--compare", str(runs["dense"]),
                      "--by-copy-distance", "--classes-of", str(runs["pi"]))
    c = result["copy_distance"]
    assert c["classes_of"]["attention"] == "pi" and c["reference"]["attention"] == "dense"
    # dense as the reference reaches every lag: every matched byte is class A
    assert all(c["classes"][name]["count"] == 0 for name in "BCD")
    a = c["classes"]["A"]
    assert a["diff"] == 0 and a["low"] == 0 and a["high"] == 0 and a["count"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--by-copy-distance"], "--by-copy-distance needs --compare"),
    (["--compare", "LOCAL", "--by-copy-distance", "--position-bins", "2"], "takes no --position-bins"),
    (["--classes-of", "PI"], "--classes-of names the classes of --by-copy-distance"),
    (["--compare", "LOCAL", "--by-copy-distance", "--classes-of", "LONGFORMER"],
     "--classes-of: .*attention must be one of \\['dense', 'local', 'neighbourhood', 'pi', 'strided'\\]"),
])
def test_refusals_are_one_line(runs, capsys, tmp_path, argv, message):
    names = {"LOCAL": "local", "PI": "pi", "LONGFORMER": "longformer"}
    argv = [str(runs[names[a]]) if a in names else a for a in argv]
    code = main(["eval", "--split", "test", "--device", "cpu", "--output", str(tmp_path / "e.json"), "--overwrite",
                 "--use-stored-data", "--checkpoint", str(runs["pi"]), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and re.search(message, err) and "\n" not in err, err


def test_a_new_kind_is_classed_by_the_reach_it_declares(runs, dilated, capsys, tmp_path):
    result = evaluate(capsys, tmp_path, "--checkpoint", str(runs[dilated]), "--compare", str(runs["local"]),
                      "--by-copy-distance")
    c = result["copy_distance"]
    loss_dilated, lags = oracle(runs[dilated], runs["corpus"])
    loss_local, _ = oracle(runs["local"], runs["corpus"])
    hops = {0, 2, 4, 6}  # window 3, dilation 2: two layers reach the even lags 0 … 12
    kind = {a + b for a in hops for b in hops}
    codes = [[expected_class(lag, kind, reachable(3, None, 2), span=12) for lag in row] for row in lags]
    assert c["classes_of"] == {"checkpoint": str(read_latest(runs[dilated] / "checkpoints")), "attention": dilated,
                               "n_layer": 2, "window": 3, "span": 12, "reachable_lags": 6}
    assert {name: row["lags"] for name, row in c["classes"].items()} == {
        "A": "0–6", "B": "8, 10, 12", "C": "7, 9, 11", "D": f"13–{SEQ - 1}", "N": "no match"}
    for name, row in c["classes"].items():
        mask = torch.tensor([[code == name for code in r] for r in codes])
        assert row["count"] == int(mask.sum()), name
        if row["count"]:
            assert row["loss"] == pytest.approx(loss_dilated[mask].mean().item(), rel=1e-5)
            assert row["reference_loss"] == pytest.approx(loss_local[mask].mean().item(), rel=1e-5)
    assert c["classes"]["A"]["count"] and c["classes"]["N"]["count"]


def test_a_kind_that_declares_no_reach_is_refused_naming_the_declaration(runs, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(ATTENTION, "dilated", DilatedAttention)  # the same weights, no `lag_reach`
    code = main(["eval", "--split", "test", "--device", "cpu", "--output", str(tmp_path / "e.json"), "--overwrite",
                 "--use-stored-data", "--checkpoint", str(runs["dilated"]), "--compare", str(runs["local"]),
                 "--by-copy-distance"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert re.search(r"--classes-of: .*attention must be one of \['dense', 'local', 'neighbourhood', 'pi', 'strided'\] "
                     r"\(kinds whose reach is "
                     r"a fixed set of lags, which they declare: `lag_reach`\), got 'dilated', which declares none$",
                     err), err


def test_the_table_names_classes_in_words_not_the_models_letters():
    from piattn.analysis.copy_distance import CLASSES
    from piattn.commands.eval_copy import CLASS_NAMES, summary_lines

    row = dict(lags="0–5", count=10, loss=1.0, reference_loss=1.5, diff=-0.5, low=-0.6, high=-0.4)
    entry = {"classes_of": {"checkpoint": "runs/pi"}, "reference": {"checkpoint": "runs/local"},
             "interval": "95%", "classes": dict.fromkeys(CLASSES, row)}
    lines = summary_lines(entry)
    assert set(CLASS_NAMES) == set(CLASSES)
    rows = lines[3:]
    assert [r.split("  ")[0].strip() for r in rows] == [CLASS_NAMES[c] for c in CLASSES]
    assert all(len(r.split()[0]) > 1 for r in rows)  # no row labelled by a lone letter, as the models are
    assert "A = runs/pi" in lines[1] and "B = runs/local" in lines[1]
