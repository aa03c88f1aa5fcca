// Python module `jax_fp4._jax_fp4_cpu`: hands the CPU FFI handlers to jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu/handlers.h"
#include "jax_fp4/ffi_capsule.h"
#include "jax_fp4/gemv_config.h"

namespace nb = nanobind;

NB_MODULE(_jax_fp4_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fp4_matmul_cpu"] = jax_fp4::FfiCapsule(JaxFp4MatmulCpu);
    return targets;
  });
  m.def("kernel_builds", &jax_fp4::CpuKernelBuilds);
  // The CUDA decode GEMV's launch heuristic (pure; exposed so CPU tests can check it).
  m.def(
      "gemv_launch_config",
      [](int64_t m, int64_t n, int64_t k, int64_t num_sms, bool tiled) {
        const jax_fp4::GemvLaunchConfig cfg =
            jax_fp4::gemv_launch_config(m, n, k, num_sms, tiled);
        nb::dict out;
        out["col_tiles"] = cfg.col_tiles;
        out["row_tiles"] = cfg.row_tiles;
        out["k_split"] = cfg.k_split;
        out["rows_per_block"] = cfg.rows_per_block;
        return out;
      },
      nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("num_sms") = 132, nb::kw_only(),
      nb::arg("tiled"));
}
