"""`piattn train --task mqar --mqar-layout / --mqar-lags`: the splits are the generator's scattered layout, the lags
control draws only its lags, and a packed bin that leaves one distance is refused in one line naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from test_mqar_task import TEST_SEED, TINY, task_of

from piattn.cli import main
from piattn.data.mqar import mqar_mix, spans
from piattn.tasks.mqar import parse_lags


def test_a_scattered_split_is_the_generators_scattered_mix():
    task = task_of("--seq-len", "64", "--mqar-pairs", "2,4", "--mqar-distance", "2-8,9-16", "--mqar-layout",
                   "scattered", "--eval-size", "20")
    out = mqar_mix(20, 64, (2, 4), key_vocab=64, value_vocab=64, distance_bins=((2, 8), (9, 16)), stratified=True,
                   layout="scattered", generator=torch.Generator().manual_seed(TEST_SEED))
    split = task.examples("test")
    assert torch.equal(split.inputs.long(), out["tokens"])
    assert torch.equal(split.labels.long(), torch.stack([out["targets"], out["distance"]], 1))
    assert set(out["distance"][out["distance"] >= 0].tolist()) >= {2, 3, 8, 9, 16}


def test_lags_imply_the_scattered_layout_and_are_the_only_distances():
    task = task_of("--seq-len", "64", "--mqar-pairs", "4", "--mqar-lags", "2-4,17-20", "--eval-size", "50")
    settings = task.settings(task.cfg)
    assert settings["layout"] == "scattered" and settings["lags"] == (2, 3, 4, 17, 18, 19, 20)
    distance = task.examples("test").labels[:, 1].long()
    assert set(distance[distance >= 0].tolist()) == {2, 3, 4, 17, 18, 19, 20}


def test_the_default_is_packed_and_unchanged():
    task = task_of("--seq-len", "40", "--mqar-pairs", "5", "--train-size", "8")
    assert task.settings(task.cfg)["layout"] == "packed" and task.settings(task.cfg)["lags"] is None


def test_parse_lags_reads_what_spans_writes():
    assert parse_lags("2-4, 9,17-18") == (2, 3, 4, 9, 17, 18)
    assert parse_lags(spans([2, 3, 4, 9, 17, 18])) == (2, 3, 4, 9, 17, 18)
    assert parse_lags("5,3,3") == (3, 5)


@pytest.mark.parametrize("argv, message", [
    (["--mqar-pairs", "4", "--mqar-distance", "2-8"],
     "--mqar-distance 2-8 puts every query at distance 8 with 4 pairs in --seq-len 64 (packed: pair 0's query is "
     ">= 8 from its key), so one fixed offset answers them all; use --mqar-layout scattered"),
    (["--mqar-pairs", "4", "--mqar-lags", "1-4"], "--mqar-lags must be distances and ranges 'A-B,C,...'"),
    (["--mqar-pairs", "4", "--mqar-lags", "4-2"], "--mqar-lags must be"),
    (["--mqar-pairs", "4", "--mqar-lags", "near"], "--mqar-lags must be"),
    (["--mqar-pairs", "4", "--mqar-lags", "2-4", "--mqar-distance", "2-8"],
     "--mqar-lags and --mqar-distance are exclusive"),
    (["--mqar-pairs", "4", "--mqar-lags", "2-4", "--mqar-layout", "packed"],
     "--mqar-lags needs --mqar-layout scattered"),
    (["--mqar-layout", "tiled"], "--mqar-layout"),
    (["--mqar-pairs", "4", "--mqar-lags", "30-70"],
     "--mqar-lags 30-70 with 4 pairs in --seq-len 64: lags must be integers in [2, seq_len - 2 = 62]"),
    (["--mqar-pairs", "4", "--mqar-lags", "61-62"], "--mqar-lags 61-62 with 4 pairs in --seq-len 64: lags "),
    (["--mqar-pairs", "16", "--mqar-layout", "scattered"],
     "--mqar-layout scattered with 16 pairs in --seq-len 64: n_pairs 16 leave too little room"),
])
def test_bad_layout_flags_give_one_line_naming_the_flag(tmp_path, capsys, argv, message):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--task", "mqar", "--seq-len", "64",
                 *TINY, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("piattn train: error: ") and message in err[0], err


def test_layout_flags_belong_to_the_mqar_task(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--task", "recall", "--mqar-lags", "2-4",
                 *TINY]) == 2
    assert "--mqar-lags applies to --task mqar only, not 'recall'" in capsys.readouterr().err


def test_a_lags_run_trains_and_eval_scores_its_lags_only(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
                 "--task", "mqar", "--attention", "local", "--window", "4", "--seq-len", "32", "--mqar-pairs", "2,4",
                 "--mqar-keys", "6", "--mqar-values", "5", "--mqar-lags", "2-5,9", "--train-size", "8",
                 "--eval-size", "10", *TINY]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--split", "test", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    data = mqar_mix(10, 32, (2, 4), key_vocab=6, value_vocab=5, stratified=True, layout="scattered",
                    lags=(2, 3, 4, 5, 9), generator=torch.Generator().manual_seed(TEST_SEED))
    asked = data["distance"] >= 0
    assert result["queries"] == int(asked.sum()) == 30
    assert result["queries_by_distance"] == {str(d): int((data["distance"] == d).sum())
                                             for d in sorted(set(data["distance"][asked].tolist()))}
    assert set(result["queries_by_distance"]) <= {"2", "3", "4", "5", "9"}
