// FFI handler of the grouped fused GEMM for sm_90a (target jax_fp4_grouped_gemm_cuda; kernel in
// ffi/cuda/grouped/gemm.cuh):
//
//   y[rows of group g] = round(a[rows of g] @ dequant(w[g])^T * gs[g] + bias[g]),
//
// rows past the groups 0. Operands (a [M, K] f16/bf16 in the fused GEMM's fragment K order
// (jax_fp4/fused.py: to_fragment_order), packed [G, N, K/2] u8, scale [G, N, K/16] E4M3
// (tiled: jax_fp4.prepack's arrays stacked on G), global_scale [G] f32, group_sizes [G] s32, bias
// [G, N] or [0] in a's dtype) -> (y [M, N], workspace u8 [W]); attributes block_size (16) and
// tiled. W = GroupedGemmWorkspaceBytes (0: the kernel needs none; the result keeps the interface
// open for a schedule that does). Needs K % 128 == 0, ceil(M / BM) + min(G, M) <= 65535 slots
// (always true for ceil(M / 64) + G <= 65535), and a compute capability 9.0 device. The launch
// depends on the shapes only: the tile schedule is found on the device, so the call is capturable
// into a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/grouped/config.h"
#include "cuda/grouped/gemm.cuh"
#include "cuda/grouped/operands.h"
#include "cuda/grouped/schedule.cuh"
#include "cuda/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

constexpr int64_t kMaxGridY = 65535;

ffi::Error GroupedGemmCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                               ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                               ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t block_size,
                               bool tiled) {
  constexpr const char* kName = "jax_fp4_grouped_gemm_cuda";
  auto invalid = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(kName) + ": " + what);
  };
  GroupedShape shape;
  const std::string problem =
      CheckGroupedCall(a, packed, scale, global_scale, group_sizes, bias, *y, block_size, tiled,
                       /*silu_mul=*/false, &shape);
  if (!problem.empty()) return invalid(problem);
  const int64_t ws_needed = GroupedGemmWorkspaceBytes(shape.m, shape.n, shape.k, shape.g);
  if (static_cast<int64_t>(workspace->element_count()) < ws_needed) {
    return invalid("workspace must hold " + std::to_string(ws_needed) + " bytes, got " +
                   std::to_string(workspace->element_count()));
  }
  const int tile_m = GroupedGemmTileM(shape.m, shape.g);
  if (GroupedSlots(shape.m, shape.g, tile_m) > kMaxGridY) {
    return invalid("ceil(M / " + std::to_string(tile_m) + ") + min(G, M) must be at most " +
                   std::to_string(kMaxGridY) + ", got M = " + std::to_string(shape.m) +
                   ", G = " + std::to_string(shape.g));
  }
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  // TMA activation tiles and 16-byte weight copies; scales 8 bytes a row (tiled: 128-byte runs by
  // bulk copy). K % 128 == 0 keeps every expert's slices as aligned as the arrays.
  if (const std::string bad = CheckOperandAlignment(a.untyped_data(), packed.typed_data(),
                                                    ScaleBytes(scale), tiled ? 16 : 8);
      !bad.empty()) {
    return invalid(bad);
  }
  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_grouped_gemm_cuda: device query", err);
  if (info.sm != 90) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(kName) + ": needs an sm_90 (Hopper) device, found sm_" +
                          std::to_string(info.sm));
  }
  const bool vec_store = shape.n % 4 == 0 && IsAligned(y->untyped_data(), 8);
  using fused_detail::LaunchGroupedGemm;
  if (a.element_type() == ffi::DataType::F16) {
    const auto p =
        MakeGroupedOperands<__half>(a, packed, scale, global_scale, group_sizes, bias, *y, shape);
    err = tiled ? LaunchGroupedGemm<__half, true>(stream, p, tile_m, vec_store)
                : LaunchGroupedGemm<__half, false>(stream, p, tile_m, vec_store);
  } else {
    using B = __nv_bfloat16;
    const auto p =
        MakeGroupedOperands<B>(a, packed, scale, global_scale, group_sizes, bias, *y, shape);
    err = tiled ? LaunchGroupedGemm<B, true>(stream, p, tile_m, vec_store)
                : LaunchGroupedGemm<B, false>(stream, p, tile_m, vec_store);
  }
  if (err != cudaSuccess) return CudaError("jax_fp4_grouped_gemm_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4GroupedGemmCuda, jax_fp4::cuda::GroupedGemmCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // a [M, K], fragment K order
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [G, N, K/2]
                                  .Arg<ffi::AnyBuffer>()         // scale [G, N, K/16] (E4M3)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global_scale [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Arg<ffi::AnyBuffer>()         // bias [G, N] or [0]
                                  .Ret<ffi::AnyBuffer>()         // y [M, N]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // workspace (none needed)
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled"),  // weights in the tiled layout
                              {ffi::Traits::kCmdBufferCompatible});
