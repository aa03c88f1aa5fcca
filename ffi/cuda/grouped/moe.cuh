// Device side of the mixture-of-experts block (jax_fp4.moe; handlers in moe_handler.cu): the two
// epilogue fusions the grouped GEMV (gemv.cuh) runs for it, and the down kernel's combine.
//
// Rows are the routing's (token, slot) pairs grouped by expert: row r of the grouped problem is
// pair order[r] = t k + j (token t, slot j).
//   gate/up  MoeGatherFusion: row r multiplies x's row order[r] / k (the token) instead of a row of
//            a gathered copy; silu(gate) * up as the grouped GEMV's silu_mul.
//   down     MoePairFusion: row r's product (times the global scale) is weighted by weights[t, j]
//            and stored in float32 to pair_out[order[r]]; then MoeFinishPairs counts the pairs
//            each token has finished in this column tile, and the block that finishes a token's
//            k-th sums its k pair rows in slot order, adds the residual and rounds once.
// The counters (room for one per token and 16-column tile of the output) start at 0: the gate/up
// launch zeroes them (MoeZeroCounters), in stream order before the down launch reads them. A block
// spanning several 16-column tiles counts on its span's first tile only, so with 32-column spans
// the odd tiles' counters stay 0.
#ifndef JAX_FP4_CUDA_GROUPED_MOE_CUH_
#define JAX_FP4_CUDA_GROUPED_MOE_CUH_

#include <cstdint>

#include "cuda/gemv/common.cuh"
#include "cuda/grouped/operands.h"
#include "cuda/grouped/schedule.cuh"
#include "jax_fp4/nvfp4_cuda.cuh"

namespace jax_fp4 {
namespace cuda {

// The gate/up epilogue's row map: row i of the chunk is pair pairs[i], token pairs[i] / top_k.
template <typename T>
struct MoeGatherFusion : GemvFusion<T> {
  static constexpr bool kRowMap = true;
  const int32_t* pairs = nullptr;  // order + the chunk's first row
  int top_k = 1;

  __device__ __forceinline__ int64_t activation_row(int64_t row) const {
    return __ldg(pairs + row) / top_k;
  }
};

// The down epilogue: each row's value goes, weighted, to its pair's float32 scratch row.
template <typename T>
struct MoePairFusion : GemvFusion<T> {
  const int32_t* pairs = nullptr;  // order + the chunk's first row
  const float* weights = nullptr;  // [T k], indexed by pair
  float* pair_out = nullptr;       // [T k, N]
};

template <typename T>
__device__ __forceinline__ void StoreFusedOutput(T* /*y*/, const T* bias,
                                                 const MoePairFusion<T>& fusion, int64_t n_out,
                                                 int64_t row, int64_t col, float acc,
                                                 float /*acc_up*/, float gs) {
  using Tr = HalfTraits<T>;
  const float v = fmaf(acc, gs, bias != nullptr ? Tr::to_float(bias[col]) : 0.0f);
  const int64_t pair = __ldg(fusion.pairs + row);
  fusion.pair_out[pair * n_out + col] = __ldg(fusion.weights + pair) * v;
}

// Zeroes the counters, spread over the whole grid (gate/up launch).
template <typename T>
__device__ __forceinline__ void MoeZeroCounters(const MoeOperands<T>& moe) {
  const int64_t block = static_cast<int64_t>(blockIdx.z) * gridDim.x + blockIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * gridDim.z * blockDim.x;
  for (int64_t i = block * blockDim.x + threadIdx.x; i < moe.counter_count; i += stride) {
    moe.counters[i] = 0;
  }
}

// After this block stored the pair rows pairs[0, count) of output columns [col0, col0 + cols)
// (col0 a multiple of 16; every block of the launch spans the same `cols`): counts them on their
// tokens' counters at tile col0 / 16, and for each token whose k-th pair this was, writes
// y[token, col0 .. col0 + cols) = round(sum over slots j in order of pair_out[token k + j] +
// residual). Called by all threads of the block.
template <typename T>
__device__ __forceinline__ void MoeFinishPairs(const MoeOperands<T>& moe, const int32_t* pairs,
                                               int64_t count, int64_t n, int64_t col0,
                                               int64_t cols) {
  using Tr = HalfTraits<T>;
  constexpr int kBatch = 32;
  __shared__ int32_t finished[kBatch];
  __shared__ int finished_count;
  __threadfence();  // this thread's pair rows are visible device-wide before any count
  for (int64_t base = 0; base < count; base += kBatch) {
    if (threadIdx.x == 0) finished_count = 0;
    __syncthreads();  // every thread's stores and fences precede the counts
    if (threadIdx.x < kBatch && base + threadIdx.x < count) {
      const int32_t token = __ldg(pairs + base + threadIdx.x) / moe.top_k;
      int32_t* counter = moe.counters + token * moe.counter_cols + col0 / 16;
      if (atomicAdd(counter, 1) == moe.top_k - 1) finished[atomicAdd(&finished_count, 1)] = token;
    }
    __syncthreads();
    const int done = finished_count;
    if (done > 0) {
      __threadfence();  // the other blocks' pair rows, counted before ours, are read after it
      for (int64_t i = threadIdx.x; i < done * cols; i += blockDim.x) {
        const int64_t token = finished[i / cols];
        const int64_t col = col0 + i % cols;
        const float* rows = moe.pair_out + token * moe.top_k * n + col;
        float sum = 0.0f;
        for (int j = 0; j < moe.top_k; ++j) sum += __ldcg(rows + j * n);
        if (moe.residual != nullptr) sum += Tr::to_float(moe.residual[token * n + col]);
        moe.out[token * n + col] = Tr::from_float(sum);
      }
    }
    __syncthreads();  // `finished` is reused by the next batch
  }
}

// An idle slot of the down launch (past the last chunk): the pair rows past the groups contribute
// nothing, so its share of them (a contiguous run; the idle slots split the tail evenly) gets zero
// products and is counted, which completes the tokens they belong to.
template <typename T>
__device__ __forceinline__ void MoeTailPairs(const MoeOperands<T>& moe, const GroupChunk& c,
                                             int64_t slot, int64_t slots, int64_t m, int64_t n,
                                             int64_t col0, int64_t cols) {
  const int64_t idle = slots - c.chunks;
  const int64_t tail = m - c.rows_end;
  if (idle <= 0 || tail <= 0 || cols <= 0) return;
  const int64_t span = (tail + idle - 1) / idle;
  const int64_t start = c.rows_end + (slot - c.chunks) * span;
  const int64_t count = start < m ? (m - start < span ? m - start : span) : 0;
  if (count <= 0) return;
  const int32_t* pairs = moe.order + start;
  for (int64_t i = threadIdx.x; i < count * cols; i += blockDim.x) {
    moe.pair_out[__ldg(pairs + i / cols) * n + col0 + i % cols] = 0.0f;
  }
  MoeFinishPairs(moe, pairs, count, n, col0, cols);
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_MOE_CUH_
