// Device code of the tensor-core decode GEMV (GemvMmaKernel, sm_80+): the fragment layout, the
// loads, the decode policies, the mma loop and the k_split epilogue. Launched by
// ffi/cuda/gemv/launch.cuh; benchmarks/probes/gemv_probe.cu times variants of it.
#ifndef JAX_FP4_CUDA_GEMV_MMA_CUH_
#define JAX_FP4_CUDA_GEMV_MMA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gemv/common.cuh"
#include "cuda/ptx.cuh"
#include "jax_fp4/gemv_config.h"
#include "jax_fp4/nvfp4_cuda.cuh"

namespace jax_fp4 {
namespace cuda {

//------------------------------------------------------------------------------------------------
// Tensor-core kernel.
//
// mma.sync.m16n8k16.row.col.f32.{f16,bf16}: D[16x8] += A[16x16] * B[16x8]. Here
//   A row i   = output column col0 + i      (weight row, [N, K] row-major == row-major A),
//   B col j   = activation row m0 + j       ([M, K] row-major == col-major B),
//   k slot    = a permuted K index inside the current 128-wide window (below).
// With g = lane >> 2 and t = lane & 3, the PTX fragment layout gives lane (g, t):
//   a0 = A[g    ][2t, 2t+1]      a1 = A[g + 8][2t, 2t+1]
//   a2 = A[g    ][2t+8, 2t+9]    a3 = A[g + 8][2t+8, 2t+9]
//   b0 = B[2t, 2t+1][g]          b1 = B[2t+8, 2t+9][g]
//   c0 = D[g][2t]  c1 = D[g][2t+1]  c2 = D[g+8][2t]  c3 = D[g+8][2t+1]
// so a lane supplies weight rows (output columns) g and g+8 and activation row g, and receives
// output (column g, rows 2t, 2t+1) and (column g+8, rows 2t, 2t+1).
//
// K permutation: in k-step s (0..7) of a window, with W = s / 2 and j = 2 (s % 2), lane t's k
// slots map to window elements
//   slots 2t, 2t+1   -> 32t + 8W + j, 32t + 8W + j + 4
//   slots 2t+8, 2t+9 -> 32t + 8W + j + 1, 32t + 8W + j + 5
// (the same map for A and B, as it must be), so lane t owns the contiguous window elements
// [32t, 32t + 32): one uint4 of packed weight per weight row, 64 bytes of activation, and
// exactly two 16-element scale blocks (window block 2t for s < 4, 2t + 1 for s >= 4). Word W of
// the uint4 holds the 8 elements of k-steps 2W and 2W + 1; pairing element j with j + 4 (nibbles
// 16 bits apart) is what makes the decode cheap (decode_e2m1_split_pair), and costs two byte
// permutes per k-step on the activation side, shared by all column tiles.
//
// A warp computes CT (1 or 2) tiles of 16 columns with ONE activation fragment per window and row
// tile, for RT tiles of 8 activation rows (each decoded weight fragment feeds RT mma);
// k_split = blockDim.x / 32 warps of a block (any count up to 16 / CT) take windows warp,
// warp + k_split, ... and reduce in shared memory in a fixed order.
template <int CT, int RT>
struct MmaFragments {
  uint4 w[CT][2];     // packed weight, rows g and g + 8 of each column tile
  uint32_t s[CT][2];  // the two scale bytes of those rows
  uint4 a[RT][4];     // activation row g of each row tile, window elements [32t, 32t + 32)
};

// The lane's activation fragment of one window: the 64 bytes at `ap` (row g, elements 32t..).
template <typename T>
__device__ __forceinline__ void LoadActivation(uint4 (&dst)[4], const T* ap) {
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = ld_u4(ap + 8 * i);
}

// The activation fragments of every row tile at `ap`, which then advance by `step` windows.
template <typename T, int RT>
__device__ __forceinline__ void LoadActivations(uint4 (&dst)[RT][4], const T* (&ap)[RT],
                                                int64_t step) {
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    LoadActivation(dst[r], ap[r]);
    ap[r] += step * kGemvWindow;
  }
}

// Loads one window's fragments at the current pointers, then advances them by `step` windows
// (the activations only if LoadAct).
// Tiled: the weight in the tiled layout (jax_fp4/layout.py), [16-row tile][window][h][lane][16 B]
// and scales [tile][window][lane][rows g, g + 8: 2 x 2 B], so a warp's window is one 1 KB run and
// one 128 B run (only wp[ct][0] / sp[ct][0] are used).
template <typename T, int CT, int RT, int L2PrefetchBytes, bool Tiled = false, bool LoadAct = true>
__device__ __forceinline__ void MmaLoad(MmaFragments<CT, RT>& f, const uint8_t* (&wp)[CT][2],
                                        const uint8_t* (&sp)[CT][2], const T* (&ap)[RT],
                                        int64_t step) {
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
    if constexpr (Tiled) {
      f.w[ct][0] = ld_stream_u4<L2PrefetchBytes>(wp[ct][0]);
      f.w[ct][1] = ld_stream_u4<L2PrefetchBytes>(wp[ct][0] + 512);
      const uint32_t both = *reinterpret_cast<const uint32_t*>(sp[ct][0]);
      f.s[ct][0] = both;
      f.s[ct][1] = both >> 16;
      wp[ct][0] += step * 1024;
      sp[ct][0] += step * 128;
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        f.w[ct][h] = ld_stream_u4<L2PrefetchBytes>(wp[ct][h]);
        f.s[ct][h] = LoadScalePair(sp[ct][h]);
        wp[ct][h] += step * (kGemvWindow / 2);
        sp[ct][h] += step * (kGemvWindow / 16);
      }
    }
  }
  if constexpr (LoadAct) LoadActivations<T, RT>(f.a, ap, step);
}

// How a k-step gets its mma operands: the decode of the lane's packed word and the matching
// activation pairs. A policy so that benchmarks/probes/gemv_probe.cu can time the kernel with other
// decodes. K-step S reads word S / 2 (elements 0..7 of it) in split pairs: slots (2t, 2t + 1) hold
// elements (j, j + 4) and slots (2t + 8, 2t + 9) elements (j + 1, j + 5), j = 2 (S % 2).
struct DecodeE2M1 {
  // The A-fragment pairs of k-step S from packed word q: e2m1 * 2^HalfTraits<T>::kDecodeExp, exact.
  template <typename T, int S>
  __device__ __forceinline__ static void Weights(uint32_t q, uint32_t& first, uint32_t& second) {
    first = decode_e2m1_split_pair<T, 2 * (S % 2)>(q);
    second = decode_e2m1_split_pair<T, 2 * (S % 2) + 1>(q);
  }
  // The B-fragment pairs of k-step S from the word's activations (4 natural pairs).
  template <int S>
  __device__ __forceinline__ static void Activations(const uint4& x, uint32_t& b0, uint32_t& b1) {
    const uint32_t lo = S % 2 ? x.y : x.x, hi = S % 2 ? x.w : x.z;
    b0 = split_activation_pair<2 * (S % 2)>(lo, hi);
    b1 = split_activation_pair<2 * (S % 2) + 1>(lo, hi);
  }
};

// The decode of the tiled layout (decode_tiled_pair): k-step S (word S / 2) puts pair S % 2 in
// slots (2t, 2t + 1) and pair 2 + S % 2 in slots (2t + 8, 2t + 9); the activations stay in their
// natural pairs (no permutes).
struct DecodeTiled {
  template <typename T, int S>
  __device__ __forceinline__ static void Weights(uint32_t q, uint32_t& first, uint32_t& second) {
    first = decode_tiled_pair<T, S % 2>(q);
    second = decode_tiled_pair<T, 2 + S % 2>(q);
  }
  template <int S>
  __device__ __forceinline__ static void Activations(const uint4& x, uint32_t& b0, uint32_t& b1) {
    b0 = S % 2 ? x.y : x.x;
    b1 = S % 2 ? x.w : x.z;
  }
};

// Block scales of a window as 16-bit pairs (lo: the lane's first 16-element block, k-steps 0-3;
// hi: 4-7).
template <typename T, int CT, int RT>
__device__ __forceinline__ void ScalePairs(const MmaFragments<CT, RT>& f, uint32_t (&lo)[CT][2],
                                           uint32_t (&hi)[CT][2]) {
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
    for (int h = 0; h < 2; ++h) e4m3x2_scale_pairs<T>(f.s[ct][h], lo[ct][h], hi[ct][h]);
  }
}

// The A fragment {a0, a1, a2, a3} of k-step S for column tile ct: decoded weights x block scale.
template <typename T, int S, int CT, int RT, typename Decode>
__device__ __forceinline__ void DecodeStep(uint32_t (&frag)[4], const MmaFragments<CT, RT>& f,
                                           int ct, const uint32_t (&lo)[CT][2],
                                           const uint32_t (&hi)[CT][2]) {
  using Tr = HalfTraits<T>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows g (a0, a2) and g + 8 (a1, a3)
    const uint32_t sc = S < 4 ? lo[ct][h] : hi[ct][h];
    uint32_t first, second;
    Decode::template Weights<T, S>(Word<S / 2>(f.w[ct][h]), first, second);
    frag[h] = Tr::pair_mul(first, sc);
    frag[2 + h] = Tr::pair_mul(second, sc);
  }
}

template <typename T, int S, int CT, int RT, typename Decode>
__device__ __forceinline__ void DecodeAndMmaStep(float (&acc)[RT][CT][4],
                                                 const MmaFragments<CT, RT>& f,
                                                 const uint32_t (&lo)[CT][2],
                                                 const uint32_t (&hi)[CT][2]) {
  uint32_t b0[RT], b1[RT];  // one activation fragment per row tile for every column tile
#pragma unroll
  for (int r = 0; r < RT; ++r) Decode::template Activations<S>(f.a[r][S / 2], b0[r], b1[r]);
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
    uint32_t frag[4];
    DecodeStep<T, S, CT, RT, Decode>(frag, f, ct, lo, hi);
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      Mma16816<T>(acc[r][ct], frag[0], frag[1], frag[2], frag[3], b0[r], b1[r]);
    }
  }
}

// One window: 8 k-steps of decode + mma per column tile. K-step s accumulates into chain
// s % Chains: Chains independent accumulators shorten the dependent-HMMA chain of a window from 8
// to 8 / Chains (summed in chain order at the end, MmaSumChains).
template <typename T, int CT, int RT, typename Decode, int Chains>
__device__ __forceinline__ void MmaCompute(float (&acc)[Chains][RT][CT][4],
                                           const MmaFragments<CT, RT>& f) {
  static_assert(Chains == 1 || Chains == 2 || Chains == 4, "Chains divides the 8 k-steps");
  uint32_t lo[CT][2], hi[CT][2];
  ScalePairs<T, CT, RT>(f, lo, hi);
  DecodeAndMmaStep<T, 0, CT, RT, Decode>(acc[0 % Chains], f, lo, hi);
  DecodeAndMmaStep<T, 1, CT, RT, Decode>(acc[1 % Chains], f, lo, hi);
  DecodeAndMmaStep<T, 2, CT, RT, Decode>(acc[2 % Chains], f, lo, hi);
  DecodeAndMmaStep<T, 3, CT, RT, Decode>(acc[3 % Chains], f, lo, hi);
  DecodeAndMmaStep<T, 4, CT, RT, Decode>(acc[4 % Chains], f, lo, hi);
  DecodeAndMmaStep<T, 5, CT, RT, Decode>(acc[5 % Chains], f, lo, hi);
  DecodeAndMmaStep<T, 6, CT, RT, Decode>(acc[6 % Chains], f, lo, hi);
  DecodeAndMmaStep<T, 7, CT, RT, Decode>(acc[7 % Chains], f, lo, hi);
}

// acc[0] += acc[1] + ... in a fixed order (deterministic).
template <int Chains, int RT, int CT>
__device__ __forceinline__ void MmaSumChains(float (&acc)[Chains][RT][CT][4]) {
#pragma unroll
  for (int c = 1; c < Chains; ++c) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[0][rt][ct][r] += acc[c][rt][ct][r];
      }
    }
  }
}

// Dynamic shared memory of GemvMmaKernel: MmaEpilogue's reduce_buf, needed only when k_split > 1.
constexpr size_t GemvMmaSmemBytes(int col_tiles, int k_split) {
  return k_split > 1 ? sizeof(float) * k_split * col_tiles * 4 * 32 : 0;
}

// Epilogue of the mma kernel, run by all k_split warps of the block.
// Accumulator r of tile ct holds column col0 + 16 ct + g + 8 (r >= 2), row m0 + 2t + (r & 1).
// k_split > 1: the warps' partial sums meet in reduce_buf ([k_split][CT * 4][32] floats) and are
// summed in warp order (deterministic).
// Fused (the fused instances): the same reduction, then StoreFusedOutput. With silu_mul (CT == 2)
// column tile 0 holds the gate rows and tile 1 the matching up rows, so one lane (or, k_split > 1,
// one reduced element) has both products of its output; col0 is then in outputs. Without Fused
// the code is the plain kernel's.
template <typename T, int CT, bool Fused = false, typename Fusion = GemvFusion<T>>
__device__ __forceinline__ void MmaEpilogue(const float (&acc)[CT][4], float* reduce_buf,
                                            int k_split, const float* __restrict__ global_scale,
                                            const T* __restrict__ bias, T* __restrict__ y,
                                            int64_t m, int64_t n, int64_t col0, int64_t m0,
                                            const Fusion& fusion = Fusion{}) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const float gs = __ldg(global_scale);
  const bool silu = Fused && CT == 2 && fusion.silu_mul;
  const int64_t n_out = silu ? n / 2 : n;
  auto store = [&](int64_t row, int64_t col, float sum, float sum_up) {
    if constexpr (Fused) {
      StoreFusedOutput(y, bias, fusion, n_out, row, col, sum, sum_up, gs);
    } else {
      StoreOutput(y, bias, n, row, col, sum, gs);
    }
  };
  if (k_split == 1) {
#pragma unroll
    for (int ct = 0; ct < (silu ? 1 : CT); ++ct) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t col = col0 + kGemvTileCols * ct + g + (r >= 2 ? 8 : 0);
        const int64_t row = m0 + 2 * t + (r & 1);
        if (col < n_out && row < m) {
          store(row, col, acc[ct][r] * 128.0f, acc[CT - 1][r] * 128.0f);
        }
      }
    }
    return;
  }
  constexpr int kPerWarp = CT * 4 * 32;
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
    for (int r = 0; r < 4; ++r) reduce_buf[warp * kPerWarp + (ct * 4 + r) * 32 + lane] = acc[ct][r];
  }
  __syncthreads();
  const int outputs = silu ? 4 * 32 : kPerWarp;  // silu: tile 0's elements, tile 1's 128 later
  for (int e = threadIdx.x; e < outputs; e += 32 * k_split) {
    float sum = 0.0f, sum_up = 0.0f;
    for (int w2 = 0; w2 < k_split; ++w2) {
      sum += reduce_buf[w2 * kPerWarp + e];
      if (silu) sum_up += reduce_buf[w2 * kPerWarp + 4 * 32 + e];
    }
    const int el = e & 31, r = (e >> 5) & 3, ct = e >> 7;
    const int64_t col = col0 + kGemvTileCols * ct + (el >> 2) + (r >= 2 ? 8 : 0);
    const int64_t row = m0 + 2 * (el & 3) + (r & 1);
    if (col < n_out && row < m) store(row, col, sum * 128.0f, sum_up * 128.0f);
  }
  __syncthreads();  // reduce_buf is reused by the next M chunk
}

// Two-tile warps are held to 128 registers (2 blocks of the largest size per SM: 4 blocks of
// k_split 4 instead of 3 at the 137 they would take; no spills, ptxas -v).
// RT (row tiles of 8 activation rows per warp) is 1, or 2 (M > 8). Two row tiles with two column
// tiles (activations read once per 32 output columns instead of 16) take 176-185 registers with
// both register buffers; on the tiled layout they load the activations just in time (below) to
// fit 128, on the spec layout blocks of at most 4 warps, 3 per SM, hold them to 168
// (GemvMmaShape).
// L2PrefetchBytes (0 or 256): the L2 prefetch size of the weight loads. 256 pays when k_split > 1,
// where the block's other warps read the neighbouring windows of the same rows at the same time
// (1-4% at M = 1 on the H200); a lone warp walking its row gains nothing from it.
// Tiled: the weight is in the tiled layout (MmaLoad; N % 16 == 0), decoded by DecodeTiled.
//
// The whole kernel, as a device function: GemvMmaKernel below runs it with the decode of its
// layout and one accumulator chain; benchmarks/probes/gemv_probe.cu instantiates it with other
// Decode policies (no decode, the older adjacent-pair decode, a layout's decode on the other
// layout's addressing) and Chains = 2 or 4 (independent accumulators per window, MmaCompute) in
// kernels of its own, under the same launch bounds.
//
// Fused (the fused instances, GemvMmaFusedKernel): the epilogue applies `fusion` (silu_mul and the
// residual, MmaEpilogue); with silu_mul (CT == 2) a block computes 16 outputs from 16 gate
// rows (tile 0) and the 16 matching up rows (tile 1), grid.x over N / 2 outputs. Without Fused
// the code is the plain kernel's.
// Fusion: GemvFusion or a type extending it (common.cuh); with Fusion::kRowMap row i of the call
// multiplies a's row fusion.activation_row(i), read after the first window's weight loads are
// issued (that read then overlaps them).
template <typename T, int CT, int RT, typename Decode, int Chains, int L2PrefetchBytes, bool Tiled,
          bool Fused = false, typename Fusion = GemvFusion<T>>
__device__ __forceinline__ void GemvMmaMainloop(
    const T* __restrict__ a, const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scale,
    const float* __restrict__ global_scale, const T* __restrict__ bias, T* __restrict__ y,
    int64_t m, int64_t n, int64_t k, const Fusion& fusion = Fusion{}) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // Under a programmatic dependent launch (attribute programmatic): every operand may come from
  // the previous kernel, so nothing is loaded before it has finished; the next kernel may be
  // scheduled now.
  WaitForPrerequisiteGrids();
  AllowDependentLaunch();
  extern __shared__ float reduce_buf[];  // [k_split][CT * 4][32], only when k_split > 1
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int k_split = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t windows = k / kGemvWindow;
  const int64_t row_bytes = k / 2, k_blocks = k / 16;
  // silu_mul: tile 0 reads gate rows, tile 1 the matching up rows, col0 counts outputs.
  const bool silu = Fused && CT == 2 && fusion.silu_mul;
  const int64_t half = n / 2;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * (kGemvTileCols * (silu ? 1 : CT));

  // This lane's weight / scale bytes in window `warp` (the warp's first) of its rows: columns
  // col0 + 16 ct + g (+ 8), clamped into [0, n); the clamped rows' results are never stored.
  const uint8_t* wp_first[CT][2];
  const uint8_t* sp_first[CT][2];
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
    if constexpr (Tiled) {  // MmaLoad reads [ct][0]; n % 16 == 0
      // A tile past N (the grid's last block, CT > 1) reads the last tile; never stored.
      // silu_mul: N / 2 % 16 == 0 (the handler's check), the up tiles from tile N / 32.
      const int64_t tile =
          silu ? ct * (half / kGemvTileCols) + Min64(col0 / kGemvTileCols, half / kGemvTileCols - 1)
               : Min64(col0 / kGemvTileCols + ct, n / kGemvTileCols - 1);
      const int64_t tile_window = tile * windows + warp;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wp_first[ct][h] = packed + tile_window * 1024 + 16 * lane;
        sp_first[ct][h] = scale + tile_window * 128 + 4 * lane;
      }
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t col = silu ? ct * half + Min64(col0 + g + 8 * h, half - 1)
                                 : Min64(col0 + kGemvTileCols * ct + g + 8 * h, n - 1);
        wp_first[ct][h] = packed + col * row_bytes + warp * (kGemvWindow / 2) + 16 * t;
        sp_first[ct][h] = scale + col * k_blocks + warp * (kGemvWindow / 16) + 2 * t;
      }
    }
  }

  static_assert(CT == 1 || CT == 2, "one or two column tiles (four: 198-244 registers)");
  static_assert(RT == 1 || RT == 2, "one or two row tiles of 8 activation rows");
  const int64_t m_chunks = CeilDiv(m, 8 * RT);
  for (int64_t chunk = blockIdx.y; chunk < m_chunks; chunk += gridDim.y) {
    const int64_t m0 = chunk * 8 * RT;
    // A lane whose row lies past M reads row m0 instead: its B column only feeds an output row
    // of the mma that is never stored (cheaper than zeroing the fragment).
    // MmaLoad advances these pointers by k_split windows.
    const T* ap[RT];
    auto point_activations = [&] {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const int64_t row = m0 + 8 * r + g;
        ap[r] = a + fusion.activation_row(row < m ? row : m0) * k + 32 * t + warp * kGemvWindow;
      }
    };
    if constexpr (!Fusion::kRowMap) point_activations();
    const uint8_t* wp[CT][2];
    const uint8_t* sp[CT][2];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
      for (int h = 0; h < 2; ++h) wp[ct][h] = wp_first[ct][h], sp[ct][h] = sp_first[ct][h];
    }

    float acc[Chains][RT][CT][4];
#pragma unroll
    for (int c = 0; c < Chains; ++c) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[c][r][ct][e] = 0.0f;
        }
      }
    }

    // Two register buffers: the loads of the next window are in flight during this one's math.
    // (A third, loads two windows ahead, measures slower: docs/design.md.)
    // Except that two column and two row tiles on the tiled layout load a window's activations
    // right before its math (L1/L2 hits, shared by every column tile): one activation buffer's
    // 32 registers instead of two holds the warp to 128 registers and 16 warps per SM instead of
    // 168 and 12 (GemvMmaShape; M = 9-16 10-24% faster on the H200). The weight still comes one
    // window ahead.
    constexpr bool kActJit = GemvMmaShape{CT, RT, Tiled}.activations_just_in_time();
    auto act_jit = [&](MmaFragments<CT, RT>& f) {
      if constexpr (kActJit) LoadActivations<T, RT>(f.a, ap, k_split);
    };
    MmaFragments<CT, RT> f0, f1;
    int64_t w = warp;
    if constexpr (Fusion::kRowMap) {
      // The weight first: its address is known, the activation rows wait on the row map.
      if (w < windows) MmaLoad<T, CT, RT, L2PrefetchBytes, Tiled, false>(f0, wp, sp, ap, k_split);
      point_activations();
      if (!kActJit && w < windows) LoadActivations<T, RT>(f0.a, ap, k_split);
    } else if (w < windows) {
      MmaLoad<T, CT, RT, L2PrefetchBytes, Tiled, !kActJit>(f0, wp, sp, ap, k_split);
    }
    while (w < windows) {
      if (w + k_split < windows) {
        MmaLoad<T, CT, RT, L2PrefetchBytes, Tiled, !kActJit>(f1, wp, sp, ap, k_split);
      }
      act_jit(f0);
      MmaCompute<T, CT, RT, Decode, Chains>(acc, f0);
      w += k_split;
      if (w >= windows) break;
      if (w + k_split < windows) {
        MmaLoad<T, CT, RT, L2PrefetchBytes, Tiled, !kActJit>(f0, wp, sp, ap, k_split);
      }
      act_jit(f1);
      MmaCompute<T, CT, RT, Decode, Chains>(acc, f1);
      w += k_split;
    }
    MmaSumChains<Chains, RT, CT>(acc);
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      MmaEpilogue<T, CT, Fused, Fusion>(acc[0][r], reduce_buf, k_split, global_scale, bias, y, m, n,
                                        col0, m0 + 8 * r, fusion);
    }
  }
#else
  __trap();  // the launcher never selects this kernel below sm_80
#endif
}

// The decode of each weight layout: split pairs (spec) or the tiled layout's adjacent pairs.
template <bool Tiled>
using GemvLayoutDecode = std::conditional_t<Tiled, DecodeTiled, DecodeE2M1>;

// The production tensor-core kernel: CT column tiles and RT row tiles per warp, the weight in the
// spec or (Tiled) the tiled layout, L2PrefetchBytes (0 or 256) on the weight loads.
template <typename T, int CT, int RT, int L2PrefetchBytes, bool Tiled>
__global__ void __launch_bounds__(32 * GemvMmaShape{CT, RT, Tiled}.max_split(),
                                  GemvMmaShape{CT, RT, Tiled}.min_blocks_per_sm())
    GemvMmaKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                  const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                  const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n, int64_t k) {
  GemvMmaMainloop<T, CT, RT, GemvLayoutDecode<Tiled>, 1, L2PrefetchBytes, Tiled>(
      a, packed, scale, global_scale, bias, y, m, n, k);
}

// The fused instances of the production kernel (GemvFusion): same tiles, launch bounds and
// decode; `fusion` says which epilogue fusions apply.
template <typename T, int CT, int RT, int L2PrefetchBytes, bool Tiled>
__global__ void __launch_bounds__(32 * GemvMmaShape{CT, RT, Tiled}.max_split(),
                                  GemvMmaShape{CT, RT, Tiled}.min_blocks_per_sm())
    GemvMmaFusedKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                       const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                       const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n,
                       int64_t k, const GemvFusion<T> fusion) {
  GemvMmaMainloop<T, CT, RT, GemvLayoutDecode<Tiled>, 1, L2PrefetchBytes, Tiled, true>(
      a, packed, scale, global_scale, bias, y, m, n, k, fusion);
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GEMV_MMA_CUH_
