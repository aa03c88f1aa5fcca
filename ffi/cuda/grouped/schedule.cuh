// The per-group work schedule of the grouped (mixture-of-experts) kernels, computed on the device
// from the runtime group sizes, so that a launch depends on shapes only (no host read of
// group_sizes: the handlers stay capturable into CUDA graphs).
//
// Group g owns rows [begin_g, end_g) of a and y: begin_g = min(s_g, M), end_g = min(s_g + size_g,
// M), s_g = the sum of the earlier sizes (a negative size counts as 0), so groups past M are cut
// at M, as jax.lax.ragged_dot does. Each group's rows are cut into chunks of `chunk` rows (the
// GEMV's 8- or 16-row tiles, the GEMM's BM-row tiles), numbered in group order; a launch has a
// slot per possible chunk and slot s serves chunk s. The chunks of the nonempty groups number at
// most ceil(M / chunk) + E - 1 (E = nonempty groups <= min(G, M)), so a grid of
// GroupedSlots(M, G, chunk) slots always has one to spare: the slots past the last chunk write
// the zero rows past min(sum(group_sizes), M).
#ifndef JAX_FP4_CUDA_GROUPED_SCHEDULE_CUH_
#define JAX_FP4_CUDA_GROUPED_SCHEDULE_CUH_

#include <cstdint>

namespace jax_fp4 {
namespace cuda {

// Slots of a launch over m rows in g groups with chunks of `chunk` rows: ceil(m / chunk) +
// min(g, m), at least 1 (host and device).
__host__ __device__ constexpr int64_t GroupedSlots(int64_t m, int64_t g, int64_t chunk) {
  const int64_t active = g < m ? g : m;
  const int64_t slots = (m + chunk - 1) / chunk + (active > 0 ? active : 0);
  return slots > 0 ? slots : 1;
}

// What slot `slot` does.
struct GroupChunk {
  int group;         // the chunk's group, or -1: the slot is past the last chunk (idle)
  int64_t begin;     // the chunk's first row
  int64_t end;       // one past the group's last row (the chunk is [begin, min(begin+chunk, end)))
  int64_t chunks;    // idle slots: the call's chunks (the idle slot's rank is slot - chunks)
  int64_t rows_end;  // idle slots: min(sum of the sizes, M), the first zero row
};

namespace grouped_detail {

// Inclusive warp scan of v (all 32 lanes).
__device__ __forceinline__ int64_t WarpInclusiveScan(int64_t v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t up = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

}  // namespace grouped_detail

// The chunk of slot `slot`; called by all 32 lanes of a warp, which all get the same answer. The
// group sizes are read 32 x kPerLane at a time (each lane kPerLane consecutive groups, loads
// independent): one pass for G <= 128.
__device__ __forceinline__ GroupChunk FindGroupChunk(const int32_t* __restrict__ group_sizes,
                                                     int groups, int64_t m, int chunk,
                                                     int64_t slot) {
  using grouped_detail::WarpInclusiveScan;
  constexpr int kPerLane = 4;
  constexpr int kBatch = 32 * kPerLane;
  const int lane = threadIdx.x & 31;
  int64_t row_base = 0;    // raw (unclamped) prefix of the sizes before this batch
  int64_t chunk_base = 0;  // chunks before this batch
  for (int base = 0; base < groups; base += kBatch) {
    int64_t size[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int g = base + lane * kPerLane + j;
      const int32_t v = g < groups ? __ldg(group_sizes + g) : 0;
      size[j] = v > 0 ? v : 0;
    }
    int64_t lane_rows = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) lane_rows += size[j];
    const int64_t rows_incl = WarpInclusiveScan(lane_rows, lane);
    // This lane's groups: clamped row ranges and chunk counts.
    int64_t begin[kPerLane], end[kPerLane], nchunks[kPerLane];
    int64_t start = row_base + rows_incl - lane_rows, lane_chunks = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      begin[j] = start < m ? start : m;
      end[j] = start + size[j] < m ? start + size[j] : m;
      nchunks[j] = (end[j] - begin[j] + chunk - 1) / chunk;
      lane_chunks += nchunks[j];
      start += size[j];
    }
    const int64_t chunks_incl = WarpInclusiveScan(lane_chunks, lane);
    const int64_t lane_first = chunk_base + chunks_incl - lane_chunks;
    const bool mine = slot >= lane_first && slot < lane_first + lane_chunks;
    const uint32_t owner = __ballot_sync(0xffffffffu, mine);
    if (owner != 0) {
      GroupChunk c{};
      if (mine) {
        int64_t first = lane_first;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          if (slot >= first && slot < first + nchunks[j]) {
            c.group = base + lane * kPerLane + j;
            c.begin = begin[j] + (slot - first) * chunk;
            c.end = end[j];
          }
          first += nchunks[j];
        }
      }
      const int src = __ffs(owner) - 1;
      c.group = __shfl_sync(0xffffffffu, c.group, src);
      c.begin = __shfl_sync(0xffffffffu, c.begin, src);
      c.end = __shfl_sync(0xffffffffu, c.end, src);
      c.chunks = 0;
      c.rows_end = 0;
      return c;
    }
    row_base += __shfl_sync(0xffffffffu, rows_incl, 31);
    chunk_base += __shfl_sync(0xffffffffu, chunks_incl, 31);
  }
  GroupChunk idle{};
  idle.group = -1;
  idle.chunks = chunk_base;
  idle.rows_end = row_base < m ? row_base : m;
  return idle;
}

// Zeroes columns [col0, col1) of the rows past the last group that belong to idle slot `slot`:
// rows rows_end + rank, + idle, ... (rank = slot - chunks of idle = slots - chunks idle slots),
// by the block's threads.
template <typename T>
__device__ __forceinline__ void ZeroTailRows(T* __restrict__ y, const GroupChunk& c, int64_t slot,
                                             int64_t slots, int64_t m, int64_t n, int64_t col0,
                                             int64_t col1) {
  const int64_t idle = slots - c.chunks;
  const int64_t cols = (col1 < n ? col1 : n) - col0;
  if (idle <= 0 || cols <= 0) return;
  const T zero = T(0.0f);
  for (int64_t row = c.rows_end + (slot - c.chunks); row < m; row += idle) {
    for (int64_t col = threadIdx.x; col < cols; col += blockDim.x) y[row * n + col0 + col] = zero;
  }
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_GROUPED_SCHEDULE_CUH_
