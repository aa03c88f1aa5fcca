"""The CUDA decode GEMV's launch heuristic (ffi/include/jax_fp4/gemv_config.h), exposed through
the CPU module as gemv_launch_config: pure C++, so it is checked on any machine."""

from __future__ import annotations

import itertools
import math

import pytest

import jax_fp4  # noqa: F401  (builds/loads the compiled modules)
from jax_fp4 import _jax_fp4_cpu

config = _jax_fp4_cpu.gemv_launch_config

H200_SMS = 132
MAX_WARPS_PER_BLOCK = 16
TARGET_WARPS_PER_SM = 16
MIN_SPLIT_ONE_TILE = 4
TWO_TILE_BLOCKS_PER_SM = 4

M_VALUES = [1, 2, 3, 4, 7, 8, 9, 64, 1000]
N_VALUES = [1, 7, 16, 100, 1000, 1056, 4096, 8448, 11008, 16896, 248320]
K_VALUES = [0, 32, 96, 128, 256, 512, 1536, 2048, 4096, 16384]
SMS = [1, 2, 46, 108, 132, 170]


@pytest.mark.parametrize("num_sms", SMS)
def test_invariants(num_sms):
    for m, n, k in itertools.product(M_VALUES, N_VALUES, K_VALUES):
        c = config(m, n, k, num_sms)
        ct, ks, rows = c["col_tiles"], c["k_split"], c["rows_per_block"]
        where = f"m={m} n={n} k={k} sms={num_sms}: {c}"
        assert ct in (1, 2, 4), where
        # Two 8-row tiles per warp exactly when M > 8, and then one column tile (registers).
        assert c["row_tiles"] == (2 if m > 8 else 1), where
        if c["row_tiles"] == 2:
            assert ct == 1, where
        assert ks >= 1 and ks & (ks - 1) == 0, where  # power of two
        assert ct * ks <= MAX_WARPS_PER_BLOCK, where
        assert ks <= (8 if ct == 1 else 4), where
        assert rows in (1, 2, 4), where
        windows = k // 128
        if ks > 1:
            assert windows >= 2 * ks, f"every split warp keeps >= 2 windows: {where}"
        if m == 1:
            assert ct in (1, 2), f"at most two tiles at M = 1: {where}"
            assert rows == 1, where
            # Not two tiles when their grid is just over one wave (by less than half a wave).
            blocks2, wave = math.ceil(math.ceil(n / 16) / 2), TWO_TILE_BLOCKS_PER_SM * num_sms
            if wave < blocks2 < 1.5 * wave:
                assert ct == 1, where
        assert rows <= max(1, 4 if m >= 3 else m), where
        # Row tiling only when the column grid ceil(N / 8) covers a wave on its own.
        if math.ceil(n / 8) < num_sms:
            assert rows == 1, where
        # Column tiles only when the grid still has two waves of blocks.
        if ct > 1:
            assert math.ceil(math.ceil(n / 16) / ct) >= 2 * num_sms, where
        # k_split stops growing once the grid is full (one-tile warps: at least 4 where K allows).
        blocks = math.ceil(math.ceil(n / 16) / ct)
        if ct == 1:
            assert ks >= min(MIN_SPLIT_ONE_TILE, max(1, 2 ** int(math.log2(max(1, windows // 2))))), where
        if ks > (MIN_SPLIT_ONE_TILE if ct == 1 else 1):
            assert blocks * (ks // 2) < TARGET_WARPS_PER_SM * num_sms, where


def test_h200_shapes():
    """The decisions for the shapes quoted in benchmarks/NOTES.md (H200, 132 SMs)."""
    def cfg(m, n, k):
        c = config(m, n, k, H200_SMS)
        return c["col_tiles"], c["k_split"], c["rows_per_block"]

    assert cfg(1, 11008, 4096) == (2, 4, 1)      # MLP up/gate at decode: two tiles share activations
    assert cfg(4, 11008, 4096) == (2, 4, 4)      # speculative decode, 4 rows
    assert cfg(1, 4096, 11008) == (1, 8, 1)      # MLP down
    assert cfg(4, 248320, 2048) == (4, 1, 4)     # lm_head
    assert cfg(8, 17408, 5120) == (4, 4, 4)
    assert cfg(1, 4096, 4096) == (1, 8, 1)
    assert cfg(1, 17408, 5120) == (1, 4, 1)      # two tiles would spill into a second wave
    assert cfg(1, 28672, 8192) == (2, 4, 1)      # 1.7 waves of two-tile blocks
    assert cfg(1, 248320, 2048) == (2, 1, 1)     # lm_head at decode
    assert cfg(8, 2048, 2048) == (1, 8, 4)       # small MLP: split K for parallelism
    assert cfg(1, 100, 128) == (1, 1, 1)         # one window: nothing to split
    assert cfg(16, 11008, 4096) == (1, 4, 4)     # M = 16: one pass, two row tiles per warp
    assert config(16, 11008, 4096, H200_SMS)["row_tiles"] == 2


def test_monotone_in_sms():
    """More SMs never means fewer warps in flight, for a given number of column tiles (at M = 1
    the choice between one and two tiles also depends on how the two-tile grid fills its waves)."""
    for m, n, k in itertools.product([1, 4, 8], [1000, 11008, 248320], [512, 4096]):
        warps = {}
        for sms in (16, 64, 132, 264):
            c = config(m, n, k, sms)
            warps.setdefault(c["col_tiles"], []).append(
                math.ceil(math.ceil(n / 16) / c["col_tiles"]) * c["k_split"])
        for ct, counts in warps.items():
            assert counts == sorted(counts), (m, n, k, ct, counts)


def test_default_num_sms_is_h200():
    assert config(4, 11008, 4096) == config(4, 11008, 4096, H200_SMS)


def test_degenerate_inputs():
    for args in ((0, 0, 0, 0), (1, 0, 128, 132), (1, 1, 0, 132), (1, 1, 128, -3)):
        c = config(*args)
        assert c["col_tiles"] >= 1 and c["k_split"] >= 1 and c["rows_per_block"] >= 1
