// Grouped decode GEMV (target jax_fp4_grouped_gemv_cuda): the decode GEMV's tensor-core main loop
// (GemvMmaMainloop, ffi/cuda/gemv/mma.cuh) run on one chunk of one group's rows per block, with the
// group's weight, scales, global scale and bias as its operands.
//
// Grid: x = the GEMV's column blocks of one expert (16 col_tiles columns each; with silu_mul 16
// outputs), z = slots
// (ffi/cuda/grouped/schedule.cuh): slot s serves the s-th chunk of 8 row_tiles rows in group
// order, found by one warp scan of group_sizes; the slots past the last chunk zero the rows past
// the groups. So only the weights of groups with rows are read, a group of r rows costs
// ceil(r / chunk) passes over its weight (the first from memory, the rest mostly from L2), and a
// launch depends on M, N, K and G only. The same kernel runs the MoE block's two products
// (GroupedStage, ffi/cuda/grouped/moe.cuh).
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
#include "cuda/grouped/moe.cuh"
#include "cuda/grouped/operands.h"
#include "cuda/grouped/schedule.cuh"
#include "jax_fp4/gemv_config.h"

namespace jax_fp4 {
namespace cuda {

// What a grouped GEMV launch computes: ragged_matmul's product (kPlain, silu_mul optional), or one
// of the MoE block's two products (ffi/cuda/grouped/moe.cuh): kMoeGateUp gathers each row's token
// from x and applies silu_mul; kMoeDown weights each pair's product and combines each token's k
// pairs with the residual into y [T, N].
enum class GroupedStage { kPlain, kMoeGateUp, kMoeDown };

// CT column tiles and RT row tiles per warp, k_split = blockDim.x / 32 warps splitting K, as
// GemvMmaKernel (same launch bounds, so the same registers and residency). SiluMul: the decode
// GEMV's fused epilogue (GemvMmaMainloop with GemvFusion::silu_mul): each group's rows [0, N/2)
// are its gate and [N/2, N) its up projection, a block's 16 outputs (y [M, N/2]) come from 16 gate
// rows (tile 0) and the 16 matching up rows (tile 1), so CT == 2.
template <typename T, int CT, int RT, int L2PrefetchBytes, bool Tiled, bool SiluMul,
          GroupedStage Stage>
__device__ __forceinline__ void GroupedGemvBody(const GroupedOperands<T>& p, int64_t slots,
                                                const MoeOperands<T>& moe) {
  static_assert(!SiluMul || CT == 2, "silu_mul pairs a gate and an up tile in each warp");
  static_assert(Stage != GroupedStage::kMoeGateUp || SiluMul, "the MoE gate/up is silu_mul");
  static_assert(Stage != GroupedStage::kMoeDown || !SiluMul, "the MoE down has no activation");
  constexpr int kChunk = 8 * RT;
  constexpr int64_t kBlockCols = kGemvTileCols * (SiluMul ? 1 : CT);
  const int64_t n_out = SiluMul ? p.n / 2 : p.n;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kBlockCols;
  const int64_t cols = Min64(kBlockCols, n_out - col0);
  if constexpr (Stage == GroupedStage::kMoeGateUp) MoeZeroCounters(moe);
  for (int64_t slot = blockIdx.z; slot < slots; slot += gridDim.z) {
    // Every warp finds the same chunk (L1 hits after the first): no barrier needed.
    const GroupChunk c = FindGroupChunk(p.sizes, p.groups, p.m, kChunk, slot);
    if (c.group < 0) {
      if constexpr (Stage == GroupedStage::kMoeDown) {
        MoeTailPairs(moe, c, slot, slots, p.m, n_out, col0, cols);
      } else {
        ZeroTailRows(p.y, c, slot, slots, p.m, n_out, col0, col0 + kBlockCols);
      }
      continue;
    }
    const int64_t g = c.group;
    const int64_t rows = Min64(c.begin + kChunk, c.end) - c.begin;
    const T* a = p.a + c.begin * p.k;
    const uint8_t* packed = p.packed + g * p.n * (p.k / 2);
    const uint8_t* scale = p.scale + g * p.n * (p.k / 16);
    const T* bias = p.bias != nullptr ? p.bias + g * p.n : nullptr;
    T* y = Stage == GroupedStage::kMoeDown ? nullptr : p.y + c.begin * n_out;
    // gridDim.y == 1: the main loop's chunk loop runs once, over these `rows` rows.
    using Decode = GemvLayoutDecode<Tiled>;
    if constexpr (Stage == GroupedStage::kPlain) {
      GemvFusion<T> fusion;
      fusion.silu_mul = SiluMul;
      GemvMmaMainloop<T, CT, RT, Decode, 1, L2PrefetchBytes, Tiled, SiluMul>(
          a, packed, scale, p.gs + g, bias, y, rows, p.n, p.k, fusion);
    } else if constexpr (Stage == GroupedStage::kMoeGateUp) {
      MoeGatherFusion<T> fusion;
      fusion.silu_mul = true;
      fusion.pairs = moe.order + c.begin;
      fusion.top_k = moe.top_k;
      GemvMmaMainloop<T, CT, RT, Decode, 1, L2PrefetchBytes, Tiled, true, MoeGatherFusion<T>>(
          p.a, packed, scale, p.gs + g, bias, y, rows, p.n, p.k, fusion);
    } else {
      MoePairFusion<T> fusion;
      fusion.pairs = moe.order + c.begin;
      fusion.weights = moe.weights;
      fusion.pair_out = moe.pair_out;
      // y stays untouched: the pair rows go to the scratch, the combine writes moe.out.
      GemvMmaMainloop<T, CT, RT, Decode, 1, L2PrefetchBytes, Tiled, true, MoePairFusion<T>>(
          a, packed, scale, p.gs + g, bias, nullptr, rows, p.n, p.k, fusion);
      MoeFinishPairs(moe, fusion.pairs, rows, n_out, col0, cols);
    }
  }
}

template <typename T, int CT, int RT, int L2PrefetchBytes, bool Tiled, bool SiluMul>
__global__ void __launch_bounds__(32 * GemvMmaShape{CT, RT, Tiled}.max_split(),
                                  GemvMmaShape{CT, RT, Tiled}.min_blocks_per_sm())
    GroupedGemvKernel(GroupedOperands<T> p, int64_t slots) {
  GroupedGemvBody<T, CT, RT, L2PrefetchBytes, Tiled, SiluMul, GroupedStage::kPlain>(
      p, slots, MoeOperands<T>{});
}

// The MoE block's stages: the same body, launch bounds and residency, with the block's operands.
template <typename T, int CT, int RT, int L2PrefetchBytes, bool Tiled, bool SiluMul,
          GroupedStage Stage>
__global__ void __launch_bounds__(32 * GemvMmaShape{CT, RT, Tiled}.max_split(),
                                  GemvMmaShape{CT, RT, Tiled}.min_blocks_per_sm())
    GroupedMoeKernel(GroupedOperands<T> p, int64_t slots, MoeOperands<T> moe) {
  GroupedGemvBody<T, CT, RT, L2PrefetchBytes, Tiled, SiluMul, Stage>(p, slots, moe);
}

template <typename T, int CT, int RT, bool Tiled, bool SiluMul = false,
          GroupedStage Stage = GroupedStage::kPlain>
cudaError_t LaunchGroupedGemvInstance(cudaStream_t stream, const GroupedOperands<T>& p, int k_split,
                                      const MoeOperands<T>& moe = {}) {
  const int64_t col_blocks =
      SiluMul ? CeilDiv(p.n / 2, kGemvTileCols) : GemvMmaColumnBlocks(p.n, CT);
  const int64_t slots = GroupedSlots(p.m, p.groups, 8 * RT);
  constexpr int64_t kMaxGridZ = 65535;  // more slots loop inside the kernel
  const dim3 grid(static_cast<unsigned>(col_blocks), 1,
                  static_cast<unsigned>(std::min<int64_t>(slots, kMaxGridZ)));
  const size_t smem = GemvMmaSmemBytes(CT, k_split);
  if constexpr (Stage == GroupedStage::kPlain) {
    auto* kernel = k_split > 1 ? GroupedGemvKernel<T, CT, RT, 256, Tiled, SiluMul>
                               : GroupedGemvKernel<T, CT, RT, 0, Tiled, SiluMul>;
    kernel<<<grid, dim3(32 * k_split), smem, stream>>>(p, slots);
  } else {
    auto* kernel = k_split > 1 ? GroupedMoeKernel<T, CT, RT, 256, Tiled, SiluMul, Stage>
                               : GroupedMoeKernel<T, CT, RT, 0, Tiled, SiluMul, Stage>;
    kernel<<<grid, dim3(32 * k_split), smem, stream>>>(p, slots, moe);
  }
  return cudaGetLastError();
}

// silu_mul: y [M, N/2] (GroupedGemvKernel's SiluMul), two column tiles (the config's).
template <typename T, bool Tiled>
cudaError_t LaunchGroupedGemv(cudaStream_t stream, const GroupedOperands<T>& p, int col_tiles,
                              int row_tiles, int k_split, bool silu_mul) {
  if (silu_mul) {
    if (col_tiles != 2) return cudaErrorInvalidValue;  // gate and up tiles pair up
    return row_tiles == 2 ? LaunchGroupedGemvInstance<T, 2, 2, Tiled, true>(stream, p, k_split)
                          : LaunchGroupedGemvInstance<T, 2, 1, Tiled, true>(stream, p, k_split);
  }
  if (col_tiles == 2) {
    return row_tiles == 2 ? LaunchGroupedGemvInstance<T, 2, 2, Tiled>(stream, p, k_split)
                          : LaunchGroupedGemvInstance<T, 2, 1, Tiled>(stream, p, k_split);
  }
  return row_tiles == 2 ? LaunchGroupedGemvInstance<T, 1, 2, Tiled>(stream, p, k_split)
                        : LaunchGroupedGemvInstance<T, 1, 1, Tiled>(stream, p, k_split);
}

// The MoE block's gate/up product: y = hidden [T k, N/2] in row (expert) order, x's rows gathered
// through moe.order, silu_mul (two column tiles), the counters zeroed for the down launch.
template <typename T, bool Tiled>
cudaError_t LaunchMoeGateUp(cudaStream_t stream, const GroupedOperands<T>& p,
                            const MoeOperands<T>& moe, int row_tiles, int k_split) {
  constexpr GroupedStage kStage = GroupedStage::kMoeGateUp;
  return row_tiles == 2
             ? LaunchGroupedGemvInstance<T, 2, 2, Tiled, true, kStage>(stream, p, k_split, moe)
             : LaunchGroupedGemvInstance<T, 2, 1, Tiled, true, kStage>(stream, p, k_split, moe);
}

// The MoE block's down product and combine: moe.out = y [T, N].
template <typename T, bool Tiled>
cudaError_t LaunchMoeDown(cudaStream_t stream, const GroupedOperands<T>& p,
                          const MoeOperands<T>& moe, int col_tiles, int row_tiles, int k_split) {
  constexpr GroupedStage kStage = GroupedStage::kMoeDown;
  if (col_tiles == 2) {
    return row_tiles == 2
               ? LaunchGroupedGemvInstance<T, 2, 2, Tiled, false, kStage>(stream, p, k_split, moe)
               : LaunchGroupedGemvInstance<T, 2, 1, Tiled, false, kStage>(stream, p, k_split, moe);
  }
  return row_tiles == 2
             ? LaunchGroupedGemvInstance<T, 1, 2, Tiled, false, kStage>(stream, p, k_split, moe)
             : LaunchGroupedGemvInstance<T, 1, 1, Tiled, false, kStage>(stream, p, k_split, moe);
}

// The resident warps of the four grouped GEMV instances of dtype T and one layout, cached per
// device (legal during graph capture: no stream is touched); the silu_mul instances have the
// same launch bounds.
template <typename T, bool Tiled>
cudaError_t GetGroupedGemvWarps(GemvResidentWarps* out) {
  return CachedResidentWarps(out, [](auto ct, auto rt, int* warps) {
    constexpr int CT = decltype(ct)::value, RT = decltype(rt)::value;
    return MinResidentWarps(GroupedGemvKernel<T, CT, RT, 256, Tiled, false>,
                            GroupedGemvKernel<T, CT, RT, 0, Tiled, false>, warps);
  });
}

// The grouped GEMV's launch for `p` on `num_sms` SMs (grouped_launch_config with this layout's
// resident warps; silu_mul pairs each gate tile with its up tile).
template <typename T>
cudaError_t GroupedGemvLaunchConfig(const GroupedOperands<T>& p, bool tiled, bool silu_mul,
                                    int num_sms, GroupedLaunchConfig* cfg) {
  GemvResidentWarps warps{};
  const cudaError_t err =
      tiled ? GetGroupedGemvWarps<T, true>(&warps) : GetGroupedGemvWarps<T, false>(&warps);
  if (err != cudaSuccess) return err;
  *cfg = grouped_launch_config(p.m, p.n, p.k, p.groups, num_sms, tiled, warps, silu_mul);
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_GEMV_CUH_
