"""What the commands tell the user: --help with every default and choice, --version, --threads, the settings
at the start of training, a warning for --warmup >= --steps, a short summary at the end and the metrics.png
figure. Each test failed before its fix."""

from __future__ import annotations

import json
import re

import pytest
import torch

from piattn.cli import main
from piattn.commands.common import torch_threads
from piattn.commands.train import summary_json
from piattn.train.metrics import plot_metrics, read_metrics


def help_of(command: str, capsys) -> dict[str, str]:
    """{option: its help text, whitespace collapsed} from `piattn COMMAND --help`."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    options = {}
    for block in re.split(r"\n(?=  -)", text.split("\noptions:", 1)[1]):
        words = " ".join(block.split("\n\n")[0].split())  # a blank line ends the group: its title is not help
        if words:
            options[words.split()[0].rstrip(",")] = words
    return options


def test_train_help_shows_the_choices_and_every_default(capsys):
    options = help_of("train", capsys)
    assert options["--attention"].startswith(
        "--attention {bigbird,dense,local,longformer,neighbourhood,pi,reformer,strided}")
    assert options["--tokenizer"].startswith("--tokenizer {bpe,byte,char}")
    assert options["--config"].startswith("--config {tiny,small,medium,large}")
    assert options["--variant"].startswith("--variant {union,separate,fixed,adaptive}")
    assert options["--backend"].startswith("--backend {")
    for flag, default in (("--tokenizer", "byte"), ("--batch-size", "8"), ("--steps", "2000"), ("--lr", "0.0003"),
                          ("--warmup", "100"), ("--eval-every", "500"), ("--config", "tiny"), ("--attention", "pi"),
                          ("--task", "lm"), ("--progress", "on")):
        assert f"(default: {default})" in options[flag], options[flag]
    assert "extending a run" in options["--steps"] and "may change" in options["--resume"]
    assert "578 s" in options["--threads"]
    # every flag says its default, or is one that is off unless given, or is required
    store_true = {"--cross-documents", "--pack-documents", "--resume", "--fsdp", "--nope-global", "-h"}
    silent = [flag for flag, text in options.items()
              if flag not in store_true and "default" not in text and "required" not in text and flag != "--out"]
    assert silent == []


@pytest.mark.parametrize("command", ["generate", "inspect", "demo", "eval"])
def test_the_other_commands_show_their_defaults(capsys, command):
    options = help_of(command, capsys)
    expected = {"generate": {"--max-new-tokens": "200", "--temperature": "1.0", "--device": "cpu"},
                "inspect": {"--batches": "4", "--flow-window": "64"},
                "demo": {"--reach-steps": "300", "--lags": "3 4 5 8"},
                "eval": {"--split": "test", "--device": "auto"}}[command]
    for flag, default in expected.items():
        assert re.search(rf"default:? {re.escape(default)}[;)]", options[flag]), options[flag]
    if command != "eval":  # eval.py is another engineer's: it calls add_threads_argument when it takes --threads
        assert "--threads" in options


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == "piattn 0.1.0"


def reach_argv(out, *extra):
    return ["train", "--task", "reach", "--lag", "4", "--window", "2", "--n-layer", "2", "--d-model", "16",
            "--n-head", "2", "--seq-len", "16", "--train-size", "32", "--eval-size", "8", "--batch-size", "4",
            "--steps", "3", "--warmup", "1", "--eval-every", "3", "--eval-batches", "1", "--log-every", "1",
            "--device", "cpu", "--no-progress", "--out", str(out), *extra]


def test_train_prints_its_settings_warns_of_warmup_and_summarises_the_gates_briefly(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(reach_argv(out, "--attention", "pi", "--period", "4", "--warmup", "3")) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "  model  --config tiny, --attention pi, --window 2, --period 4, --variant adaptive, --n-layer 2" in err
    assert "--tokenizer" not in err  # a flag the reach task ignores is not shown
    assert re.search(r"optim +--batch-size 4, .*--steps 3, .*--warmup 3", " ".join(err.split()))
    assert "warning: --warmup 3 >= --steps 3" in err
    summary = json.loads((out / "summary.json").read_text())  # every number, in the run folder
    assert not any(k.startswith("alpha/") for k in summary["train"])
    alpha = summary["train"]["alpha"]
    assert alpha["layers"] == 2 and set(alpha) == {"layers", "mean", "q05", "q50", "q95"}
    # stdout: a summary for a person, not a JSON dump
    lines = captured.out.strip().splitlines()
    assert len(lines) <= 10 and not captured.out.lstrip().startswith("{")
    assert lines[0] == f"piattn train: done at step 3, run folder {out}"
    means = ", ".join(f"{a:.2f}" for a in alpha["mean"])
    assert re.fullmatch(rf"  training \(last logged step\): loss \d+\.\d{{4}}; [\d,]+ tokens/s; gate α mean by "
                        rf"layer {means}", lines[1]), lines[1]
    assert lines[2] == "  validation:" and lines[3].startswith("    accuracy  ")
    assert f"  checkpoint  {summary['checkpoint']}" in lines
    assert lines[-1] == f"  all numbers in {out / 'summary.json'}, every logged step in {out / 'metrics.jsonl'}"
    record = [r for r in read_metrics(out) if r["split"] == "train"][-1]
    assert alpha["mean"] == [round(record[f"alpha/layer{i}/mean"], 3) for i in (0, 1)]
    assert len(record["alpha/layer1/head_mean"]) == 2  # metrics.jsonl keeps every statistic


def test_summary_json_keeps_lists_on_one_line():
    text = summary_json({"train": {"loss": 1.0, "alpha/layer0/mean": 0.5, "alpha/layer0/q05": 0.25,
                                   "alpha/layer0/q50": 0.5, "alpha/layer0/q95": 0.75,
                                   "alpha/layer0/head_mean": [0.5, 0.5]}, "step": 3})
    assert json.loads(text) == {"train": {"loss": 1.0, "alpha": {"layers": 1, "mean": [0.5], "q05": [0.25],
                                                                   "q50": [0.5], "q95": [0.75]}}, "step": 3}
    assert '"mean": [0.5]' in text


def test_train_draws_metrics_png(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(reach_argv(out, "--attention", "local")) == 0
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"curves in {out / 'metrics.png'}" in capsys.readouterr().err
    (out / "metrics.png").unlink()
    assert plot_metrics(out) == out / "metrics.png" and (out / "metrics.png").stat().st_size > 1000
    assert plot_metrics(tmp_path / "nothing-here") is None


def test_threads_default_to_one_on_the_cpu_and_follow_the_flag(tmp_path, capsys):
    before = torch.get_num_threads()
    assert main(reach_argv(tmp_path / "a", "--attention", "local")) == 0
    assert "1 × cpu (1 CPU thread)" in capsys.readouterr().err
    assert main(reach_argv(tmp_path / "b", "--attention", "local", "--threads", "2")) == 0
    assert "1 × cpu (2 CPU threads)" in capsys.readouterr().err
    assert torch.get_num_threads() == before  # put back for whatever runs next in this process


@pytest.mark.parametrize("command", [["train", "--out", "unused"], ["generate", "--checkpoint", "x", "--prompt", "a"],
                                     ["inspect", "--checkpoint", "x", "--out", "unused"], ["demo"]])
def test_threads_below_one_is_one_line(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"piattn {command[0]}: error: --threads must be >= 1, got 0"]


def test_torch_threads_sets_and_restores():
    before = torch.get_num_threads()
    with torch_threads(None, "cpu") as n:
        assert n == torch.get_num_threads() == 1
    with torch_threads(3, "cuda") as n:
        assert n == 3
    assert torch.get_num_threads() == before


def test_train_and_eval_draw_one_progress_bar_style(tmp_path):
    """Both bars are `piattn.progress.progress_bar`: tqdm, named by what it counts, with its rate and time left."""
    import io

    from piattn.commands.eval import Progress
    from piattn.progress import progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    with Progress(3, stream=stream) as progress:
        for _ in range(3):
            progress.step()
    assert re.search(r"eval: 100%\|.*\| 3/3 \[\d\d:\d\d<\d\d:\d\d, .*batch/s\]", stream.getvalue()), stream.getvalue()
    piped = io.StringIO()  # eval draws only on a terminal
    with Progress(3, stream=piped) as progress:
        progress.step()
    assert piped.getvalue() == ""
    train = Terminal()
    bar = progress_bar(4, desc="train", unit="step", initial=1, file=train)
    bar.update(3)
    bar.close()
    assert re.search(r"train: 100%\|.*\| 4/4 \[.*step/s\]", train.getvalue()), train.getvalue()
