"""Loading the compiled modules and registering their XLA FFI targets with JAX."""

from __future__ import annotations

import jax

try:
    from jax_fp4 import _jax_fp4_cpu
except ImportError as err:  # pragma: no cover - only in a source tree that was never built
    raise ImportError(
        "jax_fp4's compiled CPU module is missing; install the package with `pip install .` "
        "(or `pip install -e .`) so that CMake builds it") from err

try:
    from jax_fp4 import _jax_fp4_cuda
except ImportError:  # built without nvcc: CPU (and the reference lowering) only
    _jax_fp4_cuda = None

_PLATFORM_MODULES = {"cpu": _jax_fp4_cpu, "CUDA": _jax_fp4_cuda}

# Every FFI target the compiled modules define, per platform, built here or not (a program can be
# exported for a platform this build lacks; tests/test_info.py keeps this equal to the modules').
FFI_TARGETS = {
    "cpu": ("jax_fp4_matmul_cpu",),
    "CUDA": ("jax_fp4_gemv_cuda", "jax_fp4_dequant_cuda", "jax_fp4_quantize_activation_cuda",
             "jax_fp4_swizzle_scales_cuda", "jax_fp4_native_sm120_cuda", "jax_fp4_fused_cuda"),
}


def _register_all() -> dict[str, list[str]]:
    registered: dict[str, list[str]] = {}
    for platform, module in _PLATFORM_MODULES.items():
        if module is None:
            continue
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
            registered.setdefault(platform, []).append(name)
    return registered


REGISTERED_TARGETS = _register_all()


def has_cuda_kernels() -> bool:
    """Whether this build carries the CUDA module (nvcc was found when it was built)."""
    return _jax_fp4_cuda is not None


# CMakeLists.txt's default JAX_FP4_CUDA_ARCHITECTURES (tests/test_info.py keeps the two equal).
DEFAULT_CUDA_ARCHITECTURES = "80-real;90a-real;120a-real;80-virtual"


def cpu_kernel_builds() -> str:
    """The instruction sets the `cpu` path's kernel runs on this CPU (chosen at run time), e.g.
    'x86-64-v4 (AVX-512) GEMM, x86-64-v3 (AVX2, FMA) decode'."""
    return _jax_fp4_cpu.kernel_builds()


def cuda_architectures() -> str:
    """The CUDA architectures compiled in, e.g. '80-real,90a-real,120a-real,80-virtual' (CMake's
    list, its ';' written as ',')."""
    return _jax_fp4_cuda.architectures() if _jax_fp4_cuda is not None else ""
