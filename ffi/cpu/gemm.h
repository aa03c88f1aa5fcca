// The CPU kernel (ffi/cpu/matmul.cc) as a function the CPU handlers share: one product of the
// activations with one NVFP4 weight, or several weights each multiplying its own rows (the
// grouped handler, ffi/cpu/grouped.cc).
#ifndef JAX_FP4_CPU_GEMM_H_
#define JAX_FP4_CPU_GEMM_H_

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {

// One weight and the rows of A (and Y) it multiplies.
struct CpuGemmGroup {
  int64_t row0 = 0, rows = 0;
  const uint8_t* packed = nullptr;  // [N, K/2] codes, the spec or the tiled layout
  const uint8_t* scale = nullptr;   // [N, ceil(K/block_size)] E4M3 bytes (same layout)
  float global_scale = 1.0f;
  const void* bias = nullptr;  // [N] in A's dtype, or nullptr: no bias
};

// What every group shares: the activations, the result and the weights' shape.
struct CpuGemm {
  const void* a = nullptr;                             // [M, K] in `dtype`, row-major
  void* y = nullptr;                                   // [M, N] in `dtype`, row-major
  xla::ffi::DataType dtype = xla::ffi::DataType::F32;  // F16, BF16 or F32
  int64_t n = 0, k = 0, block_size = 0;
  bool tiled = false;  // the weights in the tiled layout (block_size 16, N % 16 == 0, K % 128 == 0)
  bool avx512 = true;  // the AVX-512 panel product where the CPU has it (the same bits)
};

// y[r] = a[r] @ dequant(W_g)^T * global_scale_g (+ bias_g), accumulated in fp32 and rounded once to
// the dtype, for every row r of every group g; rows of y outside the groups are not written. Groups
// must not overlap. A row's result does not depend on how many rows its group has. The work is
// shared out over XLA's intra-op threads when it is large enough.
void RunCpuGemm(xla::ffi::ThreadPool thread_pool, const CpuGemm& gemm,
                const std::vector<CpuGemmGroup>& groups);

}  // namespace jax_fp4

#endif  // JAX_FP4_CPU_GEMM_H_
