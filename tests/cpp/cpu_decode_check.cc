// The CPU kernel's vector decode (ffi/cpu/matmul.cc, DecodeE2M1Lanes) against nvfp4.h's scalar
// e2m1_to_float, for every code in every word position, on both layouts, and its fp16 activation
// conversion (ToFloats, a vectorized loop of nvfp4.h's fp16_bits_to_float) against the value each
// of the 65536 halves encodes: built and run by tests/test_cpu_decode.py with each C++ compiler at
// hand (GCC takes __builtin_shuffle, Clang the lane-by-lane table). Prints the number of
// mismatches; exits 1 if there are any.
#include <cmath>
#include <cstdio>
#include <vector>

#include "cpu/matmul.cc"

int main() {
  using jax_fp4::Float8;
  using jax_fp4::Word8;
  const Float8 ones = {1, 1, 1, 1, 1, 1, 1, 1};
  int mismatches = 0;
  uint32_t state = 12345;
  for (int trial = 0; trial < 4096; ++trial) {
    Word8 spec_words = {}, tiled_words = {};
    for (int lane = 0; lane < 8; ++lane) {
      state = state * 1664525u + 1013904223u;  // every code lands in every position many times
      spec_words[lane] = state;
      uint32_t tiled = 0;  // the tiled layout's word of the same eight codes
      for (int e = 0; e < 8; ++e) {
        for (int bit = 0; bit < 4; ++bit) {
          tiled |= ((state >> (4 * e + bit)) & 1u) << jax_fp4::tiled_code_bit(e, bit);
        }
      }
      tiled_words[lane] = tiled;
    }
    for (int e = 0; e < 8; ++e) {
      Float8 spec, tiled;
      jax_fp4::DecodeE2M1Lanes<false>(spec_words, e, ones, &spec);
      jax_fp4::DecodeE2M1Lanes<true>(tiled_words, e, ones, &tiled);
      for (int lane = 0; lane < 8; ++lane) {
        const uint32_t want =
            jax_fp4::float_to_bits(jax_fp4::e2m1_to_float(spec_words[lane] >> (4 * e)));
        mismatches += jax_fp4::float_to_bits(spec[lane]) != want;
        mismatches += jax_fp4::float_to_bits(tiled[lane]) != want;
      }
    }
  }
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h < 65536; ++h) halves[h] = static_cast<uint16_t>(h);
  std::vector<float> floats(65536);
  jax_fp4::ToFloats(halves.data(), xla::ffi::DataType::F16, 65536, floats.data());
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    const double magnitude =
        exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, int(exponent) - 25);
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t want = exponent == 0x1Fu
                              ? sign | 0x7F800000u | (mantissa << 13)  // inf, NaN with its payload
                              : sign | jax_fp4::float_to_bits(static_cast<float>(magnitude));
    mismatches += jax_fp4::float_to_bits(floats[h]) != want;
  }
  std::printf("%d\n", mismatches);
  return mismatches != 0;
}
