"""`GPT.init_cache` with no max_positions: a ring as long as the period asks, refused with the number where the
memory is not there, and `nbytes` counting every buffer. Before, period 10⁹ allocated the whole ring and a
2·capacity int64 slot table (64 GB; 16 GB at batch 0 for a cache whose nbytes said 0)."""

from __future__ import annotations

import pytest
import torch

from piattn.decoding import cache as cache_module
from piattn.decoding.cache import RingCache
from piattn.models import GPT, GPTConfig

HUGE = 10**9


def huge_period_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", attention="pi", vocab_size=50, n_layer=2, d_model=32, n_head=2,
                                   window=3, period=HUGE, dropout=0.0)).eval()


def test_a_ring_beyond_the_memory_is_refused_with_the_number():
    model = huge_period_model()
    with pytest.raises(ValueError, match=r"ring cache of 1,000,000,00\d positions .* needs [\d.]+ GiB.*max_positions"):
        model.init_cache(1)


def test_a_batch_of_zero_holds_no_table_that_grows_with_the_period():
    cache = huge_period_model().init_cache(0)
    assert cache.nbytes == 0


def test_max_positions_sizes_the_ring_to_what_decoding_reaches():
    model = huge_period_model()
    idx = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = model.init_cache(1, max_positions=20)
    with torch.no_grad():
        stepped = model(idx, cache)
        full = model(idx)
    torch.testing.assert_close(stepped, full)


@pytest.mark.parametrize("sinks", [0, 2])
def test_nbytes_counts_the_slot_table_and_kept_runs(sinks):
    ring = RingCache(1, 2, 4, 8, sinks=sinks)
    for _ in range(13):
        ring.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        ring.recent()
    kept = sum(t.nbytes for t in ring._recent.values())
    assert ring.nbytes == ring.kv.nbytes + ring._slots.nbytes + kept
    assert (kept > 0) == (sinks > 0)


@pytest.mark.parametrize("sinks", [0, 3])
def test_a_ring_without_a_slot_table_reads_the_same_rows(monkeypatch, sinks):
    """Above SLOT_TABLE_MAX the slots are computed per read: the same rows as the table gives."""
    rows = []
    for table_max in (1 << 20, 0):
        monkeypatch.setattr(cache_module, "SLOT_TABLE_MAX", table_max)
        ring = RingCache(1, 1, 2, 5, sinks=sinks)
        g = torch.Generator().manual_seed(0)
        got = []
        for t in (3, 1, 1, 4, 1, 6):
            k = torch.randn(1, 1, t, 2, generator=g)
            ring.append(k, -k)
            got.append(ring.recent())
        rows.append(got)
    assert (rows[0][0][0] is not None) and all(
        torch.equal(a, b) for x, y in zip(*rows, strict=True) for a, b in zip(x, y, strict=True))
