// Top-k routing of a mixture-of-experts layer in one kernel (target jax_fp4_top_k_routing_cuda):
//
//   (logits [T, E] f16/bf16/f32) -> weights [T, k] f32, experts [T, k] s32, order [T k] s32,
//                                   inverse [T k] s32, group_sizes [E] s32;
//   attributes k and renormalize.
//
// experts[t] are token t's k largest logits in descending order (the lower expert on ties; NaN
// above +inf, -0 equal to +0), weights[t] their softmax probabilities in float32 (exp(l - max)
// over the row's sum, or over the k chosen ones' sum when renormalize), order the T k (token,
// slot) pairs stably sorted by expert, inverse its inverse permutation and group_sizes the pairs
// of each expert: what jax_fp4.route_top_k returns (jax_fp4/routing.py, whose XLA composition of
// softmax, top_k and a sort takes six kernels at decode sizes).
//
// One block of kThreads threads does it all, so it serves up to kRoutingMaxPairs pairs and
// kRoutingMaxExperts experts (jax_fp4.dispatch.ROUTING_BLOCK_MAX_PAIRS / _EXPERTS; "auto" takes
// it up to dispatch.ROUTING_KERNEL_MAX_PAIRS): a warp per token picks the top k in k rounds of a
// warp arg-max over (logit, expert) keys, two redux.sync a round with each lane holding its best
// key not yet taken, and counts the pairs of each expert in shared memory; one warp then scans
// the counts and places the pairs 32 at a time in pair order (__match_any_sync ranks the lanes
// that share an expert), which keeps the sort stable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "cuda/common.cuh"
#include "cuda/handlers.h"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kRoutingMaxPairs = 1024;
constexpr int64_t kRoutingMaxExperts = 4096;

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

// A total order of (logit, expert) as one integer: the larger logit first, then the lower expert.
// The float's bits made monotone (negatives flipped whole, positives' sign bit set; -0 read as
// +0, positive NaNs above +inf), above the complement of the expert. Every key is nonzero.
__device__ __forceinline__ uint64_t RoutingKey(float logit, int expert) {
  uint32_t bits = __float_as_uint(logit);
  if (bits == 0x80000000u) bits = 0;  // -0 ties with +0
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(ordered) << 32) | (0xffffffffu - static_cast<uint32_t>(expert));
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

// The largest of this lane's keys (experts lane, lane + 32, ...) below `below`; 0 when none is.
template <typename T>
__device__ __forceinline__ uint64_t LaneBestBelow(const T* __restrict__ row, int experts,
                                                  uint64_t below) {
  uint64_t best = 0;
  for (int e = threadIdx.x & 31; e < experts; e += 32) {
    const uint64_t key = RoutingKey(ToFloat(row[e]), e);
    if (key < below && key > best) best = key;
  }
  return best;
}

// Token t's top k: chosen experts and weights written, each pair's expert kept in pair_expert and
// counted in `counts`, the unnormalised weights staged in pair_weight. Called by the 32 lanes of
// one warp. Each lane keeps its best key not yet taken; a round takes the warp's largest with two
// redux.sync (the logit half, then the lowest expert among the lanes holding it), and only the
// lane that won reads its logits again. The winning logit comes back from its key, so every lane
// knows the round's weight with no shuffle, and lane j % 32 keeps round j's.
template <typename T>
__device__ void RouteToken(const T* __restrict__ row, int experts, int k, bool renormalize,
                           float* __restrict__ weights, int32_t* __restrict__ chosen,
                           int32_t* pair_expert, float* pair_weight, int32_t* counts) {
  const int lane = threadIdx.x & 31;
  float row_max = -INFINITY;
  for (int e = lane; e < experts; e += 32) row_max = fmaxf(row_max, ToFloat(row[e]));
  row_max = WarpMax(row_max);
  float row_sum = 0.0f;
  for (int e = lane; e < experts; e += 32) row_sum += expf(ToFloat(row[e]) - row_max);
  row_sum = WarpSum(row_sum);

  uint64_t best = LaneBestBelow(row, experts, ~0ull);
  float chosen_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    const uint32_t ordered = static_cast<uint32_t>(best >> 32);
    const uint32_t top = __reduce_max_sync(0xffffffffu, ordered);
    const uint32_t expert = __reduce_min_sync(
        0xffffffffu, ordered == top ? 0xffffffffu - static_cast<uint32_t>(best) : 0xffffffffu);
    const uint32_t bits = (top & 0x80000000u) ? (top & 0x7fffffffu) : ~top;  // RoutingKey undone
    const float p = expf(__uint_as_float(bits) - row_max);
    chosen_sum += p;
    if (lane == (j & 31)) {
      pair_expert[j] = static_cast<int32_t>(expert);
      pair_weight[j] = p;
    }
    if (0xffffffffu - static_cast<uint32_t>(best) == expert) {
      best = LaneBestBelow(row, experts, best);
    }
  }
  __syncwarp();
  const float denominator = renormalize ? chosen_sum : row_sum;
  for (int j = lane; j < k; j += 32) {
    const int32_t expert = pair_expert[j];
    chosen[j] = expert;
    weights[j] = pair_weight[j] / denominator;
    atomicAdd(counts + expert, 1);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    TopKRoutingKernel(const T* __restrict__ logits, int64_t tokens, int experts, int k,
                      bool renormalize, float* __restrict__ weights, int32_t* __restrict__ chosen,
                      int32_t* __restrict__ order, int32_t* __restrict__ inverse,
                      int32_t* __restrict__ group_sizes) {
  extern __shared__ int32_t shared[];
  const int64_t pairs = tokens * k;
  int32_t* pair_expert = shared;                                  // [pairs]
  float* pair_weight = reinterpret_cast<float*>(shared + pairs);  // [pairs]
  int32_t* cursor = shared + 2 * pairs;  // [experts]: counts, then each expert's next row
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) cursor[e] = 0;
  __syncthreads();
  for (int64_t t = warp; t < tokens; t += blockDim.x >> 5) {
    RouteToken(logits + t * experts, experts, k, renormalize, weights + t * k, chosen + t * k,
               pair_expert + t * k, pair_weight + t * k, cursor);
  }
  __syncthreads();
  if (warp != 0) return;

  // Counts out, then their exclusive scan in place: each expert's first row.
  int32_t running = 0;
  for (int base = 0; base < experts; base += 32) {
    const int e = base + lane;
    const int32_t count = e < experts ? cursor[e] : 0;
    int32_t inclusive = count;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    if (e < experts) {
      group_sizes[e] = count;
      cursor[e] = running + inclusive - count;
    }
    running += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  __syncwarp();

  // The pairs in order, 32 at a time: a lane's row is its expert's cursor plus the lanes before
  // it with the same expert; the last of those lanes moves the cursor on.
  const uint32_t lanes_before = (1u << lane) - 1u;
  for (int64_t base = 0; base < pairs; base += 32) {
    const int64_t p = base + lane;
    const bool active = p < pairs;
    const int expert = active ? pair_expert[p] : -1 - lane;  // idle lanes match nobody
    const uint32_t peers = __match_any_sync(0xffffffffu, expert);
    int32_t row = 0;
    if (active) {
      row = cursor[expert] + __popc(peers & lanes_before);
      order[row] = static_cast<int32_t>(p);
      inverse[p] = row;
    }
    __syncwarp();
    if (active && lane == 31 - __clz(peers)) cursor[expert] = row + 1;
    __syncwarp();
  }
}

template <typename T>
cudaError_t LaunchTopKRouting(cudaStream_t stream, const void* logits, int64_t tokens,
                              int64_t experts, int64_t k, bool renormalize, float* weights,
                              int32_t* chosen, int32_t* order, int32_t* inverse,
                              int32_t* group_sizes) {
  const size_t smem = static_cast<size_t>(2 * tokens * k + experts) * sizeof(int32_t);
  TopKRoutingKernel<T><<<1, kThreads, smem, stream>>>(
      static_cast<const T*>(logits), tokens, static_cast<int>(experts), static_cast<int>(k),
      renormalize, weights, chosen, order, inverse, group_sizes);
  return cudaGetLastError();
}

ffi::Error TopKRoutingCudaImpl(cudaStream_t stream, ffi::AnyBuffer logits,
                               ffi::Result<ffi::Buffer<ffi::F32>> weights,
                               ffi::Result<ffi::Buffer<ffi::S32>> chosen,
                               ffi::Result<ffi::Buffer<ffi::S32>> order,
                               ffi::Result<ffi::Buffer<ffi::S32>> inverse,
                               ffi::Result<ffi::Buffer<ffi::S32>> group_sizes, int64_t k,
                               bool renormalize) {
  const std::string name = "jax_fp4_top_k_routing_cuda: ";
  auto invalid = [&](const std::string& what) { return ffi::Error::InvalidArgument(name + what); };
  const auto dims = logits.dimensions();
  if (dims.size() != 2) {
    return invalid("logits must be 2-D [T, E], got " + DimsToString(dims));
  }
  const int64_t tokens = dims[0], experts = dims[1], pairs = tokens * k;
  const ffi::DataType dtype = logits.element_type();
  if (!IsActivationType(dtype, /*allow_f32=*/true)) {
    return invalid("logits must be float32, float16 or bfloat16");
  }
  if (k < 1 || k > experts) {
    return invalid("k must be in [1, E = " + std::to_string(experts) + "], got " +
                   std::to_string(k));
  }
  if (pairs > kRoutingMaxPairs || experts > kRoutingMaxExperts) {
    return invalid("one block serves T k <= " + std::to_string(kRoutingMaxPairs) +
                   " pairs and E <= " + std::to_string(kRoutingMaxExperts) +
                   " experts, got T k = " + std::to_string(pairs) +
                   ", E = " + std::to_string(experts));
  }
  auto shape_is = [](const auto& buffer, std::initializer_list<int64_t> want) {
    const auto got = buffer.dimensions();
    return got.size() == want.size() && std::equal(got.begin(), got.end(), want.begin());
  };
  if (!shape_is(*weights, {tokens, k}) || !shape_is(*chosen, {tokens, k}) ||
      !shape_is(*order, {pairs}) || !shape_is(*inverse, {pairs}) ||
      !shape_is(*group_sizes, {experts})) {
    return invalid(
        "results must be weights and experts [T, k], order and inverse [T k], "
        "group_sizes [E]");
  }
  auto launch = dtype == ffi::DataType::F32   ? LaunchTopKRouting<float>
                : dtype == ffi::DataType::F16 ? LaunchTopKRouting<__half>
                                              : LaunchTopKRouting<__nv_bfloat16>;
  const cudaError_t err = launch(stream, logits.untyped_data(), tokens, experts, k, renormalize,
                                 weights->typed_data(), chosen->typed_data(), order->typed_data(),
                                 inverse->typed_data(), group_sizes->typed_data());
  if (err != cudaSuccess) return CudaError("jax_fp4_top_k_routing_cuda: kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4TopKRoutingCuda, jax_fp4::cuda::TopKRoutingCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // logits [T, E]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // weights [T, k]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // experts [T, k]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // order [T k]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // inverse [T k]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Attr<int64_t>("k")
                                  .Attr<bool>("renormalize"),
                              {ffi::Traits::kCmdBufferCompatible});
