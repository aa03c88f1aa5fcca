// Fused GEMM work decomposition: a CTA's K range under cluster split-K (device), the stream-K
// plan the kernel walks (device) and its host-side shape and cost model.
#ifndef JAX_FP4_CUDA_FUSED_SCHEDULER_CUH_
#define JAX_FP4_CUDA_FUSED_SCHEDULER_CUH_

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/fused/config.cuh"
#include "cuda/fused/fused.h"

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

// The CTA's stage range [kc0, kc0 + nst) of its split-K rank (every CTA has at least one stage:
// split <= K / 128).
__device__ __forceinline__ int2 StageRange(int k) {
  const int ks = k / kStageK;
  const int kc0 = static_cast<int>(static_cast<int64_t>(blockIdx.z) * ks / gridDim.z);
  const int kc1 = static_cast<int>(static_cast<int64_t>(blockIdx.z + 1) * ks / gridDim.z);
  return make_int2(kc0, kc1 - kc0);
}

// Stream-K decomposition (host-computed): the tiles in a row (N fastest), ks K stages each, as
// units u = stage u % ks of tile u / ks; CTA c of `ctas` (one per SM) runs units
// [Begin(c), Begin(c + 1)), tile segment by tile segment, with one continuous pipeline. A segment
// that is a whole tile is stored from the accumulators. A tile split over several runs is owned
// by its first contributor (the run holding its K stage 0, which reaches it at the run's end):
// the later ones (each at its run's start, or a run inside the tile) write their partials to the
// workspace and arrive on the tile's counter; the owner waits for them, adds their partials to its
// accumulators in CTA order (deterministic) and stores the tile.
struct StreamKPlan {
  int64_t units;    // tiles * ks
  int ctas;         // <= units
  int ks;           // K stages per tile
  int tiles_n;      // tiles along N
  float* partials;  // [ctas][BM * TN] (PartialSlot)
  int* arrivals;    // [tiles], zero at launch

  __device__ int64_t Begin(int c) const { return static_cast<int64_t>(c) * units / ctas; }
  // The CTA whose run holds unit u: the largest c with Begin(c) <= u.
  __device__ int CtaOf(int64_t u) const {
    return static_cast<int>(((u + 1) * ctas + units - 1) / units) - 1;
  }
  // CTA c's partial tile. A run hands at most one partial to an owner (its first segment:
  // a run's last segment, if partial, holds its tile's stage 0, so the run owns that tile).
  __device__ float* PartialSlot(int c, int tile_elems) const {
    return partials + static_cast<int64_t>(c) * tile_elems;
  }
};

// The stream-K decomposition of a call (StreamKPlan without its pointers) on `sms` SMs with CTA
// tile bm x tn, and the workspace it needs: a partial tile per CTA, one counter per tile.
struct StreamKShape {
  int64_t tiles, tiles_n, ks, units;
  int ctas;
  int64_t partial_elems;    // the partial tiles' floats; the counters follow them
  int64_t workspace_elems;  // partial_elems + tiles

  // Whether the call's workspace holds the plan and its tile index fits the kernel's int.
  bool Fits(int64_t available_elems) const {
    return workspace_elems <= available_elems && tiles <= INT_MAX;
  }
};

inline StreamKShape PlanStreamK(int bm, int tn, int64_t m, int64_t n, int64_t k, int sms) {
  StreamKShape p;
  p.tiles_n = CeilDiv(n, tn);
  p.tiles = p.tiles_n * CeilDiv(m, bm);
  p.ks = k / kStageK;
  p.units = p.tiles * p.ks;
  p.ctas = static_cast<int>(std::min<int64_t>({sms, fused::kMaxStreamKCtas, p.units}));
  p.partial_elems = static_cast<int64_t>(p.ctas) * bm * tn;
  p.workspace_elems = p.partial_elems + p.tiles;
  return p;
}

// Stream-K's cost, in half stage-times (twice ChooseSplit's units): the longest run, the
// pipeline fill, and the fixup, ~2 stage-times of segment epilogues plus ~1.5 per contributor to
// a tile. With the owner reducing in registers and the run's last tile stored through shared
// memory, the rule picks the faster of stream-K and cluster split-K, or one within 1% of it, at
// all 24 points measured at the 128- and 256-row tiles (M = 80-1024, four shapes; spec layout,
// kernel-only), so it serves both tiles (benchmarks/RESULTS.md; docs/design.md).
constexpr bool StreamKByDefault(int bm) { return bm >= 128; }
inline int64_t StreamKCost2(const StreamKShape& p) {
  const int64_t run = CeilDiv(p.units, p.ctas);
  const int64_t contributors = CeilDiv(p.ks, std::max<int64_t>(p.units / p.ctas, 1)) + 1;
  return 2 * (run + kFillStages + 2) + 3 * contributors;
}

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_FUSED_SCHEDULER_CUH_
