"""The CUDA decode GEMV's launch heuristic (ffi/include/jax_fp4/gemv_config.h), exposed through
the CPU module as gemv_launch_config: pure C++, so it is checked on any machine."""

from __future__ import annotations

import itertools
import math

import pytest

import jax_fp4  # noqa: F401  (builds/loads the compiled modules)
from jax_fp4 import _jax_fp4_cpu

_config = _jax_fp4_cpu.gemv_launch_config


def config(m, n, k, num_sms=132, tiled=True):
    """The heuristic's pick; prepacked weights (the tiled layout) unless tiled=False."""
    c = _config(m, n, k, num_sms, tiled=tiled)
    c["tiled"] = tiled
    return c


H200_SMS = 132
MAX_WARPS_PER_BLOCK = 16
SPLITS = (1, 2, 3, 4, 6, 8)
TWO_TILE_BLOCKS_PER_SM = 4
BLOCK_OVERHEAD_WINDOWS = 5

M_VALUES = [1, 2, 3, 4, 5, 7, 8, 9, 16, 64, 1000]
N_VALUES = [1, 7, 16, 100, 1000, 1056, 4096, 5120, 8448, 11008, 16896, 17408, 24576, 28672, 248320]
K_VALUES = [0, 32, 96, 128, 256, 512, 1536, 2048, 4096, 5120, 16384, 17408]
SMS = [1, 2, 46, 108, 132, 170]


def spec_two_by_two(col_tiles, row_tiles, tiled):
    """Two column with two row tiles on the spec layout keep both register buffers (168
    registers); on the tiled layout they load activations just in time (128)."""
    return col_tiles == 2 and row_tiles == 2 and not tiled


def resident_warps(col_tiles, row_tiles, tiled):
    """Warps per SM of the mma kernel at its register count (96; 121-128 with two column or two
    row tiles, or both on the tiled layout; 168 with both on the spec layout)."""
    if spec_two_by_two(col_tiles, row_tiles, tiled):
        return 12
    return 20 if col_tiles == 1 and row_tiles == 1 else 16


def max_split(col_tiles, row_tiles, tiled):
    return 4 if spec_two_by_two(col_tiles, row_tiles, tiled) else MAX_WARPS_PER_BLOCK // col_tiles


def grid_blocks(c, m, n):
    return math.ceil(math.ceil(n / 16) / c["col_tiles"]) * math.ceil(max(m, 1) / (8 * c["row_tiles"]))


def fits_one_wave(c, m, n, k_split, num_sms):
    warps = resident_warps(c["col_tiles"], c["row_tiles"], c["tiled"])
    return grid_blocks(c, m, n) <= num_sms * (warps // k_split)


def split_allowed(c, k, k_split):
    """1 always; more only within the block's warp budget and with two windows per warp."""
    return k_split == 1 or (k_split <= max_split(c["col_tiles"], c["row_tiles"], c["tiled"])
                            and 2 * k_split <= k // 128)


def allowed_split(c, m, n, k, k_split, num_sms):
    """An allowed k_split whose grid fits one wave (the column-tile rule asks it of k_split > 1:
    whether one tile splits K)."""
    return split_allowed(c, k, k_split) and fits_one_wave(c, m, n, k_split, num_sms)


def modelled_time(c, m, n, k, k_split, num_sms):
    """The heuristic's cost of a k_split, waves of resident blocks x (windows per warp + 5), then
    the waves (the tie-break)."""
    per_sm = resident_warps(c["col_tiles"], c["row_tiles"], c["tiled"]) // k_split
    rounds = math.ceil(grid_blocks(c, m, n) / (num_sms * per_sm))
    return rounds * (math.ceil(k // 128 / k_split) + BLOCK_OVERHEAD_WINDOWS), rounds


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("num_sms", SMS)
def test_invariants(num_sms, tiled):
    for m, n, k in itertools.product(M_VALUES, N_VALUES, K_VALUES):
        c = config(m, n, k, num_sms, tiled)
        ct, ks, rows = c["col_tiles"], c["k_split"], c["rows_per_block"]
        where = f"m={m} n={n} k={k} sms={num_sms}: {c}"
        assert ct in (1, 2), where
        # Two 8-row tiles per warp exactly when M > 8.
        assert c["row_tiles"] == (2 if m > 8 else 1), where
        assert ks in SPLITS and ks <= max_split(ct, c["row_tiles"], tiled), where
        assert rows in (1, 2, 4), where
        windows = k // 128
        if ks > 1:
            assert windows >= 2 * ks, f"every split warp keeps >= 2 windows: {where}"
        # The split of least modelled time (fewer waves on a tie).
        candidates = [s for s in SPLITS if split_allowed(c, k, s)]
        assert ks in candidates, where
        assert modelled_time(c, m, n, k, ks, num_sms) == min(
            modelled_time(c, m, n, k, s, num_sms) for s in candidates), where
        # Prepacked at M > 8: two column tiles wherever their grid (both axes: 16 rows of M a block
        # row) has a block for every other SM.
        # Otherwise two only when their grid still has two waves of blocks; not at M <= 4 when
        # it is just over one wave of k_split-4 blocks (by less than half a wave), unless one tile
        # would not split K there.
        blocks2, wave = math.ceil(math.ceil(n / 16) / 2), TWO_TILE_BLOCKS_PER_SM * num_sms
        thin = m <= 4 and wave < blocks2 < 1.5 * wave
        one_tile = {"col_tiles": 1, "row_tiles": 1, "tiled": tiled}
        one_tile_splits = any(allowed_split(one_tile, m, n, k, s, num_sms) for s in SPLITS if s > 1)
        if tiled and m > 8:
            assert ct == (2 if 2 * blocks2 * math.ceil(m / 16) >= num_sms else 1), where
        elif ct == 2:
            assert blocks2 >= 2 * num_sms, where
            assert not (thin and one_tile_splits), where
        elif blocks2 >= 2 * num_sms:
            assert thin and one_tile_splits and ks > 1, where
        if m == 1:
            assert rows == 1, where
        assert rows <= max(1, 4 if m >= 3 else m), where
        # Row tiling only when the column grid ceil(N / 8) covers a wave on its own.
        if math.ceil(n / 8) < num_sms:
            assert rows == 1, where


def test_h200_shapes():
    """The picks the H200 sweep measured best (benchmarks/results/sweeps/gemv_configs_h200.log,
    gemv_configs_session21_h200.log for prepacked weights at M = 9-16)."""
    def cfg(m, n, k, tiled=True):
        c = config(m, n, k, H200_SMS, tiled)
        return c["col_tiles"], c["k_split"], c["rows_per_block"]

    for m, tiled in itertools.product((1, 2, 4, 8), (True, False)):  # M <= 8: the layouts agree
        assert config(m, 11008, 4096, H200_SMS, tiled) == config(m, 11008, 4096, H200_SMS, True) | {
            "tiled": tiled}
    for m in (1, 2, 4, 8):
        assert cfg(m, 11008, 4096)[:2] == (2, 4)     # MLP up/gate: two tiles share activations
        assert cfg(m, 4096, 11008)[:2] == (1, 8)     # MLP down
        assert cfg(m, 5120, 17408)[:2] == (1, 6)     # 8 would need 1.2 waves of 8-warp blocks
        assert cfg(m, 28672, 8192)[:2] == (2, 2)     # 4 would need 1.7 waves
        assert cfg(m, 248320, 2048)[:2] == (2, 1)    # lm_head: many waves at any split
        assert cfg(m, 4096, 4096)[:2] == (1, 8)
    for m in (1, 2, 4):
        assert cfg(m, 17408, 5120)[:2] == (1, 2)     # two tiles just over a wave
    assert cfg(8, 17408, 5120)[:2] == (2, 3)
    assert cfg(1, 24576, 4096)[:2] == (2, 2)     # one tile would fit a wave only at k_split 1
    assert cfg(4, 11008, 4096) == (2, 4, 4)      # speculative decode, 4 rows (scalar row tiling 4)
    assert cfg(8, 2048, 2048) == (1, 8, 4)       # small MLP: split K for parallelism (2 windows each)
    assert cfg(1, 100, 128) == (1, 1, 1)         # one window: nothing to split
    for m in (9, 12, 16):  # one pass over the weight for up to 16 rows: two row tiles per warp
        assert config(m, 11008, 4096, H200_SMS)["row_tiles"] == 2
        # Prepacked (activations just in time, 16 warps per SM): the fastest config of every
        # k_split on all eight shapes measured (gemv_configs_session21_h200.log).
        assert cfg(m, 11008, 4096)[:2] == (2, 4)
        assert cfg(m, 28672, 8192)[:2] == (2, 2)
        assert cfg(m, 17408, 5120)[:2] == (2, 3)
        assert cfg(m, 24576, 4096)[:2] == (2, 2)
        assert cfg(m, 4096, 11008)[:2] == (2, 8)
        assert cfg(m, 6144, 4096)[:2] == (2, 8)
        assert cfg(m, 4096, 4096)[:2] == (2, 8)
        assert cfg(m, 248320, 2048)[:2] == (2, 1)
        # Spec layout (both register buffers, 12 warps per SM; twentieth session's sweep).
        assert cfg(m, 11008, 4096, False)[:2] == (2, 4)
        assert cfg(m, 28672, 8192, False)[:2] == (2, 3)   # 1.7 waves beat the one-wave k_split 1
        assert cfg(m, 17408, 5120, False)[:2] == (2, 2)
        assert cfg(m, 24576, 4096, False)[:2] == (2, 2)
        assert cfg(m, 4096, 11008, False)[:2] == (1, 8)   # too few two-tile blocks
        assert cfg(m, 6144, 4096, False)[:2] == (1, 4)
    # M = 17-48 prepacked, where gridDim.y holds blocks too (gemv_configs_m17_48_session32_h100.log:
    # an H100, 132 SMs like the H200): two tiles on 2048-row weights, 1-27% faster than one.
    for m in (17, 24, 32, 48):
        assert cfg(m, 2048, 16384)[:2] == (2, 8)
        assert cfg(m, 2048, 8192)[:2] == (2, 8)
    for m in (17, 24, 32):
        assert cfg(m, 1024, 16384)[:2] == (1, 8)  # 64 two-tile blocks: one tile 24-31% faster
    assert cfg(48, 1024, 16384)[:2] == (2, 8)     # 96 two-tile blocks: 19.2 against 23.3 us
    assert cfg(1, 24576, 8192)[:2] == (2, 2)     # k_split 8 in three waves measured 6% slower
    assert cfg(1, 151936, 4096)[:2] == (2, 2)    # lm_head of the decode step: 97.6 us, 1: 100.0


def test_monotone_in_sms():
    """More SMs never means fewer warps in flight, for a given number of column tiles (at M = 1
    the choice between one and two tiles also depends on how the two-tile grid fills its waves)."""
    for m, n, k in itertools.product([1, 4, 8, 16], [1000, 11008, 248320], [512, 4096]):
        warps = {}
        for sms in (16, 64, 132, 264):
            c = config(m, n, k, sms)
            warps.setdefault(c["col_tiles"], []).append(
                math.ceil(math.ceil(n / 16) / c["col_tiles"]) * c["k_split"])
        for ct, counts in warps.items():
            assert counts == sorted(counts), (m, n, k, ct, counts)


def test_default_num_sms_is_h200():
    assert _config(4, 11008, 4096, tiled=True) == _config(4, 11008, 4096, H200_SMS, tiled=True)


def test_layout_is_required():
    with pytest.raises(TypeError):
        _config(4, 11008, 4096, H200_SMS)


def test_degenerate_inputs():
    for args, tiled in itertools.product(
            ((0, 0, 0, 0), (1, 0, 128, 132), (1, 1, 0, 132), (1, 1, 128, -3), (9, 1, 128, 132)),
            (True, False)):
        c = config(*args, tiled=tiled)
        assert c["col_tiles"] >= 1 and c["k_split"] >= 1 and c["rows_per_block"] >= 1
