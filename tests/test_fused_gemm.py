"""The fused sm_90 NVFP4 GEMM (FFI target jax_fp4_fused_cuda) called directly through
jax.ffi.ffi_call, against the independent float64 reference in tests/reference.py: its activation
tiles, weight tiles, split-K, warp-specialized and stream-K kernels, each forced through the
kernel's attributes (jax_fp4.KernelTuning), and a host model of its index algebra.

The kernel tests need a compute-capability-9.0 CUDA device (marked `gpu`; skipped otherwise); the
model tests run anywhere. The target comes from the package's CUDA module. Inputs are fresh random
draws on every run; outputs are poisoned with NaN before each call and every check rejects NaN
where none is expected, so an unwritten element fails.

JAX_FP4_GPU_TEST_QUICK=1 shrinks the sweep (used under compute-sanitizer).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import KernelTuning
from jax_fp4 import ffi as _ffi
from jax_fp4 import fused as _fused
from jax_fp4 import layout as _layout
from tests import reference
from tests._helpers import (
    CHAIN_DIMS,
    DTYPES,
    NP_DTYPES,
    SPECIAL_SCALES,
    chain_weights,
    check,
    fused_attributes,
    has_sm90,
    plain_and_programmatic,
    poison,
)

TARGET = "jax_fp4_fused_cuda"
QUICK = os.environ.get("JAX_FP4_GPU_TEST_QUICK", "") not in ("", "0")


HAS_SM90 = has_sm90()
HAS_TARGET = TARGET in _ffi.REGISTERED_TARGETS.get("CUDA", [])


def needs_sm90(fn):
    """GPU tests: an sm_90 device and the registered target."""
    fn = pytest.mark.skipif(
        HAS_SM90 and not HAS_TARGET, reason="jax_fp4_fused_cuda not registered (built without nvcc)"
    )(fn)
    fn = pytest.mark.skipif(not HAS_SM90, reason="needs a compute capability 9.0 CUDA device")(fn)
    return pytest.mark.gpu(fn)


EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def fused(
    a,
    packed,
    scale,
    gs,
    bias=None,
    *,
    block_size=16,
    tiled=False,
    silu_mul=False,
    residual=None,
    tuning=None,
    attributes=None,
):
    """The fused target on spec-layout packed / scale (tiled=True: handed the tiled layout), with
    the epilogue fusions silu_mul and residual ([M, N_out]), and the attributes of `tuning` (None:
    the heuristics), overridden by `attributes`."""
    a = jnp.asarray(a)
    m, k = a.shape
    n = packed.shape[0]
    n_out = n // 2 if silu_mul else n
    if bias is None:
        bias = jnp.zeros((0,), a.dtype)
    if tiled:
        packed, scale = _layout.tile_packed(packed), _layout.tile_scale(scale)
    ws = _fused.fused_workspace_elems(m, n, k)
    poison((m, n_out), a.dtype)
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((m, n_out), a.dtype), jax.ShapeDtypeStruct((ws,), jnp.float32)),
    )
    y, _ = call(
        _fused.to_fragment_order(a, tiled),
        jnp.asarray(packed),
        jnp.asarray(scale),
        jnp.asarray(gs, jnp.float32).reshape(1),
        jnp.asarray(bias),
        jnp.zeros((0,), a.dtype) if residual is None else jnp.asarray(residual, a.dtype),
        block_size=np.int64(block_size),
        tiled=bool(tiled),
        activation=np.int64(1 if silu_mul else 0),
        **{**fused_attributes(tuning), **(attributes or {})},
    )
    return np.asarray(y)


def call_as_given(a, packed, scale, gs, y_shape, *, tiled=False, activation=0):
    """The target on operands exactly as given (no layout or K-order conversion), y of y_shape,
    no bias or residual, the heuristics' attributes: for what its handler refuses."""
    call = jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct(y_shape, a.dtype), jax.ShapeDtypeStruct((0,), jnp.float32))
    )
    return np.asarray(
        call(
            a,
            packed,
            scale,
            jnp.asarray([gs]),
            jnp.zeros((0,), a.dtype),
            jnp.zeros((0,), a.dtype),
            block_size=np.int64(16),
            tiled=tiled,
            activation=np.int64(activation),
            **fused_attributes(),
        )[0]
    )


def random_weight(rng, n, k, special=False):
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = rng.integers(0x28, 0x48, size=(n, math.ceil(k / 16)), dtype=np.uint8)
    if special:
        mask = rng.random(scale.shape) < 0.2
        scale[mask] = rng.choice(SPECIAL_SCALES, size=int(mask.sum()))
    gs = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-8, 1))
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
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} elements off; first at "
        f"{np.argwhere(bad)[0]}: got {y64[tuple(np.argwhere(bad)[0])]}, "
        f"want {ref[tuple(np.argwhere(bad)[0])]}"
    )
    assert reference.relative_error(y64, ref) < {"float16": 2e-3, "bfloat16": 1e-2}[dtype]


# (M, N, K): ragged M and N, K from one stage to many (split-K across cluster CTAs).
SHAPES = [
    (1, 256, 128),
    (9, 300, 256),
    (17, 1000, 384),
    (16, 256, 8192),  # one tile, 64 stages: the largest split
    (64, 257, 512),
    (65, 512, 256),  # first M served by the 128-row tile
    (128, 384, 640),
    (200, 1030, 1024),
    (300, 96, 128),  # N below one tile
    (48, 4096, 11008),  # a real shape, several splits
    (256, 2048, 4096),
    (1000, 520, 1152),
]
QUICK_SHAPES = [(9, 300, 256), (70, 520, 384), (16, 256, 2048)]


@needs_sm90
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


@needs_sm90
@pytest.mark.parametrize("m, n, k", [(70, 300, 256), (16, 256, 384), (5, 1024, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_arithmetic_bit_for_bit(m, n, k, dtype):
    """Small integer activations, scales {2^-9, 2^-6, 0.5, 1, 2}, gs a power of two: every product
    and partial sum is exact in fp32, so y must equal the rounded float64 reference exactly (this
    also pins the E2M1 subnormal 0.5 and E4M3 subnormal scales)."""
    rng = np.random.default_rng()
    a, packed, scale, gs, bias, want = _exact_problem(rng, m, n, k, dtype)
    y = fused(a, packed, scale, gs, bias)
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))


def _exact_problem(rng, m, n, k, dtype):
    """Inputs of test_exact_arithmetic_bit_for_bit, and the rounded float64 result they must give."""
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = rng.choice(np.array([0x01, 0x08, 0x30, 0x38, 0x40], np.uint8), size=(n, k // 16))
    gs = np.float32(2.0 ** rng.integers(-3, 2))
    a = rng.integers(-2, 3, size=(m, k)).astype(NP_DTYPES[dtype])
    bias = rng.integers(-4, 5, size=n).astype(NP_DTYPES[dtype])
    want = reference.matmul(
        np.asarray(a, np.float64), packed, scale, gs, 16, np.asarray(bias, np.float64)
    ).astype(NP_DTYPES[dtype])
    return a, packed, scale, gs, bias, want


@needs_sm90
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


@needs_sm90
@pytest.mark.parametrize("m, n, k", [(48, 4096, 4096), (256, 1024, 2048), (16, 256, 8192)])
def test_bit_identical_reruns(m, n, k):
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, n, k)
    a = rng.standard_normal((m, k)).astype(NP_DTYPES["bfloat16"])
    y0 = fused(a, packed, scale, gs)
    for _ in range(3):
        np.testing.assert_array_equal(
            fused(a, packed, scale, gs).view(np.uint16), y0.view(np.uint16)
        )


@needs_sm90
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


@needs_sm90
@pytest.mark.parametrize("split", [1, 3, 8])
def test_forced_split_matches_reference(split):
    """KernelTuning(fused_split=...) forces the split-K factor: every forced split, clamped to the
    K stages, gives the reference result."""
    rng = np.random.default_rng()
    m, n, k = 24, 300, 1024
    packed, scale, gs = random_weight(rng, n, k)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    y = fused(a, packed, scale, gs, tuning=KernelTuning(fused_split=split))
    check_close(y, a, packed, scale, gs, None, "bfloat16")


@needs_sm90
@pytest.mark.parametrize("tile_m", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("m", [1, 16, 33, 70, 300])
def test_forced_tile_matches_reference(tile_m, m):
    """KernelTuning(fused_tile_m=...) forces the activation rows per CTA: each tile, with one and with
    several M tiles per weight tile (ragged last tile), and split-K, gives the reference result."""
    rng = np.random.default_rng()
    n, k = 520, 1024
    packed, scale, gs = random_weight(rng, n, k, special=True)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    y = fused(a, packed, scale, gs, bias, tuning=KernelTuning(fused_tile_m=tile_m))
    check_close(y, a, packed, scale, gs, bias, "bfloat16")


@needs_sm90
@pytest.mark.parametrize("tile_m", [64, 128, 256])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_warp_specialized_equals_multistage(tile_m, tiled, dtype):
    """From 64 activation rows per CTA two kernels serve (fused_warp_specialized): the
    warp-specialized one (a copying warpgroup, mbarrier stages) and the multistage one. Both
    match the reference on ragged M and N with cluster split-K, and each other bit for bit (the
    same wgmma sequence per CTA and the same reduction order)."""
    rng = np.random.default_rng()
    n, k = 528, 1152
    packed, scale, gs = random_weight(rng, n, k, special=True)
    bias = rng.standard_normal(n).astype(NP_DTYPES[dtype])
    for m, split in ((1, 1), (70, 3), (300, 0)):  # split 0: the heuristic's
        a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
        ys = {}
        for ws in (True, False):
            # both kernels: cluster split-K
            tuning = KernelTuning(
                fused_tile_m=tile_m,
                fused_stream_k=False,
                fused_split=split,
                fused_warp_specialized=ws,
            )
            ys[ws] = fused(a, packed, scale, gs, bias, tiled=tiled, tuning=tuning)
        check_close(ys[True], a, packed, scale, gs, bias, dtype)
        np.testing.assert_array_equal(ys[True].view(np.uint16), ys[False].view(np.uint16))


def _fusion_reference(a, packed, scale, gs, bias, silu_mul, residual):
    """silu(gate + bias) * (up + bias) (silu_mul) + residual of the float64 product: the epilogue
    fusions in float64, no rounding before the last."""
    y = reference.matmul(a, packed, scale, gs, 16, bias)
    if silu_mul:
        gate, up = y[:, : y.shape[1] // 2], y[:, y.shape[1] // 2 :]
        y = gate / (1.0 + np.exp(-gate)) * up
    return y if residual is None else y + np.asarray(residual, np.float64)


# (tile_m, warp-specialized, split (0: the heuristic's), M): every kernel and tile that runs the
# epilogue fusions, ragged M, cluster split-K.
FUSION_TILES = [(16, False, 0, 9), (32, False, 3, 27), (64, True, 2, 50), (64, False, 0, 64)]
FUSION_TILES_ALL = FUSION_TILES + [(128, True, 3, 100), (256, True, 2, 300), (256, False, 1, 260)]


@needs_sm90
@pytest.mark.parametrize("tile_m, ws, split, m", FUSION_TILES if QUICK else FUSION_TILES_ALL)
@pytest.mark.parametrize("tiled", [False, True], ids=["spec", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_fusions_match_reference(tile_m, ws, split, m, tiled, dtype):
    """silu_mul (gate rows [0, N/2), up rows [N/2, N)) and the residual in the fused GEMM's
    epilogue, with bias, against the float64 composition: gate/up halves of fewer rows than half
    a CTA tile and of several tiles with a ragged last one, each alone and together."""
    rng = np.random.default_rng()
    k = 1152
    for half in (40, 304) if not tiled else (48, 304):  # the tiled layout: N / 2 % 16 == 0
        n = 2 * half
        packed, scale, _ = random_weight(rng, n, k, special=True)
        gs = np.float32(2.0 ** rng.integers(-6, -3))  # silu(gate) * up stays inside fp16
        a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
        bias = rng.standard_normal(n).astype(NP_DTYPES[dtype])
        tuning = KernelTuning(
            fused_tile_m=tile_m, fused_warp_specialized=ws, fused_split=split, fused_stream_k=False
        )
        for silu_mul, with_residual in ((True, False), (False, True), (True, True)):
            n_out = half if silu_mul else n
            residual = (
                rng.standard_normal((m, n_out)).astype(NP_DTYPES[dtype]) if with_residual else None
            )
            y = fused(
                a,
                packed,
                scale,
                gs,
                bias,
                tiled=tiled,
                silu_mul=silu_mul,
                residual=residual,
                tuning=tuning,
            )
            check(y, _fusion_reference(a, packed, scale, gs, bias, silu_mul, residual), dtype)


@needs_sm90
@pytest.mark.parametrize("tiled", [False, True], ids=["spec", "tiled"])
def test_epilogue_fusions_rerun_bit_identical_and_agree_across_kernels(tiled):
    """The fused epilogue on a gate/up weight of Llama-3-8B's shape at a serving batch: reruns
    give the same bits, and the multistage and warp-specialized kernels (the 64-row tile) the
    same bits as each other."""
    rng = np.random.default_rng()
    m, n, k = 40, 2 * 1536, 4096
    packed, scale, _ = random_weight(rng, n, k)
    gs = np.float32(2.0**-7)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    residual = rng.standard_normal((m, n // 2)).astype(ml_dtypes.bfloat16)
    args = dict(tiled=tiled, silu_mul=True, residual=residual)
    first = fused(a, packed, scale, gs, **args)
    check(first, _fusion_reference(a, packed, scale, gs, None, True, residual), "bfloat16")
    for _ in range(2):
        again = fused(a, packed, scale, gs, **args)
        np.testing.assert_array_equal(again.view(np.uint16), first.view(np.uint16))
    kernels = [
        fused(a, packed, scale, gs, **args, tuning=KernelTuning(fused_warp_specialized=ws))
        for ws in (True, False)
    ]
    np.testing.assert_array_equal(kernels[0].view(np.uint16), kernels[1].view(np.uint16))


@needs_sm90
def test_epilogue_fusions_are_checked():
    """A silu_mul call whose y is not [M, N / 2], a residual of the wrong shape, an odd gate/up
    split on the tiled layout, and stream-K forced with a fusion are refused."""
    rng = np.random.default_rng()
    m, k = 8, 256
    packed, scale, gs = random_weight(rng, 96, k)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    with pytest.raises(Exception, match="residual must be"):
        fused(a, packed, scale, gs, residual=np.zeros((m, 95), ml_dtypes.bfloat16))
    assert fused(a, packed, scale, gs, tiled=True, silu_mul=True).shape == (m, 48)
    with pytest.raises(Exception, match="needs N / 2 % 16 == 0"):
        fused(a, *random_weight(rng, 80, k)[:2], gs, tiled=True, silu_mul=True)  # N / 2 = 40
    with pytest.raises(Exception, match="no epilogue fusion"):
        fused(
            rng.standard_normal((300, k)).astype(ml_dtypes.bfloat16),
            packed,
            scale,
            gs,
            silu_mul=True,
            tuning=KernelTuning(fused_tile_m=256, fused_stream_k=True),
        )
    with pytest.raises(Exception, match="activation silu_mul needs an even N and y"):
        call_as_given(_fused.to_fragment_order(a), packed, scale, gs, (m, 96), activation=1)


@needs_sm90
@pytest.mark.parametrize("warp_specialized", [True, False])
@pytest.mark.parametrize("tiled", [False, True])
def test_tile_n_128_equals_default_tile(warp_specialized, tiled):
    """fused_tile_n=128: 128 weight rows per CTA at the 128-row activation tile (twice the
    CTAs of the default 256). Each output is the same wgmma sequence and, at a forced split, the
    same reduction: equal to the reference and bit-identical to the default tile."""
    rng = np.random.default_rng()
    n, k = 528, 1152  # ragged against both tiles; N % 16 == 0 for the tiled layout
    packed, scale, gs = random_weight(rng, n, k, special=True)
    bias = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    for m, split in ((70, 1), (200, 3)):
        a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        tuning = KernelTuning(
            fused_tile_m=128,
            fused_warp_specialized=warp_specialized,
            fused_split=split,
            fused_tile_n=128,
        )
        y = fused(a, packed, scale, gs, bias, tiled=tiled, tuning=tuning)
        tuning = dataclasses.replace(tuning, fused_tile_n=256)
        y_default = fused(a, packed, scale, gs, bias, tiled=tiled, tuning=tuning)
        check_close(y, a, packed, scale, gs, bias, "bfloat16")
        np.testing.assert_array_equal(y.view(np.uint16), y_default.view(np.uint16))


# Stream-K (fused_stream_k=True): (M, N, K, activation tile, weight tile) where the CTAs'
# runs are single K stages of tiles split 9 ways, mixes of whole and partial tiles (136 tiles of 2
# stages over at most 132 CTAs: runs of 3 stages store a whole tile mid-run, from registers: paired
# 4-byte stores with one 64-row weight tile per warpgroup, 2-byte ones with two), the same with
# N % 4 != 0 (2-byte stores; spec layout only, the tiled one needs N % 16 == 0), and runs crossing
# several tiles.
STREAM_K_CASES = [
    (70, 528, 1152, 128, 256),
    (200, 528, 1152, 128, 128),
    (300, 528, 1152, 256, 128),
    (1000, 4240, 256, 256, 128),
    (1000, 4240, 256, 128, 256),
    (1000, 4234, 256, 256, 128),
    (129, 8208, 384, 128, 256),
    (65, 144, 11008, 64, 256),
]


@needs_sm90
@pytest.mark.parametrize(
    "m, n, k, tile_m, tile_n, tiled",
    [
        (*case, tiled)
        for case in STREAM_K_CASES
        for tiled in (False, True)
        if not (tiled and case[1] % 16)
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stream_k_matches_reference(m, n, k, tile_m, tile_n, tiled, dtype):
    """Stream-K splits the tiles' K stages evenly over one CTA per SM; partial tiles meet in the
    workspace, where each tile's owner (the run holding its K stage 0) adds them to its own in CTA
    order. Equal to the reference on ragged M and N (bias, fp16 and bf16, both layouts), and
    bit-identical from run to run although the order in which CTAs arrive is not."""
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, n, k, special=True)
    bias = rng.standard_normal(n).astype(NP_DTYPES[dtype])
    a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    tuning = KernelTuning(
        fused_tile_m=tile_m,
        fused_warp_specialized=True,
        fused_stream_k=True,
        fused_tile_n=tile_n if tile_m == 128 else 0,
    )
    y = fused(a, packed, scale, gs, bias, tiled=tiled, tuning=tuning)
    check_close(y, a, packed, scale, gs, bias, dtype)
    again = fused(a, packed, scale, gs, bias, tiled=tiled, tuning=tuning)
    np.testing.assert_array_equal(y.view(np.uint16), again.view(np.uint16))
    tuning = dataclasses.replace(tuning, fused_stream_k=False)  # cluster split-K, same problem
    y = fused(a, packed, scale, gs, bias, tiled=tiled, tuning=tuning)
    check_close(y, a, packed, scale, gs, bias, dtype)


@needs_sm90
def test_stream_k_needs_its_workspace_and_kernel():
    """fused_stream_k=True where stream-K cannot run is an error, not a silent fallback."""
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, 256, 256)
    for m, more in ((40, {}), (100, {"fused_split": 2}), (100, {"fused_warp_specialized": False})):
        a = rng.standard_normal((m, 256)).astype(np.float16)
        with pytest.raises(Exception, match=r"(?i)stream_k\W*(=\W*)?(1|true)\W* needs"):
            fused(a, packed, scale, gs, tuning=KernelTuning(fused_stream_k=True, **more))


@needs_sm90
def test_warp_specialized_needs_the_64_row_tile():
    """The 16- and 32-row tiles have the multistage kernel only: asking for the other is an error."""
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, 256, 256)
    tuning = KernelTuning(fused_warp_specialized=True)
    for m in (16, 20):  # the 16- and 32-row tiles
        a = rng.standard_normal((m, 256)).astype(np.float16)
        with pytest.raises(
            Exception, match=r"(?i)warp_specialized\W*(=\W*)?(1|true)\W* needs 64-row"
        ):
            fused(a, packed, scale, gs, tuning=tuning)
    a = rng.standard_normal((40, 256)).astype(np.float16)  # the 64-row tile serves it
    check_close(fused(a, packed, scale, gs, tuning=tuning), a, packed, scale, gs, None, "float16")


@needs_sm90
def test_tile_n_128_needs_the_128_row_tile():
    """A weight tile forced at an activation tile other than 128 rows is an error from the kernel
    call, directly and through jax_fp4.matmul (KernelTuning validates each field alone; the
    combination is the kernel's to check)."""
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, 256, 256)
    for m, tile_n in ((40, 128), (300, 256)):  # 64- and 256-row activation tiles
        a = rng.standard_normal((m, 256)).astype(np.float16)
        message = rf"(?i)tile_n\W*(=\W*)?{tile_n}\W* needs 128-row activation tiles"
        with pytest.raises(Exception, match=message):
            fused(a, packed, scale, gs, tuning=KernelTuning(fused_tile_n=tile_n))
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    a = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    tuning = KernelTuning(fused_tile_m=64, fused_tile_n=128)
    with pytest.raises(
        Exception, match=r"(?i)tile_n\W*(=\W*)?128\W* needs 128-row activation tiles"
    ):
        jax.block_until_ready(
            jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="fused", tuning=tuning))(a, w)
        )


# Values outside each field's set: KernelTuning rejects them where it is built
# (tests/test_matmul.py); the handler checks the attributes it is handed too.
BAD_ATTRIBUTES = [
    *[("split", np.int64(v)) for v in (9, -1)],
    *[("tile_m", np.int64(v)) for v in (8, 48, 512)],
    *[("tile_n", np.int64(v)) for v in (64, 512)],
    *[("warp_specialized", np.int64(v)) for v in (2, -2)],
    *[("stream_k", np.int64(v)) for v in (2, -2)],
]


@needs_sm90
@pytest.mark.parametrize("attribute, value", BAD_ATTRIBUTES)
def test_malformed_attribute_is_an_error(attribute, value):
    """An attribute outside its set is an error from the kernel call naming the attribute and the
    value."""
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, 64, 256)
    a = rng.standard_normal((8, 256)).astype(np.float16)
    with pytest.raises(Exception, match=rf"{attribute}\b.*{int(value)}"):
        fused(a, packed, scale, gs, attributes={attribute: value})


@needs_sm90
@pytest.mark.parametrize("m", [32, 80, 300])
@pytest.mark.parametrize("tiled", [False, True], ids=["spec", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_programmatic_launch_chain(m, tiled, dtype):
    """KernelTuning(programmatic_launch=True): each fused GEMM of a jitted chain, whose activations are the previous one's
    output, may be scheduled while that one still runs and must wait for it (multistage,
    warp-specialized with cluster split-K, stream-K: whatever the defaults pick at these M). The
    chain (tests/_helpers.py's matmul_chain) starts with a large layer. Same bits as plain launches; every layer within the
    element-wise bound of the float64 reference on the input it was given."""
    rng = np.random.default_rng()
    weights = chain_weights(lambda n, k: random_weight(rng, n, k))
    a = rng.standard_normal((m, CHAIN_DIMS[0])).astype(NP_DTYPES[dtype])
    plain, programmatic = plain_and_programmatic(a, weights, backend="fused", tiled=tiled)
    x = a
    for i, ((packed, scale, gs), y, y_pdl) in enumerate(zip(weights, plain, programmatic)):
        np.testing.assert_array_equal(
            y_pdl.view(np.uint16), y.view(np.uint16), err_msg=f"layer {i}"
        )
        check_close(y, x, packed, scale, gs, None, dtype)
        x = y


# Weights in the tiled layout (jax_fp4.prepack): N % 16 == 0, ragged against the 128 / 256-row
# CTA tiles; every activation tile and several splits.
TILED_SHAPES = [
    (1, 16, 128),
    (9, 304, 256),
    (17, 1008, 384),
    (16, 256, 8192),
    (64, 272, 512),
    (65, 512, 256),
    (200, 1040, 1024),
    (300, 96, 128),
    (48, 4096, 11008),
    (1000, 528, 1152),
]
QUICK_TILED_SHAPES = [(9, 304, 256), (70, 528, 384), (16, 256, 2048)]


@needs_sm90
@pytest.mark.parametrize("m, n, k", QUICK_TILED_SHAPES if QUICK else TILED_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_random_sweep(m, n, k, dtype):
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, n, k, special=True)
    a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    bias = rng.standard_normal(n).astype(NP_DTYPES[dtype]) if m % 2 else None
    y = fused(a, packed, scale, gs, bias, tiled=True)
    check_close(y, a, packed, scale, gs, bias, dtype)


@needs_sm90
@pytest.mark.parametrize(
    "m, n, k", [(70, 304, 256), (16, 256, 384), (5, 1024, 256), (300, 528, 1152)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_exact_arithmetic_bit_for_bit(m, n, k, dtype):
    rng = np.random.default_rng()
    a, packed, scale, gs, bias, want = _exact_problem(rng, m, n, k, dtype)
    for _ in range(2):  # and bit-identical on a rerun
        y = fused(a, packed, scale, gs, bias, tiled=True)
        np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))


@needs_sm90
@pytest.mark.parametrize("tile_m, split", [(16, 1), (32, 3), (64, 8), (128, 0), (256, 2)])
def test_tiled_forced_tiles_and_splits(tile_m, split):
    rng = np.random.default_rng()
    n, k = 528, 1024
    packed, scale, gs = random_weight(rng, n, k, special=True)
    bias = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    tuning = KernelTuning(fused_tile_m=tile_m, fused_split=split)
    for m in (1, 33, 300):
        a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        check_close(
            fused(a, packed, scale, gs, bias, tiled=True, tuning=tuning),
            a,
            packed,
            scale,
            gs,
            bias,
            "bfloat16",
        )


@needs_sm90
def test_tiled_rejects_ragged_n():
    rng = np.random.default_rng()
    packed, scale, gs = random_weight(rng, 40, 256)
    a = rng.standard_normal((8, 256)).astype(np.float16)
    with pytest.raises(
        Exception,
        match="tiled layout needs block_size 16, N % 16 == 0 and K % 128 == 0, "
        "got block_size 16, N = 40",
    ):
        call_as_given(a, packed, scale, gs, (8, 40), tiled=True)


def test_tiled_fragment_order_is_the_spec_order_with_o_and_j0_swapped():
    """The activation order for tiled weights: physical p = 16 t + 8 sb + 4 j0 + 2 j1 + o at
    logical k_log = 32 sb + 16 j1 + 8 j0 + 2 t + o, per 64-element block."""
    k = 128
    a = np.arange(k)[None, :]
    got = _fused.to_fragment_order(a, tiled=True)[0]
    for k_log in range(k):
        b, r = divmod(k_log, 64)
        sb, j1, j0, t, o = r >> 5, (r >> 4) & 1, (r >> 3) & 1, (r >> 1) & 3, r & 1
        assert got[k_log] == 64 * b + 16 * t + 8 * sb + 4 * j0 + 2 * j1 + o


def _stream_k_runs(units: int, ctas: int, ks: int) -> list[list[tuple[int, int, int]]]:
    """A model of StreamKPlan (ffi/cuda/fused/scheduler.cuh): each CTA's run as (tile, first K stage,
    stages) segments, from the kernel's Begin and CtaOf formulas (CtaOf checked against Begin)."""
    begin = lambda c: c * units // ctas  # noqa: E731
    cta_of = lambda u: ((u + 1) * ctas + units - 1) // units - 1  # noqa: E731
    runs = []
    for c in range(ctas):
        run, u = [], begin(c)
        while u < begin(c + 1):
            assert cta_of(u) == c
            tile, kc = divmod(u, ks)
            nst = min(begin(c + 1) - u, ks - kc)
            run.append((tile, kc, nst))
            u += nst
        runs.append(run)
    return runs


@pytest.mark.parametrize(
    "tiles, ks, ctas",
    [
        (43, 32, 132),
        (16, 86, 132),
        (86, 32, 132),
        (68, 40, 132),
        (5, 9, 45),
        (136, 2, 132),
        (224, 64, 132),
        (1, 3, 3),
        (7, 1, 7),
        (200, 7, 131),
    ],
)
def test_stream_k_plan_lets_owners_reduce(tiles, ks, ctas):
    """What the owner-reduced fixup relies on, on the kernel's plan: a split tile's contributors are
    consecutive CTAs; its owner (the CTA holding K stage 0) reaches it in its run's last segment and
    is the only one that waits, on higher-numbered CTAs only; every other contributor reaches it in
    its run's first segment, so it hands on at most one partial (one workspace slot per CTA)."""
    runs = _stream_k_runs(tiles * ks, ctas, ks)
    contributors: dict[int, list[int]] = {}
    for c, run in enumerate(runs):
        for tile, _, _ in run:
            contributors.setdefault(tile, []).append(c)
    assert sorted(contributors) == list(range(tiles))
    handed_on = [0] * ctas
    for tile, cs in contributors.items():
        assert cs == list(
            range(cs[0], cs[-1] + 1)
        )  # consecutive: AddPartials reads slots first + 1 ..
        segments = {c: next(seg for seg in runs[c] if seg[0] == tile) for c in cs}
        assert sum(seg[2] for seg in segments.values()) == ks
        owner = cs[0]
        assert segments[owner][1] == 0  # the owner holds K stage 0 ...
        if len(cs) > 1:
            assert runs[owner][-1][0] == tile  # ... in its run's last segment
            for c in cs[1:]:
                assert c > owner and runs[c][0][0] == tile and segments[c][1] > 0
                handed_on[c] += 1
    assert max(handed_on) <= 1


def test_static_rules():
    # Stream-K from M = 65: a partial tile of 128 x 256 per CTA (132 at most) + 1 counter per
    # 128 x 128 tile; none up to M = 64.
    assert _fused.fused_workspace_elems(64, 28672, 8192) == 0
    assert _fused.fused_workspace_elems(128, 11008, 4096) == 132 * 32768 + 86
    assert _fused.fused_workspace_elems(4096, 28672, 8192) == 132 * 32768 + 32 * 224
    assert _fused.fused_workspace_elems(70, 528, 128) == 5 * 32768 + 5  # 5 tiles x 1 stage
    assert _fused.fused_supported(16, 11008, 4096, 16, np.float16) is None
    assert _fused.fused_supported(16, 11008, 4096, 16, ml_dtypes.bfloat16) is None
    assert "multiple of 128" in _fused.fused_supported(16, 11008, 4160, 16, np.float16)
    assert "block_size" in _fused.fused_supported(16, 11008, 4096, 32, np.float16)
    assert "float16" in _fused.fused_supported(16, 11008, 4096, 16, np.float32)


# ---------------------------------------------------------------------------------------------
# A bit-level model of the fused kernels' index algebra (runs on any machine; FusedGemmKernel and
# FusedGemmWsKernel share it, up to how many threads issue the copies). It mirrors the
# kernel's fragment K order of the activations, its cp.async placements and swizzles, each lane's
# scale byte and word loads + split-pair E2M1 decode into the wgmma register-A fragment, the wgmma
# semantics (A fragment layout per warp, B read through the K-major 128-byte-swizzle descriptor:
# 8-row groups 1024 B apart, +32 B per k16 step), the accumulator layout, the epilogue staging and
# the rank-ordered split-K reduction. Keep it in sync with ffi/cuda/fused/ when either
# changes.


def _default_tile_n(bm):
    """DefaultTileN(BM): weight rows per CTA (256 up to BM = 128, 128 at BM = 256)."""
    return 128 if bm == 256 else 256


class _Half:
    """HalfTraits<T> of jax_fp4/nvfp4_cuda.cuh."""

    def __init__(self, dtype):
        self.dt = NP_DTYPES[dtype]
        self.mul = 2.0**7 if dtype == "float16" else 2.0**119

    def halves(self, bits):
        return np.array([bits & 0xFFFF, bits >> 16], np.uint16).view(self.dt).astype(np.float64)

    def pair(self, lo, hi):
        v = np.array([lo, hi], np.float64).astype(self.dt).view(np.uint16).astype(np.uint32)
        return int(v[0]) | (int(v[1]) << 16)

    def pair_mul(self, x, y):
        p = self.halves(x) * self.halves(y)
        assert np.array_equal(p.astype(self.dt).astype(np.float64), p), "folded scale not exact"
        return self.pair(p[0], p[1])

    def decode_split(self, q, j):  # decode_e2m1_split_pair<T, j>(q): nibbles j and j + 4
        x, p = (q >> 8 if j >= 2 else q), 4 * (j & 1)
        if self.dt == np.float16:
            em, sign = x & (0x00070007 << p), x & (0x00080008 << p)
            return (em * (1 << (9 - p)) + sign * (1 << (12 - p))) & 0xFFFFFFFF
        nibbles = x & (0x000F000F << p)
        return (nibbles * ((1 << (6 - p)) + (1 << (12 - p)))) & 0x81C081C0

    def decode_tiled(self, q, p):  # decode_tiled_pair<T, p>(q): elements 2p, 2p + 1
        x = [
            q,
            ((q >> 3) | (q << 29)) & 0xFFFFFFFF,
            ((q >> 6) | (q << 26)) & 0xFFFFFFFF,
            ((q & 0x001B001B) * 0x1084) & 0xFFFFFFFF,
        ][p]
        if self.dt == np.float16:
            return (((x & 0x01C001C0) << 3) | (x & 0x80008000)) & 0xFFFFFFFF
        return x & 0x81C081C0


def _model_fused(
    a, packed, scale, gs, dtype, bm, splits, tiled=False, loaders=256, tile_n=None, silu_mul=False
):
    """y[M, N] as FusedGemmKernel<T, FusedConfig<bm, tile_n>, tiled> computes it with `splits`
    K-splits (fp32 sums in float64); packed and scale are given in the spec layout (tiled:
    converted here). `loaders`: how many threads issue a stage's copies (StageLoader's kLoaders:
    256 in the multistage kernel, the 128 of the warp-specialized kernel's copier); `tile_n`:
    weight rows per CTA (default DefaultTileN(bm)); `silu_mul`: the epilogue fusion (y [M, N / 2],
    each CTA's second half of rows the up rows of its first half's gate rows: ColumnsOf)."""
    h16 = _Half(dtype)
    m, k = a.shape
    n = packed.shape[0]
    ks = k // 128
    a = _fused.to_fragment_order(a, tiled)  # what the caller hands the kernel
    if tiled:
        flat_packed = np.asarray(_layout.tile_packed(packed)).reshape(-1)
        flat_scale = np.asarray(_layout.tile_scale(scale)).reshape(-1)
    tile_n = tile_n or _default_tile_n(bm)
    tj = tile_n // 128  # m64 weight tiles per warpgroup
    epi_stride = tile_n + 4
    col_threads = tile_n // (8 if silu_mul else 4)  # epilogue threads per staged row
    n_out = n // 2 if silu_mul else n
    cta_cols = tile_n // 2 if silu_mul else tile_n  # outputs per CTA
    up_shift = n // 2 - tile_n // 2 if silu_mul else 0
    y = np.full((m, n_out), np.nan)
    for n0 in range(0, n_out, cta_cols):
        halves = (n0, n0 + tile_n // 2 + up_shift)  # each half's first weight row
        for m0 in range(0, m, bm):
            staged = []
            for z in range(splits):
                acc = np.zeros((tile_n, bm))  # D[weight row][activation row]
                for c in range(z * ks // splits, (z + 1) * ks // splits):
                    act = np.zeros(2 * bm * 128, np.uint8)  # two [bm][64] SW128 tiles
                    act_rows = loaders // 16  # rows per pass
                    for tid in range(loaders):
                        ch, r0 = tid & 15, tid >> 4
                        dst0 = (ch >> 3) * bm * 128 + r0 * 128 + (((ch & 7) ^ (r0 & 7)) << 4)
                        for i in range(bm // act_rows):
                            row = m0 + r0 + act_rows * i
                            dst = dst0 + act_rows * 128 * i
                            if row < m:
                                act[dst : dst + 16] = a[
                                    row, 128 * c + 8 * ch : 128 * c + 8 * ch + 8
                                ].view(np.uint8)
                    pk = np.zeros(tile_n * 64, np.uint8)
                    pk_rows = loaders // 4  # rows per pass
                    half_passes = tile_n // pk_rows // 2
                    for tid in range(loaders):
                        q, r0 = tid & 3, tid >> 2
                        dst0 = r0 * 64 + ((q ^ (((r0 >> 1) & 1) << 1)) << 4)
                        for i in range(tile_n // pk_rows):
                            half, ih = divmod(i, half_passes)
                            row = min(halves[half] + r0 + pk_rows * ih, n - 1)
                            if tiled:  # the row's quarter q of window c in its tile's 1 KB run
                                src = (
                                    ((row // 16) * ks * 2 + (row // 8) % 2) * 512
                                    + ((row % 8) * 4 + q) * 16
                                    + 1024 * c
                                )
                                chunk = flat_packed[src : src + 16]
                            else:
                                chunk = packed[row, 64 * c + 16 * q : 64 * c + 16 * q + 16]
                            pk[dst0 + pk_rows * 64 * i : dst0 + pk_rows * 64 * i + 16] = chunk
                    sc = np.zeros(
                        tile_n * 8, np.uint8
                    )  # raw bytes; 8 of row r from thread r % loaders
                    for r in (
                        tid + loaders * i
                        for tid in range(loaders)
                        for i in range(-(-tile_n // loaders))
                    ):
                        if r >= tile_n:
                            continue
                        half, rh = divmod(r, tile_n // 2)
                        row = min(halves[half] + rh, n - 1)
                        if tiled:  # bytes 8 (r % 16).. of the row's tile's 128-byte run
                            src = (row // 16) * ks * 128 + (r % 16) * 8 + 128 * c
                            sc[8 * r : 8 * r + 8] = flat_scale[src : src + 8]
                        else:
                            sc[8 * r : 8 * r + 8] = scale[row, 8 * c : 8 * c + 8]
                    pk32 = pk.view(np.uint32)
                    for h in range(2):
                        b_mat = np.zeros((64, bm))  # B[k][act row] read through the descriptor
                        for s in range(4):
                            for col in range(bm):
                                for kk in range(16):
                                    logical = (col // 8) * 1024 + (col % 8) * 128 + 32 * s + 2 * kk
                                    phys = h * bm * 128 + (logical ^ (((logical >> 7) & 7) << 4))
                                    b_mat[16 * s + kk, col] = act[phys : phys + 2].view(
                                        NP_DTYPES[dtype]
                                    )[0]
                        for wg in range(2):
                            for j in range(tj):
                                a_mat = np.full((64, 64), np.nan)  # A[row of the m64 tile][k]
                                for wq in range(4):
                                    for lane in range(32):
                                        g, t = lane >> 2, lane & 3
                                        r_lo = wg * 64 * tj + 64 * j + wq * 16 + g
                                        for r, row in enumerate((r_lo, r_lo + 8)):
                                            quarter = (2 * h + (t >> 1)) ^ (((g >> 1) & 1) << 1)
                                            w = (row * 64 + (quarter << 4) + 8 * (t & 1)) // 4
                                            if tiled:
                                                byte = (
                                                    (r_lo // 16) * 128
                                                    + (4 * g + 2 * h + (t >> 1)) * 4
                                                    + (t & 1)
                                                    + 2 * r
                                                )
                                            else:
                                                byte = row * 8 + 4 * h + t
                                            v = reference.e4m3_decode(sc[byte]) * h16.mul
                                            sp = h16.pair(v, v)  # e4m3x2_scale_pairs<T>
                                            for sb in range(2):
                                                q = int(pk32[w + sb])
                                                for jj in range(4):
                                                    s_, off = 2 * sb + (jj >> 1), 8 * (jj & 1)
                                                    bits = (
                                                        h16.decode_tiled(
                                                            q, (jj >> 1) + 2 * (jj & 1)
                                                        )
                                                        if tiled
                                                        else h16.decode_split(q, jj)
                                                    )
                                                    pair = h16.halves(h16.pair_mul(bits, sp))
                                                    col = 16 * s_ + off + 2 * t
                                                    a_mat[16 * wq + g + 8 * r, col : col + 2] = pair
                                base = wg * 64 * tj + 64 * j
                                acc[base : base + 64] += a_mat @ b_mat
                epi = np.full(bm * epi_stride, np.nan)
                for wg in range(2):
                    for wq in range(4):
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for j in range(tj):
                                nl = wg * 64 * tj + 64 * j + wq * 16 + g
                                for b in range(bm // 8):
                                    ml = 8 * b + 2 * t
                                    epi[ml * epi_stride + nl] = acc[nl, ml]
                                    epi[(ml + 1) * epi_stride + nl] = acc[nl, ml + 1]
                                    epi[ml * epi_stride + nl + 8] = acc[nl + 8, ml]
                                    epi[(ml + 1) * epi_stride + nl + 8] = acc[nl + 8, ml + 1]
                staged.append(epi)
            for rank in range(splits):
                for tid in range(256):
                    c4, ml = tid % col_threads, rank + splits * (tid // col_threads)
                    nn = n0 + 4 * c4
                    while ml < bm and m0 + ml < m and nn < n_out:

                        def staged_sum(col, ml=ml):
                            return sum(
                                e[ml * epi_stride + col : ml * epi_stride + col + 4] for e in staged
                            )

                        total = staged_sum(4 * c4) * 128.0 * gs
                        if silu_mul:
                            up = staged_sum(4 * c4 + tile_n // 2) * 128.0 * gs
                            total = total / (1.0 + np.exp(-total)) * up
                        for e in range(min(4, n_out - nn)):
                            y[m0 + ml, nn + e] = total[e]
                        ml += splits * (256 // col_threads)
    return y


@pytest.mark.parametrize(
    "m, n, k, dtype, bm, splits, tiled, loaders, tile_n",
    [
        (5, 300, 256, "float16", 64, 1, False, 256, None),
        (13, 270, 256, "bfloat16", 16, 2, False, 256, None),
        (40, 260, 256, "float16", 32, 1, False, 256, None),
        (70, 260, 384, "bfloat16", 128, 3, False, 256, None),
        (300, 140, 256, "float16", 256, 2, False, 256, None),
        (5, 304, 256, "float16", 64, 1, True, 256, None),
        (13, 272, 256, "bfloat16", 16, 2, True, 256, None),
        (70, 272, 384, "bfloat16", 128, 3, True, 256, None),
        (300, 144, 256, "float16", 256, 2, True, 256, None),
        # the warp-specialized kernel's 128-thread copier (tiles of 64 rows and more)
        (5, 300, 256, "float16", 64, 1, False, 128, None),
        (70, 272, 384, "bfloat16", 128, 3, True, 128, None),
        (300, 140, 256, "float16", 256, 2, False, 128, None),
        (270, 144, 256, "bfloat16", 256, 1, True, 128, None),
        # 128 weight rows per CTA at the 128-row tile (fused_tile_n=128)
        (70, 272, 384, "bfloat16", 128, 3, True, 128, 128),
        (130, 300, 256, "float16", 128, 2, False, 256, 128),
    ],
)
def test_layout_model_matches_reference(m, n, k, dtype, bm, splits, tiled, loaders, tile_n):
    rng = np.random.default_rng()
    packed, scale, _ = random_weight(rng, n, k, special=True)
    gs = np.float32(0.5)
    a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    y = _model_fused(a, packed, scale, gs, dtype, bm, splits, tiled, loaders, tile_n)
    ref = reference.matmul(np.asarray(a, np.float64), packed, scale, gs, 16)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize(
    "m, n, k, dtype, bm, splits, tiled, loaders, tile_n",
    [
        # gate/up parts of fewer rows than half a CTA tile (I = 40 < 128), and of several tiles
        # with a ragged last one (I = 300: 2 CTAs of 128 outputs + 44)
        (5, 80, 256, "float16", 16, 1, False, 256, None),
        (13, 600, 256, "bfloat16", 32, 2, False, 256, None),
        (40, 600, 256, "float16", 64, 1, False, 128, None),
        (13, 288, 256, "bfloat16", 16, 2, True, 256, None),  # I = 144: 128 + one 16-row tile
        (70, 288, 384, "bfloat16", 128, 3, True, 128, None),
        (70, 288, 256, "float16", 128, 1, True, 128, 128),
        (300, 160, 256, "float16", 256, 2, False, 128, None),
    ],
)
def test_layout_model_with_silu_mul_matches_reference(
    m, n, k, dtype, bm, splits, tiled, loaders, tile_n
):
    """The epilogue fusion silu_mul in the host model: each CTA loads TN / 2 gate rows and their
    up rows N / 2 further (StageLoader's two halves), and its epilogue pairs staged column c with
    c + TN / 2; against silu(gate) * up of the float64 reference."""
    rng = np.random.default_rng()
    packed, scale, _ = random_weight(rng, n, k, special=True)
    gs = np.float32(0.5)
    a = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    y = _model_fused(a, packed, scale, gs, dtype, bm, splits, tiled, loaders, tile_n, silu_mul=True)
    full = reference.matmul(np.asarray(a, np.float64), packed, scale, gs, 16)
    gate, up = full[:, : n // 2], full[:, n // 2 :]
    ref = gate / (1.0 + np.exp(-gate)) * up
    assert y.shape == ref.shape and np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
