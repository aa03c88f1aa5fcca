// Fused GEMM main loop (ffi/cuda/fused/kernels.cuh describes the kernel): the shared-memory map
// of a CTA, the stage loader (cp.async, TMA and bulk copies into a pipeline slot), the stage
// decoder (E2M1 words to wgmma A fragments, then the wgmma groups of a stage), and the
// warp-specialized kernels' ring of pipeline slots (mbarriers). Device only.
#ifndef JAX_FP4_CUDA_FUSED_MAINLOOP_CUH_
#define JAX_FP4_CUDA_FUSED_MAINLOOP_CUH_

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/fused/config.cuh"
#include "cuda/ptx.cuh"
#include "jax_fp4/nvfp4.h"
#include "jax_fp4/nvfp4_cuda.cuh"

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

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
// i < a_valid lie in M (the rest are zero-filled), its packed rows in N are counted per half of
// the CTA tile (p_valid0 / p_valid1; the rest read row N - 1, never stored).
// The CTA tile's weight rows: [0, TN / 2) are rows n0 .., [TN / 2, TN) rows n0 + TN / 2 + up_shift
// ..: up_shift is 0, or with silu_mul (EpilogueFusion) N / 2 - TN / 2, which puts the up rows
// matching the first half's gate rows there.
template <typename T, typename Cfg, bool Tiled, int kLoaders, bool kActTma = false>
struct StageLoader {
  static constexpr int BM = Cfg::kBM;
  static constexpr int kActRows = kLoaders / 16;  // activation rows per pass
  static constexpr int kActPasses = BM / kActRows;
  static constexpr int kPkRows = kLoaders / 4;  // packed rows per pass
  static constexpr int kPkPasses = Cfg::kTileN / kPkRows;
  static constexpr int kHalfPasses = kPkPasses / 2;  // packed passes per half of the CTA tile
  static constexpr int kScPasses = (Cfg::kTileN + kLoaders - 1) / kLoaders;
  static_assert(kActRows % 8 == 0 && kPkRows % 16 == 0, "passes keep the swizzle phase and tiles");
  static_assert(BM % kActRows == 0 && Cfg::kTileN % (2 * kPkRows) == 0,
                "whole passes, each in one half of the CTA tile");
  // The warp-specialized producer's register budget (kProducerRegisters) holds the pass pointers
  // only if the compiler cannot hoist every pass's address out of the stage loop (it spilled).
  static constexpr bool kOpaquePasses = kLoaders == kProducerThreads;
  // The warp-specialized kernels on prepacked weights: a 16-row tile's bytes of one K stage are
  // one 1 KB packed run ([16 rows][64 B], nvfp4.h tiled_packed_offset) and one 128-byte scale run,
  // each brought by one bulk copy from lane `tile` of the copier's warp 0 (the packed rows then
  // land without the quarter swizzle: StageDecoder kPlainRows). No cp.async at all: the slot's
  // `full` barrier expects lane 0's expect_tx arrival only. BM = 256 only: there it measures up
  // to 5% faster; at BM = 128 (TN = 256) 17-30% slower, likely the lost swizzle (twice the
  // shared-memory wavefronts per packed load) weighing on a decode that feeds half as many
  // activation rows (docs/design.md).
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
  const T* a_any;             // a valid address for the zero-byte copies of rows past M
  const T* a_src0;
  int64_t a_step;
  int a_valid;
  uint32_t a_dst0;
  const uint8_t* p_src0;  // the thread's first row of each half of the CTA tile
  const uint8_t* p_src1;
  const uint8_t* p_last;
  int64_t p_step;
  int p_valid0, p_valid1;  // the thread's passes in N of each half
  uint32_t p_dst0;
  const uint8_t* s_src[kScPasses];
  int s_rows;  // scale rows this thread copies
  SmemMap<Cfg> map;

  __device__ StageLoader(int ltid, const T* a, const uint8_t* packed, const uint8_t* scale, int m,
                         int n, int k, int m0, int n0, int up_shift, SmemMap<Cfg> smem)
      : a_any(a), map(smem) {
    const int a_ch = ltid & 15, a_r0 = ltid >> 4;
    a_dst0 = (a_ch >> 3) * Cfg::kActSubBytes + a_r0 * 128 + (((a_ch & 7) ^ (a_r0 & 7)) << 4);
    a_valid = min(max((m - m0 - a_r0 + kActRows - 1) / kActRows, 0), kActPasses);
    a_src0 = a + static_cast<int64_t>(a_valid > 0 ? m0 + a_r0 : 0) * k + a_ch * 8;
    a_step = kActRows * static_cast<int64_t>(k);

    const int p_q = ltid & 3, p_r0 = ltid >> 2;
    p_dst0 = p_r0 * 64 + ((p_q ^ (((p_r0 >> 1) & 1) << 1)) << 4);
    const int half0 = n0, half1 = n0 + Cfg::kTileN / 2 + up_shift;  // each half's first row
    auto passes_in_n = [&](int first) {
      return min(max((n - first - p_r0 + kPkRows - 1) / kPkRows, 0), kHalfPasses);
    };
    p_valid0 = passes_in_n(half0);
    p_valid1 = passes_in_n(half1);
    const int64_t row_bytes = k / 2;
    const int64_t windows = k / kStageK;
    // Quarter p_q of a row's window 0: spec row-major; tiled in its tile's 1 KB run of the window
    // (nvfp4.h). kPkRows rows are whole 16-row tiles, kPkRows * row_bytes apart in both.
    auto packed_at = [&](int64_t row) {
      return packed +
             (Tiled ? tiled_packed_offset(row, 0, p_q, windows) : row * row_bytes + p_q * 16);
    };
    p_src0 = packed_at(min(half0 + p_r0, n - 1));
    p_src1 = packed_at(min(half1 + p_r0, n - 1));
    p_last = packed_at(n - 1);
    p_step = kPkRows * row_bytes;

    // Spec: the 8 scale bytes of the weight row of CTA row r. Tiled: bytes 8 (r % 16) .. of the
    // 128-byte run of its tile (stored in shared memory tile by tile, as in global memory; both
    // halves start on a tile, so the row's place in its tile is r % 16).
    s_rows = 0;
#pragma unroll
    for (int i = 0; i < kScPasses; ++i) {
      const int r = ltid + kLoaders * i;
      if (r < Cfg::kTileN) s_rows = i + 1;
      const int row = min(r < Cfg::kTileN / 2 ? half0 + r : half1 + r - Cfg::kTileN / 2, n - 1);
      s_src[i] = Tiled ? scale + static_cast<int64_t>(row / 16) * windows * 128 + (r % 16) * 8
                       : scale + static_cast<int64_t>(row) * (k / 16);
    }
    if constexpr (kWeightBulk) {
      // Lanes [0, kTiles / 2) bring the first half's 16-row tiles, the others the second's.
      // Prepacked: N % 16 == 0, so a tile is in N whole or not at all.
      const int half_tiles = kTiles / 2;
      const int tiles_in_n =
          min(max((n - half0) / 16, 0), half_tiles) + min(max((n - half1) / 16, 0), half_tiles);
      weight_bytes = static_cast<uint32_t>(tiles_in_n) * (kPackedRun + kScaleRun);
      const int first = ltid < half_tiles ? half0 + 16 * ltid : half1 + 16 * (ltid - half_tiles);
      if (ltid < kTiles && first < n) {
        const int64_t tile = first / 16;
        pk_run = packed + tile * windows * kPackedRun;
        sc_run = scale + tile * windows * kScaleRun;
      }
    }
  }

  // kActTma: the activation tile comes as two TMA boxes ([BM][64] each, 128-byte swizzle: the
  // layout the cp.async copies build) issued by thread 0, whose arrival on `full_bar` also
  // expects their bytes; one instruction per box instead of BM / 8 cp.async per thread, which
  // leaves the copier warpgroup issue-bound at the 256-row tile (docs/design.md). Rows past M
  // are zero-filled by the TMA unit.
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
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* p_src = (h == 0 ? p_src0 : p_src1) + c * kPkStage;
      const int valid = h == 0 ? p_valid0 : p_valid1;
#pragma unroll
      for (int i = 0; i < kHalfPasses; ++i, p_src += p_step) {
        if constexpr (kOpaquePasses) FencePtr(p_src);
        CpAsync16(pk_dst + (h * kHalfPasses + i) * kPkRows * 64,
                  i < valid ? p_src : p_last + c * kPkStage, 16u);
      }
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
      // Orders cp.async activation writes (generic proxy) before wgmma reads (async proxy). Here
      // the activations come by TMA, async-proxy already, so the fence is only a safeguard.
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

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_FUSED_MAINLOOP_CUH_
