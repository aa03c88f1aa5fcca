// CUDA decode GEMV: y[m, n] = round((sum_k a[m,k] * e2m1(code) * e4m3(scale[n, k/16])) * gs
//                                   + bias[n]),
// fp32 accumulation, NVFP4 weights decoded in registers (no dequantized copy of W). Two kernels:
//
// * GemvMmaKernel (sm_80+, K % 128 == 0): mma.sync m16n8k16 with the WEIGHT in the A slot
//   (16 output columns) and the activations in the B slot (8 rows of M; at M > 8 each decoded
//   weight fragment feeds two such row tiles unless row tiling is off). See the fragment table
//   above the kernel. The E4M3 block scale is folded into the decoded 16-bit weight before the
//   mma (exact), global scale and bias are applied in the epilogue. Device code in
//   cuda/gemv_mma.cuh (shared with benchmarks/probes/gemv_probe.cu). It reads the weight in the
//   spec layout, or (attribute tiled) in the tiled layout of jax_fp4.prepack (_layout.py).
// * GemvScalarKernel (any K % 32 == 0): a warp per output column, 32 K elements (one 16-byte load
//   of packed weight, two scale blocks) per lane per step, per-block fp32 partial sums, a warp
//   shuffle reduction, and row tiling (RowsPerBlock rows of M share each decoded weight).
//
// Both are deterministic (fixed work split and reduction order) and never touch memory outside
// their operands: ragged N is clamped on loads and masked on stores, rows past M are never read.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda/common.cuh"
#include "cuda/gemv_mma.cuh"
#include "cuda/handlers.h"
#include "jax_fp4/gemv_config.h"
#include "jax_fp4/nvfp4.h"
#include "jax_fp4/nvfp4_cuda.cuh"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

//------------------------------------------------------------------------------------------------
// Scalar kernel: a warp per output column, RowsPerBlock rows of M per warp.
template <typename T, int R>
__device__ __forceinline__ void ScalarRow(float& acc, const T* ap, const float (&wf)[32], float s0,
                                          float s1) {
  using Tr = HalfTraits<T>;
  uint4 av[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) av[i] = ld_u4(ap + 8 * i);
  float lo = 0.0f, hi = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t words[4] = {av[i].x, av[i].y, av[i].z, av[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = Tr::pair_to_float2(words[j]);
      const int e = 8 * i + 2 * j;  // element index within the lane's 32
      if (e < 16) {
        lo = fmaf(x.x, wf[e], lo);
        lo = fmaf(x.y, wf[e + 1], lo);
      } else {
        hi = fmaf(x.x, wf[e], hi);
        hi = fmaf(x.y, wf[e + 1], hi);
      }
    }
  }
  acc = fmaf(lo, s0, acc);
  acc = fmaf(hi, s1, acc);
}

template <typename T, int R>
__global__ void __launch_bounds__(32 * kGemvScalarColsPerBlock)
    GemvScalarKernel(const T* __restrict__ a, const uint8_t* __restrict__ packed,
                     const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                     const T* __restrict__ bias, T* __restrict__ y, int64_t m, int64_t n, int64_t k) {
  const int lane = threadIdx.x & 31;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kGemvScalarColsPerBlock + (threadIdx.x >> 5);
  if (col >= n) return;  // warp-uniform
  const int64_t chunks = k / 32;
  const uint8_t* wrow = packed + col * (k / 2);
  const uint8_t* srow = scale + col * (k / 16);
  const int64_t tiles = CeilDiv(m, R);

  for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const int64_t m0 = tile * R;
    const int rows = static_cast<int>(Min64(R, m - m0));
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;

    int64_t c = lane;
    uint4 q = make_uint4(0u, 0u, 0u, 0u);
    uint32_t sb = 0;
    if (c < chunks) {
      q = ld_stream_u4(wrow + 16 * c);
      sb = LoadScalePair(srow + 2 * c);
    }
    for (; c < chunks; c += 32) {
      uint4 qn = make_uint4(0u, 0u, 0u, 0u);
      uint32_t sbn = 0;
      if (c + 32 < chunks) {  // next chunk's weight in flight during this one's math
        qn = ld_stream_u4(wrow + 16 * (c + 32));
        sbn = LoadScalePair(srow + 2 * (c + 32));
      }
      // Block scales * 2^14 (the fp16 decode below is e2m1 * 2^-14); NaN bytes give NaN.
      const float s0 = e4m3_to_float_fast(sb & 0xFFu) * 16384.0f;
      const float s1 = e4m3_to_float_fast(sb >> 8) * 16384.0f;
      float wf[32];
      const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t q4 = qw[j] << 4;
        const float2 p0 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 0>(qw[j], q4));
        const float2 p1 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 1>(qw[j], q4));
        const float2 p2 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 2>(qw[j], q4));
        const float2 p3 = HalfTraits<__half>::pair_to_float2(decode_e2m1_pair<__half, 3>(qw[j], q4));
        wf[8 * j + 0] = p0.x; wf[8 * j + 1] = p0.y;
        wf[8 * j + 2] = p1.x; wf[8 * j + 3] = p1.y;
        wf[8 * j + 4] = p2.x; wf[8 * j + 5] = p2.y;
        wf[8 * j + 6] = p3.x; wf[8 * j + 7] = p3.y;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) ScalarRow<T, R>(acc[r], a + (m0 + r) * k + 32 * c, wf, s0, s1);
      }
      q = qn;
      sb = sbn;
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], off);
    }
    if (lane == 0) {
      const float gs = __ldg(global_scale);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) StoreOutput(y, bias, n, m0 + r, col, acc[r], gs);
      }
    }
  }
}

//------------------------------------------------------------------------------------------------
// Launchers.
template <typename T, int CT, int RT = 1>
cudaError_t LaunchMma(cudaStream_t stream, bool tiled, const T* a, const uint8_t* packed,
                      const uint8_t* scale, const float* gs, const T* bias, T* y, int64_t m,
                      int64_t n, int64_t k, int k_split, bool programmatic) {
  return tiled ? LaunchMmaLayout<T, CT, RT, true>(stream, a, packed, scale, gs, bias, y, m, n, k,
                                                  k_split, programmatic)
               : LaunchMmaLayout<T, CT, RT, false>(stream, a, packed, scale, gs, bias, y, m, n, k,
                                                   k_split, programmatic);
}

template <typename T, int R>
cudaError_t LaunchScalar(cudaStream_t stream, const T* a, const uint8_t* packed,
                         const uint8_t* scale, const float* gs, const T* bias, T* y, int64_t m,
                         int64_t n, int64_t k) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(n, kGemvScalarColsPerBlock)),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(m, R), kMaxGridY)));
  GemvScalarKernel<T, R><<<grid, 32 * kGemvScalarColsPerBlock, 0, stream>>>(a, packed, scale, gs,
                                                                             bias, y, m, n, k);
  return cudaGetLastError();
}

// Debug / tuning override: JAX_FP4_GEMV_CONFIG="col_tiles,k_split[,rows_per_block]" (read on each
// call; empty or unset = the heuristic): col_tiles 1 or 2, rows_per_block 1, 2 or 4; k_split >= 1,
// clamped into the block's warp budget (GemvMmaShape::max_split); row_tiles stays the heuristic's.
// Anything else is an error.
std::string ApplyConfigOverride(GemvLaunchConfig* cfg, bool tiled) {
  const char* env = std::getenv("JAX_FP4_GEMV_CONFIG");
  if (env == nullptr || *env == '\0') return "";
  int ct = 0, ks = 0, rows = 1, used = 0;
  const int got = std::sscanf(env, "%d,%d%n,%d%n", &ct, &ks, &used, &rows, &used);
  if (got < 2 || env[used] != '\0' || !(ct == 1 || ct == 2) || ks < 1 ||
      !(rows == 1 || rows == 2 || rows == 4)) {
    return std::string("JAX_FP4_GEMV_CONFIG must be col_tiles,k_split[,rows_per_block] with "
                       "col_tiles in {1, 2}, rows_per_block in {1, 2, 4} and k_split >= 1, got '") +
           env + "'";
  }
  cfg->col_tiles = ct;
  cfg->k_split = std::min(ks, GemvMmaShape{ct, cfg->row_tiles, tiled}.max_split());
  cfg->rows_per_block = rows;
  return "";
}

template <typename T>
cudaError_t LaunchGemv(cudaStream_t stream, const DeviceInfo& info, const void* a,
                       const uint8_t* packed, const uint8_t* scale, const float* gs,
                       const void* bias, void* y, int64_t m, int64_t n, int64_t k, bool use_mma,
                       bool tiled, bool row_tiling, const GemvLaunchConfig& cfg,
                       bool programmatic) {
  const T* at = static_cast<const T*>(a);
  const T* bt = static_cast<const T*>(bias);
  T* yt = static_cast<T*>(y);
  if (tiled || (use_mma && k > 0 && k % kGemvWindow == 0 && info.sm >= 80)) {
    const int ks = cfg.k_split;
    const bool pdl = programmatic && info.sm >= 90;
    if (row_tiling && cfg.row_tiles == 2) {
      return cfg.col_tiles == 2
                 ? LaunchMma<T, 2, 2>(stream, tiled, at, packed, scale, gs, bt, yt, m, n, k, ks, pdl)
                 : LaunchMma<T, 1, 2>(stream, tiled, at, packed, scale, gs, bt, yt, m, n, k, ks, pdl);
    }
    return cfg.col_tiles == 2
               ? LaunchMma<T, 2>(stream, tiled, at, packed, scale, gs, bt, yt, m, n, k, ks, pdl)
               : LaunchMma<T, 1>(stream, tiled, at, packed, scale, gs, bt, yt, m, n, k, ks, pdl);
  }
  const int rows = row_tiling ? cfg.rows_per_block : 1;
  switch (rows) {
    case 4: return LaunchScalar<T, 4>(stream, at, packed, scale, gs, bt, yt, m, n, k);
    case 2: return LaunchScalar<T, 2>(stream, at, packed, scale, gs, bt, yt, m, n, k);
    default: return LaunchScalar<T, 1>(stream, at, packed, scale, gs, bt, yt, m, n, k);
  }
}

ffi::Error GemvCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                        ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::F32> global_scale,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, int64_t block_size,
                        bool use_mma, bool tiled, bool row_tiling) {
  MatmulShape shape;
  const std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      global_scale.element_count(), bias.element_type(), bias.element_count(), y->element_type(),
      y->dimensions(), block_size, /*allow_f32=*/false, &shape);
  if (!problem.empty()) return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + problem);
  if (block_size != 16) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: block_size must be 16, got " +
                                       std::to_string(block_size));
  }
  if (shape.k % 32 != 0) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: K must be a multiple of 32, got " +
                                       std::to_string(shape.k));
  }
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + bad);
  }
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  const void* bias_data = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  // 16-byte vector loads of a and packed (rows are 16-byte multiples since K % 32 == 0); the
  // tiled layout's scales are read 4 bytes at a time.
  if (!IsAligned(a.untyped_data(), 16) || !IsAligned(packed.untyped_data(), 16) ||
      !IsAligned(scale.untyped_data(), tiled ? 4 : 2)) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: a and packed must be 16-byte aligned and scale 2-byte aligned "
        "(4-byte for the tiled layout)");
  }

  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: device query", err);
  if (tiled && info.sm < 80) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: the tiled layout needs the tensor-core kernel (sm_80+), this device "
        "is sm_" + std::to_string(info.sm));
  }
  GemvLaunchConfig cfg = gemv_launch_config(shape.m, shape.n, shape.k, info.num_sms, tiled);
  const std::string bad_override = ApplyConfigOverride(&cfg, tiled);
  if (!bad_override.empty()) return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + bad_override);
  bool programmatic = false;  // the tensor-core kernel on sm_90+ only (LaunchGemv)
  const std::string bad_pdl = ProgrammaticLaunchOverride(&programmatic);
  if (!bad_pdl.empty()) return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + bad_pdl);

  if (a.element_type() == ffi::DataType::F16) {
    err = LaunchGemv<__half>(stream, info, a.untyped_data(), packed.typed_data(),
                             scale.typed_data(), global_scale.typed_data(), bias_data,
                             y->untyped_data(), shape.m, shape.n, shape.k, use_mma, tiled,
                             row_tiling, cfg, programmatic);
  } else {
    err = LaunchGemv<__nv_bfloat16>(stream, info, a.untyped_data(), packed.typed_data(),
                                    scale.typed_data(), global_scale.typed_data(), bias_data,
                                    y->untyped_data(), shape.m, shape.n, shape.k, use_mma,
                                    tiled, row_tiling, cfg, programmatic);
  }
  if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4GemvCuda, jax_fp4::cuda::GemvCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // a [M, K] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scale [N, K/16] (E4M3 bytes)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // global scale, one element
                                  .Arg<ffi::AnyBuffer>()          // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N]
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("use_mma")
                                  .Attr<bool>("tiled")   // weight in the tiled layout
                                  .Attr<bool>("row_tiling"),
                              {ffi::Traits::kCmdBufferCompatible});
