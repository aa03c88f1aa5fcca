// CUDA dequantize: w[n, k] = e2m1(code) * e4m3(scale[n, k / bs]) * gs rounded once to the dtype
// (to nearest, ties to even): the first product is exact in fp32; the second is rounded to odd in
// fp32 (MulRoundToOdd), which fp32 -> bf16 / fp16 then rounds as the exact product would. NaN scale
// bytes give NaN. The prefill path of the operator: XLA's dot (cuBLAS) consumes w.
//
// * Fast path (K % 16 == 0, block_size % 16 == 0, aligned buffers): a thread per 16 elements,
//   one 8-byte load of packed weight, one scale byte, two 16-byte stores.
// * General path (any block_size > 0, any even K, blocks that split a byte, partial trailing
//   blocks): a thread per packed byte, each element with its own scale index, one 4-byte store.
// * Tiled path (attribute tiled: the layout of jax_fp4.prepack, N % 16 == 0, K % 128 == 0,
//   block_size 16): a thread per 4-byte word of the tiled weight (8 elements of one row), one
//   scale byte, one 16-byte store; same values bit for bit.
// All use grid-stride loops with 64-bit indices and never touch memory outside the operands.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/handlers.h"
#include "jax_fp4/nvfp4.h"
#include "jax_fp4/nvfp4_cuda.cuh"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// a * b rounded to odd in fp32: truncated toward zero, the last bit set where the product is
// inexact (round-down and round-up differ). Rounding to nearest from there to a format with at
// least two bits less precision (bf16: 8 bits, fp16: 11, against fp32's 24) gives the correctly
// rounded exact product; fp32 rounded to nearest first, then to bf16, is one ulp off where the fp32
// result lands on a bf16 midpoint. Exact through subnormals (this file is built without -ftz),
// overflow (the largest finite fp32, odd, which rounds on to inf) and NaN (NaN != NaN).
__device__ __forceinline__ float MulRoundToOdd(float a, float b) {
  const float down = __fmul_rd(a, b), up = __fmul_ru(a, b);
  const bool negative = ((__float_as_uint(a) ^ __float_as_uint(b)) >> 31) != 0;
  const float toward_zero = negative ? up : down;
  return __uint_as_float(__float_as_uint(toward_zero) | (down != up ? 1u : 0u));
}

// The 8 E2M1 codes of one packed word, scaled: out[i] holds elements 2i, 2i+1 as a T pair.
template <typename T>
__device__ __forceinline__ void DequantWord(uint32_t q, float s, float gs, uint32_t (&out)[4]) {
  using Tr = HalfTraits<T>;
  using Hf = HalfTraits<__half>;
  const uint32_t q4 = q << 4;
  // fp16 decode is e2m1 * 2^-14 and s carries 2^14: the product is e2m1 * e4m3, exact in fp32.
  const float2 p0 = Hf::pair_to_float2(decode_e2m1_pair<__half, 0>(q, q4));
  const float2 p1 = Hf::pair_to_float2(decode_e2m1_pair<__half, 1>(q, q4));
  const float2 p2 = Hf::pair_to_float2(decode_e2m1_pair<__half, 2>(q, q4));
  const float2 p3 = Hf::pair_to_float2(decode_e2m1_pair<__half, 3>(q, q4));
  out[0] = Tr::pair_from_floats(MulRoundToOdd(p0.x * s, gs), MulRoundToOdd(p0.y * s, gs));
  out[1] = Tr::pair_from_floats(MulRoundToOdd(p1.x * s, gs), MulRoundToOdd(p1.y * s, gs));
  out[2] = Tr::pair_from_floats(MulRoundToOdd(p2.x * s, gs), MulRoundToOdd(p2.y * s, gs));
  out[3] = Tr::pair_from_floats(MulRoundToOdd(p3.x * s, gs), MulRoundToOdd(p3.y * s, gs));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    DequantFastKernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scale,
                      const float* __restrict__ global_scale, T* __restrict__ w, int64_t n,
                      int64_t k, int64_t k_blocks, int64_t block_size) {
  const float gs = __ldg(global_scale);
  const int64_t groups_per_row = k / 16;
  const int64_t total = n * groups_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t row = i / groups_per_row;
    const int64_t group = i - row * groups_per_row;
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(packed + row * (k / 2)) + group);
    const float s =
        e4m3_to_float_fast(__ldg(scale + row * k_blocks + (group * 16) / block_size)) * 16384.0f;
    uint32_t lo[4], hi[4];
    DequantWord<T>(q.x, s, gs, lo);
    DequantWord<T>(q.y, s, gs, hi);
    uint4* dst = reinterpret_cast<uint4*>(w + row * k + group * 16);
    dst[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    dst[1] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  }
}

// Tiled layout: a thread per 32-bit word i (8 elements), so that a warp's 16-byte stores cover
// two rows' 256-byte window runs whole (a thread per 16-byte chunk measured 9-16% slower than the
// spec path at M = 1024: its stores left half sectors). Word i is word i % 4 of 16-byte chunk
// c = i / 4 = ((T W + w) 2 + h) 32 + L (lane L = 4 g + t, row half h, window w, 16-row tile T):
// row 16 T + 8 h + g, elements 128 w + 32 t + 8 (i % 4) .. + 7, block scale byte
// ((T W + w) 32 + L) 4 + 2 h + (i % 4) / 2.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    DequantTiledKernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scale,
                       const float* __restrict__ global_scale, T* __restrict__ w, int64_t n,
                       int64_t k) {
  using Tr = HalfTraits<T>;
  using Hf = HalfTraits<__half>;
  const float gs = __ldg(global_scale);
  const int64_t total = n * k / 8;
  const int64_t windows = k / 128;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int word = static_cast<int>(i & 3);
    const int64_t chunk = i >> 2;
    const int lane = static_cast<int>(chunk & 31), h = static_cast<int>((chunk >> 5) & 1);
    const int64_t tile_window = chunk >> 6;
    const int64_t tile = tile_window / windows, window = tile_window - tile * windows;
    const int64_t row = 16 * tile + 8 * h + (lane >> 2);
    const uint32_t q = __ldg(reinterpret_cast<const uint32_t*>(packed) + i);
    const uint32_t sbyte = __ldg(scale + (32 * tile_window + lane) * 4 + 2 * h + word / 2);
    // fp16 decode is e2m1 * 2^-14 and s carries 2^14: the product is e2m1 * e4m3, exact in fp32.
    const float s = e4m3_to_float_fast(sbyte) * 16384.0f;
    const float2 p0 = Hf::pair_to_float2(decode_tiled_pair<__half, 0>(q));
    const float2 p1 = Hf::pair_to_float2(decode_tiled_pair<__half, 1>(q));
    const float2 p2 = Hf::pair_to_float2(decode_tiled_pair<__half, 2>(q));
    const float2 p3 = Hf::pair_to_float2(decode_tiled_pair<__half, 3>(q));
    *reinterpret_cast<uint4*>(w + row * k + 128 * window + 32 * (lane & 3) + 8 * word) =
        make_uint4(Tr::pair_from_floats(MulRoundToOdd(p0.x * s, gs), MulRoundToOdd(p0.y * s, gs)),
                   Tr::pair_from_floats(MulRoundToOdd(p1.x * s, gs), MulRoundToOdd(p1.y * s, gs)),
                   Tr::pair_from_floats(MulRoundToOdd(p2.x * s, gs), MulRoundToOdd(p2.y * s, gs)),
                   Tr::pair_from_floats(MulRoundToOdd(p3.x * s, gs), MulRoundToOdd(p3.y * s, gs)));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    DequantGeneralKernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scale,
                         const float* __restrict__ global_scale, T* __restrict__ w, int64_t n,
                         int64_t k, int64_t k_blocks, int64_t block_size) {
  using Tr = HalfTraits<T>;
  const float gs = __ldg(global_scale);
  const int64_t row_bytes = k / 2;
  const int64_t total = n * row_bytes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t row = i / row_bytes;
    const int64_t k0 = 2 * (i - row * row_bytes);
    const uint32_t byte = __ldg(packed + i);
    const uint8_t* srow = scale + row * k_blocks;
    const float s0 = e4m3_to_float_fast(__ldg(srow + k0 / block_size));
    const float s1 = e4m3_to_float_fast(__ldg(srow + (k0 + 1) / block_size));
    const float v0 = MulRoundToOdd(e2m1_to_float(byte & 0xFu) * s0, gs);
    const float v1 = MulRoundToOdd(e2m1_to_float(byte >> 4) * s1, gs);
    *reinterpret_cast<uint32_t*>(w + row * k + k0) = Tr::pair_from_floats(v0, v1);
  }
}

template <typename T>
cudaError_t LaunchDequant(cudaStream_t stream, const DeviceInfo& info, const uint8_t* packed,
                          const uint8_t* scale, const float* gs, void* out, int64_t n, int64_t k,
                          int64_t k_blocks, int64_t block_size, bool tiled) {
  T* w = static_cast<T*>(out);
  const bool fast = k % 16 == 0 && block_size % 16 == 0 && IsAligned(packed, 8) && IsAligned(w, 16);
  const int64_t work = tiled ? n * (k / 8) : fast ? n * (k / 16) : n * (k / 2);
  // Enough blocks to fill the device several times over; grid-stride beyond that.
  const int64_t max_blocks = static_cast<int64_t>(info.num_sms) * 32;
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min(CeilDiv(work, kThreads), max_blocks)));
  if (tiled) {
    DequantTiledKernel<T><<<blocks, kThreads, 0, stream>>>(packed, scale, gs, w, n, k);
  } else if (fast) {
    DequantFastKernel<T>
        <<<blocks, kThreads, 0, stream>>>(packed, scale, gs, w, n, k, k_blocks, block_size);
  } else {
    DequantGeneralKernel<T>
        <<<blocks, kThreads, 0, stream>>>(packed, scale, gs, w, n, k, k_blocks, block_size);
  }
  return cudaGetLastError();
}

ffi::Error DequantCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer scale,
                           ffi::Buffer<ffi::F32> global_scale, ffi::Result<ffi::AnyBuffer> w,
                           int64_t block_size, bool tiled) {
  MatmulShape shape;
  const std::string problem =
      CheckWeightOperands(packed.dimensions(), scale.dimensions(), scale.element_type(),
                          global_scale.element_count(), block_size, &shape);
  if (!problem.empty()) return ffi::Error::InvalidArgument("jax_fp4_dequant_cuda: " + problem);
  const ffi::DataType dtype = w->element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("jax_fp4_dequant_cuda: w must be float16 or bfloat16");
  }
  const auto w_dims = w->dimensions();
  if (w_dims.size() != 2 || w_dims[0] != shape.n || w_dims[1] != shape.k) {
    return ffi::Error::InvalidArgument("jax_fp4_dequant_cuda: w must be [" +
                                       std::to_string(shape.n) + ", " + std::to_string(shape.k) +
                                       "], got " + DimsToString(w_dims));
  }
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_dequant_cuda: " + bad);
  }
  if (shape.n == 0 || shape.k == 0) return ffi::Error::Success();
  if (!IsAligned(w->untyped_data(), 4)) {
    return ffi::Error::InvalidArgument("jax_fp4_dequant_cuda: w must be 4-byte aligned");
  }
  if (tiled && (!IsAligned(w->untyped_data(), 16) || !IsAligned(packed.typed_data(), 4))) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_dequant_cuda: the tiled layout needs w 16-byte and packed 4-byte aligned");
  }

  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_dequant_cuda: device query", err);
  if (dtype == ffi::DataType::F16) {
    err = LaunchDequant<__half>(stream, info, packed.typed_data(), ScaleBytes(scale),
                                global_scale.typed_data(), w->untyped_data(), shape.n, shape.k,
                                shape.k_blocks, block_size, tiled);
  } else {
    err = LaunchDequant<__nv_bfloat16>(stream, info, packed.typed_data(), ScaleBytes(scale),
                                       global_scale.typed_data(), w->untyped_data(), shape.n,
                                       shape.k, shape.k_blocks, block_size, tiled);
  }
  if (err != cudaSuccess) return CudaError("jax_fp4_dequant_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4DequantCuda, jax_fp4::cuda::DequantCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [N, K/2]
                                  .Arg<ffi::AnyBuffer>()         // scale [N, ceil(K/bs)]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global scale, one element
                                  .Ret<ffi::AnyBuffer>()         // w [N, K] f16 / bf16
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled"),  // weight in the tiled layout
                              {ffi::Traits::kCmdBufferCompatible});
