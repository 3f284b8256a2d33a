"""A run folder made by someone else cannot make training or eval write outside it through a symbolic link.

N2: `piattn train --resume` wrote five temporaries under fixed names (metrics.jsonl.tmp, checkpoints/.latest.tmp,
metrics.png.tmp, cache/<split>-<digest>.tokens.npy.partial, cache/<split>-<digest>.docs.npy) by opening them,
which follows a link planted there. N3: eval checked RUN/eval before scoring and wrote into it afterwards, so a
link put there meanwhile received the result. Each test failed before its fix; the helpers of
`piattn.safe_files` are tested at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from piattn import safe_files
from piattn.cli import main
from piattn.commands import eval as eval_command
from piattn.data.packing import load_corpus
from piattn.train import checkpoint as ckpt
from piattn.train.metrics import read_metrics
from utils import write_word_corpus

TINY = ["--seq-len", "32", "--attention", "local", "--window", "3", "--n-layer", "1", "--d-model", "16",
        "--n-head", "2", "--batch-size", "2", "--steps", "1", "--warmup", "1", "--eval-every", "0",
        "--save-every", "0", "--log-every", "1", "--device", "cpu", "--no-progress"]
KEEP = "the victim's own content"
RESULT = {"checkpoint": "run", "step": 1, "data": None, "split": "test", "loss": 1.0, "seconds": 0.1}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 1-step language-model run (its tokenized train split cached in RUN/cache); copy it first."""
    root = tmp_path_factory.mktemp("links")
    corpus = write_word_corpus(root / "corpus", {"train": [120], "validation": [40], "test": [40]})
    assert main(["train", "--out", str(root / "run"), "--data", str(corpus), *TINY]) == 0
    return root / "run"


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run, free to damage, and a folder outside it."""
    (tmp_path / "outside").mkdir()
    return shutil.copytree(finished, tmp_path / "run", symlinks=True)


def victim(run, name: str = "victim.txt"):
    """A file outside the run folder that must keep its content."""
    file = run.parent / "outside" / name
    file.write_text(KEEP)
    return file


def cache_stem(run) -> str:
    """`<split>-<digest>` of the run's one cached (train) split."""
    (tokens,) = (run / "cache").glob("train-*.tokens.npy")
    return tokens.name.removesuffix(".tokens.npy")


def temporary(run, name: str):
    """Where the unfixed code put the temporary named `name` (a cache name gets the split's prefix)."""
    return run / "cache" / f"{cache_stem(run)}{name}" if name.startswith(".") and "npy" in name else run / name


# --- N2: train --resume ---

@pytest.mark.parametrize("name", ["metrics.jsonl.tmp", "checkpoints/.latest.tmp", "metrics.png.tmp",
                                  ".tokens.npy.partial", ".docs.npy"])
def test_resume_never_writes_through_a_link_at_a_temporary_name(run, name, capsys):
    target = victim(run)
    link = temporary(run, name)
    if name.startswith("."):  # the cache is written again when a file of it is missing or not valid
        (run / "cache" / f"{cache_stem(run)}.tokens.npy").unlink()
        link.unlink(missing_ok=True)
    link.symlink_to(target)
    assert main(["train", "--resume", "--out", str(run), "--steps", "2"]) == 0
    assert target.read_text() == KEEP
    assert ckpt.read_latest(run / "checkpoints").name == "step_00000002"
    assert [r["step"] for r in read_metrics(run) if r["split"] == "train"] == [1, 2]
    assert (run / "metrics.png").read_bytes().startswith(b"\x89PNG")
    corpus = load_corpus(run / "cache" / cache_stem(run))
    assert corpus.doc_starts.tolist() == [0] and len(corpus.tokens) > 100
    assert not (run / "cache" / f"{cache_stem(run)}.docs.npy").is_symlink()
    assert not list(run.rglob(".tmp-*"))  # no temporary left behind


def test_a_linked_metrics_file_is_refused_not_followed(run, capsys):
    target = run.parent / "outside" / "created.jsonl"  # appending through a dangling link would create it
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(target)
    assert main(["train", "--resume", "--out", str(run), "--steps", "2"]) == 2
    assert "metrics.jsonl is a symbolic link" in capsys.readouterr().err
    assert not target.exists()


def test_a_linked_cache_folder_is_refused(run, capsys):
    elsewhere = run.parent / "outside"
    shutil.rmtree(run / "cache")
    (run / "cache").symlink_to(elsewhere, target_is_directory=True)
    assert main(["train", "--resume", "--out", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'cache'} is a symbolic link" in err and "--cache-dir" in err
    assert list(elsewhere.iterdir()) == []


def test_resume_refuses_a_linked_checkpoints_folder_and_deletes_nothing_there(run, capsys):
    """A link at RUN/checkpoints sent the new step into the linked folder and keep-N pruning deleted its
    older steps (exit 0, no message)."""
    elsewhere = run.parent / "outside" / "checkpoints"
    shutil.move(run / "checkpoints", elsewhere)
    for step in (100, 200, 300):  # someone else's checkpoints, which pruning must not touch
        (elsewhere / f"step_{step:08d}").mkdir()
    before = sorted(p.name for p in elsewhere.iterdir())
    (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    assert main(["train", "--resume", "--out", str(run), "--steps", "2", "--keep", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'checkpoints'} is a symbolic link" in err
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_a_checkpoint_folder_swapped_for_links_while_saving_sends_nothing_elsewhere(tmp_path, monkeypatch):
    """The temporary folder of a save was written by path after its mkdir: swapped for a folder of links,
    config.json and trainer_state.pt went through them."""
    import torch

    root, outside = tmp_path / "run" / "checkpoints", tmp_path / "outside"
    outside.mkdir()
    targets = {name: outside / name for name in (ckpt.STATE_FILE, ckpt.CONFIG_FILE, ckpt.MODEL_FILE)}
    for target in targets.values():
        target.write_text(KEEP)
    real_save_model = ckpt.save_model

    def swap_then_save(model, path):
        made = next(p for p in root.iterdir() if p.name.startswith(safe_files.TEMP_PREFIX))
        made.rename(root / "moved-away")
        made.mkdir()
        for name, target in targets.items():
            (made / name).symlink_to(target)
        real_save_model(model, path)

    monkeypatch.setattr(ckpt, "save_model", swap_then_save)
    ckpt.save_checkpoint(root, 1, model=torch.nn.Linear(2, 2), trainer_state={"step": 1}, config={"a": 1})
    assert all(target.read_text() == KEEP for target in targets.values())
    written = root / "moved-away"  # the folder the save opened got every file
    assert json.loads((written / ckpt.CONFIG_FILE).read_text()) == {"a": 1}
    assert torch.load(written / ckpt.STATE_FILE) == {"step": 1}


def test_pruning_never_follows_a_link_among_the_checkpoints(tmp_path):
    import torch

    root, outside = tmp_path / "checkpoints", tmp_path / "outside"
    (outside / "keep-me").mkdir(parents=True)
    (outside / "keep-me" / "file").write_text(KEEP)
    root.mkdir()
    (root / "step_00000000").symlink_to(outside / "keep-me", target_is_directory=True)
    for step in (1, 2):
        ckpt.save_checkpoint(root, step, model=torch.nn.Linear(2, 2), trainer_state={}, config={}, keep=1)
    assert (outside / "keep-me" / "file").read_text() == KEEP
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000000", "step_00000002"]


# --- inspect and convert-eval: results written in a folder with links planted at their names ---

def test_inspect_replaces_links_at_its_file_names_instead_of_writing_through_them(run, capsys):
    out = run / "inspect"
    out.mkdir()
    names = ("inspect.json", "token_flow.png", "gate_dynamics.png", "skip_prior_by_phase.png")
    targets = [victim(run, name) for name in names]
    for name, target in zip(names, targets, strict=True):
        (out / name).symlink_to(target)
    assert main(["inspect", "--checkpoint", str(run), "--out", str(out), "--batches", "1", "--device", "cpu"]) == 0
    assert all(target.read_text() == KEEP for target in targets)
    assert json.loads((out / "inspect.json").read_text())["step"] == 1
    assert not (out / "inspect.json").is_symlink() and not list(out.glob(".tmp-*"))


def test_convert_eval_writes_its_results_through_no_link(tmp_path):
    from piattn.commands import convert_eval

    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    targets = {name: outside / name for name in ("r.json", "r.md", "fig.png")}
    for name, target in targets.items():
        target.write_text(KEEP)
        (out / name).symlink_to(target)

    def plot(results, path):
        from matplotlib.figure import Figure

        return safe_files.save_figure(Figure(), path)

    assert convert_eval._report({"configs": {}}, out / "r.json", "| table |", plot, "fig.png") == 0
    assert all(target.read_text() == KEEP for target in targets.values())
    assert json.loads((out / "r.json").read_text()) == {"configs": {}} and (out / "r.md").read_text() == "| table |"


def test_convert_eval_refuses_an_existing_file_as_out(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code = main(["convert-eval", "--out", str(tmp_path / "file"), "--data", "books:" + str(tmp_path)])
    assert code == 2 and "is a file, not a folder" in capsys.readouterr().err


# --- N3: eval ---

def test_eval_does_not_follow_a_link_put_at_run_eval_while_it_scores(run, monkeypatch, capsys):
    elsewhere = run.parent / "outside"
    (run / "eval").mkdir()

    def score_and_swap(args, ctx, folder, data, other):
        # what another user can do to their run folder between eval's check and its write
        (run / "eval").rmdir()
        (run / "eval").symlink_to(elsewhere, target_is_directory=True)
        return RESULT

    monkeypatch.setattr(eval_command, "evaluate_checkpoint", score_and_swap)
    code = main(["eval", "--checkpoint", str(run), "--use-stored-data", "--device", "cpu", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and f"{run / 'eval'} is a symbolic link" in err and "the JSON above" in err
    assert json.loads(out)["loss"] == 1.0  # the result is not lost
    assert list(elsewhere.iterdir()) == []


def test_eval_warns_once_about_a_run_folder_of_another_user(run, monkeypatch, capsys):
    monkeypatch.setattr(eval_command, "evaluate_checkpoint", lambda *a: RESULT)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(run).st_uid + 1)
    assert main(["eval", "--checkpoint", str(run), "--use-stored-data", "--device", "cpu"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(run) in warnings[0] and "belongs to" in warnings[0]


def test_resume_warns_about_a_run_folder_of_another_user(run, monkeypatch, capsys):
    """Resuming someone else's run folder says whose it is (its checkpoint and settings are theirs); a fresh
    run of one's own does not."""
    monkeypatch.setattr(safe_files, "foreign_owner", lambda folder: "mallory" if Path(folder) == run else None)
    assert main(["train", "--resume", "--out", str(run), "--steps", "2"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "belongs to" in line]
    assert warnings == [f"piattn train: warning: the run folder {run} belongs to mallory, not to you; the "
                        "checkpoint and settings it resumes from are theirs"]


# --- the helpers ---

def test_atomic_write_replaces_a_link_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text(KEEP)
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / "file.txt"
    link.symlink_to(target)
    safe_files.atomic_write_text(link, "new")
    assert target.read_text() == KEEP and not link.is_symlink() and link.read_text() == "new"
    assert os.listdir(tmp_path / "run") == ["file.txt"]


def test_a_failed_atomic_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    file = tmp_path / "file.txt"
    file.write_text("old")
    with pytest.raises(RuntimeError), safe_files.atomic_writer(file, "w") as f:
        f.write("half")
        raise RuntimeError("cut")
    assert file.read_text() == "old" and os.listdir(tmp_path) == ["file.txt"]


def test_atomic_save_npy_writes_the_array_through_no_link(tmp_path):
    target = tmp_path / "victim.npy"
    target.write_text(KEEP)
    (tmp_path / "a.npy").symlink_to(target)
    safe_files.atomic_save_npy(tmp_path / "a.npy", np.arange(5))
    assert target.read_text() == KEEP and np.load(tmp_path / "a.npy").tolist() == [0, 1, 2, 3, 4]


def test_open_dir_refuses_a_link_unless_asked_to_follow(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(OSError, match="is a symbolic link"):
        safe_files.open_dir(tmp_path / "link")
    os.close(safe_files.open_dir(tmp_path / "link", follow_links=True))


def test_create_new_and_open_append_never_follow_a_link(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text(KEEP)
    (tmp_path / "link").symlink_to(target)
    fd = safe_files.open_dir(tmp_path)
    try:
        with pytest.raises(FileExistsError):
            safe_files.create_new("link", fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="is a symbolic link"):
        safe_files.open_append(tmp_path / "link")
    with safe_files.open_append(tmp_path / "log") as f:
        f.write("a\n")
    with safe_files.open_append(tmp_path / "log") as f:
        f.write("b\n")
    assert (tmp_path / "log").read_text() == "a\nb\n" and target.read_text() == KEEP


def test_foreign_owner_names_another_user_only(tmp_path, monkeypatch):
    assert safe_files.foreign_owner(tmp_path) is None
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    assert safe_files.foreign_owner(tmp_path)
