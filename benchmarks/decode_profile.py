"""Where a decoding step's time goes: the tiny GPT of `decode_bench.py`, its kinds side by side, one-token steps
at one position, batch 1 and 8 (one intra-op thread).

Two views of the same loop:
- **by module**: forward hooks time each whole layer, in µs per step: the attention layers (projections,
  gate MLP, the ring cache's write and the attention itself: the compiled step for `pi` and `local`, torch
  ops for `dense`), the feed-forward MLPs, the layer norms, the embedding and the output head; "between
  modules" is what the step takes outside all of them (the model's own Python, the residual adds, the
  argmax). The hooks cost about a µs per module call (19 calls a step with 4 layers), which lands in
  "between modules". No hook goes inside an attention layer: a hooked projection or gate leaves the lean
  path that the compiled step runs.
- **by library** (with `perf` installed, and allowed to sample: `perf record -e cpu-clock`): the share of
  CPU samples in the Python interpreter, torch's Python bindings, torch's C++ library (its kernels and its
  dispatcher), the compiled step, libc / libm, the OS kernel and the rest, over a few seconds of steps
  after warm-up, in a fresh process per (kind, batch). Without perf the table says so and keeps the module
  view.

    python benchmarks/decode_profile.py --out benchmarks/results/decode --name decode_profile \
        --kinds pi local dense --position 512 --batch 1 8
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from piattn.benchmarking import (
    DECODE_KINDS,
    command_line,
    decode_model,
    fill_cache,
    machine_info,
    markdown_table,
    save_results,
)

KINDS = tuple(DECODE_KINDS)  # the GPT kinds of the decoding benchmarks (no Hugging Face ones here)
# A model's module name (within a block for the per-layer ones) -> its part of the step. Only whole layers:
# hooks on the attention layer's own parts (its projections, the gate MLP) would move its decoding off the
# lean path that the compiled step runs (a hooked linear is computed in torch so that its hooks see it).
PARTS = {"attn": "attention layer", "ffn": "feed-forward MLP", "ln1": "layer norms", "ln2": "layer norms",
         "ln_f": "layer norms", "embed": "embedding", "head": "output head"}
BETWEEN = "between modules"
# perf's shared-object name (a regular expression, first match wins) -> the library it counts for.
LIBRARIES = (("Python interpreter", r"^(python[0-9.]*|libpython.*)$"),
             ("torch bindings", r"^libtorch_python\.so"),
             ("torch C++ (kernels, dispatcher)", r"^(libtorch_cpu\.so|libc10\.so|libtorch\.so|libgomp.*|libiomp.*"
                                                 r"|libmkl.*|libdnnl.*|libsleef.*|\[JIT\].*)"),
             ("compiled step", r"^decode_step.*\.so$"),
             ("libc / libm", r"^(libc\.so.*|libm\.so.*|ld-linux.*)$"),
             ("OS kernel", r"^\[kernel\.kallsyms\]$"))
OTHER = "other"


def _warm_cache(model, position: int, batch: int):
    """A fresh cache of `model` filled to `position`, three steps taken; returns (cache, next token [B, 1])."""
    cache = model.init_cache(batch)
    fill_cache(cache, position, torch.Generator().manual_seed(0))
    token = torch.zeros(batch, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(3):  # the first calls allocate, pick kernels and build the compiled step
            token = model(token, cache)[:, -1:].argmax(-1)
    return cache, token


def by_module(model, position: int, batch: int, steps: int) -> dict:
    """µs per step of each part (PARTS, BETWEEN) and the step itself, from hooks over `steps` steps from a fresh
    cache at `position`; the hooks are removed after."""
    cache, token = _warm_cache(model, position, batch)
    spent: dict[str, float] = {}
    started: dict[int, float] = {}
    handles = []

    def timed(module, part: str) -> None:
        def before(*_):
            started[id(module)] = time.perf_counter()

        def after(*_):
            spent[part] = spent.get(part, 0.0) + time.perf_counter() - started.pop(id(module))
        handles.extend([module.register_forward_pre_hook(before), module.register_forward_hook(after)])

    for name, module in model.named_modules():
        if name in ("embed", "ln_f", "head") or re.fullmatch(r"blocks\.\d+\.(attn|ffn|ln1|ln2)", name):
            timed(module, PARTS[name.rsplit(".", 1)[-1]])
    try:
        with torch.no_grad():
            start = time.perf_counter()
            for _ in range(steps):
                token = model(token, cache)[:, -1:].argmax(-1)
            total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    parts = {**spent, BETWEEN: total - sum(spent.values())}
    return {"step": total / steps * 1e6, **{p: s / steps * 1e6 for p, s in parts.items()}}


def worker(kind: str, position: int, batch: int, seconds: float, config: str) -> None:
    """The child `by_library` samples: warm up, say "ready", take steps for `seconds`."""
    model = decode_model(kind, config)
    cache, token = _warm_cache(model, position, batch)
    print("ready", flush=True)
    deadline = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < deadline:
            token = model(token, cache)[:, -1:].argmax(-1)


def library_of(dso: str) -> str:
    """The library (LIBRARIES' name, or OTHER) that perf's shared-object name `dso` counts for."""
    for library, pattern in LIBRARIES:
        if re.match(pattern, dso):
            return library
    return OTHER


def by_library(kind: str, position: int, batch: int, seconds: float, config: str) -> dict | None:
    """Share (%) of perf's CPU samples per library over `seconds` of steps after warm-up; None without perf."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "perf.data"
        child = subprocess.Popen([sys.executable, __file__, "--worker", kind, str(position), str(batch),
                                  str(seconds + 2), "--config", config], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        if child.stdout.readline().strip() != "ready":
            raise SystemExit(f"decode_profile: the worker for {kind} stopped before its steps")
        recorded = subprocess.run([perf, "record", "-q", "-e", "cpu-clock", "-F", "2999", "-p", str(child.pid),
                                   "-o", str(data), "--", "sleep", str(seconds)], capture_output=True, text=True)
        child.communicate()
        if recorded.returncode != 0 or not data.exists():
            print(f"decode_profile: perf could not sample ({recorded.stderr.strip()[:200]}): library view left out",
                  file=sys.stderr)
            return None
        report = subprocess.run([perf, "report", "-i", str(data), "--stdio", "--sort", "dso", "--no-children"],
                                capture_output=True, text=True, check=True).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        match = re.match(r"\s*([0-9.]+)%\s+(\S+)", line)
        if match and not line.lstrip().startswith("#"):
            library = library_of(match.group(2))
            shares[library] = shares.get(library, 0.0) + float(match.group(1))
    return shares


def markdown(result: dict) -> str:
    rows = result["rows"]
    parts = [p for p in dict.fromkeys([*PARTS.values(), BETWEEN]) if any(p in r["module"] for r in rows)]
    head = ["kind", "batch", "step µs", *parts]
    lines = [f"# Where a decoding step's time goes (tiny GPT, position {result['position']}, one thread)", "",
             f"`{result['command']}`", "",
             f"{result['machine']['processor']}, torch {result['machine']['torch']}, Python "
             f"{result['machine']['python']}. By module: µs per step (one step takes one token for each "
             f"sequence of the batch), median of {result['repeats']} runs of {result['steps']} steps, the kinds "
             "taking turns in one process; the "
             "hooks' own cost (about a µs a module call) lands in 'between modules'.", "",
             *markdown_table(head, ([r["kind"], r["batch"], f"{r['module']['step']:.0f}",
                                     *(f"{r['module'].get(p, 0.0):.0f}" for p in parts)] for r in rows))]
    libraries = [name for name, _ in LIBRARIES] + [OTHER]
    if all(r["library"] is None for r in rows):
        lines += ["", "By library: not measured (no `perf`, or perf may not sample here)."]
    else:
        lines += ["", f"By library: % of CPU samples (`perf record -e cpu-clock`, {result['seconds']} s of steps "
                  "after warm-up, a fresh process per row).", "",
                  *markdown_table(["kind", "batch", *libraries],
                                  ([r["kind"], r["batch"], *(f"{r['library'].get(lib, 0.0):.1f}" for lib in libraries)]
                                   for r in rows if r["library"] is not None))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["pi", "local", "dense"], choices=KINDS)
    p.add_argument("--position", type=int, default=512)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--steps", type=int, default=400, help="steps per module-view run")
    p.add_argument("--repeats", type=int, default=5, help="module-view runs per row (the median is kept)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds of steps perf samples per row")
    p.add_argument("--config", default="tiny")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/decode"))
    p.add_argument("--name", default="decode_profile")
    p.add_argument("--worker", nargs=4, metavar=("KIND", "POSITION", "BATCH", "SECONDS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.worker:
        kind, position, batch, seconds = args.worker
        worker(kind, int(position), int(batch), float(seconds), args.config)
        return {}
    bad = [n for n in ("position", "steps", "repeats") if getattr(args, n) < 1] + \
        (["batch"] if min(args.batch) < 1 else []) + (["seconds"] if args.seconds <= 0 else [])
    if bad:
        p.error(f"--{', --'.join(bad)} must be positive")
    # The module view: every kind's model in this process, taking turns within each repeat (the order rotated
    # from one repeat to the next), so that a slow spell of a shared machine touches every kind alike.
    models = {kind: decode_model(kind, args.config) for kind in args.kinds}
    runs: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        turn = args.kinds[repeat % len(args.kinds):] + args.kinds[:repeat % len(args.kinds)]
        for batch in args.batch:
            for kind in turn:
                runs.setdefault((kind, batch), []).append(by_module(models[kind], args.position, batch, args.steps))
    rows = []
    for kind in args.kinds:
        for batch in args.batch:
            done = runs[(kind, batch)]
            module = {part: statistics.median(r.get(part, 0.0) for r in done) for part in done[0]}
            library = by_library(kind, args.position, batch, args.seconds, args.config)
            rows.append(dict(kind=kind, batch=batch, module=module, library=library))
            print(f"{kind:6s} batch {batch}: {module['step']:.0f} µs a step; " +
                  ", ".join(f"{k} {v:.0f}" for k, v in module.items() if k != "step"), flush=True)
    result = dict(command=command_line("benchmarks/decode_profile.py", argv), machine=machine_info(),
                  position=args.position, steps=args.steps, repeats=args.repeats, seconds=args.seconds, rows=rows)
    save_results(args.out, args.name, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
