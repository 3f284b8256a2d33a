"""Evaluation windows: whole windows of the token stream, spread evenly from its start to its end."""

from __future__ import annotations

import pytest

from piattn.data.windows import evaluation_windows


class ByteTokenizer:
    """The Hugging Face tokenizer interface the windows use: ids of a document, an end-of-sequence id."""

    eos_token_id = 255

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode())}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(chr(ord("a") + i % 26) for i in range(99)))  # 99 bytes + end of sequence: 100 ids
    return path


def test_windows_are_spread_from_the_start_to_the_end_of_the_stream(corpus):
    windows = evaluation_windows(str(corpus), "none", ByteTokenizer(), context=10, limit_tokens=35)
    assert windows.shape == (3, 10)  # limit_tokens // context whole windows
    stream = list(corpus.read_bytes()) + [255]
    assert windows[0].tolist() == stream[:10] and windows[-1].tolist() == stream[-10:]
    assert windows[1].tolist() == stream[45:55]  # stride (100 − 10) // 2


def test_a_stream_shorter_than_the_context_is_refused(corpus):
    with pytest.raises(ValueError, match="has 100 tokens, fewer than --context 128"):
        evaluation_windows(str(corpus), "none", ByteTokenizer(), context=128, limit_tokens=1024)
