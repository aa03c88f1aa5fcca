// XLA FFI handlers of the CPU module.
#ifndef JAX_FP4_CPU_HANDLERS_H_
#define JAX_FP4_CPU_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

// Fused decode + dot: (a [M,K], packed, scale, global_scale, bias [N] or [0]) -> y [M,N].
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp4MatmulCpu);

#endif  // JAX_FP4_CPU_HANDLERS_H_
