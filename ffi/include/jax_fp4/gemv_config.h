// Launch heuristic of the CUDA decode GEMV (ffi/cuda/gemv.cu): one small pure constexpr function,
// host-only C++ so that the CPU module can expose it to tests (tests/test_gemv_config.py).
//
// Tensor-core path (sm_80+, K % 128 == 0): a warp computes col_tiles tiles of 16 output columns
// for up to 8 * row_tiles rows of M, over a strided share of the 128-wide K windows; k_split
// warps of one block split K and reduce through shared memory. Scalar path: a warp per output
// column, 8 columns per block, rows_per_block rows of M per warp sharing each decoded weight.
#ifndef JAX_FP4_GEMV_CONFIG_H_
#define JAX_FP4_GEMV_CONFIG_H_

#include <cstdint>

namespace jax_fp4 {

struct GemvLaunchConfig {
  int col_tiles;       // mma path: 16-column tiles per warp (1, 2 or 4), one activation fragment
  int row_tiles;       // mma path: 8-row activation tiles per warp (1, or 2 with one column tile)
  int k_split;         // mma path: warps per block splitting K (power of two, 1..16/col_tiles)
  int rows_per_block;  // scalar path: rows of M per warp (1, 2 or 4)
};

constexpr int kGemvWindow = 128;            // K elements per mma window (8 k-steps of 16)
constexpr int kGemvTileCols = 16;           // output columns per mma tile
constexpr int kGemvMaxWarpsPerBlock = 16;   // k_split * col_tiles <= this (register budget)
constexpr int kGemvTargetWarpsPerSm = 16;   // grow k_split until this many warps per SM
constexpr int kGemvScalarColsPerBlock = 8;  // scalar path: warps (= columns) per block
// Blocks of the two-tile kernel resident per SM at k_split 4, what it gets at M = 1 on grids of
// one to two waves (4 warps at the 128-register bound: 4 blocks per SM). A two-tile grid just over
// one wave of them (by less than half a wave) leaves its second wave nearly empty.
constexpr int kGemvTwoTileBlocksPerSm = 4;
// k_split bounds of the heuristic, as the H200 measured (benchmarks/NOTES.md, fourth session):
// one-tile warps split K at least 4 ways where K allows (2 was never faster than 4) and at most 8
// (16: 17.6 vs 13.5 us on 4096x11008); two- and four-tile warps at most 4 (two tiles at M = 8 on
// 11008x4096: 15.8 us at 4 vs 21.5 at 8; four tiles keep their earlier 4: 2 measured no better on
// 17408x5120, within the ~15% spread between device calls).
constexpr int kGemvMinSplitOneTile = 4;
constexpr int GemvMaxSplit(int col_tiles) { return col_tiles == 1 ? 8 : 4; }

constexpr int64_t GemvCeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// m, n, k: the matmul (K % 32 == 0 for any path; the mma fields matter only when K % 128 == 0).
// num_sms: the device's multiprocessor count (132 on an H200).
constexpr GemvLaunchConfig gemv_launch_config(int64_t m, int64_t n, int64_t k, int64_t num_sms) {
  const int64_t sms = num_sms > 0 ? num_sms : 1;
  const int64_t tiles = GemvCeilDiv(n > 0 ? n : 1, kGemvTileCols);
  const int64_t windows = k > 0 ? k / kGemvWindow : 0;

  // Share each activation fragment (its loads and split-pair permutes) over several column tiles
  // when the column grid alone still gives two waves of blocks. At M = 1 two tiles at most, and
  // not when their grid is just over one wave: the H200 measured (2, 4) 13.0-13.4 us against
  // 14.7-15.7 for one tile on 11008x4096 (344 blocks) and two tiles ahead or even on 28672x8192
  // (896) and lm_head (7760), but one tile faster on 17408x5120 (544 blocks, 528 resident):
  // 21.5-22.5 against 24.5-25.7 us in three measurements (benchmarks/NOTES.md, ninth session).
  // Four tiles: 26.6 against 22.7 on 17408x5120.
  // M > 8: each decoded weight fragment feeds two 8-row tiles (one pass over the weight for 16
  // rows instead of two; 128 registers leave room for one column tile only).
  const int row_tiles = m > 8 ? 2 : 1;
  int col_tiles = 1;
  if (row_tiles > 1) {
    col_tiles = 1;
  } else if (m > 1 && GemvCeilDiv(tiles, 4) >= 2 * sms) {
    col_tiles = 4;
  } else if (GemvCeilDiv(tiles, 2) >= 2 * sms) {
    const int64_t two_tile_blocks = GemvCeilDiv(tiles, 2);
    const int64_t wave = kGemvTwoTileBlocksPerSm * sms;
    const bool thin_second_wave = two_tile_blocks > wave && 2 * two_tile_blocks < 3 * wave;
    col_tiles = m == 1 && thin_second_wave ? 1 : 2;
  }
  const int64_t blocks = GemvCeilDiv(tiles, col_tiles);

  // Split K over warps until the grid holds kGemvTargetWarpsPerSm warps per SM (bytes in flight),
  // keeping at least two windows per warp, the block within its warp budget and k_split within
  // [kGemvMinSplitOneTile (one tile only), GemvMaxSplit].
  int k_split = 1;
  while (2 * k_split * col_tiles <= kGemvMaxWarpsPerBlock && 4 * k_split <= windows &&
         k_split < GemvMaxSplit(col_tiles) &&
         (blocks * k_split < kGemvTargetWarpsPerSm * sms ||
          (col_tiles == 1 && k_split < kGemvMinSplitOneTile))) {
    k_split *= 2;
  }

  // Scalar path: row tiling trades grid parallelism (M leaves gridDim.y) for weight reuse, so
  // only when the column grid ceil(N / 8) covers a wave of SMs on its own.
  int rows_per_block = 1;
  if (GemvCeilDiv(n > 0 ? n : 1, kGemvScalarColsPerBlock) >= sms) {
    rows_per_block = m >= 3 ? 4 : (m == 2 ? 2 : 1);
  }
  return GemvLaunchConfig{col_tiles, row_tiles, k_split, rows_per_block};
}

// Compile-time checks of the H200 (132 SMs) shapes quoted in benchmarks/NOTES.md.
static_assert(gemv_launch_config(1, 11008, 4096, 132).col_tiles == 2, "");
static_assert(gemv_launch_config(1, 17408, 5120, 132).col_tiles == 1, "");
static_assert(gemv_launch_config(1, 11008, 4096, 132).k_split == 4, "");
static_assert(gemv_launch_config(4, 248320, 2048, 132).col_tiles == 4, "");
static_assert(gemv_launch_config(4, 248320, 2048, 132).k_split == 1, "");
static_assert(gemv_launch_config(4, 11008, 4096, 132).rows_per_block == 4, "");
static_assert(gemv_launch_config(16, 11008, 4096, 132).row_tiles == 2, "");
static_assert(gemv_launch_config(16, 11008, 4096, 132).col_tiles == 1, "");
static_assert(gemv_launch_config(4, 1000, 4096, 132).rows_per_block == 1, "");

}  // namespace jax_fp4

#endif  // JAX_FP4_GEMV_CONFIG_H_
