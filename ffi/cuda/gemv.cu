// CUDA decode GEMV: y[m, n] = round((sum_k a[m,k] * e2m1(code) * e4m3(scale[n, k/16])) * gs
//                                   + bias[n]),
// fp32 accumulation, NVFP4 weights decoded in registers (no dequantized copy of W). Two kernels:
//
// * GemvMmaKernel (sm_80+, K % 128 == 0): mma.sync m16n8k16 with the WEIGHT in the A slot
//   (16 output columns) and the activations in the B slot (8 rows of M). See the fragment table
//   above the kernel. The E4M3 block scale is folded into the decoded 16-bit weight before the
//   mma (exact), global scale and bias are applied in the epilogue. Loads of the next 128-wide
//   K window are in flight in registers during the current one's math. (A cp.async shared-memory
//   ring with 3-7 windows in flight per warp measured slower on the H200: benchmarks/NOTES.md.)
// * GemvScalarKernel (any K % 32 == 0): a warp per output column, 32 K elements (one 16-byte load
//   of packed weight, two scale blocks) per lane per step, per-block fp32 partial sums, a warp
//   shuffle reduction, and row tiling (RowsPerBlock rows of M share each decoded weight).
//
// Both are deterministic (fixed work split and reduction order) and never touch memory outside
// their operands: ragged N is clamped on loads and masked on stores, rows past M are never read.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/handlers.h"
#include "jax_fp4/gemv_config.h"
#include "jax_fp4/nvfp4.h"
#include "jax_fp4/nvfp4_cuda.cuh"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

template <int I>
__device__ __forceinline__ uint32_t Word(const uint4& v) {
  static_assert(I >= 0 && I < 4, "");
  return I == 0 ? v.x : (I == 1 ? v.y : (I == 2 ? v.z : v.w));
}

__device__ __forceinline__ int64_t Min64(int64_t x, int64_t y) { return x < y ? x : y; }

__device__ __forceinline__ uint32_t LoadScalePair(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);  // 2-byte aligned: K / 16 is even
}

template <typename T>
__device__ __forceinline__ void StoreOutput(T* y, const T* bias, int64_t n, int64_t row,
                                            int64_t col, float acc, float gs) {
  using Tr = HalfTraits<T>;
  const float b = bias != nullptr ? Tr::to_float(bias[col]) : 0.0f;
  y[row * n + col] = Tr::from_float(fmaf(acc, gs, b));
}

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
// K permutation: in k-step s (0..7) of a window, lane t's k slots map to window elements
//   slots 2t, 2t+1   -> 32t + 4s + 0, 1
//   slots 2t+8, 2t+9 -> 32t + 4s + 2, 3
// (the same map for A and B, as it must be), so lane t owns the contiguous window elements
// [32t, 32t + 32): one uint4 of packed weight per weight row, 64 bytes of activation, and
// exactly two 16-element scale blocks (window block 2t for s < 4, 2t + 1 for s >= 4). The uint4's
// word s/2 holds the 8 elements of k-steps s (bytes 0, 1 when s is even, bytes 2, 3 when odd);
// activation words 2s and 2s+1 hold elements 4s..4s+3.
//
// A warp computes ColTiles tiles of 16 columns with ONE activation fragment per window;
// k_split = blockDim.x / 32 warps of a block take windows warp, warp + k_split, ... and reduce in
// shared memory in a fixed order.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

template <int CT>
struct MmaFragments {
  uint4 w[CT][2];      // packed weight, rows g and g + 8 of each column tile
  uint32_t s[CT][2];   // the two scale bytes of those rows
  uint4 a[4];          // activation row g, window elements [32t, 32t + 32)
};

// Loads one window's fragments at the current pointers, then advances them by `step` windows.
template <typename T, int CT>
__device__ __forceinline__ void MmaLoad(MmaFragments<CT>& f, const uint8_t* (&wp)[CT][2],
                                        const uint8_t* (&sp)[CT][2], const T*& ap, bool has_row,
                                        int64_t step) {
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      f.w[ct][h] = ld_stream_u4(wp[ct][h]);
      f.s[ct][h] = LoadScalePair(sp[ct][h]);
      wp[ct][h] += step * (kGemvWindow / 2);
      sp[ct][h] += step * (kGemvWindow / 16);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f.a[i] = has_row ? ld_u4(ap + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
  }
  ap += step * kGemvWindow;
}

template <typename T, int S, int CT>
__device__ __forceinline__ void MmaStep(float (&acc)[CT][4], const MmaFragments<CT>& f,
                                        const uint32_t (&scale_lo)[CT][2],
                                        const uint32_t (&scale_hi)[CT][2]) {
  using Tr = HalfTraits<T>;
  constexpr int kWord = S / 2;        // the uint4 word holding k-steps 2 (S/2) and 2 (S/2) + 1
  constexpr int kByte = (S % 2) * 2;  // this step's elements 4S..4S+3: bytes kByte, kByte + 1
  const uint32_t b0 = Word<(2 * S) % 4>(f.a[(2 * S) / 4]);
  const uint32_t b1 = Word<(2 * S + 1) % 4>(f.a[(2 * S + 1) / 4]);
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
    uint32_t frag[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t q = Word<kWord>(f.w[ct][h]);
      const uint32_t q4 = q << 4;
      const uint32_t sc = S < 4 ? scale_lo[ct][h] : scale_hi[ct][h];
      frag[h][0] = Tr::pair_mul(decode_e2m1_pair<T, kByte>(q, q4), sc);
      frag[h][1] = Tr::pair_mul(decode_e2m1_pair<T, kByte + 1>(q, q4), sc);
    }
    Mma16816<T>(acc[ct], frag[0][0], frag[1][0], frag[0][1], frag[1][1], b0, b1);
  }
}

template <typename T, int CT>
__device__ __forceinline__ void MmaCompute(float (&acc)[CT][4], const MmaFragments<CT>& f) {
  using Tr = HalfTraits<T>;
  // Block scales as 16-bit pairs, pre-multiplied so that decode * scale = e2m1 * e4m3 * 2^-7.
  uint32_t scale_lo[CT][2], scale_hi[CT][2];
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float s0 = e4m3_to_float_fast(f.s[ct][h] & 0xFFu) * Tr::kScaleMul;
      const float s1 = e4m3_to_float_fast(f.s[ct][h] >> 8) * Tr::kScaleMul;
      scale_lo[ct][h] = Tr::pair_from_floats(s0, s0);
      scale_hi[ct][h] = Tr::pair_from_floats(s1, s1);
    }
  }
  MmaStep<T, 0>(acc, f, scale_lo, scale_hi);
  MmaStep<T, 1>(acc, f, scale_lo, scale_hi);
  MmaStep<T, 2>(acc, f, scale_lo, scale_hi);
  MmaStep<T, 3>(acc, f, scale_lo, scale_hi);
  MmaStep<T, 4>(acc, f, scale_lo, scale_hi);
  MmaStep<T, 5>(acc, f, scale_lo, scale_hi);
  MmaStep<T, 6>(acc, f, scale_lo, scale_hi);
  MmaStep<T, 7>(acc, f, scale_lo, scale_hi);
}

// Epilogue of the mma kernels. Accumulator r of tile ct holds column col0 + 16 ct + g + 8 (r >= 2),
// row m0 + 2t + (r & 1). k_split > 1: the warps' partial sums meet in reduce_buf
// ([k_split][CT * 4][32] floats) and are summed in warp order (deterministic).
template <typename T, int CT>
__device__ __forceinline__ void MmaEpilogue(const float (&acc)[CT][4], float* reduce_buf,
                                            const float* __restrict__ global_scale,
                                            const T* __restrict__ bias, T* __restrict__ y,
                                            int64_t m, int64_t n, int64_t col0, int64_t m0) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int k_split = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const float gs = __ldg(global_scale);
  if (k_split == 1) {
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t col = col0 + kGemvTileCols * ct + g + (r >= 2 ? 8 : 0);
        const int64_t row = m0 + 2 * t + (r & 1);
        if (col < n && row < m) StoreOutput(y, bias, n, row, col, acc[ct][r] * 128.0f, gs);
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
  for (int e = threadIdx.x; e < kPerWarp; e += blockDim.x) {
    float sum = 0.0f;
    for (int w2 = 0; w2 < k_split; ++w2) sum += reduce_buf[w2 * kPerWarp + e];
    const int el = e & 31, r = (e >> 5) & 3, ct = e >> 7;
    const int64_t col = col0 + kGemvTileCols * ct + (el >> 2) + (r >= 2 ? 8 : 0);
    const int64_t row = m0 + 2 * (el & 3) + (r & 1);
    if (col < n && row < m) StoreOutput(y, bias, n, row, col, sum * 128.0f, gs);
  }
  __syncthreads();  // reduce_buf is reused by the next M chunk
}

template <typename T, int CT>
__global__ void __launch_bounds__(32 * kGemvMaxWarpsPerBlock / CT)
    GemvMmaKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                  const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                  const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n, int64_t k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float reduce_buf[];  // [k_split][CT * 4][32], only when k_split > 1
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int k_split = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t windows = k / kGemvWindow;
  const int64_t row_bytes = k / 2, k_blocks = k / 16;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * (kGemvTileCols * CT);

  // This lane's weight / scale rows: columns col0 + 16 ct + g (+ 8), clamped into [0, n); the
  // clamped rows' results are never stored.
  const uint8_t* wp_row[CT][2];
  const uint8_t* sp_row[CT][2];
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t col = Min64(col0 + kGemvTileCols * ct + g + 8 * h, n - 1);
      wp_row[ct][h] = packed + col * row_bytes + 16 * t;
      sp_row[ct][h] = scale + col * k_blocks + 2 * t;
    }
  }

  const int64_t m_chunks = CeilDiv(m, 8);
  for (int64_t chunk = blockIdx.y; chunk < m_chunks; chunk += gridDim.y) {
    const int64_t m0 = chunk * 8;
    const int rows = static_cast<int>(Min64(8, m - m0));
    const bool has_row = g < rows;  // rows past M are never read: their B column is zero
    // Pointers at window `warp` of this lane's rows; MmaLoad advances them by k_split windows.
    const T* ap = a + (m0 + (has_row ? g : 0)) * k + 32 * t + warp * kGemvWindow;
    const uint8_t* wp[CT][2];
    const uint8_t* sp[CT][2];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wp[ct][h] = wp_row[ct][h] + warp * (kGemvWindow / 2);
        sp[ct][h] = sp_row[ct][h] + warp * (kGemvWindow / 16);
      }
    }

    float acc[CT][4];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) acc[ct][0] = acc[ct][1] = acc[ct][2] = acc[ct][3] = 0.0f;

    // Two register buffers: the loads of the next window are in flight during this one's math.
    MmaFragments<CT> f0, f1;
    int64_t w = warp;
    if (w < windows) MmaLoad<T, CT>(f0, wp, sp, ap, has_row, k_split);
    while (w < windows) {
      if (w + k_split < windows) MmaLoad<T, CT>(f1, wp, sp, ap, has_row, k_split);
      MmaCompute<T, CT>(acc, f0);
      w += k_split;
      if (w >= windows) break;
      if (w + k_split < windows) MmaLoad<T, CT>(f0, wp, sp, ap, has_row, k_split);
      MmaCompute<T, CT>(acc, f1);
      w += k_split;
    }
    MmaEpilogue<T, CT>(acc, reduce_buf, global_scale, bias, y, m, n, col0, m0);
  }
#else
  __trap();  // the launcher never selects this kernel below sm_80
#endif
}

//------------------------------------------------------------------------------------------------
// Scalar kernel: a warp per output column, RowsPerBlock rows of M per warp.
template <typename T, int R>
__device__ __forceinline__ void ScalarRow(float& acc, const T* ap, const float (&wf)[32], float s0,
                                          float s1) {
  using Tr = HalfTraits<T>;
  uint4 av[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) av[i] = ld_u4(ap + 8 * i);
  float lo = 0.0f, hi = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t words[4] = {av[i].x, av[i].y, av[i].z, av[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = Tr::pair_to_float2(words[j]);
      const int e = 8 * i + 2 * j;  // element index within the lane's 32
      if (e < 16) {
        lo = fmaf(x.x, wf[e], lo);
        lo = fmaf(x.y, wf[e + 1], lo);
      } else {
        hi = fmaf(x.x, wf[e], hi);
        hi = fmaf(x.y, wf[e + 1], hi);
      }
    }
  }
  acc = fmaf(lo, s0, acc);
  acc = fmaf(hi, s1, acc);
}

template <typename T, int R>
__global__ void __launch_bounds__(32 * kGemvScalarColsPerBlock)
    GemvScalarKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                     const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                     const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n, int64_t k) {
  const int lane = threadIdx.x & 31;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kGemvScalarColsPerBlock + (threadIdx.x >> 5);
  if (col >= n) return;  // warp-uniform
  const int64_t chunks = k / 32;
  const uint8_t* wrow = packed + col * (k / 2);
  const uint8_t* srow = scale + col * (k / 16);
  const int64_t tiles = CeilDiv(m, R);

  for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const int64_t m0 = tile * R;
    const int rows = static_cast<int>(Min64(R, m - m0));
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;

    int64_t c = lane;
    uint4 q = make_uint4(0u, 0u, 0u, 0u);
    uint32_t sb = 0;
    if (c < chunks) {
      q = ld_stream_u4(wrow + 16 * c);
      sb = LoadScalePair(srow + 2 * c);
    }
    for (; c < chunks; c += 32) {
      uint4 qn = make_uint4(0u, 0u, 0u, 0u);
      uint32_t sbn = 0;
      if (c + 32 < chunks) {  // next chunk's weight in flight during this one's math
        qn = ld_stream_u4(wrow + 16 * (c + 32));
        sbn = LoadScalePair(srow + 2 * (c + 32));
      }
      // Block scales * 2^14 (the fp16 decode below is e2m1 * 2^-14); NaN bytes give NaN.
      const float s0 = e4m3_to_float_fast(sb & 0xFFu) * 16384.0f;
      const float s1 = e4m3_to_float_fast(sb >> 8) * 16384.0f;
      float wf[32];
      const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t q4 = qw[j] << 4;
        const float2 p0 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 0>(qw[j], q4));
        const float2 p1 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 1>(qw[j], q4));
        const float2 p2 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 2>(qw[j], q4));
        const float2 p3 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 3>(qw[j], q4));
        wf[8 * j + 0] = p0.x; wf[8 * j + 1] = p0.y;
        wf[8 * j + 2] = p1.x; wf[8 * j + 3] = p1.y;
        wf[8 * j + 4] = p2.x; wf[8 * j + 5] = p2.y;
        wf[8 * j + 6] = p3.x; wf[8 * j + 7] = p3.y;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) ScalarRow<T, R>(acc[r], a + (m0 + r) * k + 32 * c, wf, s0, s1);
      }
      q = qn;
      sb = sbn;
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], off);
    }
    if (lane == 0) {
      const float gs = __ldg(global_scale);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) StoreOutput(y, bias, n, m0 + r, col, acc[r], gs);
      }
    }
  }
}

//------------------------------------------------------------------------------------------------
// Launchers.
constexpr int64_t kMaxGridY = 65535;

template <typename T, int CT>
cudaError_t LaunchMma(cudaStream_t stream, const T* a, const uint8_t* packed, const uint8_t* scale,
                      const float* gs, const T* bias, T* y, int64_t m, int64_t n, int64_t k,
                      int k_split) {
  const int64_t tiles = CeilDiv(n, kGemvTileCols);
  const dim3 grid(static_cast<unsigned>(CeilDiv(tiles, CT)),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(m, 8), kMaxGridY)));
  const dim3 block(32 * k_split);
  const size_t smem = k_split > 1 ? sizeof(float) * k_split * CT * 4 * 32 : 0;
  GemvMmaKernel<T, CT><<<grid, block, smem, stream>>>(a, packed, scale, gs, bias, y, m, n, k);
  return cudaGetLastError();
}

template <typename T, int R>
cudaError_t LaunchScalar(cudaStream_t stream, const T* a, const uint8_t* packed,
                         const uint8_t* scale, const float* gs, const T* bias, T* y, int64_t m,
                         int64_t n, int64_t k) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(n, kGemvScalarColsPerBlock)),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(m, R), kMaxGridY)));
  GemvScalarKernel<T, R><<<grid, 32 * kGemvScalarColsPerBlock, 0, stream>>>(a, packed, scale, gs,
                                                                             bias, y, m, n, k);
  return cudaGetLastError();
}

// Debug / tuning override: JAX_FP4_GEMV_CONFIG="col_tiles,k_split[,rows_per_block]" (read on
// each call; empty or unset = the heuristic): col_tiles and rows_per_block 1, 2 or 4; k_split >= 1,
// rounded down to a power of two within the block's warp budget. Anything else is an error.
std::string ApplyConfigOverride(GemvLaunchConfig* cfg) {
  const char* env = std::getenv("JAX_FP4_GEMV_CONFIG");
  if (env == nullptr || *env == '\0') return "";
  int ct = 0, ks = 0, rows = 1, used = 0;
  const int got = std::sscanf(env, "%d,%d%n,%d%n", &ct, &ks, &used, &rows, &used);
  if (got < 2 || env[used] != '\0' || !(ct == 1 || ct == 2 || ct == 4) || ks < 1 ||
      !(rows == 1 || rows == 2 || rows == 4)) {
    return std::string("JAX_FP4_GEMV_CONFIG must be col_tiles,k_split[,rows_per_block] with "
                       "col_tiles and rows_per_block in {1, 2, 4} and k_split >= 1, got '") +
           env + "'";
  }
  cfg->col_tiles = ct;
  int p = 1;
  while (p * 2 <= ks && p * 2 * ct <= kGemvMaxWarpsPerBlock) p *= 2;
  cfg->k_split = p;
  cfg->rows_per_block = rows;
  return "";
}

template <typename T>
cudaError_t LaunchGemv(cudaStream_t stream, const DeviceInfo& info, const void* a,
                       const uint8_t* packed, const uint8_t* scale, const float* gs,
                       const void* bias, void* y, int64_t m, int64_t n, int64_t k, bool use_mma,
                       bool row_tiling, const GemvLaunchConfig& cfg) {
  const T* at = static_cast<const T*>(a);
  const T* bt = static_cast<const T*>(bias);
  T* yt = static_cast<T*>(y);
  if (use_mma && k > 0 && k % kGemvWindow == 0 && info.sm >= 80) {
    switch (cfg.col_tiles) {
      case 4: return LaunchMma<T, 4>(stream, at, packed, scale, gs, bt, yt, m, n, k, cfg.k_split);
      case 2: return LaunchMma<T, 2>(stream, at, packed, scale, gs, bt, yt, m, n, k, cfg.k_split);
      default: return LaunchMma<T, 1>(stream, at, packed, scale, gs, bt, yt, m, n, k, cfg.k_split);
    }
  }
  const int rows = row_tiling ? cfg.rows_per_block : 1;
  switch (rows) {
    case 4: return LaunchScalar<T, 4>(stream, at, packed, scale, gs, bt, yt, m, n, k);
    case 2: return LaunchScalar<T, 2>(stream, at, packed, scale, gs, bt, yt, m, n, k);
    default: return LaunchScalar<T, 1>(stream, at, packed, scale, gs, bt, yt, m, n, k);
  }
}

ffi::Error GemvCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                        ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::F32> global_scale,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, int64_t block_size,
                        bool use_mma, bool row_tiling) {
  MatmulShape shape;
  const std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      global_scale.element_count(), bias.element_type(), bias.element_count(), y->element_type(),
      y->dimensions(), block_size, /*allow_f32=*/false, &shape);
  if (!problem.empty()) return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + problem);
  if (block_size != 16) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: block_size must be 16, got " +
                                       std::to_string(block_size));
  }
  if (shape.k % 32 != 0) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: K must be a multiple of 32, got " +
                                       std::to_string(shape.k));
  }
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  const void* bias_data = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  // 16-byte vector loads of a and packed (rows are 16-byte multiples since K % 32 == 0).
  if (!IsAligned(a.untyped_data(), 16) || !IsAligned(packed.untyped_data(), 16) ||
      !IsAligned(scale.untyped_data(), 2)) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: a and packed must be 16-byte aligned and scale 2-byte aligned");
  }

  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: device query", err);
  GemvLaunchConfig cfg = gemv_launch_config(shape.m, shape.n, shape.k, info.num_sms);
  const std::string bad_override = ApplyConfigOverride(&cfg);
  if (!bad_override.empty()) return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + bad_override);

  if (a.element_type() == ffi::DataType::F16) {
    err = LaunchGemv<__half>(stream, info, a.untyped_data(), packed.typed_data(),
                             scale.typed_data(), global_scale.typed_data(), bias_data,
                             y->untyped_data(), shape.m, shape.n, shape.k, use_mma, row_tiling, cfg);
  } else {
    err = LaunchGemv<__nv_bfloat16>(stream, info, a.untyped_data(), packed.typed_data(),
                                    scale.typed_data(), global_scale.typed_data(), bias_data,
                                    y->untyped_data(), shape.m, shape.n, shape.k, use_mma,
                                    row_tiling, cfg);
  }
  if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4GemvCuda, jax_fp4::cuda::GemvCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // a [M, K] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scale [N, K/16] (E4M3 bytes)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // global scale, one element
                                  .Arg<ffi::AnyBuffer>()          // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N]
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("use_mma")
                                  .Attr<bool>("row_tiling"),
                              {ffi::Traits::kCmdBufferCompatible});
