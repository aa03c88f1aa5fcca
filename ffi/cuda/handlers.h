// XLA FFI handlers of the CUDA module. Plain declarations: module.cc (C++, nanobind) includes this
// header and never sees CUDA; the handlers are defined in gemv/handler.cu, dequant.cu, routing.cu
// and grouped/ (the fused GEMM's in fused/fused.h, the native SM120 path's in
// native_sm120/handlers.h). Block scales "e4m3": float8_e4m3fn or its uint8 bytes, either one
// (jax_fp4/validate.h CheckScaleType).
#ifndef JAX_FP4_CUDA_HANDLERS_H_
#define JAX_FP4_CUDA_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

// Fused decode GEMV: (a [M,K] f16/bf16, packed [N,K/2] u8, scale [N,K/16] e4m3, global_scale
// f32[1], bias [N] or [0]) -> y [M,N]; attrs block_size (== 16), tiled, tensor_cores, row_tiling,
// col_tiles, k_split, rows_per_block, programmatic. K % 32 == 0.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4GemvCuda);

// Dequantize: (packed [N,K/2] u8, scale [N,ceil(K/bs)] e4m3, global_scale f32[1]) -> w [N,K]
// f16/bf16; attr block_size (any > 0).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4DequantCuda);

// Grouped (mixture-of-experts) decode GEMV: (a [M,K] f16/bf16, packed [G,N,K/2] u8, scale
// [G,N,K/16] e4m3, global_scale [G] f32, group_sizes [G] s32, bias [G,N] or [0]) -> y [M,N]; attrs
// block_size (== 16), tiled. K % 128 == 0, sm_80+ (ffi/cuda/grouped/gemv_handler.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4GroupedGemvCuda);

// Grouped fused GEMM (sm_90a): the same operands with a in the fused GEMM's fragment K order ->
// (y [M,N], workspace u8 [W]); attrs block_size (== 16), tiled (ffi/cuda/grouped/gemm_handler.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4GroupedGemmCuda);

// Top-k routing of a mixture-of-experts layer: (logits [T,E] f32/f16/bf16) -> (weights [T,k] f32,
// experts [T,k] s32, order [T k] s32, inverse [T k] s32, group_sizes [E] s32); attrs k,
// renormalize. One block: T k <= 1024, E <= 4096 (ffi/cuda/routing.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4TopKRoutingCuda);

// The mixture-of-experts block's two products (ffi/cuda/grouped/moe_handler.cu): gate/up, (x [T,H],
// packed [E,2I,H/2] u8, scale [E,2I,H/16] e4m3, global_scale [E] f32, group_sizes [E] s32, order
// [T k] s32) -> (hidden [T k,I], counters [T,ceil(H/16)] s32); down, (hidden, packed [E,H,I/2],
// scale, global_scale, group_sizes, order, weights [T,k] f32, residual [T,H] or [0], counters) ->
// (y [T,H], counters, scratch [T k,H] f32). Attrs block_size (== 16), tiled, top_k.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4MoeGateUpCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4MoeDownCuda);

#endif  // JAX_FP4_CUDA_HANDLERS_H_
