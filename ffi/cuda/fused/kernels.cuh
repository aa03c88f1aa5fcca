// Fused NVFP4 x FP16/BF16 GEMM for sm_90a (M > 8): the packed weight streams from HBM into shared
// memory (cp.async, multi-stage), is decoded in registers straight into the wgmma A-operand
// fragment with the E4M3 block scale folded in (exact), and feeds wgmma.mma_async (A = weight
// from registers, B = activations from 128B-swizzled shared memory), fp32 accumulation; global
// scale, bias and the epilogue fusions (silu_mul, residual: EpilogueFusion) in the epilogue.
// Split-K across the CTAs of a thread-block cluster, reduced on chip through distributed shared
// memory in a fixed order (deterministic, no workspace).
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
// a_frag[m, k_log] = a[m, p(k_log)] per 64-k block (jax_fp4/fused.py: to_fragment_order), which
// XLA fuses into whatever produced the activation. Each lane reads one 8-byte word pair per row
// (no byte gather) and one scale byte per row, and one packed multiply folds the scale exactly:
// e2m1 * 2^-14 (fp16) / 2^-126 (bf16) times the scale pair = e2m1 * e4m3 * 2^-7; the epilogue
// multiplies by 2^7 gs.
//
// Tiled weights (template flag Tiled; the layout of jax_fp4.prepack, jax_fp4/layout.py): the
// same stage contents gathered from other addresses (a row's 16-byte quarter q of window c sits
// in its 16-row tile's 1 KB run of that window; a tile's 128 scale bytes of the window are copied
// whole and read at their tiled offsets), and each word decoded in adjacent pairs
// (decode_tiled_pair) instead of split pairs: the pair at logical (k_log, k_log + 1) then holds
// physical (p, p + 1) with p = 16 t + 8 sb + 4 j0 + 2 j1 + o (to_fragment_order(tiled=True)).
//
// One wgmma commit group = one (sub-chunk of 64 k, m64 tile): decode group q into registers
// A[q & 1] while the previous group runs, with the next group's shared-memory loads already
// issued; wgmma.wait_group 1 after each commit retires the group that last read A[(q & 1) ^ 1].
#ifndef JAX_FP4_CUDA_FUSED_KERNELS_CUH_
#define JAX_FP4_CUDA_FUSED_KERNELS_CUH_

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/fused/config.cuh"
#include "cuda/fused/epilogue.cuh"
#include "cuda/fused/mainloop.cuh"
#include "cuda/fused/scheduler.cuh"
#include "cuda/ptx.cuh"

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

// ---- the kernels -----------------------------------------------------------------------------

// Multistage: all 256 threads copy (cp.async, S - 2 stages ahead) and all decode and multiply;
// one CTA-wide barrier per stage. The default up to BM = 32 (WarpSpecializedByDefault).
template <typename T, typename Cfg, bool Tiled = false>
__global__ void __launch_bounds__(kConsumerThreads, Cfg::kMinBlocks)
    FusedGemmKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                    const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                    const T* __restrict__ bias, T* __restrict__ y, int m, int n, int k,
                    int vec_store, const EpilogueFusion<T> fusion) {
#if JAX_FP4_SM90A
  WaitForPrerequisiteGrids();  // attribute programmatic: see FusedTuning::programmatic
  AllowDependentLaunch();
  constexpr int BM = Cfg::kBM;
  using Decoder = StageDecoder<T, Cfg, Tiled>;
  constexpr int S = Cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem;
  const SmemMap<Cfg> map(AlignedSmemBase(smem, smem_raw));
  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * BM;
  const CtaColumns cols = ColumnsOf<Cfg>(blockIdx.x, n, fusion);
  const int2 range = StageRange(k);
  const int kc0 = range.x, nst = range.y;
  const StageLoader<T, Cfg, Tiled, kConsumerThreads> load(tid, a, packed, scale, m, n, k, m0,
                                                          cols.n0, cols.up_shift, map);
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
  StoreTile(decode, acc, reinterpret_cast<float*>(smem), tid, m0, cols.n0, m, cols.n_out,
            global_scale, bias, y, vec_store, fusion);
#endif  // JAX_FP4_SM90A
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
                      int vec_store, const __grid_constant__ CUtensorMap act_map,
                      const EpilogueFusion<T> fusion) {
#if JAX_FP4_SM90A
  WaitForPrerequisiteGrids();  // attribute programmatic: see FusedTuning::programmatic
  AllowDependentLaunch();
  using Loader = StageLoader<T, Cfg, Tiled, kProducerThreads, /*kActTma=*/true>;
  using Decoder = StageDecoder<T, Cfg, Tiled, /*kPlainRows=*/Loader::kWeightBulk>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * Cfg::kStages];
  uint8_t* smem;
  const SmemMap<Cfg> map(AlignedSmemBase(smem, smem_raw));
  PipelineRing<Cfg::kStages> ring(bars);
  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * Cfg::kBM;
  const CtaColumns cols = ColumnsOf<Cfg>(blockIdx.x, n, fusion);
  const int2 range = StageRange(k);
  const int kc0 = range.x, nst = range.y;
  if (tid == 0) ring.Init(Loader::kFullArrivals);
  __syncthreads();

  if (tid < kProducerThreads) {
    SetMaxRegisters<kProducerRegisters, false>();
    if (tid < Loader::kCopyThreads) {
      Loader load(tid, a, packed, scale, m, n, k, m0, cols.n0, cols.up_shift, map);
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
  StoreTile(decode, acc, reinterpret_cast<float*>(smem), ctid, m0, cols.n0, m, cols.n_out,
            global_scale, bias, y, vec_store, fusion);
#endif  // JAX_FP4_SM90A
}

// Stream-K (StreamKPlan): the warp-specialized pipeline over a run of tile segments, one CTA per
// SM (grid = plan.ctas), no cluster; partial tiles reduced through the workspace.
template <typename T, typename Cfg, bool Tiled = false>
__global__ void __launch_bounds__(kWsThreads, 1)
    FusedGemmStreamKKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                           const uint8_t* __restrict__ scale,
                           const float* __restrict__ global_scale, const T* __restrict__ bias,
                           T* __restrict__ y, int m, int n, int k, int vec_store, StreamKPlan plan,
                           const __grid_constant__ CUtensorMap act_map) {
#if JAX_FP4_SM90A
  WaitForPrerequisiteGrids();  // attribute programmatic: see FusedTuning::programmatic
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
        Loader load(tid, a, packed, scale, m, n, k, m0, n0, /*up_shift=*/0, map);
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
#endif  // JAX_FP4_SM90A
}

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

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_FUSED_KERNELS_CUH_
