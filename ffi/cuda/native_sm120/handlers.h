// XLA FFI handlers of the native Blackwell SM120 NVFP4 x NVFP4 path (spec sections 6 and 7).
//
//   jax_fp4_quantize_activation_cuda  (quantize.cu, every architecture)
//     a [M, K] f16/bf16, activation_scale f32 [0] (dynamic) or [1] (static)
//     -> packed u8 [M, K/2], scale u8 (swizzled [ceil(M/128), 512*ceil(K/64)] or plain [M, K/16]),
//        global_scale f32 [1], partials f32 [kActivationPartials] (scratch)
//     attrs: block_size (16), swizzled (bool)
//   jax_fp4_swizzle_scales_cuda  (quantize.cu, every architecture)
//     scale u8 [R, KB] plain row-major -> u8 [ceil(R/128), 512*ceil(KB/4)] (CUTLASS SM1xx "128x4")
//   jax_fp4_native_sm120_cuda  (gemm.cu; the GEMM runs only on compute capability 12.0
//   with an sm_120a build, and answers an error elsewhere)
//     a_packed u8 [M, K/2], a_scale u8 swizzled, a_global_scale f32 [1],
//     b_packed u8 [N, K/2], b_scale u8 swizzled, b_global_scale f32 [1], bias [N] or [0]
//     -> y [M, N] (f16/bf16, the bias dtype), workspace u8 [kNativeWorkspaceBytes]
//     attrs: block_size (16)
//
// All three are command-buffer compatible: no allocation, no synchronisation; scratch comes from
// XLA as extra outputs.
#ifndef JAX_FP4_CUDA_NATIVE_SM120_HANDLERS_H_
#define JAX_FP4_CUDA_NATIVE_SM120_HANDLERS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {

// Per-block partial maxima for the dynamic activation scale (jax_fp4/native.py mirrors these).
inline constexpr int64_t kActivationPartials = 1024;
// Workspace of the native GEMM: alpha (= a_global_scale * b_global_scale) at offset 0, CUTLASS's
// own workspace (0 bytes for the persistent scheduler used here) from
// kNativeWorkspaceCutlassOffset.
inline constexpr int64_t kNativeWorkspaceBytes = 4096;
inline constexpr int64_t kNativeWorkspaceCutlassOffset = 256;

}  // namespace jax_fp4

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4QuantizeActivationCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4SwizzleScalesCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4NativeSm120Cuda);

#endif  // JAX_FP4_CUDA_NATIVE_SM120_HANDLERS_H_
