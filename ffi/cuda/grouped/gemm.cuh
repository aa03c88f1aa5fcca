// Grouped fused GEMM for sm_90a (target jax_fp4_grouped_gemm_cuda): the fused GEMM's
// warp-specialized pipeline (ffi/cuda/fused/: StageLoader, StageDecoder, PipelineRing, the staged
// store) with a per-group tile schedule.
//
// Grid: x = the N tiles of one expert (TN weight rows each), y = slots (ffi/cuda/grouped/
// schedule.cuh): slot s is the s-th BM-row tile of the groups' rows in group order, which warp 0
// finds by one scan of group_sizes before the pipeline starts. The CTA multiplies rows
// [m0, m0 + BM) of a (m0 = the tile's first row inside its group) with its group's weight: the
// activation tile comes by TMA from the whole [M, K] activation (rows of the next group are read
// and their results dropped; rows past M arrive as zeros), the weight, scales, global scale and
// bias are the group's, and the store keeps to the group's rows. No split-K: the tiles of many
// experts fill the machine. The slots past the last tile zero the rows past the groups.
//
// The activation comes in the fused GEMM's fragment K order (jax_fp4/fused.py: to_fragment_order).
#ifndef JAX_FP4_CUDA_GROUPED_GEMM_CUH_
#define JAX_FP4_CUDA_GROUPED_GEMM_CUH_

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/fused/config.cuh"
#include "cuda/fused/epilogue.cuh"
#include "cuda/fused/launch.cuh"  // EncodeActivationMap
#include "cuda/fused/mainloop.cuh"
#include "cuda/grouped/operands.h"
#include "cuda/grouped/schedule.cuh"
#include "cuda/ptx.cuh"

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {

template <typename T, typename Cfg, bool Tiled>
__global__ void __launch_bounds__(kWsThreads, 1)
    GroupedGemmKernel(GroupedOperands<T> p, int vec_store,
                      const __grid_constant__ CUtensorMap act_map) {
#if JAX_FP4_SM90A
  using Loader = StageLoader<T, Cfg, Tiled, kProducerThreads, /*kActTma=*/true>;
  using Decoder = StageDecoder<T, Cfg, Tiled, /*kPlainRows=*/Loader::kWeightBulk>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * Cfg::kStages];
  __shared__ GroupChunk tile_s;
  uint8_t* smem;
  const SmemMap<Cfg> map(AlignedSmemBase(smem, smem_raw));
  PipelineRing<Cfg::kStages> ring(bars);
  const int tid = threadIdx.x;
  if (tid < 32) {
    const GroupChunk c = FindGroupChunk(p.sizes, p.groups, p.m, Cfg::kBM, blockIdx.y);
    if (tid == 0) tile_s = c;
  }
  if (tid == 0) ring.Init(Loader::kFullArrivals);
  __syncthreads();
  const GroupChunk tile = tile_s;
  const int n0 = blockIdx.x * Cfg::kTileN;
  if (tile.group < 0) {
    ZeroTailRows(p.y, tile, blockIdx.y, gridDim.y, p.m, p.n, n0, n0 + Cfg::kTileN);
    return;
  }
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  const int64_t g = tile.group;
  const uint8_t* packed = p.packed + g * p.n * (p.k / 2);
  const uint8_t* scale = p.scale + g * p.n * (p.k / 16);
  const int m0 = static_cast<int>(tile.begin), m_end = static_cast<int>(tile.end);
  const int nst = k / kStageK;

  if (tid < kProducerThreads) {
    SetMaxRegisters<kProducerRegisters, false>();
    if (tid < Loader::kCopyThreads) {
      Loader load(tid, p.a, packed, scale, m, n, k, m0, n0, /*up_shift=*/0, map);
      load.UseActivationTma(&act_map, m0);
      for (int c = 0; c < nst; ++c) ring.Copy(load, c, tid);
    }
    CpAsyncCommit();
    CpAsyncWait<0>();  // nothing in flight when this warpgroup exits
    return;
  }

  SetMaxRegisters<kConsumerRegisters, true>();
  const int ctid = tid - kProducerThreads;
  const Decoder decode(ctid);
  float acc[Decoder::TJ][Decoder::kAcc];
  uint32_t afrag[2][4][4] = {};
  ring.Consume(decode, acc, afrag, map, nst, ctid & 31);
  NamedBarrierSync(1, kConsumerThreads);  // both consumer warpgroups done with the pipeline smem
  float* epi = reinterpret_cast<float*>(smem);
  decode.Stage(epi, acc);
  NamedBarrierSync(1, kConsumerThreads);
  constexpr int ST = Cfg::kEpiStride;
  auto staged = [&](int ml, int col) {
    return *reinterpret_cast<const float4*>(epi + ml * ST + col);
  };
  StoreStagedRows<Decoder>(staged, 0, 1, ctid, m0, n0, m_end, n, p.gs + g,
                           p.bias != nullptr ? p.bias + g * p.n : nullptr, p.y, vec_store,
                           EpilogueFusion<T>{});
#endif  // JAX_FP4_SM90A
}

template <typename T, int BM, bool Tiled>
cudaError_t LaunchGroupedGemmTile(cudaStream_t stream, const GroupedOperands<T>& p,
                                  bool vec_store) {
  using Cfg = FusedConfig<BM>;
  constexpr auto* kKernel = GroupedGemmKernel<T, Cfg, Tiled>;
  cudaError_t err = AllowDynamicSmem<kKernel>(Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  CUtensorMap act_map;
  err = EncodeActivationMap<T>(&act_map, p.a, p.m, p.k, BM);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.n, Cfg::kTileN)),
                  static_cast<unsigned>(GroupedSlots(p.m, p.groups, BM)));
  kKernel<<<grid, dim3(kWsThreads), Cfg::kSmemBytes, stream>>>(p, vec_store ? 1 : 0, act_map);
  return cudaGetLastError();
}

template <typename T, bool Tiled>
cudaError_t LaunchGroupedGemm(cudaStream_t stream, const GroupedOperands<T>& p, int tile_m,
                              bool vec_store) {
  switch (tile_m) {
    case 64:
      return LaunchGroupedGemmTile<T, 64, Tiled>(stream, p, vec_store);
    case 128:
      return LaunchGroupedGemmTile<T, 128, Tiled>(stream, p, vec_store);
    default:
      return LaunchGroupedGemmTile<T, 256, Tiled>(stream, p, vec_store);
  }
}

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_GEMM_CUH_
