// XLA FFI handlers of the CPU module.
#ifndef JAX_FP4_CPU_HANDLERS_H_
#define JAX_FP4_CPU_HANDLERS_H_

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
// The instruction sets the CPU kernel runs on this CPU, e.g. "x86-64-v3 (AVX2, FMA)", for calls
// whose `avx512` attribute is `avx512`: its builds are chosen at run time, and the AVX2 and plain
// builds differ in the last bits (FMA).
std::string CpuKernelBuilds(bool avx512);
}  // namespace jax_fp4

// Fused decode + dot: (a [M,K], packed, scale, global_scale, bias [N] or [0]) -> y [M,N];
// attrs block_size, tiled, avx512.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4MatmulCpu);

// Grouped (ragged) product, rows of a sorted by group: (a [M,K], packed [G,N,K/2], scale
// [G,N,ceil(K/block)], global_scale [G], group_sizes s32 [G], bias [G,N] or [0]) -> y [M,N];
// attrs block_size, tiled, avx512.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4GroupedMatmulCpu);

#endif  // JAX_FP4_CPU_HANDLERS_H_
