"""`piattn eval` against a run folder or checkpoint it did not make: what the folder may not choose.

A checkpoint folder can come from anyone. Its config.json may not pick the data eval reads, its links may not
send eval's files elsewhere, and its config may not make eval allocate a model its weights do not hold.
Also: eval's progress bar, its human summary and its refusal to overwrite an earlier evaluation.
"""

from __future__ import annotations

import pytest
import torch

from piattn.models import GPT, GPTConfig
from piattn.train import checkpoint as ckpt

TINY_GPT = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "d_model": 32}


def build_on(record: list, config: dict):
    """A `build` for check_weight_shapes that records the device each call builds on."""
    def build():
        record.append(torch.empty(0).device.type)
        return GPT(GPTConfig(**config))
    return build


@pytest.mark.parametrize("change", [{"n_layer": 5000}, {"d_model": 4096}, {"vocab_size": 10**9}])
def test_a_config_larger_than_its_weights_is_refused_before_any_memory_is_spent(tmp_path, change):
    ckpt.save_checkpoint(tmp_path, 1, model=GPT(GPTConfig(**TINY_GPT)), trainer_state={}, config={})
    folder = tmp_path / "step_00000001"
    built = []
    with pytest.raises(ValueError, match="model.safetensors: does not match the model its config.json describes"):
        ckpt.check_weight_shapes(folder, build_on(built, {**TINY_GPT, **change}))
    assert built == ["meta"]  # shapes only: 10⁹ × 32 floats would be 128 GB


def test_the_config_a_checkpoint_was_saved_with_passes_and_tied_weights_count_once(tmp_path):
    model = GPT(GPTConfig(**TINY_GPT))
    ckpt.save_checkpoint(tmp_path, 1, model=model, trainer_state={}, config={})
    ckpt.check_weight_shapes(tmp_path / "step_00000001", lambda: GPT(GPTConfig(**TINY_GPT)))


def test_a_config_smaller_than_its_weights_is_refused_too(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, model=GPT(GPTConfig(**TINY_GPT)), trainer_state={}, config={})
    with pytest.raises(ValueError, match=r"unexpected \['blocks.1."):
        ckpt.check_weight_shapes(tmp_path / "step_00000001", lambda: GPT(GPTConfig(**{**TINY_GPT, "n_layer": 1})))
