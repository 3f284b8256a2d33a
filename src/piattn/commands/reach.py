"""`piattn reach`: coverage, span and minimum depth of local vs π-Attention, and the paper's Fig. rf_app.

    piattn reach --n 48 --window 4 --period 16 --layers 6 [--sinks N] [--bidirectional] [--out PATH.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis.report import format_summary, plot_receptive_field, reach_summary
from ..config import PI_DEFAULTS

DEFAULT_OUT = Path("runs/reach/receptive_field.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=48, help="sequence length (default 48)")
    parser.add_argument("--window", type=int, default=PI_DEFAULTS.window,
                        help=f"local window k (default {PI_DEFAULTS.window})")
    parser.add_argument("--period", type=int, default=PI_DEFAULTS.period,
                        help=f"skip distance π (default {PI_DEFAULTS.period})")
    parser.add_argument("--layers", type=int, default=6, help="depth L (default 6)")
    parser.add_argument("--sinks", type=int, default=0,
                        help="sink keys (the first N positions, seen by every query): what they add (default 0)")
    parser.add_argument("--bidirectional", action="store_true", help="bidirectional instead of causal")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"figure path (default {DEFAULT_OUT})")


def run(args: argparse.Namespace) -> int:
    causal = not args.bidirectional
    if args.sinks < 0:
        raise ValueError(f"--sinks must be >= 0, got {args.sinks}")
    print(format_summary(reach_summary(args.n, args.window, args.period, args.layers, causal, sinks=args.sinks)))
    try:
        path = plot_receptive_field(args.n, args.window, args.period, args.layers, args.out, causal, args.sinks)
    except ImportError as e:
        print(f"\nno figure: {e}")
        return 0
    print(f"\nfigure: {path}")
    return 0
