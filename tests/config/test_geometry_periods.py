"""Periods from the image width: `--period width`, `2width`, `width±K`, `neighbourhood` (`ModelConfig.image_width`)."""

from __future__ import annotations

import argparse

import pytest

from piattn.commands.train import add_arguments, checked_config
from piattn.config import EncoderConfig, GPTConfig, TrainConfig
from piattn.config.model import geometry_periods, is_geometry_period
from piattn.config.training import parse_period
from piattn.config.vision import VisionLanguageConfig


@pytest.mark.parametrize("word, periods", [
    ("width", 28), ("2width", 56), ("width-1", 27), ("width+1", 29), ("3width-2", 82),
    ("neighbourhood", [27, 28, 29, 56]), ("neighborhood", [27, 28, 29, 56])])
def test_words_resolve_to_the_periods_of_the_width(word, periods):
    assert parse_period(word) == word and is_geometry_period(word)
    assert geometry_periods(word, 28, 4) == periods
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=257, block_size=784, period=word, image_width=28)
    assert cfg.period == periods  # stored resolved: the checkpoint's config rebuilds the same periods
    assert GPTConfig.from_dict(cfg.to_dict()).period == periods


def test_neighbourhood_repeats_over_heads_and_refuses_other_counts():
    assert geometry_periods("neighbourhood", 14, 8) == [13, 14, 15, 28] * 2
    with pytest.raises(ValueError, match=r"--period neighbourhood .* multiple of 4, got 6 \(--n-head\)"):
        geometry_periods("neighbourhood", 14, 6)
    with pytest.raises(ValueError, match="multiple of 4, got 2"):
        EncoderConfig(n_layer=1, n_head=2, d_model=32, period="neighbourhood", image_width=14)


def test_without_a_width_or_below_one_is_refused():
    with pytest.raises(ValueError, match="--period width needs the image width"):
        GPTConfig(n_layer=1, n_head=2, d_model=32, period="width")
    with pytest.raises(ValueError, match="below 1"):
        geometry_periods("width-5", 5, 1)
    assert not is_geometry_period("widths") and not is_geometry_period("cover")
    with pytest.raises(ValueError, match="--period must be"):
        parse_period("height")


def parsed(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return checked_config(TrainConfig.from_args(parser.parse_args(["--out", "unused", *argv])))


def test_non_image_tasks_refuse_the_words_naming_the_flag():
    for task in ("lm", "recall", "listops"):
        message = rf"^--period 2width applies to the tasks on images .* not to --task {task}"
        with pytest.raises(ValueError, match=message):
            parsed(["--task", task, "--period", "2width"])


def test_image_tasks_resolve_the_width_of_their_data(tmp_path):
    from piattn.tasks import ImageClassTask, PixelsTask
    from piattn.train.distributed import setup

    cfg = parsed(["--task", "pixels", "--data", "shapes", "--image-size", "16", "--downsample", "2", "--period",
                  "width", "--n-head", "4", "--n-layer", "2", "--d-model", "32"])
    assert cfg.data.seq_len == 64
    task = PixelsTask.from_config(cfg, tmp_path, setup("cpu"))
    assert (task.model_config.image_width, task.model_config.period, task.model_config.block_size) == (8, 8, 64)
    cfg = parsed(["--task", "image-class", "--data", "pathfinder", "--image-size", "16", "--period", "neighbourhood",
                  "--n-head", "8", "--n-layer", "1", "--d-model", "32"])
    config = ImageClassTask.from_config(cfg, tmp_path, setup("cpu")).model_config
    assert config.period == [15, 16, 17, 32] * 2 and config.num_classes == 2 and config.image_width == 16


def test_vision_tower_counts_patches_per_row():
    cfg = VisionLanguageConfig(n_layer=1, n_head=4, d_model=32, image_size=32, patch_size=4, period="2width")
    assert cfg.image_width == 8 and cfg.period == 16
    assert cfg.text_config().image_width is None
    assert VisionLanguageConfig(n_layer=1, n_head=4, d_model=32).period == 8  # the default stays the grid


@pytest.mark.parametrize("text", ["5,x", "0", "8,16/0,3", "a/b", "4,,8"])
def test_train_and_reach_read_period_numbers_alike(text):
    """One syntax, one message: what `piattn train --period` and `piattn reach --periods` parse their values with
    refuse the same texts in the same words (guarded by behaviour, not by the parsers' names)."""
    from piattn.commands.reach import parse_periods

    messages = []
    for parse in (parse_period, lambda t: parse_periods(t, 2, 4)):
        with pytest.raises(ValueError) as refused:
            parse(text)
        messages.append(str(refused.value))
    syntax = "an int >= 1, per-head ints '8,16,32,64' or per-layer '5,6,7,8/9,14,19,24'"
    assert messages[0].startswith(f"--period must be {syntax}") and messages[0].endswith(f"got {text!r}")
    assert messages[1] == f"--periods must be {syntax}, got {text!r}"
