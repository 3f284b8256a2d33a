"""benchmarks/kernel_ab.py: revisions of fused_cpu.c built and timed side by side, end to end on a tiny call
(no timing is asserted): a row per dtype, length and revision, its ratios against the first revision, and the
files it writes; a revision git does not have is refused with its name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from utils import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_ab.py"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("git") is None,
                                reason="needs a C compiler and git")


def test_the_worktree_against_itself(tmp_path):
    bench = load_script(SCRIPT, "kernel_ab")
    rows = bench.main(["--revisions", "worktree", "worktree", "--lengths", "40", "--dtypes", "float32",
                       "bfloat16", "--rounds", "2", "--out", str(tmp_path), "--name", "ab"])
    assert [(r["dtype"], r["T"]) for r in rows] == [("float32", 40), ("bfloat16", 40)]  # one build for both
    for row in rows:
        assert row["revision"] == "worktree" and row["fwd / first"] == 1.0 and row["bwd min"] > 0
    written = json.loads((tmp_path / "ab.json").read_text())
    assert written["rows"] == rows
    assert "| bfloat16 | 40 | worktree |" in (tmp_path / "ab.md").read_text()


def test_an_unknown_revision_is_refused_with_its_name(tmp_path):
    bench = load_script(SCRIPT, "kernel_ab")
    with pytest.raises(SystemExit, match="no-such-revision"):
        bench.main(["--revisions", "no-such-revision", "--out", str(tmp_path)])


def test_the_decoding_step_of_the_worktree_against_itself(tmp_path):
    """--kernels step: a row per case, batch and revision, from the packed block of a real layer step."""
    bench = load_script(SCRIPT, "kernel_ab")
    rows = bench.main(["--kernels", "step", "--revisions", "worktree", "worktree", "--cases", "pi", "local",
                       "--batches", "1", "3", "--rounds", "2", "--calls", "5", "--out", str(tmp_path), "--name", "ab"])
    assert [(r["case"], r["batch"]) for r in rows] == [("pi", 1), ("pi", 3), ("local", 1), ("local", 3)]
    for row in rows:
        assert row["revision"] == "worktree" and row["step / first"] == 1.0 and row["step min"] > 0
    text = (tmp_path / "ab.md").read_text()
    assert "# decode_step.c revisions" in text and "| pi | 3 | worktree |" in text


@pytest.mark.parametrize("flags", [["--kernels", "step", "--lengths", "64"], ["--cases", "pi"]])
def test_a_setting_of_the_other_kernels_is_refused(flags, tmp_path, capsys):
    bench = load_script(SCRIPT, "kernel_ab")
    with pytest.raises(SystemExit):
        bench.main(["--revisions", "worktree", "--out", str(tmp_path), *flags])
    assert "applies to --kernels" in capsys.readouterr().err
