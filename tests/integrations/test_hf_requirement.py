"""piattn.integrations.hf refuses a transformers older than the one whose `cache` argument it documents
(before 5.24 a `cache=PiCache(...)` would not reach the attention modules), with the installed version and the
fix in one line."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from piattn.integrations.hf import MIN_TRANSFORMERS, check_transformers  # noqa: E402


@pytest.mark.parametrize("version", ["5.24.0", "5.24.0.dev0", "5.30.1", "6.0.0", "10.1"])
def test_a_recent_transformers_is_accepted(version):
    check_transformers(version)


@pytest.mark.parametrize("version", ["5.23.1", "4.57.0", "5.9.0", "not-a-version"])
def test_an_older_transformers_is_refused_with_the_fix(version):
    with pytest.raises(ImportError, match=rf"transformers >= 5\.24 \(installed: {version}\); pip install -U"):
        check_transformers(version)


def test_the_requirement_is_the_one_pyproject_declares():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    need = ".".join(map(str, MIN_TRANSFORMERS))
    assert text.count(f'"transformers>={need}"') == 3 and "transformers>=5.23" not in text
