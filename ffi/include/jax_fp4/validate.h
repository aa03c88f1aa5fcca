// Operand checks shared by every matmul FFI handler (CPU and CUDA). The Python layer validates
// first and names the offending argument; these checks keep a handler safe when called directly.
#ifndef JAX_FP4_VALIDATE_H_
#define JAX_FP4_VALIDATE_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {

struct MatmulShape {
  int64_t m = 0, n = 0, k = 0, k_blocks = 0;
};

inline std::string DimsToString(xla::ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + "]";
}

inline bool IsActivationType(xla::ffi::DataType dtype, bool allow_f32) {
  return dtype == xla::ffi::DataType::F16 || dtype == xla::ffi::DataType::BF16 ||
         (allow_f32 && dtype == xla::ffi::DataType::F32);
}

// E4M3 block scales come as float8_e4m3fn, the type checkpoints and jax_fp4.NVFP4Weight hold
// them in, or as their uint8 bytes: taking float8 as it is keeps a bitcast_convert out of the
// caller's program, which XLA runs as a kernel copying every scale on every call. Returns "" for
// either type.
inline std::string CheckScaleType(xla::ffi::DataType dtype) {
  if (dtype == xla::ffi::DataType::F8E4M3FN || dtype == xla::ffi::DataType::U8) return "";
  return "scale must be float8_e4m3fn or uint8 (E4M3 bytes)";
}

// The bytes of a scale operand that passed CheckScaleType.
inline const uint8_t* ScaleBytes(const xla::ffi::AnyBuffer& scale) {
  return static_cast<const uint8_t*>(scale.untyped_data());
}

// Checks packed [N, K/2], scale [N, ceil(K/block)] (CheckScaleType), global scale (1 element)
// and block size; fills n, k, k_blocks. Returns "" when valid, else a description of the problem.
inline std::string CheckWeightOperands(xla::ffi::Span<const int64_t> packed_dims,
                                       xla::ffi::Span<const int64_t> scale_dims,
                                       xla::ffi::DataType scale_type, size_t global_scale_count,
                                       int64_t block_size, MatmulShape* shape) {
  if (std::string bad = CheckScaleType(scale_type); !bad.empty()) return bad;
  if (block_size <= 0) return "block_size must be positive, got " + std::to_string(block_size);
  if (packed_dims.size() != 2) return "packed must be rank 2, got " + DimsToString(packed_dims);
  shape->n = packed_dims[0];
  shape->k = 2 * packed_dims[1];
  shape->k_blocks = (shape->k + block_size - 1) / block_size;
  if (scale_dims.size() != 2 || scale_dims[0] != shape->n || scale_dims[1] != shape->k_blocks) {
    return "scale must be [" + std::to_string(shape->n) + ", " + std::to_string(shape->k_blocks) +
           "], got " + DimsToString(scale_dims);
  }
  if (global_scale_count != 1) {
    return "global_scale must hold one element, got " + std::to_string(global_scale_count);
  }
  return "";
}

// Checks that a weight [N, K] can be in the tiled layout of jax_fp4.prepack (attribute tiled):
// block size 16, N % 16 == 0, K % 128 == 0. Returns "" when it can, else the problem.
inline std::string CheckTiledLayout(const MatmulShape& shape, int64_t block_size) {
  if (block_size == 16 && shape.n % 16 == 0 && shape.k % 128 == 0) return "";
  return "the tiled layout needs block_size 16, N % 16 == 0 and K % 128 == 0, got block_size " +
         std::to_string(block_size) + ", N = " + std::to_string(shape.n) +
         ", K = " + std::to_string(shape.k);
}

// Checks a matmul's operands: a [M, K], weight operands, bias [N] or empty, y [M, N].
inline std::string CheckMatmulOperands(
    xla::ffi::DataType a_type, xla::ffi::Span<const int64_t> a_dims,
    xla::ffi::Span<const int64_t> packed_dims, xla::ffi::Span<const int64_t> scale_dims,
    xla::ffi::DataType scale_type, size_t global_scale_count, xla::ffi::DataType bias_type,
    size_t bias_count, xla::ffi::DataType y_type, xla::ffi::Span<const int64_t> y_dims,
    int64_t block_size, bool allow_f32, MatmulShape* shape) {
  std::string problem = CheckWeightOperands(packed_dims, scale_dims, scale_type, global_scale_count,
                                            block_size, shape);
  if (!problem.empty()) return problem;
  if (!IsActivationType(a_type, allow_f32)) return "a has an unsupported element type";
  if (a_dims.size() != 2 || a_dims[1] != shape->k) {
    return "a must be [M, " + std::to_string(shape->k) + "], got " + DimsToString(a_dims);
  }
  shape->m = a_dims[0];
  if (y_type != a_type) return "y must have a's element type";
  if (y_dims.size() != 2 || y_dims[0] != shape->m || y_dims[1] != shape->n) {
    return "y must be [" + std::to_string(shape->m) + ", " + std::to_string(shape->n) + "], got " +
           DimsToString(y_dims);
  }
  if (bias_count != 0 && (bias_type != a_type || bias_count != static_cast<size_t>(shape->n))) {
    return "bias must be empty or hold N = " + std::to_string(shape->n) +
           " elements of a's type, got " + std::to_string(bias_count);
  }
  return "";
}

// The epilogue fusions of a GEMV or fused GEMM call: activation 0 (none) or 1 (silu_mul: weight
// rows [0, N/2) a gate and [N/2, N) an up projection, y [M, N / 2], N even), residual [M, N_out]
// in a's type or [0] (none). Checks the product's operands (CheckMatmulOperands, y seen as the
// [M, N] product) and then the fusions'; *has_residual says whether the residual is a real one.
inline std::string CheckFusedMatmulOperands(
    xla::ffi::DataType a_type, xla::ffi::Span<const int64_t> a_dims,
    xla::ffi::Span<const int64_t> packed_dims, xla::ffi::Span<const int64_t> scale_dims,
    xla::ffi::DataType scale_type, size_t global_scale_count, xla::ffi::DataType bias_type,
    size_t bias_count, xla::ffi::DataType y_type, xla::ffi::Span<const int64_t> y_dims,
    int64_t block_size, int64_t activation, xla::ffi::DataType residual_type,
    xla::ffi::Span<const int64_t> residual_dims, MatmulShape* shape, bool* has_residual) {
  if (activation != 0 && activation != 1) {
    return "activation must be 0 (none) or 1 (silu_mul), got " + std::to_string(activation);
  }
  const bool silu = activation == 1;
  if (silu && (y_dims.size() != 2 || packed_dims.size() != 2 || packed_dims[0] % 2 != 0 ||
               2 * y_dims[1] != packed_dims[0])) {
    return "activation silu_mul needs an even N and y [M, N / 2], got packed " +
           DimsToString(packed_dims) + " and y " + DimsToString(y_dims);
  }
  const int64_t product_dims[2] = {y_dims.size() == 2 ? y_dims[0] : 0,
                                   y_dims.size() == 2 ? y_dims[1] * (silu ? 2 : 1) : 0};
  std::string problem = CheckMatmulOperands(
      a_type, a_dims, packed_dims, scale_dims, scale_type, global_scale_count, bias_type,
      bias_count, y_type, silu ? xla::ffi::Span<const int64_t>(product_dims, 2) : y_dims,
      block_size, /*allow_f32=*/false, shape);
  if (!problem.empty()) return problem;
  const int64_t n_out = silu ? shape->n / 2 : shape->n;
  *has_residual = !(residual_dims.size() == 1 && residual_dims[0] == 0);
  if (*has_residual && (residual_type != a_type || residual_dims.size() != 2 ||
                        residual_dims[0] != shape->m || residual_dims[1] != n_out)) {
    return "residual must be [0] or [M, N_out] = [" + std::to_string(shape->m) + ", " +
           std::to_string(n_out) + "] in a's element type, got " + DimsToString(residual_dims);
  }
  return "";
}

}  // namespace jax_fp4

#endif  // JAX_FP4_VALIDATE_H_
