"""`piattn reach`: coverage, span and minimum depth of local vs π-Attention, and the paper's Fig. rf_app.

    piattn reach --n 48 --window 4 --period 16 --layers 6 [--sinks N] [--bidirectional] [--out PATH.png]
    piattn reach --design --target 256 --window 4 --layers 4 --heads 4 [--out PATH.png]
    piattn reach --periods 5,6,7,8/9,14,19,24 --target 64 --window 4 [--out PATH.png]
    piattn reach --image 7x7 --layers 4 [--window 4] [--period W] [--radius 1] [--stride W] [--out DIR]

With --design or --periods (multi-scale π: a skip period per head and per layer) it compares, over the
lags 1 … --target, local attention, single π = --period, geometric heads and the designed or given
periods (`piattn.analysis.multiscale`), and draws which lag each reaches at which depth. With --image HxW
it shows, per kind (dense, local, π, neighbourhood, strided) and depth, the pixels of an H × W raster-scanned
image that its bottom-centre pixel reaches (`piattn.commands.reach_image`).

`--out` names the figure file (.png, .pdf or .svg), or a folder to write receptive_field.png in: an
existing folder, or any path ending in '/'. The reachability is computed as dense n × n matrix powers
(`piattn.analysis.reachability`): memory grows as n² and work as n³ per layer, so n and the depth are
capped (MAX_N, MAX_WORK, MAX_LAYERS) with a message rather than left to run out of memory or for hours.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..analysis.multiscale import ReachBudgetError, periods_per_layer
from ..analysis.multiscale_report import compare_schedules, format_schedules, plot_schedules
from ..analysis.report import format_summary, plot_receptive_field, reach_summary
from ..config import PI_DEFAULTS
from ..config.training import period_numbers, period_text
from .paths import output_file
from .reach_image import DEFAULT_LAYERS, IMAGE_NAME, run_image

FIGURE_NAME = "receptive_field.png"
DEFAULT_OUT = Path("runs/reach") / FIGURE_NAME
MULTISCALE_NAME = "multiscale_reach.png"
MAX_TARGET = 1 << 16  # lags are bits of Python ints: cheap, but the figure draws one marker per lag
# --design / --periods shift a (target + 1)-bit set once per hop (window + 1 local, one a head) per layer
# for each of the four schedules compared: --layers 512 --heads 4 --window 4 --target 65536 (3·10⁸ bits)
# takes under a second. The geometric heads' periods are 2^h·π: a million heads were a million-bit ints each.
MAX_MULTISCALE_WORK = 1 << 30
MAX_HEADS = 1024
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
    parser.add_argument("--period", type=int, default=None,
                        help=f"skip distance π, >= 1 (default {PI_DEFAULTS.period}; with --image the width W)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"depth L, 1 … {MAX_LAYERS}, and n³·L at most {MAX_N}³·8 (default 6; with --image "
                        f"{DEFAULT_LAYERS})")
    parser.add_argument("--sinks", type=int, default=0,
                        help=f"sink keys (the first N positions, seen by every query): what they add; 0 … n, "
                        f"with n <= {MAX_N_SINKS} (default 0)")
    parser.add_argument("--bidirectional", action="store_true", help="bidirectional instead of causal")
    parser.add_argument("--out", default=None,
                        help=f"figure file (.png, .pdf, .svg), or a folder (existing, or ending in /) to write "
                        f"{FIGURE_NAME} ({MULTISCALE_NAME} with --design/--periods) in (default runs/reach/)")
    image = parser.add_argument_group("2D reach on a raster-scanned image (causal)")
    image.add_argument("--image", default=None, metavar="HxW",
                       help=f"the image's height and width: per kind and depth, the pixels its bottom-centre pixel "
                       f"reaches (text, and {IMAGE_NAME} in --out)")
    image.add_argument("--radius", type=int, default=1, help="neighbourhood attention's radius, >= 0 (default 1)")
    image.add_argument("--stride", type=int, default=None,
                       help="strided attention's stride l, >= 1 (default: the width W)")
    multi = parser.add_argument_group("multi-scale π (a skip period per head and per layer)")
    how = multi.add_mutually_exclusive_group()
    how.add_argument("--design", action="store_true",
                     help="propose per-layer head periods that reach every lag 1 … --target within --layers")
    how.add_argument("--periods", default=None, metavar="SPEC",
                     help="periods to analyse: one int (every head), H ints for every layer ('8,16,32,64'), or "
                     "L groups of H ints separated by '/' ('5,6,7,8/9,14,19,24')")
    multi.add_argument("--heads", type=int, default=4, help="heads per layer H, >= 1 (default 4)")
    multi.add_argument("--target", type=int, default=None,
                       help=f"the longest lag to reach and report, 1 … {MAX_TARGET} (required with --design or "
                       "--periods)")


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


def check_multiscale_work(window: int, n_layer: int, n_head: int, target: int) -> None:
    """ValueError naming the flags and MAX_HEADS or MAX_MULTISCALE_WORK where --design / --periods would
    take minutes or more (see MAX_MULTISCALE_WORK)."""
    if n_head > MAX_HEADS:
        raise ValueError(f"--heads must be <= {MAX_HEADS} (MAX_HEADS) with --design or --periods, got {n_head}")
    work = n_layer * (window + 1 + n_head) * (target + 1)
    if work > MAX_MULTISCALE_WORK:
        raise ValueError(f"--layers {n_layer} × (--window {window} + 1 + --heads {n_head}) × (--target {target} + 1) "
                         f"= {work:,} is more than MAX_MULTISCALE_WORK = 2^{MAX_MULTISCALE_WORK.bit_length() - 1} "
                         "bits shifted; take a smaller --target, --window, --layers or --heads")


def figure_path(out: str | None, name: str = FIGURE_NAME) -> Path:
    """The figure file --out means: inside it when it is a folder (existing, or written with a trailing /),
    else the file itself, which must end in one of FORMATS (matplotlib would otherwise write `out.png` and
    the path reported would not exist). Checked to be writable before any work."""
    if out is None:
        return output_file(DEFAULT_OUT.parent / name, "--out")
    if not out.strip():
        raise ValueError(f"--out must name a figure file or a folder, got {out!r}")
    path = Path(out)
    if path.is_dir() or out.endswith(("/", os.sep)):
        path = path / name
    elif path.suffix.lower() not in FORMATS:
        raise ValueError(f"--out {out}: a figure file must end in {', '.join(FORMATS)}; a folder must exist or "
                         "end in /")
    return output_file(path, "--out")


def parse_periods(spec: str, n_layer: int, n_head: int):
    """--periods SPEC -> a Schedule of n_layer layers: `period_numbers`' syntax, one int (every head of every
    layer), H ints (every layer; H replaces --heads) or n_layer '/'-separated groups of H ints."""
    value = period_numbers(spec, "--periods")
    heads = n_head if isinstance(value, int) else len(value if isinstance(value[0], int) else value[0])
    try:
        return periods_per_layer(value, n_layer, heads)
    except ValueError as e:
        raise ValueError(f"--periods {spec} with --layers {n_layer}: {e}") from None


def run_multiscale(args: argparse.Namespace) -> int:
    """--design / --periods: the schedule table and figure over lags 1 … --target."""
    if args.target is None or not 1 <= args.target <= MAX_TARGET:
        raise ValueError(f"--target must be in 1 … {MAX_TARGET} with --design or --periods, got {args.target}")
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {args.heads}")
    if args.window < 0 or args.period < 1 or not 1 <= args.layers <= MAX_LAYERS:
        check_sizes(args)  # the same messages as the single-period report
    given = None if args.periods is None else parse_periods(args.periods, args.layers, args.heads)
    check_multiscale_work(args.window, args.layers, max(args.heads, len(given[0]) if given else 0), args.target)
    out = figure_path(args.out, MULTISCALE_NAME)
    try:
        rows, studied = compare_schedules(args.window, args.layers, args.heads, args.period, args.target, given)
    except ReachBudgetError as e:
        raise ValueError(f"--layers {args.layers}, --heads {args.heads}, --window {args.window}, --period "
                         f"{args.period}: {e}; take fewer --layers or --heads") from None
    print(format_schedules(rows, args.window, args.target))
    if given is None:  # the designed periods, ready for a training run
        print(f"\npiattn train -> --period {period_text(studied)} --window {args.window} --n-layer {args.layers} "
              f"--n-head {args.heads}")
    try:
        path = plot_schedules(rows, args.window, args.target, out)
    except ImportError as e:
        print(f"\nno figure: {e}")
        return 0
    print(f"\nfigure: {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.image is not None:
        if args.design or args.periods is not None:
            raise ValueError("--image does not combine with --design or --periods")
        return run_image(args, lambda name: figure_path(args.out, name))
    # the defaults --image replaces by the image's own (π = W, fewer layers)
    args.period = PI_DEFAULTS.period if args.period is None else args.period
    args.layers = 6 if args.layers is None else args.layers
    if args.design or args.periods is not None:
        return run_multiscale(args)
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
