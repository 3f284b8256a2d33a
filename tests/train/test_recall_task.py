"""`piattn train --task recall` then `piattn eval`: accuracy by lag, checked against an oracle rebuilt here."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch.nn import functional as F

from piattn.cli import main
from piattn.commands.train import add_arguments, checked_config
from piattn.config import TrainConfig
from piattn.data import recall
from piattn.models import GPT, GPTConfig
from piattn.tasks import RecallTask
from piattn.train.checkpoint import load_weights, read_config, read_latest
from piattn.train.distributed import setup
from utils import train_summary

TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--batch-size", "4", "--warmup", "1",
        "--device", "cpu", "--precision", "fp32", "--no-progress"]
TEST_SEED = 2  # split seed of the test split with --data-seed 0: 3·0 + 2


@pytest.mark.parametrize("order, loss", [("marker-value", "query"), ("value-marker", "every")])
def test_recall_trains_and_eval_reports_accuracy_by_lag(tmp_path, capsys, order, loss):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
                 "--task", "recall", "--attention", "pi", "--window", "2", "--period", "8", "--seq-len", "24",
                 "--recall-symbols", "5", "--lag-min", "3", "--lag-max", "12", "--recall-order", order,
                 "--recall-loss", loss, "--train-size", "8", "--eval-size", "25", *TINY]) == 0
    summary = train_summary(out, capsys)
    assert set(summary["validation"]["accuracy_by_lag"]) <= {str(lag) for lag in range(3, 13)}
    assert main(["eval", "--checkpoint", str(out), "--split", "test", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    data = recall.generate(25, seed=TEST_SEED, seq_len=24, n_symbols=5, lag_min=3, lag_max=12, stratified=True,
                           value_first=order == "value-marker")
    folder = read_latest(out / "checkpoints")
    model = GPT(GPTConfig(**read_config(folder)["model"]))
    load_weights(model, folder)
    with torch.no_grad():
        logits = model.eval()(data.tokens)[:, -1]
    assert logits.shape == (25, 7)  # 5 symbols, the marker and the query
    correct = logits.argmax(-1) == data.answer
    assert result["accuracy"] == pytest.approx(correct.double().mean().item())
    assert result["chance"] == pytest.approx(0.2)
    assert result["examples_by_lag"] == {str(lag): int((data.lag == lag).sum()) for lag in range(3, 13)}
    for lag in range(3, 13):
        at = data.lag == lag
        assert result["accuracy_by_lag"][str(lag)] == pytest.approx(correct[at].double().mean().item())


@pytest.mark.parametrize("order", ["marker-value", "value-marker"])
def test_every_position_loss_asks_each_position_its_lag(order):
    """--recall-loss every: the mean cross-entropy of the value at every position lag-min … lag-max after it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "unused", "--task", "recall", "--seq-len", "16", "--recall-symbols", "4",
                              "--lag-min", "3", "--lag-max", "9", "--recall-order", order, "--recall-loss", "every",
                              *TINY])
    task = RecallTask.from_config(checked_config(TrainConfig.from_args(args)), None, setup("cpu"))
    torch.manual_seed(0)
    model = task.build_model().eval()
    data = recall.generate(6, seed=1, seq_len=16, n_symbols=4, lag_min=3, lag_max=9,
                           value_first=order == "value-marker")
    loss, _ = task.loss(model, (data.tokens, data.answer))
    with torch.no_grad():
        logits = model(data.tokens)
    terms = [F.cross_entropy(logits[i, 15 - lag + d], data.answer[i]) for i, lag in enumerate(data.lag.tolist())
             for d in range(3, 10) if 15 - lag + d <= 15]
    assert loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-5)
    assert torch.equal(task.lags(data.tokens), data.lag)


@pytest.mark.parametrize("argv, message", [
    (["--lag-max", "23"], "--lag-max must be <= 22 with --seq-len 24 and --recall-order marker-value, got 23"),
    (["--recall-order", "value-marker", "--lag-min", "1"],
     "--lag-min must be >= 2 with --recall-order value-marker, got 1"),
    (["--lag-min", "9", "--lag-max", "8"], "--lag-min must be <= --lag-max = 8, got 9"),
    (["--lag-min", "0"], "--lag-min must be >= 1, got 0"),
    (["--recall-symbols", "1"], "--recall-symbols must be >= 2, got 1"),
    (["--data", "x"], "--data does not apply to --task recall"),
])
def test_bad_recall_flags_give_one_line_naming_the_flag(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "1", "--task", "recall", "--seq-len", "24", *TINY,
                 *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("piattn train: error: ") and message in err[0]


def test_recall_flags_belong_to_the_recall_task(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--task", "reach", "--lag", "3",
                 "--lag-max", "5", *TINY]) == 2
    assert "--lag-max applies to --task recall only, not 'reach'" in capsys.readouterr().err
