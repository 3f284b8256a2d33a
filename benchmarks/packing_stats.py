"""How much of a corpus each way of cutting language-model sequences wastes: dropped text and padding.

For each corpus split (byte tokenizer) and sequence length S, a sequence is S + 1 tokens (S inputs, S
next-token targets; consecutive sequences share one token). Every token but a document's first is a
target of its document; the schemes differ in what they do with the targets that do not fill a sequence:

- per document (`piattn train` default): sequences stay inside a document and each document's tail that
  cannot fill a sequence is dropped: no padding, but that text is never trained on;
- padded (the usual alternative): each document's tail is padded to a full sequence: nothing dropped, but
  padding positions cost compute;
- packed (`--pack-documents`): documents back to back, attention kept inside each by document ids; only the
  tail of the whole stream is dropped, no padding; the targets that start a new document (not predictable
  from their input's document) are skipped by the loss.

Fractions are of the target slots a scheme computes (padding) or of the targets the text holds (dropped).

    python benchmarks/packing_stats.py --out benchmarks/results/packing    # books and WikiText-2 from ../shared/data
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from piattn.benchmarking import command_line, save_results
from piattn.data.text import load_documents

SEQ_LENS = (256, 1024, 4096)


def document_lengths(source: str, split: str) -> np.ndarray:
    """[n_documents] int64: bytes (byte-level tokens) of each document of the split."""
    return np.array([len(doc.encode("utf-8")) for doc in load_documents(source, split)], dtype=np.int64)


def scheme_stats(lengths: np.ndarray, S: int) -> dict:
    """The three schemes' numbers for documents of `lengths` tokens and sequences of S targets."""
    targets = lengths - 1  # per document: every token but the first is a target
    total = int(targets.sum())
    per_doc = np.where(lengths >= S + 1, (lengths - 1) // S, 0)
    padded = -(-targets // S)  # ceil: the tail padded to a full sequence
    stream = int(lengths.sum())
    packed = (stream - 1) // S
    starts = np.cumsum(lengths)[:-1]  # positions where a later document starts
    skipped = int((starts <= packed * S).sum())  # targets at a document start, inside the used stream
    return {
        "seq_len": S,
        "documents": int(len(lengths)),
        "targets": total,
        "per_document": {"sequences": int(per_doc.sum()), "dropped_fraction": 1 - int(per_doc.sum()) * S / total,
                         "padding_fraction": 0.0},
        "padded": {"sequences": int(padded.sum()), "dropped_fraction": 0.0,
                   "padding_fraction": 1 - total / (int(padded.sum()) * S)},
        "packed": {"sequences": packed, "dropped_fraction": 1 - (packed * S - skipped) / total,
                   "padding_fraction": 0.0, "skipped_boundary_fraction": skipped / (packed * S)},
    }


def markdown(result: dict) -> str:
    out = ["# Packing: wasted text and padding per way of cutting sequences", "",
           f"`{result['command']}`; byte tokenizer; dropped = share of the text's targets never trained on, "
           "padding = share of computed target slots that are padding, skipped = share of packed slots whose "
           f"target starts a new document (masked). {result['seconds']:.0f} s.", "",
           "| corpus | split | docs | S | per document: dropped | padded: padding | packed: dropped | "
           "packed: padding | packed: skipped | sequences per doc / padded / packed |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        d, p, k = r["per_document"], r["padded"], r["packed"]
        out.append(f"| {r['corpus']} | {r['split']} | {r['documents']} | {r['seq_len']} | "
                   f"{d['dropped_fraction']:.1%} | {p['padding_fraction']:.1%} | {k['dropped_fraction']:.2%} | "
                   f"{k['padding_fraction']:.0%} | {k['skipped_boundary_fraction']:.2%} | "
                   f"{d['sequences']:,} / {p['sequences']:,} / {k['sequences']:,} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--books", default="../shared/data/books", help="folder of the Gutenberg books")
    parser.add_argument("--wikitext", default="../shared/data/wikitext-2", help="WikiText-2 folder")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    parser.add_argument("--out", type=Path, help="directory for packing.{json,md}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for corpus, source, splits in (("books", f"books:{args.books}", ("train", "validation", "test")),
                                   ("wikitext-2", f"wikitext:{args.wikitext}", ("validation", "test"))):
        for split in splits:
            lengths = document_lengths(source, split)
            rows += [{"corpus": corpus, "split": split, **scheme_stats(lengths, S)} for S in args.seq_lens]
    command = command_line("benchmarks/packing_stats.py", argv)
    result = dict(command=command, seconds=time.perf_counter() - start, rows=rows)
    table = markdown(result)
    if args.out:
        save_results(args.out, "packing", result, table)
    print(table)


if __name__ == "__main__":
    main()
