"""Run a job on N real processes over Gloo (CPU) and collect what each rank returns.

`run_ranks(world, job, payload)` spawns `world` processes, each joins one Gloo group (a file store, no
ports) and calls `JOBS[job](rank, world, payload)`; its JSON-able result, or its traceback, comes back
per rank. A process still alive after `deadline` seconds is killed and reported as hung, so a test of
"raises instead of hanging" fails instead of freezing the suite.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path


class RankFailure(AssertionError):
    pass


def _entry(rank: int, world: int, store: str, out: str, job: str, payload) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import sp_jobs
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result = {"ok": sp_jobs.JOBS[job](rank, world, payload)}
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = {"error": traceback.format_exc()}
    path.write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _context():
    """Fresh processes (no inherited OpenMP or allocator state) forked from one server that imported torch
    once, where the platform has forkserver; else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "piattn", "sp_jobs"])
    return ctx


def run_ranks(world: int, job: str, payload=None, deadline: float = 120.0) -> list:
    """Each rank's result, in rank order; RankFailure if a rank raised or hung."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, tmp, job, payload)) for r in range(world)]
        for p in procs:
            p.start()
        hung, end = [], time.monotonic() + deadline
        for r, p in enumerate(procs):
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                hung.append(r)
        for r in hung:
            procs[r].kill()
            procs[r].join()
        if hung:
            raise RankFailure(f"ranks {hung} of job {job!r} hung (killed after {deadline} s)")
        results = []
        for r in range(world):
            path = Path(tmp) / f"rank{r}.json"
            if not path.exists():
                raise RankFailure(f"rank {r} of job {job!r} died (exit code {procs[r].exitcode})")
            result = json.loads(path.read_text())
            if "error" in result:
                raise RankFailure(f"rank {r} of job {job!r} raised:\n{result['error']}")
            results.append(result["ok"])
        return results
