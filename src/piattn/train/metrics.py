"""Where training numbers go: `metrics.jsonl` in the run directory, TensorBoard when it is installed.

One JSON object per line, with `step`, `split` ("train" or an evaluation split) and the values. A resumed
run first drops the records of steps after its checkpoint (logged by the run it continues, then lost) and
appends, so the lines of a run interrupted and resumed read as one run. A last line cut short by a crash
mid-write is not a record: readers skip it and a resumed run drops it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

METRICS_FILE = "metrics.jsonl"


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
            if self.path.exists():
                kept = [r for r in _read_records(self.path) if r["step"] <= after_step]
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, self.path)
            self._file = self.path.open("a")
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
