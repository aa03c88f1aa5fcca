"""The native SM120 path's CUDA targets, on whatever CUDA device is present.

- jax_fp4_quantize_activation_cuda: bit-exact against the NumPy model
  (jax_fp4.native.quantize_activation_reference), dynamic and static scales, plain and swizzled
  scale layouts, non-finite and all-zero inputs, padding bytes 0;
- jax_fp4_swizzle_scales_cuda: against the NumPy layout model and the jnp prepack;
- jax_fp4_native_sm120_cuda: on a device that is not compute capability 12.x it must answer a
  clear error; on SM120 (skipped elsewhere) the GEMM is compared with an activation-quantized
  float64 reference.

Inputs are fresh random draws (the seed is in every failure message); output buffers are poisoned
first (an array of the same size is filled and freed just before, so the allocator hands its memory
to the kernel's output).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fp4
from jax_fp4 import ffi as _ffi, native as _native
from tests import reference


def _has_cuda() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        return False


HAS_CUDA = _has_cuda()
_TARGETS = {_native.QUANTIZE_ACTIVATION_TARGET, _native.SWIZZLE_SCALES_TARGET, _native.NATIVE_GEMM_TARGET}
HAS_TARGETS = _TARGETS <= set(_ffi.REGISTERED_TARGETS.get("CUDA", []))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"),
              pytest.mark.skipif(not HAS_TARGETS, reason="the CUDA module lacks the native SM120 targets")]

CAPABILITY = _native.device_capability() if HAS_CUDA else None
IS_SM120 = CAPABILITY is not None and CAPABILITY[0] == 12
DTYPES = [jnp.float16, jnp.bfloat16]


def _rng():
    seed = int(np.random.SeedSequence().entropy % (2**63))
    return np.random.default_rng(seed), seed


def _poison(nbytes: int, value: int = 0xA5) -> None:
    x = jnp.full((max(int(nbytes), 1),), value, jnp.uint8)
    x.block_until_ready()
    del x


def _activation(rng, m, k, dtype):
    """Random rows spanning several binades, plus an all-zero block and a tiny block."""
    a = rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 6, (m, 1)))
    if m > 2 and k >= 32:
        a[1, :16] = 0.0
        a[2, 16:32] *= 1e-4
    return jnp.asarray(a.astype(np.float32)).astype(dtype)


# ---- activation quantizer -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("m,k", [(1, 16), (9, 32), (130, 96), (257, 160), (300, 4096), (1024, 1024)])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("swizzled", [True, False], ids=["swizzled", "plain"])
def test_quantizer_bit_exact(dtype, m, k, static, swizzled):
    rng, seed = _rng()
    a = _activation(rng, m, k, dtype)
    a_np = np.asarray(a)
    scale_in = None
    if static:  # a static scale below the dynamic one: some blocks saturate
        scale_in = np.float32(_native.activation_global_scale_np(a_np) * rng.uniform(0.3, 1.5))
    ref_packed, ref_scale, ref_gs = _native.quantize_activation_reference(a_np, scale_in)
    fn = jax.jit(functools.partial(_native.quantize_activation, swizzled=swizzled))
    _poison(m * k)
    packed, scale, gs = fn(a) if scale_in is None else fn(a, jnp.float32(scale_in))
    packed, scale, gs = np.asarray(packed), np.asarray(scale), np.asarray(gs)
    msg = f"seed={seed}"
    assert gs.shape == (1,) and gs[0] == ref_gs, msg
    np.testing.assert_array_equal(packed, ref_packed, err_msg=msg)
    expected_scale = _native.swizzle_scales_np(ref_scale) if swizzled else ref_scale
    np.testing.assert_array_equal(scale, expected_scale, err_msg=msg)  # padding bytes included


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_quantizer_nonfinite_and_zero(dtype):
    rng, seed = _rng()
    a = np.asarray(_activation(rng, 140, 128, dtype)).copy()
    a[3, 5] = np.nan
    a[7, 100] = np.inf
    a[139, 127] = -np.inf
    a = jnp.asarray(a)
    for inp in (a, jnp.zeros((20, 64), dtype)):
        ref_packed, ref_scale, ref_gs = _native.quantize_activation_reference(np.asarray(inp))
        packed, scale, gs = jax.jit(_native.quantize_activation)(inp)
        assert np.asarray(gs)[0] == ref_gs, f"seed={seed}"
        np.testing.assert_array_equal(np.asarray(packed), ref_packed, err_msg=f"seed={seed}")
        np.testing.assert_array_equal(np.asarray(scale), _native.swizzle_scales_np(ref_scale))
    _, scale, _ = jax.jit(functools.partial(_native.quantize_activation, swizzled=False))(a)
    assert np.asarray(scale)[3, 0] == 0x7F and np.asarray(scale)[7, 6] == 0x7F


def test_quantizer_is_deterministic_and_matches_modelopt():
    rng, seed = _rng()
    a = _activation(rng, 64, 512, jnp.bfloat16)
    first = jax.jit(functools.partial(_native.quantize_activation, swizzled=False))(a)
    second = jax.jit(functools.partial(_native.quantize_activation, swizzled=False))(a)
    for x, y in zip(first, second):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with jax.default_device(jax.devices("cpu")[0]):
        w = jax_fp4.quantize(np.asarray(a, np.float32))
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(w.packed), err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(first[1]), np.asarray(w.scale_bytes), err_msg=f"seed={seed}")


# ---- scale swizzle ------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,k_blocks", [(1, 2), (32, 4), (127, 3), (128, 4), (129, 6), (300, 10),
                                           (11008, 256), (4096, 688)])
def test_swizzle_kernel(rows, k_blocks):
    rng, seed = _rng()
    scale = rng.integers(1, 256, size=(rows, k_blocks), dtype=np.uint8)
    expected = _native.swizzle_scales_np(scale)
    _poison(expected.size)
    got = np.asarray(jax.jit(_native.swizzle_scales_cuda)(jnp.asarray(scale)))
    np.testing.assert_array_equal(got, expected, err_msg=f"seed={seed}")
    as_fp8 = jnp.asarray(scale.view(ml_dtypes.float8_e4m3fn))
    np.testing.assert_array_equal(np.asarray(jax.jit(_native.swizzle_scales)(as_fp8)), expected)


# ---- the native GEMM ----------------------------------------------------------------------------

def _problem(rng, m, n, k, dtype, with_bias):
    w = jax_fp4.quantize(rng.standard_normal((n, k)).astype(np.float32))
    a = _activation(rng, m, k, dtype)
    bias = jnp.asarray(rng.standard_normal(n).astype(np.float32)).astype(dtype) if with_bias else None
    return a, w, bias


def _call_native(a, w, bias, prepacked):
    swz = _native.prepack(w).swizzled_scale if prepacked else None
    fn = jax.jit(lambda a, packed, scale, gs, bias, swz: _native.native_matmul(
        a, packed, scale, gs, bias, block_size=16, swizzled_scale=swz))
    return fn(a, w.packed, w.scale_bytes, w.global_scale, bias, swz)


@pytest.mark.skipif(IS_SM120, reason="checks the error on devices other than SM120")
def test_native_gemm_errors_off_sm120():
    rng, _ = _rng()
    a, w, bias = _problem(rng, 64, 128, 256, jnp.bfloat16, True)
    with pytest.raises(Exception, match=r"compute capability 12\.x") as err:
        np.asarray(_call_native(a, w, bias, prepacked=False))
    assert f"{CAPABILITY[0]}.{CAPABILITY[1]}" in str(err.value)
    with pytest.raises(ValueError, match="backend='native' cannot serve"):
        _native.native_path_applies(CAPABILITY, True, "native", 64, 128, 256, 16)


@pytest.mark.skipif(not IS_SM120, reason="the native NVFP4 x NVFP4 GEMM needs compute capability 12.x")
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("m,n,k", [(9, 32, 32), (128, 256, 96), (300, 512, 4096), (1000, 11008, 512)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("prepacked", [False, True], ids=["scratch", "prepacked"])
def test_native_gemm_matches_activation_quantized_reference(dtype, m, n, k, with_bias, prepacked):
    rng, seed = _rng()
    a, w, bias = _problem(rng, m, n, k, dtype, with_bias)
    q_packed, q_scale, q_gs = _native.quantize_activation_reference(np.asarray(a))
    a_q = reference.dequantize(q_packed, q_scale, q_gs, 16)
    expected = reference.matmul(a_q, np.asarray(w.packed), np.asarray(w.scale_bytes), w.global_scale, 16,
                                None if bias is None else np.asarray(bias, np.float64))
    _poison(m * n * 2, 0xFF)  # 0xFFFF is NaN in fp16 and bf16
    y = np.asarray(_call_native(a, w, bias, prepacked))
    assert y.shape == (m, n) and y.dtype == np.dtype(dtype)
    assert np.isfinite(y.astype(np.float32)).all(), f"seed={seed}"
    err = reference.relative_error(y, expected)
    assert err < reference.TOLERANCE[np.dtype(dtype).name], f"seed={seed} rel err {err}"
