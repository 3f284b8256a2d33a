"""The 2D reach of `piattn reach --image` against brute force: per-layer masks written here from each kind's
definition, composed by boolean matrix powers; and the command's output and refusals."""

from __future__ import annotations

import time

import pytest
import torch

from piattn import cli
from piattn.analysis.raster import neighbourhood_reach, raster_grid, raster_offsets
from piattn.commands.reach_image import IMAGE_KINDS, bottom_centre, image_grids
from piattn.layers import ATTENTION

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def allowed_key(kind: str, i: int, j: int, width: int, s: dict) -> bool:
    """Whether causal query i sees key j <= i under `kind` with settings s, from its definition."""
    d = i - j
    (ri, ci), (rj, cj) = divmod(i, width), divmod(j, width)
    if kind == "dense":
        return True
    if kind == "local":
        return d <= s["window"]
    if kind == "pi":
        return d <= s["window"] or d == s["period"]
    if kind == "neighbourhood":
        return ri - rj <= s["radius"] and abs(ci - cj) <= s["radius"]
    return d < s["stride"] or d % s["stride"] == 0  # strided


def one_layer(kind: str, T: int, width: int, s: dict) -> torch.Tensor:
    """bool [T, T], causal, by loops over (query i, key j)."""
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(i + 1):
            allowed[i, j] = allowed_key(kind, i, j, width, s)
    return allowed


def brute_reach(step: torch.Tensor, layers: int) -> torch.Tensor:
    """bool [T, T]: [i, j] = a path of `layers` hops, one layer each, leads from query i to input j."""
    reach = torch.eye(step.shape[0], dtype=torch.bool)
    for _ in range(layers):
        reach = (step.long() @ reach.long()) > 0
    return reach


GRIDS = [(5, 6, dict(window=4, period=6, radius=1, stride=6)),
         (7, 7, dict(window=2, period=7, radius=2, stride=3)),
         (4, 9, dict(window=1, period=5, radius=1, stride=9)),
         (6, 3, dict(window=4, period=3, radius=1, stride=2))]


@pytest.mark.parametrize("height,width,settings", GRIDS, ids=[f"{h}x{w}" for h, w, _ in GRIDS])
def test_the_image_reach_is_the_matrix_power_of_each_kinds_mask(height, width, settings):
    T, layers = height * width, 4
    settings = {**settings, "image_width": width, "n_head": 1, "sinks": 0}
    grids = image_grids(height, width, layers, settings)
    position = bottom_centre(height, width)
    for kind in IMAGE_KINDS:
        step = one_layer(kind, T, width, settings)
        for depth in range(1, layers + 1):
            expected = brute_reach(step, depth)[position].view(height, width)
            assert torch.equal(grids[kind][depth - 1], expected), (kind, depth)


@pytest.mark.parametrize("width,radius", [(5, 1), (6, 2), (3, 1), (1, 1), (4, 0)])
def test_the_neighbourhood_reach_is_exact_from_every_position(width, radius):
    """Every column, the side ones included, where the window is clipped (no wrapping to the next row)."""
    T = 5 * width + 2  # a partial last row: the rows continue at the same width
    step = one_layer("neighbourhood", T, width, dict(radius=radius))
    for layers in (1, 2, 3):
        brute = brute_reach(step, layers)
        for q in range(T):
            got = ATTENTION["neighbourhood"].lag_reach(dict(image_width=width, radius=radius, n_layer=layers), q)
            assert torch.equal(got.reachable, brute[q, : q + 1].flip(0)), (layers, q)
            hops = layers * radius
            assert got.span == hops * width + min(q % width, hops)


def test_the_neighbourhood_span_is_reached_on_a_tall_image():
    width, radius, layers = 7, 1, 3
    max_lag = 40 * width + 5
    got = neighbourhood_reach(width, radius, layers, max_lag)
    assert got.reachable[got.span] and not got.reachable[got.span + 1:].any()


def test_raster_offsets_are_rows_up_and_columns_left():
    width, position = 5, 13  # row 2, column 3
    reachable = torch.zeros(14, dtype=torch.bool)
    reachable[[0, 1, 4, 6, 13]] = True  # itself, left, up and right, up and left, the top-left corner's row
    grid = raster_grid(reachable, width, position)
    assert raster_offsets(grid, position) == [(0, 0), (0, 1), (1, -1), (1, 1), (2, 3)]


@pytest.fixture
def reach_only(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", {"reach": cli.COMMANDS["reach"]})


def test_the_command_prints_a_grid_per_kind_and_depth_and_writes_the_figure(reach_only, capsys, tmp_path):
    assert cli.main(["reach", "--image", "5x6", "--layers", "2", "--out", f"{tmp_path}/"]) == 0
    out = capsys.readouterr().out
    assert "bottom-centre pixel (row 4, column 3) of a 5×6 image" in out
    assert "neighbourhood (radius 1): 4.0 keys per query" in out and "pi (window 4, period 6)" in out
    assert "strided (stride 6)" in out
    # neighbourhood, depth 1 beside depth 2: the row above (2r + 1 keys) and r + 1 in the pixel's own row
    block = out.split("neighbourhood (radius 1)")[1].splitlines()
    assert [line.split() for line in block[1:7]] == [["L=1", "5px", "L=2", "12px"], ["......", "......"],
                                                     ["......", "......"], ["......", ".#####"],
                                                     ["..###.", ".####."], ["..#o..", ".##o.."]]
    assert (tmp_path / "image_reach.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(("argv", "message"), [
    (["--image", "5"], "--image must be HxW, the image's height and width in pixels (e.g. 7x7), got '5'"),
    (["--image", "0x4"], "--image must be HxW"),
    (["--image", "100x100"], "--image 100x100: at most 4096 pixels (H·W), got 10000"),
    (["--image", "5x5", "--bidirectional"], "--bidirectional does not apply with --image"),
    (["--image", "5x5", "--sinks", "2"], "--sinks does not apply with --image, got 2"),
    (["--image", "5x5", "--layers", "0"], "--layers must be in 1 … 64 with --image, got 0"),
    (["--image", "5x5", "--radius", "-1"], "--radius must be >= 0, got -1"),
    (["--image", "5x5", "--stride", "0"], "--stride must be >= 1, got 0"),
    (["--image", "5x5", "--design"], "--image does not combine with --design or --periods"),
])
def test_bad_image_values_are_one_line_naming_the_flag(reach_only, capsys, tmp_path, argv, message):
    start = time.perf_counter()
    assert cli.main(["reach", "--out", f"{tmp_path}/", *argv]) == 2
    assert time.perf_counter() - start < 5
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err
    assert list(tmp_path.iterdir()) == []
