// FFI handler of the grouped decode GEMV (target jax_fp4_grouped_gemv_cuda; kernel in
// ffi/cuda/grouped/gemv.cuh):
//
//   y[rows of group g] = round(a[rows of g] @ dequant(w[g])^T * gs[g] + bias[g]),
//
// rows past the groups 0; with the attribute activation = 1 (silu_mul) each group's weight is a
// gate [0, N/2) and up [N/2, N) pair and y [M, N/2] = round(silu(gate product) * up product), one
// rounding (the decode GEMV's fused epilogue). Operands (a [M, K] f16/bf16, packed [G, N, K/2] u8,
// scale [G, N, K/16] E4M3 (tiled: jax_fp4.prepack's arrays stacked on G), global_scale [G] f32,
// group_sizes [G] s32, bias [G, N] or [0] in a's dtype) -> y [M, N] (silu_mul: [M, N/2]);
// attributes block_size (16), tiled and activation (0 none, 1 silu_mul). Needs K % 128 == 0 and an
// sm_80+ device (the tensor-core GEMV). The launch depends on the shapes only: the group offsets
// are found on the device, so the call is capturable into a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/grouped/config.h"
#include "cuda/grouped/gemv.cuh"
#include "cuda/grouped/operands.h"
#include "cuda/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

template <typename T>
cudaError_t RunGroupedGemv(cudaStream_t stream, bool tiled, bool silu_mul,
                           const GroupedOperands<T>& p, int num_sms) {
  GroupedLaunchConfig cfg;
  const cudaError_t err = GroupedGemvLaunchConfig(p, tiled, silu_mul, num_sms, &cfg);
  if (err != cudaSuccess) return err;
  const auto launch = tiled ? LaunchGroupedGemv<T, true> : LaunchGroupedGemv<T, false>;
  return launch(stream, p, cfg.gemv_col_tiles, cfg.gemv_row_tiles, cfg.gemv_k_split, silu_mul);
}

ffi::Error GroupedGemvCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                               ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                               ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> y, int64_t block_size, bool tiled,
                               int64_t activation) {
  constexpr const char* kName = "jax_fp4_grouped_gemv_cuda";
  auto invalid = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(kName) + ": " + what);
  };
  if (activation != 0 && activation != 1) {
    return invalid("activation must be 0 (none) or 1 (silu_mul), got " +
                   std::to_string(activation));
  }
  const bool silu_mul = activation == 1;
  GroupedShape shape;
  const std::string problem = CheckGroupedCall(a, packed, scale, global_scale, group_sizes, bias,
                                               *y, block_size, tiled, silu_mul, &shape);
  if (!problem.empty()) return invalid(problem);
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  // 16-byte loads of a and packed rows (K % 128 == 0 keeps every row and expert aligned), 2-byte
  // scale pairs (tiled: 4-byte words).
  if (const std::string bad = CheckOperandAlignment(a.untyped_data(), packed.typed_data(),
                                                    ScaleBytes(scale), tiled ? 4 : 2);
      !bad.empty()) {
    return invalid(bad);
  }
  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_grouped_gemv_cuda: device query", err);
  if (info.sm < 80) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(kName) + ": needs an sm_80+ device (mma.sync), found sm_" +
                          std::to_string(info.sm));
  }
  if (a.element_type() == ffi::DataType::F16) {
    const auto p =
        MakeGroupedOperands<__half>(a, packed, scale, global_scale, group_sizes, bias, *y, shape);
    err = RunGroupedGemv(stream, tiled, silu_mul, p, info.num_sms);
  } else {
    const auto p = MakeGroupedOperands<__nv_bfloat16>(a, packed, scale, global_scale, group_sizes,
                                                      bias, *y, shape);
    err = RunGroupedGemv(stream, tiled, silu_mul, p, info.num_sms);
  }
  if (err != cudaSuccess) return CudaError("jax_fp4_grouped_gemv_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4GroupedGemvCuda, jax_fp4::cuda::GroupedGemvCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // a [M, K] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [G, N, K/2]
                                  .Arg<ffi::AnyBuffer>()         // scale [G, N, K/16] (E4M3)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global_scale [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Arg<ffi::AnyBuffer>()         // bias [G, N] or [0]
                                  .Ret<ffi::AnyBuffer>()         // y [M, N] or [M, N/2]
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled")           // weights in the tiled layout
                                  .Attr<int64_t>("activation"),  // 0 none, 1 silu_mul
                              {ffi::Traits::kCmdBufferCompatible});
