"""`piattn eval --position-bins` and `--compare`: loss by position and paired differences of two checkpoints.

The per-bin losses are checked against an oracle that runs the bare model over the test files window by
window (as tests/train/test_cli.py does for the total loss); the paired comparison against the two
checkpoints' own per-bin losses and against itself (zero difference, zero-width interval).
"""

from __future__ import annotations

import json

import pytest
import torch
from distributed_runs import torchrun
from torch.nn import functional as F

from piattn.cli import main
from piattn.models import GPT, GPTConfig
from piattn.train.checkpoint import load_weights, read_config, read_latest
from utils import write_word_corpus

SEQ = 32
TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--batch-size", "2", "--steps", "2", "--warmup", "1",
        "--eval-every", "0", "--save-every", "0", "--log-every", "1", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder}: two byte-level LMs (local, pi), a char-level LM, a reach classifier; and the corpus."""
    root = tmp_path_factory.mktemp("positions")
    corpus = write_word_corpus(root / "corpus", {"train": [120, 160], "validation": [60], "test": [80, 120]})
    lm = ["--data", str(corpus), "--seq-len", str(SEQ), *TINY]
    argvs = {"local": [*lm, "--attention", "local", "--window", "3"],
             "pi": [*lm, "--attention", "pi", "--window", "2", "--period", "5"],
             "char": [*lm, "--attention", "local", "--tokenizer", "char"],
             "reach": ["--task", "reach", "--lag", "3", "--seq-len", "16", "--train-size", "8", "--eval-size", "4",
                       *TINY]}
    out = {}
    for name, argv in argvs.items():
        out[name] = root / name
        assert main(["train", "--out", str(out[name]), *argv]) == 0
    out["corpus"] = corpus
    return out


def evaluate(capsys, tmp_path, *argv) -> dict:
    assert main(["eval", "--split", "test", "--device", "cpu", "--output", str(tmp_path / "e.json"),
                 "--overwrite", "--use-stored-data", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def oracle_position_losses(run, corpus) -> torch.Tensor:
    """[windows, SEQ] next-byte loss at every position of every test window, each file cut on its own."""
    folder = read_latest(run / "checkpoints")
    model = GPT(GPTConfig(**read_config(folder)["model"])).eval()
    load_weights(model, folder)
    rows = []
    for path in sorted((corpus / "test").glob("*.txt")):
        data = list(path.read_text(encoding="utf-8").encode("utf-8"))
        for start in range(0, len(data) - SEQ, SEQ):
            window = torch.tensor(data[start:start + SEQ + 1]).unsqueeze(0)
            with torch.no_grad():
                rows.append(F.cross_entropy(model(window[:, :-1])[0], window[0, 1:], reduction="none"))
    return torch.stack(rows).double()


def test_bins_match_the_oracle_and_add_up_to_the_total_loss(runs, capsys, tmp_path):
    result = evaluate(capsys, tmp_path, "--checkpoint", str(runs["pi"]), "--position-bins", "5")
    bins = result["position_bins"]
    # 32 positions in 5 near-equal bins, contiguous and covering every position once.
    assert [(b["start"], b["end"]) for b in bins] == [(0, 6), (6, 12), (12, 19), (19, 25), (25, 32)]
    assert sum(b["tokens"] for b in bins) == result["tokens"]
    total = sum(b["loss"] * b["tokens"] for b in bins) / result["tokens"]
    assert total == pytest.approx(result["loss"], rel=1e-9)

    losses = oracle_position_losses(runs["pi"], runs["corpus"])
    assert result["tokens"] == losses.numel()
    for b in bins:
        assert b["loss"] == pytest.approx(losses[:, b["start"]:b["end"]].mean().item(), rel=1e-5)
    # the bins actually differ: the first positions see less context
    assert len({round(b["loss"], 6) for b in bins}) == len(bins)


def test_a_checkpoint_compared_with_itself_differs_by_exactly_zero(runs, capsys, tmp_path):
    result = evaluate(capsys, tmp_path, "--checkpoint", str(runs["local"]), "--compare", str(runs["local"]),
                      "--position-bins", "4")
    compare = result["compare"]
    assert compare["loss"] == result["loss"] and compare["windows"] == result["tokens"] // SEQ
    for row in [compare["total"], *compare["position_bins"]]:
        assert row == {**row, "difference": 0.0, "low": 0.0, "high": 0.0}


def test_compare_gives_the_paired_difference_of_two_checkpoints(runs, capsys, tmp_path):
    a = evaluate(capsys, tmp_path, "--checkpoint", str(runs["pi"]), "--position-bins", "4")
    b = evaluate(capsys, tmp_path, "--checkpoint", str(runs["local"]), "--position-bins", "4")
    both = evaluate(capsys, tmp_path, "--checkpoint", str(runs["pi"]), "--compare", str(runs["local"]),
                    "--position-bins", "4")
    compare = both["compare"]
    assert both["loss"] == pytest.approx(a["loss"], rel=1e-12)
    assert compare["loss"] == pytest.approx(b["loss"], rel=1e-12)
    for row, bin_a, bin_b in zip(compare["position_bins"], a["position_bins"], b["position_bins"], strict=True):
        assert row["difference"] == pytest.approx(bin_a["loss"] - bin_b["loss"], abs=1e-9)
        assert row["low"] < row["difference"] < row["high"]
    assert compare["total"]["difference"] == pytest.approx(a["loss"] - b["loss"], abs=1e-9)
    # without --position-bins, --compare reports one bin: the whole window
    whole = evaluate(capsys, tmp_path, "--checkpoint", str(runs["pi"]), "--compare", str(runs["local"]))
    assert [(r["start"], r["end"]) for r in whole["compare"]["position_bins"]] == [(0, SEQ)]
    assert whole["compare"]["position_bins"][0]["difference"] == pytest.approx(compare["total"]["difference"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--checkpoint", "{pi}", "--position-bins", "0"], "--position-bins must be >= 1, got 0"),
    (["--checkpoint", "{pi}", "--position-bins", "33"], "--position-bins must be an integer in [1, seq_len=32]"),
    (["--checkpoint", "{pi}", "--compare", "{reach}"], "--compare: "),
    (["--checkpoint", "{reach}", "--position-bins", "2"], "--checkpoint: "),
    (["--checkpoint", "{pi}", "--compare", "{char}"], "has another tokenizer than --checkpoint"),
])
def test_bad_input_gives_one_line(runs, capsys, tmp_path, argv, message):
    argv = [a.format(**runs) for a in argv]
    assert main(["eval", "--split", "test", "--device", "cpu", "--output", str(tmp_path / "e.json"),
                 "--use-stored-data", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("piattn eval: error: ") and message in err[0]
    if "reach" in argv[-1] or "reach" in argv[1]:
        assert "holds a 'reach' model" in err[0]
    assert not (tmp_path / "e.json").exists()


@pytest.mark.slow
def test_two_processes_give_the_one_process_bins_and_differences(runs, capsys, tmp_path):
    """Under torchrun rank r scores windows r, r + 2, …; the assembled per-window matrix, and with it every
    bin and paired difference, equals the one-process result on the same windows (0 … 9)."""
    argv = ["--checkpoint", str(runs["pi"]), "--compare", str(runs["local"]), "--position-bins", "3",
            "--batch-size", "1"]
    one = evaluate(capsys, tmp_path, *argv, "--batches", "10")
    done = torchrun(2, ["eval", "--split", "test", "--device", "cpu", "--use-stored-data",
                        "--output", str(tmp_path / "two.json"), *argv, "--batches", "5"])
    assert done.returncode == 0, done.stderr
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["tokens"] == one["tokens"] == 10 * SEQ and two["compare"]["windows"] == 10
    for got, want in zip(two["position_bins"], one["position_bins"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for got, want in zip([two["compare"]["total"], *two["compare"]["position_bins"]],
                         [one["compare"]["total"], *one["compare"]["position_bins"]], strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-9)
