"""jax_fp4.matmul on a CUDA device, through the public API: the default dispatch and every forced
backend against the float64 reference, and against backend="reference" within rounding.
Skipped without a CUDA device (the kernels' own sweeps are in test_gpu_kernels.py and
test_gpu_fused.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from tests import reference
from tests.test_matmul import _check, _random_case, weight_rounding_reference


def _gpu():
    try:
        return next((d for d in jax.devices() if d.platform == "gpu"), None)
    except RuntimeError:
        return None


GPU = _gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU is None, reason="needs a CUDA device")]

CASES = [
    # (leading dims of a, N, K, block_size)
    ((1,), 100, 4096, 16),      # decode: gemv (mma)
    ((4,), 129, 160, 16),       # gemv scalar (K % 128 != 0)
    ((2, 3), 64, 256, 16),      # leading dims
    ((9,), 33, 256, 16),        # just past the GEMV: dequant
    ((65,), 1000, 512, 16),
    ((17,), 21, 50, 16),        # K % 32 != 0: dequant
    ((3,), 8, 42, 7),           # odd block size: dequant
    ((1000,), 48, 128, 32),
]


def _backends(a, w):
    names = ["auto", "reference", "dequant", "xla"]
    if w.block_size == 16 and w.k % 32 == 0:
        names.append("gemv")
    if GPU is not None and str(getattr(GPU, "compute_capability", "")) == "9.0" and (
            w.block_size == 16 and w.k % 128 == 0):
        names.append("fused")
    return names


@pytest.mark.parametrize("lead, n, k, block_size", CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_backend_matches_the_reference(lead, n, k, block_size, dtype, with_bias):
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, lead, n, k, block_size, dtype, with_bias)
    results = {}
    for backend in _backends(a, w):
        y = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend=backend))(a, w, bias)
        rounds_weight = backend in ("dequant", "xla")
        _check(y, weight_rounding_reference(a, w, bias) if rounds_weight else ref, dtype)
        results[backend] = np.asarray(y, np.float64)
    eps = {"bfloat16": 2**-7, "float16": 2**-10}[dtype]
    scale = np.abs(results["reference"]).max()
    for backend, y in results.items():  # each forced backend equals "reference" within rounding
        np.testing.assert_allclose(y, results["reference"], rtol=2 * eps, atol=4 * eps * scale,
                                   err_msg=backend)


@pytest.mark.parametrize("lead", [(1,), (3,), (8,), (2, 8), (16,), (17,), (64,), (600,)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepacked_weights_on_every_backend(lead, dtype):
    """jax_fp4.prepack(w) (the tiled layout): the GEMV reads it, the other paths transform it
    back; every backend against the float64 reference, and equal to the same backend on the spec
    layout (bit for bit where the kernel is the same: all but the GEMV, and xla, whose program
    XLA compiles, and may fuse, differently for the two layouts)."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, lead, 112, 512, 16, dtype, with_bias=len(lead) == 1)
    p = jax_fp4.prepack(w)
    for backend in _backends(a, w):
        f = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend=backend))
        y = np.asarray(f(a, p, bias))
        _check(y, ref, dtype)
        if backend not in ("gemv", "auto", "xla"):
            np.testing.assert_array_equal(y, np.asarray(f(a, w, bias)), err_msg=backend)


# The H200 dispatch rules' edges (jax_fp4/dispatch.py): (M, N, K, layout, auto's path on sm_90).
RULE_EDGES = [
    (32, 4096, 8192, "tiled", "gemv"),     # narrow prepacked weight, long rows: the GEMV to M = 32
    (33, 4096, 8192, "tiled", "fused"),
    (32, 4096, 8192, "spec", "fused"),
    (64, 1024, 8192, "tiled", "gemv"),     # small weight, either layout: the GEMV to M = 64
    (64, 1024, 8192, "spec", "gemv"),
    (65, 1024, 8192, "tiled", "fused"),
    (65, 1024, 8192, "spec", "fused"),
    (64, 1040, 4096, "tiled", "fused"),
    (32, 2048, 4096, "spec", "gemv"),      # spec layout, N * K <= 2^23: the GEMV to M = 32
    (33, 2048, 4096, "spec", "fused"),
    (32, 2112, 4096, "spec", "fused"),
    (1100, 12288, 4096, "spec", "fused"),  # N >= 8192, N * K >= 3 * 2^24: the fused GEMM to M = 2048
    (1100, 8192, 4096, "spec", "dequant"),
]


@pytest.mark.parametrize("m, n, k, layout, hopper_path", RULE_EDGES)
def test_auto_at_the_dispatch_rule_edges(m, n, k, layout, hopper_path):
    """Auto's pick on either side of each rule, against the float64 reference (the path itself
    checked on a Hopper GPU, where the rules come from)."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), n, k, 16, "bfloat16", with_bias=True)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    if str(getattr(GPU, "compute_capability", "")) == "9.0":
        assert jax_fp4.dispatch_path(a, w) == hopper_path
    _check(jax.jit(jax_fp4.matmul)(a, w, bias), ref, "bfloat16")


def test_float32_activations_take_the_reference_path():
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (3,), 40, 64, 16, "float32", True)
    assert jax_fp4.dispatch_path(a, w) == "reference"
    _check(jax_fp4.matmul(a, w, bias), ref, "float32")


def test_reruns_are_bit_identical():
    rng = np.random.default_rng()
    for m in (1, 8, 64):
        a, w, bias, _ = _random_case(rng, (m,), 1024, 2048, 16, "bfloat16", True)
        f = jax.jit(jax_fp4.matmul)
        first = np.asarray(f(a, w, bias)).view(np.uint16)
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(a, w, bias)).view(np.uint16), first)


def test_quickstart_mlp_on_gpu():
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 128)).astype(np.float32)
    q = jax_fp4.quantize(w)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    y = jax.jit(jax_fp4.matmul)(x, q)
    deq = reference.dequantize(q.packed, q.scale_bytes, q.global_scale, 16)
    _check(y, np.asarray(x, np.float64) @ deq.T, "bfloat16")


@pytest.mark.parametrize("m, n, k, layout", [(1, 256, 4096, "tiled"), (64, 2112, 4096, "spec"),
                                             (2048, 128, 256, "spec")])
def test_exported_program_runs_its_kernel(m, n, k, layout):
    """jax.export on the GPU: the program keeps the kernel auto picked (its FFI target in the
    module) and the exported call gives the live call's bits (tests/test_export.py: serialization
    and the CPU side)."""
    rng = np.random.default_rng()
    a, w, bias, ref = _random_case(rng, (m,), n, k, 16, "bfloat16", with_bias=True)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    path = jax_fp4.dispatch_path(a, w)
    live = jax.jit(jax_fp4.matmul)
    exported = jax.export.export(live, disabled_checks=jax_fp4.export_disabled_checks())(a, w, bias)
    assert f"jax_fp4_{path}_cuda" in exported.mlir_module()
    y = exported.call(a, w, bias)
    _check(y, weight_rounding_reference(a, w, bias) if path == "dequant" else ref, "bfloat16")
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                  np.asarray(live(a, w, bias)).view(np.uint16))
