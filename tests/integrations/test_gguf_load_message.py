"""load_gguf_model says what it is doing before transformers' silent minute (tokenizer, de-quantization)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from piattn.integrations.hf import load_gguf_model  # noqa: E402


class _Stop(Exception):
    pass


def test_the_load_is_announced_before_it_starts(tmp_path, monkeypatch, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(16))

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stop)
    with pytest.raises(_Stop):
        load_gguf_model(path)
    assert "piattn: loading model.gguf (tokenizer, then weights de-quantized" in capsys.readouterr().err
