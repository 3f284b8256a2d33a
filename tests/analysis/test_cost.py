"""The hierarchy cost model (Eq. online_cost) against numbers worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from piattn.analysis import PROFILES, HardwareProfile, dense_cost, online_cost, working_set_size


@pytest.mark.parametrize("window,period,causal,size", [
    (4, 16, True, 6),      # 5 local + 1 skip
    (4, 16, False, 11),    # 9 local + 2 skips
    (4, 4, True, 5),       # the skip is already local
    (4, 3, False, 9),
    (0, 1, True, 2),
    (0, 1, False, 3),
    (4, None, True, 5),
    (4, None, False, 9),
    (0, None, True, 1),
])
def test_working_set_size(window, period, causal, size):
    assert working_set_size(window, period, causal) == size


def test_online_cost_by_hand():
    # n=4096, k=4, π=16, d_h=64, bf16, n_tile=128 on the H100 SXM profile; |W| = 6
    c = online_cost(4096, 4, 16, 64, "h100-sxm")
    assert c["working_set"] == 6
    assert c["flops"] == 4 * 4096 * 6 * 64
    assert c["bytes"] == {"reg": 4096 * 6 * 64 * 2, "sram": 128 * 6 * 64 * 2,
                          "hbm": 4096 * 5 * 64 * 2, "net": 0}
    s = c["seconds"]
    assert s["compute"] == pytest.approx(6_291_456 / 989e12)
    assert s["reg"] == pytest.approx(3_145_728 / 400e12)
    assert s["sram"] == pytest.approx(98_304 / 33e12)
    assert s["hbm"] == pytest.approx(2_621_440 / 3.35e12)
    assert s["net"] == 0.0
    assert c["total_seconds"] == pytest.approx(sum(s.values()))


def test_remote_skips_use_the_interconnect():
    # half of the 4096 - 16 in-range skip partners live on another device
    c = online_cost(4096, 4, 16, 64, "h200", remote_fraction=0.5)
    assert c["bytes"]["net"] == 2040 * 64 * 2
    assert c["seconds"]["net"] == pytest.approx(2040 * 64 * 2 / 900e9)
    bidir = online_cost(4096, 4, 16, 64, "h200", causal=False, remote_fraction=0.5)
    assert bidir["bytes"]["net"] == 2 * 2040 * 64 * 2
    assert bidir["bytes"]["hbm"] == 4096 * 9 * 64 * 2  # 2k + 1 local keys


def test_no_interconnect_on_a_single_cpu():
    assert online_cost(1024, 4, 16, 64, "cpu-2core")["seconds"]["net"] == 0.0
    with pytest.raises(ValueError, match="interconnect"):
        online_cost(1024, 4, 16, 64, "cpu-2core", remote_fraction=0.1)


def test_linear_in_n_except_the_per_tile_sram_term():
    small, big = (online_cost(n, 4, 16, 64, "a100") for n in (8192, 16384))
    for term in ("compute", "reg", "hbm"):
        assert big["seconds"][term] == pytest.approx(2 * small["seconds"][term])
    assert big["seconds"]["sram"] == small["seconds"]["sram"]


def test_skip_costs_one_key_more_than_local():
    pi, local = online_cost(2048, 4, 16, 64, "a100"), online_cost(2048, 4, None, 64, "a100")
    assert pi["flops"] / local["flops"] == pytest.approx(6 / 5)
    assert pi["bytes"]["hbm"] == local["bytes"]["hbm"]


def test_dense_cost():
    c = dense_cost(1024, 64, "h100-sxm", causal=False)
    assert c["flops"] == 4 * 1024 * 1024 * 64
    assert c["bytes"]["hbm"] == 1024 * 1024 * 64 * 2
    assert dense_cost(1024, 64, "h100-sxm")["flops"] == 4 * 1024 * (1025 / 2) * 64
    # quadratic against linear: the ratio doubles with n
    ratio = [dense_cost(n, 64, "h100-sxm")["total_seconds"]
             / online_cost(n, 4, 16, 64, "h100-sxm")["total_seconds"] for n in (4096, 8192)]
    assert ratio[1] == pytest.approx(2 * ratio[0], rel=0.02)


def test_profiles():
    # peers' facts: H100 SXM HBM3 3.35 TB/s, H200 HBM3e 4.8 TB/s
    assert PROFILES["h100-sxm"].hbm_bw == 3.35e12
    assert PROFILES["h200"].hbm_bw == 4.8e12
    for name, p in PROFILES.items():
        assert p.name == name
        assert p.reg_bw > p.sram_bw > p.hbm_bw > 0 and p.tc_flops > 0


def test_profile_object_and_errors():
    custom = dataclasses.replace(PROFILES["a100"], name="mine", hbm_bw=1e12)
    assert isinstance(custom, HardwareProfile)
    assert online_cost(512, 2, 8, 32, custom)["seconds"]["hbm"] == pytest.approx(512 * 3 * 32 * 2 / 1e12)
    with pytest.raises(ValueError, match="unknown profile"):
        online_cost(512, 2, 8, 32, "tpu")
    with pytest.raises(ValueError):
        online_cost(512, 2, 8, 32, "a100", remote_fraction=1.5)
