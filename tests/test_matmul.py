"""jax_fp4.matmul through the public API against the float64 reference, on each device present
(the `device` fixture: CPU always, a CUDA device where jax sees one): the default dispatch and every
backend the device serves, the CPU kernel across its blocking, and the bad-input catalogue. The
kernels' own sweeps on the GPU are tests/test_gemv_kernel.py's and tests/test_fused_gemm.py's."""

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
from tests._helpers import check as _check
from tests._helpers import cpu_has_avx512, weight_rounding_reference
from tests._helpers import random_case as _random_case

CPU_BACKENDS = ("auto", "cpu", "reference", "xla")


def cpu_backends(dtype):
    """The backends that serve `dtype` on the CPU (xla dequantizes to the activations' dtype:
    fp16/bf16 only)."""
    return [b for b in CPU_BACKENDS if b != "xla" or np.dtype(dtype) != np.float32]


def backends(device, a, w):
    """The backends that serve this matmul on `device`. On CUDA: dequant and xla take fp16/bf16
    only, the GEMV block_size 16 and K % 32 == 0, the fused GEMM (sm_90) K % 128 == 0 as well."""
    if not device.is_gpu:
        return cpu_backends(a.dtype)
    names = ["auto", "reference"]
    if np.dtype(a.dtype) == np.float32:
        return names
    names += ["dequant", "xla"]
    if w.block_size == 16 and w.k % 32 == 0:
        names.append("gemv")
    if device.is_hopper and w.block_size == 16 and w.k % 128 == 0:
        names.append("fused")
    return names


SHAPES = [
    # (leading dims of a, N, K, block_size)
    ((1,), 37, 64, 16),
    ((5,), 100, 96, 16),
    ((3, 7), 19, 48, 16),  # K not a multiple of 32
    ((64,), 33, 160, 32),
    ((9,), 21, 50, 16),  # partial trailing block
    ((2, 2, 3), 8, 42, 7),  # odd block size splitting bytes, partial trailing block
    ((17,), 5, 6, 3),
    ((1,), 1, 2, 1),
    ((33,), 129, 130, 16),
]


# The GPU's paths: (leading dims of a, N, K, block_size).
GPU_SHAPES = [
    ((1,), 100, 4096, 16),  # decode: gemv (mma)
    ((4,), 129, 160, 16),  # gemv scalar (K % 128 != 0)
    ((2, 3), 64, 256, 16),  # leading dims
    ((9,), 33, 256, 16),  # just past the GEMV: dequant
    ((65,), 1000, 512, 16),
    ((17,), 21, 50, 16),  # K % 32 != 0: dequant
    ((3,), 8, 42, 7),  # odd block size: dequant
    ((1000,), 48, 128, 32),
]


@pytest.mark.parametrize("lead, n, k, block_size", SHAPES + GPU_SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_matches_reference(device, lead, n, k, block_size, dtype, with_bias):
    """Every backend the device serves against the float64 reference, and (fp16 / bf16) against
    backend="reference" within rounding."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, lead, n, k, block_size, dtype, with_bias)
    results = {}
    for backend in backends(device, a, w):
        y = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend=backend))(a, w, bias)
        # The dequantizing paths multiply the weight rounded to a's dtype, "auto" too where it
        # takes one (a block size other than 16 on a GPU): a few outputs whose terms cancel are
        # off the exact product by more than their own rounding.
        path = jax_fp4.dispatch_path(a, w) if backend == "auto" else backend
        rounds_weight = path in ("dequant", "xla")
        _check(y, weight_rounding_reference(a, w, bias) if rounds_weight else ref, dtype)
        results[backend] = np.asarray(y, np.float64)
    if dtype == "float32":
        return
    eps = {"bfloat16": 2**-7, "float16": 2**-10}[dtype]
    # Rounding errors scale with the products' terms, not with a sum they may cancel to.
    terms = (
        np.abs(np.asarray(a, np.float64)).reshape(-1, k)
        @ np.abs(np.asarray(jax_fp4.dequantize(w), np.float64)).T
    )
    scale = max(terms.max(), np.abs(results["reference"]).max()) if ref.size else 1.0
    for backend, y in results.items():  # each forced backend equals "reference" within rounding
        np.testing.assert_allclose(
            y, results["reference"], rtol=2 * eps, atol=4 * eps * scale, err_msg=backend
        )


# The CPU kernel's blocking (ffi/cpu/matmul.cc): units of 480 rows of M against 64 weight rows,
# K in steps of 256, a micro-kernel of 6 rows of M by 16 weight rows (12 by 32 on AVX-512), the
# weight decoded a word of 8 codes at a time for 8 rows at once. Shapes that cross every boundary
# with a remainder: two units along M (480 + 7 rows: the last one takes the no-panel path), a
# partial panel and partial 8-row lanes along N, a partial last K step, blocks that straddle a K
# step (block 24), and the element-by-element decode where a block or K is not whole words (block
# 12; K = 1030).
@pytest.mark.parametrize(
    "m, n, k, block_size, layout",
    [
        (487, 83, 528, 16, "spec"),
        (487, 80, 640, 16, "tiled"),
        (7, 150, 600, 24, "spec"),
        (13, 70, 300, 12, "spec"),
        (1, 17, 1030, 16, "spec"),
    ],
)
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
@pytest.mark.parametrize(
    "n, k, block_size, layout",
    [
        (83, 528, 16, "spec"),  # partial 8-row lanes, a partial last K step
        (40, 600, 24, "spec"),  # blocks straddling K steps
        (80, 640, 16, "tiled"),
    ],
)
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
@pytest.mark.parametrize(
    "m, n, k, block_size, layout",
    [
        (29, 83, 528, 16, "spec"),  # 12 + 12 + 5 rows; weight panels of 4 and 2 groups of 16 rows
        (40, 40, 600, 24, "spec"),  # a group pair and a lone group; blocks straddling K steps
        (13, 80, 640, 16, "tiled"),  # a lone group in the last panel
    ],
)
def test_cpu_avx512_and_avx2_panel_products_agree(tmp_path, m, n, k, block_size, layout):
    # The AVX-512 build (12 x 32 outputs a micro-kernel call) runs the same fused multiply-adds in
    # the same order per output as the AVX2 build (6 x 16): the same bits. JAX_FP4_CPU_AVX512=0
    # runs the AVX2 one, here in a fresh process (nothing of this one's traces or caches).
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), n, k, block_size, "float32", True)
    np.savez(
        tmp_path / "case.npz",
        a=np.asarray(a),
        bias=np.asarray(bias),
        packed=w.packed,
        scale=w.scale_bytes,
        gs=np.float32(w.global_scale),
        block_size=block_size,
        tiled=layout == "tiled",
    )
    w = jax_fp4.prepack(w) if layout == "tiled" else w
    wide = np.asarray(jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend="cpu"))(a, w, bias))
    _check(wide, ref, "float32")
    env = dict(os.environ, JAX_FP4_CPU_AVX512="0", JAX_PLATFORMS="cpu")
    subprocess.run(
        [
            sys.executable,
            "-c",
            _AVX2_PANEL_PRODUCT,
            str(tmp_path / "case.npz"),
            str(tmp_path / "narrow.npy"),
        ],
        check=True,
        env=env,
    )
    np.testing.assert_array_equal(np.load(tmp_path / "narrow.npy"), wide)


def test_cpu_avx512_switch_rejects_bad_values(monkeypatch):
    rng = np.random.default_rng()
    a, w, bias, _ = _random_case(rng, (2,), 16, 32, 16, "float32", False)
    monkeypatch.setenv("JAX_FP4_CPU_AVX512", "maybe")
    with pytest.raises(ValueError, match="JAX_FP4_CPU_AVX512 must be a boolean"):
        jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="cpu"))(a, w)


@pytest.mark.parametrize("m", list(range(0, 65, 7)) + [64])
def test_matmul_sweep_over_m(device, m):
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), 45, 80, 16, "bfloat16", True)
    y = jax.jit(jax_fp4.matmul)(a, w, bias)
    _check(y, ref, "bfloat16")


def test_eager_call_and_vmap_over_activations(device):
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
    np.testing.assert_array_equal(
        np.asarray(jax.jit(jax_fp4.matmul)(a0, w0, bias)), np.broadcast_to(np.asarray(bias), (3, 5))
    )
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


@pytest.mark.parametrize("m", [3, 100])
@pytest.mark.parametrize("layout", ["spec", "tiled"])
def test_float8_scales_reach_the_kernel_as_they_are(device, layout, m):
    """A weight's float8_e4m3fn scales go to the kernel as they are, no bitcast_convert in the
    compiled program (XLA runs one as a kernel copying every scale on every call), with the same
    bits out as the same scales given as uint8 bytes, both the float64 reference's; at a decode
    and a prefill M (on a GPU the GEMV, then a GEMM path)."""
    rng = np.random.default_rng()
    n, k = 256, 512
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    packed, scale_bytes, gs = reference.random_weight(rng, n, k, 16)
    ref = reference.matmul(np.asarray(a, np.float64), packed, scale_bytes, gs, 16)
    outs = []
    for scale in (scale_bytes, scale_bytes.view(jnp.float8_e4m3fn)):
        w = jax_fp4.NVFP4Weight(packed, scale, gs, block_size=16)
        if layout == "tiled":
            w = jax_fp4.prepack(w)
        step = jax.jit(jax_fp4.matmul)
        assert "bitcast-convert" not in step.lower(a, w).compile().as_text()
        outs.append(np.asarray(step(a, w)))
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
    _check(outs[1], ref, "bfloat16")


def test_dispatch_path_follows_the_default_device(monkeypatch):
    """With a GPU first in jax.devices(), jax.default_device(cpu) still makes dispatch_path answer
    for the CPU, where matmul then runs (a device or a platform name)."""
    rng = np.random.default_rng()
    a, w, _, _ = _random_case(rng, (1,), 16, 128, 16, "bfloat16", False)
    cpu, real_devices = jax.devices("cpu")[0], jax.devices
    gpu = types.SimpleNamespace(platform="gpu", device_kind="a GPU")
    monkeypatch.setattr(
        jax, "devices", lambda backend=None: real_devices(backend) if backend else [gpu]
    )
    with jax.default_device(None):  # whatever the test setup set
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


@pytest.mark.parametrize("lead", [(1,), (3,), (8,), (2, 8), (16,), (17,), (64,), (600,)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepacked_weights_on_every_backend(device, lead, dtype):
    """jax_fp4.prepack(w) (the tiled layout): the CPU kernel and the GEMV read it, the other paths
    transform it back; every backend against the float64 reference, and equal to the same backend
    on the spec layout (bit for bit where the kernel is the same: all but the GEMV, auto, and the
    pure-JAX xla and reference paths, whose programs XLA compiles, and may fuse, differently for
    the two layouts: XLA's CPU dot rounded one float16 output of 112 x 512 one ulp apart)."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, lead, 112, 512, 16, dtype, with_bias=len(lead) == 1)
    p = jax_fp4.prepack(w)
    for backend in backends(device, a, w):
        f = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend=backend))
        y = np.asarray(f(a, p, bias))
        _check(
            y,
            weight_rounding_reference(a, w, bias)
            if backend == "xla" and not device.is_gpu
            else ref,
            dtype,
        )
        if backend not in ("gemv", "auto", "xla", "reference"):
            np.testing.assert_array_equal(y, np.asarray(f(a, w, bias)), err_msg=backend)


# The H200 dispatch rules' edges (jax_fp4/dispatch.py): (M, N, K, layout, auto's path on sm_90).
RULE_EDGES = [
    (32, 4096, 8192, "tiled", "gemv"),  # narrow prepacked weight, long rows: the GEMV to M = 32
    (33, 4096, 8192, "tiled", "fused"),
    (32, 4096, 8192, "spec", "fused"),
    (64, 1024, 8192, "tiled", "gemv"),  # small weight, either layout: the GEMV to M = 64
    (64, 1024, 8192, "spec", "gemv"),
    (65, 1024, 8192, "tiled", "fused"),
    (65, 1024, 8192, "spec", "fused"),
    (64, 1040, 4096, "tiled", "fused"),
    (32, 2048, 4096, "spec", "gemv"),  # spec layout, N * K <= 2^23: the GEMV to M = 32
    (33, 2048, 4096, "spec", "fused"),
    (32, 2112, 4096, "spec", "fused"),
    (
        1100,
        12288,
        4096,
        "spec",
        "fused",
    ),  # N >= 8192, N * K >= 3 * 2^24: the fused GEMM to M = 2048
    (1100, 8192, 4096, "spec", "dequant"),
]


@pytest.mark.parametrize("m, n, k, layout, hopper_path", RULE_EDGES)
def test_auto_at_the_dispatch_rule_edges(device, m, n, k, layout, hopper_path):
    """Auto's pick on either side of each rule, against the float64 reference (the path itself
    checked on the CPU, where it is the CPU kernel, and on a Hopper GPU, where the rules come
    from)."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), n, k, 16, "bfloat16", with_bias=True)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    if not device.is_gpu:
        assert jax_fp4.dispatch_path(a, w) == "cpu"
    elif device.is_hopper:
        assert jax_fp4.dispatch_path(a, w) == hopper_path
    _check(jax.jit(jax_fp4.matmul)(a, w, bias), ref, "bfloat16")


def test_float32_activations_path(device):
    """fp32 activations: the CPU kernel on the CPU; on CUDA, whose kernels take fp16 / bf16, the
    reference path."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (3,), 40, 64, 16, "float32", True)
    assert jax_fp4.dispatch_path(a, w) == ("reference" if device.is_gpu else "cpu")
    _check(jax_fp4.matmul(a, w, bias), ref, "float32")


def test_reruns_are_bit_identical(device):
    rng = np.random.default_rng()
    for m in (1, 8, 64):
        a, w, bias, _ = _random_case(rng, (m,), 1024, 2048, 16, "bfloat16", True)
        f = jax.jit(jax_fp4.matmul)
        first = np.asarray(f(a, w, bias)).view(np.uint16)
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(a, w, bias)).view(np.uint16), first)


def test_quickstart_mlp(device):
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 128)).astype(np.float32)
    q = jax_fp4.quantize(w)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    y = jax.jit(jax_fp4.matmul)(x, q)
    deq = reference.dequantize(q.packed, q.scale_bytes, q.global_scale, 16)
    _check(y, np.asarray(x, np.float64) @ deq.T, "bfloat16")


@pytest.mark.parametrize(
    "m, n, k, layout", [(1, 256, 4096, "tiled"), (64, 2112, 4096, "spec"), (2048, 128, 256, "spec")]
)
def test_exported_program_runs_its_kernel(device, m, n, k, layout):
    """jax.export on the device: the program keeps the kernel auto picked (its FFI target in the
    module) and the exported call gives the live call's bits (tests/test_export.py: serialization
    and the CPU side's disabled checks)."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), n, k, 16, "bfloat16", with_bias=True)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    path = jax_fp4.dispatch_path(a, w)
    live = jax.jit(jax_fp4.matmul)
    exported = jax.export.export(live, disabled_checks=jax_fp4.export_disabled_checks())(a, w, bias)
    target = f"jax_fp4_{path}_cuda" if device.is_gpu else "jax_fp4_matmul_cpu"
    assert target in exported.mlir_module()
    y = exported.call(a, w, bias)
    _check(y, weight_rounding_reference(a, w, bias) if path == "dequant" else ref, "bfloat16")
    np.testing.assert_array_equal(
        np.asarray(y).view(np.uint16), np.asarray(live(a, w, bias)).view(np.uint16)
    )


# ---- bad input: clear errors at trace time, naming the argument -----------------------------


def _weight(n=8, k=32, block_size=16):
    packed, scale, gs = reference.random_weight(np.random.default_rng(), n, k, block_size)
    return jax_fp4.NVFP4Weight(packed, scale, gs, block_size=block_size)


@pytest.mark.parametrize(
    "make_args, error, match",
    [
        (lambda w: (jnp.ones((2, 48), jnp.bfloat16), w), ValueError, r"K = 32.*\(2, 48\)"),
        (
            lambda w: (jnp.ones((2, 32), jnp.int32), w),
            TypeError,
            "a must be float16, bfloat16 or float32",
        ),
        (
            lambda w: (
                jnp.ones((2, 32), jnp.float64 if jax.config.jax_enable_x64 else jnp.int8),
                w,
            ),
            TypeError,
            "dtype",
        ),
        (lambda w: (jnp.ones((), jnp.bfloat16), w), ValueError, "rank"),
        (
            lambda w: (jnp.ones((2, 32), jnp.bfloat16), w.packed),
            TypeError,
            "w must be an NVFP4Weight",
        ),
        (
            lambda w: (jnp.ones((2, 32), jnp.bfloat16), w, jnp.ones((7,))),
            ValueError,
            r"bias must have shape \(N,\) = \(8,\)",
        ),
        (lambda w: (jnp.ones((2, 32), jnp.bfloat16), w, jnp.ones((1, 8))), ValueError, "bias"),
        (
            lambda w: (jnp.ones((2, 32), jnp.bfloat16), w, jnp.ones((8,), jnp.int32)),
            TypeError,
            "bias must be a float",
        ),
    ],
)
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
        jax_fp4.matmul(
            jnp.ones((2, 64), jnp.bfloat16), _weight(k=64, block_size=32), backend="gemv"
        )
    for backend in ("dequant", "xla"):
        with pytest.raises(
            ValueError,
            match=rf"backend='{backend}' cannot serve this matmul: a must "
            r"be float16 or bfloat16, got float32",
        ):
            jax_fp4.matmul(jnp.ones((2, 48), jnp.float32), w, backend=backend)


# Values outside each KernelTuning field's set: rejected where it is built, naming the field.
BAD_TUNINGS = [
    *[("fused_split", v) for v in (9, -1, 100)],
    *[("fused_tile_m", v) for v in (8, 48, 512, -16)],
    *[("fused_tile_n", v) for v in (64, 512, -128)],
    *[("fused_warp_specialized", v) for v in (2, -1, "yes")],
    *[("fused_stream_k", v) for v in (2, -1, "on")],
    *[("gemv_col_tiles", v) for v in (3, 4, -1)],
    *[("gemv_k_split", v) for v in (-1, -4)],
    *[("gemv_rows_per_block", v) for v in (3, 8, -1)],
    *[("programmatic_launch", v) for v in (2, "yes")],
    *[("gemv_norm_scale", v) for v in (1, None, "yes")],
]


@pytest.mark.parametrize("field, value", BAD_TUNINGS)
def test_kernel_tuning_rejects_malformed_values(field, value):
    """A malformed kernel choice is an error naming the field, not silently ignored."""
    with pytest.raises(ValueError, match=field):
        jax_fp4.KernelTuning(**{field: value})


def test_kernel_tuning_is_static_and_hashable():
    """matmul's `tuning` is a static parameter: equal tunings hash alike, and it reaches the
    kernels of the CUDA paths only (the CPU kernel gives the same bits with and without it)."""
    tuning = jax_fp4.KernelTuning(fused_tile_m=64, gemv_col_tiles=2, programmatic_launch=True)
    assert hash(tuning) == hash(
        jax_fp4.KernelTuning(fused_tile_m=64, gemv_col_tiles=2, programmatic_launch=True)
    )
    assert jax_fp4.KernelTuning is jax_fp4.config.KernelTuning
    w = _weight(k=128)
    a = jnp.ones((2, 128), jnp.bfloat16)
    plain = jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="cpu"))(a, w)
    tuned = jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="cpu", tuning=tuning))(a, w)
    np.testing.assert_array_equal(np.asarray(tuned), np.asarray(plain))


def test_stacked_weight_needs_a_transform():
    ws = jax_fp4.quantize(np.random.default_rng().standard_normal((2, 8, 32)).astype(np.float32))
    with pytest.raises(ValueError, match="stacked"):
        jax_fp4.matmul(jnp.ones((1, 32), jnp.bfloat16), ws)


def test_cpu_handler_validates_operands():
    # Called directly with a mismatched scale, the C++ handler returns an error instead of reading
    # out of bounds.
    w = _weight()
    call = jax.ffi.ffi_call("jax_fp4_matmul_cpu", jax.ShapeDtypeStruct((2, 8), jnp.float32))

    def run(scale, block_size=16, tiled=False):
        return jax.block_until_ready(
            call(
                jnp.ones((2, 32), jnp.float32),
                w.packed,
                scale,
                w.global_scale,
                jnp.zeros((0,), jnp.float32),
                block_size=np.int64(block_size),
                tiled=tiled,
                avx512=False,
            )
        )

    with pytest.raises(Exception, match="scale must be"):
        run(np.zeros((8, 1), np.uint8))
    with pytest.raises(Exception, match="scale must be float8_e4m3fn or uint8"):
        run(np.asarray(w.scale_bytes).view(np.int8))
    with pytest.raises(Exception, match="block_size must be positive"):
        run(w.scale_bytes, block_size=0)
    with pytest.raises(
        Exception, match="tiled layout needs block_size 16, N % 16 == 0 and K % 128"
    ):
        run(w.scale_bytes, tiled=True)
