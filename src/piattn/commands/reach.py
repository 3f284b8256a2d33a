"""`piattn reach`: coverage, span and minimum depth of local vs π-Attention, and the paper's Fig. rf_app.

    piattn reach --n 48 --window 4 --period 16 --layers 6 [--sinks N] [--bidirectional] [--out PATH.png]

`--out` names the figure file (.png, .pdf or .svg), or a folder to write receptive_field.png in: an
existing folder, or any path ending in '/'. The reachability is computed as dense n × n matrix powers
(`piattn.analysis.reachability`): memory grows as n² and work as n³ per layer, so n and the depth are
capped (MAX_N, MAX_WORK, MAX_LAYERS) with a message rather than left to run out of memory or for hours.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..analysis.report import format_summary, plot_receptive_field, reach_summary
from ..config import PI_DEFAULTS
from .paths import output_file

FIGURE_NAME = "receptive_field.png"
DEFAULT_OUT = Path("runs/reach") / FIGURE_NAME
FORMATS = (".png", ".pdf", ".svg")  # what matplotlib writes without extra packages
# n = 4096 holds a few 64 MiB matrices and takes about a minute at depth 8 on one CPU core; the work is
# about n³ per layer per matrix, so MAX_WORK allows that depth at n = 4096 and proportionally more below.
MAX_N = 4096
MAX_WORK = 8 * MAX_N**3
MAX_LAYERS = 512
# With sinks the depth at which each token reaches a sink is searched layer by layer up to n (n⁴ work):
# 75 s at n = 1024 (causal, one core).
MAX_N_SINKS = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=48, help=f"sequence length, 1 … {MAX_N} (default 48)")
    parser.add_argument("--window", type=int, default=PI_DEFAULTS.window,
                        help=f"local window k, >= 0 (default {PI_DEFAULTS.window})")
    parser.add_argument("--period", type=int, default=PI_DEFAULTS.period,
                        help=f"skip distance π, >= 1 (default {PI_DEFAULTS.period})")
    parser.add_argument("--layers", type=int, default=6,
                        help=f"depth L, 1 … {MAX_LAYERS}, and n³·L at most {MAX_N}³·8 (default 6)")
    parser.add_argument("--sinks", type=int, default=0,
                        help=f"sink keys (the first N positions, seen by every query): what they add; 0 … n, "
                        f"with n <= {MAX_N_SINKS} (default 0)")
    parser.add_argument("--bidirectional", action="store_true", help="bidirectional instead of causal")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help=f"figure file (.png, .pdf, .svg), or a folder (existing, or ending in /) to write "
                        f"{FIGURE_NAME} in (default {DEFAULT_OUT})")


def check_sizes(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a value the analysis cannot take, or one it would take hours or more
    memory than the machine has for."""
    n, layers, sinks = args.n, args.layers, args.sinks
    if not 1 <= n <= MAX_N:
        raise ValueError(f"--n must be in 1 … {MAX_N} (the reachability is an n × n matrix), got {n}")
    if args.window < 0:
        raise ValueError(f"--window must be >= 0 (0: the skip only), got {args.window}")
    if args.period < 1:
        raise ValueError(f"--period must be >= 1, got {args.period}")
    if not 1 <= layers <= MAX_LAYERS:
        raise ValueError(f"--layers must be in 1 … {MAX_LAYERS}, got {layers}")
    if n**3 * layers > MAX_WORK:
        raise ValueError(f"--layers {layers} at --n {n} is too much work (n³ per layer per matrix); at --n {n} "
                         f"take at most --layers {MAX_WORK // n**3}, or a smaller --n")
    if not 0 <= sinks <= n:
        raise ValueError(f"--sinks must be in 0 … --n ({n}), got {sinks}")
    if sinks and n > MAX_N_SINKS:
        raise ValueError(f"--n must be <= {MAX_N_SINKS} with --sinks (the sink depths take n⁴ work), got {n}")


def figure_path(out: str) -> Path:
    """The figure file --out means: inside it when it is a folder (existing, or written with a trailing /),
    else the file itself, which must end in one of FORMATS (matplotlib would otherwise write `out.png` and
    the path reported would not exist). Checked to be writable before any work."""
    if not out.strip():
        raise ValueError(f"--out must name a figure file or a folder, got {out!r}")
    path = Path(out)
    if path.is_dir() or out.endswith(("/", os.sep)):
        path = path / FIGURE_NAME
    elif path.suffix.lower() not in FORMATS:
        raise ValueError(f"--out {out}: a figure file must end in {', '.join(FORMATS)}; a folder must exist or "
                         "end in /")
    return output_file(path, "--out")


def run(args: argparse.Namespace) -> int:
    check_sizes(args)
    out = figure_path(args.out)
    causal = not args.bidirectional
    print(format_summary(reach_summary(args.n, args.window, args.period, args.layers, causal, sinks=args.sinks)))
    try:
        path = plot_receptive_field(args.n, args.window, args.period, args.layers, out, causal, args.sinks)
    except ImportError as e:
        print(f"\nno figure: {e}")
        return 0
    print(f"\nfigure: {path}")
    return 0
