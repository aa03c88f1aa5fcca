"""The mixture-of-experts block's two CUDA kernels called directly through jax.ffi.ffi_call
(jax_fp4_moe_gate_up_cuda, then jax_fp4_moe_down_cuda with the counters the first returns),
against a float64 NumPy model of the block: y[t] = residual[t] + sum_j w[t, j] *
down_e(silu(gate_e(x_t)) * up_e(x_t)), the hidden rows rounded to x's dtype as the kernels store
them.

Routings from route_top_k on random logits, on logits that send every token to one expert, on
tied logits, with experts holding no pair, T not a multiple of anything (1, 3, 7, 13, 33), group
sizes summing below T k (the pairs past the groups add nothing), spec and tiled layouts, f16 and
bf16, with and without the residual. The outputs are poisoned with NaN first, so an unwritten
element fails; every counter comes back as k (each (token, tile) completed exactly once); reruns
are bit-identical; the handlers reject inconsistent operands by name. All tests are marked `gpu`
and skip without a suitable device. Run once under compute-sanitizer:
`compute-sanitizer --tool memcheck python -m pytest -q -m gpu tests/test_moe_kernels.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import layout as _layout
from jax_fp4.moe_block import DOWN_TARGET, GATE_UP_TARGET, counter_tiles
from tests import reference
from tests._helpers import DTYPES, NP_DTYPES, poison
from tests.test_grouped_kernels import EPS, _marks
from tests.test_ragged_matmul import random_stack

MARKS = _marks(GATE_UP_TARGET, (8, 0)) + _marks(DOWN_TARGET, (8, 0))
pytestmark = MARKS


def call(x, gu, dn, routing, residual, *, tiled, sizes=None):
    """The two kernels on spec-layout stacks (tiled: handed the tiled layout): (y, hidden,
    counters) as NumPy."""
    weights, order = routing.weights, routing.order
    sizes = routing.group_sizes if sizes is None else sizes
    tokens, hidden_size = x.shape
    k = weights.shape[1]

    def stack(arrays):
        packed, scale, gs = arrays
        if tiled:
            packed, scale = _layout.tile_packed(packed), _layout.tile_scale(scale)
        return jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(gs, jnp.float32)

    inter = gu[0].shape[1] // 2
    counters = jax.ShapeDtypeStruct((tokens, counter_tiles(hidden_size)), jnp.int32)
    attrs = dict(block_size=np.int64(16), tiled=bool(tiled), top_k=np.int64(k))
    poison((tokens * k, inter), x.dtype)
    hidden, counts = jax.ffi.ffi_call(
        GATE_UP_TARGET, (jax.ShapeDtypeStruct((tokens * k, inter), x.dtype), counters)
    )(x, *stack(gu), jnp.asarray(sizes, jnp.int32), order, **attrs)
    res = jnp.zeros((0,), x.dtype) if residual is None else residual
    poison((tokens, hidden_size), x.dtype)
    y, counts, _ = jax.ffi.ffi_call(
        DOWN_TARGET,
        (
            jax.ShapeDtypeStruct((tokens, hidden_size), x.dtype),
            counters,
            jax.ShapeDtypeStruct((tokens * k, hidden_size), jnp.float32),
        ),
        input_output_aliases={8: 1},
    )(hidden, *stack(dn), jnp.asarray(sizes, jnp.int32), order, weights, res, counts, **attrs)
    return np.asarray(y), np.asarray(hidden), np.asarray(counts)


def model(x, gu, dn, routing, residual, sizes, dtype):
    """(float64 y, the bound of each element): the hidden rows rounded to `dtype` as the gate/up
    kernel stores them; pairs past the groups add nothing."""
    x64 = np.asarray(x, np.float64)
    weights = np.asarray(routing.weights, np.float64)
    order = np.asarray(routing.order)
    tokens, k = weights.shape
    inter = gu[0].shape[1] // 2
    ref = np.zeros((tokens, dn[0].shape[1]))
    rounding = np.zeros_like(ref)  # the hidden rows' rounding (a float32 sum may flip it)
    accumulation = np.zeros_like(ref)  # the float32 accumulations' error scale
    start = 0
    for e, size in enumerate(np.maximum(np.asarray(sizes, np.int64), 0)):
        end = min(start + size, order.size)
        if end <= start:
            continue
        w_gu = reference.dequantize(gu[0][e], gu[1][e], gu[2][e], 16)
        w_dn = reference.dequantize(dn[0][e], dn[1][e], dn[2][e], 16)
        for pair in order[start:end]:
            t, j = divmod(int(pair), k)
            gate, up = w_gu[:inter] @ x64[t], w_gu[inter:] @ x64[t]
            hid = reference.round_once(gate / (1 + np.exp(-gate)) * up, dtype).astype(np.float64)
            ref[t] += weights[t, j] * (w_dn @ hid)
            ag = np.abs(w_gu[:inter]) @ np.abs(x64[t])
            au = np.abs(w_gu[inter:]) @ np.abs(x64[t])
            rounding[t] += abs(weights[t, j]) * (np.abs(w_dn) @ np.abs(hid))
            accumulation[t] += abs(weights[t, j]) * (np.abs(w_dn) @ (2.1 * ag * au))
        start = end
    if residual is not None:
        ref += np.asarray(residual, np.float64)
    return ref, 2 * EPS[dtype] * (np.abs(ref) + rounding) + 1e-5 * accumulation + 1e-30


def check(y, ref, bound, dtype):
    y64 = y.astype(np.float64)
    assert y.dtype == NP_DTYPES[dtype] and y.shape == ref.shape
    assert np.isfinite(y64).all(), "non-finite output: an element was not written"
    bad = np.abs(y64 - ref) > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} elements off; first at {np.argwhere(bad)[0]}: got "
        f"{y64[tuple(np.argwhere(bad)[0])]}, want {ref[tuple(np.argwhere(bad)[0])]}"
    )


def check_counts(counts, k):
    """Each token counted k pairs on the first 16-column tile of every column span the down
    launch's blocks cover (spans of 1, 2 or 4 tiles, the same for all), and nothing elsewhere."""
    tiles = counts.shape[1]
    spans = [s for s in (1, 2, 4) if (counts[:, ::s] == k).all()]
    assert spans, f"some (token, span) did not count {k} pairs: {counts}"
    used = np.zeros(tiles, bool)
    used[:: min(spans)] = True
    assert (counts[:, ~used] == 0).all(), f"counts off the spans' first tiles: {counts}"


def logits(rng, kind, tokens, experts):
    if kind == "random":
        return rng.standard_normal((tokens, experts))
    if kind == "one_expert":
        x = rng.standard_normal((tokens, experts))
        x[:, experts // 2] = 50.0
        return x
    if kind == "ties":
        return rng.integers(0, 2, size=(tokens, experts)).astype(np.float64)
    raise ValueError(kind)


def problem(rng, tokens, experts, k, hidden, inter, kind, dtype, renormalize=True):
    """x, the stacks' (packed, scale bytes, global scales), the routing and a residual. Unit-gain
    rows keep the hidden rows and outputs O(1) (two chained products overflow float16 otherwise)."""
    gu = random_stack(rng, experts, 2 * inter, hidden, unit_gain=True)[1:]
    dn = random_stack(rng, experts, hidden, inter, unit_gain=True)[1:]
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    residual = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    r = jax_fp4.route_top_k(
        jnp.asarray(logits(rng, kind, tokens, experts), jnp.float32), k, renormalize=renormalize
    )
    return x, gu, dn, r, residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize(
    "tokens, experts, k, hidden, inter, kind",
    [
        (1, 128, 8, 256, 128, "random"),
        (3, 16, 4, 128, 256, "random"),
        (7, 8, 2, 384, 128, "one_expert"),
        (13, 16, 4, 256, 128, "ties"),
        (33, 64, 8, 256, 128, "random"),  # 264 pairs: several 16-row chunks per expert
        (33, 4, 2, 128, 128, "one_expert"),  # one expert holds all 33 tokens
    ],
)
def test_matches_the_float64_model(tokens, experts, k, hidden, inter, kind, dtype, tiled):
    rng = np.random.default_rng()
    x, gu, dn, r, residual = problem(rng, tokens, experts, k, hidden, inter, kind, dtype)
    for res in (None, residual):
        y, _, counts = call(x, gu, dn, r, res, tiled=tiled)
        check(y, *model(x, gu, dn, r, res, r.group_sizes, dtype), dtype)
        check_counts(counts, k)


@pytest.mark.parametrize("tiled", [False, True])
def test_pairs_past_the_groups_add_nothing(tiled):
    rng = np.random.default_rng()
    x, gu, dn, r, residual = problem(rng, 13, 16, 4, 256, 128, "random", "bfloat16")
    sizes = np.asarray(r.group_sizes).copy()
    sizes[np.nonzero(sizes)[0][-2:]] = 0  # the last two experts' pairs fall past the groups
    y, hidden, counts = call(x, gu, dn, r, residual, tiled=tiled, sizes=sizes)
    check(y, *model(x, gu, dn, r, residual, sizes, "bfloat16"), "bfloat16")
    check_counts(counts, 4)
    assert (hidden[int(sizes.sum()) :] == 0).all(), "hidden rows past the groups are zero"


def test_reruns_are_bit_identical():
    rng = np.random.default_rng()
    x, gu, dn, r, residual = problem(rng, 33, 64, 8, 512, 256, "random", "bfloat16")
    first = call(x, gu, dn, r, residual, tiled=True)[0]
    for _ in range(3):
        again = call(x, gu, dn, r, residual, tiled=True)[0]
        np.testing.assert_array_equal(first.view(np.uint16), again.view(np.uint16))


def test_the_block_s_kernels_give_the_direct_calls_bits():
    """jax_fp4.moe with backend="kernels" is these two calls (tiled stacks from prepack)."""
    rng = np.random.default_rng()
    x, gu, dn, r, residual = problem(rng, 5, 16, 4, 256, 128, "random", "float16")

    w_gu, w_d = (jax_fp4.prepack(jax_fp4.NVFP4Weight(*a, block_size=16)) for a in (gu, dn))
    y = jax.jit(lambda x, r, res, a, b: jax_fp4.moe(x, r, a, b, residual=res, backend="kernels"))(
        x, r, residual, w_gu, w_d
    )
    direct = call(x, gu, dn, r, residual, tiled=True)[0]
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), direct.view(np.uint16))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(top_k=np.int64(3)), "the rows must be T \\* top_k"),
        (dict(order=jnp.zeros((5,), jnp.int32)), "order must hold T \\* top_k = 6"),
    ],
)
def test_the_gate_up_handler_rejects_inconsistent_operands(change, match):
    rng = np.random.default_rng()
    x, gu, dn, r, _ = problem(rng, 3, 4, 2, 128, 128, "random", "bfloat16")
    operands = dict(
        packed=jnp.asarray(gu[0]),
        scale=jnp.asarray(gu[1]),
        gs=jnp.asarray(gu[2]),
        sizes=r.group_sizes,
        order=r.order,
    )
    attrs = dict(block_size=np.int64(16), tiled=False, top_k=np.int64(2))
    for key, value in change.items():
        (attrs if key in attrs else operands)[key] = value
    outs = (
        jax.ShapeDtypeStruct((6, 128), x.dtype),
        jax.ShapeDtypeStruct((3, counter_tiles(128)), jnp.int32),
    )
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(
            jax.ffi.ffi_call(GATE_UP_TARGET, outs)(x, *operands.values(), **attrs)
        )
