// Python module `jax_fp4._jax_fp4_cpu`: hands the CPU FFI handlers to jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu/handlers.h"
#include "jax_fp4/ffi_capsule.h"

namespace nb = nanobind;

NB_MODULE(_jax_fp4_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fp4_matmul_cpu"] = jax_fp4::FfiCapsule(JaxFp4MatmulCpu);
    targets["jax_fp4_grouped_matmul_cpu"] = jax_fp4::FfiCapsule(JaxFp4GroupedMatmulCpu);
    return targets;
  });
  m.def("kernel_builds", &jax_fp4::CpuKernelBuilds, nb::arg("avx512"));
}
