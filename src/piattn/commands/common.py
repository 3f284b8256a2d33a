"""What the commands share: a help formatter that shows each flag's default, and the `--threads` flag.

    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)   # `piattn.cli` does this
    add_threads_argument(parser)
    ...
    with torch_threads(args.threads, args.device):
        ...   # the command's work

Kept free of torch at import: `piattn.cli` builds every subcommand's parser from here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

THREADS_HELP = ("torch CPU threads (default: 1 when running on the CPU, where torch's default of one per core "
                "competes with every other process: a small training run on a loaded 2-core machine took "
                "578 s with it against 27 s with one thread; torch's own choice with a GPU)")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Ends a flag's help with "(default: X)" unless the help already speaks of its default.

    Like `argparse.ArgumentDefaultsHelpFormatter`, without "(default: None)" and "(default: False)" (a
    flag off unless given), and without a second default where the text already says one.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.required or "default" in text.lower() or default is None
                or default is False or default is argparse.SUPPRESS):
            return text
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default))
        return f"{text} (default: {str(default).replace('%', '%%')})"


def available_cores() -> int:
    """The cores this process may run on: its affinity mask where the platform has one (a container or
    `taskset` narrows it below os.cpu_count()), else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def add_threads_argument(parser: argparse._ActionsContainer) -> None:
    """`--threads N`, checked against the cores by `check_threads_fit` and applied by `torch_threads`."""
    parser.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)


def check_threads_fit(threads: int | None) -> None:
    """ValueError naming --threads for more threads than the cores this process may run on: the extra ones
    only take turns on them (see THREADS_HELP). None (the default) passes; below 1 is `torch_threads`'s."""
    cores = available_cores()
    if threads is not None and threads > cores:
        raise ValueError(f"--threads {threads} is more than the {cores} core{'s' * (cores > 1)} this process may "
                         f"run on; take at most --threads {cores}")


def default_threads(device: str) -> int | None:
    """The thread count `--threads` means when not given: 1 on the CPU, None (torch's choice) on a GPU."""
    import torch

    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return None if on_gpu else 1


@contextlib.contextmanager
def torch_threads(threads: int | None, device: str = "cpu") -> Iterator[int]:
    """Within the block torch uses `threads` intra-op threads (None: `default_threads(device)`); the count
    before is restored after it, so that a command called in-process (tests, notebooks) leaves none behind.
    Yields the count in force. ValueError naming --threads below 1."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    before = torch.get_num_threads()
    wanted = threads if threads is not None else default_threads(device)
    if wanted is not None:
        torch.set_num_threads(wanted)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def child_threads(threads: int | None) -> Iterator[None]:
    """Within the block, Python processes started from here use `threads` torch threads (OMP_NUM_THREADS,
    which torch reads at start-up); nothing changes when None."""
    if threads is None:
        yield
        return
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before

