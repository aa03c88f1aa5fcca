// Grouped decode GEMV (target jax_fp4_grouped_gemv_cuda): the decode GEMV's tensor-core main loop
// (GemvMmaMainloop, ffi/cuda/gemv/mma.cuh) run on one chunk of one group's rows per block, with the
// group's weight, scales, global scale and bias as its operands.
//
// Grid: x = the GEMV's column blocks of one expert (16 col_tiles columns each), z = slots
// (ffi/cuda/grouped/schedule.cuh): slot s serves the s-th chunk of 8 row_tiles rows in group
// order, found by one warp scan of group_sizes; the slots past the last chunk zero the rows past
// the groups. So only the weights of groups with rows are read, a group of r rows costs
// ceil(r / chunk) passes over its weight (the first from memory, the rest mostly from L2), and a
// launch depends on M, N, K and G only.
#ifndef JAX_FP4_CUDA_GROUPED_GEMV_CUH_
#define JAX_FP4_CUDA_GROUPED_GEMV_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/gemv/mma.cuh"
#include "cuda/grouped/config.h"
#include "cuda/grouped/operands.h"
#include "cuda/grouped/schedule.cuh"
#include "jax_fp4/gemv_config.h"

namespace jax_fp4 {
namespace cuda {

// CT column tiles and RT row tiles per warp, k_split = blockDim.x / 32 warps splitting K, as
// GemvMmaKernel (same launch bounds, so the same registers and residency).
template <typename T, int CT, int RT, int L2PrefetchBytes, bool Tiled>
__global__ void __launch_bounds__(32 * GemvMmaShape{CT, RT, Tiled}.max_split(),
                                  GemvMmaShape{CT, RT, Tiled}.min_blocks_per_sm())
    GroupedGemvKernel(GroupedOperands<T> p, int64_t slots) {
  constexpr int kChunk = 8 * RT;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * (kGemvTileCols * CT);
  for (int64_t slot = blockIdx.z; slot < slots; slot += gridDim.z) {
    // Every warp finds the same chunk (L1 hits after the first): no barrier needed.
    const GroupChunk c = FindGroupChunk(p.sizes, p.groups, p.m, kChunk, slot);
    if (c.group < 0) {
      ZeroTailRows(p.y, c, slot, slots, p.m, p.n, col0, col0 + kGemvTileCols * CT);
      continue;
    }
    const int64_t g = c.group;
    const int64_t rows = Min64(c.begin + kChunk, c.end) - c.begin;
    // gridDim.y == 1: the main loop's chunk loop runs once, over these `rows` rows.
    GemvMmaMainloop<T, CT, RT, GemvLayoutDecode<Tiled>, 1, L2PrefetchBytes, Tiled>(
        p.a + c.begin * p.k, p.packed + g * p.n * (p.k / 2), p.scale + g * p.n * (p.k / 16),
        p.gs + g, p.bias != nullptr ? p.bias + g * p.n : nullptr, p.y + c.begin * p.n, rows, p.n,
        p.k);
  }
}

template <typename T, int CT, int RT, bool Tiled>
cudaError_t LaunchGroupedGemvInstance(cudaStream_t stream, const GroupedOperands<T>& p,
                                      int k_split) {
  const int64_t col_blocks = CeilDiv(CeilDiv(p.n, kGemvTileCols), CT);
  const int64_t slots = GroupedSlots(p.m, p.groups, 8 * RT);
  constexpr int64_t kMaxGridZ = 65535;  // more slots loop inside the kernel
  const dim3 grid(static_cast<unsigned>(col_blocks), 1,
                  static_cast<unsigned>(std::min<int64_t>(slots, kMaxGridZ)));
  const size_t smem = GemvMmaSmemBytes(CT, k_split);
  auto* kernel = k_split > 1 ? GroupedGemvKernel<T, CT, RT, 256, Tiled>
                             : GroupedGemvKernel<T, CT, RT, 0, Tiled>;
  kernel<<<grid, dim3(32 * k_split), smem, stream>>>(p, slots);
  return cudaGetLastError();
}

template <typename T, bool Tiled>
cudaError_t LaunchGroupedGemv(cudaStream_t stream, const GroupedOperands<T>& p, int col_tiles,
                              int row_tiles, int k_split) {
  if (col_tiles == 2) {
    return row_tiles == 2 ? LaunchGroupedGemvInstance<T, 2, 2, Tiled>(stream, p, k_split)
                          : LaunchGroupedGemvInstance<T, 2, 1, Tiled>(stream, p, k_split);
  }
  return row_tiles == 2 ? LaunchGroupedGemvInstance<T, 1, 2, Tiled>(stream, p, k_split)
                        : LaunchGroupedGemvInstance<T, 1, 1, Tiled>(stream, p, k_split);
}

// Warps of GroupedGemvKernel<T, CT, RT, *, Tiled> resident per SM (the smaller of its two L2
// prefetch instances), from the occupancy API with one-warp blocks.
template <typename T, int CT, int RT, bool Tiled>
cudaError_t GroupedGemvInstanceWarps(int* warps) {
  int with_prefetch = 0, without = 0;
  cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &with_prefetch, GroupedGemvKernel<T, CT, RT, 256, Tiled>, 32, 0);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &without, GroupedGemvKernel<T, CT, RT, 0, Tiled>, 32, 0);
  }
  *warps = std::min(std::max(std::min(with_prefetch, without), 1), 255);
  return err;
}

// The resident warps of the four instances of dtype T and one layout, queried once per device and
// cached (legal during graph capture: no stream is touched).
template <typename T, bool Tiled>
cudaError_t GetGroupedGemvWarps(GemvResidentWarps* out) {
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
  GemvResidentWarps w{};
  if ((err = GroupedGemvInstanceWarps<T, 1, 1, Tiled>(&w.one_tile)) != cudaSuccess) return err;
  if ((err = GroupedGemvInstanceWarps<T, 2, 1, Tiled>(&w.two_col_tiles)) != cudaSuccess) {
    return err;
  }
  if ((err = GroupedGemvInstanceWarps<T, 1, 2, Tiled>(&w.two_row_tiles)) != cudaSuccess) {
    return err;
  }
  if ((err = GroupedGemvInstanceWarps<T, 2, 2, Tiled>(&w.two_by_two)) != cudaSuccess) return err;
  *out = w;
  if (cached) {
    cache[device].store(static_cast<uint32_t>(w.one_tile) |
                            (static_cast<uint32_t>(w.two_col_tiles) << 8) |
                            (static_cast<uint32_t>(w.two_row_tiles) << 16) |
                            (static_cast<uint32_t>(w.two_by_two) << 24),
                        std::memory_order_relaxed);
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_GEMV_CUH_
