// Python module `jax_fp4._jax_fp4_cpu`: hands the CPU FFI handlers to jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "cpu/handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_fp4_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fp4_matmul_cpu"] = Capsule(JaxFp4MatmulCpu);
    return targets;
  });
}
