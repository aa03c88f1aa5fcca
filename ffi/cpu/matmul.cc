// CPU XLA FFI handler: Y = A @ dequant(W)^T (+ bias), fused.
//
// Weight rows are decoded a tile at a time into a small fp32 buffer and consumed at once, so the
// dequantized [N, K] matrix never exists (from the spec layout, or from jax_fp4.prepack's tiled
// layout, attribute tiled, through the nvfp4.h helpers: the same values bit for bit); accumulation is fp32, the global scale and bias are applied
// once per output in the epilogue, then the result is rounded to A's dtype. Tiles of weight rows are
// shared out over XLA's intra-op thread pool.
#include "cpu/handlers.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "jax_fp4/nvfp4.h"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace {

constexpr int64_t kRowTile = 8;  // weight rows decoded together; 8 * K floats stay in L1/L2
constexpr int64_t kParallelWork = int64_t{1} << 22;  // multiply-adds below which one thread runs

float load_as_float(const void* data, ffi::DataType dtype, int64_t i) {
  switch (dtype) {
    case ffi::DataType::F16:
      return fp16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
    case ffi::DataType::BF16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

void store_from_float(void* data, ffi::DataType dtype, int64_t i, float value) {
  switch (dtype) {
    case ffi::DataType::F16:
      static_cast<uint16_t*>(data)[i] = float_to_fp16_bits(value);
      break;
    case ffi::DataType::BF16:
      static_cast<uint16_t*>(data)[i] = float_to_bf16_bits(value);
      break;
    default:
      static_cast<float*>(data)[i] = value;
  }
}

// Everything one call shares between the threads that work on it (read-only but for the counters).
struct MatmulJob {
  int64_t m = 0, n = 0, k = 0, k_blocks = 0, block_size = 0;
  std::vector<float> a_f32;  // activations in fp32, [M, K]
  const uint8_t* packed = nullptr;
  const uint8_t* scale = nullptr;
  const void* bias = nullptr;  // nullptr: no bias
  void* y = nullptr;
  ffi::DataType dtype = ffi::DataType::F32;
  float global_scale = 1.0f;
  bool tiled = false;  // packed / scale in the tiled layout (block_size 16, K % 128 == 0)

  int64_t num_tiles = 0;
  std::atomic<int64_t> next_tile{0};
  std::atomic<int64_t> done_tiles{0};
  std::mutex mutex;
  std::condition_variable all_done;
};

// Decodes the weight rows of one tile into fp32 (block scale folded in).
void DecodeTile(const MatmulJob& job, int64_t n0, int64_t rows, float* w_tile) {
  static const auto kE2M1 = [] {
    std::array<float, 16> table{};
    for (uint32_t code = 0; code < 16; ++code) table[code] = e2m1_to_float(code);
    return table;
  }();
  if (job.tiled) {
    // A tiled word's bit permutation, undone byte by byte: kSpecBits[j][v] is the spec-order word
    // (element e's code at bits 4e..4e+3) of the tiled word holding byte v at byte j and zeros
    // elsewhere; each bit moves on its own, so the four parts OR together.
    static const auto kSpecBits = [] {
      std::array<std::array<uint32_t, 256>, 4> table{};
      for (int j = 0; j < 4; ++j) {
        for (uint32_t v = 0; v < 256; ++v) {
          for (int e = 0; e < 8; ++e) table[j][v] |= tiled_word_code(v << (8 * j), e) << (4 * e);
        }
      }
      return table;
    }();
    const int64_t windows = job.k / 128;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = n0 + r;
      float* w_row = w_tile + r * job.k;
      for (int64_t kb = 0; kb < job.k_blocks; ++kb) {  // 16 elements: two words of one quarter
        const float block_scale = e4m3_to_float(job.scale[tiled_scale_offset(row, kb, windows)]);
        const uint8_t* chunk = job.packed + tiled_packed_offset(row, kb / 8, (kb % 8) / 2, windows);
        for (int j = 0; j < 2; ++j) {
          const uint8_t* b = chunk + 8 * (kb % 2) + 4 * j;
          const uint32_t codes =
              kSpecBits[0][b[0]] | kSpecBits[1][b[1]] | kSpecBits[2][b[2]] | kSpecBits[3][b[3]];
          for (int e = 0; e < 8; ++e) {
            w_row[16 * kb + 8 * j + e] = kE2M1[(codes >> (4 * e)) & 0xFu] * block_scale;
          }
        }
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* packed_row = job.packed + (n0 + r) * (job.k / 2);
    const uint8_t* scale_row = job.scale + (n0 + r) * job.k_blocks;
    float* w_row = w_tile + r * job.k;
    for (int64_t kb = 0; kb < job.k_blocks; ++kb) {
      const float block_scale = e4m3_to_float(scale_row[kb]);
      const int64_t k_end = std::min(job.k, (kb + 1) * job.block_size);
      for (int64_t kk = kb * job.block_size; kk < k_end; ++kk) {
        w_row[kk] = kE2M1[packed_code(packed_row, kk)] * block_scale;
      }
    }
  }
}

// fp32 dot product in kLanes independent partial sums, which the compiler keeps in SIMD registers.
float Dot(const float* x, const float* w, int64_t k) {
  constexpr int kLanes = 8;
  float partial[kLanes] = {};
  int64_t kk = 0;
  for (; kk + kLanes <= k; kk += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += x[kk + lane] * w[kk + lane];
  }
  for (; kk < k; ++kk) partial[0] += x[kk] * w[kk];
  float sum = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
  return sum;
}

void ComputeTile(const MatmulJob& job, int64_t tile, float* w_tile) {
  const int64_t n0 = tile * kRowTile;
  const int64_t rows = std::min(kRowTile, job.n - n0);
  DecodeTile(job, n0, rows, w_tile);
  for (int64_t mi = 0; mi < job.m; ++mi) {
    const float* a_row = job.a_f32.data() + mi * job.k;
    for (int64_t r = 0; r < rows; ++r) {
      float out = Dot(a_row, w_tile + r * job.k, job.k) * job.global_scale;
      if (job.bias != nullptr) out += load_as_float(job.bias, job.dtype, n0 + r);
      store_from_float(job.y, job.dtype, mi * job.n + n0 + r, out);
    }
  }
}

// Claims tiles until none is left. Safe to run after the call returned: it then finds no tile.
void Work(const std::shared_ptr<MatmulJob>& job) {
  std::vector<float> w_tile(static_cast<size_t>(kRowTile * job->k));
  int64_t finished = 0;
  for (int64_t tile; (tile = job->next_tile.fetch_add(1)) < job->num_tiles; ++finished) {
    ComputeTile(*job, tile, w_tile.data());
  }
  if (finished != 0 && job->done_tiles.fetch_add(finished) + finished == job->num_tiles) {
    std::lock_guard<std::mutex> lock(job->mutex);
    job->all_done.notify_all();
  }
}

ffi::Error MatmulCpuImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer a,
                         ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scale,
                         ffi::Buffer<ffi::F32> global_scale, ffi::AnyBuffer bias,
                         ffi::Result<ffi::AnyBuffer> y, int64_t block_size, bool tiled) {
  MatmulShape shape;
  const std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      global_scale.element_count(), bias.element_type(), bias.element_count(), y->element_type(),
      y->dimensions(), block_size, /*allow_f32=*/true, &shape);
  if (!problem.empty()) return ffi::Error::InvalidArgument("jax_fp4_matmul_cpu: " + problem);
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_matmul_cpu: " + bad);
  }
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();

  auto job = std::make_shared<MatmulJob>();
  job->m = shape.m;
  job->n = shape.n;
  job->k = shape.k;
  job->k_blocks = shape.k_blocks;
  job->block_size = block_size;
  job->dtype = a.element_type();
  job->a_f32.resize(static_cast<size_t>(shape.m * shape.k));
  for (int64_t i = 0; i < shape.m * shape.k; ++i) {
    job->a_f32[i] = load_as_float(a.untyped_data(), job->dtype, i);
  }
  job->packed = packed.typed_data();
  job->scale = scale.typed_data();
  job->bias = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  job->y = y->untyped_data();
  job->global_scale = global_scale.typed_data()[0];
  job->tiled = tiled;
  job->num_tiles = (shape.n + kRowTile - 1) / kRowTile;

  // Small problems are not worth waking other threads for.
  const bool parallel = shape.m * shape.n * shape.k >= kParallelWork;
  const int64_t helpers =
      parallel ? std::min(thread_pool.num_threads(), job->num_tiles) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) thread_pool.Schedule([job] { Work(job); });
  Work(job);  // the calling thread works too, so progress never depends on the pool
  std::unique_lock<std::mutex> lock(job->mutex);
  job->all_done.wait(lock, [&] { return job->done_tiles.load() == job->num_tiles; });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4MatmulCpu, jax_fp4::MatmulCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()          // a [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scale [N, ceil(K/block)]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // global scale, one element
                                  .Arg<ffi::AnyBuffer>()          // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N]
                                  .Attr<int64_t>("block_size")
                                  .Attr<bool>("tiled"));          // weight in the tiled layout
