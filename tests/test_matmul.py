"""jax_fp4.matmul on the CPU paths against the float64 reference, plus its bad-input catalogue."""


import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from tests import reference
from tests.cpu_features import cpu_has_avx512

CPU_BACKENDS = ("auto", "cpu", "reference", "xla")


def cpu_backends(dtype):
    """The backends that serve `dtype` on the CPU (xla dequantizes to the activations' dtype:
    fp16/bf16 only)."""
    return [b for b in CPU_BACKENDS if b != "xla" or np.dtype(dtype) != np.float32]


def _random_case(rng, lead, n, k, block_size, dtype, with_bias):
    packed, scale, gs = reference.random_weight(rng, n, k, block_size)
    w = jax_fp4.NVFP4Weight(packed, scale, gs, block_size=block_size)
    a = rng.standard_normal(lead + (k,)).astype(np.float32)
    a = jnp.asarray(a, dtype)
    bias = jnp.asarray(rng.standard_normal(n), dtype) if with_bias else None
    ref = reference.matmul(np.asarray(a, np.float64), packed, scale, gs, block_size,
                           None if bias is None else np.asarray(bias, np.float64))
    return a, w, bias, ref


def weight_rounding_reference(a, w, bias):
    """The float64 product with the weight the dequantizing paths (xla, and dequant on CUDA)
    multiply: rounded to a's dtype. With few terms that cancel, that rounding alone can exceed
    the output's tolerance, so for those paths it is part of the model, not of the error."""
    w = jax_fp4.unprepack(w) if w.layout == "tiled" else w
    return reference.matmul(np.asarray(a, np.float64), w.packed, w.scale_bytes, w.global_scale,
                            w.block_size, None if bias is None else np.asarray(bias, np.float64),
                            weight_dtype=a.dtype)


def _check(y, ref, dtype):
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.dtype(dtype)
    y64 = y.astype(np.float64)
    assert np.isfinite(y64).all(), "non-finite output: an element was not written or overflowed"
    assert reference.relative_error(y64, ref) < reference.TOLERANCE[np.dtype(dtype).name]
    # Element-wise too: every element holds its own dot product (no stale or swapped elements).
    eps = {"bfloat16": 2**-7, "float16": 2**-10, "float32": 2**-20}[np.dtype(dtype).name]
    scale = np.abs(ref).max() if ref.size else 1.0
    np.testing.assert_allclose(y64, ref, rtol=2 * eps, atol=4 * eps * scale)


SHAPES = [
    # (leading dims of a, N, K, block_size)
    ((1,), 37, 64, 16),
    ((5,), 100, 96, 16),
    ((3, 7), 19, 48, 16),      # K not a multiple of 32
    ((64,), 33, 160, 32),
    ((9,), 21, 50, 16),        # partial trailing block
    ((2, 2, 3), 8, 42, 7),     # odd block size splitting bytes, partial trailing block
    ((17,), 5, 6, 3),
    ((1,), 1, 2, 1),
    ((33,), 129, 130, 16),
]


@pytest.mark.parametrize("lead, n, k, block_size", SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_matches_reference(lead, n, k, block_size, dtype, with_bias):
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, lead, n, k, block_size, dtype, with_bias)
    for backend in cpu_backends(dtype):
        y = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend=backend))(a, w, bias)
        _check(y, weight_rounding_reference(a, w, bias) if backend == "xla" else ref, dtype)


# The CPU kernel's blocking (ffi/cpu/matmul.cc): units of 480 rows of M against 64 weight rows,
# K in steps of 256, a micro-kernel of 6 rows of M by 16 weight rows (12 by 32 on AVX-512), the
# weight decoded a word of 8 codes at a time for 8 rows at once. Shapes that cross every boundary
# with a remainder: two units along M (480 + 7 rows: the last one takes the no-panel path), a
# partial panel and partial 8-row lanes along N, a partial last K step, blocks that straddle a K
# step (block 24), and the element-by-element decode where a block or K is not whole words (block
# 12; K = 1030).
@pytest.mark.parametrize("m, n, k, block_size, layout", [
    (487, 83, 528, 16, "spec"),
    (487, 80, 640, 16, "tiled"),
    (7, 150, 600, 24, "spec"),
    (13, 70, 300, 12, "spec"),
    (1, 17, 1030, 16, "spec"),
])
def test_cpu_kernel_across_its_blocking(m, n, k, block_size, layout):
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), n, k, block_size, "bfloat16", True)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    y = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend="cpu"))(a, w, bias)
    _check(y, ref, "bfloat16")


# Up to 8 rows of M the CPU kernel multiplies each weight word as it decodes it; from 9 rows it
# decodes a panel first and runs its micro-kernel. Both do the same operations in the same order
# per output, so a row's result does not depend on how many rows come with it.
@pytest.mark.parametrize("n, k, block_size, layout", [
    (83, 528, 16, "spec"),    # partial 8-row lanes, a partial last K step
    (40, 600, 24, "spec"),    # blocks straddling K steps
    (80, 640, 16, "tiled"),
])
def test_cpu_kernel_rows_do_not_depend_on_m(n, k, block_size, layout):
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (24,), n, k, block_size, "float32", True)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    f = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend="cpu"))
    full = np.asarray(f(a, w, bias))  # the panel path
    _check(full, ref, "float32")
    for m in (1, 3, 8, 9):
        np.testing.assert_array_equal(np.asarray(f(a[:m], w, bias)), full[:m], err_msg=f"M = {m}")


_AVX2_PANEL_PRODUCT = """
import sys, numpy as np, jax, jax_fp4
d = np.load(sys.argv[1])
w = jax_fp4.NVFP4Weight(d["packed"], d["scale"], d["gs"], block_size=int(d["block_size"]))
w = jax_fp4.prepack(w) if bool(d["tiled"]) else w
y = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend="cpu"))(d["a"], w, d["bias"])
np.save(sys.argv[2], np.asarray(y))
"""


@pytest.mark.skipif(not cpu_has_avx512(), reason="the CPU has no AVX-512: one panel product")
@pytest.mark.parametrize("m, n, k, block_size, layout", [
    (29, 83, 528, 16, "spec"),   # 12 + 12 + 5 rows; weight panels of 4 and 2 groups of 16 rows
    (40, 40, 600, 24, "spec"),   # a group pair and a lone group; blocks straddling K steps
    (13, 80, 640, 16, "tiled"),  # a lone group in the last panel
])
def test_cpu_avx512_and_avx2_panel_products_agree(tmp_path, m, n, k, block_size, layout):
    # The AVX-512 build (12 x 32 outputs a micro-kernel call) runs the same fused multiply-adds in
    # the same order per output as the AVX2 build (6 x 16): the same bits. JAX_FP4_CPU_AVX512=0,
    # read once per process, runs the AVX2 one in a fresh process.
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), n, k, block_size, "float32", True)
    np.savez(tmp_path / "case.npz", a=np.asarray(a), bias=np.asarray(bias), packed=w.packed,
             scale=w.scale_bytes, gs=np.float32(w.global_scale), block_size=block_size,
             tiled=layout == "tiled")
    w = jax_fp4.prepack(w) if layout == "tiled" else w
    wide = np.asarray(jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend="cpu"))(a, w, bias))
    _check(wide, ref, "float32")
    env = dict(os.environ, JAX_FP4_CPU_AVX512="0", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _AVX2_PANEL_PRODUCT, str(tmp_path / "case.npz"),
                    str(tmp_path / "narrow.npy")], check=True, env=env)
    np.testing.assert_array_equal(np.load(tmp_path / "narrow.npy"), wide)


def test_cpu_avx512_switch_rejects_bad_values(monkeypatch):
    rng = np.random.default_rng()
    a, w, bias, _ = _random_case(rng, (2,), 16, 32, 16, "float32", False)
    monkeypatch.setenv("JAX_FP4_CPU_AVX512", "maybe")
    with pytest.raises(ValueError, match="JAX_FP4_CPU_AVX512 must be a boolean"):
        jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="cpu"))(a, w)


@pytest.mark.parametrize("m", list(range(0, 65, 7)) + [64])
def test_matmul_sweep_over_m(m):
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), 45, 80, 16, "bfloat16", True)
    y = jax.jit(jax_fp4.matmul)(a, w, bias)
    _check(y, ref, "bfloat16")


def test_eager_call_and_vmap_over_activations():
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (4, 6), 24, 64, 16, "float16", True)
    _check(jax_fp4.matmul(a, w, bias), ref, "float16")  # un-jitted
    y = jax.jit(jax.vmap(lambda x: jax_fp4.matmul(x, w, bias), in_axes=1, out_axes=1))(a)
    _check(y, ref, "float16")


def test_cpu_paths_agree_bit_for_bit_on_exact_arithmetic():
    # Products are multiples of 2^-10 and sums stay far below 2^23 units: fp32 accumulation is
    # exact in any order, so the fused kernel and the reference must give identical bits.
    rng = np.random.default_rng()
    n, k = 31, 96
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.choice(np.array([0x30, 0x38, 0x40, 0xB8], np.uint8), size=(n, k // 16))  # .5 1 2 -1
    w = jax_fp4.NVFP4Weight(packed, scale, np.float32(1.0))
    a = jnp.asarray(rng.integers(-8, 9, (5, k)) / 2.0, jnp.bfloat16)
    ref = reference.matmul(np.asarray(a, np.float64), packed, scale, 1.0, 16)
    want = np.asarray(jnp.asarray(ref, jnp.bfloat16))
    for backend in cpu_backends(jnp.bfloat16):
        got = np.asarray(jax_fp4.matmul(a, w, backend=backend))
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_nan_scale_poisons_only_its_block():
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, 6, 64)
    scale[2, 1] = 0x7F  # NaN block scale for row 2, elements 16..31
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    a = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    for backend in ("cpu", "reference"):
        y = np.asarray(jax_fp4.matmul(a, w, backend=backend))
        assert np.isnan(y[:, 2]).all() and np.isfinite(np.delete(y, 2, axis=1)).all()


def test_zero_k_and_empty_shapes():
    rng = np.random.default_rng()
    w0 = jax_fp4.NVFP4Weight(np.zeros((5, 0), np.uint8), np.zeros((5, 0), np.uint8), 1.0)
    bias = jnp.asarray(rng.standard_normal(5), jnp.bfloat16)
    a0 = jnp.ones((3, 0), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax_fp4.matmul)(a0, w0, bias)),
                                  np.broadcast_to(np.asarray(bias), (3, 5)))
    assert not np.asarray(jax_fp4.matmul(a0, w0)).any()
    packed, scale, gs = reference.random_weight(rng, 5, 32)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    assert jax_fp4.matmul(jnp.ones((0, 32), jnp.float16), w).shape == (0, 5)
    assert jax_fp4.matmul(jnp.ones((2, 0, 32), jnp.float16), w).shape == (2, 0, 5)
    assert jax_fp4.dispatch_path(jnp.ones((0, 32), jnp.float16), w) == "empty"


def test_cpu_kernel_is_the_default_on_cpu():
    rng = np.random.default_rng()
    a, w, bias, _ = _random_case(rng, (4,), 16, 64, 16, "bfloat16", True)
    hlo = jax.jit(jax_fp4.matmul).lower(a, w, bias).as_text()
    assert "jax_fp4_matmul_cpu" in hlo
    assert jax_fp4.dispatch_path(a, w, platform="cpu") == "cpu"
    ref_hlo = jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="reference")).lower(a, w).as_text()
    assert "jax_fp4_matmul_cpu" not in ref_hlo and "dot_general" in ref_hlo


def test_dispatch_path_follows_the_default_device(monkeypatch):
    """With a GPU first in jax.devices(), jax.default_device(cpu) still makes dispatch_path answer
    for the CPU, where matmul then runs (a device or a platform name)."""
    rng = np.random.default_rng()
    a, w, _, _ = _random_case(rng, (1,), 16, 128, 16, "bfloat16", False)
    cpu, real_devices = jax.devices("cpu")[0], jax.devices
    gpu = types.SimpleNamespace(platform="gpu", device_kind="a GPU")
    monkeypatch.setattr(jax, "devices", lambda backend=None: real_devices(backend) if backend else [gpu])
    with jax.default_device(None):  # whatever the test session set
        assert jax_fp4.dispatch_path(a, w) == jax_fp4.dispatch_path(a, w, platform="cuda") != "cpu"
        for device in (cpu, "cpu"):
            with jax.default_device(device):
                assert jax_fp4.dispatch_path(a, w) == "cpu"


def test_gpu_backends_refuse_cpu_platform():
    rng = np.random.default_rng()
    a, w, _, _ = _random_case(rng, (2,), 16, 64, 16, "bfloat16", False)
    for backend in ("gemv", "dequant"):
        with pytest.raises(ValueError, match=backend):
            jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend=backend)).lower(a, w)


# ---- bad input: clear errors at trace time, naming the argument -----------------------------

def _weight(n=8, k=32, block_size=16):
    packed, scale, gs = reference.random_weight(np.random.default_rng(), n, k, block_size)
    return jax_fp4.NVFP4Weight(packed, scale, gs, block_size=block_size)


@pytest.mark.parametrize("make_args, error, match", [
    (lambda w: (jnp.ones((2, 48), jnp.bfloat16), w), ValueError, r"K = 32.*\(2, 48\)"),
    (lambda w: (jnp.ones((2, 32), jnp.int32), w), TypeError, "a must be float16, bfloat16 or float32"),
    (lambda w: (jnp.ones((2, 32), jnp.float64 if jax.config.jax_enable_x64 else jnp.int8), w),
     TypeError, "dtype"),
    (lambda w: (jnp.ones((), jnp.bfloat16), w), ValueError, "rank"),
    (lambda w: (jnp.ones((2, 32), jnp.bfloat16), w.packed), TypeError, "w must be an NVFP4Weight"),
    (lambda w: (jnp.ones((2, 32), jnp.bfloat16), w, jnp.ones((7,))), ValueError, r"bias must have shape \(N,\) = \(8,\)"),
    (lambda w: (jnp.ones((2, 32), jnp.bfloat16), w, jnp.ones((1, 8))), ValueError, "bias"),
    (lambda w: (jnp.ones((2, 32), jnp.bfloat16), w, jnp.ones((8,), jnp.int32)), TypeError, "bias must be a float"),
])
def test_matmul_bad_input(make_args, error, match):
    args = make_args(_weight())
    with pytest.raises(error, match=match):
        jax.jit(jax_fp4.matmul)(*args)


def test_matmul_bad_backend_and_unservable_forced_backend():
    w = _weight(k=48)
    a = jnp.ones((2, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="backend must be one of"):
        jax_fp4.matmul(a, w, backend="cuda")
    with pytest.raises(ValueError, match="K must be a multiple of 32, got 48"):
        jax_fp4.matmul(a, w, backend="gemv")
    with pytest.raises(ValueError, match="block_size must be 16, got 32"):
        jax_fp4.matmul(jnp.ones((2, 64), jnp.bfloat16), _weight(k=64, block_size=32), backend="gemv")
    for backend in ("dequant", "xla"):
        with pytest.raises(ValueError, match=rf"backend='{backend}' cannot serve this matmul: a must "
                                             r"be float16 or bfloat16, got float32"):
            jax_fp4.matmul(jnp.ones((2, 48), jnp.float32), w, backend=backend)


def test_stacked_weight_needs_a_transform():
    ws = jax_fp4.quantize(np.random.default_rng().standard_normal((2, 8, 32)).astype(np.float32))
    with pytest.raises(ValueError, match="stacked"):
        jax_fp4.matmul(jnp.ones((1, 32), jnp.bfloat16), ws)


def test_cpu_handler_validates_operands():
    # Called directly with a mismatched scale, the C++ handler returns an error instead of reading
    # out of bounds.
    w = _weight()
    call = jax.ffi.ffi_call("jax_fp4_matmul_cpu", jax.ShapeDtypeStruct((2, 8), jnp.float32))
    with pytest.raises(Exception, match="scale must be"):
        jax.block_until_ready(call(jnp.ones((2, 32), jnp.float32), w.packed, np.zeros((8, 1), np.uint8),
                                   w.global_scale, jnp.zeros((0,), jnp.float32), block_size=np.int64(16),
                                   tiled=False))
    with pytest.raises(Exception, match="block_size must be positive"):
        jax.block_until_ready(call(jnp.ones((2, 32), jnp.float32), w.packed, w.scale_bytes,
                                   w.global_scale, jnp.zeros((0,), jnp.float32), block_size=np.int64(0),
                                   tiled=False))
    with pytest.raises(Exception, match="tiled layout needs block_size 16, N % 16 == 0 and K % 128"):
        jax.block_until_ready(call(jnp.ones((2, 32), jnp.float32), w.packed, w.scale_bytes,
                                   w.global_scale, jnp.zeros((0,), jnp.float32), block_size=np.int64(16),
                                   tiled=True))
