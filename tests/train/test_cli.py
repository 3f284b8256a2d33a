"""`piattn train` then `piattn eval` end to end on a corpus the test writes; the errors bad flags give."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from piattn.cli import main
from piattn.data.tokenizers import BPETokenizer, ByteTokenizer, CharTokenizer
from piattn.models import GPT, GPTConfig
from piattn.tasks.lm import token_byte_lengths
from piattn.train.checkpoint import load_weights, read_config, read_latest
from piattn.train.metrics import read_metrics
from utils import train_summary, write_word_corpus

SEQ = 64


def write_corpus(root):
    return write_word_corpus(root, {"train": [150, 250, 350], "validation": [150], "test": [150, 250]})


def train_argv(corpus, out, *extra):
    return ["train", "--data", str(corpus), "--out", str(out), "--attention", "local", "--n-layer", "2",
            "--d-model", "32", "--n-head", "2", "--seq-len", str(SEQ), "--batch-size", "2", "--steps", "4",
            "--warmup", "1", "--eval-every", "2", "--eval-batches", "2", "--save-every", "2", "--log-every", "1",
            "--device", "cpu", "--no-progress", *extra]


def oracle_test_loss(checkpoint, corpus) -> tuple[float, int]:
    """Mean next-byte loss over the test files, sequences of SEQ + 1 bytes cut from each file on its own."""
    model = GPT(GPTConfig(**read_config(checkpoint)["model"])).eval()
    load_weights(model, checkpoint)
    nats, count = 0.0, 0
    for path in sorted((corpus / "test").glob("*.txt")):
        data = list(path.read_text(encoding="utf-8").encode("utf-8"))
        for start in range(0, len(data) - SEQ, SEQ):  # consecutive windows share one token
            window = torch.tensor(data[start:start + SEQ + 1]).unsqueeze(0)
            with torch.no_grad():
                logits = model(window[:, :-1])
            nats += float(F.cross_entropy(logits[0], window[0, 1:], reduction="sum"))
            count += SEQ
    return nats / count, count


def test_train_then_eval(tmp_path, capsys):
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    assert main(train_argv(corpus, run)) == 0
    summary = train_summary(run, capsys)
    assert summary["step"] == 4 and summary["checkpoint"].endswith("step_00000004")

    records = read_metrics(run)  # every line parses as JSON
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["split"] == "validation"] == [2, 4]
    first = records[0]
    assert first["tokens"] == 2 * SEQ and first["tokens_per_second"] > 0 and first["peak_memory_bytes"] > 0
    assert first["wall_seconds"] > 0 and math.isfinite(first["loss"])
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*"))] == ["step_00000002", "step_00000004"]

    assert main(["eval", "--checkpoint", str(run), "--use-stored-data", "--split", "test", "--device", "cpu",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    loss, count = oracle_test_loss(read_latest(run / "checkpoints"), corpus)
    assert result["tokens"] == count and result["bytes"] == count
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["bpb"] == pytest.approx(result["loss"] / math.log(2), rel=1e-12)  # byte tokens: bpb = loss/ln 2
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    assert result["tokens_per_second"] > 0
    assert json.loads((run / "eval" / "step_00000004_test.json").read_text()) == result


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_token_byte_lengths_add_up_to_the_utf8_length(kind):
    tokenizer = {"byte": ByteTokenizer, "char": lambda: CharTokenizer("abc πω"),
                 "bpe": lambda: BPETokenizer.train(["π and ω, naïve café — déjà vu " * 20], vocab_size=300)}[kind]()
    text = "a naïve café: π ω — déjà vu"
    ids = tokenizer.encode(text)
    expected = len(text.encode("utf-8")) if tokenizer.kind != "char" else \
        sum(len(c.encode("utf-8")) if c in "abc πω" else 3 for c in text)  # unknown chars count as U+FFFD
    assert int(token_byte_lengths(tokenizer)[ids].sum()) == expected


@pytest.mark.parametrize(("extra", "message"), [
    (["--tokenizer", "words"], "--tokenizer must be one of ['bpe', 'byte', 'char'], got 'words'"),
    (["--precision", "fp8"], "--precision must be one of ['auto', 'fp32', 'bf16'], got 'fp8'"),
    (["--task", "chess"],
     "--task must be one of ['image-class', 'listops', 'lm', 'mqar', 'pathfinder', 'pixels', 'reach', 'recall', "
     "'retrieval', 'vl-retrieval'], got 'chess'"),
    (["--attention", "magic"], "--attention must be one of"),
    (["--config", "huge"], "--config must be one of ['tiny', 'small', 'medium', 'large'], got 'huge'"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--attention", "pi", "--sinks", "100000"], "--sinks must be smaller than --seq-len"),
    (["--tokenizer", "bpe"], "--vocab-size is required with --tokenizer bpe"),
])
def test_bad_flags_give_one_line_naming_the_flag(tmp_path, capsys, extra, message):
    corpus = write_corpus(tmp_path / "corpus")
    assert main(train_argv(corpus, tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("piattn train: error: ") and message in err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_data_path(tmp_path, capsys):
    assert main(train_argv(tmp_path / "nowhere", tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "--data: path does not exist" in err and "nowhere" in err
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def test_missing_validation_split_and_checkpoint(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    for f in (corpus / "validation").iterdir():
        f.unlink()
    (corpus / "validation").rmdir()
    assert main(train_argv(corpus, tmp_path / "run")) == 2
    assert "--data: no folder for split 'validation'" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 2
    assert "--checkpoint: no checkpoint" in capsys.readouterr().err


def test_refuses_to_train_over_an_existing_run(tmp_path, capsys):
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    assert main(train_argv(corpus, run, "--steps", "1", "--eval-every", "0")) == 0
    assert main(train_argv(corpus, run, "--steps", "1", "--eval-every", "0")) == 2
    assert "pass --resume" in capsys.readouterr().err
