// Python module `jax_fp4._jax_fp4_cuda`: hands the CUDA FFI handlers to jax.ffi.register_ffi_target
// (platform "CUDA"). Importing it needs no GPU: cudart is linked statically and nothing here
// touches the device.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cuda/handlers.h"
#include "jax_fp4/ffi_capsule.h"
#include "cuda/fused/fused.h"
#include "cuda/native_sm120/handlers.h"

namespace nb = nanobind;

NB_MODULE(_jax_fp4_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fp4_gemv_cuda"] = jax_fp4::FfiCapsule(JaxFp4GemvCuda);
    targets["jax_fp4_dequant_cuda"] = jax_fp4::FfiCapsule(JaxFp4DequantCuda);
    targets["jax_fp4_quantize_activation_cuda"] = jax_fp4::FfiCapsule(JaxFp4QuantizeActivationCuda);
    targets["jax_fp4_swizzle_scales_cuda"] = jax_fp4::FfiCapsule(JaxFp4SwizzleScalesCuda);
    targets["jax_fp4_native_sm120_cuda"] = jax_fp4::FfiCapsule(JaxFp4NativeSm120Cuda);
    targets["jax_fp4_fused_cuda"] = jax_fp4::FfiCapsule(JaxFp4FusedCuda);
    targets["jax_fp4_grouped_gemv_cuda"] = jax_fp4::FfiCapsule(JaxFp4GroupedGemvCuda);
    targets["jax_fp4_grouped_gemm_cuda"] = jax_fp4::FfiCapsule(JaxFp4GroupedGemmCuda);
    targets["jax_fp4_top_k_routing_cuda"] = jax_fp4::FfiCapsule(JaxFp4TopKRoutingCuda);
    targets["jax_fp4_moe_gate_up_cuda"] = jax_fp4::FfiCapsule(JaxFp4MoeGateUpCuda);
    targets["jax_fp4_moe_down_cuda"] = jax_fp4::FfiCapsule(JaxFp4MoeDownCuda);
    return targets;
  });
  m.def("architectures", []() { return std::string(JAX_FP4_CUDA_ARCHITECTURES); });
  m.def("cuda_version", []() { return std::string(JAX_FP4_CUDA_VERSION); });
}
