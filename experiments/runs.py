"""What every experiment script does per run: `piattn train`, then `piattn eval` on the test split, once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def train_and_test(run: Path, train_argv: list[str], eval_argv: list[str] = ()) -> dict:
    """The test metrics of `run`; trains (`piattn train` + train_argv) and scores it first unless that was done.

    A run counts as done once its `eval/*_test.json` exists, so an interrupted sweep resumes where it stopped, a
    run cut short from its latest checkpoint.
    """
    if not list(run.glob("eval/*_test.json")):
        start = time.perf_counter()
        piattn = [sys.executable, "-m", "piattn.cli"]
        # One thread per run: the scripts run several at a time, and two-thread runs sharing a few cores
        # spend their time in OpenMP's spin-waits (several times slower).
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # a run cut short (the script stopped) continues from its latest checkpoint, with the same flags
        resume = ["--resume"] if (run / "checkpoints" / "latest").exists() else []
        subprocess.run([*piattn, *train_argv, *resume], check=True, stdout=subprocess.DEVNULL, env=env)
        subprocess.run([*piattn, "eval", "--checkpoint", str(run), "--use-stored-data", "--split", "test", *eval_argv],
                       check=True,
                       stdout=subprocess.DEVNULL, env=env)
        print(f"{run.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return json.loads(next(run.glob("eval/*_test.json")).read_text())


def timed_or_exit(key: str, log: Path, call):
    """(call(), its seconds): one run of a script that runs several at a time. A trainer or evaluator that fails
    (`train_and_test`'s CalledProcessError) stops the script with one line naming the run and the log that holds
    its messages."""
    start = time.perf_counter()
    try:
        return call(), time.perf_counter() - start
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"{key} failed (exit {err.returncode}); its messages are in {log}") from None


def write_json(path: Path, data) -> None:
    """`data` as JSON at `path`, through a temporary file renamed over it: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(temporary, path)
