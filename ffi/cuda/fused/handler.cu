// FFI handler of the fused GEMM (target jax_fp4_fused_cuda): operand checks, the tuning
// attributes, the tile choice, and the launch (ffi/cuda/fused/launch.cuh). The one translation unit
// that instantiates the fused kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/fused/config.cuh"
#include "cuda/fused/fused.h"
#include "cuda/fused/launch.cuh"
#include "cuda/fused/scheduler.cuh"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace fused_detail {  // named, not anonymous: helpers unused on non-sm_90a passes stay quiet

ffi::Error FusedCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                         ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                         ffi::AnyBuffer bias, ffi::AnyBuffer residual,
                         ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t block_size,
                         bool tiled, int64_t activation, int64_t split, int64_t tile_m,
                         int64_t tile_n, int64_t warp_specialized, int64_t stream_k,
                         bool programmatic) {
  constexpr const char* kName = "jax_fp4_fused_cuda";
  MatmulShape shape;
  bool has_residual = false;
  const std::string problem = CheckFusedMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      scale.element_type(), global_scale.element_count(), bias.element_type(), bias.element_count(),
      y->element_type(), y->dimensions(), block_size, activation, residual.element_type(),
      residual.dimensions(), &shape, &has_residual);
  auto invalid = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(kName) + ": " + what);
  };
  if (!problem.empty()) return invalid(problem);
  if (block_size != fused::kBlockSize) {
    return invalid("block_size must be 16, got " + std::to_string(block_size));
  }
  const int64_t m = shape.m, n = shape.n, k = shape.k;
  if (k <= 0 || k % fused::kKMultiple != 0) {
    return invalid("K must be a positive multiple of 128, got " + std::to_string(k));
  }
  if (m >= INT_MAX || n >= INT_MAX || k >= INT_MAX) return invalid("M, N and K must be < 2^31");
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return invalid(bad);
  }
  const bool silu = activation == 1;
  // silu_mul: the up rows start a 16-row tile of their own (StageLoader, the tiled layout's runs).
  if (silu && tiled && (n / 2) % 16 != 0) {
    return invalid("activation silu_mul on the tiled layout needs N / 2 % 16 == 0, got N = " +
                   std::to_string(n));
  }
  const int64_t n_out = silu ? n / 2 : n;
  if (CeilDiv(m, fused::kTileMLarge) > fused::kMaxMTiles) return invalid("M too large");
  const int64_t ws_needed = fused::WorkspaceElems(m, n, k);
  const int64_t ws_elems = static_cast<int64_t>(workspace->element_count());
  if (ws_elems < ws_needed) {
    return invalid("workspace must hold " + std::to_string(ws_needed) + " f32 elements");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  // Prepacked scales come by bulk copy (16-byte aligned runs), spec-layout ones 8 bytes a row.
  if (const std::string bad = CheckOperandAlignment(a.untyped_data(), packed.typed_data(),
                                                    ScaleBytes(scale), tiled ? 16 : 8);
      !bad.empty()) {
    return invalid(bad);
  }

  DeviceInfo info;
  cudaError_t err = GetDeviceInfo(&info);
  if (err != cudaSuccess) return CudaError("jax_fp4_fused_cuda: device query", err);
  if (info.sm != 90) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(kName) + ": needs an sm_90 (Hopper) device, found sm_" +
                          std::to_string(info.sm));
  }
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return CudaError("jax_fp4_fused_cuda: cudaGetDevice", err);

  // Tuning attributes (measurement only): 0 / -1 = the heuristic's choice.
  if (split < 0 || split > kMaxSplit) {
    return invalid("split must be 0 (the heuristic) or 1.." + std::to_string(kMaxSplit) + ", got " +
                   std::to_string(split));
  }
  if (tile_m != 0 && !IsTileM(tile_m)) {
    return invalid("tile_m must be 0 (the heuristic) or one of 16, 32, 64, 128, 256, got " +
                   std::to_string(tile_m));
  }
  if (!(tile_n == 0 || tile_n == 128 || tile_n == 256)) {
    return invalid("tile_n must be 0 (the heuristic), 128 or 256, got " + std::to_string(tile_n));
  }
  if (warp_specialized < -1 || warp_specialized > 1) {
    return invalid("warp_specialized must be -1 (the heuristic), 0 or 1, got " +
                   std::to_string(warp_specialized));
  }
  if (stream_k < -1 || stream_k > 1) {
    return invalid("stream_k must be -1 (the heuristic), 0 or 1, got " + std::to_string(stream_k));
  }
  FusedTuning tuning;
  tuning.split = static_cast<int>(split);
  tuning.stream_k = static_cast<int>(stream_k);
  tuning.programmatic = programmatic;
  TileChoice tile;
  tile.m = tile_m > 0 ? static_cast<int>(tile_m) : DefaultTileM(m);
  tile.n = tile_n > 0 ? static_cast<int>(tile_n) : DefaultTileN(tile.m);
  tile.ws = warp_specialized < 0 ? WarpSpecializedByDefault(tile.m) : warp_specialized == 1;
  if (tile.n != DefaultTileN(tile.m) && tile.m != 128) {
    return invalid("tile_n=" + std::to_string(tile.n) +
                   " needs 128-row activation "
                   "tiles (this call's are " +
                   std::to_string(tile.m) + " rows)");
  }
  if (tile.ws && !HasWarpSpecialized(tile.m)) {
    return invalid(
        "warp_specialized=1 needs 64-row or larger activation tiles (this "
        "call's are " +
        std::to_string(tile.m) + " rows)");
  }
  if (CeilDiv(m, tile.m) > fused::kMaxMTiles) {
    return invalid("M too large for " + std::to_string(tile.m) + "-row tiles");
  }
  if (tuning.stream_k == 1) {
    const StreamKShape sk = PlanStreamK(tile.m, tile.n, m, n, k, info.num_sms);
    if (!tile.ws || tuning.split > 0 || !sk.Fits(ws_elems) || silu || has_residual) {
      return invalid(
          "stream_k=1 needs the warp-specialized kernel, split=0, M > 64 (the workspace) and no "
          "epilogue fusion");
    }
  }

  FusedProblem operands;
  operands.a = a.untyped_data();
  operands.packed = packed.typed_data();
  operands.scale = ScaleBytes(scale);
  operands.gs = global_scale.typed_data();
  operands.bias = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  operands.y = y->untyped_data();
  operands.m = m;
  operands.n = n;
  operands.k = k;
  operands.vec_store = n_out % 4 == 0 && IsAligned(y->untyped_data(), 8);
  operands.workspace = workspace->typed_data();
  operands.workspace_elems = ws_elems;
  operands.residual = has_residual ? residual.untyped_data() : nullptr;
  operands.silu_mul = silu;
  const auto dispatch =
      a.element_type() == ffi::DataType::F16 ? DispatchFused<__half> : DispatchFused<__nv_bfloat16>;
  err = dispatch(stream, tiled, device, info.num_sms, tile, operands, tuning);
  if (err != cudaSuccess) return CudaError("jax_fp4_fused_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace fused_detail
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4FusedCuda, jax_fp4::cuda::fused_detail::FusedCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // a [M, K] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [N, K/2]
                                  .Arg<ffi::AnyBuffer>()         // scale [N, K/16] (E4M3)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global scale, one element
                                  .Arg<ffi::AnyBuffer>()         // bias [N] or [0]
                                  .Arg<ffi::AnyBuffer>()         // residual [M, N_out] or [0]
                                  .Ret<ffi::AnyBuffer>()         // y [M, N_out]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // workspace (WorkspaceElems)
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled")                // weight in the tiled layout
                                  .Attr<int64_t>("activation")        // 0 none, 1 silu_mul
                                  .Attr<int64_t>("split")             // 0 = heuristic, 1..8
                                  .Attr<int64_t>("tile_m")            // 0 = heuristic, 16..256
                                  .Attr<int64_t>("tile_n")            // 0 = heuristic, 128, 256
                                  .Attr<int64_t>("warp_specialized")  // -1 = heuristic, 0, 1
                                  .Attr<int64_t>("stream_k")          // -1 = heuristic, 0, 1
                                  .Attr<bool>("programmatic"),        // PDL
                              {ffi::Traits::kCmdBufferCompatible});
