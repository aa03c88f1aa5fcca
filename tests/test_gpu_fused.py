"""The fused sm_90 NVFP4 GEMM (FFI target jax_fp4_fused_cuda) called directly through
jax.ffi.ffi_call, against the independent float64 reference in tests/reference.py.

Needs a compute-capability-9.0 CUDA device; skipped otherwise. The target comes from the package's
CUDA module when it registers it, else from the shared library named by JAX_FP4_FUSED_LIB (a plain
.so exporting JaxFp4FusedCuda, e.g. built by benchmarks/fused_timing.py's instructions). Inputs are
fresh random draws on every run; outputs are poisoned with NaN before each call and every check
rejects NaN where none is expected, so an unwritten element fails.

JAX_FP4_GPU_TEST_QUICK=1 shrinks the sweep (used under compute-sanitizer).
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests import reference

TARGET = "jax_fp4_fused_cuda"
QUICK = os.environ.get("JAX_FP4_GPU_TEST_QUICK", "") not in ("", "0")


def _load_fused_module():
    """jax_fp4/_fused.py, imported without the package's __init__ (which needs the built modules)."""
    path = pathlib.Path(__file__).resolve().parent.parent / "jax_fp4" / "_fused.py"
    spec = importlib.util.spec_from_file_location("jax_fp4_fused_static", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fused = _load_fused_module()


def _sm90() -> bool:
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except Exception:
        return False
    return bool(gpus) and str(getattr(gpus[0], "compute_capability", "")) == "9.0"


def _register() -> bool:
    try:
        from jax_fp4 import _ffi  # registers the package's targets on import
        if TARGET in _ffi.REGISTERED_TARGETS.get("CUDA", []):
            return True
    except Exception:
        pass
    lib = os.environ.get("JAX_FP4_FUSED_LIB")
    if not lib:
        return False
    import ctypes
    so = ctypes.CDLL(lib)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(so.JaxFp4FusedCuda), platform="CUDA")
    return True


HAS_SM90 = _sm90()
HAS_TARGET = HAS_SM90 and _register()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_SM90, reason="needs a compute capability 9.0 CUDA device"),
    pytest.mark.skipif(HAS_SM90 and not HAS_TARGET,
                       reason="jax_fp4_fused_cuda not registered (build the package or set JAX_FP4_FUSED_LIB)"),
]

DTYPES = ["float16", "bfloat16"]
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# Zero, subnormals, -0, negative scales mixed into random weights.
SPECIAL_SCALES = np.array([0x00, 0x01, 0x07, 0x08, 0x80, 0xB8, 0x81, 0x3F, 0x30], np.uint8)


def _poison(shape, dtype):
    """Leave NaN in the memory the next same-sized allocation will most likely get."""
    p = jnp.full(shape, jnp.nan, dtype)
    p.block_until_ready()
    del p


def fused(a, packed, scale, gs, bias=None, *, block_size=16):
    a = jnp.asarray(a)
    m, k = a.shape
    n = packed.shape[0]
    if bias is None:
        bias = jnp.zeros((0,), a.dtype)
    ws = _fused.fused_workspace_elems(m, n, k)
    _poison((m, n), a.dtype)
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((m, n), a.dtype),
                                     jax.ShapeDtypeStruct((ws,), jnp.float32)))
    y, _ = call(a, jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(gs, jnp.float32).reshape(1),
                jnp.asarray(bias), block_size=np.int64(block_size))
    return np.asarray(y)


def random_weight(rng, n, k, special=False):
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = rng.integers(0x28, 0x48, size=(n, math.ceil(k / 16)), dtype=np.uint8)
    if special:
        mask = rng.random(scale.shape) < 0.2
        scale[mask] = rng.choice(SPECIAL_SCALES, size=int(mask.sum()))
    gs = np.float32(rng.uniform(0.5, 2.0) * 2.0**rng.integers(-8, 1))
    return packed, scale, gs


def check_close(y, a, packed, scale, gs, bias, dtype):
    """Element-wise: |y - ref| <= 2 eps |ref| + fp32-accumulation slack * (|a| @ |W|^T)."""
    a64 = np.asarray(a, np.float64)
    b64 = None if bias is None else np.asarray(bias, np.float64)
    ref = reference.matmul(a64, packed, scale, gs, 16, b64)
    w = reference.dequantize(packed, scale, gs, 16)
    mag = np.abs(a64) @ np.abs(w).T + (0.0 if b64 is None else np.abs(b64))
    y64 = np.asarray(y, np.float64)
    assert y.shape == ref.shape and y.dtype == NP_DTYPES[dtype]
    assert np.isfinite(y64).all(), "non-finite output: an element was not written"
    err = np.abs(y64 - ref)
    bound = 2 * EPS[dtype] * np.abs(ref) + 1e-5 * mag + 1e-30
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} elements off; first at "
                           f"{np.argwhere(bad)[0]}: got {y64[tuple(np.argwhere(bad)[0])]}, "
                           f"want {ref[tuple(np.argwhere(bad)[0])]}")
    assert reference.relative_error(y64, ref) < {"float16": 2e-3, "bfloat16": 1e-2}[dtype]


# (M, N, K): ragged M and N, K from one stage to many (split-K across cluster CTAs).
SHAPES = [
    (1, 256, 128),
    (9, 300, 256),
    (17, 1000, 384),
    (16, 256, 8192),      # one tile, 64 stages: the largest split
    (64, 257, 512),
    (65, 512, 256),       # first M served by the 128-row tile
    (128, 384, 640),
    (200, 1030, 1024),
    (300, 96, 128),       # N below one tile
    (48, 4096, 11008),    # a real shape, several splits
    (256, 2048, 4096),
    (1000, 520, 1152),
]
QUICK_SHAPES = [(9, 300, 256), (70, 520, 384), (16, 256, 2048)]


@pytest.mark.parametrize("m, n, k", QUICK_SHAPES if QUICK else SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_random_sweep(m, n, k, dtype, with_bias):
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, n, k, special=True)
    a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    bias = rng.standard_normal(n).astype(NP_DTYPES[dtype]) if with_bias else None
    y = fused(a, packed, scale, gs, bias)
    check_close(y, a, packed, scale, gs, bias, dtype)


@pytest.mark.parametrize("m, n, k", [(70, 300, 256), (16, 256, 384), (5, 1024, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_arithmetic_bit_for_bit(m, n, k, dtype):
    """Small integer activations, scales {2^-9, 2^-6, 0.5, 1, 2}, gs a power of two: every product
    and partial sum is exact in fp32, so y must equal the rounded float64 reference exactly (this
    also pins the E2M1 subnormal 0.5 and E4M3 subnormal scales)."""
    rng = np.random.default_rng()
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = rng.choice(np.array([0x01, 0x08, 0x30, 0x38, 0x40], np.uint8), size=(n, k // 16))
    gs = np.float32(2.0**rng.integers(-3, 2))
    a = rng.integers(-2, 3, size=(m, k)).astype(NP_DTYPES[dtype])
    bias = rng.integers(-4, 5, size=n).astype(NP_DTYPES[dtype])
    y = fused(a, packed, scale, gs, bias)
    ref = reference.matmul(np.asarray(a, np.float64), packed, scale, gs, 16,
                           np.asarray(bias, np.float64))
    want = ref.astype(NP_DTYPES[dtype])
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_scale_propagates(dtype):
    rng = np.random.default_rng()
    m, n, k = 40, 300, 512
    packed, scale, gs = random_weight(rng, n, k)
    rows = [3, 257, 299]
    scale[rows[0], 5] = 0x7F
    scale[rows[1], 0] = 0xFF
    scale[rows[2], k // 16 - 1] = 0x7F
    a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    y = np.asarray(fused(a, packed, scale, gs), np.float64)
    assert np.isnan(y[:, rows]).all()
    others = np.setdiff1d(np.arange(n), rows)
    assert np.isfinite(y[:, others]).all()


@pytest.mark.parametrize("m, n, k", [(48, 4096, 4096), (256, 1024, 2048), (16, 256, 8192)])
def test_bit_identical_reruns(m, n, k):
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, n, k)
    a = rng.standard_normal((m, k)).astype(NP_DTYPES["bfloat16"])
    y0 = fused(a, packed, scale, gs)
    for _ in range(3):
        np.testing.assert_array_equal(fused(a, packed, scale, gs).view(np.uint16), y0.view(np.uint16))


def test_bad_arguments_are_rejected():
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, 64, 192)  # K = 192: not a multiple of 128
    a = rng.standard_normal((8, 192)).astype(np.float16)
    with pytest.raises(Exception, match="multiple of 128"):
        fused(a, packed, scale, gs)
    packed, scale, gs = random_weight(rng, 64, 256)
    scale32 = scale[:, ::2].copy()  # block size 32 layout
    a = rng.standard_normal((8, 256)).astype(np.float16)
    with pytest.raises(Exception, match="block_size"):
        fused(a, packed, scale32, gs, block_size=32)


def test_static_rules():
    assert _fused.fused_workspace_elems(4096, 28672, 8192) == 0
    assert _fused.fused_supported(16, 11008, 4096, 16, np.float16) is None
    assert _fused.fused_supported(16, 11008, 4096, 16, ml_dtypes.bfloat16) is None
    assert "multiple of 128" in _fused.fused_supported(16, 11008, 4160, 16, np.float16)
    assert "block_size" in _fused.fused_supported(16, 11008, 4096, 32, np.float16)
    assert "float16" in _fused.fused_supported(16, 11008, 4096, 16, np.float32)
