"""benchmarks/decode_profile.py: where a decoding step's time goes, end to end on a few steps (no timing is
asserted): the module view leaves π on its lean compiled path and its hooks behind it, every kind and batch
gets a row, a machine without perf gets the module view and says so, perf's libraries are classed by name,
and bad arguments are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from piattn.ops.pi import decode_native, native
from utils import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_profile.py"


@pytest.fixture(scope="module")
def profile():
    return load_script(SCRIPT, "decode_profile")


def test_the_module_view_keeps_pi_on_the_compiled_step_and_removes_its_hooks(profile):
    if native.unavailable():
        pytest.skip(f"the compiled decoding step is not available here: {native.unavailable()}")
    model = profile.decode_model("pi", "tiny")
    steps, ran = 4, []
    real = decode_native.run

    def counted(plan, x, kv, slot, valid, gate, gate_layers, **kwargs):
        # each layer's one-token step: did the compiled step take it, gate and all (its whole MLP: PRIOR_INPUT)?
        y = real(plan, x, kv, slot, valid, gate, gate_layers, **kwargs)
        ran.append(y is not None and kwargs.get("fresh_slot") is not None and len(gate_layers or ()) == 4)
        return y

    with mock.patch.object(decode_native, "run", counted):
        parts = profile.by_module(model, 40, 2, steps)
    calls = len(ran)
    assert all(ran)
    n_layer = len(model.blocks)
    assert calls == (3 + steps) * n_layer  # warm-up and timed steps, one compiled call per layer each
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert set(parts) == {"step", *profile.PARTS.values(), profile.BETWEEN}
    assert parts["step"] > parts["attention layer"] > 0 and parts["feed-forward MLP"] > 0


def test_every_kind_and_batch_gets_a_row_and_no_perf_is_said(profile, tmp_path):
    with mock.patch.object(profile.shutil, "which", return_value=None):
        result = profile.main(["--kinds", "pi", "local", "--batch", "1", "2", "--position", "20", "--steps", "2",
                               "--repeats", "2", "--out", str(tmp_path), "--name", "p"])
    assert [(r["kind"], r["batch"]) for r in result["rows"]] == [("pi", 1), ("pi", 2), ("local", 1), ("local", 2)]
    assert all(r["library"] is None for r in result["rows"])
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == result["rows"]
    table = (tmp_path / "p.md").read_text()
    assert "| local | 2 |" in table and "By library: not measured" in table


@pytest.mark.parametrize("dso, library", [("libpython3.11.so.1.0", "Python interpreter"),
                                          ("python3.11", "Python interpreter"),
                                          ("libtorch_python.so", "torch bindings"),
                                          ("libtorch_cpu.so", "torch C++ (kernels, dispatcher)"),
                                          ("decode_step-42d24407ed647cfa.so", "compiled step"),
                                          ("libc.so.6", "libc / libm"), ("[kernel.kallsyms]", "OS kernel"),
                                          ("libfoo.so", "other")])
def test_perf_libraries_are_classed_by_name(profile, dso, library):
    assert profile.library_of(dso) == library


@pytest.mark.parametrize("args, named", [(["--steps", "0"], "--steps"), (["--batch", "0"], "--batch"),
                                         (["--seconds", "0"], "--seconds")])
def test_bad_arguments_are_refused_by_name(profile, tmp_path, capsys, args, named):
    with pytest.raises(SystemExit):
        profile.main([*args, "--out", str(tmp_path)])
    assert named in capsys.readouterr().err


@pytest.mark.slow  # seconds of perf sampling a model; classing the samples by library is checked below
def test_perf_samples_land_in_the_libraries(profile):
    """Where perf can sample here: half a second of π's steps, its samples split over the libraries (the shares
    add up to the whole, and the interpreter and the compiled step each took some)."""
    if profile.shutil.which("perf") is None or native.unavailable():
        pytest.skip(f"no perf here, or no compiled step: {native.unavailable()}")
    shares = profile.by_library("pi", 40, 1, 0.5, "tiny")
    if shares is None:
        pytest.skip("perf may not sample here")
    assert 99.0 <= sum(shares.values()) <= 100.5, shares
    assert shares.get("Python interpreter", 0) > 0 and shares.get("compiled step", 0) > 0, shares
