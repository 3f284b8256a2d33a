"""The `piattn` command: one subcommand per job, each a module of `piattn.commands`."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from . import __version__
from .commands.common import DefaultsHelpFormatter, check_threads_fit

# subcommand -> (module with `add_arguments(parser)` and `run(args) -> int`, one-line help)
COMMANDS = {
    "reach": ("piattn.commands.reach", "reachability, coverage and minimum depth; writes the figure"),
    "demo": ("piattn.commands.demo", "the main job on built-in data: analysis, reach task, backend comparison"),
    "train": ("piattn.commands.train", "train a language model or a long-range classifier; checkpoints, exact resume"),
    "eval": ("piattn.commands.eval", "score a checkpoint: bits per byte and perplexity, or accuracy"),
    "generate": ("piattn.commands.generate", "continue a prompt with a trained language model, streaming tokens"),
    "inspect": ("piattn.commands.inspect", "inside a checkpoint: attention mass per layer, token flow, gate dynamics"),
    "convert-eval": ("piattn.commands.convert_eval",
                     "a pretrained LM converted to π-Attention untrained: perplexity, or passkey retrieval by "
                     "distance (--task passkey), against dense, local and sinks"),
    "data": ("piattn.commands.data", "fetch the data the README's examples read: the Gutenberg books"),
}

# Options whose value is a list of numbers that may start with '-' ('-1,16'): argparse takes such a word for
# an option and says "expected one argument"; joined as --period=-1,16 it reaches piattn's own check, which
# says what the option allows.
NUMBER_LIST_OPTIONS = ("--period", "--periods")
_NUMBER_LIST = re.compile(r"-\d")


def join_number_lists(argv: list[str]) -> list[str]:
    """argv with `OPTION VALUE` written `OPTION=VALUE` for the NUMBER_LIST_OPTIONS whose value starts with
    '-' and a number: argparse then hands the value over instead of refusing it. A value that is not a
    number ('--period --steps') is left to argparse's own error."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in NUMBER_LIST_OPTIONS and _NUMBER_LIST.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `piattn ARGV`: every subcommand, with the arguments of the one ARGV names (only that
    command's module is imported: start-up stays fast)."""
    parser = argparse.ArgumentParser(prog="piattn", description="π-Attention toolkit")
    parser.add_argument("--version", action="version", version=f"piattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        # every flag's --help line says its default (unless its text already does)
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter)
        p.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = join_number_lists(sys.argv[1:] if argv is None else argv)
    prog = " ".join(["piattn", *[a for a in argv if not a.startswith("-")][:1]])  # "piattn train"
    try:  # start-up (imports, parsing) included: Ctrl-C at any point is one line, not a traceback
        args = build_parser(argv).parse_args(argv)
        check_threads_fit(getattr(args, "threads", None))  # every command taking --threads, before its work
        return importlib.import_module(args._module).run(args) or 0
    except ValueError as e:  # bad input reaches the user as one line, not a traceback
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what was saved has been said already; no traceback after it
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
