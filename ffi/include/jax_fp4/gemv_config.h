// Launch heuristic of the CUDA decode GEMV (ffi/cuda/gemv/launch.cuh): one small pure constexpr
// function of the shape, the SM count and the resident warps per SM of each kernel instance,
// host-only C++ checked by tests/cpp/gemv_config_check.cc (tests/test_gemv_config.py builds it).
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
  int col_tiles;       // mma path: 16-column tiles per warp (1 or 2), one activation fragment
  int row_tiles;       // mma path: 8-row activation tiles per warp (1, or 2 when M > 8)
  int k_split;         // mma path: warps per block splitting K (1..8, not only powers of two)
  int rows_per_block;  // scalar path: rows of M per warp (1, 2 or 4)
};

constexpr int kGemvWindow = 128;            // K elements per mma window (8 k-steps of 16)
constexpr int kGemvTileCols = 16;           // output columns per mma tile
constexpr int kGemvMaxWarpsPerBlock = 16;   // k_split * col_tiles <= this (launch bounds)
constexpr int kGemvScalarColsPerBlock = 8;  // scalar path: warps (= columns) per block
// Warps of one tensor-core kernel instance resident per SM, by its tiles per warp (col_tiles,
// row_tiles), for one weight layout and dtype: what the heuristic plans its waves of blocks with.
// They follow from the kernel's register count on the device, so the launcher asks the CUDA
// occupancy API for them (cudaOccupancyMaxActiveBlocksPerMultiprocessor on each kernel instance
// with one-warp blocks, cached per device: ffi/cuda/gemv/launch.cuh). On an H100 / H200 (sm_90a
// build) it gives 20 for one tile (93-96 registers: 5 warps per scheduler), 16 for two column
// tiles, two row tiles, or both on the tiled layout (121-128 registers), and 12 for both on the
// spec layout (161-168 registers).
struct GemvResidentWarps {
  int one_tile;       // (1, 1)
  int two_col_tiles;  // (2, 1)
  int two_row_tiles;  // (1, 2)
  int two_by_two;     // (2, 2)

  constexpr int at(int col_tiles, int row_tiles) const {
    return col_tiles == 2 ? (row_tiles == 2 ? two_by_two : two_col_tiles)
                          : (row_tiles == 2 ? two_row_tiles : one_tile);
  }
};

// One mma kernel instance: tiles per warp and the weight's layout (tiled: jax_fp4.prepack's).
struct GemvMmaShape {
  int col_tiles;
  int row_tiles;
  bool tiled;

  // Two column with two row tiles on the tiled layout load each window's activations just in
  // time instead of one window ahead (GemvMmaKernel), which fits them in 128 registers like the
  // other two-tile configs (24 bytes of spill, ptxas sm_90a). On the spec layout (two row
  // pointers per tile, the activation permutes) that spills ~250 bytes, so there they keep both
  // register buffers at 161-168 registers, in blocks of at most 4 warps, 3 per SM.
  constexpr bool activations_just_in_time() const {
    return col_tiles == 2 && row_tiles == 2 && tiled;
  }
  constexpr bool spec_two_by_two() const { return col_tiles == 2 && row_tiles == 2 && !tiled; }
  // The largest k_split (warps per block): the block's warp budget (the kernel's launch bounds).
  constexpr int max_split() const {
    return spec_two_by_two() ? 4 : kGemvMaxWarpsPerBlock / col_tiles;
  }
  // The kernel's minimum resident blocks (its __launch_bounds__): what caps its registers.
  constexpr int min_blocks_per_sm() const {
    return spec_two_by_two() ? 3 : (col_tiles == 2 ? 2 : 1);
  }
};
// The k_split values the heuristic tries, largest first. 16 is never faster than 8 on the H200,
// nor 12 than 8 or 6 (benchmarks/RESULTS.md).
constexpr int kGemvSplits[] = {8, 6, 4, 3, 2, 1};

constexpr int64_t GemvCeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether k_split `split` may run: 1 always; more only within the block's warp budget and with
// at least two windows per warp.
constexpr bool GemvSplitAllowed(int split, GemvMmaShape shape, int64_t windows) {
  return split == 1 || (split <= shape.max_split() && 2 * split <= windows);
}

// Blocks of `split` warps resident per SM, of an instance with `resident_warps` warps per SM (at
// least 1: a block of at most max_split() warps always fits, its launch bounds say so).
constexpr int64_t GemvBlocksPerSm(int resident_warps, int split) {
  return resident_warps / split > 0 ? resident_warps / split : 1;
}

// The largest allowed k_split of kGemvSplits whose grid of `blocks` is resident all at once; 1
// where none is. resident_warps: the shape's instance's (GemvResidentWarps).
constexpr int GemvOneWaveSplit(int64_t blocks, GemvMmaShape shape, int resident_warps,
                               int64_t windows, int64_t sms) {
  for (const int split : kGemvSplits) {
    if (GemvSplitAllowed(split, shape, windows) &&
        blocks <= sms * GemvBlocksPerSm(resident_warps, split)) {
      return split;
    }
  }
  return 1;
}

// A block's fixed cost in windows of one warp's work: the first load's unhidden latency, the
// k_split reduction and the stores. Fitted: 3 puts 24576x8192 at M = 1-8 on k_split 8 in three
// waves, measured 6% slower on the H200 than the one-wave 2.
constexpr int64_t kGemvBlockOverheadWindows = 5;

// The allowed k_split of kGemvSplits that minimises the modelled time rounds x (windows per warp
// + kGemvBlockOverheadWindows), where rounds = the waves of resident blocks the grid needs; ties
// go to fewer rounds. On the H200 (12 shapes, M = 1-16) its pick is the fastest split or within
// 2.5%: up to M = 8 mostly the largest whose grid fits one wave (5120x17408 6, not 8: 18.0
// against 23.7 us); lm_head's many waves take 1 (75.6 against 82.6 us at 2); with two column and
// two row tiles on the spec layout (12 resident warps, M = 9-16) a split of 1.7 waves wins on
// 28672x8192 (3: 59.7 us, 4: 63.3, the one-wave 1: 67.9, 2 at 1.1 waves: 79.1); prepacked (16
// resident warps) its pick is the fastest on all eight shapes measured at M = 9-16
// (benchmarks/RESULTS.md).
constexpr int GemvSplit(int64_t blocks, GemvMmaShape shape, int resident_warps, int64_t windows,
                        int64_t sms) {
  int best = 1;
  int64_t best_rounds = 0, best_cost = 0;
  for (const int split : kGemvSplits) {
    if (!GemvSplitAllowed(split, shape, windows)) continue;
    const int64_t rounds = GemvCeilDiv(blocks, sms * GemvBlocksPerSm(resident_warps, split));
    const int64_t cost = rounds * (GemvCeilDiv(windows, split) + kGemvBlockOverheadWindows);
    if (best_cost == 0 || cost < best_cost || (cost == best_cost && rounds < best_rounds)) {
      best = split, best_rounds = rounds, best_cost = cost;
    }
  }
  return best;
}

// The k_split of a (col_tiles, row_tiles) instance for an [m, k] x [n, k] call: GemvSplit over
// its grid. What the heuristic picks, and what a call that fixes col_tiles but not k_split gets.
constexpr int gemv_mma_split(int64_t m, int64_t n, int64_t k, int64_t num_sms, bool tiled,
                             const GemvResidentWarps& warps, int col_tiles, int row_tiles) {
  const int64_t sms = num_sms > 0 ? num_sms : 1;
  const int64_t tiles = GemvCeilDiv(n > 0 ? n : 1, kGemvTileCols);
  const int64_t windows = k > 0 ? k / kGemvWindow : 0;
  const int64_t m_chunks = GemvCeilDiv(m > 0 ? m : 1, 8);
  const int64_t blocks = GemvCeilDiv(tiles, col_tiles) * GemvCeilDiv(m_chunks, row_tiles);
  return GemvSplit(blocks, GemvMmaShape{col_tiles, row_tiles, tiled},
                   warps.at(col_tiles, row_tiles), windows, sms);
}

// m, n, k: the matmul (K % 32 == 0 for any path; the mma fields matter only when K % 128 == 0).
// num_sms: the device's multiprocessor count (132 on an H200). tiled: the weight is prepacked
// (jax_fp4.prepack), which changes what two column with two row tiles cost (GemvMmaShape).
// warps: the resident warps per SM of the kernel instances of this layout and dtype.
//
// Measured on the H200 with prepacked weights, every config at M = 1-16 on twelve shapes: k_split
// by GemvSplit above, whose pick is the fastest config or within 2.5% on all of them. Four column
// tiles per warp (198-244 registers, 8 warps per SM) are never best: 94 against 77 us on lm_head
// at M = 4 (benchmarks/RESULTS.md; docs/design.md for the reasoning).
constexpr GemvLaunchConfig gemv_launch_config(int64_t m, int64_t n, int64_t k, int64_t num_sms,
                                              bool tiled, const GemvResidentWarps& warps) {
  const int64_t sms = num_sms > 0 ? num_sms : 1;
  const int64_t tiles = GemvCeilDiv(n > 0 ? n : 1, kGemvTileCols);
  const int64_t windows = k > 0 ? k / kGemvWindow : 0;
  const int64_t m_chunks = GemvCeilDiv(m > 0 ? m : 1, 8);  // 8-row tiles of M

  // M > 8: each decoded weight fragment feeds two 8-row tiles (one pass over the weight for 16
  // rows instead of two), and two column tiles share each activation fragment (a warp reads 2 KB
  // of activations per KB of weight instead of 4). Prepacked, with the activations loaded just
  // in time, they run 16 warps per SM like one tile: two tiles wherever their grid, 16 rows of M
  // a block row, has a block for every other SM (H200, M = 9 / 16: 4096x11008 13.9 / 14.7 us
  // against one tile's 15.3 / 17.3, 4096x4096 7.8 / 7.8 against 8.1 / 8.8; past M = 16 the rows
  // count, on an H100 at M = 24: 2048x16384 two tiles 19.9 against 22.2 us, 1024x16384 (64
  // two-tile blocks) one 14.0 against 18.5). On the spec layout (12 warps per SM) the rule of
  // M <= 8 below (H200, M = 16: 11008x4096 15.7 against 19.5, 28672x8192 63.7 against 76.5,
  // 24576x4096 27.5 against 34.4).
  // M <= 8: two column tiles where their grid still gives two waves of blocks (11008x4096 10.4
  // against 10.6 us, 28672x8192 36.1 against 38.9), except where it is just over one wave of
  // k_split-4 blocks at M <= 4 and one tile still splits K (17408x5120: one tile at k_split 2
  // 17.0-17.3 us, two 17.7; at M = 8, where the shared activations weigh more, two tiles win,
  // 17.8 to 19.2). One tile at k_split 1 would leave too few warps in flight (17408x5120
  // (1, 1): 22.0 us).
  const int row_tiles = m > 8 ? 2 : 1;
  int col_tiles = 1;
  if (m > 8 && tiled) {
    col_tiles = 2 * GemvCeilDiv(tiles, 2) * GemvCeilDiv(m_chunks, row_tiles) >= sms ? 2 : 1;
  } else if (GemvCeilDiv(tiles, 2) >= 2 * sms) {
    const int64_t two_tile_blocks = GemvCeilDiv(tiles, 2);
    // Two-tile blocks resident per SM at k_split 4: the unit of the "thin second wave" band.
    const int64_t wave = static_cast<int64_t>(warps.at(2, 1) / 4) * sms;
    const bool thin_second_wave = two_tile_blocks > wave && 2 * two_tile_blocks < 3 * wave;
    const bool one_tile_splits = GemvOneWaveSplit(tiles * m_chunks, GemvMmaShape{1, 1, tiled},
                                                  warps.at(1, 1), windows, sms) > 1;
    col_tiles = m <= 4 && thin_second_wave && one_tile_splits ? 1 : 2;
  }
  const int k_split = gemv_mma_split(m, n, k, num_sms, tiled, warps, col_tiles, row_tiles);

  // Scalar path: row tiling trades grid parallelism (M leaves gridDim.y) for weight reuse, so
  // only when the column grid ceil(N / 8) covers a wave of SMs on its own.
  int rows_per_block = 1;
  if (GemvCeilDiv(n > 0 ? n : 1, kGemvScalarColsPerBlock) >= sms) {
    rows_per_block = m >= 3 ? 4 : (m == 2 ? 2 : 1);
  }
  return GemvLaunchConfig{col_tiles, row_tiles, k_split, rows_per_block};
}

}  // namespace jax_fp4

#endif  // JAX_FP4_GEMV_CONFIG_H_
