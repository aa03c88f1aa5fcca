// CPU XLA FFI handler of the grouped product (jax_fp4.ragged_matmul): the rows of A come sorted by
// group, group g's rows multiply weight g of a stack, as jax.lax.ragged_dot does.
//
// The group offsets are prefix sums of group_sizes, read on the host (CPU buffers are host
// memory); every group with rows is one group of the CPU kernel (RunCpuGemm, ffi/cpu/matmul.cc),
// so a row gets the bits the dense kernel gives it with its group's weight, whatever the group
// sizes. A group with no rows reads nothing of its weight. Rows past the groups are zeros.
// group_sizes as ragged_dot's masks read them when they are in range; out of range, the GPU
// kernels' rule: a negative size counts as 0, and the groups end at M (rows past M do not exist).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/handlers.h"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fp4 {
namespace {

// Checks the grouped operands: a [M, K], packed [G, N, K/2], scale [G, N, ceil(K/block)],
// global_scale [G], group_sizes [G], bias [G, N] or empty, y [M, N]. Fills shape (m, n, k,
// k_blocks) and groups. Returns "" when valid, else a description of the problem.
std::string CheckGroupedOperands(ffi::AnyBuffer a, ffi::Buffer<ffi::U8> packed,
                                 ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> global_scale,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer bias,
                                 const ffi::AnyBuffer& y, int64_t block_size, MatmulShape* shape,
                                 int64_t* groups) {
  const auto packed_dims = packed.dimensions();
  const auto scale_dims = scale.dimensions();
  if (packed_dims.size() != 3) {
    return "packed must be [G, N, K/2] (rank 3), got " + DimsToString(packed_dims);
  }
  *groups = packed_dims[0];
  if (scale_dims.size() != 3 || scale_dims[0] != *groups) {
    return "scale must be [G = " + std::to_string(*groups) + ", N, ceil(K/block_size)], got " +
           DimsToString(scale_dims);
  }
  // One group's weight as the dense matmul's checks see it (its global scale: one element).
  std::string problem = CheckMatmulOperands(
      a.element_type(), a.dimensions(), packed_dims.last(2), scale_dims.last(2),
      scale.element_type(), 1, bias.element_type(), 0, y.element_type(), y.dimensions(), block_size,
      /*allow_f32=*/true, shape);
  if (!problem.empty()) return problem;
  if (global_scale.element_count() != static_cast<size_t>(*groups)) {
    return "global_scale must hold G = " + std::to_string(*groups) + " elements, got " +
           std::to_string(global_scale.element_count());
  }
  if (group_sizes.element_count() != static_cast<size_t>(*groups)) {
    return "group_sizes must hold G = " + std::to_string(*groups) + " elements, got " +
           std::to_string(group_sizes.element_count());
  }
  const size_t bias_count = static_cast<size_t>(*groups * shape->n);
  if (bias.element_count() != 0 &&
      (bias.element_type() != a.element_type() || bias.element_count() != bias_count)) {
    return "bias must be empty or hold G x N = " + std::to_string(bias_count) +
           " elements of a's type, got " + std::to_string(bias.element_count());
  }
  return "";
}

ffi::Error GroupedMatmulCpuImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer a,
                                ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer scale,
                                ffi::Buffer<ffi::F32> global_scale,
                                ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer bias,
                                ffi::Result<ffi::AnyBuffer> y, int64_t block_size, bool tiled,
                                bool avx512) {
  MatmulShape shape;
  int64_t num_groups = 0;
  const std::string problem = CheckGroupedOperands(a, packed, scale, global_scale, group_sizes,
                                                   bias, *y, block_size, &shape, &num_groups);
  if (!problem.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_grouped_matmul_cpu: " + problem);
  }
  if (const std::string bad = tiled ? CheckTiledLayout(shape, block_size) : ""; !bad.empty()) {
    return ffi::Error::InvalidArgument("jax_fp4_grouped_matmul_cpu: " + bad);
  }
  if (shape.m == 0 || shape.n == 0) return ffi::Error::Success();

  CpuGemm gemm;
  gemm.a = a.untyped_data();
  gemm.y = y->untyped_data();
  gemm.dtype = a.element_type();
  gemm.n = shape.n;
  gemm.k = shape.k;
  gemm.block_size = block_size;
  gemm.tiled = tiled;
  gemm.avx512 = avx512;

  const int64_t weight_bytes = shape.n * (shape.k / 2);
  const int64_t scale_bytes = shape.n * shape.k_blocks;
  const size_t bias_bytes = static_cast<size_t>(shape.n) * ffi::ByteWidth(gemm.dtype);
  const int32_t* sizes = group_sizes.typed_data();
  std::vector<CpuGemmGroup> groups;
  int64_t end = 0;  // the running prefix sum, clamped to [0, M]
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(sizes[g], 0), shape.m - end);
    if (rows == 0) continue;
    CpuGemmGroup group;
    group.row0 = end;
    group.rows = rows;
    group.packed = packed.typed_data() + g * weight_bytes;
    group.scale = ScaleBytes(scale) + g * scale_bytes;
    group.global_scale = global_scale.typed_data()[g];
    if (bias.element_count() != 0) {
      group.bias = static_cast<const char*>(bias.untyped_data()) + g * bias_bytes;
    }
    groups.push_back(group);
    end += rows;
  }
  // Rows past the last group: zeros, as ragged_dot gives them.
  const size_t row_bytes = static_cast<size_t>(shape.n) * ffi::ByteWidth(gemm.dtype);
  std::memset(static_cast<char*>(gemm.y) + end * row_bytes, 0, (shape.m - end) * row_bytes);
  RunCpuGemm(thread_pool, gemm, groups);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFp4GroupedMatmulCpu, jax_fp4::GroupedMatmulCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()        // XLA's intra-op threads
        .Arg<ffi::AnyBuffer>()         // a [M, K], rows sorted by group
        .Arg<ffi::Buffer<ffi::U8>>()   // packed [G, N, K/2]
        .Arg<ffi::AnyBuffer>()         // scale [G, N, ceil(K/block)]
        .Arg<ffi::Buffer<ffi::F32>>()  // global scales [G]
        .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
        .Arg<ffi::AnyBuffer>()         // bias [G, N] or [0]
        .Ret<ffi::AnyBuffer>()         // y [M, N]
        .Attr<int64_t>("block_size")
        .Attr<bool>("tiled")     // weights in the tiled layout
        .Attr<bool>("avx512"));  // AVX-512 panel product if the CPU has it
