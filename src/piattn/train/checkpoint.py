"""Checkpoints written atomically, kept N deep, and everything an exact resume needs.

Layout of a run directory:

    runs/NAME/checkpoints/latest            text file: the name of the newest complete checkpoint
    runs/NAME/checkpoints/step_00001000/    model.safetensors, trainer_state.pt, config.json, tokenizer/

A checkpoint is written into a hidden temporary folder and renamed into place once complete; then `latest`
is replaced through `os.replace`. A crash at any point leaves the previous `latest` and what it names intact;
the hidden `.tmp-*` / `.trash-*` folders a killed save leaves behind are removed by `clean_incomplete`.

Reading is defensive: a missing, truncated or corrupt file, or a `latest` that names no complete checkpoint
of this root, raises one ValueError whose one-line message names the file or folder and what is wrong.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from ..safe_files import TEMP_PREFIX, Folder, fsync_path, run_subfolder

MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"
LATEST = "latest"
PREFIX = "step_"
STEP_NAME = re.compile(rf"{PREFIX}\d{{1,20}}")  # the only names `latest` may hold: no separators, no '..'
# hidden entries of a save that was killed before it finished: its folders and the temporary of `latest`
LEFTOVER_PREFIXES = (TEMP_PREFIX, ".trash-")
POINTER_MAX_BYTES = 256


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


def _one_line(err: BaseException, limit: int = 200) -> str:
    """An exception as a short single line: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= limit else text[:limit] + "…"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (MODEL_FILE, STATE_FILE, CONFIG_FILE))


def _existing_names(root: Path) -> str:
    names = [p.name for p in list_checkpoints(root) if _is_complete(p)]
    return f"complete checkpoints here: {', '.join(names)}" if names else "none exist"


def _pointer_name(root: Path) -> str | None:
    """The raw name `root/latest` holds (stripped, undecoded bytes replaced), or None without a pointer."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    with open(pointer, "rb") as f:
        data = f.read(POINTER_MAX_BYTES + 1)
    return data.decode("utf-8", errors="replace").strip()


def read_latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or None when there is none yet.

    The name is data from disk: it must be a `step_<digits>` folder directly under `root` (never a path
    leading elsewhere, also not through a symbolic link) holding a complete checkpoint. Anything else
    raises ValueError naming the pointer file and listing the complete checkpoints that do exist.
    """
    pointer = root / LATEST
    try:
        name = _pointer_name(root)
    except OSError as err:
        raise ValueError(f"{pointer}: cannot be read ({_one_line(err)})") from None
    if name is None:
        return None
    fix = f"{_existing_names(root)}; point it at one of them or delete it"
    if not STEP_NAME.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + "…"
        raise ValueError(f"{pointer}: holds {shown!r}, not the name of a checkpoint folder "
                         f"({PREFIX}<step>); {fix}")
    folder = root / name
    if not folder.is_dir():
        raise ValueError(f"{pointer}: names {name}, which does not exist (deleted?); {fix}")
    if folder.resolve().parent != root.resolve():
        raise ValueError(f"{pointer}: names {name}, a link to a folder outside {root}; {fix}")
    if not _is_complete(folder):
        missing = [f for f in (MODEL_FILE, STATE_FILE, CONFIG_FILE) if not (folder / f).is_file()]
        raise ValueError(f"{pointer}: names {name}, which is incomplete (missing {', '.join(missing)}); {fix}")
    return folder


def clean_incomplete(root: Path) -> list[Path]:
    """Remove what interrupted saves left directly under `root`; returns the removed paths, sorted.

    Only the hidden `.tmp-*` and `.trash-*` entries `save_checkpoint` creates are removed (a link among
    them is unlinked, never followed; folders are walked through descriptors), nothing in subfolders. No
    complete checkpoint or `latest` depends on them. Call it on the writing rank before saving, never while
    another process saves into `root`. `root` itself may not be a link (`checkpoint_root`).
    """
    if not root.is_dir() or root.is_symlink():
        return []
    removed = []
    with Folder.open(root) as folder:
        for entry in folder.entries():
            if entry.name.startswith(LEFTOVER_PREFIXES):
                folder.remove(entry.name)
                removed.append(root / entry.name)
    return removed


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root` (not links), oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and p.is_dir() and not p.is_symlink())


def checkpoint_root(run_dir: Path) -> Path:
    """RUN/checkpoints, where training saves: ValueError when a run folder made elsewhere put a link there
    (saving would write into, and keep-N pruning delete from, wherever it points) or a file."""
    return run_subfolder(run_dir, "checkpoints", "training", "another --out")


def save_checkpoint(root: Path, step: int, *, model: nn.Module, trainer_state: dict, config: dict,
                    save_assets: Callable[[Path], None] | None = None, keep: int = 3,
                    model_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint `step` under `root` atomically, point `latest` at it, keep the newest `keep`.

    model: the plain (unwrapped) model; tied weights are stored once (safetensors `save_model`).
    model_state: its state dict, when `model.state_dict()` is not it (a sharded model's, gathered); tied
    weights must be one tensor in it, stored once like the plain model's.
    trainer_state: optimizer/scheduler/loader/RNG states and counters (saved with `torch.save`).
    config: JSON-able dict (model config and training arguments).
    save_assets: writes extra files into the folder (the tokenizer), before it becomes visible.

    Every entry is made, renamed and removed relative to `root`'s descriptor (opened without following a link),
    the files inside the temporary folder through its own (`Folder.local`): a name swapped for a link while
    saving sends nothing elsewhere, and pruning never follows a link.
    """
    if keep < 1:
        raise ValueError(f"--keep must be >= 1, got {keep!r}")
    root.parent.mkdir(parents=True, exist_ok=True)
    with Folder.open(root.parent, follow_links=True) as run, run.child(root.name, create=True) as folder:
        final = step_dir_name(step)
        if folder.exists(final) and _pointer_name(root) == final and _is_complete(root / final):
            return root / final  # written by this run at this very step: the state is the same, nothing to add
        tmp = f"{TEMP_PREFIX}{final}-{os.getpid()}"
        folder.remove(tmp)
        try:
            with folder.child(tmp, private=True) as made:
                save_model(model if model_state is None else _StateHolder(model_state), made.local(MODEL_FILE))
                torch.save(trainer_state, made.local(STATE_FILE))
                made.write_text(CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
                if save_assets is not None:
                    save_assets(Path(made.local("")))
                for f in Path(made.local("")).rglob("*"):
                    if f.is_file() and not f.is_symlink():
                        fsync_path(f)
                os.chmod(made.fd, 0o777 & ~_umask())  # the mode a folder made by mkdir would have
            if folder.exists(final):  # a complete but unreferenced leftover of an interrupted run: replace it
                trash = f".trash-{final}-{os.getpid()}"
                folder.rename(final, trash)
                folder.rename(tmp, final)
                folder.remove(trash)
            else:
                folder.rename(tmp, final)
            folder.fsync()
        except BaseException:
            folder.remove(tmp)
            raise
        folder.write_text(LATEST, final + "\n")
        for old in list_checkpoints(root)[:-keep]:
            if old.name != final:
                folder.remove(old.name)
    return root / final


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status): setting it to
    read it would, for that moment, give files other threads create meanwhile a mask of 0."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o077)  # elsewhere: set and restore, at worst stricter meanwhile, never looser
        os.umask(mask)
        return mask


class _StateHolder:
    """What `save_model` reads of a model, its `state_dict()`, for a state dict given as such."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._state)


def resolve_checkpoint(path: Path | str, flag: str = "--checkpoint") -> Path:
    """The checkpoint folder meant by `path`: a checkpoint itself, a checkpoints root, or a run directory.

    A damaged `latest` pointer raises ValueError prefixed with `flag`.
    """
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / MODEL_FILE).is_file() and (candidate / STATE_FILE).is_file():
            return candidate
        try:
            latest = read_latest(candidate)
        except ValueError as err:
            raise ValueError(f"{flag}: {err}") from None
        if latest is not None:
            return latest
    raise ValueError(f"{flag}: no checkpoint at {path} (expected a run directory with checkpoints/latest, "
                     f"or a folder holding {MODEL_FILE})")


def _require_file(file: Path) -> None:
    if not file.is_file():
        raise ValueError(f"{file}: missing; not a complete checkpoint")


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint folder belongs to (runs/NAME for runs/NAME/checkpoints/step_…)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def read_config(ckpt: Path) -> dict:
    """The config.json of a checkpoint (a JSON object); ValueError naming the file when it is missing or invalid."""
    file = Path(ckpt) / CONFIG_FILE
    _require_file(file)
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON ({_one_line(err)})") from None
    except OSError as err:
        raise ValueError(f"{file}: cannot be read ({_one_line(err)})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(config).__name__}")
    return config


def _fmt_shape(shape) -> str:
    return str(tuple(int(n) for n in shape))


class _BeyondWeights(Exception):
    """A model being built in `check_weight_shapes` has a parameter its weights file cannot hold."""


def _stored_shapes(ckpt: Path) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """(model.safetensors of `ckpt`, name -> shape of each stored tensor), read from the header alone;
    ValueError naming the file when it is missing or unreadable."""
    file = Path(ckpt) / MODEL_FILE
    _require_file(file)
    try:
        with safe_open(str(file), framework="pt") as f:
            return file, {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({_one_line(err)})") from None


def check_weight_shapes(ckpt: Path, build: Callable[[], nn.Module]) -> None:
    """ValueError naming model.safetensors unless the model `build()` makes has exactly the tensors the file
    holds, each of the stored shape; checked before any memory is spent on the model.

    The model is built on the meta device (shapes only, no storage) and compared with the file's header
    (no tensor read), so a config.json that asks for a far larger model than its weights (a crafted or
    edited checkpoint) is refused instead of allocated. safetensors refuses a header whose tensors do not
    fill the file exactly, so a model that passes takes about the file's size. A tied tensor stored once
    counts as present under each of its names. The first meta build of a process costs about 2 s (torch
    loads its Python reference ops).
    """
    file, saved = _stored_shapes(ckpt)
    shapes, registered = set(saved.values()), 0

    def stop_at_unknown(module: nn.Module, name: str, param: torch.Tensor) -> None:
        # Even on the meta device a config's 5,000 layers take a minute to build: stop at the first
        # parameter the file cannot hold. A stored tensor counts at most twice (tied: two names).
        nonlocal registered
        registered += 1
        if tuple(param.shape) not in shapes or registered > 2 * len(saved):
            shown = f"{type(module).__name__}.{name} of shape {_fmt_shape(param.shape)}"
            raise _BeyondWeights(f"a parameter {shown}, a shape no tensor of the file has"
                                 if tuple(param.shape) not in shapes else
                                 f"more than {2 * len(saved)} parameters, the file {len(saved)} tensors")

    hook = torch.nn.modules.module.register_module_parameter_registration_hook(stop_at_unknown)
    try:
        with torch.device("meta"):
            state = build().state_dict(keep_vars=True)
    except _BeyondWeights as err:
        raise ValueError(f"{file}: does not match the model its config.json describes, which has {err} "
                         "(an edited config.json?)") from None
    finally:
        hook.remove()
    stored_ids = {id(t) for key, t in state.items() if key in saved}
    missing = sorted(key for key, t in state.items() if key not in saved and id(t) not in stored_ids)
    for key, tensor in state.items():
        if key in saved and tuple(tensor.shape) != saved[key]:
            raise ValueError(f"{file}: does not match the model its config.json describes: {key} has shape "
                             f"{_fmt_shape(saved[key])} in the weights, {_fmt_shape(tensor.shape)} in the config's "
                             "model (an edited config.json?)")
    unexpected = sorted(set(saved) - set(state))
    if missing or unexpected:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"{file}: does not match the model its config.json describes: missing "
                         f"[{shown}], unexpected {unexpected[:3]} (an edited config.json?)")


def load_weights(model: nn.Module, ckpt: Path) -> None:
    """Load model.safetensors into `model` (strict; the tied head is restored from the embedding).

    ValueError naming the file when it is missing, unreadable, truncated, or holds tensors of other names
    or shapes (the first mismatching tensor is named with both shapes).
    """
    file, saved = _stored_shapes(ckpt)
    for key, tensor in model.state_dict().items():
        if key in saved and tuple(tensor.shape) != saved[key]:
            raise ValueError(f"{file}: does not match the model: {key} has shape {_fmt_shape(saved[key])} in the "
                             f"checkpoint, {_fmt_shape(tensor.shape)} in the model (another configuration?)")
    try:
        missing, unexpected = load_model(model, str(file), strict=False)
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"{file}: cannot be loaded ({_one_line(err)})") from None
    if missing or unexpected:
        raise ValueError(f"{file}: does not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")


def load_trainer_state(ckpt: Path) -> dict:
    """trainer_state.pt of a checkpoint, on the CPU; ValueError naming the file when it cannot be loaded."""
    file = Path(ckpt) / STATE_FILE
    _require_file(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip (RuntimeError), garbage (UnpicklingError), empty (EOFError), …
        raise ValueError(f"{file}: truncated or corrupt, cannot be loaded ({_one_line(err)})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{file}: must hold a dict of trainer state, got {type(state).__name__}")
    return state
