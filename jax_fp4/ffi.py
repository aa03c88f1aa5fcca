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
    "cpu": ("jax_fp4_matmul_cpu", "jax_fp4_grouped_matmul_cpu"),
    "CUDA": (
        "jax_fp4_gemv_cuda",
        "jax_fp4_dequant_cuda",
        "jax_fp4_quantize_activation_cuda",
        "jax_fp4_swizzle_scales_cuda",
        "jax_fp4_native_sm120_cuda",
        "jax_fp4_fused_cuda",
        "jax_fp4_grouped_gemv_cuda",
        "jax_fp4_grouped_gemm_cuda",
        "jax_fp4_top_k_routing_cuda",
        "jax_fp4_moe_gate_up_cuda",
        "jax_fp4_moe_down_cuda",
    ),
}

# ---- CUDA graphs ---------------------------------------------------------------------------------
#
# XLA records runs of a GPU program's kernels into CUDA graphs (command buffers: on by default,
# --xla_gpu_enable_command_buffer lists CUSTOM_CALL) and launches each run at once; a custom call
# joins a graph only if its handler has the trait COMMAND_BUFFER_COMPATIBLE, else it splits the
# program there, and a decode step of ~220 matmul calls becomes hundreds of launches from the host.
# The trait is compiled into each handler (XLA_FFI_DEFINE_HANDLER_SYMBOL(..., {xla::ffi::Traits::
# kCmdBufferCompatible})), and XLA reads it from the handler's metadata when it registers it.
# Registration passes no traits: jax's CUDA plugin refuses traits given to register_ffi_target
# ("The plugin does not support custom call traits", jax 0.10-0.11), and refuses them only when the
# GPU backend starts, which would then fail. XLA_FLAGS=--xla_gpu_enable_command_buffer= turns the
# graphs off for a whole program (to compare).
#
# A handler XLA captures runs once, while XLA records the graph (again when the operands' buffer
# addresses change), and the graph replays what it launched. So it must launch the same work for
# the same shapes, attributes and addresses, and must not allocate, synchronise a stream or the
# device, read device memory on the host, or copy from host memory that is gone at replay. Per-
# device queries cached on first use (cudaGetDevice, cudaDeviceGetAttribute, cudaOccupancy*,
# cudaFuncGetAttributes), cudaFuncSetAttribute, cudaMemsetAsync on the call's stream and a tensor
# map encoded on the host and passed by value as a kernel parameter are all allowed.
#
# The CUDA targets whose handlers are COMMAND_BUFFER_COMPATIBLE, each checked for the above
# (tests/test_ffi_registration.py keeps this table equal to the traits the handlers declare):
COMMAND_BUFFER_TARGETS = (
    # Operand checks, cached device and occupancy queries, one kernel launch.
    "jax_fp4_gemv_cuda",
    "jax_fp4_dequant_cuda",
    # Plus cudaFuncSetAttribute, cached cluster-occupancy queries, the activation's tensor map
    # (a kernel parameter) and, for stream-K, a cudaMemsetAsync of the tile counters in its
    # workspace output.
    "jax_fp4_fused_cuda",
    # Kernel launches only (the dynamic scale's partial maxima go to a scratch output).
    "jax_fp4_quantize_activation_cuda",
    "jax_fp4_swizzle_scales_cuda",
    # The global-scale product kernel, CUTLASS's workspace set up on the call's stream (in the
    # workspace output), cudaFuncGetAttributes / cudaFuncSetAttribute, one launch.
    "jax_fp4_native_sm120_cuda",
    # Group offsets computed from group_sizes inside the kernels (the host never reads it), a grid
    # sized from the static M and G; the GEMM also cudaFuncSetAttribute and the activation's
    # tensor map.
    "jax_fp4_grouped_gemv_cuda",
    "jax_fp4_grouped_gemm_cuda",
    # Operand checks and one single-block launch.
    "jax_fp4_top_k_routing_cuda",
    # The grouped GEMV's device-side schedule (as above), one launch each; the down call's
    # per-token counters are zeroed by the gate/up launch (an output passed on to it), its float32
    # pair products go to a scratch output.
    "jax_fp4_moe_gate_up_cuda",
    "jax_fp4_moe_down_cuda",
)


def _register_all() -> dict[str, list[str]]:
    registered: dict[str, list[str]] = {}
    for platform, module in _PLATFORM_MODULES.items():
        if module is None:
            continue
        for name, capsule in module.registrations().items():
            # No traits here: each handler carries its own (see COMMAND_BUFFER_TARGETS).
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
            registered.setdefault(platform, []).append(name)
    return registered


REGISTERED_TARGETS = _register_all()


def has_cuda_kernels() -> bool:
    """Whether this build carries the CUDA module (nvcc was found when it was built)."""
    return _jax_fp4_cuda is not None


# Every architecture a kernel is written for: CMakeLists.txt's JAX_FP4_ALL_CUDA_ARCHITECTURES, what
# JAX_FP4_CUDA_ARCHITECTURES=all builds (tests/test_info.py keeps the two equal).
ALL_CUDA_ARCHITECTURES = "80-real;90a-real;120a-real;80-virtual"


def cpu_kernel_builds() -> str:
    """The instruction sets the `cpu` path's kernel runs on this CPU (chosen at run time), e.g.
    'x86-64-v4 (AVX-512) GEMM, x86-64-v3 (AVX2, FMA) decode' (JAX_FP4_CPU_AVX512 honoured)."""
    return _jax_fp4_cpu.kernel_builds(config.cpu_avx512())


def cuda_architectures() -> str:
    """The CUDA architectures compiled in, e.g. '80-real,90a-real,120a-real,80-virtual' (CMake's
    list, its ';' written as ',')."""
    return _jax_fp4_cuda.architectures() if _jax_fp4_cuda is not None else ""


def cuda_version() -> str:
    """The CUDA toolkit (nvcc) version the CUDA kernels were built with, e.g. '13.0.88'; '' without
    them."""
    if _jax_fp4_cuda is None:
        return ""
    return getattr(_jax_fp4_cuda, "cuda_version", lambda: "")()


# jax's CUDA plugins (pip's jaxlib itself runs on the CPU only), newest first.
JAX_CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")


def jax_cuda_plugin() -> str | None:
    """The installed jax CUDA plugin and its version, e.g. 'jax-cuda13-plugin 0.10.2', or None."""
    import importlib.metadata

    for name in JAX_CUDA_PLUGINS:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
