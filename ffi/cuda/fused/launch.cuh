// Fused GEMM host side: the split-K choice (occupancy of the actual kernel), the activation's
// tensor map, and the launches (cluster split-K or stream-K) of each CTA tile and kernel.
#ifndef JAX_FP4_CUDA_FUSED_LAUNCH_CUH_
#define JAX_FP4_CUDA_FUSED_LAUNCH_CUH_

#include <cuda.h>  // CUtensorMap (the map is encoded through the runtime's driver entry point)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fused/config.cuh"
#include "cuda/fused/kernels.cuh"
#include "cuda/fused/scheduler.cuh"

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

// How many clusters of `split` CTAs with `smem` bytes of dynamic shared memory fit on the device at
// once (cached per device, split and whether smem is the spread size). Asked of the spec-layout
// kernel; the tiled one has the same launch bounds and shared memory.
template <typename T, typename Cfg, bool WS>
int MaxActiveClusters(int device, int split, int smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices][kMaxSplit + 1][2];  // value + 1; 0 = not queried
  const int spread = smem != Cfg::kSmemBytes ? 1 : 0;
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device][split][spread].load(std::memory_order_relaxed);
    if (cached > 0) return cached - 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1, 1, split);
  config.blockDim = dim3(kFusedThreads<WS>, 1, 1);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = split;
  config.attrs = attr;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kFusedKernel<T, Cfg, false, WS>, &config) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // clear: a refused size just is not used
    clusters = 0;
  }
  if (device >= 0 && device < kMaxDevices) {
    cache[device][split][spread].store(clusters + 1, std::memory_order_relaxed);
  }
  return clusters;
}

// Split-K factor: minimise waves * (stages per CTA + fixed cost) over the cluster sizes that
// fit; ties go to the smaller split. Deterministic for a given device and shape. *cost: the
// chosen split's cost in stage units (compared with stream-K's, StreamKCost2).
template <typename T, typename Cfg, bool WS>
int ChooseSplit(int device, int64_t tiles, int64_t ks, int smem, int64_t* cost = nullptr) {
  int best = 1;
  int64_t best_cost = INT64_MAX;
  const int max_split = static_cast<int>(std::min<int64_t>(kMaxSplit, std::max<int64_t>(ks, 1)));
  for (int s = 1; s <= max_split; ++s) {
    const int clusters = MaxActiveClusters<T, Cfg, WS>(device, s, smem);
    if (clusters <= 0) continue;
    const int64_t capacity = static_cast<int64_t>(clusters) * s;
    const int64_t waves = CeilDiv(tiles * s, capacity);
    const int64_t c = waves * (CeilDiv(ks, s) + kFillStages);
    if (c < best_cost) {
      best_cost = c;
      best = s;
    }
  }
  if (cost != nullptr) *cost = best_cost;
  return best;
}

// One call's operands (device pointers), shape and workspace.
struct FusedProblem {
  const void* a;
  const uint8_t* packed;
  const uint8_t* scale;
  const float* gs;
  const void* bias;  // or nullptr
  void* y;
  int64_t m, n, k;
  bool vec_store;  // y rows 8-byte aligned, N_out % 4 == 0
  float* workspace;
  int64_t workspace_elems;
  const void* residual;  // [M, N_out], or nullptr (EpilogueFusion)
  bool silu_mul;         // y [M, N / 2] = silu(gate rows) * up rows (EpilogueFusion)
};

// A call's tuning attributes that reach the launch (the handler validates them and resolves the
// tile); 0 / -1 = the heuristic's choice.
struct FusedTuning {
  int split = 0;  // attribute split: the split-K factor (clamped to the K stages), 0 = ChooseSplit
  int stream_k = -1;  // attribute stream_k: 0 cluster split-K, 1 stream-K, -1 = the cost model
  // Attribute programmatic: programmatic dependent launches (LaunchKernel, common.cuh); every
  // kernel waits for the previous one before its first memory access.
  bool programmatic = false;
};

// The warp-specialized kernels' activation tensor map: a [M, K] row-major, boxes of 64 K x BM rows
// with the 128-byte swizzle of the wgmma B tiles; rows past M read as zeros. Encoded per call
// (host only, ~1 us) through the runtime's driver entry point, so nothing links libcuda.
template <typename T>
cudaError_t EncodeActivationMap(CUtensorMap* out, const void* a, int64_t m, int64_t k,
                                int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(m)};
  const cuuint64_t row_stride[1] = {static_cast<cuuint64_t>(k) * sizeof(T)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = encode(out,
                            std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                      : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            2, const_cast<void*>(a), dims, row_stride, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T, typename Cfg, bool Tiled>
cudaError_t LaunchStreamK(cudaStream_t stream, const FusedProblem& p, const StreamKShape& sk,
                          bool programmatic) {
  constexpr auto* kKernel = FusedGemmStreamKKernel<T, Cfg, Tiled>;
  cudaError_t err = AllowDynamicSmem<kKernel>(Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  StreamKPlan plan;
  plan.units = sk.units;
  plan.ctas = sk.ctas;
  plan.ks = static_cast<int>(sk.ks);
  plan.tiles_n = static_cast<int>(sk.tiles_n);
  plan.partials = p.workspace;
  plan.arrivals = reinterpret_cast<int*>(p.workspace + sk.partial_elems);
  CUtensorMap act_map;
  err = EncodeActivationMap<T>(&act_map, p.a, p.m, p.k, Cfg::kBM);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(plan.arrivals, 0, sk.tiles * sizeof(int), stream);
  if (err != cudaSuccess) return err;
  return LaunchKernel(kKernel, dim3(sk.ctas), dim3(kWsThreads), Cfg::kSmemBytes, stream,
                      programmatic, static_cast<const T*>(p.a), p.packed, p.scale, p.gs,
                      static_cast<const T*>(p.bias), static_cast<T*>(p.y), static_cast<int>(p.m),
                      static_cast<int>(p.n), static_cast<int>(p.k), p.vec_store ? 1 : 0, plan,
                      act_map);
}

template <typename T, typename Cfg, bool Tiled, bool WS>
cudaError_t LaunchFused(cudaStream_t stream, int device, int sms, const FusedProblem& p,
                        const FusedTuning& o) {
  constexpr int BM = Cfg::kBM;
  EpilogueFusion<T> fusion;
  fusion.residual = static_cast<const T*>(p.residual);
  fusion.silu_mul = p.silu_mul;
  // silu_mul: a CTA's TN rows are TN / 2 gate rows and their up rows (ColumnsOf).
  const int64_t tiles_n =
      p.silu_mul ? CeilDiv(p.n / 2, Cfg::kTileN / 2) : CeilDiv(p.n, Cfg::kTileN);
  const int64_t tiles_m = CeilDiv(p.m, BM);
  const int64_t ks = p.k / kStageK;
  // Too few CTAs, even at the largest split, to give every SM kMinBlocks: one per SM (the
  // scheduler would otherwise pack the clusters two to an SM and leave the rest idle).
  const int64_t max_ctas = tiles_n * tiles_m * std::min<int64_t>(kMaxSplit, ks);
  const int smem = Cfg::kMinBlocks > 1 && max_ctas < static_cast<int64_t>(Cfg::kMinBlocks) * sms
                       ? Cfg::kSpreadSmemBytes
                       : Cfg::kSmemBytes;
  constexpr auto* kKernel = kFusedKernel<T, Cfg, Tiled, WS>;
  cudaError_t err = AllowDynamicSmem<kKernel>(smem);
  // ChooseSplit's occupancy query asks the spec-layout kernel, which needs the same allowance.
  if (err == cudaSuccess && Tiled) err = AllowDynamicSmem<kFusedKernel<T, Cfg, false, WS>>(smem);
  if (err != cudaSuccess) return err;
  int64_t cluster_cost = 0;
  const int split =
      o.split > 0 ? static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(o.split, ks)))
                  : ChooseSplit<T, Cfg, WS>(device, tiles_n * tiles_m, ks, smem, &cluster_cost);
  if constexpr (WS) {
    // Stream-K where its plan fits the workspace and (unless forced) its cost model wins; never
    // with the epilogue fusions (EpilogueFusion).
    static_assert(2 * Cfg::kSmemBytes > kSmemPerSm, "stream-K plans one CTA per SM");
    const StreamKShape sk = PlanStreamK(BM, Cfg::kTileN, p.m, p.n, p.k, sms);
    const bool by_cost = StreamKByDefault(BM) && StreamKCost2(sk) < 2 * cluster_cost;
    if (!fusion.active() && o.split == 0 && o.stream_k != 0 && sk.Fits(p.workspace_elems) &&
        (o.stream_k == 1 || by_cost)) {
      return LaunchStreamK<T, Cfg, Tiled>(stream, p, sk, o.programmatic);
    }
  }

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m),
                        static_cast<unsigned>(split));
  config.blockDim = dim3(kFusedThreads<WS>, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = split;
  attr[1] = ProgrammaticLaunchAttribute();
  config.attrs = attr;
  config.numAttrs = o.programmatic ? 2 : 1;
  CUtensorMap act_map;  // the warp-specialized kernel's activation copies
  if constexpr (WS) {
    err = EncodeActivationMap<T>(&act_map, p.a, p.m, p.k, BM);
    if (err != cudaSuccess) return err;
  }
  auto launch = [&] {
    const auto a = static_cast<const T*>(p.a);
    const auto bias = static_cast<const T*>(p.bias);
    const auto m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
    if constexpr (WS) {
      return cudaLaunchKernelEx(&config, kKernel, a, p.packed, p.scale, p.gs, bias,
                                static_cast<T*>(p.y), m, n, k, p.vec_store ? 1 : 0, act_map,
                                fusion);
    } else {
      return cudaLaunchKernelEx(&config, kKernel, a, p.packed, p.scale, p.gs, bias,
                                static_cast<T*>(p.y), m, n, k, p.vec_store ? 1 : 0, fusion);
    }
  };
  err = launch();
  if (err != cudaSuccess && split > 1) {
    // A cluster launch the device refuses (configuration errors are not sticky): no split-K.
    (void)cudaGetLastError();
    config.gridDim.z = 1;
    attr[0].val.clusterDim.z = 1;
    err = launch();
  }
  return err;
}

template <typename T, bool Tiled, int BM, int TN = DefaultTileN(BM)>
constexpr auto LaunchFor(bool ws) {
  using Cfg = FusedConfig<BM, TN>;
  if constexpr (HasWarpSpecialized(BM)) {
    return ws ? LaunchFused<T, Cfg, Tiled, true> : LaunchFused<T, Cfg, Tiled, false>;
  } else {
    return LaunchFused<T, Cfg, Tiled, false>;  // the handler rejects ws here
  }
}

template <typename T, bool Tiled>
cudaError_t DispatchFusedLayout(cudaStream_t stream, int device, int sms, TileChoice tile,
                                const FusedProblem& p, const FusedTuning& o) {
  const auto launch = tile.m == 16    ? LaunchFor<T, Tiled, 16>(tile.ws)
                      : tile.m == 32  ? LaunchFor<T, Tiled, 32>(tile.ws)
                      : tile.m == 64  ? LaunchFor<T, Tiled, 64>(tile.ws)
                      : tile.m == 128 ? (tile.n == 128 ? LaunchFor<T, Tiled, 128, 128>(tile.ws)
                                                       : LaunchFor<T, Tiled, 128>(tile.ws))
                                      : LaunchFor<T, Tiled, 256>(tile.ws);
  return launch(stream, device, sms, p, o);
}

template <typename T>
cudaError_t DispatchFused(cudaStream_t stream, bool tiled, int device, int sms, TileChoice tile,
                          const FusedProblem& p, const FusedTuning& o) {
  const auto dispatch = tiled ? DispatchFusedLayout<T, true> : DispatchFusedLayout<T, false>;
  return dispatch(stream, device, sms, tile, p, o);
}

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_FUSED_LAUNCH_CUH_
