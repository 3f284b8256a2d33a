"""What `piattn eval` prints: a summary for a person first (the task, the checkpoint, the metrics with their
units; bits per byte = loss / ln 2 for a byte-level model; accuracy by lag with the lags the reachability
analysis says the model reaches marked), then where the JSON was written; `--json` keeps the JSON on stdout.

The marks are checked against `reachability_mask`, the analysis by matrix powers over the run's actual
sequence (sinks included), not against the reach each kind declares (`lag_reach`), which the summary uses.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from piattn.analysis.reachability import reachability_mask
from piattn.cli import main
from piattn.commands import eval as eval_command
from piattn.commands import eval_report
from piattn.commands.eval_report import MAX_LAG_ROWS, lag_rows
from piattn.tasks import TASKS
from utils import write_word_corpus

TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--batch-size", "4", "--steps", "1", "--warmup", "1",
        "--eval-every", "0", "--device", "cpu", "--precision", "fp32", "--no-progress"]
SEQ = 24
WINDOW, PERIOD, LAYERS = 2, 8, 2
RECALL = ["--task", "recall", "--attention", "pi", "--window", str(WINDOW), "--period", str(PERIOD), "--seq-len",
          str(SEQ), "--recall-symbols", "5", "--train-size", "8", "--eval-size", "40"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder}: byte- and char-level LMs, recall in both orders (one with sinks), a reach run."""
    root = tmp_path_factory.mktemp("summary")
    corpus = write_word_corpus(root / "corpus", {"train": [120], "validation": [40], "test": [60, 90]})
    lm = ["--data", str(corpus), "--seq-len", "32", "--attention", "local", "--window", "3"]
    argvs = {"byte": lm, "char": [*lm, "--tokenizer", "char"],
             "marker-value": [*RECALL, "--lag-min", "3", "--lag-max", "22", "--sinks", "2"],
             "value-marker": [*RECALL, "--lag-min", "3", "--lag-max", "14", "--recall-order", "value-marker"],
             "reach": ["--task", "reach", "--lag", "3", "--seq-len", "16", "--attention", "local", "--window",
                       "2", "--train-size", "8", "--eval-size", "8"]}
    for name, argv in argvs.items():
        assert main(["train", "--out", str(root / name), *argv, *TINY]) == 0
    return {name: root / name for name in argvs}


def evaluate(capsys, run, *argv) -> tuple[list[str], dict, str]:
    """(stdout lines, the JSON file eval named, stderr) of `piattn eval` on `run`'s test split."""
    assert main(["eval", "--checkpoint", str(run), "--use-stored-data", "--split", "test", "--device", "cpu",
                 "--overwrite", *argv]) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    written = re.fullmatch(r"full JSON written to (.+)", lines[-1])
    assert written, lines[-1]
    with open(written[1], encoding="utf-8") as f:
        return lines, json.load(f), err


def metric(lines: list[str], name: str) -> str:
    """The value printed on the summary line `  NAME  VALUE …`."""
    return next(line.split()[1] for line in lines if line.split()[:1] == [name])


def lag_marks(lines: list[str]) -> dict[int, tuple[bool, str, int]]:
    """{lag: (marked, accuracy as printed, examples)} from the accuracy-by-lag table (one lag a row)."""
    start = lines.index("accuracy by lag") + 2  # after the column names
    rows = {}
    for line in lines[start:]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows[int(cells[0])] = (cells[1] == "*", cells[-2], int(cells[-1]))
    return rows


def analysis_reaches(seq_len: int, sinks: int, lag: int) -> bool:
    """Whether the analysis says the last position (the query) reads the key `lag` back."""
    mask = reachability_mask(seq_len, WINDOW, PERIOD, LAYERS, causal=True, sinks=sinks)
    return bool(mask[seq_len - 1, seq_len - 1 - lag])


def test_a_byte_level_model_reads_as_bits_per_byte_equal_to_loss_over_ln2(runs, capsys):
    lines, result, err = evaluate(capsys, runs["byte"])
    assert lines[0] == (f"lm, step 1 of {result['checkpoint']}: test split of {result['data']}, "
                        f"{result['tokens']:,} tokens, {result['seconds']:.1f} s")
    assert metric(lines, "loss") == f"{result['loss']:.4f}"
    assert metric(lines, "perplexity") == f"{math.exp(result['loss']):.3f}"
    assert metric(lines, "bits/byte") == f"{result['loss'] / math.log(2):.4f}"
    assert "= loss / ln 2: byte tokenizer" in next(line for line in lines if "bits/byte" in line)
    assert err == ""  # no terminal, no warning: stderr has nothing to say


def test_another_tokenizer_says_how_its_bits_per_byte_count(runs, capsys):
    lines, result, _ = evaluate(capsys, runs["char"])
    line = next(line for line in lines if "bits/byte" in line)
    assert line.split()[1] == f"{result['bpb']:.4f}" and "loss / ln 2" not in line
    assert f"char tokenizer: nats over the text's {result['bytes']:,} UTF-8 bytes" in line


@pytest.mark.parametrize("run, sinks, marker", [("marker-value", 2, +1), ("value-marker", 0, -1)])
def test_recall_prints_accuracy_by_lag_with_the_reachable_lags_marked(runs, capsys, run, sinks, marker):
    lines, result, _ = evaluate(capsys, runs[run])
    assert metric(lines, "accuracy") == f"{result['accuracy']:.2%}"
    table = lag_marks(lines)
    assert sorted(table) == sorted(int(lag) for lag in result["accuracy_by_lag"])
    expected = {lag: analysis_reaches(SEQ, sinks, lag) and analysis_reaches(SEQ, sinks, lag + marker)
                for lag in table}
    assert {lag: row[0] for lag, row in table.items()} == expected
    assert any(expected.values()) and not all(expected.values())  # both kinds of row are checked
    for lag, (_, accuracy, examples) in table.items():
        assert accuracy == f"{result['accuracy_by_lag'][str(lag)]:.2%}"
        assert examples == result["examples_by_lag"][str(lag)]
    legend = lines[lines.index("accuracy by lag") + 2 + len(table)]
    assert legend.startswith(f"* reachable: the query reaches the value and its marker through pi attention, "
                             f"window {WINDOW}, period {PERIOD}")


def test_reach_prints_its_one_lag(runs, capsys):
    lines, result, _ = evaluate(capsys, runs["reach"])
    # local window 2, 2 layers: lag 3 is within k·L = 4
    assert lag_marks(lines) == {3: (True, f"{result['accuracy']:.2%}", result["examples"])}


def test_json_flag_prints_the_json_and_the_summary_goes_to_stderr(runs, capsys):
    assert main(["eval", "--checkpoint", str(runs["value-marker"]), "--split", "test", "--device", "cpu",
                 "--overwrite", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    written = err.strip().splitlines()[-1].removeprefix("full JSON written to ")
    with open(written, encoding="utf-8") as f:
        assert json.load(f) == result
    assert err.startswith("recall, step 1 of ") and "accuracy by lag" in err


def test_a_failed_write_prints_the_json_after_the_summary(runs, capsys, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eval_command, "write_result", full_disk)
    code = main(["eval", "--checkpoint", str(runs["reach"]), "--split", "test", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2 and "No space left on device" in err and "the JSON above" in err
    summary, _, text = out.partition("\n{")
    assert summary.startswith("reach, step 1 of ") and json.loads("{" + text)["examples"] == 8


def test_many_lags_share_rows_that_never_mix_reachable_and_unreachable():
    lags = list(range(1, 101))
    reachable = {lag: lag <= 10 or lag in (50, 51) for lag in lags}
    rows = lag_rows(lags, reachable)
    assert [lag for row in rows for lag in row] == lags
    assert all(len({reachable[lag] for lag in row}) == 1 for row in rows)
    assert all(row == list(range(row[0], row[-1] + 1)) for row in rows)
    assert len(rows) <= MAX_LAG_ROWS + 4  # each change of reachability may cut one row short
    assert lag_rows(list(range(3, 13)), None) == [[lag] for lag in range(3, 13)]


def test_each_task_declares_its_report_and_eval_names_no_task():
    """The tables after the metrics are the task's to declare (`Task.report_sections`), drawn by the sections
    eval_report knows; eval and eval_report switch on no task name (the issue's measure: none left)."""
    declared = {section for task in TASKS.values() for section in task.report_sections}
    assert declared == set(eval_report.SECTIONS)
    assert {name for name, task in TASKS.items() if task.by_position} == {"lm"}
    for module in (eval_command, eval_report):
        text = Path(module.__file__).read_text()
        names = "|".join(re.escape(name) for name in TASKS)
        assert not re.search(rf'task ==|task !=|task in \(|isinstance\(task|"task"\) (==|!=|in)|[=!]= *"({names})"',
                             text), module
