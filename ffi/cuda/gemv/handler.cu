// CUDA decode GEMV: y[m, n] = round((sum_k a[m,k] * e2m1(code) * e4m3(scale[n, k/16])) * gs
//                                   + bias[n]),
// fp32 accumulation, NVFP4 weights decoded in registers (no dequantized copy of W). Two kernels:
//
// * GemvMmaKernel (attribute tensor_cores; sm_80+, K % 128 == 0 or the tiled layout): mma.sync
// m16n8k16 with the WEIGHT in the A slot
//   (16 output columns) and the activations in the B slot (8 rows of M; at M > 8 each decoded
//   weight fragment feeds two such row tiles unless row tiling is off). See the fragment table
//   above the kernel. The E4M3 block scale is folded into the decoded 16-bit weight before the
//   mma (exact), global scale and bias are applied in the epilogue. Device code in
//   ffi/cuda/gemv/mma.cuh (benchmarks/probes/gemv_probe.cu times variants of it). It reads the
//   weight in the spec layout, or (attribute tiled) in the tiled layout of jax_fp4.prepack
//   (jax_fp4/layout.py).
// * GemvScalarKernel (tensor_cores false; spec layout, any K % 32 == 0; ffi/cuda/gemv/scalar.cuh):
// a warp per output column, 32 K elements (one 16-byte load
//   of packed weight, two scale blocks) per lane per step, per-block fp32 partial sums, a warp
//   shuffle reduction, and row tiling (RowsPerBlock rows of M share each decoded weight).
//
// Both are deterministic (fixed work split and reduction order) and never touch memory outside
// their operands: ragged N is clamped on loads and masked on stores, rows past M are never read.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/gemv/launch.cuh"
#include "cuda/handlers.h"
#include "jax_fp4/gemv_config.h"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

ffi::Error GemvCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                        ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::F32> global_scale,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, int64_t block_size,
                        bool tiled, bool tensor_cores, bool row_tiling, int64_t col_tiles,
                        int64_t k_split, int64_t rows_per_block, bool programmatic) {
  MatmulShape shape;
  const std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      global_scale.element_count(), bias.element_type(), bias.element_count(), y->element_type(),
      y->dimensions(), block_size, /*allow_f32=*/false, &shape);
  if (!problem.empty()) return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + problem);
  if (block_size != 16) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: block_size must be 16, got " +
                                       std::to_string(block_size));
  }
  if (shape.k % 32 != 0) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: K must be a multiple of 32, got " +
                                       std::to_string(shape.k));
  }
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + bad);
  }
  // The kernel variant is the caller's choice (jax_fp4.dispatch); this only checks that it runs.
  if (tiled && !tensor_cores) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: tiled=true needs tensor_cores=true (the scalar kernel reads the spec "
        "layout only)");
  }
  if (tensor_cores && !tiled && shape.k % kGemvWindow != 0) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: tensor_cores=true needs K % 128 == 0 on the spec layout, got K = " +
        std::to_string(shape.k));
  }
  // Tuning attributes: 0 = the launch heuristic's choice.
  if (!(col_tiles == 0 || col_tiles == 1 || col_tiles == 2)) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: col_tiles must be 0 (the heuristic), 1 or 2, got " +
        std::to_string(col_tiles));
  }
  if (k_split < 0) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: k_split must be 0 (the heuristic) or >= 1, got " +
        std::to_string(k_split));
  }
  if (!(rows_per_block == 0 || rows_per_block == 1 || rows_per_block == 2 || rows_per_block == 4)) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: rows_per_block must be 0 (the heuristic), 1, 2 or 4, got " +
        std::to_string(rows_per_block));
  }
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  const void* bias_data = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  // 16-byte vector loads of a and packed (rows are 16-byte multiples since K % 32 == 0); the
  // tiled layout's scales are read 4 bytes at a time.
  if (!IsAligned(a.untyped_data(), 16) || !IsAligned(packed.untyped_data(), 16) ||
      !IsAligned(scale.untyped_data(), tiled ? 4 : 2)) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: a and packed must be 16-byte aligned and scale 2-byte aligned "
        "(4-byte for the tiled layout)");
  }

  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: device query", err);
  if (tensor_cores && info.sm < 80) {
    return ffi::Error::InvalidArgument(
        "jax_fp4_gemv_cuda: tensor_cores=true needs an sm_80+ device, this one is sm_" +
        std::to_string(info.sm));
  }
  const bool f16 = a.element_type() == ffi::DataType::F16;
  GemvResidentWarps warps{};
  if (tensor_cores) {
    err = f16 ? (tiled ? GetGemvResidentWarps<__half, true>(&warps)
                       : GetGemvResidentWarps<__half, false>(&warps))
              : (tiled ? GetGemvResidentWarps<__nv_bfloat16, true>(&warps)
                       : GetGemvResidentWarps<__nv_bfloat16, false>(&warps));
    if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: occupancy query", err);
  }
  GemvLaunchConfig cfg = gemv_launch_config(shape.m, shape.n, shape.k, info.num_sms, tiled, warps);
  if (col_tiles != 0 && col_tiles != cfg.col_tiles) {
    cfg.col_tiles = static_cast<int>(col_tiles);
    cfg.k_split = gemv_mma_split(shape.m, shape.n, shape.k, info.num_sms, tiled, warps,
                                 cfg.col_tiles, cfg.row_tiles);
  }
  if (k_split != 0) {  // clamped into the block's warp budget
    cfg.k_split = static_cast<int>(
        std::min<int64_t>(k_split, GemvMmaShape{cfg.col_tiles, cfg.row_tiles, tiled}.max_split()));
  }
  if (rows_per_block != 0) cfg.rows_per_block = static_cast<int>(rows_per_block);
  // Programmatic dependent launch: the tensor-core kernel on sm_90+ (elsewhere a plain launch).
  const bool pdl = programmatic && info.sm >= 90;

  const auto launch = f16 ? LaunchGemv<__half> : LaunchGemv<__nv_bfloat16>;
  err = launch(stream, a.untyped_data(), packed.typed_data(), scale.typed_data(),
               global_scale.typed_data(), bias_data, y->untyped_data(), shape.m, shape.n, shape.k,
               tensor_cores, tiled, row_tiling, cfg, pdl);
  if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4GemvCuda, jax_fp4::cuda::GemvCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // a [M, K] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // scale [N, K/16] (E4M3 bytes)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global scale, one element
                                  .Arg<ffi::AnyBuffer>()         // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()         // y [M, N]
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled")         // weight in the tiled layout
                                  .Attr<bool>("tensor_cores")  // mma.sync kernel, else scalar
                                  .Attr<bool>("row_tiling")
                                  .Attr<int64_t>("col_tiles")       // 0 = heuristic, 1 or 2
                                  .Attr<int64_t>("k_split")         // 0 = heuristic, >= 1
                                  .Attr<int64_t>("rows_per_block")  // 0 = heuristic, 1, 2, 4
                                  .Attr<bool>("programmatic"),      // PDL on sm_90+
                              {ffi::Traits::kCmdBufferCompatible});
