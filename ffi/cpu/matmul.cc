// CPU XLA FFI handler: Y = A @ dequant(W)^T (+ bias), fused.
//
// Weight rows are decoded a tile at a time into a small fp32 buffer and consumed at once, so the
// dequantized [N, K] matrix never exists; accumulation is fp32, the global scale and bias are applied
// once per output in the epilogue, then the result is rounded to A's dtype.
#include "cpu/handlers.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "jax_fp4/nvfp4.h"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace {

constexpr int64_t kRowTile = 8;  // weight rows decoded together; 8 * K floats stay in L1/L2

float load_as_float(const void* data, ffi::DataType dtype, int64_t i) {
  switch (dtype) {
    case ffi::DataType::F16:
      return fp16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
    case ffi::DataType::BF16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

void store_from_float(void* data, ffi::DataType dtype, int64_t i, float value) {
  switch (dtype) {
    case ffi::DataType::F16:
      static_cast<uint16_t*>(data)[i] = float_to_fp16_bits(value);
      break;
    case ffi::DataType::BF16:
      static_cast<uint16_t*>(data)[i] = float_to_bf16_bits(value);
      break;
    default:
      static_cast<float*>(data)[i] = value;
  }
}

ffi::Error MatmulCpuImpl(ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scale,
                         ffi::Buffer<ffi::F32> global_scale, ffi::AnyBuffer bias,
                         ffi::Result<ffi::AnyBuffer> y, int64_t block_size) {
  MatmulShape shape;
  const std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      global_scale.element_count(), bias.element_type(), bias.element_count(), y->element_type(),
      y->dimensions(), block_size, /*allow_f32=*/true, &shape);
  if (!problem.empty()) return ffi::Error::InvalidArgument("jax_fp4_matmul_cpu: " + problem);

  const int64_t m_rows = shape.m, n_cols = shape.n, k = shape.k;
  const ffi::DataType dtype = a.element_type();
  const void* a_data = a.untyped_data();
  void* y_data = y->untyped_data();
  if (m_rows == 0 || n_cols == 0) return ffi::Error::Success();

  // Activations once in fp32, row-major [M, K].
  std::vector<float> a_f32(static_cast<size_t>(m_rows * k));
  for (int64_t i = 0; i < m_rows * k; ++i) a_f32[i] = load_as_float(a_data, dtype, i);

  const uint8_t* packed_data = packed.typed_data();
  const uint8_t* scale_data = scale.typed_data();
  const int64_t packed_stride = k / 2;
  const int64_t scale_stride = shape.k_blocks;
  const float gscale = global_scale.typed_data()[0];
  const bool has_bias = bias.element_count() != 0;

  std::vector<float> w_tile(static_cast<size_t>(kRowTile * k));
  for (int64_t n0 = 0; n0 < n_cols; n0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, n_cols - n0);
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* packed_row = packed_data + (n0 + r) * packed_stride;
      const uint8_t* scale_row = scale_data + (n0 + r) * scale_stride;
      float* w_row = w_tile.data() + r * k;
      for (int64_t kb = 0; kb < shape.k_blocks; ++kb) {
        const float block_scale = e4m3_to_float(scale_row[kb]);
        const int64_t k_end = std::min(k, (kb + 1) * block_size);
        for (int64_t kk = kb * block_size; kk < k_end; ++kk) {
          w_row[kk] = e2m1_to_float(packed_code(packed_row, kk)) * block_scale;
        }
      }
    }
    for (int64_t mi = 0; mi < m_rows; ++mi) {
      const float* a_row = a_f32.data() + mi * k;
      for (int64_t r = 0; r < rows; ++r) {
        const float* w_row = w_tile.data() + r * k;
        float acc = 0.0f;
        for (int64_t kk = 0; kk < k; ++kk) acc += a_row[kk] * w_row[kk];
        float out = acc * gscale;
        if (has_bias) out += load_as_float(bias.untyped_data(), dtype, n0 + r);
        store_from_float(y_data, dtype, mi * n_cols + n0 + r, out);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4MatmulCpu, jax_fp4::MatmulCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // a [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scale [N, ceil(K/block)]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // global scale, one element
                                  .Arg<ffi::AnyBuffer>()          // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N]
                                  .Attr<int64_t>("block_size"));
