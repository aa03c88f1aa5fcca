// FFI handlers of the mixture-of-experts block (jax_fp4.moe; kernels: the grouped GEMV of
// ffi/cuda/grouped/gemv.cuh with the stages of ffi/cuda/grouped/moe.cuh). P = T k pairs, rows in
// the routing's expert order (row r is pair order[r] = t k + j).
//
// jax_fp4_moe_gate_up_cuda: (x [T, H] f16/bf16, packed [E, 2 I, H/2] u8, scale [E, 2 I, H/16] e4m3,
//   global_scale [E] f32, group_sizes [E] s32, order [P] s32) -> (hidden [P, I] in x's type,
//   counters [T, ceil(H / 16)] s32); attributes block_size (16), tiled, top_k.
//   hidden[r] = round(silu(x[order[r] / k] @ gate_e^T) * (x[order[r] / k] @ up_e^T)) for row r of
//   expert e; rows past the groups 0. The counters come back zeroed for the down call.
// jax_fp4_moe_down_cuda: (hidden [P, I], packed [E, H, I/2] u8, scale [E, H, I/16] e4m3,
//   global_scale [E] f32, group_sizes [E] s32, order [P] s32, weights [T, k] f32, residual [T, H]
//   or [0] in hidden's type, counters [T, ceil(H / 16)] s32, aliased to result 1) -> (y [T, H],
//   counters, scratch [P, H] f32); attributes block_size (16), tiled, top_k.
//   y[t] = round(sum over j in order of weights[t, j] * (hidden[row of pair t k + j] @ down_e^T)
//   + residual[t]), pairs past the groups contributing 0.
// Both need H and I multiples of 128 and an sm_80+ device (the tensor-core GEMV), as the grouped
// GEMV; launches depend on the shapes only (capturable into CUDA graphs).
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
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

// What both handlers check beyond the grouped call's operands: top_k, order [P], P = T k, the
// counters [T, ceil(H / 16)].
std::string CheckMoeRouting(int64_t tokens, int64_t top_k, int64_t pairs, size_t order_count,
                            size_t counter_count, int64_t hidden) {
  if (top_k < 1) return "top_k must be positive, got " + std::to_string(top_k);
  if (tokens * top_k != pairs) {
    return "the rows must be T * top_k = " + std::to_string(tokens) + " * " +
           std::to_string(top_k) + ", got " + std::to_string(pairs);
  }
  if (order_count != static_cast<size_t>(pairs)) {
    return "order must hold T * top_k = " + std::to_string(pairs) + " elements, got " +
           std::to_string(order_count);
  }
  const int64_t counters = tokens * CeilDiv(hidden, 16);
  if (counter_count != static_cast<size_t>(counters)) {
    return "counters must hold T * ceil(H / 16) = " + std::to_string(counters) + " elements, got " +
           std::to_string(counter_count);
  }
  return "";
}

ffi::Error Invalid(const char* name, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
}

// The device (sm_80+) and the call's 16-byte / scale alignment, as the grouped GEMV's handler.
ffi::Error CheckDevice(const char* name, const void* a, const void* packed, const void* scale,
                       bool tiled, DeviceInfo* info) {
  if (const std::string bad = CheckOperandAlignment(a, packed, scale, tiled ? 4 : 2);
      !bad.empty()) {
    return Invalid(name, bad);
  }
  const cudaError_t err = GetDeviceInfo(info);
  if (err != cudaSuccess) return CudaError(name, err);
  if (info->sm < 80) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(name) + ": needs an sm_80+ device (mma.sync), found sm_" +
                          std::to_string(info->sm));
  }
  return ffi::Error::Success();
}

// The routing operands both block calls share: the pair order, the combine's counters (room for
// one per token and 16-column tile of H: MoeFinishPairs) and k.
template <typename T>
MoeOperands<T> RoutingOperands(ffi::Buffer<ffi::S32> order,
                               ffi::Result<ffi::Buffer<ffi::S32>>& counters, int64_t hidden_size,
                               int64_t top_k) {
  MoeOperands<T> moe;
  moe.order = order.typed_data();
  moe.counters = counters->typed_data();
  moe.counter_count = static_cast<int64_t>(counters->element_count());
  moe.counter_cols = CeilDiv(hidden_size, 16);
  moe.top_k = static_cast<int>(top_k);
  return moe;
}

template <typename T>
cudaError_t RunGateUp(cudaStream_t stream, bool tiled, const GroupedOperands<T>& p,
                      const MoeOperands<T>& moe, int num_sms) {
  GroupedLaunchConfig cfg;
  const cudaError_t err = GroupedGemvLaunchConfig(p, tiled, /*silu_mul=*/true, num_sms, &cfg);
  if (err != cudaSuccess) return err;
  const auto launch = tiled ? LaunchMoeGateUp<T, true> : LaunchMoeGateUp<T, false>;
  return launch(stream, p, moe, cfg.gemv_row_tiles, cfg.gemv_k_split);
}

template <typename T>
cudaError_t RunDown(cudaStream_t stream, bool tiled, const GroupedOperands<T>& p,
                    const MoeOperands<T>& moe, int num_sms) {
  GroupedLaunchConfig cfg;
  const cudaError_t err = GroupedGemvLaunchConfig(p, tiled, /*silu_mul=*/false, num_sms, &cfg);
  if (err != cudaSuccess) return err;
  const auto launch = tiled ? LaunchMoeDown<T, true> : LaunchMoeDown<T, false>;
  return launch(stream, p, moe, cfg.gemv_col_tiles, cfg.gemv_row_tiles, cfg.gemv_k_split);
}

ffi::Error MoeGateUpImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed,
                         ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> order,
                         ffi::Result<ffi::AnyBuffer> hidden,
                         ffi::Result<ffi::Buffer<ffi::S32>> counters, int64_t block_size,
                         bool tiled, int64_t top_k) {
  constexpr const char* kName = "jax_fp4_moe_gate_up_cuda";
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return Invalid(kName, "x must be [T, H], got " + DimsToString(x_dims));
  const int64_t tokens = x_dims[0], hidden_size = x_dims[1];
  // The grouped call's checks on the rows as the kernel reads them: [P, H], P = hidden's rows.
  const auto hidden_dims = hidden->dimensions();
  if (hidden_dims.size() != 2) {
    return Invalid(kName, "hidden must be [P, I], got " + DimsToString(hidden_dims));
  }
  const int64_t rows_dims[2] = {hidden_dims[0], hidden_size};
  GroupedShape shape;
  std::string problem = CheckGroupedOperands(
      x.element_type(), ffi::Span<const int64_t>(rows_dims, 2), packed.dimensions(),
      scale.dimensions(), scale.element_type(), global_scale.element_count(),
      group_sizes.element_count(), x.element_type(), 0, hidden->element_type(), hidden_dims,
      block_size, true, &shape);
  if (problem.empty()) problem = CheckGroupedKernelShape(shape, block_size, tiled, true);
  if (problem.empty()) {
    problem = CheckMoeRouting(tokens, top_k, shape.m, order.element_count(),
                              counters->element_count(), hidden_size);
  }
  if (!problem.empty()) return Invalid(kName, problem);
  if (tokens == 0) return ffi::Error::Success();
  DeviceInfo info;
  if (ffi::Error e = CheckDevice(kName, x.untyped_data(), packed.typed_data(), ScaleBytes(scale),
                                 tiled, &info);
      e.failure()) {
    return e;
  }
  auto run = [&](auto zero) -> cudaError_t {
    using T = decltype(zero);
    const GroupedOperands<T> p{static_cast<const T*>(x.untyped_data()),
                               packed.typed_data(),
                               ScaleBytes(scale),
                               global_scale.typed_data(),
                               group_sizes.typed_data(),
                               nullptr,
                               static_cast<T*>(hidden->untyped_data()),
                               shape.m,
                               shape.n,
                               shape.k,
                               static_cast<int>(shape.g)};
    return RunGateUp(stream, tiled, p, RoutingOperands<T>(order, counters, hidden_size, top_k),
                     info.num_sms);
  };
  const cudaError_t err =
      x.element_type() == ffi::DataType::F16 ? run(__half{}) : run(__nv_bfloat16{});
  if (err != cudaSuccess) return CudaError("jax_fp4_moe_gate_up_cuda: kernel launch", err);
  return ffi::Error::Success();
}

ffi::Error MoeDownImpl(cudaStream_t stream, ffi::AnyBuffer hidden, ffi::Buffer<ffi::U8> packed,
                       ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> order,
                       ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer residual,
                       ffi::Buffer<ffi::S32> /*counters_in: aliased to counters*/,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> counters,
                       ffi::Result<ffi::Buffer<ffi::F32>> scratch, int64_t block_size, bool tiled,
                       int64_t top_k) {
  constexpr const char* kName = "jax_fp4_moe_down_cuda";
  const auto y_dims = y->dimensions();
  if (y_dims.size() != 2) return Invalid(kName, "y must be [T, H], got " + DimsToString(y_dims));
  const int64_t tokens = y_dims[0], hidden_size = y_dims[1];
  // The grouped call's checks with y as the kernel writes its pair rows: [P, H].
  const auto hidden_dims = hidden.dimensions();
  const int64_t pair_dims[2] = {hidden_dims.size() == 2 ? hidden_dims[0] : -1, hidden_size};
  GroupedShape shape;
  std::string problem =
      CheckGroupedOperands(hidden.element_type(), hidden_dims, packed.dimensions(),
                           scale.dimensions(), scale.element_type(), global_scale.element_count(),
                           group_sizes.element_count(), hidden.element_type(), 0, y->element_type(),
                           ffi::Span<const int64_t>(pair_dims, 2), block_size, false, &shape);
  if (problem.empty()) problem = CheckGroupedKernelShape(shape, block_size, tiled, false);
  if (problem.empty()) {
    problem = CheckMoeRouting(tokens, top_k, shape.m, order.element_count(),
                              counters->element_count(), hidden_size);
  }
  if (problem.empty()) {
    const auto w_dims = weights.dimensions();
    const auto s_dims = scratch->dimensions();
    if (w_dims.size() != 2 || w_dims[0] != tokens || w_dims[1] != top_k) {
      problem = "weights must be [T, top_k] = [" + std::to_string(tokens) + ", " +
                std::to_string(top_k) + "], got " + DimsToString(w_dims);
    } else if (residual.element_count() != 0 &&
               (residual.element_type() != hidden.element_type() ||
                residual.element_count() != static_cast<size_t>(tokens * hidden_size))) {
      problem = "residual must be empty or hold T * H = " + std::to_string(tokens * hidden_size) +
                " elements of hidden's type";
    } else if (s_dims.size() != 2 || s_dims[0] != shape.m || s_dims[1] != hidden_size) {
      problem = "scratch must be [P, H] = [" + std::to_string(shape.m) + ", " +
                std::to_string(hidden_size) + "], got " + DimsToString(s_dims);
    }
  }
  if (!problem.empty()) return Invalid(kName, problem);
  if (tokens == 0 || hidden_size == 0) return ffi::Error::Success();
  DeviceInfo info;
  if (ffi::Error e = CheckDevice(kName, hidden.untyped_data(), packed.typed_data(),
                                 ScaleBytes(scale), tiled, &info);
      e.failure()) {
    return e;
  }
  auto run = [&](auto zero) -> cudaError_t {
    using T = decltype(zero);
    const GroupedOperands<T> p{
        static_cast<const T*>(hidden.untyped_data()),
        packed.typed_data(),
        ScaleBytes(scale),
        global_scale.typed_data(),
        group_sizes.typed_data(),
        nullptr,
        nullptr,  // the pair rows go to the scratch, y is written by the combine
        shape.m,
        shape.n,
        shape.k,
        static_cast<int>(shape.g)};
    MoeOperands<T> moe = RoutingOperands<T>(order, counters, hidden_size, top_k);
    moe.weights = weights.typed_data();
    moe.residual =
        residual.element_count() != 0 ? static_cast<const T*>(residual.untyped_data()) : nullptr;
    moe.pair_out = scratch->typed_data();
    moe.out = static_cast<T*>(y->untyped_data());
    return RunDown(stream, tiled, p, moe, info.num_sms);
  };
  const cudaError_t err =
      hidden.element_type() == ffi::DataType::F16 ? run(__half{}) : run(__nv_bfloat16{});
  if (err != cudaSuccess) return CudaError("jax_fp4_moe_down_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4MoeGateUpCuda, jax_fp4::cuda::MoeGateUpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, H] f16 / bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [E, 2 I, H/2]
                                  .Arg<ffi::AnyBuffer>()         // scale [E, 2 I, H/16] (E4M3)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global_scale [E]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order [T k]
                                  .Ret<ffi::AnyBuffer>()         // hidden [T k, I]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // counters [T, ceil(H / 16)]
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled")
                                  .Attr<int64_t>("top_k"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4MoeDownCuda, jax_fp4::cuda::MoeDownImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // hidden [T k, I]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [E, H, I/2]
                                  .Arg<ffi::AnyBuffer>()         // scale [E, H, I/16] (E4M3)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // global_scale [E]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order [T k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, k]
                                  .Arg<ffi::AnyBuffer>()         // residual [T, H] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counters (aliased to ret 1)
                                  .Ret<ffi::AnyBuffer>()         // y [T, H]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // counters [T, ceil(H / 16)]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scratch [T k, H]
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled")
                                  .Attr<int64_t>("top_k"),
                              {ffi::Traits::kCmdBufferCompatible});
