// Host side of the CUDA decode GEMV: the resident warps of each tensor-core kernel instance (the
// occupancy API, for the launch heuristic of jax_fp4/gemv_config.h) and the launches of both
// kernels, plain or fused (GemvFusion). Included by the handler (ffi/cuda/gemv/handler.cu),
// benchmarks/probes/gemv_probe.cu, and the grouped GEMV (ffi/cuda/grouped/gemv.cuh: its kernel's
// resident warps and column blocks).
#ifndef JAX_FP4_CUDA_GEMV_LAUNCH_CUH_
#define JAX_FP4_CUDA_GEMV_LAUNCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gemv/common.cuh"
#include "cuda/gemv/mma.cuh"
#include "cuda/gemv/scalar.cuh"
#include "jax_fp4/gemv_config.h"

namespace jax_fp4 {
namespace cuda {

// Blocks of the tensor-core kernels over N: one per CT column tiles of 16.
inline int64_t GemvMmaColumnBlocks(int64_t n, int ct) {
  return CeilDiv(CeilDiv(n, kGemvTileCols), ct);
}

// The production launch of GemvMmaKernel for a weight in the spec or (Tiled) the tiled layout: CT
// column tiles and RT row tiles per warp, k_split warps per block (the 256-byte L2 prefetch only
// when k_split > 1, see GemvMmaKernel); `programmatic`: a programmatic dependent launch (sm_90+).
// Shared by the handler (LaunchGemv) and the probe's config sweep.
template <typename T, int CT, int RT, bool Tiled>
cudaError_t LaunchMmaLayout(cudaStream_t stream, const T* a, const uint8_t* packed,
                            const uint8_t* scale, const float* gs, const T* bias, T* y, int64_t m,
                            int64_t n, int64_t k, int k_split, bool programmatic = false) {
  const dim3 grid(static_cast<unsigned>(GemvMmaColumnBlocks(n, CT)),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(m, 8 * RT), kMaxGridY)));
  const dim3 block(32 * k_split);
  const size_t smem = GemvMmaSmemBytes(CT, k_split);
  auto* kernel =
      k_split > 1 ? GemvMmaKernel<T, CT, RT, 256, Tiled> : GemvMmaKernel<T, CT, RT, 0, Tiled>;
  return LaunchKernel(kernel, grid, block, smem, stream, programmatic, a, packed, scale, gs, bias,
                      y, m, n, k);
}

// The fused instances (GemvMmaFusedKernel), with the plain launch's config; silu_mul (CT == 2)
// covers N / 2 outputs, 16 a block.
template <typename T, int CT, int RT, bool Tiled>
cudaError_t LaunchMmaFusedLayout(cudaStream_t stream, const T* a, const uint8_t* packed,
                                 const uint8_t* scale, const float* gs, const T* bias, T* y,
                                 int64_t m, int64_t n, int64_t k, int k_split, bool programmatic,
                                 const GemvFusion<T>& fusion) {
  if (CT != 2 && fusion.silu_mul) return cudaErrorInvalidValue;  // gate and up tiles pair up
  const int64_t blocks_x =
      CT == 2 && fusion.silu_mul ? CeilDiv(n / 2, kGemvTileCols) : GemvMmaColumnBlocks(n, CT);
  const dim3 grid(static_cast<unsigned>(blocks_x),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(m, 8 * RT), kMaxGridY)));
  const dim3 block(32 * k_split);
  const size_t smem = GemvMmaSmemBytes(CT, k_split);
  auto* kernel = k_split > 1 ? GemvMmaFusedKernel<T, CT, RT, 256, Tiled>
                             : GemvMmaFusedKernel<T, CT, RT, 0, Tiled>;
  return LaunchKernel(kernel, grid, block, smem, stream, programmatic, a, packed, scale, gs, bias,
                      y, m, n, k, fusion);
}

// Warps of a tensor-core kernel resident per SM on the current device, from the occupancy API with
// one-warp blocks (the kernel's registers decide: no static shared memory, and the dynamic k_split
// buffer is a few KB): of its two L2-prefetch instances (k_split 1 and > 1) the smaller.
template <typename Kernel>
cudaError_t MinResidentWarps(Kernel* with_prefetch_kernel, Kernel* without_kernel, int* warps) {
  int with_prefetch = 0, without = 0;
  cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&with_prefetch, with_prefetch_kernel, 32, 0);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&without, without_kernel, 32, 0);
  }
  *warps = std::min(with_prefetch, without);
  return err;
}

// The resident warps of the four tensor-core instances of one kernel family, dtype and layout
// (GemvResidentWarps, gemv_config.h): query(ct, rt, &warps) queries one, ct and rt (column and row
// tiles) as std::integral_constant<int, 1 or 2>. Queried once per device and cached, one cache per
// Query type (each caller's lambda); like GetDeviceInfo, legal during graph capture.
template <typename Query>
cudaError_t CachedResidentWarps(GemvResidentWarps* out, Query query) {
  constexpr int kMaxDevices = 64;
  static std::atomic<uint32_t> cache[kMaxDevices];  // 8 bits per instance; 0 = not queried yet
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cached = device >= 0 && device < kMaxDevices;
  const uint32_t packed = cached ? cache[device].load(std::memory_order_relaxed) : 0u;
  if (packed != 0) {
    *out =
        GemvResidentWarps{static_cast<int>(packed & 0xFFu), static_cast<int>((packed >> 8) & 0xFFu),
                          static_cast<int>((packed >> 16) & 0xFFu), static_cast<int>(packed >> 24)};
    return cudaSuccess;
  }
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  GemvResidentWarps warps{};
  if ((err = query(One{}, One{}, &warps.one_tile)) != cudaSuccess) return err;
  if ((err = query(Two{}, One{}, &warps.two_col_tiles)) != cudaSuccess) return err;
  if ((err = query(One{}, Two{}, &warps.two_row_tiles)) != cudaSuccess) return err;
  if ((err = query(Two{}, Two{}, &warps.two_by_two)) != cudaSuccess) return err;
  // At least one warp each (the launch bounds guarantee a block fits), at most 255 (8 bits).
  for (int* w : {&warps.one_tile, &warps.two_col_tiles, &warps.two_row_tiles, &warps.two_by_two}) {
    *w = std::min(std::max(*w, 1), 255);
  }
  *out = warps;
  if (cached) {
    cache[device].store(static_cast<uint32_t>(warps.one_tile) |
                            (static_cast<uint32_t>(warps.two_col_tiles) << 8) |
                            (static_cast<uint32_t>(warps.two_row_tiles) << 16) |
                            (static_cast<uint32_t>(warps.two_by_two) << 24),
                        std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// The resident warps of the four tensor-core GEMV instances of dtype T and one layout, cached per
// device.
template <typename T, bool Tiled>
cudaError_t GetGemvResidentWarps(GemvResidentWarps* out) {
  return CachedResidentWarps(out, [](auto ct, auto rt, int* warps) {
    constexpr int CT = decltype(ct)::value, RT = decltype(rt)::value;
    return MinResidentWarps(GemvMmaKernel<T, CT, RT, 256, Tiled>,
                            GemvMmaKernel<T, CT, RT, 0, Tiled>, warps);
  });
}

template <typename T, int CT, int RT = 1>
cudaError_t LaunchMma(cudaStream_t stream, bool tiled, const T* a, const uint8_t* packed,
                      const uint8_t* scale, const float* gs, const T* bias, T* y, int64_t m,
                      int64_t n, int64_t k, int k_split, bool programmatic,
                      const GemvFusion<T>& fusion = GemvFusion<T>{}) {
  auto on_layout = [&](auto tiled_tag) {
    constexpr bool kTiled = decltype(tiled_tag)::value;
    return fusion.active()
               ? LaunchMmaFusedLayout<T, CT, RT, kTiled>(stream, a, packed, scale, gs, bias, y, m,
                                                         n, k, k_split, programmatic, fusion)
               : LaunchMmaLayout<T, CT, RT, kTiled>(stream, a, packed, scale, gs, bias, y, m, n, k,
                                                    k_split, programmatic);
  };
  return tiled ? on_layout(std::true_type{}) : on_layout(std::false_type{});
}

template <typename T, int R>
cudaError_t LaunchScalar(cudaStream_t stream, const T* a, const uint8_t* packed,
                         const uint8_t* scale, const float* gs, const T* bias, T* y, int64_t m,
                         int64_t n, int64_t k) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(n, kGemvScalarColsPerBlock)),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(m, R), kMaxGridY)));
  GemvScalarKernel<T, R>
      <<<grid, 32 * kGemvScalarColsPerBlock, 0, stream>>>(a, packed, scale, gs, bias, y, m, n, k);
  return cudaGetLastError();
}

template <typename T, int R>
cudaError_t LaunchScalarFused(cudaStream_t stream, const T* a, const uint8_t* packed,
                              const uint8_t* scale, const float* gs, const T* bias, T* y, int64_t m,
                              int64_t n, int64_t k, const GemvFusion<T>& fusion) {
  const int64_t n_out = fusion.silu_mul ? n / 2 : n;
  const dim3 grid(static_cast<unsigned>(CeilDiv(n_out, kGemvScalarColsPerBlock)),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(m, R), kMaxGridY)));
  GemvScalarFusedKernel<T, R><<<grid, 32 * kGemvScalarColsPerBlock, 0, stream>>>(
      a, packed, scale, gs, bias, y, m, n, k, fusion);
  return cudaGetLastError();
}

// The tensor-core kernel (tensor_cores: validated by the handler) or the scalar one, with the
// launch config `cfg`; `fusion` active: their fused instances (silu_mul on tensor cores needs
// cfg.col_tiles == 2, and on the tiled layout N / 2 % 16 == 0: the handler's checks).
template <typename T>
cudaError_t LaunchGemv(cudaStream_t stream, const void* a, const uint8_t* packed,
                       const uint8_t* scale, const float* gs, const void* bias, void* y, int64_t m,
                       int64_t n, int64_t k, bool tensor_cores, bool tiled, bool row_tiling,
                       const GemvLaunchConfig& cfg, bool programmatic,
                       const GemvFusion<T>& fusion = GemvFusion<T>{}) {
  const T* at = static_cast<const T*>(a);
  const T* bt = static_cast<const T*>(bias);
  T* yt = static_cast<T*>(y);
  if (tensor_cores) {
    const int ks = cfg.k_split;
    const bool pdl = programmatic;
    if (row_tiling && cfg.row_tiles == 2) {
      return cfg.col_tiles == 2 ? LaunchMma<T, 2, 2>(stream, tiled, at, packed, scale, gs, bt, yt,
                                                     m, n, k, ks, pdl, fusion)
                                : LaunchMma<T, 1, 2>(stream, tiled, at, packed, scale, gs, bt, yt,
                                                     m, n, k, ks, pdl, fusion);
    }
    return cfg.col_tiles == 2 ? LaunchMma<T, 2>(stream, tiled, at, packed, scale, gs, bt, yt, m, n,
                                                k, ks, pdl, fusion)
                              : LaunchMma<T, 1>(stream, tiled, at, packed, scale, gs, bt, yt, m, n,
                                                k, ks, pdl, fusion);
  }
  const int rows = row_tiling ? cfg.rows_per_block : 1;
  if (fusion.active()) {
    switch (rows) {
      case 4:
        return LaunchScalarFused<T, 4>(stream, at, packed, scale, gs, bt, yt, m, n, k, fusion);
      case 2:
        return LaunchScalarFused<T, 2>(stream, at, packed, scale, gs, bt, yt, m, n, k, fusion);
      default:
        return LaunchScalarFused<T, 1>(stream, at, packed, scale, gs, bt, yt, m, n, k, fusion);
    }
  }
  switch (rows) {
    case 4:
      return LaunchScalar<T, 4>(stream, at, packed, scale, gs, bt, yt, m, n, k);
    case 2:
      return LaunchScalar<T, 2>(stream, at, packed, scale, gs, bt, yt, m, n, k);
    default:
      return LaunchScalar<T, 1>(stream, at, packed, scale, gs, bt, yt, m, n, k);
  }
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GEMV_LAUNCH_CUH_
