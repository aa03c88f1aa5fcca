// Activation quantization to NVFP4 and the SM1xx block-scaled scale layout, for the native SM120
// NVFP4 x NVFP4 GEMM (spec sections 6 and 7). Plain CUDA that builds for every architecture, so it
// is tested on Hopper even though the GEMM it feeds runs only on Blackwell SM120.
//
// Activation quantization (W4A4 semantics), per call, everything in fp32 with IEEE rounding:
//   g      = static activation scale if one is given (ModelOpt `input_scale`, multiplied), else
//            amax(|A| over finite elements) / (6 * 448), or 1 when that amax is 0;
//            g = max(g, 2^-126) so that no step underflows to zero;
//   block  = 16 consecutive elements of one row;
//   s      = amax_block / (6 g); s == 0 -> 1; clamp to [2^-9, 448]; E4M3 round-to-nearest-even;
//   code   = E2M1(x / (e4m3(s) * g)), nearest, ties to even, saturating at +-6;
//   a block holding a NaN or Inf (or an invalid g: not > 0 or not finite) gets the E4M3 NaN byte
//   0x7F as its scale and zero codes, so the NaN reaches the output instead of vanishing.
// This is ModelOpt's weight quantizer (jax_fp4.quantize) applied to rows of A; the Python
// reference jax_fp4._native.quantize_activation_reference is bit-exact with it.
//
// Swizzled ("128x4") scale layout, CuTe Sm1xxBlockScaledConfig<16>::tile_atom_to_shape_SF*:
//   byte offset of (row r, k-block kb) =
//     ((r / 128) * ceil(KB / 4) + kb / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + kb % 4
//   over rows padded to a multiple of 128 and k-blocks padded to a multiple of 4; every padding
//   byte is written as 0 (scale 0 times the zero-filled out-of-bounds data is 0, never NaN).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/native_sm120/handlers.h"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kBlock = 16;  // NVFP4 block size: the only one these kernels serve
constexpr float kMinGlobalScale = 1.17549435e-38f;  // 2^-126

__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

// Eight consecutive 16-bit activations (16-byte aligned) -> fp32.
template <typename T>
__device__ __forceinline__ void Load8(const T* src, float* dst) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = ToFloat(v[i]);
}

// fp32 in [2^-9, 448] -> E4M3FN byte, round to nearest, ties to even.
__device__ __forceinline__ uint32_t F32ToE4m3Rne(float s) {
  const uint32_t u = __float_as_uint(s);
  const int exponent = static_cast<int>(u >> 23) - 127;
  if (exponent < -6) {
    // E4M3 subnormal m * 2^-9: scaling by 2^9 is exact, rintf rounds half to even; m == 8 is the
    // encoding of the smallest normal 2^-6, so the carry lands correctly.
    return static_cast<uint32_t>(rintf(s * 512.0f));
  }
  const uint32_t mantissa = u & 0x7FFFFFu;
  uint32_t code = (static_cast<uint32_t>(exponent + 7) << 3) | (mantissa >> 20);
  const uint32_t rest = mantissa & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) code += 1u;  // carry may bump exponent
  return code;
}

__device__ __forceinline__ float E4m3ToF32(uint32_t code) {  // positive, finite codes only
  const uint32_t exponent = code >> 3, mantissa = code & 7u;
  if (exponent == 0) return static_cast<float>(mantissa) * (1.0f / 512.0f);
  return __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
}

// fp32 -> E2M1 code, round to nearest, ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
// 3.5->4, 5->4), saturating at 6; a negative value that rounds to 0 gets -0 (0x8), as ModelOpt
// writes it, and -0.0 itself (not below zero) gets 0.
__device__ __forceinline__ uint32_t E2m1Rne(float q) {
  const float m = fabsf(q);
  const uint32_t code = static_cast<uint32_t>(m > 0.25f) + static_cast<uint32_t>(m >= 0.75f) +
                        static_cast<uint32_t>(m > 1.25f) + static_cast<uint32_t>(m >= 1.75f) +
                        static_cast<uint32_t>(m > 2.5f) + static_cast<uint32_t>(m >= 3.5f) +
                        static_cast<uint32_t>(m > 5.0f);
  return code | (q < 0.0f ? 8u : 0u);
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// Block-wide max of non-negative values; every thread gets the result.
__device__ float BlockMax(float v) {
  __shared__ float warp_max[kThreads / 32];
  __shared__ float result;
  v = WarpMax(v);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.0f;
    w = WarpMax(w);
    if (threadIdx.x == 0) result = w;
  }
  __syncthreads();
  return result;
}

// Pass 1 of the dynamic scale: partials[b] = max |a| over the finite elements block b visits.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    AbsMaxPartialsKernel(const T* __restrict__ a, int64_t num_vec8, float* __restrict__ partials) {
  float amax = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < num_vec8;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float v[8];
    Load8(a + 8 * i, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float mag = fabsf(v[j]);
      amax = mag <= 3.40282347e38f ? fmaxf(amax, mag) : amax;  // skips Inf and NaN
    }
  }
  amax = BlockMax(amax);
  if (threadIdx.x == 0) partials[blockIdx.x] = amax;
}

// Pass 2: each thread quantizes up to four 16-element blocks (64 elements) of one row, so that
// the four scale bytes of an swizzled word come from one thread and land as one 32-bit store.
// Threads run over rows_out = (swizzled ? ceil(M/128)*128 : M) rows and k_groups = ceil(KB/4)
// groups; padding positions get zero scale bytes and no packed data.
template <typename T, bool kSwizzled>
__global__ void __launch_bounds__(kThreads)
    QuantizeActivationKernel(const T* __restrict__ a, int64_t m, int64_t k, int64_t rows_out,
                             int64_t k_groups, const float* __restrict__ static_scale,
                             const float* __restrict__ partials, int num_partials,
                             uint8_t* __restrict__ packed, uint8_t* __restrict__ scale,
                             float* __restrict__ global_scale) {
  // The global scale: every CTA derives the same value from the same inputs.
  __shared__ float s_gs;
  if (static_scale != nullptr) {
    if (threadIdx.x == 0) s_gs = static_scale[0];
    __syncthreads();
  } else {
    float amax = 0.0f;
    for (int i = threadIdx.x; i < num_partials; i += kThreads) amax = fmaxf(amax, partials[i]);
    amax = BlockMax(amax);
    if (threadIdx.x == 0) s_gs = amax > 0.0f ? __fdiv_rn(amax, 6.0f * 448.0f) : 1.0f;
    __syncthreads();
  }
  const float gs_in = s_gs;
  const bool gs_valid = gs_in > 0.0f && gs_in <= 3.40282347e38f;
  const float gs = gs_valid ? fmaxf(gs_in, kMinGlobalScale) : gs_in;
  if (blockIdx.x == 0 && threadIdx.x == 0) global_scale[0] = gs;

  const int64_t idx = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (idx >= rows_out * k_groups) return;
  const int64_t row = idx / k_groups;
  const int64_t group = idx - row * k_groups;
  const int64_t k_blocks = k / kBlock;
  const float six_gs = __fmul_rn(6.0f, gs);

  uint32_t scale_word = 0;  // byte j: k-block 4*group + j
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t kb = 4 * group + j;
    if (row >= m || kb >= k_blocks) continue;  // padding: scale 0, no data
    float x[kBlock];
    const T* src = a + row * k + kb * kBlock;
    Load8(src, x);
    Load8(src + 8, x + 8);
    float bamax = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      const float mag = fabsf(x[i]);
      finite = finite && mag <= 3.40282347e38f;
      bamax = fmaxf(bamax, mag);
    }
    uint32_t sbyte = 0x7Fu;  // E4M3 NaN
    uint2 codes = make_uint2(0u, 0u);
    if (finite && gs_valid) {
      float s = __fdiv_rn(bamax, six_gs);
      if (s == 0.0f) s = 1.0f;
      s = fminf(fmaxf(s, 1.0f / 512.0f), 448.0f);
      sbyte = F32ToE4m3Rne(s);
      const float step = __fmul_rn(E4m3ToF32(sbyte), gs);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        codes.x |= E2m1Rne(__fdiv_rn(x[i], step)) << (4 * i);
        codes.y |= E2m1Rne(__fdiv_rn(x[8 + i], step)) << (4 * i);
      }
    }
    *reinterpret_cast<uint2*>(packed + row * (k / 2) + kb * (kBlock / 2)) = codes;
    if (kSwizzled) {
      scale_word |= sbyte << (8 * j);
    } else {
      scale[row * k_blocks + kb] = static_cast<uint8_t>(sbyte);
    }
  }
  if (kSwizzled) {
    const int64_t offset =
        ((row >> 7) * k_groups + group) * 512 + (row & 31) * 16 + ((row & 127) >> 5) * 4;
    *reinterpret_cast<uint32_t*>(scale + offset) = scale_word;
  }
}

// One thread per 32-bit word of the swizzled output: gathers the four k-blocks (4 kb .. 4 kb + 3)
// of one row, zero outside [rows, k_blocks).
__global__ void __launch_bounds__(kThreads)
    SwizzleScalesKernel(const uint8_t* __restrict__ scale, int64_t rows, int64_t k_blocks,
                        int64_t k_groups, int64_t num_words, uint32_t* __restrict__ out) {
  const int64_t w = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (w >= num_words) return;
  const int64_t tile = w >> 7;  // 128 words (512 bytes) per atom
  const int within = static_cast<int>(w & 127) * 4;
  const int64_t row_tile = tile / k_groups;
  const int64_t group = tile - row_tile * k_groups;
  const int64_t row = row_tile * 128 + ((within & 15) >> 2) * 32 + (within >> 4);
  uint32_t word = 0;
  if (row < rows) {
    const uint8_t* src = scale + row * k_blocks;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t kb = 4 * group + j;
      if (kb < k_blocks) word |= static_cast<uint32_t>(src[kb]) << (8 * j);
    }
  }
  out[w] = word;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// At least one CTA: the quantizer's first CTA also writes the global scale when M or K is 0.
unsigned GridFor(int64_t threads) {
  return static_cast<unsigned>(std::max<int64_t>(1, CeilDiv(threads, kThreads)));
}

ffi::Error LaunchError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

template <typename T>
void LaunchQuantize(cudaStream_t stream, const void* a, int64_t m, int64_t k, bool swizzled,
                    const float* static_scale, float* partials, int num_partials, uint8_t* packed,
                    uint8_t* scale, float* global_scale) {
  const T* a_t = static_cast<const T*>(a);
  if (static_scale == nullptr) {
    AbsMaxPartialsKernel<T><<<num_partials, kThreads, 0, stream>>>(a_t, m * k / 8, partials);
  }
  const int64_t k_groups = CeilDiv(k / kBlock, 4);
  const int64_t rows_out = swizzled ? CeilDiv(m, 128) * 128 : m;
  const unsigned grid = GridFor(rows_out * k_groups);
  if (swizzled) {
    QuantizeActivationKernel<T, true>
        <<<grid, kThreads, 0, stream>>>(a_t, m, k, rows_out, k_groups, static_scale, partials,
                                        num_partials, packed, scale, global_scale);
  } else {
    QuantizeActivationKernel<T, false>
        <<<grid, kThreads, 0, stream>>>(a_t, m, k, rows_out, k_groups, static_scale, partials,
                                        num_partials, packed, scale, global_scale);
  }
}

ffi::Error QuantizeActivationImpl(cudaStream_t stream, ffi::AnyBuffer a,
                                  ffi::Buffer<ffi::F32> activation_scale,
                                  ffi::Result<ffi::Buffer<ffi::U8>> packed,
                                  ffi::Result<ffi::Buffer<ffi::U8>> scale,
                                  ffi::Result<ffi::Buffer<ffi::F32>> global_scale,
                                  ffi::Result<ffi::Buffer<ffi::F32>> partials, int64_t block_size,
                                  bool swizzled) {
  const std::string name = "jax_fp4_quantize_activation_cuda: ";
  if (block_size != kBlock) {
    return ffi::Error::InvalidArgument(name + "block_size must be 16, got " +
                                       std::to_string(block_size));
  }
  const ffi::DataType dtype = a.element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(name + "a must be float16 or bfloat16");
  }
  const auto a_dims = a.dimensions();
  if (a_dims.size() != 2)
    return ffi::Error::InvalidArgument(name + "a must be [M, K], got " + DimsToString(a_dims));
  const int64_t m = a_dims[0], k = a_dims[1];
  if (k % kBlock) {
    return ffi::Error::InvalidArgument(name + "K must be a multiple of 16, got " +
                                       std::to_string(k));
  }
  const int64_t k_blocks = k / kBlock;
  const auto p_dims = packed->dimensions();
  if (p_dims.size() != 2 || p_dims[0] != m || p_dims[1] != k / 2) {
    return ffi::Error::InvalidArgument(name + "packed must be [M, K/2], got " +
                                       DimsToString(p_dims));
  }
  const int64_t scale_bytes =
      swizzled ? CeilDiv(m, 128) * 128 * CeilDiv(k_blocks, 4) * 4 : m * k_blocks;
  if (static_cast<int64_t>(scale->element_count()) != scale_bytes) {
    return ffi::Error::InvalidArgument(name + "scale must hold " + std::to_string(scale_bytes) +
                                       " bytes, got " + DimsToString(scale->dimensions()));
  }
  if (global_scale->element_count() != 1) {
    return ffi::Error::InvalidArgument(name + "global_scale must hold one element");
  }
  const size_t static_count = activation_scale.element_count();
  if (static_count > 1) {
    return ffi::Error::InvalidArgument(name +
                                       "activation_scale must hold 0 (dynamic) or 1 element");
  }
  const bool dynamic = static_count == 0;
  int num_partials = 0;
  if (dynamic) {
    const int64_t available = static_cast<int64_t>(partials->element_count());
    if (available < 1) {
      return ffi::Error::InvalidArgument(
          name + "a dynamic activation scale needs a partials scratch buffer");
    }
    const int64_t wanted = std::max<int64_t>(1, CeilDiv(m * k / 8, kThreads));
    num_partials = static_cast<int>(std::min({wanted, available, kActivationPartials}));
  }
  const float* static_ptr = dynamic ? nullptr : activation_scale.typed_data();
  if (dtype == ffi::DataType::F16) {
    LaunchQuantize<__half>(stream, a.untyped_data(), m, k, swizzled, static_ptr,
                           partials->typed_data(), num_partials, packed->typed_data(),
                           scale->typed_data(), global_scale->typed_data());
  } else {
    LaunchQuantize<__nv_bfloat16>(stream, a.untyped_data(), m, k, swizzled, static_ptr,
                                  partials->typed_data(), num_partials, packed->typed_data(),
                                  scale->typed_data(), global_scale->typed_data());
  }
  return LaunchError(name.c_str());
}

ffi::Error SwizzleScalesImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> scale,
                             ffi::Result<ffi::Buffer<ffi::U8>> out) {
  const std::string name = "jax_fp4_swizzle_scales_cuda: ";
  const auto dims = scale.dimensions();
  if (dims.size() != 2)
    return ffi::Error::InvalidArgument(name + "scale must be [R, KB], got " + DimsToString(dims));
  const int64_t rows = dims[0], k_blocks = dims[1];
  const int64_t k_groups = CeilDiv(k_blocks, 4);
  const int64_t bytes = CeilDiv(rows, 128) * 128 * k_groups * 4;
  if (static_cast<int64_t>(out->element_count()) != bytes) {
    return ffi::Error::InvalidArgument(name + "out must hold " + std::to_string(bytes) +
                                       " bytes, got " + DimsToString(out->dimensions()));
  }
  if (bytes == 0) return ffi::Error::Success();
  const int64_t words = bytes / 4;
  SwizzleScalesKernel<<<GridFor(words), kThreads, 0, stream>>>(
      scale.typed_data(), rows, k_blocks, k_groups, words,
      reinterpret_cast<uint32_t*>(out->typed_data()));
  return LaunchError(name.c_str());
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeActivationCuda, jax_fp4::QuantizeActivationImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // a [M, K] f16/bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // activation scale [0] or [1]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // packed [M, K/2]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // scale, swizzled or [M, K/16]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // global scale [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // partials scratch
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("swizzled"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4SwizzleScalesCuda, jax_fp4::SwizzleScalesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // scale [R, KB] plain
                                  .Ret<ffi::Buffer<ffi::U8>>(),  // swizzled
                              {ffi::Traits::kCmdBufferCompatible});
