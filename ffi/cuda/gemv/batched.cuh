// Device code of the batched decode GEMV (GemvBatchedKernel, sm_90+, the tiled layout): the rows
// of a serving batch against a prepacked NVFP4 weight, up to 32 of them in one pass over the
// weight (more in chunks of 32).
//
// It is the tensor-core GEMV's mma (ffi/cuda/gemv/mma.cuh: the weight in mma.sync's A slot, its
// decode and fragment order) with the block turned around. The plain GEMV's block is k_split warps
// on the same columns, each on other K windows, so every warp loads its own activations: at
// M = 16 4 KB of activations per 2.25 KB of weight, from L2 (the likely reason M = 9-16 reach
// only 57-72% of the streaming read, docs/design.md). Here a block is CW column warps x KW K warps:
// the CW warps of one K lane read the same activation window at the same time (L1 hits of one L2
// read), so the L2 serves about one activation byte per weight byte at M = 32. Each warp takes two
// column tiles (a gate and its up tile under silu_mul) and RT 8-row activation tiles: all of M <=
// 32 in one pass over the weight. Small weights (a few hundred column tiles) cannot fill the GPU
// with column blocks alone, so the K windows are also split over a cluster of KS blocks (1, 1, KS),
// which reduce through distributed shared memory in rank order: deterministic, no workspace, one
// kernel. A lane's 16-byte activation load touches 16 lines (8 rows x 2), ~4x the L1 wavefronts
// of a coalesced load; the Staged instances copy each K lane's window into shared memory with
// whole-row copies instead and read it conflict-free (BatchedStageChunk).
#ifndef JAX_FP4_CUDA_GEMV_BATCHED_CUH_
#define JAX_FP4_CUDA_GEMV_BATCHED_CUH_

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/gemv/common.cuh"
#include "cuda/gemv/mma.cuh"
#include "cuda/ptx.cuh"
#include "jax_fp4/gemv_config.h"
#include "jax_fp4/nvfp4_cuda.cuh"

namespace jax_fp4 {
namespace cuda {

constexpr int kBatchedColTiles = 2;  // column tiles per warp (gate + up under silu_mul)

// Bytes of one staged activation window of a K lane: 8 RT rows x 128 bf16/fp16.
constexpr size_t BatchedStageBytes(int row_tiles) { return size_t{256} * 8 * row_tiles; }
constexpr int kBatchedStageSlots = 3;  // the windows a K lane holds: reading, landing, in flight

// Dynamic shared memory of GemvBatchedKernel: one fp32 partial per accumulator of every warp, and
// (Staged) three activation windows per K lane, in the same bytes (the partials are written after
// the last window is read).
constexpr size_t GemvBatchedSmemBytes(int row_tiles, int warps, int col_warps, bool staged) {
  const size_t partials = sizeof(float) * warps * row_tiles * kBatchedColTiles * 4 * 32;
  const size_t stages =
      staged ? kBatchedStageSlots * BatchedStageBytes(row_tiles) * (warps / col_warps) : 0;
  return partials > stages ? partials : stages;
}

// The 16-byte chunk (0..15) of a staged activation row that holds chunk c of row `row`. A lane
// (g, t) reads chunk 4 t + W of row 8 r + g; XOR-ing bit 1 with t's high bit and bit 0 with the
// row's parity gives the 8 lanes of each quarter warp 8 distinct 16-byte bank groups, so every
// 16-byte shared load is conflict-free.
__device__ __forceinline__ int BatchedStageChunk(int c, int row) {
  return c ^ ((c >> 3) << 1) ^ (row & 1);
}

// One k-step S of a window: the A fragments of both column tiles from the decoded weight, the B
// fragments of the RT row tiles from the activation word x (DecodeTiled's natural pairs).
template <typename T, int S, int RT>
__device__ __forceinline__ void BatchedStep(float (&acc)[RT][kBatchedColTiles][4],
                                            const MmaFragments<kBatchedColTiles, 1>& f,
                                            const uint32_t (&lo)[kBatchedColTiles][2],
                                            const uint32_t (&hi)[kBatchedColTiles][2],
                                            const uint4 (&x)[RT]) {
  uint32_t b0[RT], b1[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) DecodeTiled::Activations<S>(x[r], b0[r], b1[r]);
#pragma unroll
  for (int ct = 0; ct < kBatchedColTiles; ++ct) {
    uint32_t frag[4];
    DecodeStep<T, S, kBatchedColTiles, 1, DecodeTiled>(frag, f, ct, lo, hi);
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      Mma16816<T>(acc[r][ct], frag[0], frag[1], frag[2], frag[3], b0[r], b1[r]);
    }
  }
}

// The activation word W (k-steps 2W, 2W + 1) of every row tile: 16 bytes a lane, loaded right
// before its two k-steps, so a warp holds RT activation vectors, not 4 RT: 16 registers at M = 32
// instead of 64. load(r, W) is the lane's word W of row tile r (from L1 or the staged window).
template <typename T, int W, int RT, typename Load>
__device__ __forceinline__ void BatchedWord(float (&acc)[RT][kBatchedColTiles][4],
                                            const MmaFragments<kBatchedColTiles, 1>& f,
                                            const uint32_t (&lo)[kBatchedColTiles][2],
                                            const uint32_t (&hi)[kBatchedColTiles][2],
                                            const Load& load) {
  uint4 x[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) x[r] = load(r, W);
  BatchedStep<T, 2 * W, RT>(acc, f, lo, hi, x);
  BatchedStep<T, 2 * W + 1, RT>(acc, f, lo, hi, x);
}

// One 128-wide window: the scales, then the four words of 2 k-steps each (BatchedWord's load).
template <typename T, int RT, typename Load>
__device__ __forceinline__ void BatchedWindow(float (&acc)[RT][kBatchedColTiles][4],
                                              const MmaFragments<kBatchedColTiles, 1>& f,
                                              const Load& load) {
  uint32_t lo[kBatchedColTiles][2], hi[kBatchedColTiles][2];
  ScalePairs<T, kBatchedColTiles, 1>(f, lo, hi);
  BatchedWord<T, 0, RT>(acc, f, lo, hi, load);
  BatchedWord<T, 1, RT>(acc, f, lo, hi, load);
  BatchedWord<T, 2, RT>(acc, f, lo, hi, load);
  BatchedWord<T, 3, RT>(acc, f, lo, hi, load);
}

// The K lane's copy of one activation window into shared memory: its CW x 32 threads take 16-byte
// chunk c = tid % 16 of rows tid / 16 + 2 CW q (rows past M zero-filled), so each copy
// instruction reads 2 CW whole 256-byte rows.
template <int RT, int CW>
__device__ __forceinline__ void BatchedStageCopy(uint32_t dst, const void* src, int64_t row_bytes,
                                                 int valid_rows, const void* any_valid) {
  constexpr int kRowsPerPass = 2 * CW;
  static_assert(8 * RT % kRowsPerPass == 0, "whole passes of rows");
#pragma unroll
  for (int q = 0; q < 8 * RT / kRowsPerPass; ++q) {
    const bool valid = q * kRowsPerPass < valid_rows;
    CpAsync16(dst + 256 * kRowsPerPass * q,
              valid ? static_cast<const char*>(src) + q * kRowsPerPass * row_bytes : any_valid,
              valid ? 16 : 0);
  }
}

// The weight words and scales of one window of both column tiles (tiled layout: a 1 KB run and a
// 128-byte run per tile; tile 1's runs `tile_bytes` weight bytes past tile 0's, its scales an
// eighth of that), then the pointers advance by `step` windows.
__device__ __forceinline__ void BatchedLoad(MmaFragments<kBatchedColTiles, 1>& f,
                                            const uint8_t*& wp, const uint8_t*& sp,
                                            int64_t tile_bytes, int step) {
#pragma unroll
  for (int ct = 0; ct < kBatchedColTiles; ++ct) {
    const uint8_t* w = wp + ct * tile_bytes;
    const uint8_t* sc = sp + ct * (tile_bytes >> 3);
    f.w[ct][0] = ld_stream_u4<256>(w);
    f.w[ct][1] = ld_stream_u4<256>(w + 512);
    const uint32_t both = *reinterpret_cast<const uint32_t*>(sc);
    f.s[ct][0] = both;
    f.s[ct][1] = both >> 16;
  }
  wp += static_cast<int64_t>(step) * 1024;
  sp += static_cast<int64_t>(step) * 128;
}

// y = a @ dequant(w)^T for M rows in chunks of 8 RT (grid.y), the weight prepacked (N % 16 == 0,
// K % 128 == 0). Block: CW x KW warps, warp = kw * CW + cw; column warp cw of block x takes
// column tiles 2 (x CW + cw) and + 1 (silu_mul: gate tile x CW + cw and the up tile N / 32 past
// it), K warp kw the windows kw, kw + KW, ... of the block's share of K; block z of a cluster of
// KS (grid.z = KS) the z-th of KS even shares of the windows. Reduction: each warp's accumulators
// to shared memory, the K warps summed in kw order, then the cluster's blocks in rank order, each
// rank storing its share of the outputs (fused: GemvFusion's epilogue). Staged: each K lane's
// activation windows come through shared memory (cp.async, three slots, one named barrier of the
// lane's CW warps per window) instead of per-warp 16-byte loads served by L1.
template <typename T, int RT, int CW, bool Fused, bool Staged>
__global__ void __launch_bounds__(32 * kGemvMaxWarpsPerBlock, 1)
    GemvBatchedKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                      const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                      const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n,
                      int64_t k, const GemvFusion<T> fusion) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  WaitForPrerequisiteGrids();
  AllowDependentLaunch();
  extern __shared__ float partial[];  // [warp][RT][CT][4][32]
  constexpr int kPerWarp = RT * kBatchedColTiles * 4 * 32;
  constexpr int kPerTile = 4 * 32;
  cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int kw_count = warps / CW;
  const int cw = warp % CW, kw = warp / CW;
  const int g = lane >> 2, t = lane & 3;
  const int64_t windows = k / kGemvWindow;
  const int64_t tiles = n / kGemvTileCols;
  const bool silu = Fused && fusion.silu_mul;
  const int64_t n_out = silu ? n / 2 : n;
  const int rank = static_cast<int>(cluster.block_rank());
  const int ranks = static_cast<int>(cluster.num_blocks());
  // The cluster's even shares of the windows: rank `rank` takes [w_begin, w_end).
  const int64_t share = CeilDiv(windows, ranks);
  const int64_t w_begin = Min64(windows, rank * share), w_end = Min64(windows, w_begin + share);

  // Column tiles of this warp, clamped into the weight (a clamped tile's outputs are not stored).
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * CW + cw;  // pairs of tiles (outputs/32)
  int64_t tile[kBatchedColTiles];
  if (silu) {
    const int64_t half_tiles = tiles / 2;
    tile[0] = Min64(unit, half_tiles - 1);
    tile[1] = tile[0] + half_tiles;
  } else {
    tile[0] = Min64(2 * unit, tiles - 1);
    tile[1] = Min64(2 * unit + 1, tiles - 1);
  }

  const int64_t m_chunks = CeilDiv(m, 8 * RT);
  for (int64_t chunk = blockIdx.y; chunk < m_chunks; chunk += gridDim.y) {
    const int64_t m0 = chunk * 8 * RT;
    float acc[RT][kBatchedColTiles][4];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
      for (int ct = 0; ct < kBatchedColTiles; ++ct) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][ct][e] = 0.0f;
      }
    }
    const int64_t w0 = w_begin + kw;
    if (w0 < w_end) {
      const int64_t tile_window = tile[0] * windows + w0;
      const uint8_t* wp = packed + tile_window * 1024 + 16 * lane;
      const uint8_t* sp = scale + tile_window * 128 + 4 * lane;
      const int64_t tile_bytes = (tile[1] - tile[0]) * windows * 1024;
      // Two register buffers of weight: the next window's loads fly during this one's math.
      MmaFragments<kBatchedColTiles, 1> f0, f1;
      BatchedLoad(f0, wp, sp, tile_bytes, kw_count);
      auto for_each_window = [&](auto&& window) {
        for (int64_t w = w0; w < w_end;) {
          if (w + kw_count < w_end) BatchedLoad(f1, wp, sp, tile_bytes, kw_count);
          window(f0, w);
          w += kw_count;
          if (w >= w_end) break;
          if (w + kw_count < w_end) BatchedLoad(f0, wp, sp, tile_bytes, kw_count);
          window(f1, w);
          w += kw_count;
        }
      };
      if constexpr (Staged) {
        constexpr uint32_t kStage = static_cast<uint32_t>(BatchedStageBytes(RT));
        const int tl = cw * 32 + lane;  // the thread's place in its K lane
        const int chunk = tl & 15, srow = tl >> 4;
        const uint32_t stages = SmemAddr(partial) + kw * kBatchedStageSlots * kStage;
        const uint32_t dst = stages + 256 * srow + 16 * BatchedStageChunk(chunk, srow);
        const T* src = a + Min64(m0 + srow, m - 1) * k + 8 * chunk;
        const int valid_rows = static_cast<int>(Min64(m - m0 - srow, 8 * RT));
        auto stage = [&](int64_t w, int slot) {
          BatchedStageCopy<RT, CW>(dst + slot * kStage, src + w * kGemvWindow, k * sizeof(T),
                                   valid_rows, a);
        };
        // Lane (g, t) reads word W of row 8 r + g at 2048 r + word_off[W] (BatchedStageChunk).
        const uint32_t swizzle = ((t >> 1) << 1) | (g & 1);
        uint32_t word_off[4];
#pragma unroll
        for (int W = 0; W < 4; ++W) word_off[W] = 256 * g + 64 * t + 16 * (W ^ swizzle);
        stage(w0, 0);
        CpAsyncCommit();
        if (w0 + kw_count < w_end) stage(w0 + kw_count, 1);
        CpAsyncCommit();
        int slot = 0;
        for_each_window([&](const MmaFragments<kBatchedColTiles, 1>& f, int64_t w) {
          CpAsyncWait<1>();  // this thread's copies of window w have landed
          // ... and every thread's: the lane has also finished the window before w, whose slot
          // the copy of w + 2 KW now takes.
          NamedBarrierSync(1 + kw, 32 * CW);
          if (w + 2 * kw_count < w_end) stage(w + 2 * kw_count, slot == 0 ? 2 : slot - 1);
          CpAsyncCommit();
          const uint32_t stage = stages + slot * kStage;
          BatchedWindow<T, RT>(acc, f, [&](int r, int W) {
            return LdShared128(stage + 2048 * r + word_off[W]);  // row 8 r + g, chunk 4 t + W
          });
          slot = slot == 2 ? 0 : slot + 1;
        });
        CpAsyncWait<0>();
      } else {
        // Row tile r's rows sit row_off[r] elements past row m0 + g's (a lane whose row lies past
        // M reads row m0: its B column feeds only outputs never stored).
        const int64_t row0 = Min64(m0 + g, m - 1);
        const T* ap = a + row0 * k + w0 * kGemvWindow + 32 * t;
        int32_t row_off[RT];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const int64_t row = m0 + 8 * r + g;
          row_off[r] = static_cast<int32_t>(((row < m ? row : m0) - row0) * k);
        }
        const int64_t a_step = static_cast<int64_t>(kw_count) * kGemvWindow;
        // 32-bit offsets from one pointer keep RT 64-bit pointers out of the register budget.
        for_each_window([&](const MmaFragments<kBatchedColTiles, 1>& f, int64_t) {
          BatchedWindow<T, RT>(acc, f, [&](int r, int W) {
            return ld_u4(ap + row_off[r] + 8 * W);  // row m0 + 8 r + g, elements 32 t + 8 W
          });
          ap += a_step;
        });
      }
    }
    // Staged: the partials take the bytes of the K lanes' activation windows.
    if constexpr (Staged) __syncthreads();

    // The block's sum over its K warps, in kw order, into the slot of K warp 0.
    float* mine = partial + warp * kPerWarp;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
      for (int ct = 0; ct < kBatchedColTiles; ++ct) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          mine[((r * kBatchedColTiles + ct) * 4 + e) * 32 + lane] = acc[r][ct][e];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < CW * kPerWarp; i += blockDim.x) {
      float sum = partial[i];
      for (int q = 1; q < kw_count; ++q) sum += partial[q * CW * kPerWarp + i];
      partial[i] = sum;
    }
    // The cluster's blocks in rank order; rank `rank` stores every ranks-th output element.
    cluster.sync();
    const float gs = __ldg(global_scale);
    const int per_cw = silu ? RT * kPerTile : kPerWarp;  // silu: the gate tile's elements
    for (int i = rank * blockDim.x + threadIdx.x; i < CW * per_cw; i += ranks * blockDim.x) {
      const int c = i / per_cw, j = i % per_cw;
      // j = ((r * CT + ct) * 4 + e) * 32 + lane (silu: ct = 0 and the up element CT * ... later)
      const int el = j & 31, e = (j >> 5) & 3;
      const int ct = silu ? 0 : (j >> 7) % kBatchedColTiles;
      const int r = silu ? j >> 7 : (j >> 7) / kBatchedColTiles;
      const int base = c * kPerWarp + ((r * kBatchedColTiles + ct) * 4 + e) * 32 + el;
      float sum = 0.0f, sum_up = 0.0f;
      for (int q = 0; q < ranks; ++q) {
        const float* remote = cluster.map_shared_rank(partial, q);
        sum += remote[base];
        if (silu) sum_up += remote[base + kPerTile];
      }
      const int64_t col = (silu ? (static_cast<int64_t>(blockIdx.x) * CW + c) * kGemvTileCols
                                : (static_cast<int64_t>(blockIdx.x) * CW + c) * 2 * kGemvTileCols +
                                      kGemvTileCols * ct) +
                          (el >> 2) + (e >= 2 ? 8 : 0);
      const int64_t row = m0 + 8 * r + 2 * (el & 3) + (e & 1);
      if (col < n_out && row < m) {
        if constexpr (Fused) {
          StoreFusedOutput(y, bias, fusion, n_out, row, col, sum * 128.0f, sum_up * 128.0f, gs);
        } else {
          StoreOutput(y, bias, n, row, col, sum * 128.0f, gs);
        }
      }
    }
    cluster.sync();  // every rank has read this block's partials before they are overwritten
  }
#else
  __trap();  // the launcher selects this kernel on sm_90+ only
#endif
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GEMV_BATCHED_CUH_
