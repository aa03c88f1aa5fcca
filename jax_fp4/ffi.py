"""Loading the compiled modules and registering their XLA FFI targets with JAX."""

from __future__ import annotations

import sys
from pathlib import Path

import jax

from jax_fp4 import config

_CPU_MODULE = "_jax_fp4_cpu"


def _compiled_files(package_dir: Path, module: str) -> list[Path]:
    return sorted(package_dir.glob(module + ".*"))


def missing_cpu_module_error(package_dir: Path, search_path: list[str]) -> ImportError:
    """The ImportError for a failed import of the compiled CPU module from `package_dir` (the
    jax_fp4 folder Python found), with what happened and what to do: a source checkout imported in
    place of the installed package, an install without its module, or a module that failed to load.
    `search_path` is sys.path, where an installed copy is looked for."""
    package_dir = package_dir.resolve()
    if _compiled_files(package_dir, _CPU_MODULE):
        return ImportError(
            f"jax_fp4's compiled CPU module in {package_dir} failed to load (the error above: built for "
            "another Python or jaxlib?); reinstall jax_fp4 for this interpreter"
        )
    root = package_dir.parent
    if (root / "pyproject.toml").is_file():
        installed = None
        for entry in search_path:
            candidate = Path(entry or ".").resolve() / "jax_fp4"
            if candidate != package_dir and _compiled_files(candidate, _CPU_MODULE):
                installed = candidate
                break
        where = (
            f"an installed jax_fp4 is at {installed}: run from another directory to use it"
            if installed
            else "run from another directory to use an installed jax_fp4"
        )
        return ImportError(
            f"you are importing jax_fp4 from its source tree ({package_dir}), which has no compiled "
            f"modules; {where}, or install the checkout in place with `pip install -e .` (from {root})"
        )
    return ImportError(
        f"jax_fp4 in {package_dir} has no compiled CPU module ({_CPU_MODULE}): the install is broken; "
        "reinstall it (`pip install --force-reinstall jax_fp4`, or `pip install .` from its source)"
    )


try:
    from jax_fp4 import _jax_fp4_cpu
except ImportError as err:
    raise missing_cpu_module_error(Path(__file__).parent, sys.path) from err

try:
    from jax_fp4 import _jax_fp4_cuda
except ImportError:  # built without nvcc: CPU (and the reference lowering) only
    _jax_fp4_cuda = None

_PLATFORM_MODULES = {"cpu": _jax_fp4_cpu, "CUDA": _jax_fp4_cuda}

# Every FFI target the compiled modules define, per platform, built here or not (a program can be
# exported for a platform this build lacks; tests/test_info.py keeps this equal to the modules').
FFI_TARGETS = {
    "cpu": ("jax_fp4_matmul_cpu",),
    "CUDA": (
        "jax_fp4_gemv_cuda",
        "jax_fp4_dequant_cuda",
        "jax_fp4_quantize_activation_cuda",
        "jax_fp4_swizzle_scales_cuda",
        "jax_fp4_native_sm120_cuda",
        "jax_fp4_fused_cuda",
    ),
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
    'x86-64-v4 (AVX-512) GEMM, x86-64-v3 (AVX2, FMA) decode' (JAX_FP4_CPU_AVX512 honoured)."""
    return _jax_fp4_cpu.kernel_builds(config.cpu_avx512())


def cuda_architectures() -> str:
    """The CUDA architectures compiled in, e.g. '80-real,90a-real,120a-real,80-virtual' (CMake's
    list, its ';' written as ',')."""
    return _jax_fp4_cuda.architectures() if _jax_fp4_cuda is not None else ""
