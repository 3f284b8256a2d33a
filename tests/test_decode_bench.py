"""benchmarks/decode_bench.py's diagnostic kinds of π's gate: what each changes of a π model, and that each
still decodes what π decodes (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import torch

from utils import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_bench.py"


def _decode(model, steps: int = 6) -> torch.Tensor:
    """Logits [steps, vocab] of greedy one-token steps from a fresh cache (batch 1)."""
    cache = model.init_cache(1)
    idx, logits = torch.zeros(1, 1, dtype=torch.long), []
    with torch.no_grad():
        for _ in range(steps):
            out = model(idx, cache)[:, -1]
            logits.append(out[0])
            idx = out.argmax(-1, keepdim=True)
    return torch.stack(logits)


def test_held_gate_layers_decode_what_pi_decodes_and_skip_the_reading():
    bench = load_script(SCRIPT, "decode_bench")
    pi, held = bench._model("pi", "tiny"), bench._model("pi-gate-held", "tiny")
    for block in held.blocks:
        layers = block.attn.whole_gate_layers()
        gate = block.attn.gate
        assert layers == (gate[0].weight, gate[0].bias, gate[2].weight, gate[2].bias)
        block.attn.gate = None  # the held layers are not read from the modules any more
        assert block.attn.whole_gate_layers() is layers
        block.attn.gate = gate
    assert torch.equal(_decode(held), _decode(pi))


def test_one_gate_storage_shares_memory_not_objects_and_decodes_with_layer_0s_gate():
    bench = load_script(SCRIPT, "decode_bench")
    shared = bench._model("pi-gate-one-storage", "tiny")
    first = list(shared.blocks[0].attn.gate.parameters())
    for block in shared.blocks[1:]:
        mine = list(block.attn.gate.parameters())
        assert [p.data_ptr() for p in mine] == [p.data_ptr() for p in first]
        assert all(p is not q for p, q in zip(mine, first, strict=True))
    reference = bench._model("pi", "tiny")
    with torch.no_grad():
        for block in reference.blocks[1:]:
            for mine, theirs in zip(block.attn.gate.parameters(), reference.blocks[0].attn.gate.parameters(),
                                    strict=True):
                mine.copy_(theirs)
    assert torch.equal(_decode(shared), _decode(reference))
    assert not torch.equal(_decode(shared), _decode(bench._model("pi", "tiny")))
