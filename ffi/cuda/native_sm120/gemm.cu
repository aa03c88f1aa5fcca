// Native Blackwell SM120 NVFP4 x NVFP4 GEMM (spec section 6): Y = alpha * (A_q @ B_q^T) + bias with
// A_q the NVFP4-quantized activation (jax_fp4_quantize_activation_cuda), B_q the NVFP4 weight, both
// with E4M3 block scales in CUTLASS's SM1xx "128x4" swizzled layout, and
// alpha = a_global_scale * b_global_scale.
//
// CUTLASS 4.x block-scaled collective for sm_120a (mma.sync ... kind::mxf4nvf4.block_scale), after
// CUTLASS example 79a: one tile configuration (128x128x128, cluster 1x1x1, cooperative persistent
// schedule), instantiated for fp16 and bf16 output, with a per-column (per-N) bias fused into the
// epilogue (LinCombPerColBias; a null bias pointer means no bias).
//
// Build cost: CUTLASS is compiled in two of the file's passes only, the host pass and the sm_120a
// device pass. The kernel entry point takes its parameters as an opaque, 128-byte aligned blob and
// is instantiated explicitly with forward-declared tags, so the sm_80/sm_90a passes see neither the
// CUTLASS headers nor a kernel body (they get an empty kernel of the same signature). At run time
// the handler checks that the device is compute capability 12.x and that the loaded kernel came
// from sm_120a code (not from PTX of another architecture), and answers an ffi::Error otherwise.
//
// Without CUTLASS headers (JAX_FP4_HAVE_CUTLASS undefined, see CMakeLists.txt) this file builds a
// handler that only answers an error.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>

#include "cuda/native_sm120/handlers.h"
#include "jax_fp4/validate.h"
#include "xla/ffi/api/ffi.h"

// The device pass whose code may use SM120 block-scaled MMA: sm_120a (or the sm_120f family).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200 && __CUDA_ARCH__ < 1300 &&     \
    (defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) || \
     defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FAMILY_SPECIFIC__))
#define JAX_FP4_SM120_DEVICE_PASS 1
#endif

// CUTLASS is compiled where it is used: the host pass and the sm_120a device pass.
#if defined(JAX_FP4_HAVE_CUTLASS) && (!defined(__CUDA_ARCH__) || defined(JAX_FP4_SM120_DEVICE_PASS))
#define JAX_FP4_COMPILE_CUTLASS 1
#endif

#if defined(JAX_FP4_COMPILE_CUTLASS)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace ffi = xla::ffi;

namespace jax_fp4 {

#if !defined(__CUDA_ARCH__)
namespace {

constexpr int64_t kBlock = 16;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t SwizzledScaleBytes(int64_t rows, int64_t k_blocks) {
  return CeilDiv(rows, 128) * 128 * CeilDiv(k_blocks, 4) * 4;
}

// Compute capability (major * 10 + minor) of the current device, cached per device.
int CurrentCapability(int* device_out) {
  static std::atomic<int> cache[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  *device_out = device;
  if (device >= 0 && device < 64) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return -1;
  }
  const int cc = major * 10 + minor;
  if (device >= 0 && device < 64) cache[device].store(cc, std::memory_order_relaxed);
  return cc;
}

}  // namespace
#endif  // !__CUDA_ARCH__

// A named namespace: nvcc's generated launch stubs fail for kernel templates instantiated with
// types from an anonymous namespace.
namespace sm120 {

// Tags naming the two GEMM instantiations; complete (deriving from the CUTLASS kernel) only where
// CUTLASS is compiled.
struct GemmKernelF16;
struct GemmKernelBF16;

// alpha = a_global_scale * b_global_scale on the device (both are device scalars). External
// linkage, so that every device pass keeps it although only host code launches it.
__global__ void AlphaKernel(const float* a_gs, const float* b_gs, float* alpha) {
  alpha[0] = a_gs[0] * b_gs[0];
}

// The kernel parameters travel as an opaque blob (CUTLASS's Params holds TMA descriptors and is
// 128-byte aligned); its size is checked against CUTLASS's Params in the host pass.
inline constexpr int kParamBlobBytes = 2560;  // CUTLASS 4.2: 2176 bytes
inline constexpr int kGemmThreads =
    384;  // cooperative schedule: 1 producer + 2 consumer warpgroups
struct alignas(128) ParamBlob {
  unsigned char bytes[kParamBlobBytes];
};

// The kernel entry point: CUTLASS's device_kernel, with the body compiled only in the sm_120a pass
// (CUTLASS's own guard also admits sm_90a, which would build the whole SM120 mainloop for Hopper).
template <typename Kernel>
__global__ void __launch_bounds__(kGemmThreads, 1)
    Sm120Nvfp4GemmKernel(__grid_constant__ const ParamBlob blob) {
#if defined(JAX_FP4_SM120_DEVICE_PASS) && defined(JAX_FP4_COMPILE_CUTLASS)
  extern __shared__ char smem[];
  Kernel op;
  op(*reinterpret_cast<const typename Kernel::Params*>(&blob), smem);
#endif
}

}  // namespace sm120

#if defined(JAX_FP4_COMPILE_CUTLASS)

namespace sm120 {

using namespace cute;

template <typename ElementOut>
struct Sm120Nvfp4Gemm {
  using ElementA = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
  using ElementB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
  using LayoutATag = cutlass::layout::RowMajor;     // A [M, K], K contiguous
  using LayoutBTag = cutlass::layout::ColumnMajor;  // B [N, K], K contiguous
  static constexpr int kAlignmentA = 32;            // 16 bytes of FP4
  static constexpr int kAlignmentB = 32;
  using ElementD = ElementOut;
  using LayoutDTag = cutlass::layout::RowMajor;
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ArchTag = cutlass::arch::Sm120;
  using OperatorClass = cutlass::arch::OpClassBlockScaledTensorOp;
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _1, _1>;  // SM120 has no multicast: cluster 1x1x1

  // D = alpha * acc + bias[n]; no C operand.
  using FusionOp = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, ElementCompute, ElementD,
                                                                ElementD, ElementCompute>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, OperatorClass, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute, void,
      LayoutDTag, kAlignmentD, ElementD, LayoutDTag, kAlignmentD,
      cutlass::epilogue::collective::EpilogueScheduleAuto, FusionOp>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, OperatorClass, ElementA, LayoutATag, kAlignmentA, ElementB, LayoutBTag, kAlignmentB,
      ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                           CollectiveEpilogue, void>;
  using Params = typename GemmKernel::Params;
  using Arguments = typename GemmKernel::Arguments;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
  using ScaleConfig = typename CollectiveMainloop::Sm1xxBlkScaledConfig;
};

struct GemmKernelF16 : Sm120Nvfp4Gemm<cutlass::half_t>::GemmKernel {};
struct GemmKernelBF16 : Sm120Nvfp4Gemm<cutlass::bfloat16_t>::GemmKernel {};

}  // namespace sm120

#endif  // JAX_FP4_COMPILE_CUTLASS

// Every pass instantiates the same two kernels; only the sm_120a pass gives them a body.
template __global__ void sm120::Sm120Nvfp4GemmKernel<sm120::GemmKernelF16>(
    __grid_constant__ const sm120::ParamBlob);
template __global__ void sm120::Sm120Nvfp4GemmKernel<sm120::GemmKernelBF16>(
    __grid_constant__ const sm120::ParamBlob);

// The host side: launch code (host pass only).
#if defined(JAX_FP4_COMPILE_CUTLASS) && !defined(__CUDA_ARCH__)

namespace sm120 {

using namespace cute;

// Stride (ld, 1, 0) of a packed matrix whose second mode is contiguous: A (M, K) and B (N, K) with
// K contiguous, D (M, N) row-major; batch stride 0 (one batch). Equivalent to CUTLASS's
// make_cute_packed_stride, which lives in tools/util (not shipped in the wheel's include dir).
template <typename Stride>
Stride PackedStride(int64_t leading) {
  static_assert(
      cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<1>(Stride{}))>, cute::Int<1>>,
      "expected a stride whose second mode is contiguous");
  Stride stride{};
  cute::get<0>(stride) = leading;
  cute::get<2>(stride) = 0;
  return stride;
}

template <typename ElementOut>
struct KernelFor;
template <>
struct KernelFor<cutlass::half_t> {
  using type = GemmKernelF16;
};
template <>
struct KernelFor<cutlass::bfloat16_t> {
  using type = GemmKernelBF16;
};

template <typename ElementOut>
ffi::Error RunGemm(cudaStream_t stream, int device, int64_t m, int64_t n, int64_t k,
                   const uint8_t* a_packed, const uint8_t* a_scale, const uint8_t* b_packed,
                   const uint8_t* b_scale, const void* bias, void* y, uint8_t* workspace) {
  using G = Sm120Nvfp4Gemm<ElementOut>;
  using GemmKernel = typename KernelFor<ElementOut>::type;
  const std::string name = "jax_fp4_native_sm120_cuda: ";
  auto* kernel = &Sm120Nvfp4GemmKernel<GemmKernel>;

  // The kernel must come from sm_120a code: PTX of another architecture JIT-compiled for this
  // device would run the empty body.
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)) != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      name +
                          "no kernel image for this device; build jax_fp4 with 120a-real in "
                          "JAX_FP4_CUDA_ARCHITECTURES");
  }
  if (attributes.ptxVersion < 120) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      name +
                          "this jax_fp4 build has no sm_120a code for the NVFP4 GEMM (kernel PTX "
                          "version " +
                          std::to_string(attributes.ptxVersion) +
                          "); build with 120a-real in JAX_FP4_CUDA_ARCHITECTURES");
  }

  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const auto stride_a = PackedStride<typename G::StrideA>(k);
  const auto stride_b = PackedStride<typename G::StrideB>(k);
  const auto stride_d = PackedStride<typename G::StrideD>(n);
  auto layout_sfa = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(mi, ni, ki, 1));
  auto layout_sfb = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(mi, ni, ki, 1));

  using MainloopElementA = typename G::CollectiveMainloop::ElementA;
  using MainloopElementB = typename G::CollectiveMainloop::ElementB;
  using ElementSF = typename G::CollectiveMainloop::ElementSF;
  typename G::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {mi, ni, ki, 1};
  args.mainloop.ptr_A = reinterpret_cast<MainloopElementA const*>(a_packed);
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = reinterpret_cast<MainloopElementB const*>(b_packed);
  args.mainloop.dB = stride_b;
  args.mainloop.ptr_SFA = reinterpret_cast<ElementSF const*>(a_scale);
  args.mainloop.layout_SFA = layout_sfa;
  args.mainloop.ptr_SFB = reinterpret_cast<ElementSF const*>(b_scale);
  args.mainloop.layout_SFB = layout_sfb;
  auto& fusion = args.epilogue.thread;
  fusion.alpha_ptr = reinterpret_cast<const float*>(workspace);  // written by AlphaKernel
  fusion.beta = 0.0f;
  fusion.bias_ptr = static_cast<const ElementOut*>(bias);  // nullptr: no bias
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = {};
  args.epilogue.ptr_D = static_cast<ElementOut*>(y);
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = device;
  {
    static std::atomic<int> sm_counts[64] = {};
    int sms = device >= 0 && device < 64 ? sm_counts[device].load(std::memory_order_relaxed) : 0;
    if (sms <= 0) {
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      if (device >= 0 && device < 64) sm_counts[device].store(sms, std::memory_order_relaxed);
    }
    args.hw_info.sm_count = sms;
  }

  if (!GemmKernel::can_implement(args)) {
    return ffi::Error::InvalidArgument(name + "CUTLASS cannot implement M=" + std::to_string(m) +
                                       " N=" + std::to_string(n) + " K=" + std::to_string(k));
  }
  const size_t cutlass_workspace = GemmKernel::get_workspace_size(args);
  if (cutlass_workspace >
      static_cast<size_t>(kNativeWorkspaceBytes - kNativeWorkspaceCutlassOffset)) {
    return ffi::Error::Internal(name + "CUTLASS needs " + std::to_string(cutlass_workspace) +
                                " bytes of workspace, more than reserved");
  }
  uint8_t* cutlass_ws = workspace + kNativeWorkspaceCutlassOffset;
  if (GemmKernel::initialize_workspace(args, cutlass_ws, stream) != cutlass::Status::kSuccess) {
    return ffi::Error::Internal(name + "CUTLASS workspace initialisation failed");
  }
  static_assert(sizeof(typename G::Params) <= sizeof(ParamBlob) &&
                    alignof(typename G::Params) <= alignof(ParamBlob),
                "CUTLASS's kernel Params outgrew ParamBlob: raise kParamBlobBytes");
  static_assert(
      GemmKernel::MaxThreadsPerBlock == kGemmThreads && GemmKernel::MinBlocksPerMultiprocessor == 1,
      "kGemmThreads must match the CUTLASS kernel's launch bounds");
  ParamBlob blob;
  std::memset(&blob, 0, sizeof(blob));
  new (&blob) typename G::Params(GemmKernel::to_underlying_arguments(args, cutlass_ws));
  const auto& params = *reinterpret_cast<const typename G::Params*>(&blob);

  const int smem = static_cast<int>(GemmKernel::SharedStorageSize);
  if (cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return ffi::Error::Internal(
        name + "cudaFuncSetAttribute(" + std::to_string(smem) +
        " bytes of shared memory): " + cudaGetErrorString(cudaGetLastError()));
  }
  const dim3 grid = GemmKernel::get_grid_shape(params);
  const dim3 block = GemmKernel::get_block_shape();
  kernel<<<grid, block, smem, stream>>>(blob);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace sm120

#endif  // JAX_FP4_COMPILE_CUTLASS && !__CUDA_ARCH__

// The handler (host code; the device passes need only the kernels above).
#if !defined(__CUDA_ARCH__)

namespace {

ffi::Error NativeSm120Impl(cudaStream_t stream, ffi::Buffer<ffi::U8> a_packed,
                           ffi::Buffer<ffi::U8> a_scale, ffi::Buffer<ffi::F32> a_global_scale,
                           ffi::Buffer<ffi::U8> b_packed, ffi::Buffer<ffi::U8> b_scale,
                           ffi::Buffer<ffi::F32> b_global_scale, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t block_size) {
  const std::string name = "jax_fp4_native_sm120_cuda: ";
  // Operand checks first (they hold on any device).
  if (block_size != kBlock) {
    return ffi::Error::InvalidArgument(name + "block_size must be 16, got " +
                                       std::to_string(block_size));
  }
  const auto ad = a_packed.dimensions(), bd = b_packed.dimensions(), yd = y->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1]) {
    return ffi::Error::InvalidArgument(name + "a_packed [M, K/2] and b_packed [N, K/2] disagree: " +
                                       DimsToString(ad) + " vs " + DimsToString(bd));
  }
  const int64_t m = ad[0], n = bd[0], k = 2 * ad[1], k_blocks = k / kBlock;
  if (k % 32 || n % 32) {
    return ffi::Error::InvalidArgument(name + "K and N must be multiples of 32, got K=" +
                                       std::to_string(k) + " N=" + std::to_string(n));
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return ffi::Error::InvalidArgument(name + "M, N and K must fit in 32 bits");
  }
  if (static_cast<int64_t>(a_scale.element_count()) != SwizzledScaleBytes(m, k_blocks) ||
      static_cast<int64_t>(b_scale.element_count()) != SwizzledScaleBytes(n, k_blocks)) {
    return ffi::Error::InvalidArgument(
        name + "a_scale and b_scale must be swizzled (128x4) scales of " +
        std::to_string(SwizzledScaleBytes(m, k_blocks)) + " and " +
        std::to_string(SwizzledScaleBytes(n, k_blocks)) + " bytes, got " +
        DimsToString(a_scale.dimensions()) + " and " + DimsToString(b_scale.dimensions()));
  }
  if (a_global_scale.element_count() != 1 || b_global_scale.element_count() != 1) {
    return ffi::Error::InvalidArgument(name + "global scales must hold one element each");
  }
  const ffi::DataType out_type = y->element_type();
  if (out_type != ffi::DataType::F16 && out_type != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(name + "y must be float16 or bfloat16");
  }
  if (yd.size() != 2 || yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument(name + "y must be [M, N], got " + DimsToString(yd));
  }
  const bool has_bias = bias.element_count() != 0;
  if (has_bias &&
      (bias.element_type() != out_type || static_cast<int64_t>(bias.element_count()) != n)) {
    return ffi::Error::InvalidArgument(name + "bias must be empty or hold N elements of y's type");
  }
  if (static_cast<int64_t>(workspace->element_count()) < kNativeWorkspaceBytes) {
    return ffi::Error::InvalidArgument(name + "workspace must hold " +
                                       std::to_string(kNativeWorkspaceBytes) + " bytes");
  }

  int device = 0;
  const int cc = CurrentCapability(&device);
  if (cc < 120 || cc >= 130) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      name +
                          "the native NVFP4 x NVFP4 GEMM needs a Blackwell SM120 GPU (compute "
                          "capability 12.x); this device has compute capability " +
                          (cc < 0 ? std::string("unknown")
                                  : std::to_string(cc / 10) + "." + std::to_string(cc % 10)));
  }
#if !defined(JAX_FP4_HAVE_CUTLASS)
  (void)stream;
  return ffi::Error(
      ffi::ErrorCode::kUnimplemented,
      name +
          "this jax_fp4 build has no SM120 GEMM (it needs 120a-real in JAX_FP4_CUDA_ARCHITECTURES "
          "and nvidia-cutlass's headers: rebuild with both)");
#else
  if (m == 0) return ffi::Error::Success();
  sm120::AlphaKernel<<<1, 1, 0, stream>>>(a_global_scale.typed_data(), b_global_scale.typed_data(),
                                          reinterpret_cast<float*>(workspace->typed_data()));
  const void* bias_ptr = has_bias ? bias.untyped_data() : nullptr;
  if (out_type == ffi::DataType::F16) {
    return sm120::RunGemm<cutlass::half_t>(
        stream, device, m, n, k, a_packed.typed_data(), a_scale.typed_data(), b_packed.typed_data(),
        b_scale.typed_data(), bias_ptr, y->untyped_data(), workspace->typed_data());
  }
  return sm120::RunGemm<cutlass::bfloat16_t>(
      stream, device, m, n, k, a_packed.typed_data(), a_scale.typed_data(), b_packed.typed_data(),
      b_scale.typed_data(), bias_ptr, y->untyped_data(), workspace->typed_data());
#endif
}

}  // namespace

#endif  // !__CUDA_ARCH__

}  // namespace jax_fp4

#if !defined(__CUDA_ARCH__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4NativeSm120Cuda, jax_fp4::NativeSm120Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // a_packed [M, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // a_scale, swizzled
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a_global_scale [1]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // b_packed [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // b_scale, swizzled
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b_global_scale [1]
                                  .Arg<ffi::AnyBuffer>()         // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()         // y [M, N]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // workspace
                                  .Attr<int64_t>("block_size"),
                              {ffi::Traits::kCmdBufferCompatible});
#endif  // !__CUDA_ARCH__
