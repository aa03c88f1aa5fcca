// NVFP4 decode helpers shared by the CPU handler and the CUDA kernels.
//
// Format (see README / ONNX Runtime MatMulBlockQuantizedFp4Weight):
//   packed uint8 [N, K/2]: element 2j in the low nibble, 2j+1 in the high nibble;
//   E2M1 code: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; no Inf/NaN;
//   scale uint8 [N, ceil(K/block)]: raw E4M3FN (bias 7, NaN at 0x7F/0xFF, no Inf);
//   W[n, k] = e2m1(code) * e4m3(scale[n, k / block]) * global_scale.
//
// Everything here is branch-light scalar arithmetic that compiles for host and device alike;
// the CUDA kernels use packed bit tricks on top of these for throughput, and the tests check
// both against these definitions.
#ifndef JAX_FP4_NVFP4_H_
#define JAX_FP4_NVFP4_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAX_FP4_HD __host__ __device__ __forceinline__
#else
#define JAX_FP4_HD inline
#endif

namespace jax_fp4 {

JAX_FP4_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

JAX_FP4_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// E2M1 code (low 4 bits of `code`) -> float. Magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; 0x8 is -0.
JAX_FP4_HD float e2m1_to_float(uint32_t code) {
  const uint32_t exponent = (code >> 1) & 3u;
  const uint32_t mantissa = code & 1u;
  // Normal codes map onto an fp32 with exponent (e - 1 + 127); the one subnormal (0.5) and zero
  // are handled by the select, which the compiler turns into a predicated move.
  const uint32_t normal_bits = ((exponent + 126u) << 23) | (mantissa << 22);
  const uint32_t magnitude_bits = exponent ? normal_bits : (mantissa ? 0x3F000000u : 0u);
  return bits_to_float(magnitude_bits | ((code & 8u) << 28));
}

// E4M3FN byte -> float (exact). Bias 7, subnormals m * 2^-9, NaN at S.1111.111, no Inf.
JAX_FP4_HD float e4m3_to_float(uint32_t byte) {
  const uint32_t sign = (byte & 0x80u) << 24;
  const uint32_t exponent = (byte >> 3) & 0xFu;
  const uint32_t mantissa = byte & 7u;
  if (exponent == 0xFu && mantissa == 7u) return bits_to_float(sign | 0x7FC00000u);
  if (exponent == 0u) {
    // m * 2^-9, m in 0..7: exact in fp32 through an integer conversion.
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);
    return (sign ? -magnitude : magnitude);
  }
  return bits_to_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// The E2M1 code of logical element k of one packed weight row.
JAX_FP4_HD uint32_t packed_code(const uint8_t* packed_row, int64_t k) {
  return (packed_row[k >> 1] >> ((k & 1) * 4)) & 0xFu;
}

// The tiled layout of jax_fp4.prepack (jax_fp4/layout.py has the definition; N % 16 == 0,
// K % 128 == 0, block size 16; W = K / 128 windows). Row r sits in 16-row tile r / 16, row half
// (r / 8) % 2, lane group g = r % 8.
// Byte offset of row r's 16 packed bytes of window w, quarter t (elements 128 w + 32 t .. + 31).
JAX_FP4_HD int64_t tiled_packed_offset(int64_t row, int64_t window, int64_t quarter,
                                       int64_t windows) {
  return (((row / 16) * windows + window) * 2 + (row / 8) % 2) * 512 +
         ((row % 8) * 4 + quarter) * 16;
}

// Byte offset of row r's scale of block b (elements 16 b .. 16 b + 15).
JAX_FP4_HD int64_t tiled_scale_offset(int64_t row, int64_t block, int64_t windows) {
  const int64_t window = block / 8, lane = (row % 8) * 4 + (block % 8) / 2;
  return (((row / 16) * windows + window) * 32 + lane) * 4 + 2 * ((row / 8) % 2) + block % 2;
}

// Where element e (0..7) of a tiled 32-bit word (little-endian bytes) keeps bit `bit` of its E2M1
// code (0 mantissa, 1-2 exponent, 3 sign): element e = 2 p + h keeps them at the bf16 positions
// 6, 7, 8, 15 (+16 h), the word rotated left by 3 p, for pairs p = 0..2, and at 4, 0, 1, 3 (+16 h)
// for pair 3.
JAX_FP4_HD constexpr int tiled_code_bit(int e, int bit) {
  const int p = e / 2, h = 16 * (e % 2);
  return p < 3 ? ((bit < 3 ? 6 + bit : 15) + h + 3 * p) % 32
               : (bit == 0 ? 4 : (bit == 3 ? 3 : bit - 1)) + h;
}

// 16-bit float conversions for host code (device code uses cuda_fp16/cuda_bf16 intrinsics).
JAX_FP4_HD float bf16_bits_to_float(uint16_t bits) {
  return bits_to_float(static_cast<uint32_t>(bits) << 16);
}

JAX_FP4_HD uint16_t float_to_bf16_bits(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
    return static_cast<uint16_t>((bits >> 16) | 0x40u);     // quiet NaN
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Branch-free, so that a loop of it vectorizes. Exact: subnormal halves become m * 2^-24, a normal
// float, so flushing denormals (as XLA's CPU threads do) changes nothing.
JAX_FP4_HD float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  const uint32_t inf_or_nan = sign | 0x7F800000u | (mantissa << 13);
  const float subnormal = static_cast<float>(static_cast<int32_t>(mantissa)) * (1.0f / 16777216.0f);
  const uint32_t zero_or_subnormal = sign | float_to_bits(subnormal);
  // Selects by masks: GCC does not if-convert the nested conditional for its vectorizer.
  const uint32_t low = 0u - static_cast<uint32_t>(exponent == 0u);
  const uint32_t high = 0u - static_cast<uint32_t>(exponent == 0x1Fu);
  return bits_to_float((zero_or_subnormal & low) | (inf_or_nan & high) | (normal & ~(low | high)));
}

JAX_FP4_HD uint16_t float_to_fp16_bits(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (abs_bits >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to Inf
  if (abs_bits < 0x38800000u) {
    // Result is subnormal (or zero): scale to units of 2^-24 and round to nearest even.
    const float magnitude = bits_to_float(abs_bits) * 16777216.0f;
    float integral = static_cast<float>(static_cast<uint32_t>(magnitude));
    const float fraction = magnitude - integral;
    const uint32_t units = static_cast<uint32_t>(integral);
    uint32_t rounded = units;
    if (fraction > 0.5f || (fraction == 0.5f && (units & 1u))) rounded += 1u;
    return static_cast<uint16_t>(sign | rounded);
  }
  const uint32_t rounding = 0xFFFu + ((abs_bits >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((abs_bits - 0x38000000u + rounding) >> 13));
}

}  // namespace jax_fp4

#endif  // JAX_FP4_NVFP4_H_
