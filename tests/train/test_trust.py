"""Defects found by trying to break the trainer and the commands: each test failed before its fix.

Everything goes through `piattn.cli.main`, as a user would: a wrong or damaged input must give exit code 2
and one line naming the file or flag, never a traceback, and nothing may be lost or silently wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from piattn.cli import main
from piattn.train.metrics import read_metrics
from utils import write_word_corpus

STEPS = 4


def write_corpus(root):
    return write_word_corpus(root, {"train": [150, 250, 350], "validation": [150], "test": [150, 250]})


def train_argv(corpus, out, *extra):
    return ["train", "--data", str(corpus), "--out", str(out), "--attention", "pi", "--n-layer", "2",
            "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "2", "--steps", str(STEPS),
            "--warmup", "1", "--dropout", "0.1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2",
            "--log-every", "1", "--device", "cpu", "--no-progress", *extra]


def one_error_line(capsys, command: str) -> str:
    """The single stderr line of a refused command (no traceback before or after it)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"piattn {command}: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    """A corpus and a finished 4-step run on it (checkpoints at steps 2 and 4); copy before changing it."""
    root = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(root / "corpus")
    assert main(train_argv(corpus, root / "run")) == 0
    return corpus, root / "run"


def copy_run(trained, tmp_path):
    corpus, run = trained
    shutil.copytree(run, tmp_path / "run")
    return corpus, tmp_path / "run"


def interrupt_inside_optimizer_step(monkeypatch, at_call: int):
    """Deliver SIGINT (Ctrl-C) just after the `at_call`-th AdamW update wrote the weights, before the loop
    has recorded that step: the worst moment for a save."""
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == at_call:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def run_interrupted(argv, monkeypatch, at_call: int) -> int | None:
    interrupt_inside_optimizer_step(monkeypatch, at_call)
    try:
        return main(argv)
    except KeyboardInterrupt:
        return None
    finally:
        monkeypatch.undo()


def weights(run):
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / latest / "model.safetensors")


def test_ctrl_c_inside_an_optimizer_step_saves_a_step_boundary_and_resumes_bit_for_bit(trained, tmp_path, monkeypatch,
                                                                                      capsys):
    corpus, straight = trained
    run = tmp_path / "run"
    run_interrupted(train_argv(corpus, run, "--save-every", "0"), monkeypatch, at_call=3)
    assert "saved step 3" in capsys.readouterr().err
    assert main(train_argv(corpus, run, "--save-every", "0", "--resume")) == 0
    train = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run) if r["split"] == "train"]
    assert train == [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(straight) if r["split"] == "train"]
    a, b = weights(run), weights(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ctrl_c_prints_one_line_and_no_traceback(trained, tmp_path, monkeypatch, capsys):
    corpus, _ = trained
    assert run_interrupted(train_argv(corpus, tmp_path / "run"), monkeypatch, at_call=1) == 130
    err = capsys.readouterr().err
    assert "saved step 1" in err and "interrupted" in err and "Traceback" not in err


def test_resume_after_keep_rotated_away_the_checkpoint_it_started_from(trained, tmp_path, monkeypatch):
    corpus, straight = trained
    run = tmp_path / "run"
    argv = train_argv(corpus, run, "--save-every", "1", "--keep", "1")
    run_interrupted(argv, monkeypatch, at_call=2)
    # Resumed from step 2, which --keep 1 deletes once step 3 is saved; the evaluation at step 4 still runs.
    assert main([*argv, "--resume"]) == 0
    assert [r["step"] for r in read_metrics(run) if r["split"] == "validation"] == [2, 4]


def test_a_corpus_edited_in_place_is_tokenized_again(trained, tmp_path, capsys):
    corpus, run = trained
    corpus = shutil.copytree(corpus, tmp_path / "corpus")
    shutil.copytree(run, tmp_path / "run")
    run = tmp_path / "run"
    evaluate = ["eval", "--json", "--checkpoint", str(run), "--data", str(corpus), "--split", "test", "--cache-dir",
                str(tmp_path / "cache")]
    assert main(evaluate) == 0
    before = json.loads(capsys.readouterr().out)
    doc = corpus / "test" / "doc0.txt"
    text = doc.read_text(encoding="utf-8")
    stat = doc.stat()
    doc.write_text(text[::-1], encoding="utf-8")  # same size, same name
    os.utime(doc, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even the same modification time
    assert main(evaluate) == 0
    after = json.loads(capsys.readouterr().out)
    assert main([*evaluate[:-1], str(tmp_path / "fresh-cache")]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert after["loss"] == fresh["loss"] != before["loss"]


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_config(change):
    def edit(checkpoint):
        config = json.loads((checkpoint / "config.json").read_text())
        change(config)
        (checkpoint / "config.json").write_text(json.dumps(config))

    return edit


BREAKERS = {
    "truncated weights": (lambda c: _truncate(c / "model.safetensors"), "model.safetensors"),
    "config not JSON": (lambda c: (c / "config.json").write_text("{not json"), "config.json"),
    "config missing": (lambda c: (c / "config.json").unlink(), "config.json"),
    "unknown model key": (_edit_config(lambda cfg: cfg["model"].update(colour="red")), "colour"),
    "unknown training key": (_edit_config(lambda cfg: cfg["train_args"].update(colour="red")), "colour"),
    "another width": (_edit_config(lambda cfg: cfg["model"].update(d_model=48)), "model.safetensors"),
    "tokenizer gone": (lambda c: shutil.rmtree(c / "tokenizer"), "tokenizer"),
    "tokenizer corrupt": (lambda c: (c / "tokenizer" / "tokenizer.json").write_text("]["), "tokenizer"),
}


@pytest.mark.parametrize("breaker", list(BREAKERS))
def test_eval_of_a_damaged_checkpoint_is_one_line_naming_the_file(trained, tmp_path, capsys, breaker):
    _, run = copy_run(trained, tmp_path)
    damage, named = BREAKERS[breaker]
    damage(run / "checkpoints" / "step_00000004")
    assert main(["eval", "--checkpoint", str(run), "--use-stored-data", "--device", "cpu"]) == 2
    assert named in one_error_line(capsys, "eval")


@pytest.mark.parametrize("pointer", ["step_00000009", "../../elsewhere", "garbage\n\n"])
def test_a_latest_pointer_to_nothing_is_one_line(trained, tmp_path, capsys, pointer):
    corpus, run = copy_run(trained, tmp_path)
    (run / "checkpoints" / "latest").write_text(pointer)
    assert main(["eval", "--checkpoint", str(run)]) == 2
    assert "latest" in one_error_line(capsys, "eval")
    assert main([*train_argv(corpus, run), "--resume"]) == 2
    assert "latest" in one_error_line(capsys, "train")


def test_resume_from_a_truncated_trainer_state_is_one_line(trained, tmp_path, capsys):
    corpus, run = copy_run(trained, tmp_path)
    _truncate(run / "checkpoints" / "step_00000004" / "trainer_state.pt")
    assert main([*train_argv(corpus, run), "--resume"]) == 2
    assert "trainer_state.pt" in one_error_line(capsys, "train")


def test_a_metrics_line_cut_by_a_crash_does_not_block_resume(trained, tmp_path, monkeypatch):
    corpus, run = trained[0], tmp_path / "run"
    argv = train_argv(corpus, run, "--save-every", "1")
    run_interrupted(argv, monkeypatch, at_call=2)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tra')  # a crash in the middle of writing a line
    assert main([*argv, "--resume"]) == 0
    assert [r["step"] for r in read_metrics(run) if r["split"] == "train"] == [1, 2, 3, 4]


def test_leftovers_of_a_killed_save_are_removed_at_the_next_start(trained, tmp_path):
    corpus, run = copy_run(trained, tmp_path)
    leftover = run / "checkpoints" / ".tmp-step_00000006-12345"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    assert main([*train_argv(corpus, run), "--resume"]) == 0
    assert not leftover.exists()


@pytest.mark.parametrize("flag", ["--out", "--cache-dir"])
def test_a_file_where_a_folder_is_due_is_one_line(trained, tmp_path, capsys, flag):
    corpus, _ = trained
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = train_argv(corpus, tmp_path / "run")
    for path in (afile, afile / "below"):
        given = [*argv, "--out", str(path)] if flag == "--out" else [*argv, flag, str(path)]
        assert main(given) == 2
        assert flag in one_error_line(capsys, "train")


@pytest.mark.parametrize(("extra", "message"), [
    (["--variant", "union", "--prior", "0.3"], "--prior applies to --variant fixed only"),
    (["--prior", "0.3"], "--prior applies to --variant fixed only"),
    (["--attention", "dense", "--window", "3"], "--window applies to --attention"),
    (["--attention", "dense", "--variant", "fixed"], "--variant applies to --attention pi only"),
    (["--attention", "local", "--period", "8"], "--period applies to --attention pi only"),
])
def test_flags_the_run_would_ignore_are_refused(trained, tmp_path, capsys, extra, message):
    corpus, _ = trained
    argv = [a for a in train_argv(corpus, tmp_path / "run") if a not in ("--attention", "pi")]
    assert main([*argv, *extra]) == 2
    assert message in one_error_line(capsys, "train")
    assert not (tmp_path / "run").exists()


def test_hf_data_without_the_datasets_package_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import datasets -> ImportError
    assert main(train_argv("hf:wikitext", tmp_path / "run")) == 2
    assert "datasets" in one_error_line(capsys, "train")


def test_a_text_file_that_is_not_utf8_is_named(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "train" / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    assert main(train_argv(corpus, tmp_path / "run", "--tokenizer", "char")) == 2
    assert "latin1.txt" in one_error_line(capsys, "train")


@pytest.mark.parametrize(("extra", "flag"), [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--top-k", "0"], "--top-k"), (["--device", "nope"], "--device"), (["--device", "cuda:99"], "--device"),
])
def test_generate_refuses_bad_flags_in_one_line(trained, capsys, extra, flag):
    _, run = trained
    assert main(["generate", "--checkpoint", str(run), "--prompt", "the", "--max-new-tokens", "3", *extra]) == 2
    assert flag in one_error_line(capsys, "generate")


def test_a_checkpoint_cannot_make_eval_write_elsewhere(trained, tmp_path, capsys):
    _, run = copy_run(trained, tmp_path)
    target = tmp_path / "not-yours"
    _edit_config(lambda cfg: cfg["train_args"].update(cache_dir=str(target)))(run / "checkpoints" / "step_00000004")
    assert main(["eval", "--checkpoint", str(run), "--use-stored-data", "--split", "test"]) == 0
    assert not target.exists()
    assert any((run / "cache").iterdir())  # the tokenized split went where the run is
