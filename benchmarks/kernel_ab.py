"""Two or more revisions of the fused CPU kernels (`fused_cpu.c`) side by side: the forward and the backward
kernels alone (outputs allocated once and reused, no autograd), the revisions interleaved round by round in
one process, so that a busy machine slows them alike. The way to tell whether a change of the C source is
faster: differences of a few percent drown in the run-to-run noise of separate runs.

    python benchmarks/kernel_ab.py --revisions HEAD~1 HEAD --lengths 8192 16384 --dtypes float32 bfloat16

A revision is a git revision of this repository (its `src/piattn/ops/pi/fused_cpu.c`) or `worktree` (the file
as it is now). Each is built as `fused.py` builds its own (same compiler, flags and cache) and called through
today's `fused.py`: the revisions compared must share the C entry points (`fused._Call`'s layout).
Prints, and writes with --name to --out, the min and the median over rounds of each kernel, in ms, and each
revision's min as a ratio to the first's. B 1, H 8, D 64, causal adaptive, window 4, period 16 (cpu_bench's
settings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from piattn.ops.pi import cbuild, fused
from piattn.ops.pi.settings import OpSettings

sys.path.insert(0, str(Path(__file__).parent))
from cpu_bench import SETTINGS  # noqa: E402  (the settings every CPU benchmark times)

REPO = Path(__file__).resolve().parents[1]
SOURCE = "src/piattn/ops/pi/fused_cpu.c"
DIRECTIONS = ("fwd", "bwd")


def kernels(revision: str, folder: Path) -> dict:
    """The kernels of `revision`, built (or taken from the cache) as fused.py builds its own."""
    if revision == "worktree":
        text = (REPO / SOURCE).read_text()
    else:
        try:
            text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
        except subprocess.CalledProcessError as err:
            raise SystemExit(f"--revisions: git has no {SOURCE} at {revision!r}: {err.stderr.strip()}") from err
    # named by its text, so a revision's library is cached once (the file includes itself by its own path)
    source = folder / f"fused_cpu_{hashlib.sha256(text.encode()).hexdigest()[:12]}.c"
    source.write_text(text)
    functions, _ = cbuild.load(source, fused._open, compiler=os.environ.get("CC") or "cc", base_flags=fused._BASE_FLAGS,
                               flag_sets=fused.flag_sets())
    return functions


class Call:
    """One problem's inputs and outputs (allocated once), and the kernels of a revision timed on them."""

    def __init__(self, T: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        B, H, D = 1, 8, 64
        self.q, self.k, self.v, self.dy = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))
        self.gate = (0.05 + 0.9 * torch.rand(B, H, T, generator=g)).to(dtype)
        self.settings = OpSettings(**SETTINGS, scale=D**-0.5, dropout_p=0.0, sinks=0)
        self.forward_out = self.backward_out = None

    def time(self, functions: dict) -> dict[str, float]:
        """ms of each kernel of `functions` (fwd, then bwd on its statistics)."""
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


def main(argv=None) -> list[dict]:
    """Run the comparison; returns its rows (one per dtype, length and revision)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--revisions", nargs="+", required=True, help="git revisions, or 'worktree'")
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--name", help="write NAME.md and NAME.json to --out")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        built = {r: kernels(r, Path(folder)) for r in args.revisions}
    rows = []
    for dtype_name in args.dtypes:
        for T in args.lengths:
            call = Call(T, getattr(torch, dtype_name))
            times = {r: {d: [] for d in DIRECTIONS} for r in built}
            for _ in range(args.rounds):
                for revision, functions in built.items():
                    for d, ms in call.time(functions).items():
                        times[revision][d].append(ms)
            first = args.revisions[0]
            for revision in built:
                row = {"dtype": dtype_name, "T": T, "revision": revision}
                for d in DIRECTIONS:
                    ms = sorted(times[revision][d])
                    row |= {f"{d} min": ms[0], f"{d} median": ms[len(ms) // 2],
                            f"{d} / first": ms[0] / min(times[first][d])}
                rows.append(row)
                print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.name:
        write(args, rows)
    return rows


def write(args, rows: list[dict]) -> None:
    """NAME.md (a table) and NAME.json (the rows and the command) in --out."""
    command = "python benchmarks/kernel_ab.py " + " ".join(sys.argv[1:])
    header = ["dtype", "T", "revision", *(f"{d} {s}" for d in DIRECTIONS for s in ("min", "median", "/ first"))]
    lines = [f"# fused_cpu.c revisions side by side ({platform.processor() or platform.machine()}, "
             f"{args.threads} thread(s), torch {torch.__version__})", "",
             f"`{command}`", "",
             f"B 1, H 8, D 64, causal adaptive, window 4, period 16; kernels alone, outputs reused; ms over "
             f"{args.rounds} interleaved rounds; '/ first': min against the first revision's min.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[h]:.2f}" if isinstance(row[h], float) else str(row[h])
                                       for h in header) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{args.name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
