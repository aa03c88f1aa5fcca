// Fused NVFP4 x FP16/BF16 GEMM for sm_90a (Hopper): FFI target "jax_fp4_fused_cuda".
//
//   y[M, N] = round((sum_k a[m, k] * e2m1(packed[n, k]) * e4m3(scale[n, k / 16])) * gs + bias[n])
//
// Operands: a [M, K] f16/bf16; packed u8 [N, K/2]; scale [N, K/16] E4M3 (float8_e4m3fn or its
// u8 bytes); global_scale f32 [1] (device memory); bias [N] in a's dtype or [0]; residual
// [M, N_out] in a's dtype or [0]. Results: y [M, N_out] in a's dtype and an f32 workspace of
// WorkspaceElems(M, N, K) elements: the stream-K decomposition's partial tiles and per-tile
// arrival counters (M > 64); empty otherwise (split-K inside a thread-block cluster reduces on
// chip through distributed shared memory).
// Attributes: block_size (int64, must be 16), tiled (bool), activation (int64: 0 none, 1
// silu_mul: rows [0, N/2) gate, [N/2, N) up, N_out = N / 2; tiled: N / 2 % 16 == 0), and the
// tuning attributes split, tile_m, tile_n (0 = the heuristic), warp_specialized, stream_k (-1 =
// the heuristic) and programmatic (bool); see fused/handler.cu. The epilogue fusions (activation,
// residual) are applied in f32 before the one rounding, as the GEMV's fused instances do.
//
// Constraints (the handler returns InvalidArgument otherwise; jax_fp4/fused.py mirrors them):
//   a is f16 or bf16, block_size == 16, K % 128 == 0 and K > 0, M >= 1, N >= 1,
//   ceil(M / 128) <= 65535, M, N, K < 2^31, a / packed 16-byte aligned, scale 8-byte aligned,
//   and the device is compute capability 9.0 (the kernel is built for sm_90a only).
#ifndef JAX_FP4_CUDA_FUSED_FUSED_H_
#define JAX_FP4_CUDA_FUSED_FUSED_H_

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace fused {

inline constexpr int64_t kBlockSize = 16;   // NVFP4 block size, the only one served
inline constexpr int64_t kKMultiple = 128;  // K per pipeline stage
inline constexpr int64_t kMaxMTiles = 65535;
inline constexpr int64_t kTileMLarge =
    128;  // the smallest activation tile above M = 64 (bounds the M tiles)

inline constexpr int64_t kMaxStreamKCtas = 132;          // the most SMs of an sm_90 part
inline constexpr int64_t kStreamKTileElems = 128 * 256;  // the largest CTA tile (BM x TN)

// f32 elements of the workspace result for an [M, K] x [N, K]^T problem: for M > 64 (the 128-
// and 256-row tiles, where the warp-specialized kernel may run stream-K), one fp32 partial tile
// per stream-K CTA and one int32 arrival counter per tile; 0 up to M = 64. A bound over the tiles
// the kernel may use (128 x 256 and 256 x 128); the launch checks the size it needs and keeps to
// cluster split-K if it does not fit.
// A pure function of the shape, kept in sync with jax_fp4/fused.py:fused_workspace_elems.
inline constexpr int64_t WorkspaceElems(int64_t m, int64_t n, int64_t k) {
  if (m <= 64) return 0;
  const int64_t m128 = (m + 127) / 128, n128 = (n + 127) / 128;
  const int64_t tiles = std::max(m128 * ((n + 255) / 256), ((m + 255) / 256) * n128);
  const int64_t ctas = std::min(kMaxStreamKCtas, tiles * (k / kKMultiple));
  return ctas * kStreamKTileElems + m128 * n128;
}

}  // namespace fused
}  // namespace jax_fp4

// (a, packed, scale, global_scale, bias, residual) -> (y, workspace); attributes above.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4FusedCuda);

#endif  // JAX_FP4_CUDA_FUSED_FUSED_H_
