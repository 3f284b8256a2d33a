"""Packed documents: sequences cut from one stream that carry each token's document, and the LM task on them."""


import numpy as np
import pytest
import torch

from piattn.cli import main
from piattn.data.packing import PackedSequences, SequenceLoader
from piattn.models import GPT, GPTConfig
from piattn.tasks.lm import IGNORE, LanguageModelTask
from utils import train_summary, write_word_corpus

STARTS = [0, 5, 7, 20, 21]  # documents of 5, 2, 13, 1 and 9 tokens
TOKENS = np.arange(30) % 11


def test_packed_items_carry_the_document_of_every_token():
    packed = PackedSequences(TOKENS, STARTS, seq_len=6, document_ids=True)
    crossing = PackedSequences(TOKENS, STARTS, seq_len=6, cross_documents=True)
    owner = np.searchsorted(STARTS, np.arange(30), side="right") - 1
    assert len(packed) == len(crossing) == 4 and packed.dropped_tokens == crossing.dropped_tokens == 5
    for i in range(len(packed)):
        tokens, docs = packed[i]
        assert torch.equal(tokens, crossing[i])
        assert docs.tolist() == owner[6 * i:6 * i + 7].tolist()
    per_document = PackedSequences(TOKENS, STARTS, seq_len=6)
    # per document: the 13-token one gives 2 sequences (13 tokens used), the 9-token one 1 (7), the rest none
    assert per_document.dropped_tokens == 30 - 13 - 7


def test_packing_and_crossing_exclude_each_other():
    with pytest.raises(ValueError, match="cross_documents"):
        PackedSequences(TOKENS, STARTS, seq_len=6, cross_documents=True, document_ids=True)


def test_the_loader_batches_pairs():
    loader = SequenceLoader(PackedSequences(TOKENS, STARTS, seq_len=6, document_ids=True), batch_size=2,
                            shuffle=False)
    tokens, docs = loader.next_batch()
    assert tokens.shape == docs.shape == (2, 7) and docs.dtype == torch.int64


class _Ctx:
    device = torch.device("cpu")
    sequence_parallel, sequence_rank, sequence_group = 1, 0, None


def test_the_task_masks_targets_across_documents_and_keeps_documents_apart():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", attention="pi", vocab_size=11, n_layer=2, d_model=32, n_head=2,
                                    window=2, period=3, dropout=0.0)).double().eval()
    task = LanguageModelTask.__new__(LanguageModelTask)  # only `_forward` is exercised: no corpus needed
    task.ctx = _Ctx()
    tokens, docs = PackedSequences(TOKENS, STARTS, seq_len=12, document_ids=True)[1]  # tokens 12 … 24
    logits, targets = task._forward(model, (tokens[None], docs[None]))
    # targets 13 … 24; token 20 and 21 start documents: their targets are skipped
    assert (targets[0] == IGNORE).nonzero().flatten().tolist() == [20 - 13, 21 - 13]
    alone = model(tokens[None, 8:9])  # token 20, the one-token document, alone
    torch.testing.assert_close(logits[0, 8:9], alone[0], rtol=1e-10, atol=1e-10)


def test_training_with_packed_documents(tmp_path, capsys):
    corpus = write_word_corpus(tmp_path / "corpus", {"train": [30, 45, 20, 60, 35], "validation": [40, 50]})

    def argv(out, *extra):
        return ["train", "--data", str(corpus), "--out", str(out), "--attention", "pi", "--n-layer", "1",
                "--d-model", "32", "--n-head", "2", "--n-kv-head", "1", "--sinks", "1", "--seq-len", "64",
                "--batch-size", "2", "--steps", "2", "--warmup", "1", "--eval-every", "2", "--eval-batches", "1",
                "--device", "cpu", "--no-progress", *extra]

    assert main(argv(tmp_path / "run", "--pack-documents")) == 0
    assert train_summary(tmp_path / "run", capsys)["step"] == 2
    assert main(argv(tmp_path / "run2", "--pack-documents", "--cross-documents")) == 2
    assert "exclude each other" in capsys.readouterr().err
    # Sequence parallelism: refused before any process group starts or anything is written.
    assert main(argv(tmp_path / "run3", "--pack-documents", "--sequence-parallel", "2")) == 2
    assert "--pack-documents does not run with --sequence-parallel > 1" in capsys.readouterr().err
    assert main(argv(tmp_path / "run4", "--sequence-parallel", "2")) == 2
    assert "--sinks does not run with --sequence-parallel > 1" in capsys.readouterr().err
    assert not (tmp_path / "run3").exists() and not (tmp_path / "run4").exists()
