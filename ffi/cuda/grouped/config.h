// Launch choices of the grouped (mixture-of-experts) CUDA kernels, from static shapes only (the
// group sizes are runtime values the host never reads): host-only constexpr C++.
//
// Both kernels plan for the worst case of E = min(G, M) groups with rows, about M / E rows each:
// the decode GEMV launches as the plain GEMV would for an [M / E, K] x [E N, K] problem (its grid
// is the same column blocks per active group), the GEMM picks its activation tile from M / E.
#ifndef JAX_FP4_CUDA_GROUPED_CONFIG_H_
#define JAX_FP4_CUDA_GROUPED_CONFIG_H_

#include <cstdint>

#include "jax_fp4/gemv_config.h"

namespace jax_fp4 {

// Rows per group with rows, at worst: ceil(M / min(G, M)) (>= 1).
constexpr int64_t GroupedRowsPerGroup(int64_t m, int64_t g) {
  const int64_t active = g < m ? g : m;
  return active > 0 ? (m + active - 1) / active : 1;
}

struct GroupedLaunchConfig {
  // Grouped GEMV (GemvMmaMainloop per chunk of 8 row_tiles rows of one group).
  int gemv_col_tiles;  // 16-column tiles per warp (1 or 2)
  int gemv_row_tiles;  // 8-row activation tiles per warp (1 or 2): a chunk is 8 row_tiles rows
  int gemv_k_split;    // warps per block splitting K
  // Grouped GEMM (the fused GEMM's warp-specialized pipeline, one CTA per (group, M tile, N
  // tile)): the activation tile, BM = 64, 128 or 256 rows (256 weight rows per CTA up to 128, 128
  // at 256: FusedConfig's default tiles).
  int gemm_tile_m;
};

// Activation rows of the grouped GEMM's CTA tile. A group of r rows takes ceil(r / BM) tiles,
// about r / BM + 1/2 with routed sizes; the 128-row tile (256 weight rows) and the 256-row tile
// (128 weight rows) do the same multiply-adds per CTA, so per weight the 256-row tile needs
// r / 128 + 1 CTAs against the 128-row tile's r / 128 + 1/2, and pays off only where its ~12%
// faster CTA (docs/design.md, fused GEMM at M = 256) outweighs the extra half tile: r > ~400.
constexpr int GroupedGemmTileM(int64_t m, int64_t g) {
  const int64_t r = GroupedRowsPerGroup(m, g);
  return r <= 64 ? 64 : (r <= 384 ? 128 : 256);
}

// Bytes of the grouped GEMM's workspace result: none (the tile schedule lives in each CTA's
// registers). Mirrored by jax_fp4.grouped.grouped_gemm_workspace_bytes.
constexpr int64_t GroupedGemmWorkspaceBytes(int64_t /*m*/, int64_t /*n*/, int64_t /*k*/,
                                            int64_t /*g*/) {
  return 0;
}

// m, n, k: the problem ([M, K] x G experts [N, K]); g: the groups; num_sms; tiled: the weights'
// layout; warps: the resident warps per SM of the grouped GEMV's kernel instances; silu_mul: the
// GEMV's fused epilogue, which pairs a 16-row gate tile with its up tile in each warp (two column
// tiles, the split for them).
constexpr GroupedLaunchConfig grouped_launch_config(int64_t m, int64_t n, int64_t k, int64_t g,
                                                    int64_t num_sms, bool tiled,
                                                    const GemvResidentWarps& warps,
                                                    bool silu_mul = false) {
  const int64_t active = g < m ? (g > 0 ? g : 1) : (m > 0 ? m : 1);
  const int64_t rows = GroupedRowsPerGroup(m, g);
  GemvLaunchConfig gemv = gemv_launch_config(rows, n * active, k, num_sms, tiled, warps);
  if (silu_mul && gemv.col_tiles != 2) {
    gemv.col_tiles = 2;
    gemv.k_split = gemv_mma_split(rows, n * active, k, num_sms, tiled, warps, 2, gemv.row_tiles);
  }
  return GroupedLaunchConfig{gemv.col_tiles, gemv.row_tiles, gemv.k_split, GroupedGemmTileM(m, g)};
}

}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_CONFIG_H_
