"""The `piattn` command's start-up: cheap (`import piattn` does not import torch), `--version`, and Ctrl-C
while the command's modules are still loading."""

from __future__ import annotations

import subprocess
import sys

import pytest

from piattn import cli


def test_import_does_not_load_torch():
    """`piattn --help` / `--version` should not pay for torch; the public names still resolve, and resolving
    them does not import Dynamo (1.3 s more; `backends.constant_under_compile`)."""
    code = ("import sys, piattn; assert 'torch' not in sys.modules, 'torch imported'; "
            "print(piattn.pi_attention.__name__, piattn.PiAttention.__name__, sorted(piattn.BACKENDS)[0]); "
            "import piattn.models; assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[:2] == ["pi_attention", "PiAttention"]


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"piattn {cli.__version__}"


def test_ctrl_c_while_loading_is_one_line(monkeypatch, capsys):
    """A KeyboardInterrupt while a command's module is imported (torch takes seconds) was a traceback."""
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["train", "--steps", "1"]) == 130
    assert capsys.readouterr().err == "piattn train: interrupted\n"
