"""metrics.jsonl: a resumed run drops later records, and survives a last line cut by a crash."""

from __future__ import annotations

import json
import re

import pytest

from piattn.train.metrics import METRICS_FILE, MetricsWriter, read_metrics


def write_lines(run_dir, steps, tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"step": s, "split": "train", "loss": 1.0 / s}) + "\n" for s in steps)
    (run_dir / METRICS_FILE).write_text(lines + tail)


def steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


@pytest.mark.parametrize("tail", ['{"step": 4, "split": "tr', "{", '{"step": 4, "spl\n', "\x00\x00\x00"])
def test_resume_drops_a_last_line_cut_by_a_crash(tmp_path, tail):
    write_lines(tmp_path, [1, 2, 3], tail)
    assert steps(tmp_path) == [1, 2, 3]  # readers skip the cut line too
    writer = MetricsWriter(tmp_path, after_step=3)
    writer.log(4, "train", {"loss": 0.25})
    writer.close()
    assert steps(tmp_path) == [1, 2, 3, 4]
    assert all(json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines())


def test_resume_keeps_complete_lines_up_to_after_step(tmp_path):
    write_lines(tmp_path, [1, 2, 3, 4], '{"step": 5')
    MetricsWriter(tmp_path, after_step=2).close()
    assert steps(tmp_path) == [1, 2]
    write_lines(tmp_path, [1, 2], '{"step": 3, "split": "train"}')  # complete, only its newline missing
    writer = MetricsWriter(tmp_path, after_step=3)
    writer.log(4, "train", {})
    writer.close()
    assert steps(tmp_path) == [1, 2, 3, 4]


def test_an_invalid_line_before_the_last_is_a_value_error_naming_the_file_and_line(tmp_path):
    write_lines(tmp_path, [1], "garbage\n" + json.dumps({"step": 2, "split": "train"}) + "\n")
    file = re.escape(str(tmp_path / METRICS_FILE))
    with pytest.raises(ValueError, match=f"{file}: line 2 is not a JSON record"):
        MetricsWriter(tmp_path, after_step=2)
    with pytest.raises(ValueError, match=f"{file}: line 2"):
        read_metrics(tmp_path)
