// Operand checks of the grouped (mixture-of-experts) CUDA handlers: a [M, K], packed [G, N, K/2],
// scale [G, N, ceil(K / block)] (float8_e4m3fn or its bytes), global_scale [G] f32, group_sizes [G]
// s32, bias [G, N] or [0] in a's dtype, y [M, N] in a's dtype ([M, N / 2] with the GEMV's silu_mul)
// (host), and the kernels' view of them (GroupedOperands, MakeGroupedOperands).
#ifndef JAX_FP4_CUDA_GROUPED_OPERANDS_H_
#define JAX_FP4_CUDA_GROUPED_OPERANDS_H_

#include <cstdint>
#include <string>

#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {

struct GroupedShape {
  int64_t m = 0, n = 0, k = 0, g = 0;
};

// The MoE block's operands beyond a grouped call's (device pointers; ffi/cuda/grouped/moe.cuh). A
// kernel argument of their own, next to GroupedOperands: ragged_matmul's kernels never see them.
template <typename T>
struct MoeOperands {
  const int32_t* order = nullptr;  // [T k]: the pair of each row
  const float* weights = nullptr;  // [T, k] (down)
  const T* residual = nullptr;     // [T, H] or nullptr (down)
  float* pair_out = nullptr;       // [T k, H] scratch (down)
  int32_t* counters = nullptr;     // [T, counter_cols]
  int64_t counter_count = 0;       // T * counter_cols
  int64_t counter_cols = 0;        // ceil(H / 16)
  T* out = nullptr;                // y [T, H] (down)
  int top_k = 1;
};

// Operands of one grouped call (device pointers; bias nullptr when absent).
template <typename T>
struct GroupedOperands {
  const T* a;             // [M, K]
  const uint8_t* packed;  // [G, N, K/2]
  const uint8_t* scale;   // [G, N, K/16]
  const float* gs;        // [G]
  const int32_t* sizes;   // [G]
  const T* bias;          // [G, N] or nullptr
  T* y;                   // [M, N] ([M, N / 2] with silu_mul)
  int64_t m, n, k;
  int groups;
};

// "" when the operands are consistent, else the problem. Fills *shape. silu_mul: y holds
// silu(gate) * up of each group's gate rows [0, N/2) and up rows [N/2, N): [M, N / 2], N even.
inline std::string CheckGroupedOperands(
    xla::ffi::DataType a_type, xla::ffi::Span<const int64_t> a_dims,
    xla::ffi::Span<const int64_t> packed_dims, xla::ffi::Span<const int64_t> scale_dims,
    xla::ffi::DataType scale_type, size_t global_scale_count, size_t group_sizes_count,
    xla::ffi::DataType bias_type, size_t bias_count, xla::ffi::DataType y_type,
    xla::ffi::Span<const int64_t> y_dims, int64_t block_size, bool silu_mul, GroupedShape* shape) {
  if (std::string bad = CheckScaleType(scale_type); !bad.empty()) return bad;
  if (block_size <= 0) return "block_size must be positive, got " + std::to_string(block_size);
  if (packed_dims.size() != 3) {
    return "packed must be rank 3 [G, N, K/2], got " + DimsToString(packed_dims);
  }
  shape->g = packed_dims[0];
  shape->n = packed_dims[1];
  shape->k = 2 * packed_dims[2];
  const int64_t k_blocks = (shape->k + block_size - 1) / block_size;
  if (scale_dims.size() != 3 || scale_dims[0] != shape->g || scale_dims[1] != shape->n ||
      scale_dims[2] != k_blocks) {
    return "scale must be [" + std::to_string(shape->g) + ", " + std::to_string(shape->n) + ", " +
           std::to_string(k_blocks) + "], got " + DimsToString(scale_dims);
  }
  if (global_scale_count != static_cast<size_t>(shape->g)) {
    return "global_scale must hold G = " + std::to_string(shape->g) + " elements, got " +
           std::to_string(global_scale_count);
  }
  if (group_sizes_count != static_cast<size_t>(shape->g)) {
    return "group_sizes must hold G = " + std::to_string(shape->g) + " elements, got " +
           std::to_string(group_sizes_count);
  }
  if (a_type != xla::ffi::DataType::F16 && a_type != xla::ffi::DataType::BF16) {
    return "a must be float16 or bfloat16";
  }
  if (a_dims.size() != 2 || a_dims[1] != shape->k) {
    return "a must be [M, " + std::to_string(shape->k) + "], got " + DimsToString(a_dims);
  }
  shape->m = a_dims[0];
  if (y_type != a_type) return "y must have a's element type";
  if (silu_mul && shape->n % 2 != 0) {
    return "activation silu_mul needs an even N, got N = " + std::to_string(shape->n);
  }
  const int64_t y_cols = silu_mul ? shape->n / 2 : shape->n;
  if (y_dims.size() != 2 || y_dims[0] != shape->m || y_dims[1] != y_cols) {
    return "y must be [" + std::to_string(shape->m) + ", " + std::to_string(y_cols) + "], got " +
           DimsToString(y_dims);
  }
  if (bias_count != 0 &&
      (bias_type != a_type || bias_count != static_cast<size_t>(shape->g * shape->n))) {
    return "bias must be empty or hold G * N = " + std::to_string(shape->g * shape->n) +
           " elements of a's type, got " + std::to_string(bias_count);
  }
  constexpr int64_t kLimit = (int64_t{1} << 31) - 1;
  if (shape->m >= kLimit || shape->n >= kLimit || shape->k >= kLimit || shape->g >= kLimit) {
    return "M, N, K and G must be below 2^31";
  }
  return "";
}

// What both grouped kernels need beyond consistent operands: block size 16, K a positive multiple
// of 128 (the kernels' 128-wide windows / stages), and on the tiled layout N % 16 == 0 (with
// silu_mul N / 2 % 16 == 0: the up rows start on a tile).
inline std::string CheckGroupedKernelShape(const GroupedShape& shape, int64_t block_size,
                                           bool tiled, bool silu_mul) {
  if (block_size != 16) return "block_size must be 16, got " + std::to_string(block_size);
  if (shape.k <= 0 || shape.k % 128 != 0) {
    return "K must be a positive multiple of 128, got " + std::to_string(shape.k);
  }
  if (tiled && shape.n % 16 != 0) {
    return "the tiled layout needs N % 16 == 0, got N = " + std::to_string(shape.n);
  }
  if (tiled && silu_mul && (shape.n / 2) % 16 != 0) {
    return "activation silu_mul on the tiled layout needs N / 2 % 16 == 0, got N = " +
           std::to_string(shape.n);
  }
  return "";
}

// Both checks above on a grouped call's FFI operands (y: the result buffer): "" when the kernels
// can run them, else the problem. Fills *shape. silu_mul: the GEMV's fused epilogue.
inline std::string CheckGroupedCall(const xla::ffi::AnyBuffer& a,
                                    const xla::ffi::Buffer<xla::ffi::U8>& packed,
                                    const xla::ffi::AnyBuffer& scale,
                                    const xla::ffi::Buffer<xla::ffi::F32>& global_scale,
                                    const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                    const xla::ffi::AnyBuffer& bias, const xla::ffi::AnyBuffer& y,
                                    int64_t block_size, bool tiled, bool silu_mul,
                                    GroupedShape* shape) {
  std::string problem =
      CheckGroupedOperands(a.element_type(), a.dimensions(), packed.dimensions(),
                           scale.dimensions(), scale.element_type(), global_scale.element_count(),
                           group_sizes.element_count(), bias.element_type(), bias.element_count(),
                           y.element_type(), y.dimensions(), block_size, silu_mul, shape);
  if (problem.empty()) problem = CheckGroupedKernelShape(*shape, block_size, tiled, silu_mul);
  return problem;
}

// The kernels' view of a checked grouped call, T the activations' type.
template <typename T>
GroupedOperands<T> MakeGroupedOperands(const xla::ffi::AnyBuffer& a,
                                       const xla::ffi::Buffer<xla::ffi::U8>& packed,
                                       const xla::ffi::AnyBuffer& scale,
                                       const xla::ffi::Buffer<xla::ffi::F32>& global_scale,
                                       const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                       const xla::ffi::AnyBuffer& bias, xla::ffi::AnyBuffer& y,
                                       const GroupedShape& shape) {
  return GroupedOperands<T>{
      static_cast<const T*>(a.untyped_data()),
      packed.typed_data(),
      ScaleBytes(scale),
      global_scale.typed_data(),
      group_sizes.typed_data(),
      bias.element_count() != 0 ? static_cast<const T*>(bias.untyped_data()) : nullptr,
      static_cast<T*>(y.untyped_data()),
      shape.m,
      shape.n,
      shape.k,
      static_cast<int>(shape.g)};
}

}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_OPERANDS_H_
