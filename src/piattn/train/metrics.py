"""Where training numbers go: `metrics.jsonl` in the run directory, TensorBoard when it is installed.

One JSON object per line, with `step`, `split` ("train" or an evaluation split) and the values. A resumed
run first drops the records of steps after its checkpoint (logged by the run it continues, then lost) and
appends, so the lines of a run interrupted and resumed read as one run. A last line cut short by a crash
mid-write is not a record: readers skip it and a resumed run drops it.

`plot_metrics` draws the file's curves (loss, validation metrics, learning rate) as `metrics.png` beside it;
the trainer calls it when a run ends.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from ..safe_files import LinkRefused, atomic_write_text, atomic_writer, link_refusal, open_append

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
# validation scores `plot_metrics` draws beside the loss, the first one a record has
SCORES = ("accuracy", "i2t_r1", "t2i_r1")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: CUDA `max_memory_allocated`, or the peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


class MetricsWriter:
    """Append metrics records to `run_dir/metrics.jsonl` (and TensorBoard), on the writing rank only.

    after_step: the step training continues from; records of later steps already in the file are dropped.
    """

    def __init__(self, run_dir: Path, enabled: bool = True, after_step: int = 0):
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tensorboard = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            # A run folder made elsewhere may hold links at these names: never written through (safe_files).
            if self.path.is_symlink():
                raise link_refusal(self.path, "training")
            if self.path.exists():
                kept = [r for r in _read_records(self.path) if r["step"] <= after_step]
                atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            try:
                self._file = open_append(self.path)
            except LinkRefused:  # put there since the check above
                raise link_refusal(self.path, "training") from None
            self.tensorboard = _tensorboard_writer(run_dir / "tensorboard")

    def log(self, step: int, split: str, values: dict) -> None:
        """Write one record: {"step", "split", "time", **values}."""
        if not self.enabled:
            return
        record = {"step": step, "split": split, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _tensorboard_writer(log_dir: Path):
    """A SummaryWriter, or None when `torch.utils.tensorboard` cannot be imported (tensorboard not installed)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(log_dir))


def _parse_record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "step" in record else None


def _read_records(path: Path) -> list[dict]:
    """The records of a metrics file; an invalid last line (a write cut by a crash) is skipped.

    Any other invalid line raises ValueError naming the file and the line number.
    """
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip(" \t\r\x00")]
    records = []
    for i, (number, line) in enumerate(numbered):
        record = _parse_record(line)
        if record is None:
            if i == len(numbered) - 1:
                break  # the last line, cut short by a crash mid-write: not a record
            raise ValueError(f"{path}: line {number} is not a JSON record with a step: {line[:80]!r}")
        records.append(record)
    return records


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of `run_dir/metrics.jsonl`, in order (a last line cut short by a crash is skipped)."""
    return _read_records(Path(run_dir) / METRICS_FILE)


def plot_metrics(run_dir: Path, path: Path | None = None) -> Path | None:
    """Draw `run_dir/metrics.jsonl` into `path` (default `run_dir/metrics.png`): training and validation loss
    by step (with any other validation score, e.g. accuracy, on a second axis), and the learning rate.

    Returns the PNG's path, or None when the file holds no training record yet. ImportError without
    matplotlib (the `plot` extra).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global state, no display
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    train = [r for r in records if r["split"] == "train"]
    if not train:
        return None
    validation = [r for r in records if r["split"] == "validation"]
    fig = Figure(figsize=(10, 3.6))
    loss_ax, lr_ax = fig.subplots(1, 2)
    loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train loss")
    if validation and "loss" in validation[0]:
        loss_ax.plot([r["step"] for r in validation], [r["loss"] for r in validation], "o-", ms=3,
                     label="validation loss")
    # a task's validation score beside the loss, on its own axis (bits per byte of a language model
    # would only repeat the loss's shape)
    scores = [k for k in SCORES if validation and k in validation[0]]
    if scores:
        score_ax = loss_ax.twinx()
        score_ax.plot([r["step"] for r in validation], [r.get(scores[0]) for r in validation], "s--", ms=3,
                      color="tab:green", label=f"validation {scores[0]}")
        score_ax.set_ylabel(scores[0])
        score_ax.legend(loc="upper right", fontsize=8)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.legend(loc="upper left" if scores else "best", fontsize=8)
    loss_ax.set_title(f"{run_dir.name}: loss", fontsize=9)
    lr_ax.plot([r["step"] for r in train], [r["lr"] for r in train], lw=1, color="tab:purple")
    lr_ax.set_xlabel("step")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_title("learning rate (at each logged step)", fontsize=9)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    fig.subplots_adjust(left=0.07, right=0.93, wspace=0.3, bottom=0.14, top=0.9)
    path = run_dir / PLOT_FILE if path is None else Path(path)
    with atomic_writer(path) as f:  # a reader never sees half a PNG, a link at `path` is replaced
        FigureCanvasAgg(fig).print_png(f)
    return path
