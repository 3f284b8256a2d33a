"""benchmarks/efficiency_bench.py: a tiny end-to-end run writing the table, and the plan's rules."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from piattn.benchmarking import machine_info
from piattn.models import GPTConfig
from utils import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "efficiency_bench.py"


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: on a busy machine two threads of tiny matrices spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load():
    return load_script(SCRIPT, "efficiency_bench")


def test_plan_labels_and_skips_dense_dropout_beyond_the_limit():
    bench = _load()
    ns = argparse.Namespace(plan=["tiny:1024", "tiny:8192", "small:1024:0:1"], kinds=["dense", "local", "pi"],
                            dropout_kinds=["dense", "pi"],
                            dropouts=[0.1, 0.0], batch=1, repeats=3,
                            decode_steps=4, vocab_size=256, device="cpu", dtype="fp32", dense_dropout_max_context=4096,
                            threads=None)
    cases = bench.plan(ns)
    keys = [(c["config"], c["context"], c["kind"], c["dropout"], "skipped" in c) for c in cases]
    assert keys == [("tiny", 1024, "dense", 0.1, False), ("tiny", 1024, "dense", 0.0, False),
                    ("tiny", 1024, "local", 0.0, False),  # local: dropout 0 only (not in dropout_kinds)
                    ("tiny", 1024, "pi", 0.1, False), ("tiny", 1024, "pi", 0.0, False),
                    ("tiny", 8192, "dense", 0.1, True), ("tiny", 8192, "dense", 0.0, False),
                    ("tiny", 8192, "local", 0.0, False),
                    ("tiny", 8192, "pi", 0.1, False), ("tiny", 8192, "pi", 0.0, False),
                    ("small", 1024, "dense", 0.0, False), ("small", 1024, "local", 0.0, False),
                    ("small", 1024, "pi", 0.0, False)]
    assert [c["repeats"] for c in cases[-3:]] == [1, 1, 1]
    assert all(c["inference"] == (c["dropout"] == 0) for c in cases)


def test_flops_count_keys_per_query():
    bench = _load()
    cfg = {k: GPTConfig.from_name("tiny", attention=k, vocab_size=256) for k in ("dense", "local", "pi")}
    assert bench.keys_per_query(cfg["dense"], 1023) == 512
    assert bench.keys_per_query(cfg["local"], 1024) == 5 and bench.keys_per_query(cfg["pi"], 1024) == 6
    extra = bench.train_flops_per_token(cfg["dense"], 0, 1023) - bench.train_flops_per_token(cfg["pi"], 0, 1023)
    assert extra == 12 * 128 * 4 * (512 - 6)


def case(kind, dropout, **extra):
    return dict(config="tiny", context=64, kind=kind, dropout=dropout, batch=1, repeats=1, decode_steps=2,
                vocab_size=256, device="cpu", dtype="fp32", inference=dropout == 0, **extra)


def test_rows_and_their_table():
    bench = _load()
    rows = [bench.merge_rounds([bench.run_case(case(kind, dropout))])
            for kind, dropout in (("dense", 0.0), ("pi", 0.0), ("pi", 0.1))]
    rows.insert(0, {**case("dense", 0.1), "skipped": "dropout on CPU needs the [T, T] math kernel"})
    for r in rows[1:3]:
        assert r["train_step_s"] > 0 and r["prefill_ms"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["context"] == r["decode_position"] == 64 and r["mfu"] is None
        assert r["cache_mib"] > 0 and r["train_tokens_per_s"] == 64 / r["train_step_s"]
    assert "prefill_ms" not in rows[3] and rows[3]["train_step_s"] > 0
    result = dict(machine=machine_info(), command="python benchmarks/efficiency_bench.py --x", device="cpu",
                  dtype="fp32", vocab_size=256, batch=1, repeats=1, decode_steps=2, rows=rows)
    table = bench.markdown(result)
    dense_line = next(line for line in table.splitlines() if line.startswith("| tiny | 64 | dense (dropout 0) |"))
    pi_line = next(line for line in table.splitlines() if line.startswith("| tiny | 64 | pi (dropout 0) |"))
    assert dense_line.split("|")[6].strip() == "1.00"
    assert pi_line.split("|")[6].strip() == f"{rows[2]['train_step_s'] / rows[1]['train_step_s']:.2f}"
    assert "| tiny | 64 | dense (dropout 0.1) | not run" in table and "not measured" in table
    # the π row with dropout 0.1 has no dense row of its rate to compare with (that one was not run)
    assert next(line for line in table.splitlines() if "pi (dropout 0.1)" in line).split("|")[6].strip() == "–"


def test_rounds_give_medians_and_paired_ratio_ranges():
    bench = _load()

    def row(kind, steps):
        rounds = [dict(case(kind, 0.0), train_step_s=t, train_peak_mib=10.0, prefill_ms=2 * t,
                       decode_tokens_per_s=1 / t, mfu=None) for t in steps]
        return bench.merge_rounds(rounds)

    dense, pi = row("dense", [4.0, 8.0, 6.0]), row("pi", [1.0, 1.0, 3.0])
    assert dense["train_step_s"] == 6.0 and pi["train_step_s"] == 1.0 and pi["train_tokens_per_s"] == 64.0
    # paired by round: 1/4, 1/8, 3/6 -> median 0.25, range 0.125-0.5 (the ratio of medians would say 0.17)
    assert bench.paired_ratio(pi, dense, "train_step_s") == "0.25 [0.12–0.50]"
    assert bench.paired_ratio(pi, dense, "decode_tokens_per_s", invert=True) == "0.25 [0.12–0.50]"
    assert bench.paired_ratio(pi, None, "train_step_s") == "–"


def test_main_writes_json_and_markdown(tmp_path):
    bench = _load()
    assert bench.main(["--plan", "tiny:32:0", "--repeats", "1", "--decode-steps", "2", "--kinds", "pi",
                       "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "efficiency_bench.json").read_text())
    (row,) = result["rows"]
    assert row["kind"] == "pi" and row["prefill_ms"] > 0 and row["threads"] == 1
    assert result["machine"]["torch"] and result["command"].startswith("python benchmarks/efficiency_bench.py")
    assert "| tiny | 32 | pi (dropout 0) |" in (tmp_path / "efficiency_bench.md").read_text()


def test_interleaved_group_ratios_within_rounds_and_memory_per_kind():
    bench = _load()
    group = dict(config="tiny", context=32, kinds=["dense", "local", "pi"], dropout=0.0, batch=1, repeats=3,
                 vocab_size=256, device="cpu", dtype="fp32", threads=1)
    measured = bench.run_group(group)
    assert all(len(measured[key][k]) == 3 for key in ("train_step_s", "prefill_s") for k in group["kinds"])
    memory = bench.measure_memory({**group, "kind": "pi", "what": "train"})
    # in this (not fresh) process the growth can be about 0; the benchmark runs it in a fresh one
    assert memory["what"] == "train" and (memory["peak_mib"] is None or isinstance(memory["peak_mib"], float))
    # ratios are paired within rounds: pi/local = 2, 1, 3 -> median 2, range 1-3
    measured.update(train_step_s={"dense": [4.0, 4.0, 4.0], "local": [1.0, 2.0, 1.0], "pi": [2.0, 2.0, 3.0]},
                    memory={"local": {"train": 10.0, "prefill": 1.0}, "pi": {"train": 10.5, "prefill": 1.0}})
    result = dict(machine=machine_info(), command="python benchmarks/efficiency_bench.py --interleaved",
                  mode="interleaved", device="cpu", dtype="fp32", vocab_size=256, batch=1, dropout=0.0,
                  load="none", seconds=1.0, groups=[measured])
    line = next(ln for ln in bench.interleaved_markdown(result).splitlines() if ln.startswith("| tiny | 32 | pi |"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[7] == "2.00 [1.00–3.00]" and cells[8] == "0.50 [0.50–0.75]" and cells[10] == "1.05"
