// Fused GEMM (ffi/cuda/fused/kernels.cuh): the CTA tile configurations, the kernel-wide constants,
// and the default tile choice of a call (host and device).
#ifndef JAX_FP4_CUDA_FUSED_CONFIG_CUH_
#define JAX_FP4_CUDA_FUSED_CONFIG_CUH_

#include <cstdint>

#include "cuda/ptx.cuh"  // JAX_FP4_SM90A

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

constexpr int kConsumerThreads = 256;  // 2 warpgroups decode and multiply
constexpr int kProducerThreads = 128;  // warp-specialized kernel: 1 warpgroup copies
constexpr int kWsThreads = kProducerThreads + kConsumerThreads;
// Warp-specialized register split (setmaxnreg): 128 x 56 + 256 x 224 <= 64 K registers (40 for
// the producer spills its source pointers at 256-row CTA tiles, two scale rows per thread).
// (Used only in sm_90a device code: other compilation passes would warn that they are unused.)
[[maybe_unused]] constexpr int kProducerRegisters = 56;
[[maybe_unused]] constexpr int kConsumerRegisters = 224;
constexpr int kStageK = 128;            // K per pipeline stage
constexpr int kMaxSplit = 8;            // portable cluster size
constexpr int kFillStages = 2;          // split heuristic: per-CTA fixed cost in stage units
constexpr int kSmemPerSm = 233472;      // sm_90 shared memory per SM (each CTA reserves 1 KB of it)
constexpr int kMaxSmemPerCta = 232448;  // sm_90 opt-in maximum per CTA

// The activation tiles the kernel is built for (FusedConfig, attribute tile_m).
constexpr bool IsTileM(long bm) {
  return bm == 16 || bm == 32 || bm == 64 || bm == 128 || bm == 256;
}

// The tiles the warp-specialized kernel is built for; the 16- and 32-row tiles have the
// multistage kernel only.
constexpr bool HasWarpSpecialized(int bm) { return bm >= 64; }

// Weight rows per CTA by default: up to BM = 128 a warpgroup owns two m64 weight tiles (256 rows
// per CTA); at BM = 256 one (128 rows: the accumulators of two m64n256 tiles would not fit the
// registers), so each decoded weight fragment feeds 256 activation rows.
constexpr int DefaultTileN(int bm) { return bm == 256 ? 128 : 256; }

// The CTA tile: BM = activation rows (the wgmma N), TN = weight rows. BM: the smallest of 16 / 32
// / 64 / 128 / 256 that covers M wastes the least tensor work; BM <= 32 fits two CTAs per SM
// (<= 128 registers, <= 113 KB of shared memory, fewer stages), so that one CTA's decode hides
// the other's waits. TN = 128 at BM = 128 (attribute tile_n, measurement only): twice the
// CTAs, for grids that leave SMs idle (docs/design.md).
template <int BM, int TN = DefaultTileN(BM)>
struct FusedConfig {
  static_assert(IsTileM(BM), "BM is 16, 32, 64, 128 or 256");
  static_assert(TN == DefaultTileN(BM) || (BM == 128 && TN == 128),
                "TN is 256 up to BM = 64, 128 or 256 at BM = 128, 128 at BM = 256");
  static constexpr int kBM = BM;
  static constexpr int kTilesPerWarpgroup = TN / 128;     // m64 weight tiles
  static constexpr int kTileN = TN;                       // weight rows per CTA
  static constexpr int kGroups = 2 * kTilesPerWarpgroup;  // wgmma groups per stage
  static constexpr int kMinBlocks = BM <= 32 ? 2 : 1;
  // Stages: as many as the shared memory allows, except BM = 32, where a 4th stage (fitting two
  // CTAs per SM) measured ~15% slower on 17408x5120 and 28672x8192 at M = 32
  // (benchmarks/RESULTS.md).
  static constexpr int kStages =
      BM == 16 ? 5 : (BM == 32 ? 3 : (BM == 64 ? 6 : (BM == 128 ? (TN == 128 ? 5 : 4) : 3)));
  static constexpr int kActBytes = BM * kStageK * 2;         // two [BM][64] swizzled tiles
  static constexpr int kActSubBytes = BM * 128;              // one [BM][64] tile
  static constexpr int kPackedBytes = kTileN * kStageK / 2;  // 16 / 8 KB
  static constexpr int kScaleBytes = kTileN * kStageK / 16;  // 2 / 1 KB
  static constexpr int kPipeBytes = kStages * (kActBytes + kPackedBytes + kScaleBytes);
  static constexpr int kEpiStride = kTileN + 4;  // floats; conflict-free staging
  static constexpr int kEpiBytes = BM * kEpiStride * 4;
  static constexpr int kSmemBytes = 1024 + (kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes);
  static_assert(kSmemBytes <= kMaxSmemPerCta, "shared memory over the sm_90 limit");
  static_assert(kMinBlocks == 1 || kSmemBytes <= kSmemPerSm / kMinBlocks - 1024,
                "kMinBlocks CTAs must fit one SM's shared memory");
  static_assert(kStages >= 3, "the refill after the barrier overwrites stage it - 2's slot");
  static_assert(kActSubBytes % 1024 == 0, "wgmma B tiles must stay 1024-byte aligned");
  // Dynamic shared memory that leaves room for one CTA per SM only: how a kMinBlocks = 2 tile
  // spreads a grid too small to fill every SM twice over all SMs instead of packing half of them.
  static constexpr int kSpreadSmemBytes = kSmemBytes > kSmemPerSm / 2 ? kSmemBytes : kSmemPerSm / 2;
};

// Activation rows per CTA: the smallest tile that covers M (less padded tensor work; the tiles up
// to 32 rows also run two CTAs per SM); above 128 rows the 256-row tile, which decodes each weight
// fragment once for 256 rows (M = 256: 8-17% faster than two 128-row tiles; M = 128: 1.4-1.6x
// slower than one; benchmarks/RESULTS.md).
inline int DefaultTileM(int64_t m) {
  return m <= 16 ? 16 : (m <= 32 ? 32 : (m <= 64 ? 64 : (m <= 128 ? 128 : 256)));
}

// Which kernel serves a tile by default: the warp-specialized one from 64 rows (M = 128 - 1024:
// 3-12% faster than the multistage one; M = 48 and 64, since its activation tile comes by TMA:
// 2-20% faster on all four prefill shapes); the multistage one up to 32 rows (where a
// warp-specialized variant, one or two CTAs per SM, measures 0-10% slower: its two decoding
// warpgroups cannot hide the decode's latency, the multistage kernel's two CTAs' four can).
// benchmarks/RESULTS.md; docs/design.md.
constexpr bool WarpSpecializedByDefault(int tile_m) { return HasWarpSpecialized(tile_m); }

// The CTA tile and kernel of a call.
struct TileChoice {
  int m;    // activation rows (IsTileM)
  int n;    // weight rows: DefaultTileN(m), or 128 at m = 128
  bool ws;  // warp-specialized kernel (HasWarpSpecialized(m))
};

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_FUSED_CONFIG_CUH_
