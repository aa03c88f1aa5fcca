"""The GEMV and dequantize CUDA kernels (FFI targets jax_fp4_gemv_cuda, jax_fp4_dequant_cuda) called
directly through jax.ffi.ffi_call, against the independent float64 reference in tests/reference.py:
both GEMV variants (tensor-core and scalar), each launch configuration forced through the kernel's
attributes (jax_fp4.KernelTuning), both weight layouts.

Every test needs a CUDA device and is skipped without one. Inputs are fresh random draws on every
run; output buffers are poisoned with NaN before each call (a NaN array of the same size is
allocated and freed just before, so the allocator hands its memory to the kernel's output) and
every check rejects NaN where none is expected, so an unwritten element fails.

JAX_FP4_GPU_TEST_QUICK=1 shrinks the sweeps (used under compute-sanitizer).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference
from tests._helpers import (
    CHAIN_DIMS,
    DTYPES,
    NP_DTYPES,
    SPECIAL_SCALES,
    chain_weights,
    gemv_attributes,
    gpus,
    plain_and_programmatic,
    poison,
)

HAS_CUDA = bool(gpus())
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

QUICK = os.environ.get("JAX_FP4_GPU_TEST_QUICK", "") not in ("", "0")

GEMV = "jax_fp4_gemv_cuda"
DEQUANT = "jax_fp4_dequant_cuda"


# Importing jax_fp4 registers its FFI targets (the package's CUDA module).
import jax_fp4  # noqa: E402,F401
from jax_fp4 import KernelTuning  # noqa: E402
from jax_fp4 import layout as _layout  # noqa: E402

EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
NORM_TOL = {"float16": 2e-3, "bfloat16": 1e-2}
# SPECIAL_SCALES leave out 448 (0x7E, in the dequant tests): in a long random dot product it can
# overflow fp16.


# ---------------------------------------------------------------------------------------------
# Helpers


def gemv(
    a,
    packed,
    scale,
    gs,
    bias,
    *,
    use_mma=True,
    row_tiling=True,
    block_size=16,
    tiled=False,
    tuning=None,
    attributes=None,
):
    """The GEMV target on spec-layout packed / scale; tiled=True hands it the same weight in the
    tiled layout (jax_fp4.prepack's). use_mma: the tensor-core kernel where it can run (else the
    scalar one); `tuning`: the launch configuration (None: the heuristic); `attributes` override
    the call's attributes."""
    m, n, k = a.shape[0], packed.shape[0], a.shape[1]
    attrs = gemv_attributes(k, use_mma=use_mma, row_tiling=row_tiling, tiled=tiled, tuning=tuning)
    if bias is None:
        bias = jnp.zeros((0,), a.dtype)
    if tiled:
        packed, scale = _layout.tile_packed(packed), _layout.tile_scale(scale)
    poison((m, n), a.dtype)
    call = jax.ffi.ffi_call(GEMV, jax.ShapeDtypeStruct((m, n), a.dtype))
    y = call(
        a,
        packed,
        scale,
        gs,
        bias,
        block_size=np.int64(block_size),
        **{**attrs, **(attributes or {})},
    )
    return np.asarray(y)


def dequant(packed, scale, gs, dtype, block_size, tiled=False):
    """The dequant target on spec-layout packed / scale (tiled=True: handed the tiled layout)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    if tiled:
        packed, scale = _layout.tile_packed(packed), _layout.tile_scale(scale)
    poison((n, k), dtype)
    call = jax.ffi.ffi_call(DEQUANT, jax.ShapeDtypeStruct((n, k), jnp.dtype(dtype)))
    return np.asarray(call(packed, scale, gs, block_size=np.int64(block_size), tiled=bool(tiled)))


def random_scales(rng, n, kb, specials=True):
    scale = rng.integers(0x20, 0x50, size=(n, kb), dtype=np.uint8)
    if specials and scale.size >= 4:
        idx = rng.choice(scale.size, size=min(scale.size // 4, 8), replace=False)
        scale.flat[idx] = rng.choice(SPECIAL_SCALES, size=idx.size)
    return scale


def random_problem(rng, m, n, k, dtype, with_bias, block_size=16):
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = random_scales(rng, n, math.ceil(k / block_size))
    gs = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-6, 1))
    a = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), dtype)
    bias = jnp.asarray(rng.standard_normal(n).astype(np.float32), dtype) if with_bias else None
    return a, packed, scale, gs, bias


def reference_gemv(a, packed, scale, gs, bias):
    return reference.matmul(a, packed, scale, gs, 16, bias)


def check_close(y, ref, dtype, what=""):
    y64 = np.asarray(y).astype(np.float64)
    assert y64.shape == ref.shape, what
    bad = ~np.isfinite(y64) & np.isfinite(ref)
    assert not bad.any(), f"{what}: {bad.sum()} non-finite outputs where the reference is finite"
    assert np.array_equal(np.isnan(y64), np.isnan(ref)), f"{what}: NaN pattern differs"
    finite = np.isfinite(ref)
    err = reference.relative_error(y64[finite], ref[finite])
    assert err <= NORM_TOL[dtype], f"{what}: relative error {err:.3g}"
    scale = np.abs(ref[finite]).max() if finite.any() else 1.0
    np.testing.assert_allclose(
        y64[finite], ref[finite], rtol=2 * EPS[dtype], atol=4 * EPS[dtype] * scale, err_msg=what
    )


def as_dtype(x, dtype):
    """Round to the dtype on the host (numpy / ml_dtypes, round to nearest even). Callers pass
    values that are exact in float32, so going through float32 is a single rounding."""
    return np.asarray(x, np.float32).astype(NP_DTYPES[dtype])


# ---------------------------------------------------------------------------------------------
# GEMV: random sweep over M, ragged N, K (K % 128 != 0 and == 0), dtype, bias, kernel flags.

M_VALUES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 33, 64, 65, 128]
NK_SHAPES = [
    (1, 128),
    (7, 96),
    (100, 512),
    (129, 160),
    (1000, 4096),
    (33, 256),
    (300, 1024),
    (17, 32),
    (64, 384),
    (250, 2048),
]
if QUICK:
    M_VALUES = [1, 3, 8, 9, 17]
    NK_SHAPES = [(1, 128), (7, 96), (129, 160), (33, 256)]


# The tiled layout (jax_fp4.prepack): N % 16 == 0, K % 128 == 0, the tensor-core kernel only. Tile
# counts are odd where they can be, so that the two-tile launches have a partial last block.
TILED_SHAPES = [
    (16, 128),
    (48, 256),
    (112, 512),
    (1008, 4096),
    (8496, 128),
    (17008, 256),
    (96, 4096),
    (272, 2816),
]
if QUICK:
    TILED_SHAPES = [(16, 128), (48, 256), (8496, 128), (96, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("tiled", [False, True], ids=["spec", "tiled"])
def test_gemv_random_sweep(m, dtype, tiled):
    rng = np.random.default_rng()
    i = M_VALUES.index(m)
    pool = TILED_SHAPES if tiled else NK_SHAPES
    shapes = [pool[i % len(pool)], pool[(3 * i + 1) % len(pool)]]
    for j, (n, k) in enumerate(shapes):
        a, packed, scale, gs, bias = random_problem(rng, m, n, k, dtype, with_bias=(i + j) % 2 == 0)
        ref = reference_gemv(a, packed, scale, gs, bias)
        for use_mma in (True,) if tiled else (True, False):
            for row_tiling in (True, False):
                y = gemv(
                    a, packed, scale, gs, bias, use_mma=use_mma, row_tiling=row_tiling, tiled=tiled
                )
                check_close(
                    y, ref, dtype, f"M={m} N={n} K={k} mma={use_mma} rt={row_tiling} tiled={tiled}"
                )


# Shapes that reach the launch-config branches on an H200 (132 SMs): scalar row tiling (N/8 >=
# a wave, K % 128 != 0), mma with one and two column tiles (large ragged N), two row tiles,
# k_split 8 and a non-power-of-two k_split.
WIDE_CASES = [
    (5, 1100, 160),  # scalar, rows_per_block 4 with a partial tile
    (2, 2056, 96),  # scalar, rows_per_block 2
    (3, 8500, 128),  # mma col_tiles 2, ragged N
    (9, 8500, 256),  # mma two row tiles, ragged N, a partial second row tile
    (5, 17000, 256),  # mma col_tiles 2 (M > 4), ragged N
    (2, 17000, 256),  # mma one tile where M <= 4 (two tiles would be just over a wave)
    (2, 5110, 3072),  # mma k_split 6, ragged N
    (1, 100, 4096),  # mma k_split 8
    (4, 4097, 1024),  # ragged by one column
]
if QUICK:
    WIDE_CASES = [(5, 1100, 160), (3, 8500, 128), (5, 17000, 256), (2, 5110, 3072), (1, 100, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", WIDE_CASES)
def test_gemv_wide_shapes(m, n, k, dtype):
    rng = np.random.default_rng()
    a, packed, scale, gs, bias = random_problem(rng, m, n, k, dtype, with_bias=True)
    ref = reference_gemv(a, packed, scale, gs, bias)
    for use_mma, row_tiling in ((True, True), (False, True), (False, False)):
        y = gemv(a, packed, scale, gs, bias, use_mma=use_mma, row_tiling=row_tiling)
        check_close(y, ref, dtype, f"M={m} N={n} K={k} mma={use_mma} rt={row_tiling}")


def exact_problem(rng, m, n, k, dtype, with_bias):
    """Inputs whose fp32 sums are exact: activations in multiples of 0.5 up to 2, power-of-two
    block scales 2^-2 .. 2^2 (bytes 0x28, 0x30, .. 0x48), gs = 1, half-integer bias: every
    partial sum is a multiple of 2^-4 below 2^18, so any summation order gives the same fp32
    value and the result must equal the reference rounded to the dtype, bit for bit."""
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = (rng.integers(5, 10, size=(n, k // 16)) * 8).astype(np.uint8)
    a = jnp.asarray(rng.integers(-4, 5, size=(m, k)).astype(np.float32) * 0.5, dtype)
    bias = (
        jnp.asarray(rng.integers(-8, 9, size=n).astype(np.float32) * 0.5, dtype)
        if with_bias
        else None
    )
    return a, packed, scale, np.float32(1.0), bias


EXACT_CASES = [
    (1, 16, 128),
    (4, 40, 256),
    (8, 33, 4096),
    (9, 7, 96),
    (3, 100, 160),
    (17, 130, 512),
    (5, 1100, 128),
]
if QUICK:
    EXACT_CASES = EXACT_CASES[:3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", EXACT_CASES)
def test_gemv_exact_bitwise(m, n, k, dtype):
    rng = np.random.default_rng()
    for with_bias in (False, True):
        a, packed, scale, gs, bias = exact_problem(rng, m, n, k, dtype, with_bias)
        expected = as_dtype(reference_gemv(a, packed, scale, gs, bias), dtype)
        for use_mma in (True, False):
            for row_tiling in (True, False):
                y = gemv(a, packed, scale, gs, bias, use_mma=use_mma, row_tiling=row_tiling)
                np.testing.assert_array_equal(
                    y.view(np.uint16),
                    expected.view(np.uint16),
                    err_msg=f"M={m} N={n} K={k} mma={use_mma} rt={row_tiling} bias={with_bias}",
                )


def launch_config(config: str) -> KernelTuning:
    """KernelTuning of "col_tiles,k_split[,rows_per_block]"."""
    fields = ("gemv_col_tiles", "gemv_k_split", "gemv_rows_per_block")
    return KernelTuning(**dict(zip(fields, (int(v) for v in config.split(",")))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config",
    [
        "1,1",
        "1,2",
        "1,3",
        "1,6",
        "1,8",
        "1,16",
        "2,1",
        "2,3",
        "2,8",
        "1,4,1",
        "1,4,2",
        "1,4,4",
        "2,16",
        "2,6,2",
        "1,16,4",
    ],
)
def test_gemv_every_launch_config(config, dtype):
    """Every kernel variant (col_tiles, k_split, rows_per_block), forced through
    KernelTuning(gemv_col_tiles, gemv_k_split, gemv_rows_per_block), on exact inputs: all must match the reference bit for bit.
    ("2,16": k_split is clamped into the block's 16-warp budget; at M = 9 and 17 the "2,..."
    configs run two column tiles with two row tiles, whose budget on this, the spec, layout is
    4 warps; test_gemv_tiled_every_launch_config runs them prepacked, where it is 8.)"""
    rng = np.random.default_rng()
    tuning = launch_config(config)
    for m, n, k in ((3, 70, 1024), (9, 37, 512), (1, 5, 128), (17, 45, 2816)):
        a, packed, scale, gs, bias = exact_problem(rng, m, n, k, dtype, with_bias=True)
        expected = as_dtype(reference_gemv(a, packed, scale, gs, bias), dtype)
        for use_mma in (True, False):
            y = gemv(a, packed, scale, gs, bias, use_mma=use_mma, row_tiling=True, tuning=tuning)
            np.testing.assert_array_equal(
                y.view(np.uint16),
                expected.view(np.uint16),
                err_msg=f"config={config} M={m} N={n} K={k} mma={use_mma}",
            )


# (attribute, a valid value, an invalid value): the handler checks the attributes it is handed.
BAD_ATTRIBUTES = (
    [("col_tiles", 2, v) for v in (3, 4, -1)]
    + [("k_split", 4, v) for v in (-1,)]
    + [("rows_per_block", 4, v) for v in (3, 8, -1)]
)


@pytest.mark.parametrize("attribute, valid, value", BAD_ATTRIBUTES)
def test_gemv_attributes_reject_malformed_values(attribute, valid, value):
    """An attribute outside its set is an error from the kernel call naming the attribute (the
    valid value runs: the handler reads the attribute on every call, so the tests that set it do
    run what they name)."""
    rng = np.random.default_rng()
    a, packed, scale, gs, _ = random_problem(rng, 2, 40, 256, "bfloat16", with_bias=False)
    for use_mma in (True, False):
        y = gemv(
            a, packed, scale, gs, None, use_mma=use_mma, attributes={attribute: np.int64(valid)}
        )
        check_close(
            y,
            reference_gemv(a, packed, scale, gs, None),
            "bfloat16",
            f"{attribute}={valid} mma={use_mma}",
        )
        with pytest.raises(Exception, match=attribute):
            gemv(
                a, packed, scale, gs, None, use_mma=use_mma, attributes={attribute: np.int64(value)}
            )


def test_gemv_variant_the_handler_cannot_run_is_an_error():
    """The handler runs the variant dispatch decided, never another: the tensor-core kernel on the
    spec layout with K % 128 != 0, or the scalar kernel on the tiled layout, is an error."""
    rng = np.random.default_rng()
    a, packed, scale, gs, _ = random_problem(rng, 2, 48, 160, "bfloat16", with_bias=False)
    with pytest.raises(Exception, match="tensor_cores"):
        gemv(a, packed, scale, gs, None, attributes={"tensor_cores": True})
    a, packed, scale, gs, _ = random_problem(rng, 2, 48, 256, "bfloat16", with_bias=False)
    with pytest.raises(Exception, match="tensor_cores"):
        gemv(a, packed, scale, gs, None, tiled=True, attributes={"tensor_cores": False})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiled", [False, True], ids=["spec", "tiled"])
@pytest.mark.parametrize("m", [1, 9])
def test_gemv_programmatic_launch_chain(m, tiled, dtype):
    """KernelTuning(programmatic_launch=True) (sm_90+): each GEMV of a jitted chain, whose activations are the previous
    GEMV's output, may be scheduled while that one still runs and must wait for it. The chain
    (tests/chains.py's) starts with a large layer, so the next one is in flight long before its
    input is ready. Same bits as plain launches; every layer matches the float64 reference on the
    input it was given."""
    rng = np.random.default_rng()
    weights = chain_weights(lambda n, k: reference.random_weight(rng, n, k))
    a = as_dtype(rng.standard_normal((m, CHAIN_DIMS[0])), dtype)
    plain, programmatic = plain_and_programmatic(a, weights, backend="gemv", tiled=tiled)
    x = a
    for i, (w, y, y_pdl) in enumerate(zip(weights, plain, programmatic)):
        np.testing.assert_array_equal(
            y_pdl.view(np.uint16), y.view(np.uint16), err_msg=f"layer {i}"
        )
        check_close(y, reference_gemv(x, *w, None), dtype, f"layer {i}")
        x = y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_mma", [True, False])
def test_gemv_lane_ownership_probe(dtype, use_mma):
    """One-hot activations (row r picks a single k) against weights whose values encode the
    column (a distinct power-of-two-ish scale per column mod 16) and k (the code): y[r, n] must
    be exactly w[n, k_r]. Over the trials every position of a 128-wide window, every lane and
    every k-step of the mma fragment map is probed, for all 8 rows of an M chunk and 16+ columns."""
    rng = np.random.default_rng()
    m, n, k = 8, 40, 256
    col_scale = (0x30 + np.arange(n) % 16).astype(np.uint8)  # 0.5, 0.5625, .. 0.9375, 1, .. 1.875
    scale = np.repeat(col_scale[:, None], k // 16, axis=1)
    codes = rng.integers(1, 8, size=(n, k)).astype(np.uint8)  # nonzero, positive
    codes[:, 1::3] |= 8  # some negative
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    w = reference.dequantize(packed, scale, 1.0, 16)
    trials = [(t * 8 + (np.arange(m) + t) % 8) % k for t in range(k // 8)]  # every k once
    trials += [rng.integers(0, k, size=m) for _ in range(16)]
    for trial, ks in enumerate(trials):
        a = np.zeros((m, k), np.float32)
        a[np.arange(m), ks] = 1.0
        y = gemv(jnp.asarray(a, dtype), packed, scale, np.float32(1.0), None, use_mma=use_mma)
        expected = as_dtype(w[:, ks].T, dtype)
        np.testing.assert_array_equal(
            y.view(np.uint16),
            expected.view(np.uint16),
            err_msg=f"trial {trial}, k per row {ks.tolist()}",
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_mma", [True, False])
@pytest.mark.parametrize("m, n, k", [(3, 50, 256), (1, 20, 96), (9, 33, 512)])
def test_gemv_nan_scale_poisons_only_its_column(m, n, k, dtype, use_mma):
    rng = np.random.default_rng()
    a, packed, scale, gs, bias = random_problem(rng, m, n, k, dtype, with_bias=True)
    scale = np.clip(scale, 0x20, 0x50).astype(np.uint8)  # no other specials
    cols = rng.choice(n, size=2, replace=False)
    scale[cols[0], rng.integers(k // 16)] = 0x7F
    scale[cols[1], rng.integers(k // 16)] = 0xFF
    y = gemv(a, packed, scale, gs, bias, use_mma=use_mma).astype(np.float64)
    nan_cols = np.zeros(n, bool)
    nan_cols[cols] = True
    assert np.isnan(y[:, nan_cols]).all()
    assert np.isfinite(y[:, ~nan_cols]).all()
    ref = reference_gemv(a, packed, scale, gs, bias)
    check_close(y, ref, dtype, "NaN scale")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_deterministic(dtype):
    """Run-to-run bit-identical; the scalar path is also bit-identical across row tilings."""
    rng = np.random.default_rng()
    for m, n, k in ((4, 1100, 1024), (8, 300, 4096), (5, 2000, 160)):
        a, packed, scale, gs, bias = random_problem(rng, m, n, k, dtype, with_bias=True)
        for use_mma in (True, False):
            first = gemv(a, packed, scale, gs, bias, use_mma=use_mma)
            for _ in range(3):
                again = gemv(a, packed, scale, gs, bias, use_mma=use_mma)
                np.testing.assert_array_equal(first.view(np.uint16), again.view(np.uint16))
        tiled = gemv(a, packed, scale, gs, bias, use_mma=False, row_tiling=True)
        untiled = gemv(a, packed, scale, gs, bias, use_mma=False, row_tiling=False)
        np.testing.assert_array_equal(tiled.view(np.uint16), untiled.view(np.uint16))


def test_gemv_under_jit_and_graphs():
    """Inside one jitted program next to other ops (XLA may capture it into a command buffer):
    same bits as the eager call."""
    rng = np.random.default_rng()
    a, packed, scale, gs, bias = random_problem(rng, 4, 300, 512, "bfloat16", with_bias=True)
    eager = gemv(a, packed, scale, gs, bias)
    call = jax.ffi.ffi_call(GEMV, jax.ShapeDtypeStruct((4, 300), a.dtype))

    @jax.jit
    def f(a, packed, scale, gs, bias):
        y = call(a * 1, packed, scale, gs, bias, block_size=np.int64(16), **gemv_attributes(512))
        return y, y.astype(jnp.float32).sum()

    for _ in range(3):
        y, _ = f(a, packed, scale, gs, bias)
        np.testing.assert_array_equal(np.asarray(y).view(np.uint16), eager.view(np.uint16))


def test_gemv_rejects_bad_operands():
    rng = np.random.default_rng()
    a, packed, scale, gs, _ = random_problem(rng, 2, 8, 48, "float16", with_bias=False)
    with pytest.raises(Exception, match="multiple of 32"):
        gemv(a, packed, scale, gs, None)
    a, packed, scale, gs, _ = random_problem(
        rng, 2, 8, 64, "float16", with_bias=False, block_size=32
    )
    with pytest.raises(Exception, match="block_size"):
        gemv(a, packed, scale, gs, None, block_size=32)


# ---------------------------------------------------------------------------------------------
# GEMV on the tiled layout (jax_fp4.prepack); its random sweep is test_gemv_random_sweep[tiled].


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 16, 128),
        (4, 48, 256),
        (8, 32, 4096),
        (9, 16, 128),
        (17, 128, 512),
        (5, 1104, 128),
        (2, 8496, 256),
    ],
)
def test_gemv_tiled_exact_bitwise(m, n, k, dtype):
    rng = np.random.default_rng()
    for with_bias in (False, True):
        a, packed, scale, gs, bias = exact_problem(rng, m, n, k, dtype, with_bias)
        expected = as_dtype(reference_gemv(a, packed, scale, gs, bias), dtype)
        y = gemv(a, packed, scale, gs, bias, tiled=True)
        np.testing.assert_array_equal(
            y.view(np.uint16),
            expected.view(np.uint16),
            err_msg=f"tiled M={m} N={n} K={k} bias={with_bias}",
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", ["1,1", "1,6", "1,8", "2,1", "2,3", "2,8", "1,4,2", "1,16,4"])
def test_gemv_tiled_every_launch_config(config, dtype):
    rng = np.random.default_rng()
    tuning = launch_config(config)
    for m, n, k in ((3, 80, 1024), (9, 48, 512), (1, 16, 128), (17, 112, 2816)):
        a, packed, scale, gs, bias = exact_problem(rng, m, n, k, dtype, with_bias=True)
        expected = as_dtype(reference_gemv(a, packed, scale, gs, bias), dtype)
        y = gemv(a, packed, scale, gs, bias, tiled=True, tuning=tuning)
        np.testing.assert_array_equal(
            y.view(np.uint16),
            expected.view(np.uint16),
            err_msg=f"tiled config={config} M={m} N={n} K={k}",
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_tiled_lane_ownership_probe(dtype):
    """One-hot activations against column-coded weights (as test_gemv_lane_ownership_probe) in
    the tiled layout: every k of two windows, every lane and row of an M chunk, 48 columns."""
    rng = np.random.default_rng()
    m, n, k = 8, 48, 256
    col_scale = (0x30 + np.arange(n) % 16).astype(np.uint8)
    scale = np.repeat(col_scale[:, None], k // 16, axis=1)
    codes = rng.integers(1, 8, size=(n, k)).astype(np.uint8)
    codes[:, 1::3] |= 8
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    w = reference.dequantize(packed, scale, 1.0, 16)
    trials = [(t * 8 + (np.arange(m) + t) % 8) % k for t in range(k // 8)]
    trials += [rng.integers(0, k, size=m) for _ in range(8)]
    for trial, ks in enumerate(trials):
        a = np.zeros((m, k), np.float32)
        a[np.arange(m), ks] = 1.0
        y = gemv(jnp.asarray(a, dtype), packed, scale, np.float32(1.0), None, tiled=True)
        np.testing.assert_array_equal(
            y.view(np.uint16),
            as_dtype(w[:, ks].T, dtype).view(np.uint16),
            err_msg=f"trial {trial}, k per row {ks.tolist()}",
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_tiled_nan_scale_and_determinism(dtype):
    rng = np.random.default_rng()
    m, n, k = 5, 160, 1024
    a, packed, scale, gs, bias = random_problem(rng, m, n, k, dtype, with_bias=True)
    scale = np.clip(scale, 0x20, 0x50).astype(np.uint8)
    cols = rng.choice(n, size=2, replace=False)
    scale[cols[0], rng.integers(k // 16)] = 0x7F
    scale[cols[1], rng.integers(k // 16)] = 0xFF
    y = gemv(a, packed, scale, gs, bias, tiled=True)
    nan_cols = np.zeros(n, bool)
    nan_cols[cols] = True
    assert np.isnan(y[:, nan_cols].astype(np.float32)).all()
    check_close(y, reference_gemv(a, packed, scale, gs, bias), dtype, "tiled NaN scale")
    for _ in range(3):
        np.testing.assert_array_equal(
            gemv(a, packed, scale, gs, bias, tiled=True).view(np.uint16), y.view(np.uint16)
        )


def test_gemv_tiled_rejects_untileable_shapes():
    rng = np.random.default_rng()
    a, packed, scale, gs, _ = random_problem(rng, 2, 40, 256, "bfloat16", with_bias=False)
    call = jax.ffi.ffi_call(GEMV, jax.ShapeDtypeStruct((2, 40), a.dtype))
    with pytest.raises(
        Exception,
        match="tiled layout needs block_size 16, N % 16 == 0 and K % 128 == 0, "
        "got block_size 16, N = 40",
    ):
        np.asarray(
            call(
                a,
                packed,
                scale,
                gs,
                jnp.zeros((0,), a.dtype),
                block_size=np.int64(16),
                **gemv_attributes(256, tiled=True),
            )
        )


# ---------------------------------------------------------------------------------------------
# Dequantize: any block size, any even K; fp32 product rounded once -> exact reference.


def reference_dequant(packed, scale, gs, block_size, dtype):
    """The exact product e2m1 * e4m3 * gs rounded once to the dtype, computed independently."""
    return reference.dequantize_as(packed, scale, gs, block_size, NP_DTYPES[dtype])


DEQUANT_CASES = [
    # (N, K, block_size)
    (7, 64, 16),
    (100, 4096, 16),
    (33, 96, 32),
    (5, 160, 16),
    (9, 40, 16),  # K % 32 != 0
    (3, 42, 7),
    (17, 30, 3),
    (4, 2, 1),
    (1, 14, 16),
    (65, 200, 48),
    (2, 512, 64),
    (11, 18, 5),
    (1000, 256, 16),
]
if QUICK:
    DEQUANT_CASES = [(7, 64, 16), (9, 40, 16), (3, 42, 7), (17, 30, 3), (1, 14, 16)]


def _same_bits(y, expected):
    y = np.asarray(y)
    nan_y, nan_e = np.isnan(y.astype(np.float32)), np.isnan(expected.astype(np.float32))
    assert np.array_equal(nan_y, nan_e), "NaN pattern differs"
    np.testing.assert_array_equal(
        np.where(nan_y, 0, y.view(np.uint16)), np.where(nan_e, 0, expected.view(np.uint16))
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, block_size", DEQUANT_CASES)
def test_dequant_matches_reference_bitwise(n, k, block_size, dtype):
    rng = np.random.default_rng()
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = random_scales(rng, n, math.ceil(k / block_size))
    gs = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-8, 2))
    w = dequant(packed, scale, gs, dtype, block_size)
    _same_bits(w, reference_dequant(packed, scale, gs, block_size, dtype))
    nan_expected = np.isnan(reference.dequantize(packed, scale, gs, block_size))
    assert np.array_equal(np.isnan(w.astype(np.float32)), nan_expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(16, 128), (48, 384), (32, 2816), (1008, 4096)])
def test_dequant_tiled_matches_reference_bitwise(n, k, dtype):
    """The dequant kernel on the tiled layout (jax_fp4.prepack's): the same bits as the reference
    (and so as the spec layout), NaN scale bytes included."""
    rng = np.random.default_rng()
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = random_scales(rng, n, k // 16)
    scale.flat[rng.integers(scale.size)] = 0x7F
    gs = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-8, 2))
    w = dequant(packed, scale, gs, dtype, 16, tiled=True)
    _same_bits(w, reference_dequant(packed, scale, gs, 16, dtype))
    assert np.isnan(w.astype(np.float32)).any()
    call = jax.ffi.ffi_call(DEQUANT, jax.ShapeDtypeStruct((8, k), jnp.dtype(dtype)))
    with pytest.raises(Exception, match="tiled layout needs block_size 16, N % 16 == 0"):
        np.asarray(call(packed[:8], scale[:8], gs, block_size=np.int64(16), tiled=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 3])
def test_dequant_every_scale_byte_and_code(dtype, block_size):
    """All 256 E4M3 bytes against all 16 codes (NaN bytes give NaN, subnormals exact)."""
    n = 256
    k = 16 * 16 if block_size == 16 else 48
    codes = np.tile(np.arange(16, dtype=np.uint8), (n, k // 16))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], math.ceil(k / block_size), axis=1)
    for gs in (np.float32(1.0), np.float32(0.37)):
        w = dequant(packed, scale, gs, dtype, block_size)
        _same_bits(w, reference_dequant(packed, scale, gs, block_size, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_nan_block_only(dtype):
    rng = np.random.default_rng()
    n, k, bs = 6, 64, 16
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = rng.integers(0x30, 0x40, size=(n, k // bs), dtype=np.uint8)
    scale[2, 1] = 0x7F
    w = dequant(packed, scale, np.float32(1.0), dtype, bs).astype(np.float32)
    expected = np.zeros((n, k), bool)
    expected[2, 16:32] = True
    assert np.array_equal(np.isnan(w), expected)


def test_dequant_deterministic_and_large():
    rng = np.random.default_rng()
    n, k = 3000, 4096
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = random_scales(rng, n, k // 16)
    gs = np.float32(0.011)
    first = dequant(packed, scale, gs, "bfloat16", 16)
    again = dequant(packed, scale, gs, "bfloat16", 16)
    np.testing.assert_array_equal(first.view(np.uint16), again.view(np.uint16))
    _same_bits(first, reference_dequant(packed, scale, gs, 16, "bfloat16"))
