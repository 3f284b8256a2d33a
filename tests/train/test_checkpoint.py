"""Checkpoints: atomic writes, the `latest` pointer, keeping the newest N, tied weights, random states."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from piattn.models import GPT, GPTConfig
from piattn.train import checkpoint as ckpt


def tiny_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("tiny", n_layer=2, d_model=32, n_head=2, vocab_size=64, block_size=64))


def save(root, step, model, keep=3):
    return ckpt.save_checkpoint(root, step, model=model, trainer_state={"step": step}, config={"step": step},
                                save_assets=lambda d: (d / "asset.txt").write_text("tok"), keep=keep)


def assert_same_weights(a: GPT, b: GPT):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_save_and_load_roundtrip_with_tied_weights(tmp_path):
    model = tiny_gpt(0)
    folder = save(tmp_path, 5, model)
    assert folder.name == "step_00000005" and ckpt.read_latest(tmp_path) == folder
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "trainer_state.pt", "config.json",
                                                    "asset.txt"}
    loaded = tiny_gpt(1)
    ckpt.load_weights(loaded, folder)
    assert_same_weights(model, loaded)
    assert loaded.head.weight is loaded.embed.weight  # still tied after loading
    assert ckpt.load_trainer_state(folder) == {"step": 5} and ckpt.read_config(folder) == {"step": 5}
    assert ckpt.resolve_checkpoint(tmp_path) == folder == ckpt.resolve_checkpoint(folder)
    assert ckpt.resolve_checkpoint(tmp_path.parent / tmp_path.name) == folder


def test_keeps_the_newest_n(tmp_path):
    model = tiny_gpt(0)
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert ckpt.read_latest(tmp_path).name == "step_00000004"


def _crash(*args, **kwargs):
    raise OSError("disk full (injected)")


@pytest.mark.parametrize("where", ["torch.save", "assets", "latest pointer"])
def test_a_crash_mid_save_leaves_the_previous_latest_intact(tmp_path, monkeypatch, where):
    first = tiny_gpt(0)
    previous = save(tmp_path, 1, first)
    if where == "torch.save":
        monkeypatch.setattr(ckpt.torch, "save", _crash)
    elif where == "latest pointer":
        real_replace = os.replace
        monkeypatch.setattr(ckpt.os, "replace", lambda a, b: _crash() if str(b).endswith("latest") else
                            real_replace(a, b))
    with pytest.raises(OSError, match="injected"):
        ckpt.save_checkpoint(tmp_path, 2, model=tiny_gpt(1), trainer_state={"step": 2}, config={},
                             save_assets=_crash if where == "assets" else None)
    monkeypatch.undo()
    assert ckpt.read_latest(tmp_path) == previous
    assert ckpt.resolve_checkpoint(tmp_path) == previous
    loaded = tiny_gpt(2)
    ckpt.load_weights(loaded, previous)
    assert_same_weights(first, loaded)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]  # no half-written folder left
    if where != "latest pointer":
        assert not (tmp_path / "step_00000002").exists()


def test_rng_capture_and_restore_repeat_every_generator():
    state = ckpt.capture_rng()
    first = (torch.rand(3), random.random(), np.random.rand(2), torch.randn(2))
    ckpt.restore_rng(state)
    again = (torch.rand(3), random.random(), np.random.rand(2), torch.randn(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1]
    assert np.array_equal(first[2], again[2]) and torch.equal(first[3], again[3])


def test_missing_checkpoint_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--checkpoint: no checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "nothing")
    with pytest.raises(ValueError, match="--keep"):
        save(tmp_path, 1, tiny_gpt(0), keep=0)
