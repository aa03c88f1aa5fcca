// CPU XLA FFI handler: Y = A @ dequant(W)^T (+ bias), fused.
//
// Blocked like a BLAS GEMM whose weight panel is decoded instead of packed: a panel of weight rows
// over a step of K is decoded into a small fp32 buffer (block scale folded in) and consumed at
// once by a register-blocked micro-kernel (AVX2 or AVX-512 where the CPU has them), so the
// dequantized [N, K] matrix never exists. Up to 8 rows of M (decode, where the decode is the work)
// each word of the weight is multiplied as it is decoded instead, with no panel, in the same order
// per output. The spec layout and jax_fp4.prepack's tiled layout (attribute tiled) decode to the
// same values bit for bit (nvfp4.h's addressing and E2M1 / E4M3 definitions); accumulation is fp32
// in an order that depends on neither M, the layout nor the vector width, the global scale and
// bias are applied once per output in the epilogue, then the result is rounded to A's dtype.
// Work units (a block of M rows against a panel of weight rows) are shared out over XLA's
// intra-op thread pool. RunCpuGemm (cpu/gemm.h) is this kernel for several weights at once, each
// multiplying its own rows (the grouped handler, ffi/cpu/grouped.cc): the units of every group
// share one pool of work, so a call with many small groups keeps every thread busy.
#include "cpu/handlers.h"
#include "cpu/gemm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
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
// 4096x4096 reaches ~90 GFLOP/s per core, about the AVX2 FMA peak (~110 on a 2-core Intel Xeon
// with the AVX-512 micro-kernel, 12 x 32 outputs a call).
constexpr int64_t kPanelCols = 16;      // weight rows per micro-kernel column group
constexpr int64_t kPanelRows = 64;      // weight rows per work unit (4 groups)
constexpr int64_t kMicroRows = 6;       // rows of M per micro-kernel call (AVX2 and plain builds)
constexpr int64_t kMicroRowsWide = 12;  // rows of M per AVX-512 micro-kernel call
constexpr int64_t kBlockRows = 480;     // rows of M per work unit (80 or 40 micro-kernel calls)
constexpr int64_t kDepth = 256;         // K per step; a multiple of 128 (the tiled layout's window)
// Up to kDecodeProductMaxRows rows of M no panel (DecodeProduct): 1.5x faster than the panel at
// M = 8 on 4096x4096 (two-core Intel Xeon, AVX2 clone); 9 rows keep the panel.
constexpr int64_t kDecodeProductMaxRows = 8;
// Multiply-adds below which one thread runs: waking XLA's pool costs ~10 us. With two threads
// 2^19 (~80 us on one core) ran 1.5-1.6x faster than one at M = 1 on 512x1024 and 1024x1024
// (two-core Xeon); 2^18 was 12% slower than one thread on 512x512.
constexpr int64_t kParallelWork = int64_t{1} << 19;

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

// One weight as the decode reads it: its shape, layout and bytes.
struct Weight {
  int64_t n = 0, k = 0, k_blocks = 0, block_size = 0;
  const uint8_t* packed = nullptr;
  const uint8_t* scale = nullptr;
  bool tiled = false;  // packed / scale in the tiled layout (block_size 16, K % 128 == 0)
};

// One group of a job: a weight, the rows it multiplies, and its first work unit.
struct JobGroup {
  int64_t row0 = 0, rows = 0;
  const uint8_t* packed = nullptr;
  const uint8_t* scale = nullptr;
  float global_scale = 1.0f;
  const float* bias = nullptr;  // [N] in fp32 (in MatmulJob::bias_f32), or nullptr
  int64_t m_blocks = 0;         // units along its rows
  int64_t first_unit = 0;       // units before it: the groups' units are numbered in order
};

// Everything one call shares between the threads that work on it (read-only but for the counters).
struct MatmulJob {
  int64_t n = 0, k = 0, k_blocks = 0, block_size = 0;
  std::vector<float> a_f32;     // activations in fp32, [rows up to the last group's end, K]
  std::vector<float> bias_f32;  // the groups' biases in fp32, N each
  std::vector<JobGroup> groups;
  int64_t max_group_rows = 0;
  void* y = nullptr;
  ffi::DataType dtype = ffi::DataType::F32;
  bool tiled = false;  // packed / scale in the tiled layout (block_size 16, K % 128 == 0)
  bool avx512 = true;  // the AVX-512 panel product where the CPU has it (attribute avx512)

  int64_t num_units = 0;  // over the groups: row blocks x weight panels
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
#define JAX_FP4_CPU_HAS_AVX2_BUILD 1
#else
#define JAX_FP4_CPU_CLONES
#endif
// The panel product has a third build for AVX-512 (x86-64-v4; GCC 12+ names the level for the
// run-time check): 32 registers of 16 floats hold a 12 x 32 block of outputs, twice the AVX2
// clone's multiply-adds per instruction. Chosen at run time (PanelProduct). The same fused
// multiply-adds in the same order per output as the AVX2 clone, so the same bits.
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__clang__) && __GNUC__ >= 12
#define JAX_FP4_CPU_HAS_AVX512_BUILD 1
#endif

// out[i] = data[i] (F16, BF16 or F32) as fp32 for i < count: the activations and the bias, one
// loop per dtype (both 16-bit conversions vectorize).
JAX_FP4_CPU_CLONES
void ToFloats(const void* data, ffi::DataType dtype, int64_t count, float* out) {
  const auto* half = static_cast<const uint16_t*>(data);
  switch (dtype) {
    case ffi::DataType::F16:
      for (int64_t i = 0; i < count; ++i) out[i] = fp16_bits_to_float(half[i]);
      break;
    case ffi::DataType::BF16:
      for (int64_t i = 0; i < count; ++i) out[i] = bf16_bits_to_float(half[i]);
      break;
    default:
      std::memcpy(out, data, static_cast<size_t>(count) * sizeof(float));
  }
}

// Eight floats as one value (GCC / Clang vector extension): 256-bit registers where the target
// has them, two 128-bit ones otherwise.
typedef float Float8 __attribute__((vector_size(32)));
typedef uint32_t Word8 __attribute__((vector_size(32)));  // eight 32-bit words, one per lane

// Unaligned load (through a pointer, not a return value: a 32-byte vector returned by value would
// change the calling convention between the SSE and AVX builds).
__attribute__((always_inline)) inline void LoadFloat8(const float* p, Float8* v) {
  std::memcpy(v, p, sizeof(*v));
}

// c[0..lanes) += x (Float8, or Float16 in the AVX-512 build): how every path adds a step's
// multiply-add chain to the outputs.
template <typename Vector>
__attribute__((always_inline)) inline void AddToFloats(float* c, const Vector& x) {
  Vector sum;
  std::memcpy(&sum, c, sizeof(sum));
  sum += x;
  std::memcpy(c, &sum, sizeof(sum));
}

// The E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as float bits, indexed by a code's low 3 bits.
constexpr Word8 kE2M1MagnitudeBits = {0x00000000u, 0x3F000000u, 0x3F800000u, 0x3FC00000u,
                                      0x40000000u, 0x40400000u, 0x40800000u, 0x40C00000u};

// table[index % 8] in each lane: one vpermd under AVX2 (GCC's __builtin_shuffle; Clang has no
// variable-index shuffle in its vector extension, so there lane by lane). tests/test_cpu_decode.py
// checks both against nvfp4.h with each compiler at hand. The result through a pointer, as
// LoadFloat8's.
__attribute__((always_inline)) inline void LookUp8(const Word8& table, const Word8& index,
                                                   Word8* out) {
#if defined(__GNUC__) && !defined(__clang__)
  *out = __builtin_shuffle(table, index);
#else
  for (int lane = 0; lane < 8; ++lane) (*out)[lane] = table[index[lane] & 7u];
#endif
}

// Element e (0..7) of eight words of codes, one word per lane, as floats (e2m1_to_float of
// nvfp4.h) times the lanes' block scales: the magnitude by an eight-entry table (one vpermd under
// AVX2), the sign bit moved to bit 31. Exact. Words in spec order (element e at bits 4e..4e+3), or
// (Tiled) as the tiled layout stores them (nvfp4.h, tiled_code_bit). Into *out.
template <bool Tiled>
__attribute__((always_inline)) inline void DecodeE2M1Lanes(const Word8& words, int e,
                                                           const Float8& scales, Float8* out) {
  Word8 index, sign;  // the magnitude's three bits at bits 0..2 (the table reads only those)
  if (!Tiled) {
    index = words >> (4 * e);
    sign = (words << (28 - 4 * e)) & 0x80000000u;
  } else {
    const int mantissa = tiled_code_bit(e, 0), exponent = tiled_code_bit(e, 1);
    if (exponent == mantissa + 1) {  // pairs 0-2: mantissa and exponent bits in order
      index = words >> mantissa;
    } else {  // pair 3: the mantissa above the exponent
      index = ((words >> mantissa) & 1u) | (((words >> exponent) << 1) & 6u);
    }
    sign = (words << (31 - tiled_code_bit(e, 3))) & 0x80000000u;
  }
  Word8 bits;
  LookUp8(kE2M1MagnitudeBits, index, &bits);
  bits |= sign;
  std::memcpy(out, &bits, sizeof(bits));
  *out *= scales;
}

// e4m3_to_float (nvfp4.h) of every byte: a block's eight scales are then eight loads.
const std::array<float, 256>& E4M3Values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (uint32_t byte = 0; byte < 256; ++byte) t[byte] = e4m3_to_float(byte);
    return t;
  }();
  return table;
}

// Whether the weight can be read a word of eight codes at a time: the tiled layout (block 16,
// K % 128 == 0), or the spec layout when no block boundary or the end of K falls inside a word.
bool WholeWords(const Weight& w) { return w.tiled || (w.block_size % 8 == 0 && w.k % 8 == 0); }

// Walks weight rows [row0, row0 + lanes) (one per vector lane, lanes <= 8, row0 % 8 == 0) over K
// [k0, k0 + kc) a word at a time, in k order: visit(kk, scales, words) with words[lane] the row's
// packed word holding elements kk..kk+7 (as the layout stores it: DecodeE2M1Lanes<Tiled> reads it)
// and scales[lane] their block scale; lanes past `lanes` hold zeros. Tiled: the tiled layout.
// Needs WholeWords(w) (k0 and kc are then multiples of 8).
template <bool Tiled, typename Visit>
__attribute__((always_inline)) inline void ForEachWord(const Weight& w, int64_t row0, int lanes,
                                                       int64_t k0, int64_t kc, Visit&& visit) {
  const int64_t windows = w.k / 128;  // tiled layout only
  // Byte offsets of row `row`'s block scale kb and of its word of elements kk..kk+7 (kk % 8 == 0,
  // inside one block). Across the eight rows both step by a constant, the same for every block
  // and word (the spec layout's row strides; the tiled layout's lane groups, which eight rows from
  // a multiple of 8 are): taken once, from the first block.
  const auto scale_offset = [&](int64_t row, int64_t kb) {
    return Tiled ? tiled_scale_offset(row, kb, windows) : row * w.k_blocks + kb;
  };
  const auto word_offset = [&](int64_t row, int64_t kk) {  // kk >= 0: shifts for the divisions
    if (!Tiled) return row * (w.k / 2) + (kk >> 1);
    // A row's 64 bytes of a window are one run (its four quarters in order), windows 1 KB apart.
    return tiled_packed_offset(row, 0, 0, windows) + (kk >> 7) * 1024 + ((kk & 127) >> 1);
  };
  const auto load_word = [](const uint8_t* b) {  // little-endian, as the layouts are defined
    uint32_t word;
    std::memcpy(&word, b, sizeof(word));
    return word;
  };
  const std::array<float, 256>& e4m3 = E4M3Values();
  const int64_t kb0 = k0 / w.block_size;
  const int64_t scale_step = scale_offset(row0 + 1, kb0) - scale_offset(row0, kb0);
  const int64_t word_step = word_offset(row0 + 1, k0) - word_offset(row0, k0);
  // Eight lanes are built in registers (a lane-by-lane loop goes through memory: twice as slow).
  for (int64_t kb = kb0; kb * w.block_size < k0 + kc; ++kb) {
    const uint8_t* s = w.scale + scale_offset(row0, kb);
    Float8 scales = {};  // zero in lanes past N
    if (lanes == 8) {
      scales = Float8{e4m3[s[0]],
                      e4m3[s[scale_step]],
                      e4m3[s[2 * scale_step]],
                      e4m3[s[3 * scale_step]],
                      e4m3[s[4 * scale_step]],
                      e4m3[s[5 * scale_step]],
                      e4m3[s[6 * scale_step]],
                      e4m3[s[7 * scale_step]]};
    } else {
      for (int lane = 0; lane < lanes; ++lane) scales[lane] = e4m3[s[lane * scale_step]];
    }
    const int64_t k_end = std::min(k0 + kc, (kb + 1) * w.block_size);
    for (int64_t kk = std::max(k0, kb * w.block_size); kk < k_end; kk += 8) {
      const uint8_t* p = w.packed + word_offset(row0, kk);
      Word8 words = {};
      if (lanes == 8) {
        words = Word8{load_word(p),
                      load_word(p + word_step),
                      load_word(p + 2 * word_step),
                      load_word(p + 3 * word_step),
                      load_word(p + 4 * word_step),
                      load_word(p + 5 * word_step),
                      load_word(p + 6 * word_step),
                      load_word(p + 7 * word_step)};
      } else {
        for (int lane = 0; lane < lanes; ++lane) words[lane] = load_word(p + lane * word_step);
      }
      visit(kk, scales, words);
    }
  }
}

// DecodePanel for WholeWords(w): eight rows at a time, one per lane; each k is two stores of 8
// floats.
template <bool Tiled>
__attribute__((always_inline)) inline void DecodePanelWords(const Weight& w, int64_t n0,
                                                            int64_t rows, int64_t k0, int64_t kc,
                                                            float* panel) {
  for (int64_t g = 0; g * kPanelCols < rows; ++g) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t row0 = n0 + g * kPanelCols + 8 * half;  // this half's first row
      float* out = panel + g * kc * kPanelCols + 8 * half;  // k0's eight floats
      const int lanes = static_cast<int>(std::clamp<int64_t>(n0 + rows - row0, 0, 8));
      ForEachWord<Tiled>(w, row0, lanes, k0, kc,
                         [&](int64_t kk, const Float8& scales, const Word8& words) {
#pragma GCC unroll 8
                           for (int e = 0; e < 8; ++e) {
                             Float8 value;
                             DecodeE2M1Lanes<Tiled>(words, e, scales, &value);
                             std::memcpy(out + (kk - k0 + e) * kPanelCols, &value, sizeof(value));
                           }
                         });
    }
  }
}

// Decodes weight rows [n0, n0 + rows) over K [k0, k0 + kc) into fp32 with the block scale folded
// in, into the panel layout the micro-kernel reads: groups of 16 rows, each group [kc][16], so
// that one k of a group is 16 consecutive floats. Rows past N decode as zero.
JAX_FP4_CPU_CLONES
void DecodePanel(const Weight& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, float* panel) {
  if (WholeWords(w)) {
    if (w.tiled) {
      DecodePanelWords<true>(w, n0, rows, k0, kc, panel);
    } else {
      DecodePanelWords<false>(w, n0, rows, k0, kc, panel);
    }
    return;
  }
  const int64_t groups = (rows + kPanelCols - 1) / kPanelCols;
  // Any other block size (the spec layout: the tiled one is whole words): element by element,
  // one row at a time.
  for (int64_t r = 0; r < groups * kPanelCols; ++r) {
    const int64_t row = n0 + r;
    float* out = panel + (r / kPanelCols) * kc * kPanelCols + r % kPanelCols;  // k0's float
    if (r >= rows) {
      for (int64_t kk = 0; kk < kc; ++kk) out[kk * kPanelCols] = 0.0f;
      continue;
    }
    const uint8_t* packed_row = w.packed + row * (w.k / 2);
    for (int64_t kb = k0 / w.block_size; kb * w.block_size < k0 + kc; ++kb) {
      const float scale = e4m3_to_float(w.scale[row * w.k_blocks + kb]);
      const int64_t k_end = std::min(k0 + kc, (kb + 1) * w.block_size);
      for (int64_t kk = std::max(k0, kb * w.block_size); kk < k_end; ++kk) {
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
    for (int j = 0; j < 2; ++j) AddToFloats(c + i * ldc + 8 * j, acc[i][j]);
  }
}

// c[mb, nc] += a[mb, kc] @ panel over the panel's groups, kMicroRows rows of M at a time.
JAX_FP4_CPU_CLONES
void PanelProductNarrow(const float* a, int64_t lda, int64_t mb, const float* panel, int64_t kc,
                        int64_t groups, float* c, int64_t ldc) {
  for (int64_t i = 0; i < mb; i += kMicroRows) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* group = panel + g * kc * kPanelCols;
      float* c_block = c + i * ldc + g * kPanelCols;
      const float* a_block = a + i * lda;
      switch (std::min<int64_t>(kMicroRows, mb - i)) {
        case 6:
          MicroKernel<6>(a_block, lda, group, kc, c_block, ldc);
          break;
        case 5:
          MicroKernel<5>(a_block, lda, group, kc, c_block, ldc);
          break;
        case 4:
          MicroKernel<4>(a_block, lda, group, kc, c_block, ldc);
          break;
        case 3:
          MicroKernel<3>(a_block, lda, group, kc, c_block, ldc);
          break;
        case 2:
          MicroKernel<2>(a_block, lda, group, kc, c_block, ldc);
          break;
        default:
          MicroKernel<1>(a_block, lda, group, kc, c_block, ldc);
          break;
      }
    }
  }
}

#ifdef JAX_FP4_CPU_HAS_AVX512_BUILD
typedef float Float16 __attribute__((vector_size(64)));

// MicroKernel for AVX-512 over G (1 or 2) consecutive groups of the panel: c[MB, 16 G] +=
// a[MB, kc] @ [group 0 | group 1], in G MB registers of 16 floats (24 of 32 at MB = 12, G = 2);
// each k, G weight loads and MB broadcast activations feed G MB multiply-adds.
template <int MB, int G>
__attribute__((always_inline)) inline void MicroKernelWide(const float* a, int64_t lda,
                                                           const float* groups, int64_t kc,
                                                           float* c, int64_t ldc) {
  static_assert(kPanelCols == 16, "one Float16 per row of a group");
  const int64_t group_stride = kc * kPanelCols;
  Float16 acc[MB][G] = {};
  for (int64_t kk = 0; kk < kc; ++kk) {
    Float16 w[G];
    for (int g = 0; g < G; ++g) {
      std::memcpy(&w[g], groups + g * group_stride + kk * kPanelCols, sizeof(w[g]));
    }
    for (int i = 0; i < MB; ++i) {
      const float ai = a[i * lda + kk];
      for (int g = 0; g < G; ++g) acc[i][g] += ai * w[g];
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int g = 0; g < G; ++g) AddToFloats(c + i * ldc + g * kPanelCols, acc[i][g]);
  }
}

template <int G>
__attribute__((target("arch=x86-64-v4"))) void MicroKernelWideRows(int64_t rows, const float* a,
                                                                   int64_t lda, const float* groups,
                                                                   int64_t kc, float* c,
                                                                   int64_t ldc) {
  switch (rows) {
    case 12:
      MicroKernelWide<12, G>(a, lda, groups, kc, c, ldc);
      break;
    case 11:
      MicroKernelWide<11, G>(a, lda, groups, kc, c, ldc);
      break;
    case 10:
      MicroKernelWide<10, G>(a, lda, groups, kc, c, ldc);
      break;
    case 9:
      MicroKernelWide<9, G>(a, lda, groups, kc, c, ldc);
      break;
    case 8:
      MicroKernelWide<8, G>(a, lda, groups, kc, c, ldc);
      break;
    case 7:
      MicroKernelWide<7, G>(a, lda, groups, kc, c, ldc);
      break;
    case 6:
      MicroKernelWide<6, G>(a, lda, groups, kc, c, ldc);
      break;
    case 5:
      MicroKernelWide<5, G>(a, lda, groups, kc, c, ldc);
      break;
    case 4:
      MicroKernelWide<4, G>(a, lda, groups, kc, c, ldc);
      break;
    case 3:
      MicroKernelWide<3, G>(a, lda, groups, kc, c, ldc);
      break;
    case 2:
      MicroKernelWide<2, G>(a, lda, groups, kc, c, ldc);
      break;
    default:
      MicroKernelWide<1, G>(a, lda, groups, kc, c, ldc);
      break;
  }
}

__attribute__((target("arch=x86-64-v4"))) void PanelProductWide(const float* a, int64_t lda,
                                                                int64_t mb, const float* panel,
                                                                int64_t kc, int64_t groups,
                                                                float* c, int64_t ldc) {
  for (int64_t i = 0; i < mb; i += kMicroRowsWide) {
    const int64_t rows = std::min(kMicroRowsWide, mb - i);
    for (int64_t g = 0; g < groups; g += 2) {
      const float* group = panel + g * kc * kPanelCols;
      float* c_block = c + i * ldc + g * kPanelCols;
      if (g + 1 < groups) {
        MicroKernelWideRows<2>(rows, a + i * lda, lda, group, kc, c_block, ldc);
      } else {
        MicroKernelWideRows<1>(rows, a + i * lda, lda, group, kc, c_block, ldc);
      }
    }
  }
}

// Whether this CPU can run the AVX-512 build (checked once per process).
bool CpuHasAvx512() {
  static const bool has = __builtin_cpu_supports("x86-64-v4");
  return has;
}
#endif

// c[mb, nc] += a[mb, kc] @ panel over the panel's groups: AVX-512 where `avx512` (the call's
// attribute) asks for it and the CPU has it. Both builds give the same bits.
void PanelProduct(const float* a, int64_t lda, int64_t mb, const float* panel, int64_t kc,
                  int64_t groups, float* c, int64_t ldc, bool avx512) {
#ifdef JAX_FP4_CPU_HAS_AVX512_BUILD
  if (avx512 && CpuHasAvx512()) return PanelProductWide(a, lda, mb, panel, kc, groups, c, ldc);
#else
  (void)avx512;
#endif
  PanelProductNarrow(a, lda, mb, panel, kc, groups, c, ldc);
}

// c[mb, rows] += a[mb, kc] @ (weight rows [n0, n0 + rows) over K [k0, k0 + kc))^T with each word
// of the weight decoded as it is multiplied, eight rows at a time: for a few rows of M the decode
// is most of the work, and the panel's stores and reloads would cost as much again. Per output the
// same operations in the same order as DecodePanel + PanelProduct (one multiply-add chain over
// the step, then added to c), so that the two agree bit for bit. Needs WholeWords(w).
template <int MB, bool Tiled>
__attribute__((always_inline)) inline void DecodeProductRows(const Weight& w, const float* a,
                                                             int64_t lda, int64_t row0, int lanes,
                                                             int64_t k0, int64_t kc, float* c,
                                                             int64_t ldc) {
  Float8 acc[MB] = {};
  ForEachWord<Tiled>(w, row0, lanes, k0, kc,
                     [&](int64_t kk, const Float8& scales, const Word8& words) {
                       const float* a_word = a + (kk - k0);
#pragma GCC unroll 8
                       for (int e = 0; e < 8; ++e) {
                         Float8 w;
                         DecodeE2M1Lanes<Tiled>(words, e, scales, &w);
                         for (int i = 0; i < MB; ++i) acc[i] += a_word[i * lda + e] * w;
                       }
                     });
  for (int i = 0; i < MB; ++i) AddToFloats(c + i * ldc, acc[i]);
}

template <bool Tiled>
__attribute__((always_inline)) inline void DecodeProductLayout(const Weight& w, const float* a,
                                                               int64_t lda, int64_t mb, int64_t n0,
                                                               int64_t rows, int64_t k0, int64_t kc,
                                                               float* c, int64_t ldc) {
  static_assert(kDecodeProductMaxRows == 8, "one case per row count");
  for (int64_t r = 0; r < rows; r += 8) {
    const int lanes = static_cast<int>(std::min<int64_t>(8, rows - r));
    const int64_t row0 = n0 + r;
    float* c_rows = c + r;
    switch (mb) {
      case 8:
        DecodeProductRows<8, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
      case 7:
        DecodeProductRows<7, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
      case 6:
        DecodeProductRows<6, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
      case 5:
        DecodeProductRows<5, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
      case 4:
        DecodeProductRows<4, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
      case 3:
        DecodeProductRows<3, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
      case 2:
        DecodeProductRows<2, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
      default:
        DecodeProductRows<1, Tiled>(w, a, lda, row0, lanes, k0, kc, c_rows, ldc);
        break;
    }
  }
}

JAX_FP4_CPU_CLONES
void DecodeProduct(const Weight& w, const float* a, int64_t lda, int64_t mb, int64_t n0,
                   int64_t rows, int64_t k0, int64_t kc, float* c, int64_t ldc) {
  if (w.tiled) {
    DecodeProductLayout<true>(w, a, lda, mb, n0, rows, k0, kc, c, ldc);
  } else {
    DecodeProductLayout<false>(w, a, lda, mb, n0, rows, k0, kc, c, ldc);
  }
}

// Buffers one thread reuses across its work units.
struct Scratch {
  explicit Scratch(const MatmulJob& job)
      : panel(static_cast<size_t>(kPanelRows * std::min(job.k, kDepth))),
        c(static_cast<size_t>(std::min(job.max_group_rows, kBlockRows) * kPanelRows)) {}
  std::vector<float> panel, c;
};

// One unit: rows [m0, m0 + mb) of one group against weight rows [n0, n0 + rows) over all of K,
// in kDepth-long steps (each step's decoded panel and activation block stay in cache), then the
// epilogue: global scale, bias, rounding to the output dtype.
void ComputeUnit(const MatmulJob& job, int64_t unit, Scratch& scratch) {
  // The group holding this unit: the last one whose first unit is at most `unit`.
  const auto after =
      std::upper_bound(job.groups.begin(), job.groups.end(), unit,
                       [](int64_t u, const JobGroup& group) { return u < group.first_unit; });
  const JobGroup& group = *(after - 1);
  const int64_t local = unit - group.first_unit;
  const int64_t m0 = group.row0 + (local % group.m_blocks) * kBlockRows;
  const int64_t n0 = (local / group.m_blocks) * kPanelRows;
  const int64_t mb = std::min(kBlockRows, group.row0 + group.rows - m0);
  const int64_t rows = std::min(kPanelRows, job.n - n0);
  const int64_t groups = (rows + kPanelCols - 1) / kPanelCols;
  const int64_t ldc = kPanelRows;
  const Weight w{job.n, job.k, job.k_blocks, job.block_size, group.packed, group.scale, job.tiled};
  const bool decode_as_multiplied = mb <= kDecodeProductMaxRows && WholeWords(w);
  std::fill(scratch.c.begin(), scratch.c.end(), 0.0f);
  for (int64_t k0 = 0; k0 < job.k; k0 += kDepth) {
    const int64_t kc = std::min(kDepth, job.k - k0);
    const float* a = job.a_f32.data() + m0 * job.k + k0;
    if (decode_as_multiplied) {
      DecodeProduct(w, a, job.k, mb, n0, rows, k0, kc, scratch.c.data(), ldc);
    } else {
      DecodePanel(w, n0, rows, k0, kc, scratch.panel.data());
      PanelProduct(a, job.k, mb, scratch.panel.data(), kc, groups, scratch.c.data(), ldc,
                   job.avx512);
    }
  }
  for (int64_t i = 0; i < mb; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      float out = scratch.c[i * ldc + r] * group.global_scale;
      if (group.bias != nullptr) out += group.bias[n0 + r];
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

ffi::Error MatmulCpuImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                         ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                         ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, int64_t block_size,
                         bool tiled, bool avx512) {
  MatmulShape shape;
  const std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed.dimensions(), scale.dimensions(),
      scale.element_type(), global_scale.element_count(), bias.element_type(), bias.element_count(),
      y->element_type(), y->dimensions(), block_size, /*allow_f32=*/true, &shape);
  if (!problem.empty()) return ffi::Error::InvalidArgument("jax_fp4_matmul_cpu: " + problem);
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_matmul_cpu: " + bad);
  }
  CpuGemm gemm;
  gemm.a = a.untyped_data();
  gemm.y = y->untyped_data();
  gemm.dtype = a.element_type();
  gemm.n = shape.n;
  gemm.k = shape.k;
  gemm.block_size = block_size;
  gemm.tiled = tiled;
  gemm.avx512 = avx512;
  CpuGemmGroup group;
  group.rows = shape.m;
  group.packed = packed.typed_data();
  group.scale = ScaleBytes(scale);
  group.global_scale = global_scale.typed_data()[0];
  group.bias = bias.element_count() != 0 ? bias.untyped_data() : nullptr;
  RunCpuGemm(thread_pool, gemm, {group});
  return ffi::Error::Success();
}

}  // namespace

void RunCpuGemm(ffi::ThreadPool thread_pool, const CpuGemm& gemm,
                const std::vector<CpuGemmGroup>& groups) {
  auto job = std::make_shared<MatmulJob>();
  job->n = gemm.n;
  job->k = gemm.k;
  job->block_size = gemm.block_size;
  job->k_blocks = (gemm.k + gemm.block_size - 1) / gemm.block_size;
  job->y = gemm.y;
  job->dtype = gemm.dtype;
  job->tiled = gemm.tiled;
  job->avx512 = gemm.avx512;
  if (gemm.n == 0) return;
  int64_t end_row = 0, biases = 0, work = 0;
  for (const CpuGemmGroup& group : groups) {
    if (group.rows <= 0) continue;
    end_row = std::max(end_row, group.row0 + group.rows);
    biases += group.bias != nullptr;
  }
  // The activations up to the last group's end in fp32 (rows past it are never read); each
  // bias once, before the groups point into the buffer (no reallocation after).
  job->a_f32.resize(static_cast<size_t>(end_row * gemm.k));
  ToFloats(gemm.a, gemm.dtype, end_row * gemm.k, job->a_f32.data());
  job->bias_f32.resize(static_cast<size_t>(biases * gemm.n));
  const int64_t panels = (gemm.n + kPanelRows - 1) / kPanelRows;
  int64_t bias_index = 0;
  for (const CpuGemmGroup& group : groups) {
    if (group.rows <= 0) continue;
    JobGroup g;
    g.row0 = group.row0;
    g.rows = group.rows;
    g.packed = group.packed;
    g.scale = group.scale;
    g.global_scale = group.global_scale;
    if (group.bias != nullptr) {
      float* out = job->bias_f32.data() + bias_index++ * gemm.n;
      ToFloats(group.bias, gemm.dtype, gemm.n, out);
      g.bias = out;
    }
    g.m_blocks = (group.rows + kBlockRows - 1) / kBlockRows;
    g.first_unit = job->num_units;
    job->num_units += g.m_blocks * panels;
    job->max_group_rows = std::max(job->max_group_rows, group.rows);
    work += group.rows * gemm.n * gemm.k;
    job->groups.push_back(g);
  }
  if (job->num_units == 0) return;

  // Small problems are not worth waking other threads for.
  const bool parallel = work >= kParallelWork;
  const int64_t helpers = parallel ? std::min(thread_pool.num_threads(), job->num_units) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) thread_pool.Schedule([job] { Work(job); });
  Work(job);  // the calling thread works too, so progress never depends on the pool
  std::unique_lock<std::mutex> lock(job->mutex);
  job->all_done.wait(lock, [&] { return job->done_units.load() == job->num_units; });
}

std::string CpuKernelBuilds(bool avx512) {
  std::string builds;
#ifdef JAX_FP4_CPU_HAS_AVX512_BUILD
  if (avx512 && CpuHasAvx512()) builds = "x86-64-v4 (AVX-512) GEMM, ";
#endif
#ifdef JAX_FP4_CPU_HAS_AVX2_BUILD
#if __GNUC__ >= 12
  const bool v3 = __builtin_cpu_supports("x86-64-v3");
#else
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  if (v3)
    return builds + (builds.empty() ? "x86-64-v3 (AVX2, FMA)" : "x86-64-v3 (AVX2, FMA) decode");
#endif
  return builds + "plain C++ (no vector clones for this CPU or compiler)";
}

}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFp4MatmulCpu, jax_fp4::MatmulCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()        // XLA's intra-op threads
        .Arg<ffi::AnyBuffer>()         // a [M, K]
        .Arg<ffi::Buffer<ffi::U8>>()   // packed [N, K/2]
        .Arg<ffi::AnyBuffer>()         // scale [N, ceil(K/block)]
        .Arg<ffi::Buffer<ffi::F32>>()  // global scale, one element
        .Arg<ffi::AnyBuffer>()         // bias [N] or [0]
        .Ret<ffi::AnyBuffer>()         // y [M, N]
        .Attr<int64_t>("block_size")
        .Attr<bool>("tiled")     // weight in the tiled layout
        .Attr<bool>("avx512"));  // AVX-512 panel product if the CPU has it
