"""Checkpoints written atomically, kept N deep, and everything an exact resume needs.

Layout of a run directory:

    runs/NAME/checkpoints/latest            text file: the name of the newest complete checkpoint
    runs/NAME/checkpoints/step_00001000/    model.safetensors, trainer_state.pt, config.json, tokenizer/

A checkpoint is written into a hidden temporary folder and renamed into place once complete; then `latest`
is replaced through `os.replace`. A crash at any point leaves the previous `latest` and what it names intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"
LATEST = "latest"
PREFIX = "step_"


def capture_rng() -> dict:
    """This process's random states: torch CPU and CUDA, Python's `random`, NumPy's global generator.

    NumPy's key array is stored as a tensor, so the state loads with `torch.load(weights_only=True)`.
    """
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"pos": int(np_state["state"]["pos"]), "key": torch.from_numpy(np_state["state"]["key"].copy()),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
    }


def restore_rng(state: dict) -> None:
    """Put back the random states `capture_rng` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937", "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"],
                         "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]}})


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or None when there is none yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    return root / pointer.read_text().strip()


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name + "\n")
    _fsync(tmp)
    os.replace(tmp, root / LATEST)
    _fsync(root)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def save_checkpoint(root: Path, step: int, *, model: nn.Module, trainer_state: dict, config: dict,
                    save_assets: Callable[[Path], None] | None = None, keep: int = 3) -> Path:
    """Write checkpoint `step` under `root` atomically, point `latest` at it, keep the newest `keep`.

    model: the plain (unwrapped) model; tied weights are stored once (safetensors `save_model`).
    trainer_state: optimizer/scheduler/loader/RNG states and counters (saved with `torch.save`).
    config: JSON-able dict (model config and training arguments).
    save_assets: writes extra files into the folder (the tokenizer), before it becomes visible.
    """
    if keep < 1:
        raise ValueError(f"--keep must be >= 1, got {keep!r}")
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if final.exists() and read_latest(root) == final:
        return final  # written by this run at this very step: the state is the same, nothing to add
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_model(model, str(tmp / MODEL_FILE))
        torch.save(trainer_state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if save_assets is not None:
            save_assets(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        if final.exists():  # a complete but unreferenced leftover of an interrupted run: replace it
            trash = root / f".trash-{final.name}-{os.getpid()}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash)
        else:
            os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_latest(root, final.name)
    for old in list_checkpoints(root)[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_checkpoint(path: Path | str, flag: str = "--checkpoint") -> Path:
    """The checkpoint folder meant by `path`: a checkpoint itself, a checkpoints root, or a run directory."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / MODEL_FILE).is_file() and (candidate / STATE_FILE).is_file():
            return candidate
        latest = read_latest(candidate)
        if latest is not None and (latest / MODEL_FILE).is_file():
            return latest
    raise ValueError(f"{flag}: no checkpoint at {path} (expected a run directory with checkpoints/latest, "
                     f"or a folder holding {MODEL_FILE})")


def read_config(ckpt: Path) -> dict:
    """The config.json of a checkpoint."""
    return json.loads((ckpt / CONFIG_FILE).read_text())


def load_weights(model: nn.Module, ckpt: Path) -> None:
    """Load model.safetensors into `model` (strict; the tied head is restored from the embedding)."""
    missing, unexpected = load_model(model, str(ckpt / MODEL_FILE), strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt} does not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")


def load_trainer_state(ckpt: Path) -> dict:
    """trainer_state.pt of a checkpoint, on the CPU."""
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
