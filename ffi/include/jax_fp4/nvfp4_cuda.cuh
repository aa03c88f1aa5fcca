// Device-only packed NVFP4 decode helpers for the CUDA kernels (bit tricks on top of nvfp4.h).
//
// nvfp4.h is the definition of the format; everything here computes the same values with fewer
// instructions and is checked against it by tests/test_gemv_kernel.py (through the kernels).
// No cuda_fp4.h conversion intrinsics (emulated in software on sm_90) and no run-time-indexed
// local arrays: every helper works on whole 32-bit registers.
//
// E2M1 nibble -> 16-bit float, two elements per 32-bit register ("natural pairs": the low half
// holds the even element, the high half the odd one, like a half2 loaded from memory):
//   put the nibble in the top 4 bits of a 16-bit half (sign lands on bit 15), then move the
//   3 exponent/mantissa bits down so that they become the low 2 exponent bits and the top
//   mantissa bit of the target format. The one E2M1 subnormal (0.5, code 1) then lands on the
//   target's subnormal encoding, so the result is EXACT for every code:
//     fp16: bits (em << 9) | sign  ==  e2m1 * 2^-14
//     bf16: bits (em << 6) | sign  ==  e2m1 * 2^-126
//   Code 0x8 (-0) decodes to -0, which behaves as 0 in every sum.
#ifndef JAX_FP4_NVFP4_CUDA_CUH_
#define JAX_FP4_NVFP4_CUDA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "cuda/ptx.cuh"  // prmt, cvt_f16x2_e4m3x2, ld_stream_u4 (every inline PTX is there)
#include "jax_fp4/nvfp4.h"

namespace jax_fp4 {
namespace cuda {

template <typename T>
struct HalfTraits;

template <>
struct HalfTraits<__half> {
  using Pair = __half2;
  // decode: 16-bit value = e2m1 * 2^kDecodeExp
  static constexpr int kDecodeExp = -14;
  static constexpr int kEmShift = 3;  // nibble EM bits 14..12 -> 11..9
  static constexpr uint32_t kEmMask = 0x0E000E00u;
  // Block scale pre-multiplied by 2^kScaleExp so that decode * scale = e2m1 * e4m3 * 2^-7, exact:
  // fp16: 2^-14 * 2^7; e4m3 * 2^7 <= 57344 fits fp16, products 2^-17 .. 21 keep <= 6 significant
  // bits above fp16's subnormal step 2^-24.
  static constexpr float kScaleMul = 128.0f;  // 2^7
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ __forceinline__ static uint32_t pair_from_floats(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 pair_to_float2(uint32_t bits) {
    __half2 h = *reinterpret_cast<__half2*>(&bits);
    return __half22float2(h);
  }
  __device__ __forceinline__ static uint32_t pair_mul(uint32_t x, uint32_t y) {
    __half2 r = __hmul2(*reinterpret_cast<__half2*>(&x), *reinterpret_cast<__half2*>(&y));
    return *reinterpret_cast<uint32_t*>(&r);
  }
};

template <>
struct HalfTraits<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr int kDecodeExp = -126;
  static constexpr int kEmShift = 6;  // nibble EM bits 14..12 -> 8..6
  static constexpr uint32_t kEmMask = 0x01C001C0u;
  // bf16: decode is e2m1 * 2^-126, scale * 2^119 (448 * 2^119 < 2^128), product e2m1*e4m3*2^-7.
  static constexpr float kScaleMul = 6.6461399789245794e35f;  // 2^119
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
  __device__ __forceinline__ static uint32_t pair_from_floats(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 pair_to_float2(uint32_t bits) {
    // bf16 -> fp32 is a shift: exact and cheaper than a conversion instruction.
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u));
  }
  __device__ __forceinline__ static uint32_t pair_mul(uint32_t x, uint32_t y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    __nv_bfloat162 r =
        __hmul2(*reinterpret_cast<__nv_bfloat162*>(&x), *reinterpret_cast<__nv_bfloat162*>(&y));
    return *reinterpret_cast<uint32_t*>(&r);
#else
    float2 a = pair_to_float2(x), b = pair_to_float2(y);
    return pair_from_floats(a.x * b.x, a.y * b.y);
#endif
  }
};

// The two E2M1 codes of byte `i` (0..3) of `q` as one 16-bit-float pair (low half = low nibble =
// even element). `q4` must be q << 4. Value: e2m1 * 2^HalfTraits<T>::kDecodeExp, exact.
template <typename T, int i>
__device__ __forceinline__ uint32_t decode_e2m1_pair(uint32_t q, uint32_t q4) {
  // Byte 1 of x = q4.byte_i (low nibble of byte i in its top 4 bits), byte 3 = q.byte_i (high
  // nibble in its top 4 bits); bytes 0 and 2 are don't-care and masked away below.
  const uint32_t x = prmt(q4, q, (i << 4) | ((4 + i) << 12));
  return (x & 0x80008000u) | ((x >> HalfTraits<T>::kEmShift) & HalfTraits<T>::kEmMask);
}

// "Split pairs" (the tensor-core GEMV's order): elements j and j + 4 of a packed word, whose
// nibbles lie 16 bits apart, as one pair (low half = element j). With nibble j at bit p (p = 0 or
// 4; j = 2, 3 read q >> 8), one mask and one integer multiply move both nibbles' EM and sign bits
// to where the 16-bit float wants them (the multiply adds shifted copies that do not overlap: a
// shift-and-or on the FMA pipe), and for bf16 one more mask keeps just those bits: 2 ALU-pipe
// instructions per pair instead of the 4 (PRMT, shift, 2 masks) of decode_e2m1_pair. Same exact
// values. The activations must be paired the same way (split_activation_pair).
template <typename T, int j>
__device__ __forceinline__ uint32_t decode_e2m1_split_pair(uint32_t q) {
  static_assert(j >= 0 && j < 4, "j indexes the word's first four elements");
  const uint32_t x = j >= 2 ? q >> 8 : q;
  constexpr int p = 4 * (j & 1);
  if constexpr (std::is_same_v<T, __half>) {
    // EM -> bits 9..11 (shift 9 - p), sign -> 15 (shift 12 - p): whole-nibble copies would overlap
    // at bit 12, so EM and sign are masked apart and added.
    const uint32_t em = x & (0x00070007u << p), sign = x & (0x00080008u << p);
    return em * (1u << (9 - p)) + sign * (1u << (12 - p));
  } else {
    // EM -> bits 6..8 (shift 6 - p), sign -> 15 (shift 12 - p): the copies [6, 9] and [12, 15]
    // (and [22, 25], [28, 31] for the high half) are disjoint.
    const uint32_t nibbles = x & (0x000F000Fu << p);
    return (nibbles * ((1u << (6 - p)) + (1u << (12 - p)))) & 0x81C081C0u;
  }
}

// The activation pair that meets decode_e2m1_split_pair<T, j>: elements (j, j + 4) of a word's 8
// activations, given as natural pairs lo = (x0, x1) or (x2, x3) and hi = (x4, x5) or (x6, x7)
// (the ones holding x_j and x_{j+4}).
template <int j>
__device__ __forceinline__ uint32_t split_activation_pair(uint32_t lo, uint32_t hi) {
  return prmt(lo, hi, (j & 1) ? 0x7632u : 0x5410u);
}

// The tiled layout (jax_fp4/layout.py: jax_fp4.prepack's) keeps a word's elements in adjacent
// pairs p = (2p, 2p + 1): pair 0 at the bf16 positions (mantissa 6, exponent 7-8, sign 15; +16 for
// the odd element), pairs 1 and 2 rotated left by 3 and 6 bits, pair 3 at bits {4, 0, 1, 3} (+16),
// which one multiply by 0x1084 (copies shifted by 2, 7 and 12 that do not overlap) carries to
// {6, 7, 8, 15}. Pair p as a 16-bit-float pair (low half = element 2p), e2m1 * 2^kDecodeExp,
// exact: bf16 one mask; fp16 moves the three EM bits up by 3. 1-3 ALU instructions (pair 0)
// to 3-5 (pair 3), against 2-4 for decode_e2m1_split_pair, and the activations need no permutes.
template <typename T, int p>
__device__ __forceinline__ uint32_t decode_tiled_pair(uint32_t q) {
  static_assert(p >= 0 && p < 4, "a word holds four pairs");
  uint32_t x;
  if constexpr (p == 0) {
    x = q;
  } else if constexpr (p == 3) {
    x = (q & 0x001B001Bu) * 0x1084u;
  } else {
    x = __funnelshift_r(q, q, 3 * p);
  }
  if constexpr (std::is_same_v<T, __half>) {
    return ((x & 0x01C001C0u) << 3) | (x & 0x80008000u);
  } else {
    return x & 0x81C081C0u;
  }
}

// E4M3FN byte (low 8 bits of b) -> fp32, exact, NaN for 0x7F / 0xFF. Same values as
// e4m3_to_float in nvfp4.h: the 7 magnitude bits placed at fp32 bits 26..20 read as
// e4m3 * 2^-120 (subnormals included: they become fp32 subnormals), then an exact power-of-two
// multiply. Needs denormal support (no -ftz / --use_fast_math for this file).
__device__ __forceinline__ float e4m3_to_float_fast(uint32_t b) {
  const uint32_t mag_bits = (b & 0x7Fu) << 20;
  float mag = __uint_as_float(mag_bits) * 1.329227995784916e36f;  // 2^120
  mag = (mag_bits == (0x7Fu << 20)) ? __uint_as_float(0x7FC00000u) : mag;
  return __uint_as_float(__float_as_uint(mag) | ((b & 0x80u) << 24));
}

// Two E4M3 block-scale bytes (b0 = low byte of `bytes`, b1) as the 16-bit pairs the decode
// multiplies by: lo = {s0, s0}, hi = {s1, s1} with s = e4m3 * HalfTraits<T>::kScaleMul, so that
// decode * scale = e2m1 * e4m3 * 2^-7 exactly. NaN bytes give NaN.
template <typename T>
__device__ __forceinline__ void e4m3x2_scale_pairs(uint32_t bytes, uint32_t& lo, uint32_t& hi) {
  using Tr = HalfTraits<T>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // sm_89+: one cvt turns both E4M3 bytes into an exact fp16 pair (NaN stays NaN).
  const uint32_t h2 = cvt_f16x2_e4m3x2(bytes);
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t scaled = Tr::pair_mul(h2, 0x58005800u);  // x {128, 128}: <= 57344, exact
    lo = prmt(scaled, 0u, 0x1010u);
    hi = prmt(scaled, 0u, 0x3232u);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    lo = Tr::pair_from_floats(f.x * Tr::kScaleMul, f.x * Tr::kScaleMul);
    hi = Tr::pair_from_floats(f.y * Tr::kScaleMul, f.y * Tr::kScaleMul);
  }
#else
  const float s0 = e4m3_to_float_fast(bytes & 0xFFu) * Tr::kScaleMul;
  const float s1 = e4m3_to_float_fast((bytes >> 8) & 0xFFu) * Tr::kScaleMul;
  lo = Tr::pair_from_floats(s0, s0);
  hi = Tr::pair_from_floats(s1, s1);
#endif
}

// Read-only cached 16-byte load (activations: re-read by many warps).
__device__ __forceinline__ uint4 ld_u4(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_NVFP4_CUDA_CUH_
