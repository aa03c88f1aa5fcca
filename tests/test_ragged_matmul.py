"""jax_fp4.ragged_matmul (grouped products with stacked NVFP4 weights, jax.lax.ragged_dot's
semantics) against a float64 NumPy model, on each device present (the `device` fixture: the CPU
always; on a CUDA device the grouped GEMV and GEMM where this build has them): every backend the
device serves, group sizes with empty groups, one group holding every row, rows past the groups
and sizes out of range, both layouts, fp16/bf16 (and float32 where served), bias, activation
"silu_mul" (in the grouped GEMV's kernel and composed), jit / vmap / grad, bit-identical reruns,
the bad-input catalogue, the dispatch rules, and the sharded layouts (expert- and
tensor-parallel) on 8 CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp4
from jax_fp4 import dispatch, grouped
from tests import reference
from tests._helpers import check as _check

EIGHT_CPUS = jax.device_count() >= 8 and jax.devices()[0].platform == "cpu"


# ---- the model and random problems ---------------------------------------------------------------


def ref_ragged(a, packed, scale, gs, block_size, sizes, bias=None, *, weight_dtype=None):
    """float64 Y: row i of group g is a[i] @ W_g^T (+ bias[g]); rows past the groups are zero.
    Sizes as documented: a negative size counts as 0 and the groups end at M. `weight_dtype`: the
    weight rounded once to that dtype (the xla path's weight)."""
    a64 = np.asarray(a, np.float64)
    m, n = a64.shape[0], packed.shape[1]
    y = np.zeros((m, n))
    start = 0
    for g, size in enumerate(np.asarray(sizes, np.int64)):
        rows = int(min(max(size, 0), m - start))
        if rows == 0:
            continue
        w = reference.dequantize(packed[g], scale[g], gs[g], block_size)
        if weight_dtype is not None:
            w = reference.round_once(w, weight_dtype).astype(np.float64)
        y[start : start + rows] = a64[start : start + rows] @ w.T
        if bias is not None:
            y[start : start + rows] += np.asarray(bias[g], np.float64)
        start += rows
    return y


def random_stack(rng, g, n, k, block_size=16, *, unit_gain=False):
    """A random stack of G weights: (NVFP4Weight, packed, scale bytes, global scales); unit_gain:
    rows of unit norm (reference.unit_gain_global_scale)."""
    parts = [reference.random_weight(rng, n, k, block_size, unit_gain=unit_gain) for _ in range(g)]
    packed = np.stack([p[0] for p in parts]).reshape(g, n, k // 2)
    scale = np.stack([p[1] for p in parts]).reshape(g, n, -1)
    gs = np.array([p[2] for p in parts], np.float32)
    return jax_fp4.NVFP4Weight(packed, scale, gs, block_size=block_size), packed, scale, gs


def random_sizes(rng, g, m, kind="random"):
    """Group sizes int32 [G]: "random" (some groups empty, sum <= M), "full" (the same, sum = M),
    "one" (one group holds every row), "short" (sum well below M: trailing zero rows), "zeros"
    (no rows at all)."""
    sizes = np.zeros(g, np.int64)
    if kind == "one":
        sizes[rng.integers(g)] = m
    elif kind == "short":
        sizes = rng.multinomial(m // 2, np.ones(g) / g)
    elif kind in ("random", "full"):
        weights = rng.random(g) * (rng.random(g) < 0.7)  # ~30% of the groups empty
        if weights.sum() == 0:
            weights[0] = 1.0
        rows = m if kind == "full" else max(m - rng.integers(0, 3), 0)
        sizes = rng.multinomial(rows, weights / weights.sum())
    return sizes.astype(np.int32)


def random_problem(rng, m, g, n, k, block_size, dtype, with_bias, kind="random"):
    w, packed, scale, gs = random_stack(rng, g, n, k, block_size)
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    bias = jnp.asarray(rng.standard_normal((g, n)), dtype) if with_bias else None
    sizes = random_sizes(rng, g, m, kind)
    return a, w, sizes, bias, (packed, scale, gs)


def backends(device, a, w):
    """The backends that serve this product on `device`."""
    f32 = np.dtype(a.dtype) == np.float32
    if not device.is_gpu:
        return ["auto", "cpu", "reference"] + ([] if f32 else ["xla"])
    names = ["auto", "reference"] + ([] if f32 else ["xla"])
    if grouped.has_grouped_kernels() and not f32:
        problem = grouped.problem_of(a.shape, a.dtype, w.packed.shape, w.block_size, w.layout)
        if dispatch.grouped_gemv_unsupported_reason(problem, device.capability) is None:
            names.append("grouped_gemv")
        if dispatch.grouped_gemm_unsupported_reason(problem, device.capability) is None:
            names.append("grouped_gemm")
    return names


def run(a, w, sizes, bias=None, backend=None, activation=None):
    return jax.jit(
        lambda a, w, s, b: jax_fp4.ragged_matmul(a, w, s, b, backend=backend, activation=activation)
    )(a, w, sizes, bias)


def expected(a, w, sizes, bias, arrays, backend):
    packed, scale, gs = arrays
    rounded = a.dtype if backend == "xla" else None
    bias64 = None if bias is None else np.asarray(bias, np.float64)
    return ref_ragged(a, packed, scale, gs, w.block_size, sizes, bias64, weight_dtype=rounded)


def past_the_groups(sizes, m):
    return int(min(np.maximum(np.asarray(sizes, np.int64), 0).sum(), m))


# ---- values ------------------------------------------------------------------------------------

SHAPES = [
    # (M, G, N, K, block_size)
    (23, 4, 40, 64, 16),
    (1, 3, 16, 128, 16),  # one row
    (37, 1, 24, 96, 16),  # one group
    (61, 8, 33, 160, 32),  # odd N
    (19, 5, 21, 50, 16),  # K % 32 != 0, partial trailing block
    (13, 3, 7, 42, 7),  # odd block size splitting bytes
    (130, 6, 48, 256, 16),
]
GPU_SHAPES = [
    (5, 16, 256, 512, 16),  # decode: rows per group below one
    (300, 8, 128, 1024, 16),  # prefill: tens of rows per group
]


@pytest.mark.parametrize("m, g, n, k, block_size", SHAPES + GPU_SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_ragged_matmul_matches_reference(device, m, g, n, k, block_size, dtype, with_bias):
    rng = np.random.default_rng()
    a, w, sizes, bias, arrays = random_problem(rng, m, g, n, k, block_size, dtype, with_bias)
    end = past_the_groups(sizes, m)
    for backend in backends(device, a, w):
        y = run(a, w, sizes, bias, backend)
        _check(y, expected(a, w, sizes, bias, arrays, backend), dtype)
        assert not np.asarray(y, np.float32)[end:].any(), backend  # zeros past the groups


@pytest.mark.parametrize("kind", ["one", "short", "zeros"])
def test_group_size_patterns(device, kind):
    rng = np.random.default_rng()
    a, w, sizes, bias, arrays = random_problem(rng, 45, 6, 32, 128, 16, "bfloat16", True, kind)
    for backend in backends(device, a, w):
        y = run(a, w, sizes, bias, backend)
        _check(y, expected(a, w, sizes, bias, arrays, backend), "bfloat16")


def test_sizes_out_of_range_read_as_the_kernels_do(device):
    """Traced sizes: a negative size counts as 0, a sum past M ends the groups at M (the group
    straddling M keeps its first rows). Eager calls with concrete negative sizes raise."""
    rng = np.random.default_rng()
    a, w, _, bias, arrays = random_problem(rng, 20, 5, 32, 128, 16, "bfloat16", True)
    for sizes in ([7, -3, 9, 8, 4], [0, 30, 5, 0, 0], [12, 5, -100, 9, 1], [2**31 - 1, 1, 1, 1, 1]):
        sizes = np.asarray(sizes, np.int32)
        for backend in backends(device, a, w):
            y = run(a, w, sizes, bias, backend)
            _check(y, expected(a, w, sizes, bias, arrays, backend), "bfloat16")
    with pytest.raises(ValueError, match="group_sizes must be nonnegative, got -3 at index 1"):
        jax_fp4.ragged_matmul(a, w, np.asarray([7, -3, 9, 8, 4], np.int32), bias)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepacked_stack_gives_the_spec_layouts_bits(device, dtype):
    """The tiled layout (jax_fp4.prepack of the stack): every backend against the reference, and
    the kernels with the same bits as on the spec layout."""
    rng = np.random.default_rng()
    a, w, sizes, bias, arrays = random_problem(rng, 50, 5, 48, 256, 16, dtype, True)
    tiled = jax_fp4.prepack(w)
    assert tiled.layout == "tiled" and tiled.shape == w.shape
    for backend in backends(device, a, tiled):
        y = run(a, tiled, sizes, bias, backend)
        _check(y, expected(a, w, sizes, bias, arrays, backend), dtype)
        if backend in ("cpu", "grouped_gemm", "reference", "xla"):
            spec = run(a, w, sizes, bias, backend)
            np.testing.assert_array_equal(
                np.asarray(y).view(np.uint16), np.asarray(spec).view(np.uint16), err_msg=backend
            )


def test_float32_activations(device):
    rng = np.random.default_rng()
    a, w, sizes, bias, arrays = random_problem(rng, 30, 4, 24, 64, 16, "float32", True)
    assert jax_fp4.ragged_dispatch_path(a, w) == ("cpu" if not device.is_gpu else "reference")
    for backend in backends(device, a, w):
        _check(
            run(a, w, sizes, bias, backend), expected(a, w, sizes, bias, arrays, None), "float32"
        )
    with pytest.raises(ValueError, match="backend='xla' cannot serve this ragged_matmul"):
        jax_fp4.ragged_matmul(a, w, sizes, backend="xla")


@pytest.mark.parametrize(
    "m, n, k, block_size, layout",
    [
        (1200, 83, 528, 16, "spec"),  # groups past one 480-row unit, partial panels
        (600, 80, 640, 16, "tiled"),
        (100, 150, 600, 24, "spec"),  # blocks straddling a K step
        (60, 70, 300, 12, "spec"),  # the element-by-element decode
    ],
)
def test_cpu_rows_get_the_dense_kernels_bits(m, n, k, block_size, layout):
    """Each row of the CPU grouped kernel equals the dense CPU kernel's product of that row with
    its group's weight, bit for bit: a row's result depends neither on its group's size (one row,
    up to 8 rows without the panel, hundreds with it) nor on the other groups."""
    rng = np.random.default_rng()
    g = 5
    a, w, _, bias, _ = random_problem(rng, m, g, n, k, block_size, "bfloat16", True)
    sizes = np.array([1, 0, 7, 9 + (m - 30) // 2, (m - 30) // 2 + 3], np.int32)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    y = np.asarray(run(a, w, sizes, bias, "cpu")).view(np.uint16)
    start = 0
    for index, size in enumerate(sizes):
        one = jax.tree.map(lambda x: x[index], w)
        dense = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend="cpu"))(
            a[start : start + size], one, bias[index]
        )
        np.testing.assert_array_equal(y[start : start + size], np.asarray(dense).view(np.uint16))
        start += size
    assert not y[start:].any()


def test_reruns_are_bit_identical(device):
    rng = np.random.default_rng()
    for m, g in ((4, 16), (200, 8)):
        a, w, sizes, bias, _ = random_problem(rng, m, g, 256, 512, 16, "bfloat16", True)
        for backend in backends(device, a, w):
            f = jax.jit(lambda a, w, s, b: jax_fp4.ragged_matmul(a, w, s, b, backend=backend))
            first = np.asarray(f(a, w, sizes, bias)).view(np.uint16)
            for _ in range(3):
                np.testing.assert_array_equal(
                    np.asarray(f(a, w, sizes, bias)).view(np.uint16), first, err_msg=backend
                )


def test_one_program_serves_every_routing(device):
    """The sizes are run-time values: one compiled program, whatever they are."""
    rng = np.random.default_rng()
    a, w, _, bias, arrays = random_problem(rng, 40, 6, 32, 128, 16, "bfloat16", True)
    f = jax.jit(jax_fp4.ragged_matmul)
    for kind in ("random", "one", "short", "zeros", "random"):
        sizes = random_sizes(rng, 6, 40, kind)
        _check(f(a, w, sizes, bias), expected(a, w, sizes, bias, arrays, "auto"), "bfloat16")
    assert f._cache_size() == 1


def test_empty_shapes():
    rng = np.random.default_rng()
    w, *_ = random_stack(rng, 3, 8, 32)
    sizes = np.array([1, 0, 1], np.int32)
    y = jax_fp4.ragged_matmul(jnp.ones((0, 32), jnp.bfloat16), w, np.zeros(3, np.int32))
    assert y.shape == (0, 8)
    assert jax_fp4.ragged_dispatch_path(jnp.ones((0, 32), jnp.bfloat16), w) == "empty"
    # K = 0: each row is its group's bias; rows past the groups stay zero.
    w0 = jax_fp4.NVFP4Weight(
        np.zeros((3, 8, 0), np.uint8), np.zeros((3, 8, 0), np.uint8), np.ones(3)
    )
    bias = jnp.asarray(rng.standard_normal((3, 8)), jnp.bfloat16)
    y = np.asarray(jax.jit(jax_fp4.ragged_matmul)(jnp.ones((3, 0), jnp.bfloat16), w0, sizes, bias))
    np.testing.assert_array_equal(y, np.stack([bias[0], bias[2], np.zeros(8)]).astype(y.dtype))
    # N = 0 and G = 0.
    wn = jax_fp4.NVFP4Weight(
        np.zeros((3, 0, 16), np.uint8), np.zeros((3, 0, 2), np.uint8), np.ones(3)
    )
    assert jax_fp4.ragged_matmul(jnp.ones((4, 32), jnp.float16), wn, sizes).shape == (4, 0)
    wg = jax_fp4.NVFP4Weight(
        np.zeros((0, 8, 16), np.uint8), np.zeros((0, 8, 2), np.uint8), np.ones(0)
    )
    y = jax_fp4.ragged_matmul(jnp.ones((4, 32), jnp.float16), wg, np.zeros(0, np.int32))
    assert y.shape == (4, 8) and not np.asarray(y).any()


def test_cpu_kernel_is_the_default_on_cpu():
    rng = np.random.default_rng()
    a, w, sizes, bias, _ = random_problem(rng, 10, 3, 16, 64, 16, "bfloat16", True)
    assert (
        "jax_fp4_grouped_matmul_cpu"
        in jax.jit(jax_fp4.ragged_matmul).lower(a, w, sizes, bias).as_text()
    )
    assert jax_fp4.ragged_dispatch_path(a, w, platform="cpu") == "cpu"
    assert jax_fp4.ragged_dispatch_path(a, w, platform="rocm") == "xla"


# ---- transforms --------------------------------------------------------------------------------


def test_vmap_over_rows_and_group_sizes(device):
    """vmap over a and group_sizes (each batch element its own routing) runs one grouped product
    over the whole batch; each element's rows equal the unbatched call (bit for bit on the CPU
    kernel, whose rows do not depend on their group's size), also with a or the sizes shared."""
    rng = np.random.default_rng()
    b, m, g = 3, 21, 5
    w, packed, scale, gs = random_stack(rng, g, 32, 128)
    bias = jnp.asarray(rng.standard_normal((g, 32)), jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((b, m, 128)), jnp.bfloat16)
    sizes = np.stack([random_sizes(rng, g, m, kind) for kind in ("random", "one", "short")])
    cases = {
        "both": ((0, 0), a, sizes),
        "a only": ((0, None), a, sizes[0]),
        "sizes only": ((None, 0), a[0], sizes),
    }
    for name, (axes, a_in, s_in) in cases.items():
        y = jax.jit(jax.vmap(lambda x, s: jax_fp4.ragged_matmul(x, w, s, bias), in_axes=axes))(
            a_in, s_in
        )
        for i in range(b):
            x_i = a_in if axes[0] is None else a_in[i]
            s_i = s_in if axes[1] is None else s_in[i]
            one = jax.jit(jax_fp4.ragged_matmul)(x_i, w, s_i, bias)
            if device.is_gpu:
                _check(
                    y[i],
                    ref_ragged(x_i, packed, scale, gs, 16, s_i, np.asarray(bias, np.float64)),
                    "bfloat16",
                )
            else:
                np.testing.assert_array_equal(
                    np.asarray(y[i]).view(np.uint16), np.asarray(one).view(np.uint16), err_msg=name
                )
    # A batch axis elsewhere than 0, nested vmap.
    y = jax.vmap(
        jax.vmap(lambda x, s: jax_fp4.ragged_matmul(x, w, s), in_axes=(1, None)), in_axes=(None, 0)
    )(jnp.moveaxis(a, 0, 1), sizes)
    assert y.shape == (b, b, m, 32)
    _check(y[2, 1], ref_ragged(a[1], packed, scale, gs, 16, sizes[2]), "bfloat16")


def test_vmap_over_stacked_layers(device):
    """vmap over a leading axis of the weight stacks (layers of experts) and their biases: one
    grouped product per layer."""
    rng = np.random.default_rng()
    layers, m, g = 2, 17, 4
    stacks = [random_stack(rng, g, 24, 64) for _ in range(layers)]
    w = jax.tree.map(lambda *x: jnp.stack(x), *[s[0] for s in stacks])
    bias = jnp.asarray(rng.standard_normal((layers, g, 24)), jnp.float16)
    a = jnp.asarray(rng.standard_normal((m, 64)), jnp.float16)
    sizes = random_sizes(rng, g, m)
    y = jax.jit(jax.vmap(lambda w, b: jax_fp4.ragged_matmul(a, w, sizes, b)))(w, bias)
    for i, (_, packed, scale, gs) in enumerate(stacks):
        _check(
            y[i],
            ref_ragged(a, packed, scale, gs, 16, sizes, np.asarray(bias[i], np.float64)),
            "float16",
        )


def test_grad_matches_the_float64_model(device):
    """d/da, d/dbias and d/dglobal_scale of sum(c * y) against their float64 formulas: row i of
    group g gets c[i] @ W_g, bias row g the sum of c over g's rows, gs[g] sum(c * y(gs=1)) over
    them; rows past the groups get zero."""
    rng = np.random.default_rng()
    m, g, n, k = 29, 5, 24, 64
    w, packed, scale, gs = random_stack(rng, g, n, k)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((g, n)), jnp.float32)
    c = rng.standard_normal((m, n))
    sizes = random_sizes(rng, g, m, "short")
    ends = np.cumsum(sizes)

    def loss(a, bias, global_scale):
        ww = jax_fp4.NVFP4Weight(w.packed, w.scale, global_scale)
        y = jax_fp4.ragged_matmul(a.astype(jnp.bfloat16), ww, sizes, bias.astype(jnp.bfloat16))
        return jnp.sum(jnp.asarray(c, jnp.float32) * y.astype(jnp.float32))

    da, dbias, dgs = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a, bias, w.global_scale)
    want_da, want_dbias, want_dgs = np.zeros((m, k)), np.zeros((g, n)), np.zeros(g)
    a16 = np.asarray(a.astype(jnp.bfloat16), np.float64)
    for i in range(g):
        rows = slice(ends[i] - sizes[i], ends[i])
        unit = reference.dequantize(packed[i], scale[i], 1.0, 16)
        want_da[rows] = c[rows] @ (unit * gs[i])
        want_dbias[i] = c[rows].sum(0)
        want_dgs[i] = np.sum(c[rows] * (a16[rows] @ unit.T))
    tol = dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(
        np.asarray(da), want_da, atol=2e-2 * np.abs(want_da).max(), rtol=2e-2
    )
    np.testing.assert_allclose(np.asarray(dbias), want_dbias, **tol)
    np.testing.assert_allclose(
        np.asarray(dgs), want_dgs, rtol=2e-2, atol=2e-2 * np.abs(want_dgs).max()
    )
    assert not np.asarray(da)[ends[-1] :].any()


def test_jvp_and_linear_transpose(device):
    rng = np.random.default_rng()
    a, w, sizes, bias, arrays = random_problem(rng, 26, 4, 16, 64, 16, "float32", True)
    da = jnp.asarray(rng.standard_normal(a.shape), jnp.float32)
    dbias = jnp.asarray(rng.standard_normal(bias.shape), jnp.float32)
    f = lambda a, b: jax_fp4.ragged_matmul(a, w, sizes, b)  # noqa: E731
    y, dy = jax.jit(lambda *args: jax.jvp(f, args[:2], args[2:]))(a, bias, da, dbias)
    _check(y, expected(a, w, sizes, bias, arrays, None), "float32")
    _check(dy, expected(da, w, sizes, dbias, arrays, None), "float32")
    # Only the bias moves: its rows, no product.
    _, db_only = jax.jvp(lambda b: f(a, b), (bias,), (dbias,))
    _check(
        db_only,
        ref_ragged(np.zeros_like(a), *arrays, 16, sizes, np.asarray(dbias, np.float64)),
        "float32",
    )


def test_weight_codes_are_not_differentiable():
    rng = np.random.default_rng()
    a, w, sizes, _, _ = random_problem(rng, 8, 2, 16, 32, 16, "float32", False)

    def through_scale_bytes(scale):
        ww = jax_fp4.NVFP4Weight(w.packed, scale, w.global_scale)
        return jax_fp4.ragged_matmul(a, ww, sizes).sum()

    with pytest.raises(TypeError):
        jax.grad(through_scale_bytes)(w.scale)


# ---- activation="silu_mul" ---------------------------------------------------------------------


def silu_mul64(y):
    """silu(gate) * up of a float64 product [..., 2 I]: gate [..., :I], up [..., I:]."""
    half = y.shape[-1] // 2
    gate, up = y[..., :half], y[..., half:]
    return gate / (1.0 + np.exp(-gate)) * up


SILU_SHAPES = [
    # (M, G, N, K, layout): on a GPU the grouped GEMV runs silu_mul in its kernel where K % 128 ==
    # 0 (and, tiled, N / 2 % 16 == 0), the GEMM and the others around the product.
    (23, 4, 40, 64, "spec"),  # K % 128 != 0
    (9, 16, 34, 256, "spec"),  # N / 2 odd
    (9, 16, 64, 256, "tiled"),
    (9, 16, 48, 256, "tiled"),  # N / 2 % 16 != 0: around the GEMV's product
    (300, 8, 128, 1024, "tiled"),  # tens of rows per group: the GEMM
]


@pytest.mark.parametrize("m, g, n, k, layout", SILU_SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_mul_matches_reference(device, m, g, n, k, layout, dtype, with_bias):
    rng = np.random.default_rng()
    w, packed, scale, gs = random_stack(rng, g, n, k, unit_gain=True)
    w = jax_fp4.prepack(w) if layout == "tiled" else w
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    bias = jnp.asarray(rng.standard_normal((g, n)), dtype) if with_bias else None
    sizes = random_sizes(rng, g, m)
    end = past_the_groups(sizes, m)
    for backend in backends(device, a, w):
        y = run(a, w, sizes, bias, backend, activation="silu_mul")
        want = silu_mul64(expected(a, w, sizes, bias, (packed, scale, gs), backend))
        _check(y, want, dtype)
        assert not np.asarray(y, np.float32)[end:].any(), backend  # zeros past the groups


def test_silu_mul_under_vmap(device):
    """vmap folds the batch into one grouped call, the activation included."""
    rng = np.random.default_rng()
    w, packed, scale, gs = random_stack(rng, 6, 32, 128, unit_gain=True)
    a = jnp.asarray(rng.standard_normal((3, 10, 128)), jnp.bfloat16)
    sizes = np.stack([random_sizes(rng, 6, 10) for _ in range(3)])
    f = jax.jit(jax.vmap(lambda a, s: jax_fp4.ragged_matmul(a, w, s, activation="silu_mul")))
    y = f(a, sizes)
    assert y.shape == (3, 10, 16)
    for i in range(3):
        want = silu_mul64(expected(a[i], w, sizes[i], None, (packed, scale, gs), None))
        _check(y[i], want, "bfloat16")


def test_silu_mul_grad_matches_the_float64_model(device):
    """d/da, d/dbias, d/dglobal_scale of sum(c * silu(gate) * up) against their float64
    formulas (the tangent is the composition's: the product, then silu_mul in float32)."""
    rng = np.random.default_rng()
    m, g, n, k = 29, 5, 24, 64
    w, packed, scale, gs = random_stack(rng, g, n, k, unit_gain=True)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((g, n)), jnp.float32)
    c = rng.standard_normal((m, n // 2))
    sizes = random_sizes(rng, g, m, "short")
    ends = np.cumsum(sizes)

    def loss(a, bias, global_scale):
        ww = jax_fp4.NVFP4Weight(w.packed, w.scale, global_scale)
        y = jax_fp4.ragged_matmul(
            a.astype(jnp.bfloat16), ww, sizes, bias.astype(jnp.bfloat16), activation="silu_mul"
        )
        return jnp.sum(jnp.asarray(c, jnp.float32) * y.astype(jnp.float32))

    da, dbias, dgs = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a, bias, w.global_scale)
    want_da, want_dbias, want_dgs = np.zeros((m, k)), np.zeros((g, n)), np.zeros(g)
    a16 = np.asarray(a.astype(jnp.bfloat16), np.float64)
    b16 = np.asarray(bias.astype(jnp.bfloat16), np.float64)
    half = n // 2
    for i in range(g):
        rows = slice(ends[i] - sizes[i], ends[i])
        unit = reference.dequantize(packed[i], scale[i], 1.0, 16)
        y = a16[rows] @ (unit * gs[i]).T + b16[i]
        gate, up = y[:, :half], y[:, half:]
        sig = 1.0 / (1.0 + np.exp(-gate))
        dy = np.concatenate(
            [c[rows] * sig * (1.0 + gate * (1.0 - sig)) * up, c[rows] * gate * sig], axis=1
        )
        want_da[rows] = dy @ (unit * gs[i])
        want_dbias[i] = dy.sum(0)
        want_dgs[i] = np.sum(dy * (a16[rows] @ unit.T))
    for got, want in ((da, want_da), (dbias, want_dbias), (dgs, want_dgs)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=3e-2, atol=3e-2 * np.abs(want).max())
    assert not np.asarray(da)[ends[-1] :].any()


# ---- errors ----------------------------------------------------------------------------------------


def _weight(g=3, n=8, k=32, block_size=16):
    return random_stack(np.random.default_rng(), g, n, k, block_size)[0]


A = jnp.ones((6, 32), jnp.bfloat16)
SIZES = np.array([2, 2, 2], np.int32)


@pytest.mark.parametrize(
    "make_args, error, match",
    [
        (
            lambda w: (A, jax.tree.map(lambda x: x[0], w), SIZES),
            ValueError,
            r"stack of G weights.*use jax_fp4.matmul",
        ),
        (lambda w: (A, w.packed, SIZES), TypeError, "w must be an NVFP4Weight"),
        (lambda w: (A, w, SIZES[:2]), ValueError, r"group_sizes must have shape \(G,\) = \(3,\)"),
        (lambda w: (A, w, np.ones((3, 1), np.int32)), ValueError, "group_sizes must have shape"),
        (
            lambda w: (A, w, SIZES.astype(np.float32)),
            TypeError,
            "group_sizes must be an integer array",
        ),
        (
            lambda w: (A, w, SIZES, jnp.ones((3, 7))),
            ValueError,
            r"bias must have shape \(G, N\) = \(3, 8\)",
        ),
        (lambda w: (A, w, SIZES, jnp.ones((8,))), ValueError, "bias must have shape"),
        (lambda w: (A, w, SIZES, jnp.ones((3, 8), jnp.int32)), TypeError, "bias must be a float"),
        (
            lambda w: (jnp.ones((6, 48), jnp.bfloat16), w, SIZES),
            ValueError,
            r"a must be \[M, K\] with K = 32",
        ),
        (
            lambda w: (jnp.ones((2, 3, 32), jnp.bfloat16), w, SIZES),
            ValueError,
            r"a must be \[M, K\]",
        ),
        (
            lambda w: (jnp.ones((6, 32), jnp.int8), w, SIZES),
            TypeError,
            "a must be float16 or bfloat16",
        ),
    ],
)
def test_bad_input(make_args, error, match):
    args = make_args(_weight())
    with pytest.raises(error, match=match):
        jax.jit(jax_fp4.ragged_matmul)(*args)


def test_bad_activation():
    with pytest.raises(
        ValueError,
        match=r"ragged_matmul: activation must be one of \('silu_mul',\) or None, got 'gelu'",
    ):
        jax_fp4.ragged_matmul(A, _weight(), SIZES, activation="gelu")
    with pytest.raises(
        ValueError, match=r"ragged_matmul: activation='silu_mul' needs .* an even N; got"
    ):
        jax_fp4.ragged_matmul(A, _weight(n=7), SIZES, activation="silu_mul")


def test_bad_backend_and_unservable_forced_backend():
    w = _weight()
    with pytest.raises(ValueError, match="backend must be one of"):
        jax_fp4.ragged_matmul(A, w, SIZES, backend="gemv")
    with pytest.raises(ValueError, match="backend='grouped_gemv' needs platform 'cuda'"):
        jax_fp4.ragged_matmul(
            jnp.ones((6, 128), jnp.bfloat16), _weight(k=128), SIZES, backend="grouped_gemv"
        )
    for backend in ("grouped_gemv", "grouped_gemm"):
        with pytest.raises(
            ValueError,
            match=f"backend='{backend}' cannot serve.*K must be a multiple of 128, got 64",
        ):
            jax_fp4.ragged_matmul(
                jnp.ones((6, 64), jnp.bfloat16), _weight(k=64), SIZES, backend=backend
            )
    with pytest.raises(TypeError, match="tuning must be a jax_fp4.KernelTuning"):
        jax_fp4.ragged_matmul(A, w, SIZES, tuning={"gemv_col_tiles": 2})


def test_cpu_handler_validates_operands():
    """Called directly with inconsistent operands, the C++ handler returns an error naming the
    operand instead of reading out of bounds."""
    w = _weight()
    call = jax.ffi.ffi_call("jax_fp4_grouped_matmul_cpu", jax.ShapeDtypeStruct((6, 8), jnp.float32))
    good = dict(
        a=jnp.ones((6, 32), jnp.float32),
        packed=w.packed,
        scale=w.scale_bytes,
        global_scale=w.global_scale,
        group_sizes=jnp.asarray(SIZES),
        bias=jnp.zeros((0,), jnp.float32),
    )
    bad = [
        ("scale", np.zeros((3, 8, 1), np.uint8), "scale must be"),
        ("scale", np.asarray(w.scale_bytes).view(np.int8), "scale must be float8_e4m3fn or uint8"),
        ("packed", w.packed[0], "packed must be"),
        ("global_scale", w.global_scale[:2], "global_scale must hold G = 3"),
        ("group_sizes", jnp.asarray(SIZES[:2]), "group_sizes must hold G = 3"),
        ("bias", jnp.zeros((3, 7), jnp.float32), "bias must be empty or hold"),
    ]
    for name, value, match in bad:
        operands = dict(good, **{name: value})
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(
                call(*operands.values(), block_size=np.int64(16), tiled=False, avx512=False)
            )


# ---- dispatch ------------------------------------------------------------------------------------


def _problem(m, g=8, n=1536, k=2048, dtype="bfloat16", block_size=16):
    return dispatch.GroupedProblem(m, g, n, k, block_size, np.dtype(dtype))


HOPPER = dispatch.Target("cuda", capability=(9, 0), has_cuda_kernels=True, has_grouped_kernels=True)
AMPERE = dispatch.Target("cuda", capability=(8, 0), has_cuda_kernels=True, has_grouped_kernels=True)


def test_grouped_dispatch_rules():
    crossover = dispatch.GROUPED_DEFAULT.gemv_max_rows_per_group
    g = 8
    assert dispatch.grouped_plan(_problem(int(crossover * g), g), HOPPER) == "grouped_gemv"
    assert dispatch.grouped_plan(_problem(int(crossover * g) + 1, g), HOPPER) == "grouped_gemm"
    assert dispatch.grouped_plan(_problem(4096, 128), AMPERE) == "grouped_gemv"  # no GEMM there
    assert dispatch.grouped_plan(_problem(4096, 128, k=2080), HOPPER) == "xla"  # K % 128 != 0
    turing = dispatch.Target(
        "cuda", capability=(7, 5), has_cuda_kernels=True, has_grouped_kernels=True
    )
    assert dispatch.grouped_plan(_problem(4), turing) == "xla"  # no mma.sync
    assert (
        dispatch.grouped_plan(_problem(64 * 65535, 2), HOPPER) == "grouped_gemv"
    )  # past the GEMM's grid
    assert dispatch.grouped_plan(_problem(4, dtype="float32"), HOPPER) == "reference"
    assert dispatch.grouped_plan(_problem(4), dispatch.Target("cpu")) == "cpu"
    assert dispatch.grouped_plan(_problem(0), HOPPER) == "empty"
    assert dispatch.grouped_plan(_problem(4, g=0), HOPPER) == "empty"
    without = dispatch.Target("cuda", capability=(9, 0), has_cuda_kernels=True)
    assert dispatch.grouped_plan(_problem(4), without) == "xla"
    with pytest.raises(ValueError, match="grouped CUDA kernels"):
        dispatch.grouped_plan(_problem(4), without, "grouped_gemv")
    with pytest.raises(ValueError, match="Hopper"):
        dispatch.grouped_plan(_problem(4), AMPERE, "grouped_gemm")
    with pytest.raises(ValueError, match="needs platform 'cpu'"):
        dispatch.grouped_plan(_problem(4), HOPPER, "cpu")
    assert dispatch.grouped_plan(_problem(4), HOPPER, "xla") == "xla"
    ranges = dispatch.grouped_paths(128, 1536, 2048, HOPPER, tiled=True, max_m=4096)
    last_gemv = int(128 * dispatch.grouped_crossovers(HOPPER.device_kind).gemv_max_rows_per_group)
    assert ranges == [(1, last_gemv, "grouped_gemv"), (last_gemv + 1, 4096, "grouped_gemm")]


# ---- sharding on 8 CPU devices ---------------------------------------------------------------------

needs_eight_cpus = pytest.mark.skipif(
    not EIGHT_CPUS, reason="needs 8 CPU devices (tests/conftest.py sets XLA_FLAGS)"
)


def _mesh(explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh((8,), ("x",), axis_types=(kind,))


@needs_eight_cpus
@pytest.mark.parametrize("kind", ["full", "short"])
def test_expert_parallel_under_shard_map(kind):
    """Each of 8 shards holds G / 8 experts, their group sizes and the rows routed to them: the
    primitive runs per shard on its local [G_local, N, K] stack. Each shard's rows against the
    float64 model of its own experts; with every shard's rows filling its block, the whole
    result equals the unsharded call on the concatenated rows, bit for bit."""
    rng = np.random.default_rng()
    mesh = _mesh()
    g, m_local, n, k = 16, 12, 32, 128
    w, packed, scale, gs = random_stack(rng, g, n, k)
    bias = jnp.asarray(rng.standard_normal((g, n)), jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((8 * m_local, k)), jnp.bfloat16)
    sizes = np.concatenate([random_sizes(rng, g // 8, m_local, kind) for _ in range(8)])

    @jax.jit
    def expert_parallel(a, w, sizes, bias):
        return jax.shard_map(
            lambda a, w, s, b: jax_fp4.ragged_matmul(a, w, s, b),
            mesh=mesh,
            in_specs=(P("x"), w.shardings(P("x")), P("x"), P("x")),
            out_specs=P("x"),
        )(a, w, sizes, bias)

    y = expert_parallel(a, w, sizes, bias)
    for d in range(8):
        rows, experts = slice(d * m_local, (d + 1) * m_local), slice(2 * d, 2 * d + 2)
        want = ref_ragged(
            a[rows],
            packed[experts],
            scale[experts],
            gs[experts],
            16,
            sizes[experts],
            np.asarray(bias[experts], np.float64),
        )
        _check(y[rows], want, "bfloat16")
    if kind == "full":  # every shard's rows fill its block: the rows in one global order
        whole = jax.jit(jax_fp4.ragged_matmul)(a, w, sizes, bias)
        np.testing.assert_array_equal(
            np.asarray(y).view(np.uint16), np.asarray(whole).view(np.uint16)
        )


@needs_eight_cpus
@pytest.mark.parametrize("axis", ["n", "k"])
def test_tensor_parallel_under_shard_map(axis):
    """Every shard holds all experts, split along N (column parallel: each shard its columns, no
    collective; bit for bit the unsharded result) or along K (row parallel: partial products in
    float32, one psum, the bias added once)."""
    rng = np.random.default_rng()
    mesh = _mesh()
    g, m, n, k = 6, 40, 64, 512
    a, w, sizes, bias, arrays = random_problem(rng, m, g, n, k, 16, "bfloat16", True)
    whole = jax.jit(jax_fp4.ragged_matmul)(a, w, sizes, bias)
    if axis == "n":
        f = jax.shard_map(
            lambda a, w, s, b: jax_fp4.ragged_matmul(a, w, s, b),
            mesh=mesh,
            in_specs=(P(), w.shardings(P(None, "x", None)), P(), P(None, "x")),
            out_specs=P(None, "x"),
        )
        y = jax.jit(f)(a, w, sizes, bias)
        np.testing.assert_array_equal(
            np.asarray(y).view(np.uint16), np.asarray(whole).view(np.uint16)
        )
    else:

        def row_parallel(a, w, s, b):
            partial = jax_fp4.ragged_matmul(a, w, s).astype(jnp.float32)
            y = jax.lax.psum(partial, "x") + grouped.bias_rows(b, s, a.shape[0])
            return y.astype(a.dtype)

        f = jax.shard_map(
            row_parallel,
            mesh=mesh,
            in_specs=(P(None, "x"), w.shardings(P(None, None, "x")), P(), P()),
            out_specs=P(),
        )
        y = jax.jit(f)(a, w, sizes, bias)
    _check(y, expected(a, w, sizes, bias, arrays, "cpu"), "bfloat16")


def _collectives(hlo: str) -> dict:
    return {
        op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo))
        for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
    }


def _kernel_results(hlo: str) -> set:
    """The per-device result shapes of the CPU grouped kernel's calls in a compiled program."""
    return {
        re.search(r"=\s*\w+\[([\d,]*)\]", line).group(1)
        for line in hlo.splitlines()
        if 'custom_call_target="jax_fp4_grouped_matmul_cpu"' in line
    }


@needs_eight_cpus
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize(
    "spec, layout, kernel_result, collectives",
    [
        (P(None, "x", None), "column", "40,8", {}),  # each device its 8 columns of every expert
        (P(None, None, "x"), "row", "40,64", {"all-reduce": 1}),  # partial products, one psum
        (P("x", None, None), "gathered", "40,64", None),  # G split: gathered
    ],
)
def test_jit_with_sharded_weights(explicit, spec, layout, kernel_result, collectives):
    """Under a multi-device jit the CPU kernel runs per device on the weight stack's own shards
    along N (no collective) or K (one all-reduce of the partial products); a stack split along G
    is gathered (the rows of each group are known only at run time). Values against the model,
    and against the single-device result (bit for bit where N is split)."""
    rng = np.random.default_rng()
    mesh = _mesh(explicit)
    a, w, sizes, bias, arrays = random_problem(rng, 40, 16, 64, 512, 16, "bfloat16", True)
    ws = jax.device_put(w, w.shardings(NamedSharding(mesh, spec)))
    bs = jax.device_put(bias, NamedSharding(mesh, P(*tuple(spec)[:2])))
    f = jax.jit(jax_fp4.ragged_matmul)
    y = f(a, ws, sizes, bs)
    _check(y, expected(a, w, sizes, bias, arrays, "cpu"), "bfloat16")
    hlo = f.lower(a, ws, sizes, bs).compile().as_text()
    assert _kernel_results(hlo) == {kernel_result}
    if collectives is not None:
        assert {op: n for op, n in _collectives(hlo).items() if n} == collectives
    if layout == "column":
        assert tuple(y.sharding.spec)[:2] == (None, "x")
        single = run(a, w, sizes, bias, "cpu")
        np.testing.assert_array_equal(
            np.asarray(y).view(np.uint16), np.asarray(single).view(np.uint16)
        )


@needs_eight_cpus
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("spec", [P("x", None, None), P(None, "x", None), P(None, None, "x")])
@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_pure_jax_paths_under_jit_with_sharded_weights(explicit, spec, backend):
    """The reference and xla paths are plain JAX (ragged_dot) that XLA partitions itself."""
    rng = np.random.default_rng()
    mesh = _mesh(explicit)
    a, w, sizes, bias, arrays = random_problem(rng, 40, 8, 64, 256, 16, "bfloat16", True)
    ws = jax.device_put(w, w.shardings(NamedSharding(mesh, spec)))
    bs = jax.device_put(bias, NamedSharding(mesh, P(*tuple(spec)[:2])))
    y = jax.jit(lambda a, w, s, b: jax_fp4.ragged_matmul(a, w, s, b, backend=backend))(
        a, ws, sizes, bs
    )
    _check(y, expected(a, w, sizes, bias, arrays, backend), "bfloat16")


@needs_eight_cpus
def test_without_the_rules_xla_gathers_the_stack(monkeypatch):
    monkeypatch.setenv("JAX_FP4_CUSTOM_PARTITIONING", "0")
    rng = np.random.default_rng()
    mesh = _mesh()
    a, w, sizes, bias, arrays = random_problem(rng, 24, 4, 64, 256, 16, "float16", False)
    ws = jax.device_put(w, w.shardings(NamedSharding(mesh, P(None, "x", None))))
    f = jax.jit(lambda a, w, s: jax_fp4.ragged_matmul(a, w, s))
    _check(f(a, ws, sizes), expected(a, w, sizes, None, arrays, "cpu"), "float16")
    assert _kernel_results(f.lower(a, ws, sizes).compile().as_text()) == {"24,64"}


@needs_eight_cpus
def test_partition_plan_explains_each_fallback():
    mesh = _mesh()
    plan = lambda spec, **kw: grouped.partition_plan(  # noqa: E731
        mesh, NamedSharding(mesh, spec), **dict(dict(n=64, k=512, block_size=16, tiled=False), **kw)
    )
    assert plan(P(None, "x", None))[:2] == (("x",), ())
    assert plan(P(None, None, "x"))[:2] == ((), ("x",))
    n_axes, k_axes, reasons = plan(P("x", None, None))
    assert (n_axes, k_axes) == ((), ()) and "gathering G" in reasons[0]
    assert "not divisible" in plan(P(None, "x", None), n=60)[2][0]
    assert "16-row tiles" in plan(P(None, "x", None), n=64, tiled=True)[2][0]
    assert "tiled layout" in plan(P(None, None, "x"), tiled=True)[2][0]
    assert "block_size" in plan(P(None, None, "x"), k=320)[2][0]
    check = lambda k_local: None if k_local % 128 == 0 else "K % 128"  # noqa: E731
    assert "K slice 64" in plan(P(None, None, "x"), local_k_check=check)[2][0]


@pytest.mark.parametrize("explicit_mesh", [False, True])
def test_exported_program_runs_its_kernel(explicit_mesh):
    """jax.export keeps the kernel (its FFI target in the serialized module) and the deserialized
    program gives the same bits; with a column-parallel stack under Explicit axes too (the rule is
    a shard_map there, which serializes)."""
    if explicit_mesh and not EIGHT_CPUS:
        pytest.skip("needs 8 CPU devices")
    rng = np.random.default_rng()
    a, w, sizes, bias, _ = random_problem(rng, 30, 4, 64, 256, 16, "bfloat16", True)
    if explicit_mesh:
        mesh = _mesh(explicit=True)
        w = jax.device_put(w, w.shardings(NamedSharding(mesh, P(None, "x", None))))
        bias = jax.device_put(bias, NamedSharding(mesh, P(None, "x")))
    f = jax.jit(jax_fp4.ragged_matmul)
    exported = jax.export.export(f, disabled_checks=jax_fp4.export_disabled_checks())(
        a, w, sizes, bias
    )
    assert "jax_fp4_grouped_matmul_cpu" in exported.mlir_module()
    again = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(
        np.asarray(again.call(a, w, sizes, bias)).view(np.uint16),
        np.asarray(f(a, w, sizes, bias)).view(np.uint16),
    )


@needs_eight_cpus
@pytest.mark.parametrize("spec", [P(None, "x", None), P(None, None, "x")])
def test_silu_mul_with_sharded_weights(spec):
    """Under a multi-device jit silu_mul runs around the partitioned product (gate and up rows
    sit on different devices of an N split)."""
    rng = np.random.default_rng()
    mesh = _mesh()
    w, packed, scale, gs = random_stack(rng, 16, 64, 512, unit_gain=True)
    a = jnp.asarray(rng.standard_normal((40, 512)), jnp.bfloat16)
    sizes = random_sizes(rng, 16, 40)
    ws = jax.device_put(w, w.shardings(NamedSharding(mesh, spec)))
    y = jax.jit(lambda a, w, s: jax_fp4.ragged_matmul(a, w, s, activation="silu_mul"))(a, ws, sizes)
    _check(y, silu_mul64(expected(a, w, sizes, None, (packed, scale, gs), "cpu")), "bfloat16")
