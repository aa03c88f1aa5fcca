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
//
// Epilogue fusions (GemvFusion in ffi/cuda/gemv/common.cuh), optional: a call with the operands
// residual and row_sq_sum and the attributes activation and norm_eps runs the kernels' fused
// instances; a call without them (5 operands, the plain attributes) is the plain GEMV.
//   residual [M, N_out] (a's type), added in f32 before the rounding, or [0];
//   row_sq_sum [M] (f32), or [0]: each row's product scaled by rsqrt(row_sq_sum / K + norm_eps)
//     (norm_eps: f32), an RMSNorm whose a * norm_weight the caller has applied;
//   activation (i64): 0 none, 1 silu_mul (rows [0, N/2) gate, [N/2, N) up; y [M, N/2]; N even;
//     tiled: N/2 % 16 == 0; tensor cores: two column tiles, col_tiles 0 or 2).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + what);
}

// The attributes: the plain call's eight, and the one a fused call adds. Read from the
// dictionary of all attributes (so that the fusion one can be absent); any other name is an
// error, so that a misspelt attribute is not silently ignored.
constexpr std::string_view kPlainAttributes[] = {"block_size",     "tiled",       "tensor_cores",
                                                 "row_tiling",     "col_tiles",   "k_split",
                                                 "rows_per_block", "programmatic"};
constexpr std::string_view kFusionAttributes[] = {"activation", "norm_eps"};

template <typename V>
ffi::Error ReadAttribute(const ffi::Dictionary& attrs, std::string_view name, V* out) {
  if (!attrs.contains(name)) return Invalid("missing attribute " + std::string(name));
  ffi::ErrorOr<V> value = attrs.get<V>(name);
  if (!value.has_value()) {
    return Invalid("attribute " + std::string(name) + " has the wrong type (" +
                   value.error().message() + ")");
  }
  *out = *value;
  return ffi::Error::Success();
}

// The epilogue fusions of a call: the residual and row_sq_sum operands' data (or nullptr),
// silu_mul, and the RMSNorm's epsilon and K.
template <typename T>
GemvFusion<T> Fusion(const void* residual, bool silu_mul, const float* row_sq_sum, float eps,
                     int64_t k) {
  GemvFusion<T> fusion;
  fusion.residual = static_cast<const T*>(residual);
  fusion.silu_mul = silu_mul;
  fusion.row_sq_sum = row_sq_sum;
  fusion.norm_eps = eps;
  fusion.norm_k = static_cast<float>(k);
  return fusion;
}

struct GemvAttributes {
  int64_t block_size = 0;
  bool tiled = false, tensor_cores = false, row_tiling = false;
  int64_t col_tiles = 0, k_split = 0, rows_per_block = 0;
  bool programmatic = false;
  bool fused = false;  // the fusion attributes are present
  int64_t activation = 0;
  float norm_eps = 0.0f;
};

ffi::Error ReadAttributes(const ffi::Dictionary& attrs, GemvAttributes* out) {
  for (const std::string_view name : attrs) {
    const bool known = std::find(std::begin(kPlainAttributes), std::end(kPlainAttributes), name) !=
                           std::end(kPlainAttributes) ||
                       std::find(std::begin(kFusionAttributes), std::end(kFusionAttributes),
                                 name) != std::end(kFusionAttributes);
    if (!known) return Invalid("unknown attribute " + std::string(name));
  }
  ffi::Error err;
  if ((err = ReadAttribute(attrs, "block_size", &out->block_size)).failure()) return err;
  if ((err = ReadAttribute(attrs, "tiled", &out->tiled)).failure()) return err;
  if ((err = ReadAttribute(attrs, "tensor_cores", &out->tensor_cores)).failure()) return err;
  if ((err = ReadAttribute(attrs, "row_tiling", &out->row_tiling)).failure()) return err;
  if ((err = ReadAttribute(attrs, "col_tiles", &out->col_tiles)).failure()) return err;
  if ((err = ReadAttribute(attrs, "k_split", &out->k_split)).failure()) return err;
  if ((err = ReadAttribute(attrs, "rows_per_block", &out->rows_per_block)).failure()) return err;
  if ((err = ReadAttribute(attrs, "programmatic", &out->programmatic)).failure()) return err;
  out->fused = attrs.contains("activation") || attrs.contains("norm_eps");
  if (out->fused) {
    if ((err = ReadAttribute(attrs, "activation", &out->activation)).failure()) return err;
    if ((err = ReadAttribute(attrs, "norm_eps", &out->norm_eps)).failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error GemvCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                        ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                        ffi::AnyBuffer bias, std::optional<ffi::AnyBuffer> residual,
                        std::optional<ffi::AnyBuffer> row_sq_sum, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Dictionary attrs) {
  GemvAttributes at;
  if (ffi::Error err = ReadAttributes(attrs, &at); err.failure()) return err;
  const int64_t block_size = at.block_size, col_tiles = at.col_tiles, k_split = at.k_split;
  const int64_t rows_per_block = at.rows_per_block;
  const bool tiled = at.tiled, tensor_cores = at.tensor_cores, row_tiling = at.row_tiling;
  const bool programmatic = at.programmatic;
  if (residual.has_value() != at.fused || row_sq_sum.has_value() != at.fused) {
    return Invalid(
        "a fused call passes the operands residual and row_sq_sum and the attributes activation "
        "and norm_eps, a plain call none of them");
  }
  const bool silu = at.activation == 1;
  // A plain call checks as one with no fusions (an empty residual).
  static constexpr int64_t kNoResidual[1] = {0};
  MatmulShape shape;
  bool has_residual = false;
  const std::string problem = CheckFusedMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      scale.element_type(), global_scale.element_count(), bias.element_type(), bias.element_count(),
      y->element_type(), y->dimensions(), block_size, at.activation,
      residual.has_value() ? residual->element_type() : a.element_type(),
      residual.has_value() ? residual->dimensions() : ffi::Span<const int64_t>(kNoResidual, 1),
      &shape, &has_residual);
  if (!problem.empty()) return Invalid(problem);
  const void* residual_data = has_residual ? residual->untyped_data() : nullptr;
  const float* row_sq_sum_data = nullptr;
  if (row_sq_sum.has_value() && row_sq_sum->element_count() != 0) {
    if (row_sq_sum->element_type() != ffi::DataType::F32 ||
        row_sq_sum->element_count() != shape.m) {
      return Invalid("row_sq_sum must be float32 [M] = [" + std::to_string(shape.m) +
                     "], or [0] for none; got " + std::to_string(row_sq_sum->element_count()) +
                     " elements");
    }
    row_sq_sum_data = static_cast<const float*>(row_sq_sum->untyped_data());
  }
  // The kernels index scales as one per 16 weights: another block size would read past them.
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
  if (silu && tiled && (shape.n / 2) % kGemvTileCols != 0) {
    return Invalid("activation silu_mul on the tiled layout needs N / 2 % 16 == 0, got N = " +
                   std::to_string(shape.n));
  }
  if (silu && tensor_cores && col_tiles == 1) {
    return Invalid(
        "activation silu_mul on tensor cores runs two column tiles (a gate and an up tile per "
        "warp): col_tiles must be 0 or 2, got 1");
  }
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();
  const void* bias_data = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  // 16-byte vector loads of a and packed (rows are 16-byte multiples since K % 32 == 0); the
  // tiled layout's scales are read 4 bytes at a time.
  if (const std::string bad = CheckOperandAlignment(a.untyped_data(), packed.untyped_data(),
                                                    scale.untyped_data(), tiled ? 4 : 2);
      !bad.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_gemv_cuda: " + bad);
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
  // Programmatic dependent launch: the tensor-core kernel on sm_90+ (elsewhere a plain launch).
  const bool pdl = programmatic && info.sm >= 90;
  GemvResidentWarps warps{};
  if (tensor_cores) {
    err = f16 ? (tiled ? GetGemvResidentWarps<__half, true>(&warps)
                       : GetGemvResidentWarps<__half, false>(&warps))
              : (tiled ? GetGemvResidentWarps<__nv_bfloat16, true>(&warps)
                       : GetGemvResidentWarps<__nv_bfloat16, false>(&warps));
    if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: occupancy query", err);
  }
  GemvLaunchConfig cfg = gemv_launch_config(shape.m, shape.n, shape.k, info.num_sms, tiled, warps);
  // silu_mul pairs a gate and an up tile in each warp: two column tiles, the split for them.
  const int64_t want_col_tiles = silu && tensor_cores ? 2 : col_tiles;
  if (want_col_tiles != 0 && want_col_tiles != cfg.col_tiles) {
    cfg.col_tiles = static_cast<int>(want_col_tiles);
    cfg.k_split = gemv_mma_split(shape.m, shape.n, shape.k, info.num_sms, tiled, warps,
                                 cfg.col_tiles, cfg.row_tiles);
  }
  if (k_split != 0) {  // clamped into the block's warp budget
    cfg.k_split = static_cast<int>(
        std::min<int64_t>(k_split, GemvMmaShape{cfg.col_tiles, cfg.row_tiles, tiled}.max_split()));
  }
  if (rows_per_block != 0) cfg.rows_per_block = static_cast<int>(rows_per_block);
  auto launch = [&](auto type_tag) {
    using T = decltype(type_tag);
    return LaunchGemv<T>(stream, a.untyped_data(), packed.typed_data(), ScaleBytes(scale),
                         global_scale.typed_data(), bias_data, y->untyped_data(), shape.m, shape.n,
                         shape.k, tensor_cores, tiled, row_tiling, cfg, pdl,
                         Fusion<T>(residual_data, silu, row_sq_sum_data, at.norm_eps, shape.k));
  };
  err = f16 ? launch(__half{}) : launch(__nv_bfloat16{});
  if (err != cudaSuccess) return CudaError("jax_fp4_gemv_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4GemvCuda, jax_fp4::cuda::GemvCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // a [M, K] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [N, K/2]
                                  .Arg<ffi::AnyBuffer>()          // scale [N, K/16] (E4M3)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // global scale, one element
                                  .Arg<ffi::AnyBuffer>()          // bias [N] or [0]
                                  .OptionalArg<ffi::AnyBuffer>()  // residual [M, N_out] or [0]
                                  .OptionalArg<ffi::AnyBuffer>()  // row_sq_sum [M] (f32) or [0]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N_out]
                                  // block_size:i64, tiled (weight in the tiled layout),
                                  // tensor_cores (mma.sync kernel, else scalar), row_tiling,
                                  // col_tiles (0 = heuristic, 1 or 2), k_split (0 = heuristic,
                                  // >= 1), rows_per_block (0 = heuristic, 1, 2, 4), programmatic
                                  // (PDL on sm_90+); fused calls: activation:i64,
                                  // norm_eps:f32
                                  .Attrs(),
                              {ffi::Traits::kCmdBufferCompatible});
