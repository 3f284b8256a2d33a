"""`piattn eval` against a run folder or checkpoint it did not make: what the folder may not choose.

A checkpoint folder can come from anyone. Its config.json may not pick the data eval reads, its links may not
send eval's files elsewhere, and its config may not make eval allocate a model its weights do not hold.
Also: eval's progress bar, its human summary and its refusal to overwrite an earlier evaluation.
"""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest
import torch

from piattn.cli import main
from piattn.models import GPT, GPTConfig
from piattn.tasks import LanguageModelTask
from piattn.train import checkpoint as ckpt
from utils import write_word_corpus

SEQ = 32
TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--batch-size", "2", "--steps", "1", "--warmup", "1",
        "--eval-every", "0", "--save-every", "0", "--log-every", "1", "--device", "cpu", "--no-progress"]
STEP = "step_00000001"

TINY_GPT = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "d_model": 32}


def build_on(record: list, config: dict):
    """A `build` for check_weight_shapes that records the device each call builds on."""
    def build():
        record.append(torch.empty(0).device.type)
        return GPT(GPTConfig(**config))
    return build


@pytest.mark.parametrize("change", [{"n_layer": 5000}, {"d_model": 4096}, {"vocab_size": 10**9}])
def test_a_config_larger_than_its_weights_is_refused_before_any_memory_is_spent(tmp_path, change):
    ckpt.save_checkpoint(tmp_path, 1, model=GPT(GPTConfig(**TINY_GPT)), trainer_state={}, config={})
    folder = tmp_path / "step_00000001"
    built = []
    with pytest.raises(ValueError, match="model.safetensors: does not match the model its config.json describes"):
        ckpt.check_weight_shapes(folder, build_on(built, {**TINY_GPT, **change}))
    assert built == ["meta"]  # shapes only: 10⁹ × 32 floats would be 128 GB


def test_the_config_a_checkpoint_was_saved_with_passes_and_tied_weights_count_once(tmp_path):
    model = GPT(GPTConfig(**TINY_GPT))
    ckpt.save_checkpoint(tmp_path, 1, model=model, trainer_state={}, config={})
    ckpt.check_weight_shapes(tmp_path / "step_00000001", lambda: GPT(GPTConfig(**TINY_GPT)))


def test_a_config_smaller_than_its_weights_is_refused_too(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, model=GPT(GPTConfig(**TINY_GPT)), trainer_state={}, config={})
    with pytest.raises(ValueError, match=r"unexpected \['blocks.1."):
        ckpt.check_weight_shapes(tmp_path / "step_00000001", lambda: GPT(GPTConfig(**{**TINY_GPT, "n_layer": 1})))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{"lm": a byte-level LM run trained on "corpus", "reach": a run on generated data, "corpus": …}."""
    root = tmp_path_factory.mktemp("eval-trust")
    corpus = write_word_corpus(root / "corpus", {"train": [120], "validation": [40], "test": [60, 90]})
    runs = {"lm": ["--data", str(corpus), "--seq-len", str(SEQ), "--attention", "local", "--window", "3"],
            "reach": ["--task", "reach", "--lag", "3", "--seq-len", "16", "--train-size", "8", "--eval-size", "4"]}
    for name, argv in runs.items():
        assert main(["train", "--out", str(root / name), *argv, *TINY]) == 0
    return {"lm": root / "lm", "reach": root / "reach", "corpus": corpus}


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the LM run, free to damage."""
    return shutil.copytree(trained["lm"], tmp_path / "run", symlinks=True)


def edit_config(run, change) -> None:
    file = run / "checkpoints" / STEP / "config.json"
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))


def evaluate(capsys, *argv) -> tuple[int, dict | None, str]:
    """(exit code, the JSON printed or None, stderr) of `piattn eval --split test --device cpu *argv`."""
    code = main(["eval", "--split", "test", "--device", "cpu", "--json", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("piattn eval: error: "), lines
    return lines[0]


# --- the data is the user's to name ---

def test_the_recorded_source_is_not_read_unless_asked_for(run, trained, tmp_path, capsys):
    secret = shutil.copytree(trained["corpus"], tmp_path / "secret")
    edit_config(run, lambda c: c["train_args"].update(data=str(secret)))
    cached = sorted((run / "cache").iterdir())  # the training split's, tokenized by `piattn train`
    code, _, err = evaluate(capsys, "--checkpoint", str(run))
    line = one_line(err)
    assert code == 2 and "--data is required" in line and repr(str(secret)) in line and "--use-stored-data" in line
    assert sorted((run / "cache").iterdir()) == cached and not (run / "eval").exists()  # nothing read or written

    code, result, _ = evaluate(capsys, "--checkpoint", str(run), "--data", str(trained["corpus"]))
    assert code == 0 and result["data"] == str(trained["corpus"])
    code, result, _ = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data")
    assert code == 0 and result["data"] == str(secret)


@pytest.mark.parametrize("stored", ["hf:some/dataset", "wikitext:/nowhere", "books:/srv/books"])
def test_a_recorded_dataset_name_or_folder_is_refused_before_anything_is_loaded(run, capsys, stored):
    edit_config(run, lambda c: c["train_args"].update(data=stored))
    code, _, err = evaluate(capsys, "--checkpoint", str(run))
    assert code == 2 and repr(stored) in one_line(err)


def test_data_and_use_stored_data_exclude_each_other(run, trained, capsys):
    code, _, err = evaluate(capsys, "--checkpoint", str(run), "--data", str(trained["corpus"]), "--use-stored-data")
    assert code == 2 and "--data and --use-stored-data exclude each other" in one_line(err)


def test_generated_data_needs_no_data_flag(trained, tmp_path, capsys):
    run = shutil.copytree(trained["reach"], tmp_path / "reach")
    code, result, _ = evaluate(capsys, "--checkpoint", str(run))
    assert code == 0 and result["data"] is None and 0 <= result["accuracy"] <= 1


# --- eval writes inside the run folder only ---

@pytest.mark.parametrize(("name", "flag"), [("eval", "--output FILE"), ("cache", "--cache-dir DIR")])
def test_a_linked_eval_or_cache_folder_is_refused(run, trained, tmp_path, capsys, name, flag):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(run / name, ignore_errors=True)
    (run / name).symlink_to(elsewhere, target_is_directory=True)
    code, _, err = evaluate(capsys, "--checkpoint", str(run), "--data", str(trained["corpus"]))
    line = one_line(err)
    assert code == 2 and f"{run / name} is a symbolic link" in line and flag in line
    assert list(elsewhere.iterdir()) == []
    # the flag it names is the way round it
    other = ["--output", str(tmp_path / "e.json")] if name == "eval" else ["--cache-dir", str(tmp_path / "c")]
    code, _, _ = evaluate(capsys, "--checkpoint", str(run), "--data", str(trained["corpus"]), *other)
    assert code == 0 and list(elsewhere.iterdir()) == []


def test_a_link_inside_the_cache_folder_is_refused(run, trained, tmp_path, capsys):
    victim = tmp_path / "victim.npy"
    victim.write_text("keep me")
    (run / "cache").mkdir(exist_ok=True)
    (run / "cache" / "test-0123456789abcdef.docs.npy").symlink_to(victim)
    code, _, err = evaluate(capsys, "--checkpoint", str(run), "--data", str(trained["corpus"]))
    assert code == 2 and "test-0123456789abcdef.docs.npy is a symbolic link" in one_line(err)
    assert victim.read_text() == "keep me"


def test_a_link_at_the_default_file_name_is_not_followed(run, trained, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (run / "eval").mkdir()
    (run / "eval" / f"{STEP}_test.json").symlink_to(victim)
    code, result, err = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data")
    assert code == 0 and victim.read_text() == "keep me"
    assert json.loads((run / "eval" / f"{STEP}_test-2.json").read_text()) == result


# --- an earlier evaluation is kept ---

def test_a_second_evaluation_gets_a_numbered_file(run, capsys):
    argv = ["--checkpoint", str(run), "--use-stored-data"]
    _, first, err = evaluate(capsys, *argv, "--batches", "1")
    assert f"written to {run / 'eval' / f'{STEP}_test.json'}" in err
    _, second, err = evaluate(capsys, *argv)
    assert f"written to {run / 'eval' / f'{STEP}_test-2.json'}" in err
    assert json.loads((run / "eval" / f"{STEP}_test.json").read_text()) == first != second
    _, third, _ = evaluate(capsys, *argv, "--overwrite")
    assert json.loads((run / "eval" / f"{STEP}_test.json").read_text()) == third
    assert sorted(p.name for p in (run / "eval").iterdir()) == [f"{STEP}_test-2.json", f"{STEP}_test.json"]


def test_an_existing_output_file_needs_overwrite(run, tmp_path, capsys):
    output = tmp_path / "e.json"
    output.write_text("earlier")
    argv = ["--checkpoint", str(run), "--use-stored-data", "--output", str(output)]
    code, _, err = evaluate(capsys, *argv)
    assert code == 2 and "--output" in one_line(err) and "--overwrite" in err and output.read_text() == "earlier"
    code, result, _ = evaluate(capsys, *argv, "--overwrite")
    assert code == 0 and json.loads(output.read_text()) == result


# --- a config that asks for more than its weights ---

def test_an_edited_config_is_refused_before_the_model_is_built(run, capsys, monkeypatch):
    edit_config(run, lambda c: c["model"].update(n_layer=5000))
    devices = []
    build = LanguageModelTask.build_model

    def spy(self):
        devices.append(torch.empty(0).device.type)
        return build(self)

    monkeypatch.setattr(LanguageModelTask, "build_model", spy)
    code, _, err = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data")
    assert code == 2 and "model.safetensors: does not match the model its config.json describes" in one_line(err)
    assert devices == ["meta"]


def test_generate_refuses_an_edited_config_before_building(run, capsys):
    """`piattn generate` loads a language model through `tasks.lm.load_language_model`, which built whatever
    config.json asked for before reading the weights."""
    from piattn.cli import main

    edit_config(run, lambda c: c["model"].update(n_layer=5000))
    assert main(["generate", "--checkpoint", str(run), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("piattn generate: error: ") and err.count("\n") == 1
    assert "does not match the model its config.json describes" in err


# --- what a person reads ---

class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_progress_bar_and_a_pipe_does_not(run, capsys, monkeypatch):
    code, result, err = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data")
    windows = result["tokens"] // SEQ  # 2 windows per batch: ceil(windows / 2) batches
    assert "\r" not in err and "batches" not in err
    lines = err.strip().splitlines()  # --json: the summary and the file's name go to stderr
    assert lines[0].startswith(f"lm, step 1 of {result['checkpoint']}: test split of {result['data']}, "
                               f"{result['tokens']:,} tokens, ")
    assert lines[1].split() == ["loss", f"{result['loss']:.4f}", "nats/token"]
    assert lines[3].split()[:2] == ["bits/byte", f"{result['bpb']:.4f}"]
    assert lines[-1].startswith("full JSON written to ") and len(lines) == 6

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["eval", "--split", "test", "--device", "cpu", "--checkpoint", str(run), "--use-stored-data"]) == 0
    draws = terminal.getvalue().split("\r")
    total = -(-windows // 2)
    # the bar of `piattn train` too (`piattn.progress`): "eval: 100%|…| 10/10 [00:00<00:00, 7.9batch/s]"
    assert re.match(rf"eval: 100%\|.*\| {total}/{total} \[.*batch/s\]", draws[-1].splitlines()[0]), draws[-1]
    assert all(f"/{total} [" in d for d in draws[1:] if d.strip())


def test_position_bins_and_compare_print_a_table(run, trained, capsys):
    _, result, err = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data", "--position-bins", "2")
    lines = err.splitlines()
    table = next(i for i, line in enumerate(lines) if line.split()[:1] == ["positions"])
    assert lines[table].split() == ["positions", "tokens", "loss", "(nats/token)"]
    assert lines[table + 1].split() == ["0–15", f"{result['position_bins'][0]['tokens']:,}",
                                f"{result['position_bins'][0]['loss']:.4f}"]
    _, result, err = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data", "--compare", str(trained["lm"]),
                              "--position-bins", "2", "--overwrite")
    rows = [line.split() for line in err.splitlines() if line.strip().startswith(("0–", "16–", "all"))]
    assert [r[0] for r in rows] == ["0–15", "16–31", "all"]
    assert rows[-1][1:] == [f"{result['loss']:.4f}", "+0.0000", "[+0.0000,", "+0.0000]"]  # A against itself


@pytest.mark.parametrize(("flag", "message"), [("--output", "--output must name a file, got ''"),
                                               ("--cache-dir", "--cache-dir must name a folder, got ''")])
def test_an_empty_output_or_cache_dir_is_refused_not_taken_for_a_default(run, capsys, flag, message):
    code, _, err = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data", flag, "")
    assert code == 2 and message in one_line(err) and not (run / "eval").exists()


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="as root os.access says /proc is writable")
def test_an_output_where_nothing_can_be_created_is_refused_before_scoring(run, capsys):
    code, _, err = evaluate(capsys, "--checkpoint", str(run), "--use-stored-data", "--output", "/proc/e.json")
    assert code == 2 and "--output /proc/e.json: cannot create anything in /proc" in one_line(err)


def test_the_data_given_replaces_a_recorded_source_that_is_not_even_valid(tmp_path, capsys):
    """Only --data is used: a vision-language checkpoint whose config records a broken source scores fine."""
    out = tmp_path / "vl"
    assert main(["train", "--task", "vl-retrieval", "--out", str(out), "--steps", "1", "--eval-every", "0",
                 "--train-size", "8", "--eval-size", "6", "--batch-size", "4", "--n-layer", "1", "--d-model", "16",
                 "--n-head", "2", "--caption-len", "24", "--warmup", "1", "--device", "cpu", "--no-progress"]) == 0
    edit_config(out, lambda c: c["train_args"].update(data="coco:"))
    capsys.readouterr()
    code, result, err = evaluate(capsys, "--checkpoint", str(out), "--data", "shapes")
    assert code == 0, err
    assert result["images"] == 6 and "Recall@1/5/10 image→text" in err
