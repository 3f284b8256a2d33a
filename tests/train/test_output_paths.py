"""`piattn.commands.paths`: the output folder / file checks commands run before any work (train --out,
reach --out). Each refusal is one ValueError naming the flag; nothing is created by a check."""

from __future__ import annotations

import os

import pytest

from piattn.commands.paths import output_file, output_folder


@pytest.mark.parametrize("given", ["", "  "])
def test_an_empty_out_is_refused_not_taken_for_the_current_folder(given):
    with pytest.raises(ValueError, match=r"^--out must name a folder, got '\s*' \(an empty name would mean"):
        output_folder(given, "--out")


def test_a_file_or_a_file_on_the_way_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"^--out {afile} is a file, not a folder$"):
        output_folder(str(afile))
    with pytest.raises(ValueError, match=f"^--out {afile}/run: {afile} is a file, not a folder$"):
        output_folder(f"{afile}/run")
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=f"^--out {broken}/run: {broken} is a broken link$"):
        output_folder(f"{broken}/run")


@pytest.mark.skipif(os.geteuid() != 0, reason="root: os.access says yes to /proc, creating there fails")
def test_proc_is_refused_as_root():
    with pytest.raises(ValueError, match="^--out /proc/piattn-run: cannot create anything in /proc "):
        output_folder("/proc/piattn-run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only-mode folder")
def test_a_folder_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot create anything in"):
        output_folder(str(locked / "run"))


def test_a_good_folder_passes_and_nothing_is_created(tmp_path):
    assert output_folder(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert output_folder(str(tmp_path)) == tmp_path
    assert output_file(str(tmp_path / "c" / "f.png")) == tmp_path / "c" / "f.png"
    assert list(tmp_path.iterdir()) == []  # the write probe is removed again


def test_output_file_refuses_a_folder(tmp_path):
    with pytest.raises(ValueError, match=f"^--output {tmp_path} is a folder; name a file$"):
        output_file(str(tmp_path), "--output")


@pytest.mark.parametrize("out", ["", "/proc/piattn-run"])
def test_train_checks_out_before_any_work(out, capsys):
    """`piattn train --out ''` trained into the current folder; --out /proc/x (as root) failed late."""
    if out.startswith("/proc") and os.geteuid() != 0:
        pytest.skip("root: os.access says yes to /proc, creating there fails")
    from piattn.cli import main

    assert main(["train", "--task", "reach", "--lag", "3", "--steps", "1", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("piattn train: error: --out ") and err.count("\n") == 1


@pytest.mark.parametrize("source, label", [
    ("books:../data/books", "books"), ("/data/my.txt", "my.txt"), ("corpus/", "corpus"),
    ("coco:/data/coco2014", "coco-coco2014"), ("wikitext:data/wikitext-103/", "wikitext-wikitext-103"),
    ("hf:roneneldan/TinyStories", "hf-TinyStories"), ("mnist5k", "mnist5k"), ("../", "data"),
    ("a" * 80 + ".txt", "a" * 32),
])
def test_eval_files_get_short_names_of_their_data(source, label):
    import argparse
    from pathlib import Path

    from piattn.commands.eval import data_label, default_name

    assert data_label(source) == label
    args = argparse.Namespace(data=source, split="test")
    assert default_name(Path("step_00000004"), args) == f"step_00000004_test_{label}.json"
