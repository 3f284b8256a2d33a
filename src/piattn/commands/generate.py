"""`piattn generate`: continue a prompt with a trained language model, printing tokens as they come.

    piattn generate --checkpoint runs/pi-books --prompt "It was a dark" --max-new-tokens 200 --top-k 40

The model decodes through its cache (constant size for `pi` and `local`); `--stats` reports the cache's
bytes and the decoding speed at the end, on stderr.

A `--task pixels` checkpoint (or several) completes the bottom half of test images instead and draws them
as one PNG grid, a row per model (`completions`):

    piattn generate --checkpoint runs/px-pi runs/px-local --images 8 --temperature 0
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
from . import completions
from .common import add_threads_argument, torch_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, nargs="+", action="extend",
                   help="a run directory (its latest checkpoint) or a checkpoint folder; pixels models: one or more")
    p.add_argument("--prompt", help="text to continue (at least one token; required for a language model)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the smallest set of tokens with probability >= p")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--stats", action="store_true", help="print cache bytes and tokens/s to stderr at the end")
    images = p.add_argument_group("pixels models: complete the bottom half of images, one PNG grid")
    images.add_argument("--images", type=int, default=8, help="images to complete (the grid's columns)")
    images.add_argument("--split", default="test", help="train, validation or test")
    images.add_argument("--data", help="the image source, when the first checkpoint's is not generated or mnist5k")
    images.add_argument("--use-stored-data", action="store_true",
                        help="read the image source the first checkpoint's config.json records")
    images.add_argument("--output", help="the PNG (default: RUN/completions_<split>.png of the first checkpoint, "
                        "numbered when it exists)")
    images.add_argument("--overwrite", action="store_true", help="replace an existing --output")
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
    folders = [ckpt.resolve_checkpoint(path) for path in args.checkpoint]
    if ckpt.read_config(folders[0]).get("task") == "pixels":
        return completions.run_completions(args, folders)
    if len(folders) > 1:
        raise ValueError("--checkpoint takes one language model (several only for pixels models)")
    if args.prompt is None:
        raise ValueError("--prompt is required for a language model")
    device = parse_device(args.device)
    model, tokenizer = load_language_model(folders[0], device)
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
              f"attention {model.config.layers or model.config.attention}, cache {cache.nbytes:,} bytes at position "
              f"{cache.position}", file=sys.stderr)
        if model.config.is_hybrid():  # each layer's cache is sized for its kind: say what each holds
            print(cache.describe(), file=sys.stderr)
    return 0
