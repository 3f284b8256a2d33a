"""piattn.benchmarking's helpers shared by the scripts of benchmarks/: what their tables and records show."""

from __future__ import annotations

import torch

from piattn import benchmarking as bm


def test_spread_is_the_median_and_the_range():
    assert bm.spread([3.0, 1.0, 2.0], ".1f") == "2.0 (1.0–3.0)"
    assert bm.spread([1000.0, 3000.0], ",.0f", "[]") == "2,000 [1,000–3,000]"


def test_fmt_writes_missing_figures_as_asked():
    assert bm.fmt(1.23456, ".2f") == "1.23"
    assert bm.fmt(None, ".2f") == "–" and bm.fmt(None, ".2f", "") == ""


def test_markdown_table_has_a_rule_per_column_and_a_line_per_row():
    assert bm.markdown_table(["a", "b"], [[1, "x"], [2.5, None]]) == ["| a | b |", "|---|---|", "| 1 | x |",
                                                                      "| 2.5 | None |"]


def test_block_sizes_cover_the_steps_in_blocks_of_16():
    assert bm.block_sizes(40) == [16, 16, 8] and bm.block_sizes(32) == [16, 16] and bm.block_sizes(0) == []


def test_describe_error_keeps_the_first_line():
    assert bm.describe_error(ValueError("first\nsecond")) == "ValueError: first"
    assert bm.describe_error(KeyboardInterrupt()) == "KeyboardInterrupt: "


def test_median_ms_on_a_cpu_times_every_call():
    calls = []
    assert bm.median_ms(lambda: calls.append(1), 3) >= 0 and len(calls) == 3


def test_decode_model_is_the_kind_asked_and_seeded():
    a, b = bm.decode_model("pi"), bm.decode_model("pi")
    assert not a.training and a.config.attention == "pi" and a.config.vocab_size == 256
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert bm.decode_model("pi-union").config.variant == "union"
    assert set(bm.DECODE_KINDS) == {"pi", "pi-union", "ms-pi", "local", "dense"}


def test_machine_description():
    assert bm.cpu_model() and bm.compiler_version("no-such-compiler-here") == "none"
