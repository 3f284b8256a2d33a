"""Checkpoints: atomic writes, the `latest` pointer, keeping the newest N, tied weights, random states."""

from __future__ import annotations

import os
import random
import re
import shutil

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
        monkeypatch.setattr(ckpt.os, "replace", lambda a, b, **kw: _crash() if str(b).endswith("latest") else
                            real_replace(a, b, **kw))
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


# Damaged checkpoints: every failure is one ValueError naming the file or folder involved.

def damage(path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"not a checkpoint " * 8, "empty": b""}[how])


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_damaged_weights_file_is_a_value_error_naming_it(tmp_path, how):
    folder = save(tmp_path, 1, tiny_gpt(0))
    damage(folder / "model.safetensors", how)
    with pytest.raises(ValueError, match=f"{re.escape(str(folder / 'model.safetensors'))}: .*safetensors"):
        ckpt.load_weights(tiny_gpt(1), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=f"{re.escape(str(folder / 'model.safetensors'))}: .*missing"):
        ckpt.load_weights(tiny_gpt(1), folder)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_damaged_trainer_state_is_a_value_error_naming_it(tmp_path, how):
    folder = save(tmp_path, 1, tiny_gpt(0))
    damage(folder / "trainer_state.pt", how)
    with pytest.raises(ValueError, match=f"{re.escape(str(folder / 'trainer_state.pt'))}: ") as err:
        ckpt.load_trainer_state(folder)
    assert "\n" not in str(err.value)
    (folder / "trainer_state.pt").unlink()
    with pytest.raises(ValueError, match=f"{re.escape(str(folder / 'trainer_state.pt'))}: .*missing"):
        ckpt.load_trainer_state(folder)


@pytest.mark.parametrize("text,message", [
    (None, "missing"), ("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), (b"\xff\xfe{}", "not valid"),
])
def test_missing_or_invalid_config_is_a_value_error_naming_it(tmp_path, text, message):
    folder = save(tmp_path, 1, tiny_gpt(0))
    config = folder / "config.json"
    if text is None:
        config.unlink()
    elif isinstance(text, bytes):
        config.write_bytes(text)
    else:
        config.write_text(text)
    with pytest.raises(ValueError, match=f"{re.escape(str(config))}: .*{message}"):
        ckpt.read_config(folder)


def test_weights_of_another_shape_name_the_file_and_the_tensor(tmp_path):
    folder = save(tmp_path, 1, tiny_gpt(0))
    torch.manual_seed(0)
    wider = GPT(GPTConfig.from_name("tiny", n_layer=2, d_model=48, n_head=2, vocab_size=64, block_size=64))
    file = re.escape(str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{file}: .*embed\.weight .*\(64, 32\).*\(64, 48\)"):
        ckpt.load_weights(wider, folder)
    torch.manual_seed(0)
    deeper = GPT(GPTConfig.from_name("tiny", n_layer=3, d_model=32, n_head=2, vocab_size=64, block_size=64))
    with pytest.raises(ValueError, match=rf"{file}: .*missing \['blocks\.2\."):
        ckpt.load_weights(deeper, folder)


def complete_names(root):
    return [p.name for p in ckpt.list_checkpoints(root)]


def test_latest_naming_a_deleted_checkpoint_lists_those_that_exist(tmp_path):
    model = tiny_gpt(0)
    save(tmp_path, 1, model)
    save(tmp_path, 2, model)
    shutil.rmtree(tmp_path / "step_00000002")
    pointer = re.escape(str(tmp_path / "latest"))
    with pytest.raises(ValueError, match=rf"{pointer}: .*step_00000002.*does not exist.*step_00000001"):
        ckpt.read_latest(tmp_path)
    (tmp_path / "step_00000001" / "trainer_state.pt").unlink()
    (tmp_path / "latest").write_text("step_00000001\n")
    with pytest.raises(ValueError, match=rf"{pointer}: .*step_00000001.*incomplete .*trainer_state.pt.*none exist"):
        ckpt.read_latest(tmp_path)
    shutil.rmtree(tmp_path / "step_00000001")
    with pytest.raises(ValueError, match=rf"{pointer}: .*none exist"):
        ckpt.read_latest(tmp_path)


@pytest.mark.parametrize("content", [
    "", "\n", "../outside", "/tmp", "step_00000001/../../x", "step_00000001/model.safetensors", "..",
    "step_1 step_2", "garbage", b"\xff\xfe\x00", "step_" + "9" * 5000,
])
def test_garbage_latest_is_a_value_error_and_never_leaves_the_root(tmp_path, content):
    save(tmp_path, 1, tiny_gpt(0))
    pointer = tmp_path / "latest"
    if isinstance(content, bytes):
        pointer.write_bytes(content)
    else:
        pointer.write_text(content)
    with pytest.raises(ValueError, match=rf"{re.escape(str(pointer))}: .*step_00000001") as err:
        ckpt.read_latest(tmp_path)
    assert "\n" not in str(err.value) and len(str(err.value)) < 1000
    with pytest.raises(ValueError, match=rf"--checkpoint: {re.escape(str(pointer))}: "):  # defect g
        ckpt.resolve_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=rf"--from: {re.escape(str(pointer))}: "):
        ckpt.resolve_checkpoint(tmp_path.parent / tmp_path.name, flag="--from")


def test_latest_naming_a_link_out_of_the_root_is_refused(tmp_path):
    root, outside = tmp_path / "checkpoints", tmp_path / "elsewhere"
    save(outside, 7, tiny_gpt(0))
    save(root, 1, tiny_gpt(0))
    (root / "step_00000007").symlink_to(outside / "step_00000007", target_is_directory=True)
    (root / "latest").write_text("step_00000007\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(root / 'latest'))}: .*outside"):
        ckpt.read_latest(root)


def test_save_replaces_a_garbage_latest(tmp_path):
    save(tmp_path, 1, tiny_gpt(0))
    (tmp_path / "latest").write_text("../nowhere")
    folder = save(tmp_path, 2, tiny_gpt(0))
    assert ckpt.read_latest(tmp_path) == folder


def test_clean_incomplete_removes_only_hidden_leftovers_directly_under_root(tmp_path):
    root, outside = tmp_path / "checkpoints", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    kept = save(root, 1, tiny_gpt(0))
    leftovers = [root / ".tmp-step_00000002-123", root / ".trash-step_00000001-45"]
    for folder in leftovers:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    (root / ".tmp-file").write_text("x")
    (root / ".tmp-link").symlink_to(outside, target_is_directory=True)
    untouched = [root / "tmp-step_00000003", root / ".hidden", kept / ".tmp-nested", root / "step_00000009"]
    for folder in untouched:
        folder.mkdir()
    removed = ckpt.clean_incomplete(root)
    assert removed == sorted([*leftovers, root / ".tmp-file", root / ".tmp-link"])
    assert not any(p.exists() or p.is_symlink() for p in removed)
    assert all(p.is_dir() for p in untouched)
    assert (outside / "keep.txt").read_text() == "keep"  # a link is removed, never followed
    assert ckpt.read_latest(root) == kept and ckpt.clean_incomplete(root) == []
    assert ckpt.clean_incomplete(tmp_path / "absent") == []
