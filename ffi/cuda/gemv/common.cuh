// Device helpers shared by the decode GEMV's kernels (ffi/cuda/gemv/mma.cuh, scalar.cuh).
#ifndef JAX_FP4_CUDA_GEMV_COMMON_CUH_
#define JAX_FP4_CUDA_GEMV_COMMON_CUH_

#include <cstdint>

#include "jax_fp4/nvfp4_cuda.cuh"

namespace jax_fp4 {
namespace cuda {

template <int I>
__device__ __forceinline__ uint32_t Word(const uint4& v) {
  static_assert(I >= 0 && I < 4, "");
  return I == 0 ? v.x : (I == 1 ? v.y : (I == 2 ? v.z : v.w));
}

__device__ __forceinline__ int64_t Min64(int64_t x, int64_t y) { return x < y ? x : y; }

__device__ __forceinline__ uint32_t LoadScalePair(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);  // 2-byte aligned: K / 16 is even
}

template <typename T>
__device__ __forceinline__ void StoreOutput(T* y, const T* bias, int64_t n, int64_t row,
                                            int64_t col, float acc, float gs) {
  using Tr = HalfTraits<T>;
  const float b = bias != nullptr ? Tr::to_float(bias[col]) : 0.0f;
  y[row * n + col] = Tr::from_float(fmaf(acc, gs, b));
}

constexpr int64_t kMaxGridY = 65535;  // grid.y limit: M chunks beyond it are strided

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GEMV_COMMON_CUH_
