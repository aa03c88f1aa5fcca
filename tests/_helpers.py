"""Helpers shared by the test files: the devices present, random problems and their checks, the
CUDA kernels' direct-call attributes, jitted matmul chains, the CPU's features and loading the
repository's scripts."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import shutil
import sys
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import dispatch
from tests import reference
from tests.chains import (  # noqa: F401  (the chains' helpers, shared from here)
    CHAIN_DIMS,
    chain_weights,
    matmul_chain,
    plain_and_programmatic,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- the devices ---------------------------------------------------------------------------------


def gpus() -> list:
    """The CUDA devices jax sees (none where it has no GPU backend)."""
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:  # no backend at all
        return []


def skip_without_several_devices(request, what: str = "") -> None:
    """For a test of several devices: a `gpu`-marked test needs two or more CUDA devices, any
    other 8 CPU devices (tests/conftest.py asks XLA for them); skips, saying why, otherwise."""
    if request.node.get_closest_marker("gpu") is not None:
        found = len(gpus())
        if found < 2:
            pytest.skip(f"{what or 'it'} needs two or more CUDA devices, found {found}")
    elif not (jax.device_count() >= 8 and jax.devices()[0].platform == "cpu"):
        pytest.skip(
            "needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 set "
            "before jax is imported; tests/conftest.py does it)"
        )


def capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for any other device."""
    text = str(getattr(device, "compute_capability", "") or "")
    if getattr(device, "platform", None) != "gpu" or "." not in text:
        return None
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@dataclasses.dataclass(frozen=True)
class Device:
    """The device a test body runs on (the `device` fixture of tests/conftest.py): jax's default
    device while the test runs."""

    jax_device: Any

    @property
    def platform(self) -> str:
        """ "cpu" or "gpu", as jax names the platform."""
        return self.jax_device.platform

    @property
    def is_gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def capability(self) -> tuple[int, int] | None:
        return capability(self.jax_device)

    @property
    def is_hopper(self) -> bool:
        """Compute capability 9.0: the fused GEMM's device, where the dispatch rules come from."""
        return self.capability == (9, 0)

    def __str__(self) -> str:
        return self.platform


def has_sm90() -> bool:
    found = gpus()
    return bool(found) and capability(found[0]) == (9, 0)


# ---- random problems and checks of jax_fp4.matmul ------------------------------------------------


def random_case(rng, lead, n, k, block_size, dtype, with_bias):
    """A random weight, activations of shape lead + (K,), an optional bias, and the float64
    reference product."""
    packed, scale, gs = reference.random_weight(rng, n, k, block_size)
    w = jax_fp4.NVFP4Weight(packed, scale, gs, block_size=block_size)
    a = rng.standard_normal(lead + (k,)).astype(np.float32)
    a = jnp.asarray(a, dtype)
    bias = jnp.asarray(rng.standard_normal(n), dtype) if with_bias else None
    ref = reference.matmul(
        np.asarray(a, np.float64),
        packed,
        scale,
        gs,
        block_size,
        None if bias is None else np.asarray(bias, np.float64),
    )
    return a, w, bias, ref


def weight_rounding_reference(a, w, bias):
    """The float64 product with the weight the dequantizing paths (xla, and dequant on CUDA)
    multiply: rounded to a's dtype. With few terms that cancel, that rounding alone can exceed
    the output's tolerance, so for those paths it is part of the model, not of the error."""
    w = jax_fp4.unprepack(w) if w.layout == "tiled" else w
    return reference.matmul(
        np.asarray(a, np.float64),
        w.packed,
        w.scale_bytes,
        w.global_scale,
        w.block_size,
        None if bias is None else np.asarray(bias, np.float64),
        weight_dtype=a.dtype,
    )


EPS = {"bfloat16": 2**-7, "float16": 2**-10, "float32": 2**-20}


def check(y, ref, dtype):
    """y against the float64 reference: shape, dtype, finite, relative error, element-wise."""
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.dtype(dtype)
    y64 = y.astype(np.float64)
    assert np.isfinite(y64).all(), "non-finite output: an element was not written or overflowed"
    assert reference.relative_error(y64, ref) < reference.TOLERANCE[np.dtype(dtype).name]
    # Element-wise too: every element holds its own dot product (no stale or swapped elements).
    eps = EPS[np.dtype(dtype).name]
    scale = np.abs(ref).max() if ref.size else 1.0
    np.testing.assert_allclose(y64, ref, rtol=2 * eps, atol=4 * eps * scale)


# ---- the CUDA kernels called directly -------------------------------------------------------------

DTYPES = ["float16", "bfloat16"]
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Zero, subnormals, -0, negative scales mixed into random weights.
SPECIAL_SCALES = np.array([0x00, 0x01, 0x07, 0x08, 0x80, 0xB8, 0x81, 0x3F, 0x30], np.uint8)


def poison(shape, dtype):
    """Leave NaN in the memory the next same-sized allocation will most likely get (an array of
    the same size is filled and freed just before the kernel's output is allocated)."""
    p = jnp.full(shape, jnp.nan, dtype)
    p.block_until_ready()
    del p


def _tuning(tuning):
    return jax_fp4.KernelTuning() if tuning is None else tuning


def _tristate(value) -> np.int64:
    return np.int64(-1 if value is None else int(value))


def fused_attributes(tuning=None) -> dict:
    """The jax_fp4_fused_cuda attributes of a KernelTuning's choices (None: the heuristics)."""
    t = _tuning(tuning)
    return dict(
        split=np.int64(t.fused_split),
        tile_m=np.int64(t.fused_tile_m),
        tile_n=np.int64(t.fused_tile_n),
        warp_specialized=_tristate(t.fused_warp_specialized),
        stream_k=_tristate(t.fused_stream_k),
        programmatic=bool(t.programmatic_launch),
    )


def gemv_attributes(
    k, *, use_mma=True, row_tiling=True, tiled=False, tuning=None, device=None
) -> dict:
    """The jax_fp4_gemv_cuda attributes (block_size aside). The handler runs the variant it is
    given; `use_mma` (JAX_FP4_GEMV_MMA) and the GPU decide it as the dispatch does."""
    t = _tuning(tuning)
    cap = capability(device if device is not None else (gpus() or [None])[0])
    problem = dispatch.Problem(
        m=1, n=16, k=k, block_size=16, dtype=np.dtype("bfloat16"), tiled=bool(tiled)
    )
    target = dispatch.Target("cuda", capability=cap, gemv_mma=bool(use_mma))
    return dict(
        tiled=bool(tiled),
        tensor_cores=dispatch.gemv_tensor_cores(problem, target),
        row_tiling=bool(row_tiling),
        col_tiles=np.int64(t.gemv_col_tiles),
        k_split=np.int64(t.gemv_k_split),
        rows_per_block=np.int64(t.gemv_rows_per_block),
        programmatic=bool(t.programmatic_launch),
    )


# ---- the CPU's features ----------------------------------------------------------------------------

AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})  # x86-64-v4


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where it is not there to read."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def cpu_has_avx512() -> bool:
    """Whether this CPU has x86-64-v4 (the CPU kernel's AVX-512 panel product)."""
    return AVX512_FLAGS <= cpu_flags()


# ---- the repository's scripts -----------------------------------------------------------------------


def load_repo_script(relative_path: str) -> ModuleType:
    """The module of ROOT / relative_path (e.g. "benchmarks/ab_compare.py"), a script of the
    repository that is not part of the package, executed once per call."""
    path = ROOT / relative_path
    name = "repo_" + relative_path.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_repo_package(relative_path: str) -> ModuleType:
    """The package at ROOT / relative_path (e.g. "examples/llm"), imported under its own name with
    its parent directory on sys.path, as a script beside it imports it (one copy per process)."""
    path = ROOT / relative_path
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    module = importlib.import_module(path.name)
    if pathlib.Path(module.__file__).parent != path:
        raise ImportError(f"{path.name!r} imports {module.__file__}, not the package at {path}")
    return module


# ---- the C++ compilers at hand (tests/cpp/ checks compile with each) ------------------------------


def _compilers() -> dict[str, list[str]]:
    found = {}
    if shutil.which("g++"):
        found["g++"] = ["g++"]
    if shutil.which("clang++"):
        found["clang++"] = ["clang++"]
    elif importlib.util.find_spec("ziglang") is not None:  # Zig's bundled Clang
        found["clang++ (zig)"] = [sys.executable, "-m", "ziglang", "c++"]
    return found


COMPILERS = _compilers()
