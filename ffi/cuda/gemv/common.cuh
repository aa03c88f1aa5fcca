// Device helpers shared by the decode GEMV's kernels (ffi/cuda/gemv/mma.cuh, scalar.cuh), and the
// epilogue fusions both apply (GemvFusion).
#ifndef JAX_FP4_CUDA_GEMV_COMMON_CUH_
#define JAX_FP4_CUDA_GEMV_COMMON_CUH_

#include <cstdint>

#include "cuda/activations.cuh"
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

// The epilogue fusions of the GEMV (its fused kernel instances; all off: the plain GEMV).
//   silu_mul  the weight's rows [0, N/2) are a gate and rows [N/2, N) an up projection: output
//             [M, N/2], silu(gate + bias[j]) * (up + bias[N/2 + j]) from the f32 products;
//   residual  residual[m, j] (T, [M, N_out]) added in f32 before the one rounding;
//   row scale an RMSNorm split around the product: a holds x * norm_weight rounded once, and
//             row_sq_sum[m] (f32, [M]) the sum over K of x[m]^2; each product is scaled by
//             rsqrt(row_sq_sum[m] / K + norm_eps) before the bias (lowering.py says when).
//
// The main loop (GemvMmaMainloop) takes the fusion's type as a template argument, so that other
// epilogues (the MoE block's, ffi/cuda/grouped/moe.cuh) can extend it: kRowMap says whether
// activation_row maps the call's rows to other rows of a (then read after the first weight loads),
// and StoreFusedOutput is overloaded on the type.
template <typename T>
struct GemvFusion {
  static constexpr bool kRowMap = false;
  const T* residual = nullptr;  // [M, N_out], or nullptr
  bool silu_mul = false;
  const float* row_sq_sum = nullptr;  // [M], or nullptr
  float norm_eps = 0.0f;
  float norm_k = 1.0f;  // K, the count row_sq_sum's mean divides by

  __host__ __device__ bool active() const {
    return residual != nullptr || silu_mul || row_sq_sum != nullptr;
  }
  // The row of a that row `row` of the call multiplies.
  __device__ __forceinline__ int64_t activation_row(int64_t row) const { return row; }
};

// One output of a fused GEMV: `acc` (and, with silu_mul, `acc_up`, the product of the matching
// up row) is the product in its true scale, before the global scale; bias [N] (with silu_mul the
// gate's then the up's) and the residual are added in f32; one rounding to T.
template <typename T>
__device__ __forceinline__ void StoreFusedOutput(T* y, const T* bias, const GemvFusion<T>& fusion,
                                                 int64_t n_out, int64_t row, int64_t col, float acc,
                                                 float acc_up, float gs) {
  using Tr = HalfTraits<T>;
  if (fusion.row_sq_sum != nullptr) {
    const float inv_rms = rsqrtf(fusion.row_sq_sum[row] / fusion.norm_k + fusion.norm_eps);
    acc *= inv_rms;
    acc_up *= inv_rms;
  }
  float v = fmaf(acc, gs, bias != nullptr ? Tr::to_float(bias[col]) : 0.0f);
  if (fusion.silu_mul) {
    const float up = fmaf(acc_up, gs, bias != nullptr ? Tr::to_float(bias[n_out + col]) : 0.0f);
    v = Silu(v) * up;
  }
  if (fusion.residual != nullptr) v += Tr::to_float(fusion.residual[row * n_out + col]);
  y[row * n_out + col] = Tr::from_float(v);
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GEMV_COMMON_CUH_
