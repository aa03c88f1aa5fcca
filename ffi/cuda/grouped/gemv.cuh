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
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/gemv/launch.cuh"  // CachedResidentWarps, GemvMmaColumnBlocks
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
  const int64_t col_blocks = GemvMmaColumnBlocks(p.n, CT);
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

// The resident warps of the four grouped GEMV instances of dtype T and one layout, cached per
// device (legal during graph capture: no stream is touched).
template <typename T, bool Tiled>
cudaError_t GetGroupedGemvWarps(GemvResidentWarps* out) {
  return CachedResidentWarps(out, [](auto ct, auto rt, int* warps) {
    constexpr int CT = decltype(ct)::value, RT = decltype(rt)::value;
    return MinResidentWarps(GroupedGemvKernel<T, CT, RT, 256, Tiled>,
                            GroupedGemvKernel<T, CT, RT, 0, Tiled>, warps);
  });
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_GEMV_CUH_
