// Which limit holds the decode GEMV back? (docs/design.md discusses the readings; numbers in
// benchmarks/RESULTS.md.)
//
// Times, kernel-only with CUDA events, the production tensor-core GEMV at M = 1 (bf16) against
// variants that each take one suspect away:
//   stream           the same bytes read contiguously, 16 B per thread (the achievable read)
//   loads            the GEMV's own loads in its own address pattern and order, no math
//   loads_occ4/5     the same loads held to 4 / 5 resident blocks per SM (the GEMV's occupancy)
//                    by shared memory they do not use; that also shrinks the L1 carve-out that
//                    caches the activations, so these rows mix both effects
//   loads_prepacked  the same loads, addressed as if each warp's window were 1 KB contiguous
//                    (a load-time "prepack" layout), no math
//   loads_bulk       sm_90: the tile's rows fetched by TMA bulk copies (cp.async.bulk, 512 B per
//                    row and stage, 4 stages of 9 KB in flight per block, mbarrier completion)
//                    into shared memory and read once from there, no math. Bulk copies do not
//                    go through the L1 miss path that ld.global and cp.async share.
//   no_decode        the full GEMV (one chain) with the E2M1 decode replaced by the raw word
//   gemv_adjacent    the previous production kernel: two accumulator chains and the previous
//                    decode (adjacent-element pairs: PRMT, shift and two masks per pair) instead
//                    of split pairs (decode_e2m1_split_pair)
//   gemv             the production one-tile kernel, GemvMmaKernel<bf16, 1, 1> (one accumulator
//                    chain), at the heuristic's k_split, with the 256-byte L2 prefetch it gets
//                    at k_split > 1 (gemv_no_l2: without)
//   gemv_2tiles      GemvMmaKernel<bf16, 2, 1> (two column tiles per warp share the activations):
//                    what the heuristic launches at M = 1 when the column grid allows it
//   gemv_prepacked_decode  the tiled layout's decode (DecodeTiled: 8 instead of 13 ALU
//                    instructions per word, no activation permutes) on the spec addressing
//   gemv_tiled       the split-pair decode on the tiled layout's addressing (loads_prepacked:
//                    one 1 KB weight run and one 128 B scale run per warp and window);
//                    gemv_tiled_prepacked_decode is the kernel jax_fp4.prepack's weights run
//                    (DecodeTiled on the tiled addressing)
//   gemv_c2/c4       the same with 2 / 4 accumulator chains (the 8 dependent HMMA of a window
//                    split 2 / 4 ways); these and the rows above gemv run without the L2 prefetch
// Reading, in times ("a >> b": a takes much longer than b):
//   gemv ~ no_decode >> loads  -> the mma loop itself (instructions, dependency latency)
//   gemv >> no_decode          -> the decode
//   loads_occ5 ~ gemv >> loads -> bytes in flight, or the smaller L1 (the hold shrinks both;
//                                 more warps do not speed up the GEMV: docs/design.md)
//   loads ~ gemv >> loads_bulk -> the loads' path (L1 miss tracking): a TMA-fed kernel pays
//   loads >> loads_prepacked   -> the access pattern: a prepacked layout pays
//
// Weights rotate through copies totalling > 4x the L2, so every call reads HBM. Values are
// arbitrary (timing only). Built by CMake next to the CUDA module with -DJAX_FP4_BUILD_PROBES=ON
// (build/<wheel tag>/gemv_probe);
// built with the CMake option JAX_FP4_BUILD_PROBES=ON.
// Usage: gemv_probe [NxK ...]   (default: 11008x4096 4096x11008 28672x8192)
// GEMV_PROBE_KSPLITS=3,6,... adds rows gemv_k<s> and gemv_c2_k<s>: the kernel with 1 / 2
// accumulator chains at k_split s instead of the heuristic's.
// GEMV_PROBE_COPIES=c: rotate through c copies of the weights instead (1: L2-resident weights).
// GEMV_PROBE_SWEEP_M=1,2,4,8,16: the launch-config sweep of the prepacked kernel instead
// (SweepConfigs). GEMV_PROBE_ROWS=name,name,... times only those rows (stream always runs: the
// reference), e.g. to profile one kernel under Nsight Compute.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/gemv/launch.cuh"
#include "cuda/ptx.cuh"

namespace jax_fp4 {
namespace cuda {
namespace {

using T = __nv_bfloat16;

// GemvMmaKernel with the probe's knobs: any Decode policy (the production kernel's follows its
// layout) and Chains accumulator chains (production: 1), under the production launch bounds.
template <typename U, int CT, int RT = 1, typename Decode = DecodeE2M1, int Chains = 1,
          int L2PrefetchBytes = 0, bool Tiled = false>
__global__ void __launch_bounds__(32 * GemvMmaShape{CT, RT, Tiled}.max_split(),
                                  GemvMmaShape{CT, RT, Tiled}.min_blocks_per_sm())
    ProbeGemvKernel(const U* __restrict__ a, const uint8_t* __restrict__ packed,
                    const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                    const U* __restrict__ bias, U* __restrict__ y, int64_t m, int64_t n,
                    int64_t k) {
  GemvMmaMainloop<U, CT, RT, Decode, Chains, L2PrefetchBytes, Tiled>(a, packed, scale, global_scale,
                                                                     bias, y, m, n, k);
}

// Keeps the loaded words alive without storing them: the condition is never true in practice.
__device__ __forceinline__ void Sink(uint32_t fold, uint32_t* sink) {
  if (fold == 0x9E3779B9u) *sink = fold;
}

__device__ __forceinline__ uint32_t Fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// Both buffers (weights, then scales) in one grid-stride pass, 16 bytes per thread per step.
__global__ void StreamKernel(const uint8_t* __restrict__ first, int64_t first_bytes,
                             const uint8_t* __restrict__ second, int64_t second_bytes,
                             uint32_t* sink) {
  uint32_t fold = 0;
  const int64_t first_vectors = first_bytes / 16, vectors = first_vectors + second_bytes / 16;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    fold ^=
        Fold(ld_stream_u4(i < first_vectors ? first + 16 * i : second + 16 * (i - first_vectors)));
  }
  Sink(fold, sink);
}

// The GEMV's loads (the same instructions as MmaLoad, double-buffered, the same windows per
// warp) with no math. Prepacked: each warp's window is one 1 KB run of weight bytes
// ([tile][window][h][lane][16 B]) and one 128 B run of scales ([tile][window][row][8 B]).
template <bool Prepacked>
__global__ void __launch_bounds__(512)
    LoadsKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                const uint8_t* __restrict__ scale, uint32_t* sink, int64_t n, int64_t k) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int k_split = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t windows = k / kGemvWindow;
  const int64_t tile = blockIdx.x;
  const auto load = [&](MmaFragments<1, 1>& f, int64_t w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = kGemvTileCols * tile + g + 8 * h;  // n % 16 == 0 (main checks)
      const uint8_t* wp = Prepacked ? packed + ((tile * windows + w) * 2 + h) * 512 + 16 * lane
                                    : packed + row * (k / 2) + w * (kGemvWindow / 2) + 16 * t;
      const uint8_t* sp = Prepacked ? scale + (tile * windows + w) * 128 + (g + 8 * h) * 8 + 2 * t
                                    : scale + row * (k / 16) + w * (kGemvWindow / 16) + 2 * t;
      f.w[0][h] = ld_stream_u4(wp);
      f.s[0][h] = LoadScalePair(sp);
    }
    LoadActivation(f.a[0], a + w * kGemvWindow + 32 * t);  // M = 1: every lane reads row 0
  };
  const auto fold = [](const MmaFragments<1, 1>& f) {
    return Fold(f.w[0][0]) ^ Fold(f.w[0][1]) ^ f.s[0][0] ^ f.s[0][1] ^ Fold(f.a[0][0]) ^
           Fold(f.a[0][1]) ^ Fold(f.a[0][2]) ^ Fold(f.a[0][3]);
  };
  MmaFragments<1, 1> f0, f1;
  uint32_t folded = 0;
  int64_t w = warp;
  if (w < windows) load(f0, w);
  while (w < windows) {
    if (w + k_split < windows) load(f1, w + k_split);
    folded ^= fold(f0);
    w += k_split;
    if (w >= windows) break;
    if (w + k_split < windows) load(f0, w + k_split);
    folded ^= fold(f1);
    w += k_split;
  }
  Sink(folded, sink);
}

// ---- TMA bulk-copy loads (sm_90) -------------------------------------------------------------
constexpr int kBulkRowBytes = 512;  // packed bytes of one weight row per stage (1024 K elements)
constexpr int kBulkDepth = 4;       // stages in flight per block
constexpr int kBulkStageBytes = kGemvTileCols * (kBulkRowBytes + kBulkRowBytes / 8);

// One warp per 16-row tile; lane 0 issues the copies, every lane reads its share of each stage.
__global__ void __launch_bounds__(32)
    BulkLoadsKernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scale,
                    uint32_t* sink, int64_t n, int64_t k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t stages_smem[];  // [kBulkDepth][kBulkStageBytes]
  __shared__ __align__(8) uint64_t bars[kBulkDepth];
  const int lane = threadIdx.x;
  const int64_t row_bytes = k / 2, scale_row_bytes = k / 16;
  const int64_t stages = row_bytes / kBulkRowBytes;  // main checks K % 1024 == 0
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kGemvTileCols;
  const uint32_t smem0 = SmemAddr(stages_smem);
  if (lane == 0) {
    for (int d = 0; d < kBulkDepth; ++d) MbarInit(SmemAddr(&bars[d]), 1);
    FenceMbarInit();
  }
  __syncwarp();
  const auto issue = [&](int64_t st) {
    const int d = static_cast<int>(st % kBulkDepth);
    const uint32_t bar = SmemAddr(&bars[d]);
    const uint32_t dst = smem0 + d * kBulkStageBytes;
    MbarExpectTx(bar, kBulkStageBytes);
    for (int r = 0; r < kGemvTileCols; ++r) {
      BulkCopy(dst + r * kBulkRowBytes, packed + (row0 + r) * row_bytes + st * kBulkRowBytes,
               kBulkRowBytes, bar);
      BulkCopy(dst + kGemvTileCols * kBulkRowBytes + r * (kBulkRowBytes / 8),
               scale + (row0 + r) * scale_row_bytes + st * (kBulkRowBytes / 8), kBulkRowBytes / 8,
               bar);
    }
  };
  if (lane == 0) {
    for (int64_t st = 0; st < kBulkDepth && st < stages; ++st) issue(st);
  }
  uint32_t folded = 0;
  for (int64_t st = 0; st < stages; ++st) {
    const int d = static_cast<int>(st % kBulkDepth);
    MbarWait(SmemAddr(&bars[d]), static_cast<uint32_t>((st / kBulkDepth) & 1));
    for (int i = lane; i < kBulkStageBytes / 16; i += 32) {
      folded ^= Fold(LdShared128(smem0 + d * kBulkStageBytes + 16 * i));
    }
    __syncwarp();  // the stage is read before lane 0 refills it
    if (lane == 0 && st + kBulkDepth < stages) issue(st + kBulkDepth);
  }
  Sink(folded, sink);
#else
  __trap();  // launched on sm_90+ only
#endif
}

// The decode replaced by the raw packed word (same data dependence, no decode instructions).
struct DecodeNone {
  template <typename U, int S>
  __device__ __forceinline__ static void Weights(uint32_t q, uint32_t& first, uint32_t& second) {
    first = q;
    second = q ^ 1u;
  }
  template <int S>
  __device__ __forceinline__ static void Activations(const uint4& x, uint32_t& b0, uint32_t& b1) {
    b0 = S % 2 ? x.y : x.x;
    b1 = S % 2 ? x.w : x.z;
  }
};

// The decode before the split pairs: adjacent elements (2i, 2i + 1) per pair, byte i of the word
// spread by a PRMT, then a shift and two masks (4 ALU instructions per pair); activations in their
// natural pairs.
struct DecodeAdjacentPairs {
  template <typename U, int S>
  __device__ __forceinline__ static void Weights(uint32_t q, uint32_t& first, uint32_t& second) {
    const uint32_t q4 = q << 4;
    first = decode_e2m1_pair<U, (S % 2) * 2>(q, q4);
    second = decode_e2m1_pair<U, (S % 2) * 2 + 1>(q, q4);
  }
  template <int S>
  __device__ __forceinline__ static void Activations(const uint4& x, uint32_t& b0, uint32_t& b1) {
    b0 = S % 2 ? x.z : x.x;
    b1 = S % 2 ? x.w : x.y;
  }
};

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    const cudaError_t err_ = (expr);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                            \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

// Average microseconds per launch of `launch(copy)` over `rounds` passes through the copies.
template <typename Launch>
float TimeUs(Launch launch, int copies, int rounds) {
  for (int c = 0; c < copies; ++c) launch(c);  // warm-up
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventRecord(start));
  for (int r = 0; r < rounds; ++r) {
    for (int c = 0; c < copies; ++c) launch(c);
  }
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaEventSynchronize(stop));
  CHECK_CUDA(cudaGetLastError());
  float ms = 0.0f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return 1000.0f * ms / static_cast<float>(rounds * copies);
}

// Copies of an [N, K] weight (`weight_bytes`, packed + scales) to rotate through so that the
// copies together exceed the 60 MB L2 several times: every call reads HBM.
int RotatingCopies(int64_t weight_bytes) {
  return static_cast<int>(std::max<int64_t>(2, (240LL << 20) / weight_bytes + 1));
}

// The operands of one shape: `copies` copies of the weights (call c reads copy c: weights(c),
// scales(c)), `rows` activation and output rows. Values are arbitrary (timing only).
struct ProbeBuffers {
  int64_t packed_bytes, scale_bytes;  // one copy's
  uint8_t* packed = nullptr;
  uint8_t* scale = nullptr;
  T* a = nullptr;
  T* y = nullptr;
  float* gs = nullptr;
  uint32_t* sink = nullptr;

  ProbeBuffers(int64_t n, int64_t k, int copies, int rows)
      : packed_bytes(n * k / 2), scale_bytes(n * k / 16) {
    CHECK_CUDA(cudaMalloc(&packed, packed_bytes * copies));
    CHECK_CUDA(cudaMalloc(&scale, scale_bytes * copies));
    CHECK_CUDA(cudaMalloc(&a, sizeof(T) * k * rows));
    CHECK_CUDA(cudaMalloc(&y, sizeof(T) * n * rows));
    CHECK_CUDA(cudaMalloc(&gs, sizeof(float)));
    CHECK_CUDA(cudaMalloc(&sink, sizeof(uint32_t)));
    CHECK_CUDA(cudaMemset(packed, 0x35, packed_bytes * copies));
    CHECK_CUDA(cudaMemset(scale, 0x38, scale_bytes * copies));  // E4M3 1.0
    CHECK_CUDA(cudaMemset(a, 0x3C, sizeof(T) * k * rows));      // bf16 ~0.0115
    CHECK_CUDA(cudaMemset(gs, 0, sizeof(float)));
  }
  ~ProbeBuffers() {
    cudaFree(packed);
    cudaFree(scale);
    cudaFree(a);
    cudaFree(y);
    cudaFree(gs);
    cudaFree(sink);
  }
  ProbeBuffers(const ProbeBuffers&) = delete;
  ProbeBuffers& operator=(const ProbeBuffers&) = delete;

  const uint8_t* weights(int c) const { return packed + packed_bytes * c; }
  const uint8_t* scales(int c) const { return scale + scale_bytes * c; }
  // The reference: a plain streaming read of copy c's bytes.
  void LaunchStream(int c, int num_sms) const {
    StreamKernel<<<num_sms * 16, 256>>>(weights(c), packed_bytes, scales(c), scale_bytes, sink);
  }
};

void Probe(int64_t n, int64_t k, int num_sms, int major) {
  const int64_t bytes = n * k / 2 + n * k / 16;
  // GEMV_PROBE_COPIES=1: one copy, which stays in the 60 MB L2 for shapes of up to ~40 MB: the
  // kernels' time without HBM (compute and L2 latency only).
  const char* copies_env = std::getenv("GEMV_PROBE_COPIES");
  const int copies_override = copies_env != nullptr ? std::atoi(copies_env) : 0;
  const int copies = copies_override > 0 ? copies_override : RotatingCopies(bytes);
  const ProbeBuffers buffers(n, k, copies, 1);
  T* const a = buffers.a;
  T* const y = buffers.y;
  float* const gs = buffers.gs;
  uint32_t* const sink = buffers.sink;

  GemvResidentWarps warps{};
  CHECK_CUDA((GetGemvResidentWarps<T, false>(&warps)));
  const GemvLaunchConfig cfg = gemv_launch_config(1, n, k, num_sms, /*tiled=*/false, warps);
  const int k_split = cfg.k_split;
  const dim3 grid(static_cast<unsigned>(CeilDiv(n, kGemvTileCols)));
  const dim3 block(32 * k_split);
  const int rounds = 20;

  struct Row {
    std::string name;
    float us;
    int blocks_per_sm;  // resident blocks per SM of the row's kernel (0: not queried)
  };
  std::vector<Row> rows;
  const char* only = std::getenv("GEMV_PROBE_ROWS");
  const auto wanted = [&](const std::string& name) {
    return only == nullptr ||
           ("," + std::string(only) + ",").find("," + name + ",") != std::string::npos;
  };
  // Blocks of `kernel` that fit one SM with `threads` threads and `smem` bytes of shared memory.
  const auto resident = [](auto kernel, int threads, size_t smem) {
    int blocks = 0;
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
    return blocks;
  };
  const auto add = [&](const std::string& name, const auto& launch, int blocks_per_sm = 0) {
    if (wanted(name)) rows.push_back({name, TimeUs(launch, copies, rounds), blocks_per_sm});
  };
  rows.push_back(
      {"stream", TimeUs([&](int c) { buffers.LaunchStream(c, num_sms); }, copies, rounds), 0});
  add(
      "loads",
      [&](int c) {
        LoadsKernel<false><<<grid, block>>>(a, buffers.weights(c), buffers.scales(c), sink, n, k);
      },
      resident(LoadsKernel<false>, block.x, 0));
  // The same loads held to `blocks` resident blocks per SM (the GEMV's occupancy: 5 for one tile
  // at 96 registers, 4 for two at 128) by a shared-memory allocation they do not use: are the
  // loads alone still at the stream's speed with as few warps as the GEMV has?
  int device = 0, smem_per_sm = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(
      cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  CHECK_CUDA(cudaFuncSetAttribute(LoadsKernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  smem_per_sm - 1024));
  for (int blocks : {4, 5}) {
    // 1 KB reserved per block; allocations come in 128-byte units.
    const size_t hold = static_cast<size_t>((smem_per_sm / blocks - 1024) & ~127);
    add(
        "loads_occ" + std::to_string(blocks),
        [&](int c) {
          LoadsKernel<false>
              <<<grid, block, hold>>>(a, buffers.weights(c), buffers.scales(c), sink, n, k);
        },
        resident(LoadsKernel<false>, block.x, hold));
  }
  add(
      "loads_prepacked",
      [&](int c) {
        LoadsKernel<true><<<grid, block>>>(a, buffers.weights(c), buffers.scales(c), sink, n, k);
      },
      resident(LoadsKernel<true>, block.x, 0));
  if (major >= 9 && k % (2 * kBulkRowBytes) == 0) {
    const auto launch = [&](int c) {
      BulkLoadsKernel<<<grid, 32, kBulkDepth * kBulkStageBytes>>>(buffers.weights(c),
                                                                  buffers.scales(c), sink, n, k);
    };
    add("loads_bulk", launch);
  }
  // A ProbeGemvKernel instance (M = 1) with col_tiles tiles per warp and `split` warps per block.
  const auto add_gemv = [&](const std::string& name, auto kernel, int col_tiles, int split) {
    const dim3 kernel_grid(static_cast<unsigned>(CeilDiv(n, col_tiles * kGemvTileCols)));
    const size_t smem = GemvMmaSmemBytes(col_tiles, split);
    add(
        name,
        [&](int c) {
          kernel<<<kernel_grid, 32 * split, smem>>>(a, buffers.weights(c), buffers.scales(c), gs,
                                                    nullptr, y, 1, n, k);
        },
        resident(kernel, 32 * split, smem));
  };
  add_gemv("no_decode", ProbeGemvKernel<T, 1, 1, DecodeNone>, 1, k_split);
  add_gemv("gemv_adjacent", ProbeGemvKernel<T, 1, 1, DecodeAdjacentPairs, 2>, 1, k_split);
  // As launched (k_split > 1: 256-byte L2 prefetch of the weights), and without the prefetch.
  add_gemv("gemv", ProbeGemvKernel<T, 1, 1, DecodeE2M1, 1, 256>, 1, k_split);
  add_gemv("gemv_no_l2", ProbeGemvKernel<T, 1>, 1, k_split);
  if (cfg.col_tiles == 2) {  // the heuristic's pick at M = 1 where the column grid allows
    add_gemv("gemv_2tiles", ProbeGemvKernel<T, 2, 1, DecodeE2M1, 1, 256>, 2, k_split);
  }
  add_gemv("gemv_prepacked_decode", ProbeGemvKernel<T, 1, 1, DecodeTiled, 1, 256>, 1, k_split);
  if (cfg.col_tiles == 2) {
    add_gemv("gemv_2tiles_prepacked_decode", ProbeGemvKernel<T, 2, 1, DecodeTiled, 1, 256>, 2,
             k_split);
  }
  // The tiled layout's addressing in the full kernel, with the split-pair decode (timing only:
  // those values are not decoded correctly) and with its own decode (the production kernel on
  // prepacked weights).
  add_gemv("gemv_tiled", ProbeGemvKernel<T, 1, 1, DecodeE2M1, 1, 256, true>, 1, k_split);
  add_gemv("gemv_tiled_prepacked_decode", ProbeGemvKernel<T, 1, 1, DecodeTiled, 1, 256, true>, 1,
           k_split);
  if (cfg.col_tiles == 2) {
    add_gemv("gemv_2tiles_tiled_prepacked_decode",
             ProbeGemvKernel<T, 2, 1, DecodeTiled, 1, 256, true>, 2, k_split);
  }
  add_gemv("gemv_c2", ProbeGemvKernel<T, 1, 1, DecodeE2M1, 2>, 1, k_split);
  add_gemv("gemv_c4", ProbeGemvKernel<T, 1, 1, DecodeE2M1, 4>, 1, k_split);
  if (const char* splits = std::getenv("GEMV_PROBE_KSPLITS")) {
    for (const char* p = splits; *p != '\0';) {
      const int s = std::atoi(p);
      if (s >= 1 && s <= kGemvMaxWarpsPerBlock) {
        add_gemv("gemv_k" + std::to_string(s), ProbeGemvKernel<T, 1>, 1, s);
        add_gemv("gemv_c2_k" + std::to_string(s), ProbeGemvKernel<T, 1, 1, DecodeE2M1, 2>, 1, s);
      }
      while (*p != '\0' && *p != ',') ++p;
      if (*p == ',') ++p;
    }
  }
  for (const Row& r : rows) {
    std::printf(
        "%6lldx%-6lld k_split=%-2d %-19s %8.2f us %6.2f TB/s %5.0f%% of stream  %s\n",
        static_cast<long long>(n), static_cast<long long>(k), k_split, r.name.c_str(), r.us,
        bytes / (r.us * 1e-6) / 1e12, 100.0 * rows[0].us / r.us,
        r.blocks_per_sm > 0 ? (std::to_string(r.blocks_per_sm) + " blocks/SM").c_str() : "");
  }
}

// GEMV_PROBE_SWEEP_M=1,2,4,8,16: instead of the probe rows, the production kernel on prepacked
// weights (GemvMmaKernel<bf16, CT, RT, L2, true>, decoded by DecodeTiled: what jax_fp4.prepack's
// weights run) at each M and every launch config (col_tiles 1 and 2, with two row tiles at M > 8;
// k_split 1..16 within the warp budget, non-powers of two included), the
// heuristic's pick starred: the table gemv_launch_config rests on.
template <int CT, int RT>
float TimeTiledGemv(const ProbeBuffers& b, int64_t m, int64_t n, int64_t k, int k_split,
                    int copies) {
  return TimeUs(
      [&](int c) {
        LaunchMmaLayout<T, CT, RT, true>(nullptr, b.a, b.weights(c), b.scales(c), b.gs, nullptr,
                                         b.y, m, n, k, k_split);
      },
      copies, 20);
}

void SweepConfigs(int64_t n, int64_t k, int num_sms, const std::vector<int>& ms) {
  const int64_t bytes = n * k / 2 + n * k / 16;
  const int copies = RotatingCopies(bytes);
  const int max_m = *std::max_element(ms.begin(), ms.end());
  const ProbeBuffers b(n, k, copies, max_m);
  const float stream_us = TimeUs([&](int c) { b.LaunchStream(c, num_sms); }, copies, 20);
  std::printf("%6lldx%-6lld stream %8.2f us %6.2f TB/s\n", static_cast<long long>(n),
              static_cast<long long>(k), stream_us, bytes / (stream_us * 1e-6) / 1e12);
  GemvResidentWarps warps{};
  CHECK_CUDA((GetGemvResidentWarps<T, true>(&warps)));
  for (int m : ms) {
    const GemvLaunchConfig pick = gemv_launch_config(m, n, k, num_sms, /*tiled=*/true, warps);
    float best = 1e30f;
    std::string line;
    for (int ct : {1, 2}) {
      for (int ks : {1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16}) {
        if (ks > GemvMmaShape{ct, m > 8 ? 2 : 1, true}.max_split()) continue;
        const float us = m > 8     ? (ct == 1 ? TimeTiledGemv<1, 2>(b, m, n, k, ks, copies)
                                              : TimeTiledGemv<2, 2>(b, m, n, k, ks, copies))
                         : ct == 1 ? TimeTiledGemv<1, 1>(b, m, n, k, ks, copies)
                                   : TimeTiledGemv<2, 1>(b, m, n, k, ks, copies);
        const bool picked = ct == pick.col_tiles && ks == pick.k_split;
        best = std::min(best, us);
        char cell[48];
        std::snprintf(cell, sizeof(cell), " %d,%-2d %6.2f%s", ct, ks, us, picked ? "*" : " ");
        line += cell;
      }
    }
    std::printf("%6lldx%-6lld M=%d best %6.2f us (%3.0f%% of stream) |%s\n",
                static_cast<long long>(n), static_cast<long long>(k), m, best,
                100.0 * stream_us / best, line.c_str());
  }
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

int main(int argc, char** argv) {
  std::vector<std::string> shapes;
  for (int i = 1; i < argc; ++i) shapes.push_back(argv[i]);
  if (shapes.empty()) shapes = {"11008x4096", "4096x11008", "28672x8192"};
  int device = 0, sms = 0, major = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 8) {
    std::fprintf(stderr, "gemv_probe needs sm_80 or newer\n");
    return 1;
  }
  std::vector<int> sweep_ms;
  if (const char* env = std::getenv("GEMV_PROBE_SWEEP_M")) {
    for (const char* p = env; *p != '\0';) {
      const int m = std::atoi(p);
      if (m < 1 || m > 128) {  // 128: the GEMV's largest M in the dispatch
        std::fprintf(stderr, "GEMV_PROBE_SWEEP_M: want M values in 1..128, got '%s'\n", env);
        return 2;
      }
      sweep_ms.push_back(m);
      while (*p != '\0' && *p != ',') ++p;
      if (*p == ',') ++p;
    }
  }
  for (const std::string& s : shapes) {
    long long n = 0, k = 0;
    if (std::sscanf(s.c_str(), "%lldx%lld", &n, &k) != 2 || n <= 0 || k <= 0 ||
        n % jax_fp4::kGemvTileCols != 0 || k % jax_fp4::kGemvWindow != 0) {
      std::fprintf(stderr, "bad shape '%s': want NxK with N a multiple of %d, K of %d\n", s.c_str(),
                   jax_fp4::kGemvTileCols, jax_fp4::kGemvWindow);
      return 2;
    }
    if (!sweep_ms.empty()) {
      jax_fp4::cuda::SweepConfigs(n, k, sms, sweep_ms);
    } else {
      jax_fp4::cuda::Probe(n, k, sms, major);
    }
  }
  return 0;
}
