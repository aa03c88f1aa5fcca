// The scalar decode GEMV (GemvScalarKernel, any K % 32 == 0): a warp per output column, 32 K
// elements per lane per step, R rows of M sharing each decoded weight; and its fused instances
// (GemvScalarFusedKernel: silu_mul, residual), one body (GemvScalarBody) for both.
#ifndef JAX_FP4_CUDA_GEMV_SCALAR_CUH_
#define JAX_FP4_CUDA_GEMV_SCALAR_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/gemv/common.cuh"
#include "cuda/ptx.cuh"
#include "jax_fp4/gemv_config.h"
#include "jax_fp4/nvfp4_cuda.cuh"

namespace jax_fp4 {
namespace cuda {

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

// The 32 weights of chunk q (one packed uint4: e2m1 * 2^-14, fp16 decode) as f32.
__device__ __forceinline__ void DecodeScalarChunk(float (&wf)[32], const uint4& q) {
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t q4 = qw[j] << 4;
    const float2 p0 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 0>(qw[j], q4));
    const float2 p1 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 1>(qw[j], q4));
    const float2 p2 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 2>(qw[j], q4));
    const float2 p3 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 3>(qw[j], q4));
    wf[8 * j + 0] = p0.x;
    wf[8 * j + 1] = p0.y;
    wf[8 * j + 2] = p1.x;
    wf[8 * j + 3] = p1.y;
    wf[8 * j + 4] = p2.x;
    wf[8 * j + 5] = p2.y;
    wf[8 * j + 6] = p3.x;
    wf[8 * j + 7] = p3.y;
  }
}

// The dot products of weight row `wrow` / `srow` with rows m0 .. m0 + rows - 1 of a, summed over
// the warp (chunks = k / 32).
template <typename T, int R>
__device__ __forceinline__ void ScalarDot(float (&acc)[R], const uint8_t* wrow, const uint8_t* srow,
                                          const T* a, int64_t m0, int rows, int64_t k,
                                          int64_t chunks) {
  const int lane = threadIdx.x & 31;
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
    // Block scales * 2^14 (the fp16 decode is e2m1 * 2^-14); NaN bytes give NaN.
    const float s0 = e4m3_to_float_fast(sb & 0xFFu) * 16384.0f;
    const float s1 = e4m3_to_float_fast(sb >> 8) * 16384.0f;
    float wf[32];
    DecodeScalarChunk(wf, q);
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
}

// The whole scalar kernel, as a device function: a warp per output column. Fused (the fused
// instances, GemvFusion): the epilogue applies `fusion`; with silu_mul the warp computes both its
// gate row j and its up row N / 2 + j (two passes over K), the grid covers N / 2 outputs. Without
// Fused the code is the plain kernel's.
template <typename T, int R, bool Fused>
__device__ __forceinline__ void GemvScalarBody(
    const T* __restrict__ a, const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scale,
    const float* __restrict__ global_scale, const T* __restrict__ bias, T* __restrict__ y,
    int64_t m, int64_t n, int64_t k, const GemvFusion<T>& fusion) {
  const int lane = threadIdx.x & 31;
  const bool silu = Fused && fusion.silu_mul;
  const int64_t n_out = silu ? n / 2 : n;
  const int64_t col =
      static_cast<int64_t>(blockIdx.x) * kGemvScalarColsPerBlock + (threadIdx.x >> 5);
  if (col >= n_out) return;  // warp-uniform
  // The plain kernel keeps its row's pointers and chunk count across the M tiles; the fused one
  // forms them in each tile (kept beside the up row's, they cost it 12 to 23 more registers:
  // ptxas -v).
  const uint8_t* const wrow = packed + col * (k / 2);
  const uint8_t* const srow = scale + col * (k / 16);
  const int64_t chunks = k / 32;
  const int64_t tiles = CeilDiv(m, R);
  for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const int64_t m0 = tile * R;
    const int rows = static_cast<int>(Min64(R, m - m0));
    float acc[R], up[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f, up[r] = 0.0f;
    if constexpr (Fused) {
      auto dot = [&](float (&dst)[R], int64_t row) {
        ScalarDot<T, R>(dst, packed + row * (k / 2), scale + row * (k / 16), a, m0, rows, k,
                        k / 32);
      };
      dot(acc, col);
      if (silu) dot(up, n_out + col);  // the matching up row
    } else {
      ScalarDot<T, R>(acc, wrow, srow, a, m0, rows, k, chunks);
    }
    if (lane == 0) {
      const float gs = __ldg(global_scale);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) {
          if constexpr (Fused) {
            StoreFusedOutput(y, bias, fusion, n_out, m0 + r, col, acc[r], up[r], gs);
          } else {
            StoreOutput(y, bias, n, m0 + r, col, acc[r], gs);
          }
        }
      }
    }
  }
}

template <typename T, int R>
__global__ void __launch_bounds__(32 * kGemvScalarColsPerBlock)
    GemvScalarKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                     const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                     const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n,
                     int64_t k) {
  GemvScalarBody<T, R, false>(a, packed, scale, global_scale, bias, y, m, n, k, GemvFusion<T>{});
}

// The fused instances (GemvFusion): same launch bounds; `fusion` says which epilogue fusions
// apply.
template <typename T, int R>
__global__ void __launch_bounds__(32 * kGemvScalarColsPerBlock)
    GemvScalarFusedKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                          const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                          const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n,
                          int64_t k, const GemvFusion<T> fusion) {
  GemvScalarBody<T, R, true>(a, packed, scale, global_scale, bias, y, m, n, k, fusion);
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GEMV_SCALAR_CUH_
