"""A model whose first forward runs under `torch.inference_mode()` (Lightning's sanity check, an evaluation or a
generation before training) trains afterwards: nothing it caches (the rotary table, candidate key sets, the
gate's clip constants, block masks) stays an inference tensor. Before the fix the rotary table did, and every
later training step failed."""

from __future__ import annotations

import pytest
import torch

from piattn.layers.registry import ATTENTION
from utils import tiny_model


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_a_model_first_run_under_inference_mode_then_trains(attention):
    model = tiny_model(attention, image_width=6)  # the image kinds read the raster's width (24 tokens: 4 rows)
    idx = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(idx)
    model.train()
    logits = model(idx)
    logits.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), expected)


def test_a_rotary_table_made_under_inference_mode_is_not_an_inference_tensor():
    from piattn.layers.rotary import Rotary

    rotary = Rotary(8)
    with torch.inference_mode():
        rotary(torch.randn(1, 1, 4, 8))
    assert all(not t.is_inference() for table in rotary._tables.values() for t in table)
