"""Fixed-length windows of a tokenized split, spread evenly over it: what a pretrained model is scored on
(`piattn convert-eval`, experiments/convert_finetune.py).

The tokenizer is a Hugging Face one (called on a document, it returns {"input_ids": [...]}; it has
`eos_token_id`), since the models scored this way come with theirs.
"""

from __future__ import annotations

from .text import load_documents


def evaluation_windows(source: str, split: str, tokenizer, context: int, limit_tokens: int):
    """[N, context] int64: N = limit_tokens // context windows spread evenly over the split's token stream
    (documents joined by the tokenizer's end-of-sequence token). `split` "none": a source without splits."""
    import torch

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for doc in load_documents(source, None if split.lower() == "none" else split):
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + eos
    n = min(limit_tokens // context, len(stream) // context)
    if n == 0:
        raise ValueError(f"--data {source} [{split}] has {len(stream)} tokens, fewer than --context {context}")
    stride = (len(stream) - context) // max(n - 1, 1)
    return torch.tensor([stream[i * stride : i * stride + context] for i in range(n)], dtype=torch.long)
