// Fused GEMM epilogues: the staged store, the split-K reduction across a cluster through
// distributed shared memory, the accumulator store, and stream-K's partial tiles. Device only.
#ifndef JAX_FP4_CUDA_FUSED_EPILOGUE_CUH_
#define JAX_FP4_CUDA_FUSED_EPILOGUE_CUH_

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/activations.cuh"
#include "cuda/fused/config.cuh"
#include "cuda/fused/mainloop.cuh"
#include "cuda/fused/scheduler.cuh"
#include "cuda/ptx.cuh"
#include "jax_fp4/nvfp4_cuda.cuh"

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

// The epilogue's multiplier: the global scale, times 2^7 to undo the 2^-7 of the scale folded
// into the decoded weight.
__device__ __forceinline__ float EpilogueScale(const float* global_scale) {
  return __ldg(global_scale) * 128.0f;
}

// The epilogue fusions of a call (attribute activation, operand residual: jax_fp4.matmul's
// activation="silu_mul" and residual), in f32 before the one rounding, as the GEMV's (GemvFusion):
//   silu_mul  the weight's rows [0, N/2) are a gate and [N/2, N) an up projection. A CTA's first
//             TN / 2 rows are gate rows j0 .., its last TN / 2 the matching up rows N/2 + j0 ..
//             (StageLoader's up_shift), so its staged tile holds both products of each of its
//             TN / 2 outputs: y [M, N/2] = silu(gate + bias[j]) * (up + bias[N/2 + j]);
//   residual  residual[m, j] (T, [M, N_out]) added last.
// The cluster split-K kernels run them; LaunchFused never takes stream-K for a fused call (its
// mid-run tiles are stored from the accumulators, where a warpgroup holds gate or up rows, never
// both).
template <typename T>
struct EpilogueFusion {
  const T* residual = nullptr;  // [M, N_out], or nullptr
  bool silu_mul = false;

  __host__ __device__ bool active() const { return residual != nullptr || silu_mul; }
};

// Where the CTA of tile column x sits in N: its first output column, StageLoader's up_shift, and
// the output width (silu_mul: TN / 2 outputs a CTA, y [M, N / 2]).
struct CtaColumns {
  int n0, up_shift, n_out;
};
template <typename Cfg, typename T>
__device__ __forceinline__ CtaColumns ColumnsOf(int x, int n, const EpilogueFusion<T>& fusion) {
  if (!fusion.silu_mul) return {x * Cfg::kTileN, 0, n};
  return {x * (Cfg::kTileN / 2), n / 2 - Cfg::kTileN / 2, n / 2};
}

// Rows rank, rank + splits, ... of a staged fp32 tile (Decoder::Stage's layout) to y [m, n], 4
// outputs per consumer thread (ctid): sum(ml, col) gives the float4 at staged row ml, column
// col; then global scale, bias, the fusions and an 8-byte store where y allows it (vec_store).
// n0 is the CTA's first output column; with silu_mul output col pairs staged columns col - n0
// (gate) and col - n0 + TN / 2 (up), and bias holds the gate's n then the up's n.
template <typename Decoder, typename T, typename SumStaged>
__device__ __forceinline__ void StoreStagedRows(const SumStaged& sum_staged, int rank, int splits,
                                                int ctid, int m0, int n0, int m, int n,
                                                const float* global_scale, const T* bias, T* y,
                                                int vec_store, const EpilogueFusion<T>& fusion) {
  using Cfg = typename Decoder::Cfg;
  using Tr = HalfTraits<T>;
  const float alpha = EpilogueScale(global_scale);
  const bool silu = fusion.silu_mul;
  // Threads per staged row, 4 outputs each: a row gives TN outputs, or TN / 2 with silu_mul.
  const int col_threads = silu ? Cfg::kTileN / 8 : Cfg::kTileN / 4;
  const int rows_per_pass = kConsumerThreads / col_threads;
  const int c4 = ctid % col_threads;
  const int nn = n0 + 4 * c4;
  for (int ml = rank + splits * (ctid / col_threads); ml < Cfg::kBM; ml += splits * rows_per_pass) {
    const int mm = m0 + ml;
    if (mm >= m || nn >= n) break;
    const float4 sum = sum_staged(ml, 4 * c4);
    const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
    float ups[4] = {0.f, 0.f, 0.f, 0.f};
    if (silu) {
      const float4 up = sum_staged(ml, 4 * c4 + Cfg::kTileN / 2);
      ups[0] = up.x, ups[1] = up.y, ups[2] = up.z, ups[3] = up.w;
    }
    T out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = min(nn + e, n - 1);
      float v = fmaf(vals[e], alpha, bias != nullptr ? Tr::to_float(bias[col]) : 0.0f);
      if (silu) {
        v = Silu(v) * fmaf(ups[e], alpha, bias != nullptr ? Tr::to_float(bias[n + col]) : 0.0f);
      }
      if (fusion.residual != nullptr) {
        v += Tr::to_float(fusion.residual[static_cast<int64_t>(mm) * n + col]);
      }
      out[e] = Tr::from_float(v);
    }
    T* dst = y + static_cast<int64_t>(mm) * n + nn;
    if (vec_store && nn + 3 < n) {
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(out);
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(static_cast<uint32_t>(bits[0]) | (static_cast<uint32_t>(bits[1]) << 16),
                     static_cast<uint32_t>(bits[2]) | (static_cast<uint32_t>(bits[3]) << 16));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (nn + e < n) dst[e] = out[e];
      }
    }
  }
}

// The CTA's fp32 tile staged in `epi` (the drained pipeline's shared memory), then the split-K
// reduction across the cluster (ranks = blockIdx.z), summed in rank order, global scale, bias,
// the fusions and the store to y [m, n] from output column n0; by the 256 consumer threads
// (ctid). Every live thread of the cluster calls it (the cluster barriers; the warp-specialized
// kernel's copier has exited).
template <typename Decoder, typename T>
__device__ __forceinline__ void StoreTile(const Decoder& decode,
                                          const float (&acc)[Decoder::TJ][Decoder::kAcc],
                                          float* epi, int ctid, int m0, int n0, int m, int n,
                                          const float* global_scale, const T* bias, T* y,
                                          int vec_store, const EpilogueFusion<T>& fusion) {
  namespace cg = cooperative_groups;
  constexpr int ST = Decoder::Cfg::kEpiStride;
  cg::cluster_group cluster = cg::this_cluster();
  decode.Stage(epi, acc);
  cluster.sync();
  const int splits = static_cast<int>(cluster.num_blocks());
  // Every rank's float4 is loaded before the first add (independent distributed shared memory
  // loads in flight together, not one round trip per rank), then summed in rank order.
  auto sum_ranks = [&](int ml, int col) {
    float4 v[kMaxSplit];
#pragma unroll
    for (int q = 0; q < kMaxSplit; ++q) {
      if (q < splits) {
        const float* remote = cluster.map_shared_rank(epi, q);
        v[q] = *reinterpret_cast<const float4*>(remote + ml * ST + col);
      }
    }
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int q = 0; q < kMaxSplit; ++q) {
      if (q < splits) {
        sum.x += v[q].x;
        sum.y += v[q].y;
        sum.z += v[q].z;
        sum.w += v[q].w;
      }
    }
    return sum;
  };
  StoreStagedRows<Decoder>(sum_ranks, static_cast<int>(cluster.block_rank()), splits, ctid, m0, n0,
                           m, n, global_scale, bias, y, vec_store, fusion);
  // Keep this CTA's shared memory alive until every rank has read it. A relaxed arrival: the
  // reads are done (their sums are stored), and a releasing one would first wait for this
  // thread's global stores to drain (at the 16-row tile on 4096x4096 the two cluster barriers'
  // fences and waits held ~27% of the warps' stall samples).
  ClusterArriveRelaxed();
  ClusterWait();
}

// The CTA's fp32 tile straight from the accumulators (no shared memory: the copier is already
// filling the pipeline with the next segment): global scale, bias, stores. A lane holds weight row
// (output column) nn for activation rows r and r + 1; where y allows (vec_store: N % 4 == 0, y
// aligned) it trades one of them with the lane of column nn ^ 1 (lane ^ 4), so that each lane
// stores two adjacent columns of one row: half the store instructions, each 4 bytes. Only with
// one 64-row weight tile per warpgroup (TJ = 1, as in the 256-row activation tile's config, whose
// runs hold whole tiles from M ~ 512): at TJ = 2 the trade's registers cost the main loop three
// more spill reloads per stage (SASS), and its runs seldom hold a whole tile.
template <typename Decoder, typename T>
__device__ __forceinline__ void StoreAccumulators(const Decoder& decode,
                                                  const float (&acc)[Decoder::TJ][Decoder::kAcc],
                                                  int m0, int n0, int m, int n,
                                                  const float* global_scale, const T* bias, T* y,
                                                  int vec_store) {
  using Tr = HalfTraits<T>;
  const float alpha = EpilogueScale(global_scale);
  if (Decoder::TJ == 1 && vec_store) {
    // The lane's column parity (that of g = lane / 4, as row_lo0's; from threadIdx, which spills
    // less): even lanes keep row r for columns nn, nn + 1 (own low half, then the partner's), odd
    // lanes row r + 1 for nn - 1, nn (the partner's high half, then their own).
    const int odd = (threadIdx.x >> 2) & 1;
    const uint32_t select = odd ? 0x3276u : 0x5410u;  // __byte_perm(own, partner, select)
#pragma unroll
    for (int j = 0; j < Decoder::TJ; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int nn = n0 + decode.row_lo0 + 64 * j + 8 * h;
        const int col0 = nn - odd;  // even, so col0 < n (N % 4 == 0) covers col0 + 1 too
        const float b = bias != nullptr ? Tr::to_float(bias[min(nn, n - 1)]) : 0.0f;
#pragma unroll
        for (int i = 0; i < Decoder::kAcc / 4; ++i) {
          const uint32_t own = Tr::pair_from_floats(fmaf(acc[j][4 * i + 2 * h], alpha, b),
                                                    fmaf(acc[j][4 * i + 2 * h + 1], alpha, b));
          // The whole warp trades, before the bounds checks.
          const uint32_t partner = __shfl_xor_sync(0xffffffffu, own, 4);
          const int mm = m0 + 8 * i + 2 * decode.t + odd;
          if (mm < m && col0 < n) {
            *reinterpret_cast<uint32_t*>(y + static_cast<int64_t>(mm) * n + col0) =
                __byte_perm(own, partner, select);
          }
        }
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < Decoder::TJ; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the lane's low and high weight row (+ 8)
      const int nn = n0 + decode.row_lo0 + 64 * j + 8 * h;
      if (nn >= n) continue;
      const float b = bias != nullptr ? Tr::to_float(bias[nn]) : 0.0f;
#pragma unroll
      for (int i = 0; i < Decoder::kAcc / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int mm = m0 + 8 * i + 2 * decode.t + e;
          if (mm < m) {
            y[static_cast<int64_t>(mm) * n + nn] =
                Tr::from_float(fmaf(acc[j][4 * i + 2 * h + e], alpha, b));
          }
        }
      }
    }
  }
}

// A partial tile in the workspace, in accumulator order: float4 chunk v of consumer thread ctid
// at float4 index 256 v + ctid (each warp's accesses contiguous). L2 only (.cg): other SMs read it.
template <typename Decoder>
__device__ __forceinline__ void WritePartial(float* slot,
                                             const float (&acc)[Decoder::TJ][Decoder::kAcc],
                                             int ctid) {
  float4* dst = reinterpret_cast<float4*>(slot) + ctid;
#pragma unroll
  for (int j = 0; j < Decoder::TJ; ++j) {
#pragma unroll
    for (int i = 0; i < Decoder::kAcc / 4; ++i) {
      __stcg(dst + (j * Decoder::kAcc / 4 + i) * kConsumerThreads,
             make_float4(acc[j][4 * i], acc[j][4 * i + 1], acc[j][4 * i + 2], acc[j][4 * i + 3]));
    }
  }
}

// acc += the partials of `tile`'s later contributors first + 1 .. last, in that order (their
// slots are consecutive). Loads in groups of 8 float4 per thread, two contributors' groups at a
// time (unroll 2: up to 16 loads in flight); the few bytes this spills are outside the main loop.
template <typename Decoder>
__device__ __forceinline__ void AddPartials(float (&acc)[Decoder::TJ][Decoder::kAcc],
                                            const StreamKPlan& plan, int first, int last,
                                            int ctid) {
  constexpr int kAcc = Decoder::kAcc, kChunks = Decoder::TJ * kAcc / 4, kGroup = 8;
  constexpr int kTileElems = Decoder::Cfg::kBM * Decoder::Cfg::kTileN;
  static_assert(kChunks % kGroup == 0, "whole groups");
  const float4* slots = reinterpret_cast<const float4*>(plan.PartialSlot(first + 1, kTileElems));
  constexpr int64_t kSlotStride = kTileElems / 4;  // float4s from one CTA's slot to the next
#pragma unroll
  for (int g = 0; g < kChunks; g += kGroup) {
#pragma unroll 2
    for (int c = 0; c < last - first; ++c) {
      const float4* src = slots + c * kSlotStride + ctid;
#pragma unroll
      for (int v = g; v < g + kGroup; ++v) {
        const float4 x = __ldcg(src + v * kConsumerThreads);
        float* a = &acc[4 * v / kAcc][4 * v % kAcc];
        a[0] += x.x;
        a[1] += x.y;
        a[2] += x.z;
        a[3] += x.w;
      }
    }
  }
}

// Stream-K epilogue of one tile segment (the 256 consumer threads). A whole tile is stored. Of a
// split tile, a later contributor writes its partial and arrives; the owner (`first`) waits for
// all of them (they never wait before arriving: no cycle, and each has its SM), adds their
// partials and stores the tile. The owner's own partial never leaves its registers. The store
// goes through shared memory (`epi`, 8-byte row stores) in the run's last segment, where the
// pipeline has nothing left to copy, and straight from the accumulators (epi = nullptr) before.
template <typename Decoder, typename T>
__device__ __forceinline__ void StreamKStore(const Decoder& decode,
                                             float (&acc)[Decoder::TJ][Decoder::kAcc],
                                             const StreamKPlan& plan, int tile, int ctid,
                                             float* epi, int m0, int n0, int m, int n,
                                             const float* global_scale, const T* bias, T* y,
                                             int vec_store) {
  constexpr int kTileElems = Decoder::Cfg::kBM * Decoder::Cfg::kTileN;
  constexpr int ST = Decoder::Cfg::kEpiStride;
  const int64_t tile_u0 = static_cast<int64_t>(tile) * plan.ks;
  const int first = plan.CtaOf(tile_u0), last = plan.CtaOf(tile_u0 + plan.ks - 1);
  if (first != last) {
    if (static_cast<int>(blockIdx.x) != first) {
      WritePartial<Decoder>(plan.PartialSlot(blockIdx.x, kTileElems), acc, ctid);
      NamedBarrierSync(1, kConsumerThreads);                  // every thread's partial written ...
      if (ctid == 0) RedReleaseGpu(plan.arrivals + tile, 1);  // ... and published by one fence
      return;
    }
    if (ctid == 0) {
      while (LoadAcquireGpu(plan.arrivals + tile) < last - first) __nanosleep(64);
    }
    NamedBarrierSync(1, kConsumerThreads);  // every later partial now visible to the CTA
    AddPartials<Decoder>(acc, plan, first, last, ctid);
  }
  if (epi == nullptr) {
    StoreAccumulators(decode, acc, m0, n0, m, n, global_scale, bias, y, vec_store);
    return;
  }
  NamedBarrierSync(1, kConsumerThreads);  // both consumer warpgroups done with the pipeline
  decode.Stage(epi, acc);
  NamedBarrierSync(1, kConsumerThreads);
  auto staged = [&](int ml, int col) {
    return *reinterpret_cast<const float4*>(epi + ml * ST + col);
  };
  StoreStagedRows<Decoder>(staged, 0, 1, ctid, m0, n0, m, n, global_scale, bias, y, vec_store,
                           EpilogueFusion<T>{});
}

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_FUSED_EPILOGUE_CUH_
