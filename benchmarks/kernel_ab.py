"""Two or more revisions of piattn's C kernels side by side, the revisions interleaved round by round in one
process, so that a busy machine slows them alike. The way to tell whether a change of the C source is faster:
differences of a few percent drown in the run-to-run noise of separate runs.

- `--kernels fused` (the default): the fused CPU kernels (`fused_cpu.c`), the forward and the backward alone
  (outputs allocated once and reused, no autograd), in ms. B 1, H 8, D 64, causal adaptive, window 4,
  period 16 (cpu_bench's settings), at each of --lengths and --dtypes.
- `--kernels step`: the compiled decoding step (`decode_step.c`), one call of a tiny GPT's one-token layer
  step (`decode_native.run`'s call with the token to store, the packed arguments of layer 0 at position 512 taken from a
  real step), in µs, for each of --cases (the GPT kinds of `decode_bench.py`) and --batches.

    python benchmarks/kernel_ab.py --revisions HEAD~1 HEAD --lengths 8192 16384 --dtypes float32 bfloat16
    python benchmarks/kernel_ab.py --kernels step --revisions HEAD~1 HEAD --cases pi local --batches 1 8

A revision is a git revision of this repository (its C source) or `worktree` (the file as it is now). Each is
built as piattn builds its own (same compiler, flags and cache) and called through today's Python: the
revisions compared must share the C entry points (`fused._Call`'s layout, `native.ARGS`).
Prints, and writes with --name to --out, the min and the median over rounds of each kernel, and each
revision's min as a ratio to the first's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from piattn.benchmarking import (
    PI_SETTINGS,
    command_line,
    decode_model,
    fill_cache,
    machine_info,
    markdown_table,
    save_results,
)
from piattn.ops.pi import cbuild, decode_native, fused, native
from piattn.ops.pi.settings import OpSettings

REPO = Path(__file__).resolve().parents[1]


class Fused:
    """The fused kernels on one problem (inputs and outputs allocated once): ms of the forward, then of the
    backward on its statistics."""

    source = "src/piattn/ops/pi/fused_cpu.c"
    measures = ("fwd", "bwd")

    @staticmethod
    def build(path: Path) -> dict:
        functions, _ = cbuild.load(path, fused._open, compiler=os.environ.get("CC") or "cc",
                                   base_flags=fused._BASE_FLAGS, flag_sets=fused.flag_sets())
        return functions

    def __init__(self, T: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        B, H, D = 1, 8, 64
        self.label = {"dtype": str(dtype).removeprefix("torch."), "T": T}
        self.q, self.k, self.v, self.dy = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))
        self.gate = (0.05 + 0.9 * torch.rand(B, H, T, generator=g)).to(dtype)
        self.settings = OpSettings(**PI_SETTINGS, scale=D**-0.5, dropout_p=0.0, sinks=0)
        self.forward_out = self.backward_out = None

    def time(self, functions: dict) -> dict[str, float]:
        q, k, v, gate, s = self.q, self.k, self.v, self.gate, self.settings
        with mock.patch.object(fused, "_load", return_value=functions):
            if self.forward_out is None:
                self.forward_out = fused.fused_forward(q, k, v, gate, s)
                self.backward_out = fused.fused_backward(self.dy, q, k, v, gate, self.forward_out[1], s,
                                                         want_dgate=True)
            start = time.perf_counter()
            fused.fused_forward(q, k, v, gate, s, out=self.forward_out)
            middle = time.perf_counter()
            fused.fused_backward(self.dy, q, k, v, gate, self.forward_out[1], s, want_dgate=True,
                                 out=self.backward_out)
            end = time.perf_counter()
        return {"fwd": (middle - start) * 1e3, "bwd": (end - middle) * 1e3}


class Step:
    """One call of the compiled decoding step of a tiny GPT's layer 0 (kind `case`, `batch` sequences, position
    512, after three steps of warm-up): the packed arguments of a real one-token step, replayed `calls` times
    a round; µs a call. The step stores the token in the same ring row on every call, so the inputs stay as
    they were."""

    source = "src/piattn/ops/pi/decode_step.c"
    measures = ("step",)
    POSITION = 512

    @staticmethod
    def build(path: Path) -> dict:
        functions, _ = cbuild.load(path, native._open, compiler=os.environ.get("CC") or "cc",
                                   base_flags=native._FLAGS, flag_sets=native.flag_sets())
        return functions

    def __init__(self, case: str, batch: int, calls: int):
        self.label = {"case": case, "batch": batch}
        self.calls = calls
        model = decode_model(case, "tiny")
        self.cache = model.init_cache(batch)
        fill_cache(self.cache, self.POSITION, torch.Generator().manual_seed(0))
        self.packed, self.kept = None, []
        real_functions, real_step = native.functions, decode_native.run

        def recording():  # the first step of layer 0: its packed block
            functions = real_functions()
            if functions is None or self.packed is not None:
                return functions

            def record(packed, function=functions[torch.float32]):
                if self.packed is None:
                    self.packed = packed
                return function(packed)
            return {**functions, torch.float32: record}

        def keeping(*args, **kwargs):  # every step's output and arguments kept alive: the block points to them
            y = real_step(*args, **kwargs)
            self.kept.append((y, args, kwargs))
            return y

        token = torch.zeros(batch, 1, dtype=torch.long)
        with torch.no_grad():
            for _ in range(3):  # warm-up, as decode_bench's: the first steps build the step and settle the cache
                model(token, self.cache)
            with mock.patch.object(native, "functions", recording), \
                    mock.patch.object(decode_native, "run", keeping):
                model(token, self.cache)
        if self.packed is None:
            raise SystemExit(f"--cases: the {case!r} model's step does not run the compiled step "
                             f"({native.unavailable() or 'its layers take the torch ops'})")
        self.model = model  # the weights and the cache the block points to

    def time(self, functions: dict) -> dict[str, float]:
        function, packed = functions[torch.float32], self.packed
        start = time.perf_counter()
        for _ in range(self.calls):
            function(packed)
        return {"step": (time.perf_counter() - start) / self.calls * 1e6}


def _text(revision: str, path: str) -> str:
    """The file at `path` (from the repository's root) at `revision` ("worktree": as it is now)."""
    if revision == "worktree":
        return (REPO / path).read_text()
    try:
        return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"--revisions: git has no {path} at {revision!r}: {err.stderr.strip()}") from err


def built(revision: str, folder: Path, subject) -> dict:
    """The kernels of `subject` (Fused, Step) at `revision`, built (or taken from the cache) as piattn builds
    its own: its source and the files that source includes (`cbuild.includes`: decode_step.c's decode_gate.h),
    each at that revision."""
    texts, pending = {}, [subject.source]
    while pending:
        path = pending.pop(0)
        texts[path] = _text(revision, path)
        for name in cbuild.includes(texts[path].encode()):
            named = str(Path(path).parent / name)
            if named not in texts and named not in pending:
                pending.append(named)
    # one folder per revision's texts, so that a revision's library is cached once (the file includes itself by
    # its own path, and its other files by their names, beside it)
    key = hashlib.sha256("\0".join(texts.values()).encode()).hexdigest()[:12]
    place = folder / f"{Path(subject.source).stem}_{key}"
    place.mkdir(parents=True, exist_ok=True)
    for path, text in texts.items():
        (place / Path(path).name).write_text(text)
    return subject.build(place / Path(subject.source).name)


def problems(args):
    """The problems to time, one at a time (each allocates its inputs)."""
    if args.kernels == "fused":
        for dtype in args.dtypes or ["float32", "bfloat16"]:
            for T in args.lengths or [8192, 16384]:
                yield Fused(T, getattr(torch, dtype))
    else:
        for case in args.cases or ["pi", "local"]:
            for batch in args.batches or [1, 8]:
                yield Step(case, batch, args.calls)


def main(argv=None) -> list[dict]:
    """Run the comparison; returns its rows (one per problem and revision)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--revisions", nargs="+", required=True, help="git revisions, or 'worktree'")
    p.add_argument("--kernels", choices=["fused", "step"], default="fused")
    p.add_argument("--lengths", nargs="+", type=int, help="fused: T (default 8192 16384)")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "float64", "bfloat16", "float16"],
                   help="fused: dtypes (default float32 bfloat16)")
    p.add_argument("--cases", nargs="+", choices=["pi", "pi-union", "ms-pi", "local"],
                   help="step: the GPT kinds (default pi local)")
    p.add_argument("--batches", nargs="+", type=int, help="step: sequences per step (default 1 8)")
    p.add_argument("--calls", type=int, default=2000, help="step: calls per round")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kernel_ab")
    p.add_argument("--name", help="write NAME.md and NAME.json to --out")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or args.calls < 1:
        p.error("--rounds, --threads and --calls must be at least 1")
    other = ("--cases", "--batches") if args.kernels == "fused" else ("--lengths", "--dtypes")
    for flag in other:
        if getattr(args, flag[2:]) is not None:
            p.error(f"{flag} applies to --kernels {'step' if args.kernels == 'fused' else 'fused'}, "
                    f"not {args.kernels}")
    if any(b < 1 for b in args.batches or ()):
        p.error("--batches must be at least 1")
    torch.set_num_threads(args.threads)
    subject = Fused if args.kernels == "fused" else Step
    with tempfile.TemporaryDirectory() as folder:
        kernels = {r: built(r, Path(folder), subject) for r in args.revisions}
    rows = []
    for problem in problems(args):
        times = {r: {m: [] for m in subject.measures} for r in kernels}
        for _ in range(args.rounds):
            for revision, functions in kernels.items():
                for m, value in problem.time(functions).items():
                    times[revision][m].append(value)
        first = args.revisions[0]
        for revision in kernels:
            row = {**problem.label, "revision": revision}
            for m in subject.measures:
                values = sorted(times[revision][m])
                row |= {f"{m} min": values[0], f"{m} median": values[len(values) // 2],
                        f"{m} / first": values[0] / min(times[first][m])}
            rows.append(row)
            print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.name:
        write(args, argv, subject, rows)
    return rows


def write(args, argv, subject, rows: list[dict]) -> None:
    """NAME.md (a table) and NAME.json (the rows, the command and the machine) in --out."""
    command, machine = command_line("benchmarks/kernel_ab.py", argv), machine_info()
    header = list(rows[0])
    if subject is Fused:
        what = ("B 1, H 8, D 64, causal adaptive, window 4, period 16; kernels alone, outputs reused; ms over "
                f"{args.rounds} interleaved rounds")
    else:
        what = (f"the tiny GPT's layer-0 one-token step at position {Step.POSITION} (fp32); µs a call, the min and "
                f"median over {args.rounds} interleaved rounds of {args.calls} calls")
    lines = [f"# {Path(subject.source).name} revisions side by side ({machine['processor']}, "
             f"{args.threads} thread(s), torch {torch.__version__})", "",
             f"`{command}`", "",
             f"{what}; '/ first': min against the first revision's min.", "",
             *markdown_table(header, ([f"{row[h]:.2f}" if isinstance(row[h], float) else row[h] for h in header]
                                      for row in rows))]
    save_results(args.out, args.name, {"command": command, "machine": machine, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
