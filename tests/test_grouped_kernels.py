"""The grouped (mixture-of-experts) CUDA kernels called directly through jax.ffi.ffi_call: the
decode GEMV (jax_fp4_grouped_gemv_cuda, sm_80+) and the fused GEMM (jax_fp4_grouped_gemm_cuda,
sm_90), against a float64 NumPy reference with jax.lax.ragged_dot's semantics: group g owns the
next group_sizes[g] rows (a negative size counts as 0, groups past M are cut at M), rows past the
groups are zero.

Random group sizes with zeros, one group holding every row, sums below and above M, a single
group, no group at all, odd M, many rows per group (the GEMV's chunk loop, several GEMM tiles per
group), spec and tiled layouts, f16 and bf16, with and without bias; every output is poisoned with
NaN first, so an unwritten row fails, and rows past the groups must be exactly zero. Reruns are
bit-identical, and one compiled program serves new group sizes (nothing about them is fixed at
launch). All tests are marked `gpu` and skip without a suitable device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp4 import ffi as _ffi
from jax_fp4 import fused as _fused
from jax_fp4 import layout as _layout
from jax_fp4.grouped import grouped_gemm_workspace_bytes
from tests import reference
from tests._helpers import DTYPES, NP_DTYPES, SPECIAL_SCALES, capability, gpus, poison

GEMV = "jax_fp4_grouped_gemv_cuda"
GEMM = "jax_fp4_grouped_gemm_cuda"

_CAPABILITY = capability(gpus()[0]) if gpus() else None
_REGISTERED = _ffi.REGISTERED_TARGETS.get("CUDA", [])


def _marks(target, min_capability, exact=False):
    """The marks of a test of `target`: gpu, and skips without a device of the capability (exact:
    that one only) or without the target in this build."""
    ok = _CAPABILITY is not None and (
        _CAPABILITY == min_capability if exact else _CAPABILITY >= min_capability
    )
    want = f"{'' if exact else '>= '}{min_capability[0]}.{min_capability[1]}"
    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not ok, reason=f"needs a CUDA device of compute capability {want}"),
        pytest.mark.skipif(
            ok and target not in _REGISTERED, reason=f"{target} not registered (no nvcc build)"
        ),
    ]


GEMV_MARKS = _marks(GEMV, (8, 0))
GEMM_MARKS = _marks(GEMM, (9, 0), exact=True)


def needs_gemv(fn):
    for mark in GEMV_MARKS:
        fn = mark(fn)
    return fn


def needs_gemm(fn):
    for mark in GEMM_MARKS:
        fn = mark(fn)
    return fn


EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# Half the smallest subnormal: the rounding error of a result in the subnormal range.
TINY = {"float16": 2.0**-25, "bfloat16": 2.0**-134}


# ---- problems and the reference ----------------------------------------------------------------


def random_experts(rng, g, n, k, special=False):
    """Stacked spec-layout weights: packed [G, N, K/2], scale [G, N, K/16], global scales [G]."""
    packed = rng.integers(0, 256, size=(g, n, k // 2), dtype=np.uint8)
    scale = rng.integers(0x28, 0x48, size=(g, n, k // 16), dtype=np.uint8)
    if special:
        mask = rng.random(scale.shape) < 0.2
        scale[mask] = rng.choice(SPECIAL_SCALES, size=int(mask.sum()))
    gs = (rng.uniform(0.5, 2.0, size=g) * 2.0 ** rng.integers(-8, 1, size=g)).astype(np.float32)
    return packed, scale, gs


def group_bounds(sizes, m):
    """[(begin, end)] per group: ragged_dot's rows, negative sizes as 0, clamped to M."""
    out, start = [], 0
    for s in np.asarray(sizes, np.int64):
        s = max(int(s), 0)
        out.append((min(start, m), min(start + s, m)))
        start += s
    return out


def grouped_reference(a, packed, scale, gs, sizes, bias):
    """float64 y [M, N]: each group's rows times its dequantized weight (+ bias); other rows 0."""
    a64 = np.asarray(a, np.float64)
    m, n = a64.shape[0], packed.shape[1]
    ref = np.zeros((m, n))
    mag = np.zeros((m, n))  # |a| @ |W|^T (+ |bias|): the fp32 accumulation's error scale
    for g, (lo, hi) in enumerate(group_bounds(sizes, m)):
        if hi <= lo:
            continue
        b = None if bias is None else np.asarray(bias[g], np.float64)
        ref[lo:hi] = reference.matmul(a64[lo:hi], packed[g], scale[g], gs[g], 16, b)
        w = reference.dequantize(packed[g], scale[g], gs[g], 16)
        mag[lo:hi] = np.abs(a64[lo:hi]) @ np.abs(w).T + (0.0 if b is None else np.abs(b))
    return ref, mag


def check(y, ref, mag, sizes, dtype):
    y64 = np.asarray(y, np.float64)
    assert y.shape == ref.shape and y.dtype == NP_DTYPES[dtype]
    assert np.isfinite(y64).all(), "non-finite output: a row was not written"
    used = max((hi for _, hi in group_bounds(sizes, ref.shape[0])), default=0)
    assert (y64[used:] == 0).all(), "rows past the groups must be zero"
    bound = 2 * EPS[dtype] * np.abs(ref) + 1e-5 * mag + TINY[dtype]
    bad = np.abs(y64 - ref) > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} elements off; first at {np.argwhere(bad)[0]}: "
        f"got {y64[tuple(np.argwhere(bad)[0])]}, want {ref[tuple(np.argwhere(bad)[0])]}"
    )


def call(target, a, packed, scale, gs, sizes, bias, *, tiled, block_size=16, activation=0):
    """The target on spec-layout weights (tiled=True: handed the tiled layout), y as NumPy. The
    GEMV's activation: 0 none, 1 silu_mul (y [M, N / 2])."""
    a = jnp.asarray(a)
    m, k = a.shape
    g, n = packed.shape[:2]
    if tiled:
        packed, scale = _layout.tile_packed(packed), _layout.tile_scale(scale)
    bias = jnp.zeros((0,), a.dtype) if bias is None else jnp.asarray(bias)
    operands = (
        jnp.asarray(packed),
        jnp.asarray(scale),
        jnp.asarray(gs, jnp.float32),
        jnp.asarray(sizes, jnp.int32),
        bias,
    )
    attrs = dict(block_size=np.int64(block_size), tiled=bool(tiled))
    if target == GEMV:
        n_out = n // 2 if activation == 1 else n
        poison((m, n_out), a.dtype)
        y_type = jax.ShapeDtypeStruct((m, n_out), a.dtype)
        return np.asarray(
            jax.ffi.ffi_call(GEMV, y_type)(a, *operands, activation=np.int64(activation), **attrs)
        )
    poison((m, n), a.dtype)
    y_type = jax.ShapeDtypeStruct((m, n), a.dtype)
    ws = jax.ShapeDtypeStruct((grouped_gemm_workspace_bytes(m, n, k, g),), jnp.uint8)
    y, _ = jax.ffi.ffi_call(GEMM, (y_type, ws))(
        _fused.to_fragment_order(a, tiled), *operands, **attrs
    )
    return np.asarray(y)


def random_sizes(rng, g, m, kind):
    """int32 [G] group sizes of one of the layouts the kernels must serve."""
    if kind == "random":  # zeros included, sum <= M
        cuts = np.sort(rng.integers(0, m + 1, size=g - 1))
        sizes = np.diff(
            np.concatenate([[0], cuts, [rng.integers(cuts[-1] if g > 1 else 0, m + 1)]])
        )
        sizes[rng.random(g) < 0.3] = 0
    elif kind == "all_in_one":
        sizes = np.zeros(g, np.int64)
        sizes[rng.integers(g)] = m
    elif kind == "under":  # sum well below M: a zero tail
        sizes = rng.multinomial(m // 3, np.ones(g) / g)
    elif kind == "over":  # sum past M: the last groups cut at M
        sizes = rng.multinomial(m + m // 2 + 3, np.ones(g) / g)
    elif kind == "negative":  # a negative size counts as 0
        sizes = rng.multinomial(m, np.ones(g) / g)
        sizes[rng.integers(g)] = -5
    else:
        raise ValueError(kind)
    return np.asarray(sizes, np.int32)


def run_case(target, rng, m, n, k, g, kind, dtype, tiled, with_bias, special=False):
    packed, scale, gs = random_experts(rng, g, n, k, special)
    a = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), dtype)
    bias = jnp.asarray(rng.standard_normal((g, n)), dtype) if with_bias else None
    sizes = random_sizes(rng, g, m, kind) if g > 0 else np.zeros(0, np.int32)
    y = call(target, a, packed, scale, gs, sizes, bias, tiled=tiled)
    ref, mag = grouped_reference(a, packed, scale, gs, sizes, None if bias is None else bias)
    check(y, ref, mag, sizes, dtype)
    return a, packed, scale, gs, sizes, bias, y


KINDS = ["random", "all_in_one", "under", "over", "negative"]

# ---- the grouped decode GEMV --------------------------------------------------------------------

# (M, N, K, G): few rows per group (the decode shapes), odd M and N, more rows than a 16-row chunk
# in a group, more groups than one 128-group pass of the schedule's scan.
GEMV_SHAPES = [
    (1, 48, 128, 1),
    (8, 64, 256, 8),
    (13, 80, 384, 5),
    (37, 48, 256, 16),
    (100, 32, 128, 3),
    (64, 32, 256, 200),
]


@needs_gemv
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_grouped_gemv(shape, kind, tiled, dtype):
    m, n, k, g = shape
    rng = np.random.default_rng()
    run_case(GEMV, rng, m, n, k, g, kind, dtype, tiled, with_bias=(m + g) % 2 == 0)


@needs_gemv
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_gemv_ragged_n_and_bias(dtype):
    """Spec layout with N % 16 != 0 (the last column tile clamped and masked), special scales."""
    rng = np.random.default_rng()
    for kind in ("random", "over"):
        run_case(GEMV, rng, 23, 40, 256, 6, kind, dtype, False, True, special=True)


def silu_mul_reference(ref, mag):
    """silu(gate) * up of a float64 product [M, 2 I] (gate [:, :I], up [:, I:]), and the error
    scale of its float32 accumulation carried through (|d/dgate| mag_gate + |d/dup| mag_up)."""
    half = ref.shape[1] // 2
    gate, up = ref[:, :half], ref[:, half:]
    sig = 1.0 / (1.0 + np.exp(-gate))
    out = gate * sig * up
    slope = sig * (1.0 + gate * (1.0 - sig))  # d silu / d gate
    return out, np.abs(slope * up) * mag[:, :half] + np.abs(gate * sig) * mag[:, half:]


# (M, N, K, G): N / 2 % 16 == 0 (the tiled layout's tiles) and N / 2 odd (spec), a chunk of 16
# rows, many groups.
SILU_SHAPES = [(8, 64, 256, 8), (13, 96, 384, 5), (37, 34, 256, 16), (64, 32, 128, 200)]


@needs_gemv
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("kind", ["random", "all_in_one", "over"])
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_grouped_gemv_silu_mul(shape, kind, tiled, dtype):
    """activation 1: each group's gate rows [0, N/2) and up rows [N/2, N) give y [M, N / 2] =
    silu(gate) * up from the float32 products (bias included), one rounding."""
    m, n, k, g = shape
    if tiled and (n // 2) % 16:
        pytest.skip("the tiled layout needs N / 2 % 16 == 0 for silu_mul")
    rng = np.random.default_rng()
    packed, scale, gs = random_experts(rng, g, n, k)
    gs = gs / 16  # silu(gate) * up well inside float16's range
    a = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), dtype)
    bias = jnp.asarray(rng.standard_normal((g, n)), dtype) if m % 2 else None
    sizes = random_sizes(rng, g, m, kind)
    y = call(GEMV, a, packed, scale, gs, sizes, bias, tiled=tiled, activation=1)
    ref, mag = silu_mul_reference(*grouped_reference(a, packed, scale, gs, sizes, bias))
    check(y, ref, mag, sizes, dtype)


# ---- the grouped fused GEMM ---------------------------------------------------------------------

# (M, N, K, G): rows per group M / G choose the 64-, 128- and 256-row tiles; N not a multiple of
# the CTA's weight rows; N % 4 != 0 (element stores) on the spec layout.
GEMM_SHAPES = [
    (200, 256, 256, 4),
    (301, 384, 256, 2),
    (1000, 128, 384, 2),
    (96, 272, 128, 1),
    (523, 208, 256, 7),
]


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_grouped_gemm(shape, kind, tiled, dtype):
    m, n, k, g = shape
    rng = np.random.default_rng()
    run_case(GEMM, rng, m, n, k, g, kind, dtype, tiled, with_bias=(m + g) % 2 == 1)


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_gemm_ragged_n(dtype):
    """Spec layout, N % 4 != 0 (no vector stores), special scales, bias."""
    rng = np.random.default_rng()
    for kind in ("random", "under"):
        run_case(GEMM, rng, 150, 90, 256, 3, kind, dtype, False, True, special=True)


# ---- both -----------------------------------------------------------------------------------------

BOTH = [
    pytest.param(GEMV, marks=GEMV_MARKS, id="gemv"),
    pytest.param(GEMM, marks=GEMM_MARKS, id="gemm"),
]


@pytest.mark.parametrize("target", BOTH)
@pytest.mark.parametrize("tiled", [False, True])
def test_no_groups_and_empty_rows(target, tiled):
    """G = 0: every row is zero. M = 0: nothing to write."""
    rng = np.random.default_rng()
    run_case(target, rng, 70, 64, 128, 0, "random", "bfloat16", tiled, False)
    run_case(target, rng, 0, 64, 128, 3, "random", "float16", tiled, True)


@pytest.mark.parametrize("target", BOTH)
@pytest.mark.parametrize("tiled", [False, True])
def test_bit_identical_reruns(target, tiled):
    rng = np.random.default_rng()
    m, g = (45, 6) if target == GEMV else (400, 3)
    a, packed, scale, gs, sizes, bias, y = run_case(
        target, rng, m, 128, 256, g, "random", "bfloat16", tiled, True
    )
    for _ in range(2):
        again = call(target, a, packed, scale, gs, sizes, bias, tiled=tiled)
        assert np.array_equal(again.view(np.uint16), y.view(np.uint16))


@pytest.mark.parametrize("target", BOTH)
def test_one_program_new_group_sizes(target):
    """One jitted program (its launches possibly captured into a CUDA graph) run with different
    group sizes: each run follows its own sizes."""
    rng = np.random.default_rng()
    m, n, k, g = (24, 64, 256, 8) if target == GEMV else (300, 128, 256, 4)
    packed, scale, gs = random_experts(rng, g, n, k)
    a = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), jnp.bfloat16)
    ws = jax.ShapeDtypeStruct((grouped_gemm_workspace_bytes(m, n, k, g),), jnp.uint8)
    y_type = jax.ShapeDtypeStruct((m, n), a.dtype)
    attrs = dict(block_size=np.int64(16), tiled=False)
    gemv_attrs = dict(attrs, activation=np.int64(0))

    @jax.jit
    def run(a, sizes):
        ops = (
            jnp.asarray(packed),
            jnp.asarray(scale),
            jnp.asarray(gs),
            sizes,
            jnp.zeros((0,), a.dtype),
        )
        if target == GEMV:
            return jax.ffi.ffi_call(GEMV, y_type)(a, *ops, **gemv_attrs)
        return jax.ffi.ffi_call(GEMM, (y_type, ws))(_fused.to_fragment_order(a), *ops, **attrs)[0]

    for kind in ("random", "all_in_one", "under", "over", "random"):
        sizes = random_sizes(rng, g, m, kind)
        y = np.asarray(run(a, jnp.asarray(sizes)))
        ref, mag = grouped_reference(a, packed, scale, gs, sizes, None)
        check(y, ref, mag, sizes, "bfloat16")


@pytest.mark.parametrize("target", BOTH)
def test_invalid_operands(target):
    """The handler refuses what it cannot serve, naming the problem."""
    rng = np.random.default_rng()
    m, n, k, g = 16, 32, 256, 2
    packed, scale, gs = random_experts(rng, g, n, k)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    sizes = np.array([8, 8], np.int32)

    def attempt(a=a, packed=packed, scale=scale, gs=gs, sizes=sizes, block_size=16, **kw):
        kw = dict(tiled=False, activation=0) | kw
        call(target, a, packed, scale, gs, sizes, None, block_size=block_size, **kw)

    cases = [
        (dict(sizes=np.array([8, 8, 0], np.int32)), "group_sizes must hold G = 2"),
        (dict(gs=gs[:1]), "global_scale must hold G = 2"),
        (dict(scale=scale[:, :, :-1]), "scale must be"),
        (dict(a=a[:, :128]), "a must be [M, 256]"),
        (dict(block_size=32, scale=scale[:, :, ::2]), "block_size must be 16"),
        (
            dict(a=a[:, :192], packed=packed[:, :, :96], scale=scale[:, :, :12]),
            "K must be a positive multiple of 128",
        ),
    ]
    if target == GEMV:
        packed48, scale48, _ = random_experts(rng, g, 48, k)
        cases += [
            (dict(activation=2), "activation must be 0 (none) or 1 (silu_mul), got 2"),
            (
                dict(activation=1, packed=packed[:, :31], scale=scale[:, :31]),
                "activation silu_mul needs an even N, got N = 31",
            ),
            (
                dict(activation=1, packed=packed48, scale=scale48, tiled=True),
                "activation silu_mul on the tiled layout needs N / 2 % 16 == 0, got N = 48",
            ),
        ]
    for overrides, message in cases:
        with pytest.raises(Exception, match=re.escape(message)):
            attempt(**overrides)
