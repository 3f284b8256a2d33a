"""experiments/passkey_decode.py on a tiny random Llama (no GGUF model needed): every arm × position measured,
the π arms' ring caches their exact size and smaller than dense's growing one, positions capped below the
model's max_position_embeddings, and the table and JSON written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from byte_llama import ByteTokenizer, tiny_llama  # noqa: E402

from piattn.data.text import BOOK_SPLITS  # noqa: E402
from utils import load_script  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "passkey_decode.py"
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8  # byte_llama.tiny_llama
PATTERN = ["--window", "8", "--period", "16", "--context", "64", "--sinks", "2"]  # passkey.py's options


@pytest.fixture(scope="module")
def experiment():
    return load_script(SCRIPT, "passkey_decode_experiment")


def kv_bytes(positions: int, layers: int = LAYERS) -> int:
    """fp32 keys and values of `positions` positions in `layers` layers of the tiny model."""
    return 2 * layers * KV_HEADS * HEAD_DIM * positions * 4


def test_every_arm_and_position_is_measured_with_its_own_cache(experiment, one_thread):
    models = experiment.build_arms(tiny_llama(max_positions=512), experiment.passkey.parse_args(PATTERN))
    assert list(models) == ["dense", "local", "pi", "multiscale"]
    assert models["pi"].config.pi_attention["period"] == 16
    ids = torch.randint(0, 100, (300,), generator=torch.Generator().manual_seed(0))
    prompts = {32: ids[:32], 300: ids}
    rows = experiment.measure(models, prompts, steps=5, repeats=2, progress=False)
    by = {(r["position"], r["arm"]): r for r in rows}
    assert set(by) == {(p, a) for p in (32, 300) for a in models}
    for r in rows:
        assert len(r["repeats_tokens_per_s"]) == 2 and all(t > 0 for t in r["repeats_tokens_per_s"])
        assert r["tokens_per_s"] > 0 and r["prompt_tokens"] == r["position"]
    # dense grows with the prompt; each π arm keeps its ring (largest period + 1) and 2 sinks at any length
    assert by[(300, "dense")]["cache_bytes"] == kv_bytes(300) and by[(32, "dense")]["cache_bytes"] == kv_bytes(32)
    assert by[(300, "dense")]["ring_positions"] is None
    # local: period at its window 8 (ring W + 1); π: 16; multi-scale: the design's periods, largest 12 and 52
    rings = {"local": [9, 9], "pi": [17, 17], "multiscale": [13, 53]}
    for arm, sizes in rings.items():
        assert by[(300, arm)]["ring_positions"] == sizes
        assert by[(300, arm)]["cache_bytes"] == sum(kv_bytes(n + 2, layers=1) for n in sizes)
        assert by[(300, arm)]["cache_bytes"] < by[(300, "dense")]["cache_bytes"]
    assert by[(300, "pi")]["cache_bytes"] == by[(32, "pi")]["cache_bytes"]  # its ring is full already at 32
    pairs = {(q["position"], q["pair"]): q for q in experiment.ratios(rows)}
    assert set(pairs) == {(p, q) for p in (32, 300) for q in ("pi/dense", "pi/local", "multiscale/local")}
    q = pairs[(300, "pi/dense")]
    assert q["repeats"] == pytest.approx([a / b for a, b in zip(by[(300, "pi")]["repeats_tokens_per_s"],
                                                                by[(300, "dense")]["repeats_tokens_per_s"],
                                                                strict=True)])



def test_a_batch_decodes_together_and_counts_bytes_per_sequence(experiment, one_thread):
    models = experiment.build_arms(tiny_llama(max_positions=512), experiment.passkey.parse_args(PATTERN))
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(1))
    one, three = (experiment.measure(models, {40: ids}, steps=2, repeats=1, batch=b, progress=False) for b in (1, 3))
    bytes_of = {b: {r["arm"]: r["cache_bytes"] for r in rows} for b, rows in ((1, one), (3, three))}
    assert bytes_of[3] == bytes_of[1]  # per sequence
    assert all(r["tokens_per_s"] > 0 for r in three)
    cache = experiment.new_cache("pi", models["pi"])
    with torch.no_grad():  # what measure prefills: three copies of the prompt, one cache
        models["pi"](ids[None].expand(3, -1), use_cache=True, logits_to_keep=1,
                     **{experiment.cache_argument(models["pi"]): cache})
    assert experiment.cache_nbytes(cache) == 3 * bytes_of[1]["pi"]


def test_prompts_stay_within_the_model_positions(experiment):
    assert experiment.prompt_lengths([2048, 8192], 8192, 32) == {2048: 2048, 8192: 8192 - 32 - experiment.WARMUP}
    assert experiment.prompt_lengths([100], None, 32) == {100: 100}


@pytest.fixture
def books(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 10
    for name in (n for names in BOOK_SPLITS.values() for n in names):
        (folder / name).write_text(f"*** START OF THE PROJECT GUTENBERG EBOOK X ***\n{text}\n"
                                   "*** END OF THE PROJECT GUTENBERG EBOOK X ***\n")
    return folder


def test_main_writes_the_table_and_caps_the_longest_position(experiment, books, tmp_path, monkeypatch, one_thread):
    monkeypatch.setattr(experiment, "load_gguf_model", lambda path: (tiny_llama(max_positions=256), ByteTokenizer()))
    # passkey.py's default pattern (window 64, π 128, context 1024) on a 256-position model
    out = tmp_path / "out" / "passkey_decode"
    assert experiment.main(["--books", str(books), "--positions", "64", "256", "--steps", "3", "--repeats", "2",
                            "--out", str(out), "--no-progress"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["prompt_tokens"] == [64, 256 - 3 - experiment.WARMUP]
    assert {(r["position"], r["arm"]) for r in result["rows"]} == {(p, a) for p in (64, 256)
                                                                  for a in ("dense", "local", "pi", "multiscale")}
    table = out.with_suffix(".md").read_text()
    assert "| 256 | 250 | π + sinks |" in table and "256 measured with a prompt of 250 tokens" in table
    assert "pi/dense tok/s" in table and "multiscale/local bytes" in table


def test_main_refuses_without_the_books(experiment, tmp_path):
    with pytest.raises(SystemExit, match="lacks"):
        experiment.main(["--books", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
