// Fused NVFP4 x FP16/BF16 GEMM for sm_90a (M > 8): the packed weight streams from HBM into shared
// memory (cp.async, multi-stage), is decoded in registers straight into the wgmma A-operand
// fragment with the E4M3 block scale folded in (exact), and feeds wgmma.mma_async (A = weight
// from registers, B = activations from 128B-swizzled shared memory), fp32 accumulation; global
// scale and bias in the epilogue. Split-K across the CTAs of a thread-block cluster, reduced
// on chip through distributed shared memory in a fixed order (deterministic, no workspace).
//
// Roles of the GEMM dimensions (the weight is the wgmma "M" operand):
//   wgmma M (64 per instruction) = weight rows n (output columns),
//   wgmma N (BM = 16 .. 256)     = activation rows m,
//   wgmma K (16 per instruction) = k, in the kernel's own order inside each 64-k block (below).
//
// CTA tile: TN weight rows x BM activation rows, decoded and multiplied by 256 threads = 2
// warpgroups; warpgroup wg owns weight rows [TN / 2 wg, TN / 2 (wg + 1)) as TJ m64 tiles j
// (TJ = 2, TN = 256 up to BM = 128; TJ = 1, TN = 128 at BM = 256). Two kernels share the stage
// layout, the decode and the epilogue:
//   FusedGemmKernel (multistage, BM <= 32 by default): the same 256 threads also issue the copies,
//     S - 2 stages ahead, with one CTA-wide barrier per stage;
//   FusedGemmWsKernel (warp-specialized, BM >= 64 by default): a third warpgroup only copies
//     (the activation tile by TMA from one thread; the weight by cp.async, or on prepacked
//     weights at BM = 256 by bulk copies from one warp), S stages ahead, each
//     stage's completion on an mbarrier, and the two decoding warpgroups run on their own
//     schedules (no CTA-wide barrier in the main loop; setmaxnreg gives them 224 registers, the
//     copier 56).
// Pipeline stage = 128 K elements:
//   act    [BM][128] f16/bf16 as two [BM][64] K-major 128B-swizzled wgmma B tiles (1024-aligned)
//   packed [TN][64 B]  (16-byte quarter q of row r stored at quarter q ^ (2 ((r >> 1) & 1)),
//                       but unswizzled where bulk copies land whole tiled runs: kPlainRows)
//   scale  [TN][8 B]   raw E4M3
// Each lane converts the scale bytes it needs itself (its two rows' bytes of a group with one
// cvt.rn.f16x2.e4m3x2 per group) into 16-bit pairs {s, s} * 2^7 (fp16) / 2^119 (bf16), inside
// the decode, after the stage barrier.
//
// Fragment K order (why the activations come permuted): the wgmma register-A fragment gives lane
// (g = lane / 4, t = lane % 4) of warp w rows 16 w + g and 16 w + g + 8, k pairs (2t, 2t+1) and
// (2t+8, 2t+9) of each k16 step. The kernel hands lane t the packed words 2t and 2t + 1 of a
// row's 64-k block (physical k 16t .. 16t + 15: one NVFP4 scale block) and decodes each word as
// four "split pairs" (nibbles e and e + 4, 2 ALU instructions each: decode_e2m1_split_pair), so
// that the pair it places at logical k (k_log, k_log + 1) holds physical k (p, p + 4) with
//   k_log = 32 sb + 16 j1 + 8 j0 + 2 t + o   <->   p = 16 t + 8 sb + 4 o + 2 j1 + j0
// (word sb of the lane, nibble pair j = 2 j1 + j0, o = which nibble of the pair). wgmma sums over
// k_log, so the activation must sit at the same logical place: the caller passes
// a_frag[m, k_log] = a[m, p(k_log)] per 64-k block (jax_fp4/_fused.py: to_fragment_order), which
// XLA fuses into whatever produced the activation. Each lane reads one 8-byte word pair per row
// (no byte gather) and one scale byte per row, and one packed multiply folds the scale exactly:
// e2m1 * 2^-14 (fp16) / 2^-126 (bf16) times the scale pair = e2m1 * e4m3 * 2^-7; the epilogue
// multiplies by 2^7 gs.
//
// Tiled weights (template flag Tiled; the layout of jax_fp4.prepack, jax_fp4/_layout.py): the
// same stage contents gathered from other addresses (a row's 16-byte quarter q of window c sits
// in its 16-row tile's 1 KB run of that window; a tile's 128 scale bytes of the window are copied
// whole and read at their tiled offsets), and each word decoded in adjacent pairs
// (decode_tiled_pair) instead of split pairs: the pair at logical (k_log, k_log + 1) then holds
// physical (p, p + 1) with p = 16 t + 8 sb + 4 j0 + 2 j1 + o (to_fragment_order(tiled=True)).
//
// One wgmma commit group = one (sub-chunk of 64 k, m64 tile): decode group q into registers
// A[q & 1] while the previous group runs, with the next group's shared-memory loads already
// issued; wgmma.wait_group 1 after each commit retires the group that last read A[(q & 1) ^ 1].
#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap (the map is encoded through the runtime's driver entry point)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fused_gemm.h"
#include "cuda/ptx.cuh"
#include "jax_fp4/nvfp4.h"
#include "jax_fp4/nvfp4_cuda.cuh"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_FP4_FUSED_SM90A 1
#else
#define JAX_FP4_FUSED_SM90A 0
#endif

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

constexpr int kConsumerThreads = 256;  // 2 warpgroups decode and multiply
constexpr int kProducerThreads = 128;  // warp-specialized kernel: 1 warpgroup copies
constexpr int kWsThreads = kProducerThreads + kConsumerThreads;
// Warp-specialized register split (setmaxnreg): 128 x 56 + 256 x 224 <= 64 K registers (40 for
// the producer spilled its source pointers at 256-row CTA tiles, two scale rows per thread).
// (Used only in sm_90a device code: other compilation passes would warn that they are unused.)
[[maybe_unused]] constexpr int kProducerRegisters = 56;
[[maybe_unused]] constexpr int kConsumerRegisters = 224;
constexpr int kStageK = 128;          // K per pipeline stage
constexpr int kMaxSplit = 8;          // portable cluster size
constexpr int kFillStages = 2;        // split heuristic: per-CTA fixed cost in stage units
constexpr int kSmemPerSm = 233472;    // sm_90 shared memory per SM (each CTA reserves 1 KB of it)
constexpr int kMaxSmemPerCta = 232448;  // sm_90 opt-in maximum per CTA

// The activation tiles the kernel is built for (FusedConfig, JAX_FP4_FUSED_TILE_M).
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
// the other's waits. TN = 128 at BM = 128 (JAX_FP4_FUSED_TILE_N, measurement only): twice the
// CTAs, for grids that leave SMs idle (NOTES_fused.md, "Thirteenth session").
template <int BM, int TN = DefaultTileN(BM)>
struct FusedConfig {
  static_assert(IsTileM(BM), "BM is 16, 32, 64, 128 or 256");
  static_assert(TN == DefaultTileN(BM) || (BM == 128 && TN == 128),
                "TN is 256 up to BM = 64, 128 or 256 at BM = 128, 128 at BM = 256");
  static constexpr int kBM = BM;
  static constexpr int kTilesPerWarpgroup = TN / 128;         // m64 weight tiles
  static constexpr int kTileN = TN;                           // weight rows per CTA
  static constexpr int kGroups = 2 * kTilesPerWarpgroup;      // wgmma groups per stage
  static constexpr int kMinBlocks = BM <= 32 ? 2 : 1;
  // Stages: as many as the shared memory allows, except BM = 32, where a 4th stage (fitting two
  // CTAs per SM) measured ~15% slower on 17408x5120 and 28672x8192 at M = 32 (NOTES_fused.md).
  static constexpr int kStages =
      BM == 16 ? 5
               : (BM == 32 ? 3 : (BM == 64 ? 6 : (BM == 128 ? (TN == 128 ? 5 : 4) : 3)));
  static constexpr int kActBytes = BM * kStageK * 2;         // two [BM][64] swizzled tiles
  static constexpr int kActSubBytes = BM * 128;              // one [BM][64] tile
  static constexpr int kPackedBytes = kTileN * kStageK / 2;  // 16 / 8 KB
  static constexpr int kScaleBytes = kTileN * kStageK / 16;  // 2 / 1 KB
  static constexpr int kPipeBytes = kStages * (kActBytes + kPackedBytes + kScaleBytes);
  static constexpr int kEpiStride = kTileN + 4;              // floats; conflict-free staging
  static constexpr int kEpiBytes = BM * kEpiStride * 4;
  static constexpr int kSmemBytes = 1024 + (kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes);
  static_assert(kSmemBytes <= kMaxSmemPerCta, "shared memory over the sm_90 limit");
  static_assert(kMinBlocks == 1 || kSmemBytes <= kSmemPerSm / kMinBlocks - 1024,
                "kMinBlocks CTAs must fit one SM's shared memory");
  static_assert(kStages >= 3, "the refill after the barrier overwrites stage it - 2's slot");
  static_assert(kActSubBytes % 1024 == 0, "wgmma B tiles must stay 1024-byte aligned");
  // Dynamic shared memory that leaves room for one CTA per SM only: how a kMinBlocks = 2 tile
  // spreads a grid too small to fill every SM twice over all SMs instead of packing half of them.
  static constexpr int kSpreadSmemBytes =
      kSmemBytes > kSmemPerSm / 2 ? kSmemBytes : kSmemPerSm / 2;
};

// ---- small PTX wrappers ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t LdShared8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint2 LdShared64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Moves this warpgroup's register budget to N per thread (warp-specialized kernel).
template <int N, bool Increase>
__device__ __forceinline__ void SetMaxRegisters() {
  if constexpr (Increase) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
  }
}

template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void FenceReg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void FenceReg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <typename P>
__device__ __forceinline__ void FencePtr(const P*& p) { asm volatile("" : "+l"(p)); }

// wgmma shared-memory descriptor: K-major operand, 128-byte swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t MakeDesc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// ---- wgmma m64nNk16, A from registers, B K-major from shared memory --------------------------
// One macro per N (= BM; N / 2 fp32 accumulators per thread, 8 per JAX_FP4_ACC8); TYPE is "f16"
// or "bf16". They name WgmmaRS's operands d, a0..a3, desc and scale_d; scale_d == 0: D = A * B.
#if JAX_FP4_FUSED_SM90A
#define JAX_FP4_ACC8(I)                                                                       \
  "+f"(d[I]), "+f"(d[I + 1]), "+f"(d[I + 2]), "+f"(d[I + 3]), "+f"(d[I + 4]), "+f"(d[I + 5]), \
      "+f"(d[I + 6]), "+f"(d[I + 7])
#define JAX_FP4_WGMMA_M64N16(TYPE)                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                     \
               "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE " {" \
               "%0, %1, %2, %3, %4, %5, %6, %7"                                 \
               "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"                   \
               : JAX_FP4_ACC8(0)                                                \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N32(TYPE)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                           \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {"       \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
               "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"                       \
               : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8)                                     \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N64(TYPE)                                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                     \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                 \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
               "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                 \
               : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8), JAX_FP4_ACC8(16), JAX_FP4_ACC8(24)           \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N128(TYPE)                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                       \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                  \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"   \
               "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                   \
               : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8), JAX_FP4_ACC8(16), JAX_FP4_ACC8(24),            \
                 JAX_FP4_ACC8(32), JAX_FP4_ACC8(40), JAX_FP4_ACC8(48), JAX_FP4_ACC8(56)           \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#define JAX_FP4_WGMMA_M64N256(TYPE)                                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                    \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                         \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "               \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "               \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "               \
               "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "               \
               "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "               \
               "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "   \
               "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
               "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"                                            \
               : JAX_FP4_ACC8(0), JAX_FP4_ACC8(8), JAX_FP4_ACC8(16), JAX_FP4_ACC8(24),                          \
                 JAX_FP4_ACC8(32), JAX_FP4_ACC8(40), JAX_FP4_ACC8(48), JAX_FP4_ACC8(56),                        \
                 JAX_FP4_ACC8(64), JAX_FP4_ACC8(72), JAX_FP4_ACC8(80), JAX_FP4_ACC8(88),                        \
                 JAX_FP4_ACC8(96), JAX_FP4_ACC8(104), JAX_FP4_ACC8(112), JAX_FP4_ACC8(120)                      \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
#endif  // JAX_FP4_FUSED_SM90A

template <typename T, int BM>
__device__ __forceinline__ void WgmmaRS(float (&d)[BM / 2], const uint32_t (&a)[4], uint64_t desc,
                                        uint32_t scale_d) {
#if JAX_FP4_FUSED_SM90A
  const uint32_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
#define JAX_FP4_WGMMA_TYPED(WGMMA)           \
  if constexpr (std::is_same_v<T, __half>) { \
    WGMMA("f16");                            \
  } else {                                   \
    WGMMA("bf16");                           \
  }
  if constexpr (BM == 16) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N16)
  } else if constexpr (BM == 32) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N32)
  } else if constexpr (BM == 64) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N64)
  } else if constexpr (BM == 128) {
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N128)
  } else {
    static_assert(BM == 256, "BM must be 16, 32, 64, 128 or 256");
    JAX_FP4_WGMMA_TYPED(JAX_FP4_WGMMA_M64N256)
  }
#undef JAX_FP4_WGMMA_TYPED
#endif
}
#if JAX_FP4_FUSED_SM90A
#undef JAX_FP4_ACC8
#undef JAX_FP4_WGMMA_M64N16
#undef JAX_FP4_WGMMA_M64N32
#undef JAX_FP4_WGMMA_M64N64
#undef JAX_FP4_WGMMA_M64N128
#undef JAX_FP4_WGMMA_M64N256
#endif

// ---- decode helpers --------------------------------------------------------------------------

// What one lane reads for one (m64 tile, 64-k sub-chunk) group: per row (lo = 16 w + g, hi = +8)
// its packed words 2t and 2t + 1 of the sub-chunk and the raw scale byte of that 16-k block.
struct GroupBytes {
  uint2 words[2];
  uint32_t scale[2];
};

// sc_hi: the high row's scale byte relative to the low row's (8 rows of 8 bytes; tiled: 2).
__device__ __forceinline__ GroupBytes LoadGroup(uint32_t pk_lo, uint32_t sc_lo, uint32_t sc_hi) {
  GroupBytes gb;
  gb.words[0] = LdShared64(pk_lo);
  gb.words[1] = LdShared64(pk_lo + 8 * 64);
  gb.scale[0] = LdShared8(sc_lo);
  gb.scale[1] = LdShared8(sc_lo + sc_hi);
  return gb;
}

// The 16 A-fragment registers of one group: out[s] = {a0, a1, a2, a3} of k16 step s. Word sb of
// row r gives steps 2 sb (nibble pairs j = 0, 1) and 2 sb + 1 (j = 2, 3); j0 = j & 1 selects
// the fragment's k + 8 half (registers 2, 3). See "Fragment K order" above.
// Tiled: nibble pair j = 2 j1 + j0 of the spec's split pairs becomes adjacent pair j1 + 2 j0.
template <typename T, bool Tiled>
__device__ __forceinline__ void DecodeGroup(uint32_t (&out)[4][4], const GroupBytes& gb) {
  using Tr = HalfTraits<T>;
  uint32_t scales[2];  // both rows' scale pairs from one conversion
  e4m3x2_scale_pairs<T>(gb.scale[0] | (gb.scale[1] << 8), scales[0], scales[1]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int sb = 0; sb < 2; ++sb) {
      const uint32_t q = sb == 0 ? gb.words[r].x : gb.words[r].y;
      const uint32_t sc = scales[r];
      if constexpr (Tiled) {
        out[2 * sb][r] = Tr::pair_mul(decode_tiled_pair<T, 0>(q), sc);
        out[2 * sb][2 + r] = Tr::pair_mul(decode_tiled_pair<T, 2>(q), sc);
        out[2 * sb + 1][r] = Tr::pair_mul(decode_tiled_pair<T, 1>(q), sc);
        out[2 * sb + 1][2 + r] = Tr::pair_mul(decode_tiled_pair<T, 3>(q), sc);
      } else {
        out[2 * sb][r] = Tr::pair_mul(decode_e2m1_split_pair<T, 0>(q), sc);
        out[2 * sb][2 + r] = Tr::pair_mul(decode_e2m1_split_pair<T, 1>(q), sc);
        out[2 * sb + 1][r] = Tr::pair_mul(decode_e2m1_split_pair<T, 2>(q), sc);
        out[2 * sb + 1][2 + r] = Tr::pair_mul(decode_e2m1_split_pair<T, 3>(q), sc);
      }
    }
  }
}

// ---- the kernel's parts ----------------------------------------------------------------------

// Shared-memory map of a CTA: S pipeline slots of activations, packed weight and scale bytes,
// reused after the main loop as the fp32 epilogue tile. `base` is the 1024-aligned start.
template <typename Cfg>
struct SmemMap {
  uint32_t act, pk, sc;
  __device__ explicit SmemMap(uint32_t base)
      : act(base),
        pk(base + Cfg::kStages * Cfg::kActBytes),
        sc(base + Cfg::kStages * (Cfg::kActBytes + Cfg::kPackedBytes)) {}
  __device__ uint32_t ActSlot(int slot) const { return act + slot * Cfg::kActBytes; }
  __device__ uint32_t PackedSlot(int slot) const { return pk + slot * Cfg::kPackedBytes; }
  __device__ uint32_t ScaleSlot(int slot) const { return sc + slot * Cfg::kScaleBytes; }
};

// One thread's share (ltid of kLoaders threads) of the copies that fill a pipeline slot with K
// stage c: the activation tile (16 chunks of 16 B per row; rows ltid / 16 + kLoaders / 16 i),
// the packed weight tile (4 chunks per row; rows ltid / 4 + kLoaders / 4 i) and the scale bytes
// (8 per row; rows ltid + kLoaders i). Source rows are resolved once (per stage only the K offset
// moves; the per-row index arithmetic was ~20% of BM = 256's instructions): the thread's rows
// i < a_valid lie in M (the rest are zero-filled), its packed rows i < p_valid in N (the rest read
// row N - 1, never stored).
template <typename T, typename Cfg, bool Tiled, int kLoaders, bool kActTma = false>
struct StageLoader {
  static constexpr int BM = Cfg::kBM;
  static constexpr int kActRows = kLoaders / 16;  // activation rows per pass
  static constexpr int kActPasses = BM / kActRows;
  static constexpr int kPkRows = kLoaders / 4;  // packed rows per pass
  static constexpr int kPkPasses = Cfg::kTileN / kPkRows;
  static constexpr int kScPasses = (Cfg::kTileN + kLoaders - 1) / kLoaders;
  static_assert(kActRows % 8 == 0 && kPkRows % 16 == 0, "passes keep the swizzle phase and tiles");
  static_assert(BM % kActRows == 0 && Cfg::kTileN % kPkRows == 0, "whole passes");
  // The warp-specialized producer's register budget (kProducerRegisters) holds the pass pointers
  // only if the compiler cannot hoist every pass's address out of the stage loop (it spilled).
  static constexpr bool kOpaquePasses = kLoaders == kProducerThreads;
  // The warp-specialized kernels on prepacked weights: a 16-row tile's bytes of one K stage are
  // one 1 KB packed run ([16 rows][64 B], nvfp4.h tiled_packed_offset) and one 128-byte scale run,
  // each brought by one bulk copy from lane `tile` of the copier's warp 0 (the packed rows then
  // land without the quarter swizzle: StageDecoder kPlainRows). No cp.async at all: the slot's
  // `full` barrier expects lane 0's expect_tx arrival only. BM = 256 only: there it measured up to
  // 5% faster; at BM = 128 (TN = 256) 17-30% slower, likely the lost swizzle (twice the shared-
  // memory wavefronts per packed load) weighing on a decode that feeds half as many activation
  // rows (NOTES_fused.md, "Eighteenth session").
  static constexpr bool kWeightBulk = kActTma && Tiled && Cfg::kBM == 256;
  static constexpr int kTiles = Cfg::kTileN / 16;
  static constexpr int kPackedRun = 16 * kStageK / 2, kScaleRun = 16 * kStageK / 16;  // bytes
  static_assert(!kWeightBulk || kTiles <= 32, "one lane of warp 0 per 16-row tile");
  static constexpr int kCopyThreads = kWeightBulk ? 32 : kLoaders;  // threads that walk the ring
  static constexpr int kFullArrivals = kWeightBulk ? 1 : kLoaders + (kActTma ? 1 : 0);

  const CUtensorMap* act_map = nullptr;  // kActTma: the activation's tensor map
  int act_m0 = 0;                        // kActTma: the tile's first activation row
  const uint8_t* pk_run = nullptr;  // kWeightBulk: this lane's tile's stage-0 runs (tiles in N)
  const uint8_t* sc_run = nullptr;
  uint32_t weight_bytes = 0;  // kWeightBulk: packed + scale bytes of the CTA tile's rows in N
  const T* a_any;  // a valid address for the zero-byte copies of rows past M
  const T* a_src0;
  int64_t a_step;
  int a_valid;
  uint32_t a_dst0;
  const uint8_t* p_src0;
  const uint8_t* p_last;
  int64_t p_step;
  int p_valid;
  uint32_t p_dst0;
  const uint8_t* s_src[kScPasses];
  int s_rows;  // scale rows this thread copies
  SmemMap<Cfg> map;

  __device__ StageLoader(int ltid, const T* a, const uint8_t* packed, const uint8_t* scale, int m,
                         int n, int k, int m0, int n0, SmemMap<Cfg> smem)
      : a_any(a), map(smem) {
    const int a_ch = ltid & 15, a_r0 = ltid >> 4;
    a_dst0 = (a_ch >> 3) * Cfg::kActSubBytes + a_r0 * 128 + (((a_ch & 7) ^ (a_r0 & 7)) << 4);
    a_valid = min(max((m - m0 - a_r0 + kActRows - 1) / kActRows, 0), kActPasses);
    a_src0 = a + static_cast<int64_t>(a_valid > 0 ? m0 + a_r0 : 0) * k + a_ch * 8;
    a_step = kActRows * static_cast<int64_t>(k);

    const int p_q = ltid & 3, p_r0 = ltid >> 2;
    p_dst0 = p_r0 * 64 + ((p_q ^ (((p_r0 >> 1) & 1) << 1)) << 4);
    p_valid = min(max((n - n0 - p_r0 + kPkRows - 1) / kPkRows, 0), kPkPasses);
    const int64_t row_bytes = k / 2;
    const int64_t windows = k / kStageK;
    // Quarter p_q of a row's window 0: spec row-major; tiled in its tile's 1 KB run of the window
    // (nvfp4.h). kPkRows rows are whole 16-row tiles, kPkRows * row_bytes apart in both.
    auto packed_at = [&](int64_t row) {
      return packed +
             (Tiled ? tiled_packed_offset(row, 0, p_q, windows) : row * row_bytes + p_q * 16);
    };
    p_src0 = packed_at(min(n0 + p_r0, n - 1));
    p_last = packed_at(n - 1);
    p_step = kPkRows * row_bytes;

    // Spec: the 8 scale bytes of row n0 + r. Tiled: bytes 8 (r % 16) .. of the 128-byte run of
    // tile n0 / 16 + r / 16 (stored in shared memory tile by tile, as in global memory).
    s_rows = 0;
#pragma unroll
    for (int i = 0; i < kScPasses; ++i) {
      const int r = ltid + kLoaders * i;
      if (r < Cfg::kTileN) s_rows = i + 1;
      const int64_t tile = min(n0 / 16 + r / 16, n / 16 - 1);
      s_src[i] = Tiled ? scale + tile * windows * 128 + (r % 16) * 8
                       : scale + static_cast<int64_t>(min(n0 + r, n - 1)) * (k / 16);
    }
    if constexpr (kWeightBulk) {
      const int tiles_in_n = min(kTiles, n / 16 - n0 / 16);  // prepacked: N % 16 == 0
      weight_bytes = static_cast<uint32_t>(tiles_in_n) * (kPackedRun + kScaleRun);
      if (ltid < tiles_in_n) {
        const int64_t tile = n0 / 16 + ltid;
        pk_run = packed + tile * windows * kPackedRun;
        sc_run = scale + tile * windows * kScaleRun;
      }
    }
  }

  // kActTma: the activation tile comes as two TMA boxes ([BM][64] each, 128-byte swizzle: the
  // layout the cp.async copies build) issued by thread 0, whose arrival on `full_bar` also
  // expects their bytes; one instruction per box instead of BM / 8 cp.async per thread, which
  // left the copier warpgroup issue-bound at the 256-row tile (NOTES_fused.md, seventeenth
  // session). Rows past M are zero-filled by the TMA unit.
  __device__ void UseActivationTma(const CUtensorMap* m, int m0) {
    act_map = m;
    act_m0 = m0;
  }

  // Issues the copies of K stage c into pipeline slot `slot` (ltid: as constructed); with
  // kActTma, `full_bar` is the slot's barrier.
  __device__ __forceinline__ void operator()(int c, int slot, int ltid,
                                             uint32_t full_bar = 0) const {
    if constexpr (kActTma) {
      if (ltid == 0) {
        // One arrival that expects every byte the stage's TMA and bulk copies bring.
        MbarExpectTx(full_bar, Cfg::kActBytes + (kWeightBulk ? weight_bytes : 0u));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          TmaLoad2d(map.ActSlot(slot) + h * Cfg::kActSubBytes, act_map, c * kStageK + 64 * h,
                    act_m0, full_bar);
        }
      }
    } else {
      CopyActivations(c, slot);
    }
    if constexpr (kWeightBulk) {
      __syncwarp();  // the expect_tx before any of the warp's copies can complete
      if (pk_run != nullptr) {
        BulkCopy(map.PackedSlot(slot) + ltid * kPackedRun, pk_run + c * kPackedRun, kPackedRun,
                 full_bar);
        BulkCopy(map.ScaleSlot(slot) + ltid * kScaleRun, sc_run + c * kScaleRun, kScaleRun,
                 full_bar);
      }
    } else {
      CopyWeights(c, slot, ltid);
    }
  }

 private:
  __device__ __forceinline__ void CopyActivations(int c, int slot) const {
    const uint32_t act_dst = map.ActSlot(slot) + a_dst0;
    const T* a_src = a_src0 + static_cast<int64_t>(c) * kStageK;
    if (a_valid == kActPasses) {  // all rows in M (every M tile but a ragged last one)
#pragma unroll
      for (int i = 0; i < kActPasses; ++i, a_src += a_step) {
        if constexpr (kOpaquePasses) FencePtr(a_src);
        CpAsync16(act_dst + i * kActRows * 128, a_src, 16u);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kActPasses; ++i, a_src += a_step) {
        if constexpr (kOpaquePasses) FencePtr(a_src);
        const bool in_m = i < a_valid;
        CpAsync16(act_dst + i * kActRows * 128, in_m ? a_src : a_any, in_m ? 16u : 0u);
      }
    }
  }

  __device__ __forceinline__ void CopyWeights(int c, int slot, int ltid) const {
    // Per stage: the next 1 KB run of the row's tile (tiled), or the row's next 64 bytes (spec).
    constexpr int64_t kPkStage = Tiled ? 1024 : 64;
    const uint32_t pk_dst = map.PackedSlot(slot) + p_dst0;
    const uint8_t* p_src = p_src0 + c * kPkStage;
#pragma unroll
    for (int i = 0; i < kPkPasses; ++i, p_src += p_step) {
      if constexpr (kOpaquePasses) FencePtr(p_src);
      CpAsync16(pk_dst + i * kPkRows * 64, i < p_valid ? p_src : p_last + c * kPkStage, 16u);
    }
    constexpr int64_t kScStage = Tiled ? 128 : 8;
#pragma unroll
    for (int i = 0; i < kScPasses; ++i) {
      if (i < s_rows) {
        CpAsync8(map.ScaleSlot(slot) + (ltid + kLoaders * i) * 8, s_src[i] + c * kScStage);
      }
    }
  }
};

// The decode and tensor-core side of one consumer thread (ctid of the 256 threads of two
// warpgroups): warpgroup wg owns weight rows [TN / 2 wg, TN / 2 (wg + 1)) of the CTA tile.
// kPlainRows: the packed stage rows without the quarter swizzle (the warp-specialized kernels on
// prepacked weights, whose packed tile arrives as whole 16-row runs by bulk copy).
template <typename T, typename Config, bool Tiled, bool kPlainRows = false>
struct StageDecoder {
  using Cfg = Config;
  static constexpr int BM = Cfg::kBM;
  static constexpr int TJ = Cfg::kTilesPerWarpgroup;
  static constexpr int kAcc = BM / 2;

  int row_lo0;  // this lane's low row in tile 0 (tile j adds 64 j; the high row adds 8)
  int t;
  uint32_t pk_off[2], sc_off[2];

  // This lane's byte offsets inside a packed stage row (words 2t, 2t + 1 of sub-chunk h, quarter
  // swizzled by row; rows 16 w + g and + 8 share the swizzle) and of the scale of block 4h + t: in
  // the row's 8 bytes; tiled, in the 16-row tile's 128 bytes at (4 g + block / 2) 4 + block % 2
  // (the high row 2 bytes on).
  __device__ explicit StageDecoder(int ctid) {
    const int lane = ctid & 31, warp = ctid >> 5;
    const int wg = warp >> 2, wq = warp & 3;
    const int g = lane >> 2;
    t = lane & 3;
    row_lo0 = wg * 64 * TJ + wq * 16 + g;
    const uint32_t pswz = kPlainRows ? 0u : ((g >> 1) & 1) << 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      pk_off[h] = (((2u * h + (t >> 1)) ^ pswz) << 4) | ((t & 1u) << 3);
      sc_off[h] = Tiled ? (4u * g + 2u * h + (t >> 1)) * 4u + (t & 1u) : 4u * h + t;
    }
  }

  // One stage: its kGroups groups (q = (sub-chunk h = q / TJ, tile j = q % TJ), shared-memory
  // loads issued one group ahead) decoded into afrag[q & 1] and multiplied into acc[j]. `first`:
  // the CTA's first stage (the first wgmma of each tile overwrites acc: D = A * B; zeroing the
  // accumulators with ordinary moves makes ptxas serialize every wgmma, warning C7515).
  // after_first_group() runs once the stage's first group is committed and every older group
  // (all of the previous stage's) has retired.
  template <typename Hook>
  __device__ __forceinline__ void operator()(float (&acc)[TJ][kAcc], uint32_t (&afrag)[2][4][4],
                                             uint32_t act_slot, uint32_t pk_slot, uint32_t sc_slot,
                                             bool first, Hook&& after_first_group) const {
    constexpr uint32_t sc_hi = Tiled ? 2 : 64;
    auto load_group = [&](int q) {
      const int r_lo = row_lo0 + 64 * (q % TJ);
      const int sc_row = Tiled ? (r_lo / 16) * 128 : r_lo * 8;  // tiled: r_lo % 16 == g < 8
      return LoadGroup(pk_slot + r_lo * 64 + pk_off[q / TJ], sc_slot + sc_row + sc_off[q / TJ],
                       sc_hi);
    };
    GroupBytes next = load_group(0);
#pragma unroll
    for (int q = 0; q < Cfg::kGroups; ++q) {
      const int h = q / TJ, j = q % TJ, buf = q & 1;
      const GroupBytes cur = next;
      if (q + 1 < Cfg::kGroups) next = load_group(q + 1);
      DecodeGroup<T, Tiled>(afrag[buf], cur);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) FenceReg(acc[j][i]);
      WgmmaFence();
      const uint32_t b_tile = act_slot + h * Cfg::kActSubBytes;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        WgmmaRS<T, BM>(acc[j], afrag[buf][s], MakeDesc(b_tile + s * 32),
                       (!first || q >= TJ || s > 0) ? 1u : 0u);
      }
      WgmmaCommit();
      WgmmaWait<1>();  // retires the previous group; this one stays in flight
      // The group that read afrag[buf ^ 1] is retired: keep those registers alive until here.
#pragma unroll
      for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int r = 0; r < 4; ++r) FenceReg(afrag[buf ^ 1][s][r]);
      }
      if (q == 0) after_first_group();
    }
  }

  // After the last stage: every wgmma group retired, the accumulators final.
  __device__ __forceinline__ void Drain(float (&acc)[TJ][kAcc]) const {
    WgmmaWait<0>();
#pragma unroll
    for (int j = 0; j < TJ; ++j) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) FenceReg(acc[j][i]);
    }
  }
  // The fp32 tile as E[m][n] in `epi` (StoreTile).
  __device__ __forceinline__ void Stage(float* epi, const float (&acc)[TJ][kAcc]) const {
    constexpr int ST = Cfg::kEpiStride;
#pragma unroll
    for (int j = 0; j < TJ; ++j) {
      const int nl = row_lo0 + 64 * j;
#pragma unroll
      for (int b = 0; b < BM / 8; ++b) {
        const int ml = 8 * b + 2 * t;
        epi[ml * ST + nl] = acc[j][4 * b + 0];
        epi[(ml + 1) * ST + nl] = acc[j][4 * b + 1];
        epi[ml * ST + nl + 8] = acc[j][4 * b + 2];
        epi[(ml + 1) * ST + nl + 8] = acc[j][4 * b + 3];
      }
    }
  }
};

// The epilogue's multiplier: the global scale, times 2^7 to undo the 2^-7 of the scale folded
// into the decoded weight.
__device__ __forceinline__ float EpilogueScale(const float* global_scale) {
  return __ldg(global_scale) * 128.0f;
}

// Rows rank, rank + splits, ... of a staged fp32 tile (Decoder::Stage's layout) to y, 4 columns
// per consumer thread (ctid): sum(ml, col) gives the float4 at staged row ml, column col; then
// global scale, bias and an 8-byte store where y allows it (vec_store).
template <typename Decoder, typename T, typename SumStaged>
__device__ __forceinline__ void StoreStagedRows(const SumStaged& sum_staged, int rank, int splits,
                                                int ctid, int m0, int n0, int m, int n,
                                                const float* global_scale, const T* bias, T* y,
                                                int vec_store) {
  using Cfg = typename Decoder::Cfg;
  using Tr = HalfTraits<T>;
  const float alpha = EpilogueScale(global_scale);
  constexpr int kColThreads = Cfg::kTileN / 4;  // threads per staged row, 4 columns each
  const int c4 = ctid % kColThreads;
  const int nn = n0 + 4 * c4;
  for (int ml = rank + splits * (ctid / kColThreads); ml < Cfg::kBM;
       ml += splits * (kConsumerThreads / kColThreads)) {
    const int mm = m0 + ml;
    if (mm >= m || nn >= n) break;
    const float4 sum = sum_staged(ml, 4 * c4);
    const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
    T out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = min(nn + e, n - 1);
      const float b = bias != nullptr ? Tr::to_float(bias[col]) : 0.0f;
      out[e] = Tr::from_float(fmaf(vals[e], alpha, b));
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
// reduction across the cluster (ranks = blockIdx.z), summed in rank order, global scale, bias and
// the store; by the 256 consumer threads (ctid). Every live thread of the cluster calls it (the
// cluster barriers; the warp-specialized kernel's copier has exited).
template <typename Decoder, typename T>
__device__ __forceinline__ void StoreTile(const Decoder& decode,
                                          const float (&acc)[Decoder::TJ][Decoder::kAcc],
                                          float* epi, int ctid, int m0, int n0, int m, int n,
                                          const float* global_scale, const T* bias, T* y,
                                          int vec_store) {
  namespace cg = cooperative_groups;
  constexpr int ST = Decoder::Cfg::kEpiStride;
  cg::cluster_group cluster = cg::this_cluster();
  decode.Stage(epi, acc);
  cluster.sync();
  const int splits = static_cast<int>(cluster.num_blocks());
  auto sum_ranks = [&](int ml, int col) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = 0; q < splits; ++q) {
      const float* remote = cluster.map_shared_rank(epi, q);
      const float4 v = *reinterpret_cast<const float4*>(remote + ml * ST + col);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    return sum;
  };
  StoreStagedRows<Decoder>(sum_ranks, static_cast<int>(cluster.block_rank()), splits, ctid, m0,
                           n0, m, n, global_scale, bias, y, vec_store);
  cluster.sync();  // keep this CTA's shared memory alive until every rank has read it
}

// The CTA's stage range [kc0, kc0 + nst) of its split-K rank (every CTA has at least one stage:
// split <= K / 128).
__device__ __forceinline__ int2 StageRange(int k) {
  const int ks = k / kStageK;
  const int kc0 = static_cast<int>(static_cast<int64_t>(blockIdx.z) * ks / gridDim.z);
  const int kc1 = static_cast<int>(static_cast<int64_t>(blockIdx.z + 1) * ks / gridDim.z);
  return make_int2(kc0, kc1 - kc0);
}

__device__ __forceinline__ uint32_t AlignedSmemBase(uint8_t*& smem, uint8_t* smem_raw) {
  const uint32_t raw_base = SmemAddr(smem_raw);
  const uint32_t align_pad = ((raw_base + 1023u) & ~1023u) - raw_base;
  smem = smem_raw + align_pad;
  return raw_base + align_pad;
}

// ---- the warp-specialized pipeline -------------------------------------------------------------

// Slot bookkeeping of the warp-specialized kernels' ring of S pipeline slots: per slot a `full`
// mbarrier (kProducerThreads cp.async arrivals and the activation tile's TMA bytes: the stage
// landed) and an `empty` one (one arrival per consumer warp: the wgmma groups that read it
// retired). Copier and consumers each walk the ring in the same stage order, over one or several
// tile segments.
template <int S>
struct PipelineRing {
  uint32_t full_bar, empty_bar;  // S barriers each, 8 bytes apart
  int slot = 0;
  uint32_t parity = 0;  // copier: of the slot's previous release; consumer: of its next arrival
  int stages = 0;       // stages walked so far

  __device__ explicit PipelineRing(uint64_t (&bars)[2 * S])
      : full_bar(SmemAddr(bars)), empty_bar(SmemAddr(bars) + 8 * S) {}

  // Once per CTA by thread 0, then a CTA barrier. full_arrivals: the loader's kFullArrivals.
  __device__ void Init(int full_arrivals) const {
    for (int s = 0; s < S; ++s) {
      MbarInit(full_bar + 8 * s, full_arrivals);
      MbarInit(empty_bar + 8 * s, kConsumerThreads / 32);  // one arrival per consumer warp
    }
    FenceMbarInit();
  }

  // Copier: K stage kc of the loader's tile into the next slot, once the slot is released.
  template <typename Loader>
  __device__ __forceinline__ void Copy(const Loader& load, int kc, int ltid) {
    if (stages >= S) MbarWait(empty_bar + 8 * slot, parity);
    load(kc, slot, ltid, full_bar + 8 * slot);
    if constexpr (!Loader::kWeightBulk) CpAsyncArriveNoinc(full_bar + 8 * slot);
    Advance(stages >= S);
  }

  // Consumers: `nst` stages of one tile segment into acc (the first overwrites it); every slot
  // is released once the wgmma groups that read it have retired (the last one after the drain).
  template <typename Decoder>
  __device__ __forceinline__ void Consume(const Decoder& decode,
                                          float (&acc)[Decoder::TJ][Decoder::kAcc],
                                          uint32_t (&afrag)[2][4][4],
                                          const SmemMap<typename Decoder::Cfg>& map, int nst,
                                          int lane) {
    int prev_slot = 0;
    for (int it = 0; it < nst; ++it) {
      MbarWait(full_bar + 8 * slot, parity);
      // Ordered cp.async activation writes (generic proxy) before wgmma reads (async proxy); the
      // TMA writes are async-proxy already, so it may now go (not yet measured on a GPU).
      FenceProxyAsync();
      decode(acc, afrag, map.ActSlot(slot), map.PackedSlot(slot), map.ScaleSlot(slot), it == 0,
             [&] {
               if (it > 0 && lane == 0) MbarArrive(empty_bar + 8 * prev_slot);
             });
      prev_slot = slot;
      Advance(true);
    }
    decode.Drain(acc);
    if (lane == 0) MbarArrive(empty_bar + 8 * prev_slot);
  }

 private:
  // Next slot; a wrap flips the parity if `flip` (the copier's first round waits for nothing).
  __device__ __forceinline__ void Advance(bool flip) {
    ++stages;
    if (++slot == S) {
      slot = 0;
      if (flip) parity ^= 1;
    }
  }
};

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
      NamedBarrierSync(1, kConsumerThreads);  // every thread's partial written ...
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
  StoreStagedRows<Decoder>(staged, 0, 1, ctid, m0, n0, m, n, global_scale, bias, y, vec_store);
}

// ---- the kernels -----------------------------------------------------------------------------

// Multistage: all 256 threads copy (cp.async, S - 2 stages ahead) and all decode and multiply;
// one CTA-wide barrier per stage. The default up to BM = 32 (WarpSpecializedByDefault).
template <typename T, typename Cfg, bool Tiled = false>
__global__ void __launch_bounds__(kConsumerThreads, Cfg::kMinBlocks)
    FusedGemmKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                    const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                    const T* __restrict__ bias, T* __restrict__ y, int m, int n, int k,
                    int vec_store) {
#if JAX_FP4_FUSED_SM90A
  WaitForPrerequisiteGrids();  // JAX_FP4_PDL: see FusedOverrides::programmatic
  AllowDependentLaunch();
  constexpr int BM = Cfg::kBM;
  using Decoder = StageDecoder<T, Cfg, Tiled>;
  constexpr int S = Cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem;
  const SmemMap<Cfg> map(AlignedSmemBase(smem, smem_raw));
  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * Cfg::kTileN;
  const int2 range = StageRange(k);
  const int kc0 = range.x, nst = range.y;
  const StageLoader<T, Cfg, Tiled, kConsumerThreads> load(tid, a, packed, scale, m, n, k, m0,
                                                          n0, map);
  const Decoder decode(tid);

  float acc[Decoder::TJ][Decoder::kAcc];
  uint32_t afrag[2][4][4] = {};  // double buffer: decode group q into afrag[q & 1]

  // Prologue: stages 0 .. S-3 in flight (one commit group each, empty past the end).
#pragma unroll
  for (int p = 0; p < S - 2; ++p) {
    if (p < nst) load(kc0 + p, p, tid);
    CpAsyncCommit();
  }
  int slot = 0;         // slot of stage `it`
  int pf_slot = S - 2;  // slot of stage `it + S - 2`
  for (int it = 0; it < nst; ++it) {
    CpAsyncWait<S - 3>();  // stage `it` (this thread's copies) landed
    FenceProxyAsync();     // cp.async (generic proxy) writes -> wgmma (async proxy) reads
    __syncthreads();
    // Refill the slot of stage it - 2: its decode finished before this barrier and its wgmma
    // groups were retired by the wait_group 1 after stage it - 1's first group.
    if (it + S - 2 < nst) load(kc0 + it + S - 2, pf_slot, tid);
    CpAsyncCommit();
    decode(acc, afrag, map.ActSlot(slot), map.PackedSlot(slot), map.ScaleSlot(slot), it == 0,
           [] {});
    slot = slot + 1 == S ? 0 : slot + 1;
    pf_slot = pf_slot + 1 == S ? 0 : pf_slot + 1;
  }
  decode.Drain(acc);
  CpAsyncWait<0>();
  __syncthreads();  // pipeline smem free: stage the fp32 tile
  StoreTile(decode, acc, reinterpret_cast<float*>(smem), tid, m0, n0, m, n, global_scale, bias, y,
            vec_store);
#endif  // JAX_FP4_FUSED_SM90A
}

// Warp-specialized (BM >= 64: HasWarpSpecialized, and the default there): warpgroup 0 only
// copies (TMA and cp.async, or TMA and bulk copies from its warp 0: StageLoader::kWeightBulk;
// each stage's completion arrives on the slot's `full` mbarrier, kStages stages in flight, within
// kProducerRegisters), warpgroups 1 and 2 only decode and multiply, each on its own schedule (no
// CTA-wide barrier in the main loop): a consumer warp waits for `full`, and releases the slot on
// `empty` once its wgmma groups that read it have retired. Split-K across a cluster.
template <typename T, typename Cfg, bool Tiled = false>
__global__ void __launch_bounds__(kWsThreads, 1)
    FusedGemmWsKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                      const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                      const T* __restrict__ bias, T* __restrict__ y, int m, int n, int k,
                      int vec_store, const __grid_constant__ CUtensorMap act_map) {
#if JAX_FP4_FUSED_SM90A
  WaitForPrerequisiteGrids();  // JAX_FP4_PDL: see FusedOverrides::programmatic
  AllowDependentLaunch();
  using Loader = StageLoader<T, Cfg, Tiled, kProducerThreads, /*kActTma=*/true>;
  using Decoder = StageDecoder<T, Cfg, Tiled, /*kPlainRows=*/Loader::kWeightBulk>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * Cfg::kStages];
  uint8_t* smem;
  const SmemMap<Cfg> map(AlignedSmemBase(smem, smem_raw));
  PipelineRing<Cfg::kStages> ring(bars);
  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * Cfg::kBM, n0 = blockIdx.x * Cfg::kTileN;
  const int2 range = StageRange(k);
  const int kc0 = range.x, nst = range.y;
  if (tid == 0) ring.Init(Loader::kFullArrivals);
  __syncthreads();

  if (tid < kProducerThreads) {
    SetMaxRegisters<kProducerRegisters, false>();
    if (tid < Loader::kCopyThreads) {
      Loader load(tid, a, packed, scale, m, n, k, m0, n0, map);
      load.UseActivationTma(&act_map, m0);
      for (int c = 0; c < nst; ++c) ring.Copy(load, kc0 + c, tid);
    }
    CpAsyncCommit();
    CpAsyncWait<0>();  // nothing in flight when this warpgroup exits
    return;            // exited threads are not waited for by the cluster barriers below
  }

  SetMaxRegisters<kConsumerRegisters, true>();
  const int ctid = tid - kProducerThreads;
  const Decoder decode(ctid);
  float acc[Decoder::TJ][Decoder::kAcc];
  uint32_t afrag[2][4][4] = {};
  ring.Consume(decode, acc, afrag, map, nst, ctid & 31);
  NamedBarrierSync(1, kConsumerThreads);  // both consumer warpgroups done with the pipeline smem
  StoreTile(decode, acc, reinterpret_cast<float*>(smem), ctid, m0, n0, m, n, global_scale, bias,
            y, vec_store);
#endif  // JAX_FP4_FUSED_SM90A
}

// Stream-K (StreamKPlan): the warp-specialized pipeline over a run of tile segments, one CTA per
// SM (grid = plan.ctas), no cluster; partial tiles reduced through the workspace.
template <typename T, typename Cfg, bool Tiled = false>
__global__ void __launch_bounds__(kWsThreads, 1)
    FusedGemmStreamKKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                           const uint8_t* __restrict__ scale,
                           const float* __restrict__ global_scale, const T* __restrict__ bias,
                           T* __restrict__ y, int m, int n, int k, int vec_store,
                           StreamKPlan plan, const __grid_constant__ CUtensorMap act_map) {
#if JAX_FP4_FUSED_SM90A
  WaitForPrerequisiteGrids();  // JAX_FP4_PDL: see FusedOverrides::programmatic
  AllowDependentLaunch();
  using Loader = StageLoader<T, Cfg, Tiled, kProducerThreads, /*kActTma=*/true>;
  using Decoder = StageDecoder<T, Cfg, Tiled, /*kPlainRows=*/Loader::kWeightBulk>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * Cfg::kStages];
  uint8_t* smem;
  const SmemMap<Cfg> map(AlignedSmemBase(smem, smem_raw));
  PipelineRing<Cfg::kStages> ring(bars);
  const int tid = threadIdx.x;
  const int64_t run_end = plan.Begin(blockIdx.x + 1);
  if (tid == 0) ring.Init(Loader::kFullArrivals);
  __syncthreads();
  // Walks the CTA's run: f(tile, first K stage, stages, m0, n0, whether the run's last) per
  // tile segment.
  auto for_each_segment = [&](auto&& f) {
    for (int64_t u = plan.Begin(blockIdx.x); u < run_end;) {
      const int tile = static_cast<int>(u / plan.ks);
      const int kc = static_cast<int>(u - static_cast<int64_t>(tile) * plan.ks);
      const int nst = static_cast<int>(min(run_end - u, static_cast<int64_t>(plan.ks - kc)));
      u += nst;
      f(tile, kc, nst, (tile / plan.tiles_n) * Cfg::kBM, (tile % plan.tiles_n) * Cfg::kTileN,
        u == run_end);
    }
  };

  if (tid < kProducerThreads) {
    SetMaxRegisters<kProducerRegisters, false>();
    if (tid < Loader::kCopyThreads) {
      for_each_segment([&](int, int kc, int nst, int m0, int n0, bool) {
        Loader load(tid, a, packed, scale, m, n, k, m0, n0, map);
        load.UseActivationTma(&act_map, m0);
        for (int c = 0; c < nst; ++c) ring.Copy(load, kc + c, tid);
      });
    }
    CpAsyncCommit();
    CpAsyncWait<0>();
    return;
  }

  SetMaxRegisters<kConsumerRegisters, true>();
  const int ctid = tid - kProducerThreads;
  const Decoder decode(ctid);
  float acc[Decoder::TJ][Decoder::kAcc];
  uint32_t afrag[2][4][4] = {};
  for_each_segment([&](int tile, int, int nst, int m0, int n0, bool run_ends) {
    ring.Consume(decode, acc, afrag, map, nst, ctid & 31);
    float* epi = run_ends ? reinterpret_cast<float*>(smem) : nullptr;
    StreamKStore(decode, acc, plan, tile, ctid, epi, m0, n0, m, n, global_scale, bias, y,
                 vec_store);
  });
#endif  // JAX_FP4_FUSED_SM90A
}

// ---- host side -------------------------------------------------------------------------------

// The kernel for CTA tile Cfg: warp-specialized (WS, BM >= 64) or multistage.
template <typename T, typename Cfg, bool Tiled, bool WS>
constexpr auto* FusedKernel() {
  if constexpr (WS) {
    static_assert(HasWarpSpecialized(Cfg::kBM), "BM <= 32 runs the multistage kernel only");
    return FusedGemmWsKernel<T, Cfg, Tiled>;
  } else {
    return FusedGemmKernel<T, Cfg, Tiled>;
  }
}
template <typename T, typename Cfg, bool Tiled, bool WS>
constexpr auto* kFusedKernel = FusedKernel<T, Cfg, Tiled, WS>();
template <bool WS>
constexpr int kFusedThreads = WS ? kWsThreads : kConsumerThreads;

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

StreamKShape PlanStreamK(int bm, int tn, int64_t m, int64_t n, int64_t k, int sms) {
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
// a tile. Fitted to the 256-row tile's measurements when the last contributor to arrive wrote and
// read back every partial (fourteenth session); with the owner reducing in registers and the
// run's last tile stored through shared memory (fifteenth session) the same rule picks the faster
// of stream-K and cluster split-K, or one within 1% of it, at all 24 points measured at the 128-
// and 256-row tiles (M = 80-1024, four shapes; spec layout, kernel-only), so it now serves both.
// NOTES_fused.md, "Fifteenth session".
constexpr bool StreamKByDefault(int bm) { return bm >= 128; }
int64_t StreamKCost2(const StreamKShape& p) {
  const int64_t run = CeilDiv(p.units, p.ctas);
  const int64_t contributors = CeilDiv(p.ks, std::max<int64_t>(p.units / p.ctas, 1)) + 1;
  return 2 * (run + kFillStages + 2) + 3 * contributors;
}

// Activation rows per CTA: the smallest tile that covers M (less padded tensor work; the tiles up
// to 32 rows also run two CTAs per SM); above 128 rows the 256-row tile, which decodes each weight
// fragment once for 256 rows (M = 256: 8-17% faster than two 128-row tiles; M = 128: 1.4-1.6x
// slower than one, NOTES_fused.md "Eighth session").
int DefaultTileM(int64_t m) {
  return m <= 16 ? 16 : (m <= 32 ? 32 : (m <= 64 ? 64 : (m <= 128 ? 128 : 256)));
}

// Which kernel serves a tile by default: the warp-specialized one from 64 rows (M = 128 - 1024:
// 3-12% faster than the multistage one, thirteenth session; M = 48 and 64, since its activation
// tile comes by TMA: 2-20% faster on all four prefill shapes, nineteenth session); the multistage
// one up to 32 rows (where a warp-specialized variant, one or two CTAs per SM, measured 0-10%
// slower: its two decoding warpgroups cannot hide the decode's latency, the multistage kernel's
// two CTAs' four can). NOTES_fused.md.
constexpr bool WarpSpecializedByDefault(int tile_m) { return HasWarpSpecialized(tile_m); }

// One call's operands (device pointers), shape and workspace.
struct FusedProblem {
  const void* a;
  const uint8_t* packed;
  const uint8_t* scale;
  const float* gs;
  const void* bias;  // or nullptr
  void* y;
  int64_t m, n, k;
  bool vec_store;  // y rows 8-byte aligned, N % 4 == 0
  float* workspace;
  int64_t workspace_elems;
};

// Tuning overrides, read on each call, for measurements (not for use); unset or empty = the
// heuristic's choice (*forced left as it is):
//   JAX_FP4_FUSED_SPLIT=<n>, n in 1..kMaxSplit: the split-K factor (clamped to the K stages);
//   JAX_FP4_FUSED_TILE_M=<bm>, bm in {16, 32, 64, 128, 256} (IsTileM): activation rows per CTA;
//   JAX_FP4_FUSED_TILE_N=128|256: weight rows per CTA (128 at 128-row activation tiles only, the
//   default elsewhere);
//   JAX_FP4_FUSED_WARP_SPECIALIZED=0|1: the multistage or the warp-specialized kernel for
//   BM >= 64 (BM <= 32 has the multistage one only: 1 is an error there);
//   JAX_FP4_FUSED_STREAM_K=0|1: cluster split-K or stream-K for the warp-specialized kernel
//   (stream-K needs M > 64: the workspace; JAX_FP4_FUSED_SPLIT implies cluster split-K).
// Anything else is an error (ReadOverride, common.cuh), not silently ignored.
// What they asked for; 0 / -1 = the heuristic's choice.
struct FusedOverrides {
  int split = 0;
  int stream_k = -1;
  // JAX_FP4_PDL=1: programmatic dependent launches (LaunchKernel, common.cuh); every kernel waits
  // for the previous one before its first memory access.
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
  const CUresult r = encode(
      out, std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                     : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      2, const_cast<void*>(a), dims, row_stride, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
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
                        const FusedOverrides& o) {
  constexpr int BM = Cfg::kBM;
  const int64_t tiles_n = CeilDiv(p.n, Cfg::kTileN);
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
    // Stream-K where its plan fits the workspace and (unless forced) its cost model wins.
    static_assert(2 * Cfg::kSmemBytes > kSmemPerSm, "stream-K plans one CTA per SM");
    const StreamKShape sk = PlanStreamK(BM, Cfg::kTileN, p.m, p.n, p.k, sms);
    const bool by_cost = StreamKByDefault(BM) && StreamKCost2(sk) < 2 * cluster_cost;
    if (o.split == 0 && o.stream_k != 0 && sk.Fits(p.workspace_elems) &&
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
                                static_cast<T*>(p.y), m, n, k, p.vec_store ? 1 : 0, act_map);
    } else {
      return cudaLaunchKernelEx(&config, kKernel, a, p.packed, p.scale, p.gs, bias,
                                static_cast<T*>(p.y), m, n, k, p.vec_store ? 1 : 0);
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

// The CTA tile and kernel of a call.
struct TileChoice {
  int m;    // activation rows (IsTileM)
  int n;    // weight rows: DefaultTileN(m), or 128 at m = 128
  bool ws;  // warp-specialized kernel (HasWarpSpecialized(m))
};

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
                                const FusedProblem& p, const FusedOverrides& o) {
  const auto launch =
      tile.m == 16    ? LaunchFor<T, Tiled, 16>(tile.ws)
      : tile.m == 32  ? LaunchFor<T, Tiled, 32>(tile.ws)
      : tile.m == 64  ? LaunchFor<T, Tiled, 64>(tile.ws)
      : tile.m == 128 ? (tile.n == 128 ? LaunchFor<T, Tiled, 128, 128>(tile.ws)
                                       : LaunchFor<T, Tiled, 128>(tile.ws))
                      : LaunchFor<T, Tiled, 256>(tile.ws);
  return launch(stream, device, sms, p, o);
}

template <typename T>
cudaError_t DispatchFused(cudaStream_t stream, bool tiled, int device, int sms, TileChoice tile,
                          const FusedProblem& p, const FusedOverrides& o) {
  const auto dispatch = tiled ? DispatchFusedLayout<T, true> : DispatchFusedLayout<T, false>;
  return dispatch(stream, device, sms, tile, p, o);
}

ffi::Error FusedCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                         ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::F32> global_scale,
                         ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t block_size,
                         bool tiled) {
  constexpr const char* kName = "jax_fp4_fused_cuda";
  MatmulShape shape;
  const std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      global_scale.element_count(), bias.element_type(), bias.element_count(), y->element_type(),
      y->dimensions(), block_size, /*allow_f32=*/false, &shape);
  auto invalid = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(kName) + ": " + what);
  };
  if (!problem.empty()) return invalid(problem);
  if (block_size != fused::kBlockSize) {
    return invalid("block_size must be 16, got " + std::to_string(block_size));
  }
  const int64_t m = shape.m, n = shape.n, k = shape.k;
  if (k <= 0 || k % fused::kKMultiple != 0) {
    return invalid("K must be a positive multiple of 128, got " + std::to_string(k));
  }
  if (m >= INT_MAX || n >= INT_MAX || k >= INT_MAX) return invalid("M, N and K must be < 2^31");
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return invalid(bad);
  }
  if (CeilDiv(m, fused::kTileMLarge) > fused::kMaxMTiles) return invalid("M too large");
  const int64_t ws_needed = fused::WorkspaceElems(m, n, k);
  const int64_t ws_elems = static_cast<int64_t>(workspace->element_count());
  if (ws_elems < ws_needed) {
    return invalid("workspace must hold " + std::to_string(ws_needed) + " f32 elements");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  // Prepacked scales come by bulk copy (16-byte aligned runs), spec-layout ones 8 bytes a row.
  if (!IsAligned(a.untyped_data(), 16) || !IsAligned(packed.typed_data(), 16) ||
      !IsAligned(scale.typed_data(), tiled ? 16 : 8)) {
    return invalid(std::string("a and packed must be 16-byte aligned, scale ") +
                   (tiled ? "16" : "8") + "-byte aligned");
  }

  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_fused_cuda: device query", err);
  if (info.sm != 90) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(kName) + ": needs an sm_90 (Hopper) device, found sm_" +
                          std::to_string(info.sm));
  }
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return CudaError("jax_fp4_fused_cuda: cudaGetDevice", err);

  FusedOverrides overrides;
  int forced_tile = 0;
  std::string bad_override = ReadOverride(
      "JAX_FP4_FUSED_SPLIT", [](long v) { return v >= 1 && v <= kMaxSplit; },
      "an integer in 1.." + std::to_string(kMaxSplit), &overrides.split);
  if (bad_override.empty()) {
    bad_override = ReadOverride(
        "JAX_FP4_FUSED_TILE_M", IsTileM, "one of 16, 32, 64, 128, 256", &forced_tile);
  }
  int forced_tile_n = 0;
  if (bad_override.empty()) {
    bad_override = ReadOverride(
        "JAX_FP4_FUSED_TILE_N", [](long v) { return v == 128 || v == 256; }, "128 or 256",
        &forced_tile_n);
  }
  int warp_specialized = -1;  // unset: WarpSpecializedByDefault
  if (bad_override.empty()) {
    bad_override = ReadOverride(
        "JAX_FP4_FUSED_WARP_SPECIALIZED", [](long v) { return v == 0 || v == 1; }, "0 or 1",
        &warp_specialized);
  }
  if (bad_override.empty()) {
    bad_override = ReadOverride(
        "JAX_FP4_FUSED_STREAM_K", [](long v) { return v == 0 || v == 1; }, "0 or 1",
        &overrides.stream_k);
  }
  if (bad_override.empty()) bad_override = ProgrammaticLaunchOverride(&overrides.programmatic);
  if (!bad_override.empty()) return invalid(bad_override);
  TileChoice tile;
  tile.m = forced_tile > 0 ? forced_tile : DefaultTileM(m);
  tile.n = forced_tile_n > 0 ? forced_tile_n : DefaultTileN(tile.m);
  tile.ws = warp_specialized < 0 ? WarpSpecializedByDefault(tile.m) : warp_specialized == 1;
  if (tile.n != DefaultTileN(tile.m) && tile.m != 128) {
    return invalid("JAX_FP4_FUSED_TILE_N=" + std::to_string(tile.n) + " needs 128-row activation "
                   "tiles (this call's are " + std::to_string(tile.m) + " rows)");
  }
  if (tile.ws && !HasWarpSpecialized(tile.m)) {
    return invalid("JAX_FP4_FUSED_WARP_SPECIALIZED=1 needs 64-row or larger activation tiles (this "
                   "call's are " + std::to_string(tile.m) + " rows)");
  }
  if (CeilDiv(m, tile.m) > fused::kMaxMTiles) {
    return invalid("M too large for " + std::to_string(tile.m) + "-row tiles");
  }
  if (overrides.stream_k == 1) {
    const StreamKShape sk = PlanStreamK(tile.m, tile.n, m, n, k, info.num_sms);
    if (!tile.ws || overrides.split > 0 || !sk.Fits(ws_elems)) {
      return invalid("JAX_FP4_FUSED_STREAM_K=1 needs the warp-specialized kernel, no "
                     "JAX_FP4_FUSED_SPLIT and M > 64 (the workspace)");
    }
  }

  FusedProblem operands;
  operands.a = a.untyped_data();
  operands.packed = packed.typed_data();
  operands.scale = scale.typed_data();
  operands.gs = global_scale.typed_data();
  operands.bias = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  operands.y = y->untyped_data();
  operands.m = m;
  operands.n = n;
  operands.k = k;
  operands.vec_store = n % 4 == 0 && IsAligned(y->untyped_data(), 8);
  operands.workspace = workspace->typed_data();
  operands.workspace_elems = ws_elems;
  const auto dispatch =
      a.element_type() == ffi::DataType::F16 ? DispatchFused<__half> : DispatchFused<__nv_bfloat16>;
  err = dispatch(stream, tiled, device, info.num_sms, tile, operands, overrides);
  if (err != cudaSuccess) return CudaError("jax_fp4_fused_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4FusedCuda, jax_fp4::cuda::fused_detail::FusedCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // a [M, K] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scale [N, K/16] raw E4M3
                                  .Arg<ffi::Buffer<ffi::F32>>()   // global scale, one element
                                  .Arg<ffi::AnyBuffer>()          // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace (WorkspaceElems)
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled"),   // weight in the tiled layout
                              {ffi::Traits::kCmdBufferCompatible});
