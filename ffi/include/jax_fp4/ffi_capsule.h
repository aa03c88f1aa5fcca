// Handing an XLA FFI handler to Python (for jax.ffi.register_ffi_target). Included only by the
// nanobind module sources, never by .cu files.
#ifndef JAX_FP4_FFI_CAPSULE_H_
#define JAX_FP4_FFI_CAPSULE_H_

#include <nanobind/nanobind.h>

namespace jax_fp4 {

template <typename Fn>
nanobind::capsule FfiCapsule(Fn* handler) {
  return nanobind::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace jax_fp4

#endif  // JAX_FP4_FFI_CAPSULE_H_
