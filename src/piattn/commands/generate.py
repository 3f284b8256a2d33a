"""`piattn generate`: continue a prompt with a trained language model, printing tokens as they come.

    piattn generate --checkpoint runs/pi-books --prompt "It was a dark" --max-new-tokens 200 --top-k 40

The model decodes through its cache (constant size for `pi` and `local`); `--stats` reports the cache's
bytes and the decoding speed at the end, on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..decoding import check_sampling
from ..tasks.lm import load_language_model
from ..train import checkpoint as ckpt
from ..train.distributed import parse_device
from .common import add_threads_argument, torch_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a run directory (its latest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", required=True, help="text to continue (at least one token)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the smallest set of tokens with probability >= p")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--stats", action="store_true", help="print cache bytes and tokens/s to stderr at the end")
    add_threads_argument(p)


def run(args: argparse.Namespace) -> int:
    with torch_threads(args.threads, args.device):
        return generate(args)


def generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise ValueError(f"--{err}".replace("_", "-", 1)) from None
    device = parse_device(args.device)
    model, tokenizer = load_language_model(ckpt.resolve_checkpoint(args.checkpoint), device)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError("--prompt must encode to at least one token")
    prompt = torch.tensor([ids], device=device)
    sys.stdout.write(args.prompt)
    produced: list[int] = []
    shown = ""
    cache = model.init_cache(1, max_positions=prompt.shape[1] + args.max_new_tokens)
    start = time.perf_counter()
    for token in model.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, cache=cache):
        produced.append(int(token))
        # decode the whole continuation: a byte-level character may span several tokens
        text = tokenizer.decode(produced)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tokenizer.decode(produced)[len(shown):] + "\n")
    if args.stats:
        seconds = time.perf_counter() - start
        print(f"{len(produced)} tokens in {seconds:.2f} s ({len(produced) / max(seconds, 1e-9):.1f} tokens/s); "
              f"attention {model.config.attention}, cache {cache.nbytes:,} bytes at position {cache.position}",
              file=sys.stderr)
    return 0
