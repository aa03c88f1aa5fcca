// CPU XLA FFI handler: Y = A @ dequant(W)^T (+ bias), fused.
//
// Blocked like a BLAS GEMM whose weight panel is decoded instead of packed: a panel of weight rows
// over a step of K is decoded into a small fp32 buffer (block scale folded in) and consumed at
// once by a register-blocked micro-kernel, so the dequantized [N, K] matrix never exists. The
// spec layout and jax_fp4.prepack's tiled layout (attribute tiled) decode to the same values bit
// for bit (nvfp4.h's addressing and E2M1 / E4M3 definitions); accumulation is fp32 in an order
// that depends on neither M nor the layout, the global scale and bias are applied once per output
// in the epilogue, then the result is rounded to A's dtype.
// Work units (a block of M rows against a panel of weight rows) are shared out over XLA's
// intra-op thread pool.
#include "cpu/handlers.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
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

// Blocking, as in a BLAS GEMM with the weight panel decoded instead of packed: a work unit is
// kBlockRows rows of M against kPanelRows weight rows; K runs in steps of kDepth, each step's
// decoded panel (64 x 256 floats, 64 KB) and activation block (up to 480 x 256 floats) staying in
// L2 while the micro-kernel sweeps them kMicroRows x kPanelCols outputs at a time. On a 2-core
// AMD EPYC (AVX2 clone) 480 rows of M ran 0-6% faster than 240 at M = 64-1024; M = 1024 on
// 4096x4096 reaches ~90 GFLOP/s per core, about the AVX2 FMA peak.
constexpr int64_t kPanelCols = 16;   // weight rows per micro-kernel column group
constexpr int64_t kPanelRows = 64;   // weight rows per work unit (4 groups)
constexpr int64_t kMicroRows = 6;    // rows of M per micro-kernel call
constexpr int64_t kBlockRows = 480;  // rows of M per work unit (80 micro-kernel calls)
constexpr int64_t kDepth = 256;      // K per step; a multiple of 128 (the tiled layout's window)
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

  int64_t m_blocks = 0;   // units along M
  int64_t num_units = 0;  // m_blocks x weight panels
  std::atomic<int64_t> next_unit{0};
  std::atomic<int64_t> done_units{0};
  std::mutex mutex;
  std::condition_variable all_done;
};

// The hot functions are compiled for AVX2 + FMA as well (x86-64-v3), chosen at load time when the
// CPU has them (GCC 11+ on x86-64 glibc, which resolves the clones through ifunc): 16 registers of
// 8 floats, which the micro-kernel's 6 x 16 block needs (SSE's 4-float registers would spill it),
// and 8-lane integer shifts for the decode. Elsewhere the plain build. FMA rounds once per
// multiply-add, so the last bits differ between the two clones.
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__clang__) && __GNUC__ >= 11
#define JAX_FP4_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JAX_FP4_CPU_CLONES
#endif

// Eight floats as one value (GCC / Clang vector extension): 256-bit registers where the target
// has them, two 128-bit ones otherwise.
typedef float Float8 __attribute__((vector_size(32)));
typedef uint32_t Word8 __attribute__((vector_size(32)));  // eight 32-bit words, one per lane

// Unaligned load (through a pointer, not a return value: a 32-byte vector returned by value would
// change the calling convention between the SSE and AVX builds).
__attribute__((always_inline)) inline void LoadFloat8(const float* p, Float8* v) {
  std::memcpy(v, p, sizeof(*v));
}

// e2m1_to_float (nvfp4.h) on eight lanes, each holding one code in bits 0..3, times the lanes'
// block scales, stored to out[0..7].
__attribute__((always_inline)) inline void DecodeE2M1Lanes(const Word8& codes,
                                                           const Float8& scales, float* out) {
  const Word8 magnitude = codes & 7u;  // exponent e at bits 1..2, mantissa m at bit 0
  const Word8 normal = (magnitude + 252u) << 22;  // e >= 1: exponent e + 126, mantissa bit m
  const Word8 is_normal = reinterpret_cast<Word8>(magnitude >= 2u);  // all ones or zero
  const Word8 is_half = reinterpret_cast<Word8>(magnitude == 1u);
  const Word8 bits = (normal & is_normal) | (0x3F000000u & is_half) | ((codes & 8u) << 28);
  Float8 value;
  std::memcpy(&value, &bits, sizeof(value));
  value *= scales;
  std::memcpy(out, &value, sizeof(value));
}

// Decodes weight rows [n0, n0 + rows) over K [k0, k0 + kc) into fp32 with the block scale folded
// in, into the panel layout the micro-kernel reads: groups of 16 rows, each group [kc][16], so
// that one k of a group is 16 consecutive floats. Rows past N decode as zero.
JAX_FP4_CPU_CLONES
void DecodePanel(const MatmulJob& job, int64_t n0, int64_t rows, int64_t k0, int64_t kc,
                 float* panel) {
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
  const int64_t windows = job.k / 128;  // tiled layout only
  // Byte offsets of row `row`'s block scale kb and of its word of elements kk..kk+7 (kk % 8 == 0,
  // inside one block). Across the eight rows of a panel half both step by a constant, the same for
  // every block and word (the spec layout's row strides; the tiled layout's lane groups, which
  // those eight rows are, since n0 % 64 == 0): taken once per half, from the first block.
  const auto scale_offset = [&](int64_t row, int64_t kb) {
    return job.tiled ? tiled_scale_offset(row, kb, windows) : row * job.k_blocks + kb;
  };
  const auto word_offset = [&](int64_t row, int64_t kk) {
    if (!job.tiled) return row * (job.k / 2) + kk / 2;
    const int64_t kb = kk / 16;
    return tiled_packed_offset(row, kb / 8, (kb % 8) / 2, windows) + 8 * (kb % 2) +
           4 * ((kk / 8) % 2);
  };
  // A word of eight codes in spec order (element e at bits 4e..4e+3): the spec layout's four
  // packed bytes (little-endian) are one already.
  const auto spec_word = [&](const uint8_t* b) {
    if (job.tiled) {
      return kSpecBits[0][b[0]] | kSpecBits[1][b[1]] | kSpecBits[2][b[2]] | kSpecBits[3][b[3]];
    }
    uint32_t word;
    std::memcpy(&word, b, sizeof(word));
    return word;
  };

  const int64_t groups = (rows + kPanelCols - 1) / kPanelCols;
  // Whole words: the tiled layout (block 16, K % 128 == 0, k0 and kc multiples of 128), or the
  // spec layout when no block boundary or the end of K falls inside a word. Eight rows at a time,
  // one lane per row: every k of the panel is two stores of eight floats.
  if (job.tiled || (job.block_size % 8 == 0 && job.k % 8 == 0)) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t row0 = n0 + g * kPanelCols + 8 * half;  // this half's first row
        const int lanes = static_cast<int>(std::clamp<int64_t>(n0 + rows - row0, 0, 8));
        float* out = panel + g * kc * kPanelCols + 8 * half;  // k0's eight floats
        const int64_t kb0 = k0 / job.block_size;
        const int64_t scale_step = scale_offset(row0 + 1, kb0) - scale_offset(row0, kb0);
        const int64_t word_step = word_offset(row0 + 1, k0) - word_offset(row0, k0);
        for (int64_t kb = kb0; kb * job.block_size < k0 + kc; ++kb) {
          const int64_t scale0 = scale_offset(row0, kb);
          Float8 scales = {};  // zero in lanes past N
          for (int lane = 0; lane < lanes; ++lane) {
            scales[lane] = e4m3_to_float(job.scale[scale0 + lane * scale_step]);
          }
          const int64_t k_end = std::min(k0 + kc, (kb + 1) * job.block_size);
          for (int64_t kk = std::max(k0, kb * job.block_size); kk < k_end; kk += 8) {
            const uint8_t* word0 = job.packed + word_offset(row0, kk);
            Word8 words = {};
            for (int lane = 0; lane < lanes; ++lane) {
              words[lane] = spec_word(word0 + lane * word_step);
            }
            for (int e = 0; e < 8; ++e) {
              DecodeE2M1Lanes((words >> (4 * e)) & 0xFu, scales,
                              out + (kk + e - k0) * kPanelCols);
            }
          }
        }
      }
    }
    return;
  }
  // Any other block size: element by element, one row at a time.
  for (int64_t r = 0; r < groups * kPanelCols; ++r) {
    const int64_t row = n0 + r;
    float* out = panel + (r / kPanelCols) * kc * kPanelCols + r % kPanelCols;  // k0's float
    if (r >= rows) {
      for (int64_t kk = 0; kk < kc; ++kk) out[kk * kPanelCols] = 0.0f;
      continue;
    }
    const uint8_t* packed_row = job.packed + row * (job.k / 2);
    for (int64_t kb = k0 / job.block_size; kb * job.block_size < k0 + kc; ++kb) {
      const float scale = e4m3_to_float(job.scale[scale_offset(row, kb)]);
      const int64_t k_end = std::min(k0 + kc, (kb + 1) * job.block_size);
      for (int64_t kk = std::max(k0, kb * job.block_size); kk < k_end; ++kk) {
        out[(kk - k0) * kPanelCols] = e2m1_to_float(packed_code(packed_row, kk)) * scale;
      }
    }
  }
}

// c[MB, 16] += a[MB, kc] @ group[kc, 16]: rank-1 updates into MB x 16 fp32 accumulators held in
// registers (6 x 2 x 8 floats: 12 of AVX2's 16). Each weight value loaded feeds MB multiply-adds
// and each activation value 16, the reuse a row-by-row dot product (two loads per multiply-add)
// lacks. Always inlined, so that it takes the ISA of the clone of PanelProduct that calls it.
template <int MB>
__attribute__((always_inline)) inline void MicroKernel(const float* a, int64_t lda,
                                                       const float* group, int64_t kc, float* c,
                                                       int64_t ldc) {
  static_assert(kPanelCols == 16, "two Float8 per row of the group");
  Float8 acc[MB][2] = {};
  for (int64_t kk = 0; kk < kc; ++kk) {
    Float8 w0, w1;
    LoadFloat8(group + kk * kPanelCols, &w0);
    LoadFloat8(group + kk * kPanelCols + 8, &w1);
    for (int i = 0; i < MB; ++i) {
      const float ai = a[i * lda + kk];
      acc[i][0] += ai * w0;
      acc[i][1] += ai * w1;
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < 2; ++j) {
      Float8 sum;
      LoadFloat8(c + i * ldc + 8 * j, &sum);
      sum += acc[i][j];
      std::memcpy(c + i * ldc + 8 * j, &sum, sizeof(sum));
    }
  }
}


// c[mb, nc] += a[mb, kc] @ panel over the panel's groups, kMicroRows rows of M at a time.
JAX_FP4_CPU_CLONES
void PanelProduct(const float* a, int64_t lda, int64_t mb, const float* panel, int64_t kc,
                  int64_t groups, float* c, int64_t ldc) {
  for (int64_t i = 0; i < mb; i += kMicroRows) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* group = panel + g * kc * kPanelCols;
      float* c_block = c + i * ldc + g * kPanelCols;
      const float* a_block = a + i * lda;
      switch (std::min<int64_t>(kMicroRows, mb - i)) {
        case 6: MicroKernel<6>(a_block, lda, group, kc, c_block, ldc); break;
        case 5: MicroKernel<5>(a_block, lda, group, kc, c_block, ldc); break;
        case 4: MicroKernel<4>(a_block, lda, group, kc, c_block, ldc); break;
        case 3: MicroKernel<3>(a_block, lda, group, kc, c_block, ldc); break;
        case 2: MicroKernel<2>(a_block, lda, group, kc, c_block, ldc); break;
        default: MicroKernel<1>(a_block, lda, group, kc, c_block, ldc); break;
      }
    }
  }
}

// Buffers one thread reuses across its work units.
struct Scratch {
  explicit Scratch(const MatmulJob& job)
      : panel(static_cast<size_t>(kPanelRows * std::min(job.k, kDepth))),
        c(static_cast<size_t>(std::min(job.m, kBlockRows) * kPanelRows)) {}
  std::vector<float> panel, c;
};

// One unit: rows [m0, m0 + mb) of M against weight rows [n0, n0 + rows) over all of K, in
// kDepth-long steps (each step's decoded panel and activation block stay in cache), then the
// epilogue: global scale, bias, rounding to the output dtype.
void ComputeUnit(const MatmulJob& job, int64_t unit, Scratch& scratch) {
  const int64_t m0 = (unit % job.m_blocks) * kBlockRows;
  const int64_t n0 = (unit / job.m_blocks) * kPanelRows;
  const int64_t mb = std::min(kBlockRows, job.m - m0);
  const int64_t rows = std::min(kPanelRows, job.n - n0);
  const int64_t groups = (rows + kPanelCols - 1) / kPanelCols;
  const int64_t ldc = kPanelRows;
  std::fill(scratch.c.begin(), scratch.c.end(), 0.0f);
  for (int64_t k0 = 0; k0 < job.k; k0 += kDepth) {
    const int64_t kc = std::min(kDepth, job.k - k0);
    DecodePanel(job, n0, rows, k0, kc, scratch.panel.data());
    PanelProduct(job.a_f32.data() + m0 * job.k + k0, job.k, mb, scratch.panel.data(), kc, groups,
                 scratch.c.data(), ldc);
  }
  for (int64_t i = 0; i < mb; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      float out = scratch.c[i * ldc + r] * job.global_scale;
      if (job.bias != nullptr) out += load_as_float(job.bias, job.dtype, n0 + r);
      store_from_float(job.y, job.dtype, (m0 + i) * job.n + n0 + r, out);
    }
  }
}

// Claims units until none is left. Safe to run after the call returned: it then finds no unit.
void Work(const std::shared_ptr<MatmulJob>& job) {
  Scratch scratch(*job);
  int64_t finished = 0;
  for (int64_t unit; (unit = job->next_unit.fetch_add(1)) < job->num_units; ++finished) {
    ComputeUnit(*job, unit, scratch);
  }
  if (finished != 0 && job->done_units.fetch_add(finished) + finished == job->num_units) {
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
  job->m_blocks = (shape.m + kBlockRows - 1) / kBlockRows;
  job->num_units = job->m_blocks * ((shape.n + kPanelRows - 1) / kPanelRows);

  // Small problems are not worth waking other threads for.
  const bool parallel = shape.m * shape.n * shape.k >= kParallelWork;
  const int64_t helpers =
      parallel ? std::min(thread_pool.num_threads(), job->num_units) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) thread_pool.Schedule([job] { Work(job); });
  Work(job);  // the calling thread works too, so progress never depends on the pool
  std::unique_lock<std::mutex> lock(job->mutex);
  job->all_done.wait(lock, [&] { return job->done_units.load() == job->num_units; });
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
