"""Grouped-query attention (n_kv_head), sinks and packed documents (document_ids) in the models."""

import pytest
import torch

from piattn.layers import ATTENTION, kinds_with
from piattn.models import GPT, GPTConfig

# (kind, extra config): kinds and settings whose packed documents must match the documents alone
PACKED = [("pi", {}), ("pi", dict(sinks=2, n_kv_head=1)), ("pi", dict(variant="separate", n_kv_head=2)),
          ("local", dict(sinks=1)), ("local", dict(n_kv_head=2)), ("dense", {}), ("dense", dict(n_kv_head=1))]
LENGTHS = ([7, 12, 5], [24], [1, 23])  # one batch row per list: documents packed back to back


def tiny(attention="pi", **overrides):
    base = dict(vocab_size=40, n_layer=2, d_model=32, n_head=4, window=2, period=5, dropout=0.0,
                image_width=6)  # read by the image kinds (neighbourhood, strided) only
    return GPTConfig.from_name("tiny", **{**base, "attention": attention, **overrides})


def packed_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS[0])
    idx = torch.randint(0, 40, (len(LENGTHS), T), generator=g)
    # Ids need only differ between neighbours: repeat an id further on, and use arbitrary values.
    ids = torch.stack([torch.cat([torch.full((n,), 7 * (d % 2) - 3) for d, n in enumerate(row)]) for row in LENGTHS])
    return idx, ids


def test_config_checks_n_kv_head_and_sinks():
    assert tiny(n_kv_head=2).kv_heads == 2 and tiny().kv_heads == 4
    assert tiny(sinks=3).pi.sinks == 3
    for bad in (3, 0, -2, 8):
        with pytest.raises(ValueError, match="n_kv_head"):
            tiny(n_kv_head=bad)
    with pytest.raises(ValueError, match="sinks"):
        tiny(sinks=-1)


def test_old_configs_without_the_new_fields_load():
    fields = tiny().to_dict()
    del fields["n_kv_head"], fields["sinks"]
    cfg = GPTConfig.from_dict(fields)
    assert cfg.n_kv_head is None and cfg.sinks == 0 and cfg.kv_heads == cfg.n_head


@pytest.mark.parametrize("attention", kinds_with("grouped_query"))
def test_grouped_query_projects_fewer_key_value_channels(attention):
    full, grouped = GPT(tiny(attention)), GPT(tiny(attention, n_kv_head=1))
    D = 32 // 4
    assert full.blocks[0].attn.qkv.out_features == 32 * 3
    assert grouped.blocks[0].attn.qkv.out_features == 32 + 2 * D
    assert grouped(torch.randint(0, 40, (2, 9))).shape == (2, 9, 40)


@pytest.mark.parametrize("attention", sorted(set(ATTENTION) - {*kinds_with("grouped_query"), *kinds_with("documents")}))
def test_other_kinds_refuse_grouped_query_and_documents(attention):
    with pytest.raises(ValueError, match=f"n_kv_head.*{attention}"):
        GPT(tiny(attention, n_kv_head=2, sparse_block=4, bucket_size=4))
    model = GPT(tiny(attention, sparse_block=4, bucket_size=4))
    idx, ids = packed_batch()
    with pytest.raises(ValueError, match="document_ids"):
        model(idx, document_ids=ids)


@pytest.mark.parametrize("attention,extra", PACKED)
def test_packed_documents_give_the_logits_of_each_document_alone(attention, extra):
    torch.manual_seed(0)
    model = GPT(tiny(attention, **extra)).double().eval()
    idx, ids = packed_batch()
    packed = model(idx, document_ids=ids)
    crossing = model(idx)
    for b, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            alone = model(idx[b:b + 1, start:start + n])[0]
            torch.testing.assert_close(packed[b, start:start + n], alone, rtol=1e-10, atol=1e-10)
            start += n
    # the test can fail: without document_ids the later documents see the earlier ones
    assert not torch.allclose(packed[0, 7:], crossing[0, 7:])


def test_rope_positions_restart_at_each_document():
    """The queries and keys of a packed document are those of the document alone, bit for bit: its first
    token is rotated as position 0 (RoPE's relative scores alone would hide a constant shift)."""
    torch.manual_seed(0)
    model = GPT(tiny("pi", n_kv_head=2)).eval()
    layer = model.blocks[0].attn
    seen = []
    attend = layer.attend
    layer.attend = lambda q, k, v, x, **kw: seen.append((q, k)) or attend(q, k, v, x, **kw)
    idx, ids = packed_batch()
    model(idx, document_ids=ids)
    model(idx[:1, 7:19])  # the second document of row 0, alone
    (q_packed, k_packed), (q_alone, k_alone) = seen[0], seen[-1]
    assert torch.equal(q_packed[:1, :, 7:19], q_alone) and torch.equal(k_packed[:1, :, 7:19], k_alone)


def test_document_ids_must_match_the_batch():
    model = GPT(tiny()).eval()
    idx, ids = packed_batch()
    with pytest.raises(ValueError, match="document_ids"):
        model(idx, document_ids=ids[:, :-1])
    with pytest.raises(ValueError, match="document_ids"):
        model(idx, model.init_cache(idx.shape[0]), document_ids=ids)
