"""`piattn train --task mqar` then `piattn eval`: the splits are the generator's, the loss counts the queries
only, and accuracy by key–query distance and by number of pairs is counted right."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from piattn.cli import main
from piattn.commands.train import add_arguments, checked_config
from piattn.config import TrainConfig
from piattn.data.examples import Examples
from piattn.data.mqar import IGNORE, mqar_batch, mqar_mix
from piattn.models import GPT, GPTConfig
from piattn.tasks import MQARTask
from piattn.tasks.mqar import pairs_view
from piattn.train.checkpoint import load_weights, read_config, read_latest
from piattn.train.distributed import setup
from utils import train_summary

TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--batch-size", "4", "--warmup", "1",
        "--device", "cpu", "--precision", "fp32", "--no-progress"]
TEST_SEED = 2  # split seed of the test split with --data-seed 0: 3·0 + 2


def task_of(*argv: str) -> MQARTask:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "unused", "--task", "mqar", *TINY, *argv])
    return MQARTask.from_config(checked_config(TrainConfig.from_args(args)), None, setup("cpu"))


def test_a_split_of_one_pair_count_is_the_generators_batch():
    task = task_of("--seq-len", "40", "--mqar-pairs", "5", "--mqar-keys", "9", "--mqar-values", "6",
                   "--train-size", "12", "--data-seed", "3")
    split = task.examples("train")
    out = mqar_batch(12, 40, 5, key_vocab=9, value_vocab=6, generator=torch.Generator().manual_seed(9))  # 3·3 + 0
    assert torch.equal(split.inputs.long(), out["tokens"])
    assert torch.equal(split.labels[:, 0].long(), out["targets"]) and torch.equal(split.labels[:, 1].long(),
                                                                                  out["distance"])
    assert task.model_config.vocab_size == 9 + 6 + 1


def test_a_mixed_split_is_the_generators_stratified_mix():
    task = task_of("--seq-len", "48", "--mqar-pairs", "2-4", "--mqar-distance", "8-12,16-20", "--eval-size", "30")
    out = mqar_mix(30, 48, (2, 3, 4), key_vocab=64, value_vocab=64, distance_bins=((8, 12), (16, 20)),
                   stratified=True, generator=torch.Generator().manual_seed(TEST_SEED))
    split = task.examples("test")
    assert torch.equal(split.inputs.long(), out["tokens"])
    assert torch.equal(split.labels.long(), torch.stack([out["targets"], out["distance"]], 1))
    assert sorted(torch.bincount(out["n_pairs"]).tolist()) == [0, 0, 10, 10, 10]  # stratified over the counts


def test_the_loss_is_the_cross_entropy_at_the_queries_only():
    task = task_of("--seq-len", "32", "--mqar-pairs", "2,3", "--train-size", "6")
    torch.manual_seed(0)
    model = task.build_model().eval()
    captured = {}

    class Spy(nn.Module):  # the model, its logits kept for their gradient
        def forward(self, idx):
            captured["logits"] = model(idx)
            captured["logits"].retain_grad()
            return captured["logits"]

    batch = (task.examples("train").inputs, task.examples("train").labels)
    loss, tokens = task.loss(Spy(), batch)
    loss.backward()
    targets = batch[1][:, 0].long()
    asked = targets != IGNORE
    assert set(asked.sum(1).tolist()) <= {2, 3}  # each sequence's pairs, one query each
    expected = F.cross_entropy(captured["logits"].detach()[asked], targets[asked])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6) and tokens == 6 * 32
    grad = captured["logits"].grad.abs().sum(-1)
    assert (grad[asked] > 0).all() and (grad[~asked] == 0).all()


class Oracle(nn.Module):
    """Logits of an exact recaller (at each position, the token that followed the first earlier occurrence of
    the current token; the next token where there is none) everywhere but at `wrong` ((row, position) pairs:
    the filler there)."""

    def __init__(self, vocab: int, wrong: list[tuple[int, int]]):
        super().__init__()
        self.vocab, self.wrong = vocab, wrong

    def forward(self, idx):
        answer = idx.roll(-1, dims=1)
        for row in range(idx.shape[0]):
            for position in range(idx.shape[1]):
                earlier = (idx[row, :position] == idx[row, position]).nonzero()
                if len(earlier):
                    answer[row, position] = idx[row, earlier[0, 0] + 1]
        for row, position in self.wrong:
            answer[row, position] = self.vocab - 1
        return 5.0 * F.one_hot(answer, self.vocab).float()


def test_eval_counts_accuracy_by_distance_and_pairs_on_a_hand_checked_case(monkeypatch):
    # keys 2, values 2, filler 4: vocabulary 5; sequences of 12
    task = task_of("--seq-len", "12", "--mqar-pairs", "1,2", "--mqar-keys", "2", "--mqar-values", "2",
                   "--batch-size", "3")  # one batch: the oracle's rows are the split's
    g = torch.Generator().manual_seed(0)
    two = mqar_batch(1, 12, 2, key_vocab=2, value_vocab=2, distances=[5, 6], generator=g)  # queries at 5 and 8
    one = mqar_batch(2, 12, 1, key_vocab=2, value_vocab=2, distances=[9], generator=g)  # query at 9
    tokens = torch.cat([two["tokens"], one["tokens"]])
    labels = torch.stack([torch.cat([two[k], one[k]]) for k in ("targets", "distance")], 1)
    monkeypatch.setattr(task, "load_split", lambda split: Examples(tokens, labels))
    # wrong: row 0's query at 8 (pair 1, distance 6) and row 2's query at 9 (one pair, distance 9)
    result = task.evaluate(Oracle(5, [(0, 8), (2, 9)]), "test", 0)
    assert result["queries"] == 4 and result["examples"] == 3 and result["accuracy"] == 0.5
    assert result["accuracy_by_distance"] == {"5": 1.0, "6": 0.0, "9": 0.5}
    assert result["queries_by_distance"] == {"5": 1, "6": 1, "9": 2}
    assert result["accuracy_by_pairs"] == {"1": 0.5, "2": 0.5}
    assert result["queries_by_pairs"] == {"1": 2, "2": 2}
    assert result["by_pairs_distance"] == {"pairs": [1, 2], "distances": [5, 6, 9],
                                           "accuracy": [[None, None, 0.5], [1.0, 0.0, None]],
                                           "queries": [[0, 0, 2], [1, 1, 0]]}
    assert pairs_view(result, 2) == {"accuracy_by_distance": {"5": 1.0, "6": 0.0},
                                     "queries_by_distance": {"5": 1, "6": 1}}
    assert result["chance"] == 0.5
    right, wrong = (-F.log_softmax(torch.tensor([5.0, 0, 0, 0, 0]), 0))[[0, 1]].tolist()
    assert result["loss"] == pytest.approx((2 * right + 2 * wrong) / 4)


def test_mqar_trains_and_eval_reports_accuracy_by_distance_and_pairs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
                 "--task", "mqar", "--attention", "pi", "--window", "2", "--period", "8", "--seq-len", "32",
                 "--mqar-pairs", "2,4", "--mqar-keys", "6", "--mqar-values", "5", "--train-size", "8",
                 "--eval-size", "10", *TINY]) == 0
    summary = train_summary(out, capsys)
    assert set(summary["validation"]["accuracy_by_pairs"]) <= {"2", "4"}
    assert main(["eval", "--checkpoint", str(out), "--split", "test", "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)

    data = mqar_mix(10, 32, (2, 4), key_vocab=6, value_vocab=5, stratified=True,
                    generator=torch.Generator().manual_seed(TEST_SEED))
    folder = read_latest(out / "checkpoints")
    model = GPT(GPTConfig(**read_config(folder)["model"]))
    load_weights(model, folder)
    with torch.no_grad():
        logits = model.eval()(data["tokens"])
    asked = data["targets"] != IGNORE
    correct = logits.argmax(-1)[asked] == data["targets"][asked]
    distance, pairs = data["distance"][asked], data["n_pairs"][:, None].expand_as(asked)[asked]
    assert result["queries"] == 10 * 3 == int(asked.sum())  # 5 examples of 2 pairs, 5 of 4
    assert result["accuracy"] == pytest.approx(correct.double().mean().item())
    for d in distance.unique().tolist():
        assert result["accuracy_by_distance"][str(d)] == pytest.approx(correct[distance == d].double().mean().item())
        assert result["queries_by_distance"][str(d)] == int((distance == d).sum())
    assert result["queries_by_pairs"] == {"2": 10, "4": 20}
    for n in (2, 4):
        assert result["accuracy_by_pairs"][str(n)] == pytest.approx(correct[pairs == n].double().mean().item())
    # the summary on stderr: both tables, distances marked by π's reach (k 2, π 8, 2 layers: 1 … 4, 9 … 10)
    assert "accuracy by key–query distance" in captured.err and "accuracy by number of pairs" in captured.err
    assert "the query reaches the key and its value through pi attention, window 2, period 8" in captured.err
    served = torch.isin(distance, torch.tensor([1, 2, 3, 4, 9, 10]))
    rows = captured.err.split("accuracy by number of pairs\n")[1].splitlines()[1:3]
    for row, n in zip(rows, (2, 4), strict=True):
        cells = [correct[(pairs == n) & where].double().mean().item() if ((pairs == n) & where).any() else None
                 for where in (torch.ones_like(served), served, ~served)]
        shown = [f"{100 * c:.2f}%" if c is not None else "—" for c in cells]
        assert row.split() == [str(n), *shown, str(int((pairs == n).sum()))]


@pytest.mark.parametrize("argv, message", [
    (["--mqar-pairs", "8x"], "--mqar-pairs must be a count '8', a list '8,16,32,64' or a range '8-64'"),
    (["--mqar-pairs", "4,4"], "each count once, got '4,4'"),
    (["--mqar-pairs", "9-8"], "--mqar-pairs must be"),
    (["--mqar-pairs", "7"], "--mqar-pairs: every count must be <= --seq-len / 4 = 6"),
    (["--mqar-pairs", "6", "--mqar-keys", "5"], "--mqar-keys must be >= the most pairs, 6"),
    (["--mqar-values", "0"], "--mqar-values must be >= 1, got 0"),
    (["--mqar-distance", "near"], "--mqar-distance must be 'uniform' or distance bins 'LO-HI[,LO-HI...]'"),
    (["--mqar-distance", "5-3"], "--mqar-distance must be"),
    (["--mqar-pairs", "2,4", "--mqar-distance", "4-6"],
     "--mqar-distance 4-6 cannot hold 4 pairs in --seq-len 24: pair i's key sits at 2i and its query after all "
     "pairs, so with 4 pairs a bin needs LO <= 16, HI >= 8"),
    (["--data", "x"], "--data does not apply to --task mqar"),
])
def test_bad_mqar_flags_give_one_line_naming_the_flag(tmp_path, capsys, argv, message):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--task", "mqar", "--seq-len", "24",
                 *TINY, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("piattn train: error: ") and message in err[0]


def test_mqar_flags_belong_to_the_mqar_task(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--task", "recall", "--mqar-pairs", "4",
                 *TINY]) == 2
    assert "--mqar-pairs applies to --task mqar only, not 'recall'" in capsys.readouterr().err
