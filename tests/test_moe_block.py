"""jax_fp4.moe (the mixture-of-experts block) against a float64 NumPy model, on each device
present (the `device` fixture): the composition everywhere, and on a CUDA device with the block's
kernels also the kernels, which must agree with the model and with the composition. Routings from
route_top_k (random, one expert holding every token, ties in the logits, T not a multiple of
anything, renormalised or not) and built by the caller (sigmoid scoring with a selection bias,
pairs left past the groups as an expert-parallel shard leaves them), both layouts, float16,
bfloat16 and float32, with and without the residual; bit-identical reruns, jit, vmap over token
sets (down to one token each), grad with respect to x, the routing weights and the residual
against a float64-weight dense model, the bad-input catalogue, the dispatch rule, expert
parallelism under shard_map and N-split stacks under jit on 8 CPU devices.

The kernels' own operand checks and edge cases, called through jax.ffi: tests/test_moe_kernels.py.
"""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp4
from jax_fp4 import dispatch, moe_block
from jax_fp4.routing import TopKRouting, expert_order
from tests import reference
from tests.test_ragged_matmul import random_stack

EIGHT_CPUS = jax.device_count() >= 8 and jax.devices()[0].platform == "cpu"
needs_eight_cpus = pytest.mark.skipif(not EIGHT_CPUS, reason="needs 8 CPU devices")

EPS = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


# ---- the model -----------------------------------------------------------------------------------


def make_stacks(rng, experts, hidden, inter, layout="spec"):
    """(w_gate_up [E, 2 I, H], w_down [E, H, I], their float64 dequantized weights); unit-gain
    rows keep every product O(1)."""
    w_gu, gu_packed, gu_scale, gu_gs = random_stack(rng, experts, 2 * inter, hidden, unit_gain=True)
    w_d, d_packed, d_scale, d_gs = random_stack(rng, experts, hidden, inter, unit_gain=True)
    dense_gu = np.stack(
        [reference.dequantize(gu_packed[e], gu_scale[e], gu_gs[e], 16) for e in range(experts)]
    )
    dense_d = np.stack(
        [reference.dequantize(d_packed[e], d_scale[e], d_gs[e], 16) for e in range(experts)]
    )
    if layout == "tiled":
        w_gu, w_d = jax_fp4.prepack(w_gu), jax_fp4.prepack(w_d)
    return w_gu, w_d, dense_gu, dense_d


def pair_experts(routing):
    """The expert of each (token, slot) pair as the routing's order and group sizes place it:
    -1 for the pairs past the groups (they contribute nothing)."""
    order = np.asarray(routing.order)
    sizes = np.maximum(np.asarray(routing.group_sizes, np.int64), 0)
    ends = np.minimum(np.cumsum(sizes), order.size)
    out = np.full(order.size, -1)
    start = 0
    for e, end in enumerate(ends):
        out[order[start:end]] = e
        start = max(start, end)
    return out


def model(x, routing, dense_gu, dense_d, residual, dtype):
    """(float64 y [T, H], the error bound of each element for the block in `dtype`)."""
    x64 = np.asarray(x, np.float64)
    weights = np.asarray(routing.weights, np.float64)
    tokens, k = weights.shape
    inter = dense_gu.shape[1] // 2
    ref = np.zeros((tokens, dense_d.shape[1]))
    rounding = np.zeros_like(ref)  # where x's dtype rounds: the hidden rows, each expert's output
    accumulation = np.zeros_like(ref)  # the float32 accumulations' error scale
    for p, e in enumerate(pair_experts(routing)):
        if e < 0:
            continue
        t, j = divmod(p, k)
        gate, up = dense_gu[e, :inter] @ x64[t], dense_gu[e, inter:] @ x64[t]
        hid = gate / (1 + np.exp(-gate)) * up
        out = dense_d[e] @ hid
        ref[t] += weights[t, j] * out
        w = abs(weights[t, j])
        ag, au = (
            np.abs(dense_gu[e, :inter]) @ np.abs(x64[t]),
            np.abs(dense_gu[e, inter:]) @ np.abs(x64[t]),
        )
        rounding[t] += w * (np.abs(dense_d[e]) @ np.abs(hid) + np.abs(out))
        accumulation[t] += w * (np.abs(dense_d[e]) @ (2.1 * ag * au + np.abs(hid)))
    if residual is not None:
        ref += np.asarray(residual, np.float64)
    eps = EPS[np.dtype(dtype).name]
    bound = 2 * eps * (rounding + np.abs(ref)) + 1e-5 * accumulation + 1e-30
    return ref, bound


def check(y, ref, bound, dtype):
    y64 = np.asarray(y, np.float64)
    assert y.shape == ref.shape and y.dtype == np.dtype(dtype)
    assert np.isfinite(y64).all(), "non-finite output: an element was not written"
    bad = np.abs(y64 - ref) > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} elements off; first at {np.argwhere(bad)[0]}: got "
        f"{y64[tuple(np.argwhere(bad)[0])]}, want {ref[tuple(np.argwhere(bad)[0])]}"
    )


def logits_of(rng, kind, tokens, experts, k):
    if kind == "random":
        return rng.standard_normal((tokens, experts))
    if kind == "one_expert":  # expert 3 first for every token: it holds all of them
        x = rng.standard_normal((tokens, experts))
        x[:, 3] = 100.0
        return x
    if kind == "ties":  # a few distinct values: ties everywhere (the lower expert wins)
        return rng.integers(0, 3, size=(tokens, experts)).astype(np.float64)
    if kind == "equal":
        return np.zeros((tokens, experts))
    raise ValueError(kind)


def backends(device):
    """The block's backends that serve on `device`: the composition, and the kernels on a GPU
    that has them."""
    names = ["composed"]
    if device.is_gpu and moe_block.has_moe_kernels() and device.capability >= (8, 0):
        names.append("kernels")
    return names


def run(x, routing, w_gu, w_d, residual=None, backend=None):
    return jax.jit(lambda x, r, a, b, res: jax_fp4.moe(x, r, a, b, residual=res, backend=backend))(
        x, routing, w_gu, w_d, residual
    )


# ---- values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", ["spec", "tiled"])
@pytest.mark.parametrize(
    "tokens, experts, k, kind, renormalize",
    [
        (1, 8, 2, "random", True),
        (7, 8, 3, "random", False),
        (13, 16, 4, "one_expert", True),
        (5, 8, 2, "ties", True),
        (3, 8, 8, "equal", False),
    ],
)
def test_matches_the_float64_model(device, dtype, layout, tokens, experts, k, kind, renormalize):
    rng = np.random.default_rng()
    hidden, inter = 128, 128
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, experts, hidden, inter, layout)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    residual = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    logits = jnp.asarray(logits_of(rng, kind, tokens, experts, k), jnp.float32)
    r = jax_fp4.route_top_k(logits, k, renormalize=renormalize)
    for backend in backends(device):
        if backend == "kernels" and dtype == "float32":
            continue
        for res in (None, residual):
            y = run(x, r, w_gu, w_d, res, backend)
            check(y, *model(x, r, dense_gu, dense_d, res, dtype), dtype)


def caller_routing(rng, tokens, experts, k):
    """A DeepSeek-V3-style routing built outside route_top_k: sigmoid scores, the top k of the
    scores plus a selection bias, weights the chosen scores over their sum."""
    scores = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32))
    bias = jnp.asarray(rng.standard_normal(experts), jnp.float32)
    chosen = jax.lax.top_k(scores + bias, k)[1].astype(jnp.int32)
    weights = jnp.take_along_axis(scores, chosen, axis=1)
    weights = 2.5 * weights / jnp.sum(weights, axis=1, keepdims=True)
    return TopKRouting(weights, chosen, *expert_order(chosen.reshape(-1), experts))


def test_a_routing_built_by_the_caller(device):
    rng = np.random.default_rng()
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, 16, 128, 128)
    x = jnp.asarray(rng.standard_normal((9, 128)), jnp.bfloat16)
    r = caller_routing(rng, 9, 16, 4)
    for backend in backends(device):
        check(
            run(x, r, w_gu, w_d, None, backend),
            *model(x, r, dense_gu, dense_d, None, x.dtype),
            x.dtype,
        )


def test_pairs_past_the_groups_contribute_nothing(device):
    """An expert-parallel shard's view: the pairs of other shards' experts sit past the local
    groups (here the last nonempty expert's count set to 0): they add nothing."""
    rng = np.random.default_rng()
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, 8, 128, 128)
    x = jnp.asarray(rng.standard_normal((6, 128)), jnp.bfloat16)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((6, 8)), jnp.float32), 2)
    sizes = np.asarray(r.group_sizes).copy()
    sizes[np.nonzero(sizes)[0][-1]] = 0
    r = r._replace(group_sizes=jnp.asarray(sizes))
    assert (pair_experts(r) < 0).any()
    residual = jnp.asarray(rng.standard_normal((6, 128)), jnp.bfloat16)
    for backend in backends(device):
        y = run(x, r, w_gu, w_d, residual, backend)
        check(y, *model(x, r, dense_gu, dense_d, residual, x.dtype), x.dtype)


def test_reruns_are_bit_identical_and_one_program_serves_every_routing(device):
    rng = np.random.default_rng()
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, 16, 128, 128)
    x = jnp.asarray(rng.standard_normal((11, 128)), jnp.bfloat16)
    for backend in backends(device):
        f = jax.jit(lambda x, r, a, b: jax_fp4.moe(x, r, a, b, backend=backend))
        for kind in ("random", "one_expert", "ties"):
            logits = jnp.asarray(logits_of(rng, kind, 11, 16, 4), jnp.float32)
            r = jax_fp4.route_top_k(logits, 4)
            first = np.asarray(f(x, r, w_gu, w_d))
            check(first, *model(x, r, dense_gu, dense_d, None, x.dtype), x.dtype)
            for _ in range(2):
                again = np.asarray(f(x, r, w_gu, w_d))
                np.testing.assert_array_equal(first.view(np.uint16), again.view(np.uint16))
        assert f._cache_size() == 1


def test_vmap_over_token_sets(device):
    """vmap over a batch of token sets (one token each, then five): the batch's tokens join one
    block; each element against the model of its own routing."""
    rng = np.random.default_rng()
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, 8, 128, 128)
    for tokens in (1, 5):
        x = jnp.asarray(rng.standard_normal((4, tokens, 128)), jnp.bfloat16)
        residual = jnp.asarray(rng.standard_normal((4, tokens, 128)), jnp.bfloat16)
        logits = jnp.asarray(rng.standard_normal((4, tokens, 8)), jnp.float32)
        for backend in backends(device):

            def block(x, logits, residual, backend=backend):
                r = jax_fp4.route_top_k(logits, 2, renormalize=True)
                return jax_fp4.moe(x, r, w_gu, w_d, residual=residual, backend=backend)

            y = jax.jit(jax.vmap(block))(x, logits, residual)
            for b in range(4):
                r = jax_fp4.route_top_k(logits[b], 2, renormalize=True)
                check(y[b], *model(x[b], r, dense_gu, dense_d, residual[b], x.dtype), x.dtype)


def test_vmap_over_stacked_layers(device):
    rng = np.random.default_rng()
    layers = [make_stacks(rng, 8, 128, 128) for _ in range(2)]
    w_gu = jax.tree.map(lambda *a: jnp.stack(a), *[layer[0] for layer in layers])
    w_d = jax.tree.map(lambda *a: jnp.stack(a), *[layer[1] for layer in layers])
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((3, 8)), jnp.float32), 2)
    y = jax.jit(jax.vmap(lambda a, b: jax_fp4.moe(x, r, a, b)))(w_gu, w_d)
    for i, (_, _, dense_gu, dense_d) in enumerate(layers):
        check(y[i], *model(x, r, dense_gu, dense_d, None, x.dtype), x.dtype)


def test_grad_matches_a_dense_float64_model(device):
    """d/dx, d/d(routing weights) and d/d(residual) of a weighted sum of the block, against the
    same derivatives of a dense float64-weight model in float32 arithmetic."""
    rng = np.random.default_rng()
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, 8, 128, 128)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.float32)
    residual = jnp.asarray(rng.standard_normal((5, 128)), jnp.float32)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((5, 8)), jnp.float32), 3)
    ct = jnp.asarray(rng.standard_normal((5, 128)), jnp.float32)
    gu, dn = jnp.asarray(dense_gu, jnp.float32), jnp.asarray(dense_d, jnp.float32)
    experts = jnp.asarray(pair_experts(r).reshape(5, 3))

    def dense(x, weights, residual):
        hp = jax.lax.Precision.HIGHEST
        gate = jnp.einsum("tknh,th->tkn", gu[experts, :128], x, precision=hp)
        up = jnp.einsum("tknh,th->tkn", gu[experts, 128:], x, precision=hp)
        out = jnp.einsum("tkhn,tkn->tkh", dn[experts], jax.nn.silu(gate) * up, precision=hp)
        return jnp.sum(ct * (jnp.sum(out * weights[..., None], axis=1) + residual))

    def block(x, weights, residual):
        routing = r._replace(weights=weights)
        return jnp.sum(ct * jax_fp4.moe(x, routing, w_gu, w_d, residual=residual))

    got = jax.jit(jax.grad(block, argnums=(0, 1, 2)))(x, r.weights, residual)
    want = jax.grad(dense, argnums=(0, 1, 2))(x, r.weights, residual)
    for g, w in zip(got, want):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * np.abs(np.asarray(w)).max()
        )


def shared_model(rng, x, hidden, inter, with_gate):
    """A shared expert (w_gate_up, w_down), its gate weight or None, and its float64 output with
    the bound of its roundings (the GEMV's hidden row, the output joining the residual)."""
    packed, scale, gs = reference.random_weight(rng, 2 * inter, hidden, unit_gain=True)
    gate_up = jax_fp4.NVFP4Weight(packed, scale, gs)
    dense_gu = reference.dequantize(packed, scale, gs, 16)
    packed, scale, gs = reference.random_weight(rng, hidden, inter, unit_gain=True)
    down = jax_fp4.NVFP4Weight(packed, scale, gs)
    dense_d = reference.dequantize(packed, scale, gs, 16)
    x64 = np.asarray(x, np.float64)
    g, u = x64 @ dense_gu[:inter].T, x64 @ dense_gu[inter:].T
    hid = g / (1 + np.exp(-g)) * u
    out = hid @ dense_d.T
    bound = np.abs(hid) @ np.abs(dense_d).T + np.abs(out)
    gate = None
    if with_gate:
        gate = jnp.asarray(rng.standard_normal((1, hidden)) / np.sqrt(hidden), jnp.float32)
        sig = 1 / (1 + np.exp(-(x64 @ np.asarray(gate, np.float64)[0])))
        out, bound = out * sig[:, None], bound * sig[:, None]
    return (gate_up, down), gate, out, bound


@pytest.mark.parametrize("with_gate", [False, True])
def test_a_shared_expert_joins_the_residual(device, with_gate):
    rng = np.random.default_rng()
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, 8, 128, 128)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((5, 8)), jnp.float32), 2)
    shared, gate, out, out_bound = shared_model(rng, x, 128, 256, with_gate)
    for backend in backends(device):
        y = jax.jit(
            lambda x, r, res, s, g, backend=backend: jax_fp4.moe(
                x, r, w_gu, w_d, residual=res, shared=s, shared_gate=g, backend=backend
            )
        )(x, r, residual, shared, gate)
        ref, bound = model(x, r, dense_gu, dense_d, residual, x.dtype)
        ref = ref + out
        bound = bound + 2 * EPS["bfloat16"] * (out_bound + np.abs(ref))
        check(y, ref, bound, x.dtype)


# ---- errors ---------------------------------------------------------------------------------------


def _args(experts=4, hidden=32, inter=16, tokens=3, k=2):
    rng = np.random.default_rng(0)
    w_gu = random_stack(rng, experts, 2 * inter, hidden)[0]
    w_d = random_stack(rng, experts, hidden, inter)[0]
    x = jnp.ones((tokens, hidden), jnp.bfloat16)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32), k)
    return x, r, w_gu, w_d


def _other_experts(r):
    return r._replace(group_sizes=jnp.zeros((5,), jnp.int32))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda x, r, a, b: (x, _other_experts(r), a, b),
            ValueError,
            r"group_sizes must be \[E\] = \(4,\)",
        ),
        (
            lambda x, r, a, b: (x, _args(experts=3, k=2)[1], a, b),
            ValueError,
            r"group_sizes must be \[E\] = \(4,\)",
        ),
        (
            lambda x, r, a, b: (x, r._replace(weights=jnp.ones((3, 5))), a, b),
            ValueError,
            r"k \(routing.weights.shape\[1\]\) must be in \[1, E = 4\]",
        ),
        (
            lambda x, r, a, b: (x, r._replace(order=r.order[:4]), a, b),
            ValueError,
            r"routing.order must be \[T k\] = \(6,\)",
        ),
        (
            lambda x, r, a, b: (x[:2], r, a, b),
            ValueError,
            r"routing.weights must be \[T, k\] with T = 2",
        ),
        (
            lambda x, r, a, b: (x, r._replace(group_sizes=r.group_sizes.at[1].set(-1)), a, b),
            ValueError,
            r"routing.group_sizes must be nonnegative, got -1 at index 1",
        ),
        (
            lambda x, r, a, b: (x, r._replace(order=r.order.astype(jnp.float32)), a, b),
            TypeError,
            "routing.order must be an integer array",
        ),
        (
            lambda x, r, a, b: (x, SimpleNamespace(weights=r.weights), a, b),
            TypeError,
            "routing.order is missing",
        ),
        (
            lambda x, r, a, b: (jnp.ones((3, 48), jnp.bfloat16), r, a, b),
            ValueError,
            r"x must be \[T, H\] with H = 32",
        ),
        (
            lambda x, r, a, b: (x.astype(jnp.int8), r, a, b),
            TypeError,
            "x must be float16, bfloat16 or float32",
        ),
        (
            lambda x, r, a, b: (x, r, a, _args(inter=32)[3]),
            ValueError,
            r"w_down must be \[E, H, I\] = \(4, 32, 16\)",
        ),
        (
            lambda x, r, a, b: (x, r, b, a),
            ValueError,
            r"x must be \[T, H\] with H = 16",
        ),
        (
            lambda x, r, a, b: (x, r, jnp.ones((4, 32, 32), jnp.bfloat16), b),
            TypeError,
            "w_gate_up must be an NVFP4Weight",
        ),
        (lambda x, r, a, b: (x, r, a, b.packed), TypeError, "w_down must be an NVFP4Weight"),
        (
            lambda x, r, a, b: (x, r, jax.tree.map(lambda t: t[0], a), b),
            ValueError,
            r"w_gate_up must be a stack of E expert weights",
        ),
    ],
)
def test_bad_input_raises_at_trace_time(change, error, match):
    args = change(*_args())
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda: jax_fp4.moe(*args))


def test_bad_residual_and_backend():
    x, r, a, b = _args()
    with pytest.raises(ValueError, match=r"residual must be \[T, H\] = \(3, 32\)"):
        jax_fp4.moe(x, r, a, b, residual=jnp.ones((3, 16)))
    with pytest.raises(TypeError, match="residual must be a float array"):
        jax_fp4.moe(x, r, a, b, residual=jnp.ones((3, 32), jnp.int32))
    with pytest.raises(ValueError, match="backend must be one of"):
        jax_fp4.moe(x, r, a, b, backend="grouped_gemv")
    # K = 32: the kernels' 128-wide windows cannot take it, whatever the platform.
    with pytest.raises(ValueError, match=r"backend='kernels' cannot serve w_gate_up: K must be"):
        jax_fp4.moe(x, r, a, b, backend="kernels")


def test_bad_shared_expert():
    x, r, a, b = _args()
    rng = np.random.default_rng()
    gu = jax_fp4.NVFP4Weight(*reference.random_weight(rng, 16, 32))
    dn = jax_fp4.NVFP4Weight(*reference.random_weight(rng, 32, 8))
    jax_fp4.moe(x, r, a, b, shared=(gu, dn), shared_gate=jnp.ones((1, 32)))
    with pytest.raises(TypeError, match=r"shared must be a pair"):
        jax_fp4.moe(x, r, a, b, shared=gu)
    with pytest.raises(TypeError, match=r"shared\[1\] must be an NVFP4Weight"):
        jax_fp4.moe(x, r, a, b, shared=(gu, jnp.ones((32, 8))))
    with pytest.raises(ValueError, match=r"shared\[1\] must be \[H, I_s\] = \(32, 8\)"):
        jax_fp4.moe(x, r, a, b, shared=(gu, gu))
    with pytest.raises(ValueError, match=r"shared\[0\] must be a fused gate/up weight"):
        jax_fp4.moe(x, r, a, b, shared=(dn, dn))
    with pytest.raises(ValueError, match=r"shared_gate must be a float weight \[H\]"):
        jax_fp4.moe(x, r, a, b, shared=(gu, dn), shared_gate=jnp.ones((16,)))
    with pytest.raises(ValueError, match=r"shared_gate needs a shared expert"):
        jax_fp4.moe(x, r, a, b, shared_gate=jnp.ones((32,)))


def test_forcing_the_kernels_on_the_cpu_names_the_platform():
    rng = np.random.default_rng()
    w_gu, w_d, _, _ = make_stacks(rng, 4, 128, 128)
    x = jnp.ones((2, 128), jnp.bfloat16)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((2, 4)), jnp.float32), 2)
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(ValueError, match="lowered for 'cpu'"):
            jax.jit(lambda x: jax_fp4.moe(x, r, w_gu, w_d, backend="kernels")).lower(x)


# ---- the dispatch rule ------------------------------------------------------------------------------


def _qwen3(tokens, dtype="bfloat16", tiled=True, hidden=2048, inter=768, experts=128, k=8):
    p = dict(block_size=16, dtype=np.dtype(dtype), tiled=tiled, groups=experts)
    gate_up = dispatch.GroupedProblem(m=tokens * k, n=2 * inter, k=hidden, **p)
    down = dispatch.GroupedProblem(m=tokens * k, n=hidden, k=inter, **p)
    return gate_up, down


def test_dispatch_takes_the_kernels_at_decode_sizes_only(monkeypatch):
    h100 = dispatch.Target("cuda", (9, 0), "NVIDIA H100 80GB HBM3", has_cuda_kernels=True)

    def plan(tokens, target=h100, has_kernels=True, backend="auto", **kw):
        return dispatch.moe_plan(*_qwen3(tokens, **kw), target, backend, has_kernels=has_kernels)

    # Until a GPU's table turns them on, "auto" composes and the kernels run when forced.
    assert [plan(t) for t in (1, 8, 32, 128)] == ["composed"] * 4
    assert plan(1, backend="kernels") == "kernels"
    on = dataclasses.replace(dispatch.GROUPED_DEFAULT, moe_kernels=True)
    monkeypatch.setitem(dispatch.GROUPED_TABLES, h100.device_kind, on)
    assert [plan(t) for t in (1, 8, 32, 128)] == ["kernels"] * 4
    assert plan(129) == "composed"  # past 8 rows per expert: the grouped GEMM's regime
    assert plan(1, has_kernels=False) == "composed"
    assert plan(1, dispatch.Target("cpu")) == "composed"
    assert plan(1, dtype="float32") == "composed"
    assert plan(1, hidden=2000) == "composed"
    assert plan(1, backend="composed") == "composed"
    assert plan(0) == plan(0, backend="kernels") == "composed"  # no tokens: nothing to launch
    assert plan(500, backend="kernels") == "kernels"
    with pytest.raises(ValueError, match="lowered for 'cpu'"):
        plan(1, dispatch.Target("cpu"), backend="kernels")
    with pytest.raises(ValueError, match=r"w_down: K must be a multiple of 128"):
        plan(1, inter=96, backend="kernels")


# ---- sharding ---------------------------------------------------------------------------------------


@needs_eight_cpus
def test_expert_parallel_under_shard_map():
    """Each of 8 shards holds E / 8 experts and the routing restricted to them (its pairs first,
    grouped by its experts; the other shards' pairs past its groups); the partial blocks summed
    over the shards give the whole block."""
    rng = np.random.default_rng()
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    experts, tokens, k = 16, 6, 2
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, experts, 128, 128)
    x = jnp.asarray(rng.standard_normal((tokens, 128)), jnp.float32)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32), k)
    local = experts // 8

    def shard_routing(shard):
        flat = np.asarray(r.experts).reshape(-1)
        mine = (flat // local) == shard
        keyed = np.where(mine, flat % local, local)  # other shards' pairs sort past the groups
        order, inverse, sizes = expert_order(jnp.asarray(keyed, jnp.int32), local + 1)
        return order, inverse, sizes[:local]

    parts = [shard_routing(s) for s in range(8)]
    order, inverse, sizes = (jnp.concatenate([p[i] for p in parts]) for i in range(3))

    def body(x, weights, order, inverse, sizes, a, b):
        routing = TopKRouting(weights, None, order, inverse, sizes)
        return jax.lax.psum(jax_fp4.moe(x, routing, a, b).astype(jnp.float32), "x")

    y = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(
                P(),
                P(),
                P("x"),
                P("x"),
                P("x"),
                w_gu.shardings(P("x")),
                w_d.shardings(P("x")),
            ),
            out_specs=P(),
        )
    )(x, r.weights, order, inverse, sizes, w_gu, w_d)
    ref, bound = model(x, r, dense_gu, dense_d, None, "float32")
    check(y, ref, 8 * bound, "float32")


@needs_eight_cpus
@pytest.mark.parametrize("spec", [P(None, "x", None), P(None, None, "x")])
def test_jit_with_stacks_split_along_n_or_k(spec):
    """Under a multi-device jit the block is the composition, which XLA partitions by
    ragged_matmul's rules: the stacks stay split (no all-gather of a weight)."""
    rng = np.random.default_rng()
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    w_gu, w_d, dense_gu, dense_d = make_stacks(rng, 8, 128, 128)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    r = jax_fp4.route_top_k(jnp.asarray(rng.standard_normal((4, 8)), jnp.float32), 2)
    w_gu = jax.device_put(w_gu, w_gu.shardings(NamedSharding(mesh, spec)))
    w_d = jax.device_put(w_d, w_d.shardings(NamedSharding(mesh, spec)))
    f = jax.jit(lambda x, r, a, b: jax_fp4.moe(x, r, a, b))
    check(f(x, r, w_gu, w_d), *model(x, r, dense_gu, dense_d, None, x.dtype), x.dtype)
    hlo = f.lower(x, r, w_gu, w_d).compile().as_text()
    gathered = [line for line in hlo.splitlines() if "all-gather" in line and "u8[8," in line]
    assert not gathered, gathered


# ---- the CUDA lowering (checked on any machine) -------------------------------------------------


@pytest.fixture
def cuda_build(monkeypatch):
    """Lower as for an H100 with every CUDA target of this package registered, its dispatch table
    taking the block's kernels."""
    from jax_fp4 import ffi as _ffi  # noqa: PLC0415
    from jax_fp4 import native as _native  # noqa: PLC0415

    on = dataclasses.replace(dispatch.GROUPED_DEFAULT, moe_kernels=True)
    monkeypatch.setitem(dispatch.GROUPED_TABLES, "NVIDIA H100 80GB HBM3", on)

    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(_ffi, "cuda_architectures", lambda: _ffi.ALL_CUDA_ARCHITECTURES)
    monkeypatch.setattr(_native, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_native, "device_kind", lambda device=None: "NVIDIA H100 80GB HBM3")
    registered = dict(_ffi.REGISTERED_TARGETS, CUDA=list(_ffi.FFI_TARGETS["CUDA"]))
    monkeypatch.setattr(_ffi, "REGISTERED_TARGETS", registered)


def _cuda_text(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_a_decode_block_is_the_routing_and_two_kernels(cuda_build):
    """At decode sizes the block is three custom calls (routing, gate/up, down with the combine)
    and no XLA gather or scatter of the routed rows; vmap over token sets keeps one block; past
    the crossover it is ragged_matmul's composition."""
    import re  # noqa: PLC0415

    rng = np.random.default_rng()
    w_gu, w_d, _, _ = make_stacks(rng, 16, 256, 128, "tiled")

    def layer(x, logits):
        r = jax_fp4.route_top_k(logits, 4, renormalize=True)
        return jax_fp4.moe(x, r, w_gu, w_d, residual=x)

    x = jnp.zeros((3, 256), jnp.bfloat16)
    logits = jnp.zeros((3, 16), jnp.float32)
    text = _cuda_text(layer, x, logits)
    calls = re.findall(r"custom_call @(\w+)", text)
    assert sorted(calls) == sorted(
        ["jax_fp4_top_k_routing_cuda", moe_block.GATE_UP_TARGET, moe_block.DOWN_TARGET]
    )
    assert "gather" not in text and "scatter" not in text
    for target in (moe_block.GATE_UP_TARGET, moe_block.DOWN_TARGET):
        config = re.search(rf"custom_call @{target}\(.*?backend_config = \{{([^}}]*)\}}", text)
        assert dict(re.findall(r"(\w+) = ([\w.-]+)", config.group(1))) == {
            "block_size": "16",
            "tiled": "true",
            "top_k": "4",
        }
    assert "output_operand_aliases" in text  # the counters pass through the down call
    batched = _cuda_text(jax.vmap(layer), x[None].repeat(2, 0), logits[None].repeat(2, 0))
    assert len(re.findall(rf"custom_call @{moe_block.GATE_UP_TARGET}", batched)) == 1
    many = jnp.zeros((64, 256), jnp.bfloat16)
    prefill = _cuda_text(layer, many, jnp.zeros((64, 16), jnp.float32))
    assert moe_block.GATE_UP_TARGET not in prefill and "jax_fp4_grouped_gemm_cuda" in prefill


def test_no_tokens_gives_an_empty_block(device):
    rng = np.random.default_rng()
    w_gu, w_d, _, _ = make_stacks(rng, 4, 128, 128)
    r = jax_fp4.route_top_k(jnp.zeros((0, 4), jnp.float32), 2)
    y = run(jnp.zeros((0, 128), jnp.bfloat16), r, w_gu, w_d)
    assert y.shape == (0, 128) and y.dtype == jnp.bfloat16


def test_an_exported_block_runs_the_same():
    """jax.export serializes the block for CPU and CUDA (jax_fp4's FFI targets waived) and the
    deserialized program gives the same bits here."""
    rng = np.random.default_rng()
    w_gu, w_d, _, _ = make_stacks(rng, 8, 128, 128)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)

    def layer(x, logits, a, b):
        return jax_fp4.moe(x, jax_fp4.route_top_k(logits, 2), a, b, residual=x)

    exported = jax.export.export(
        jax.jit(layer),
        platforms=("cpu", "cuda"),
        disabled_checks=jax_fp4.export_disabled_checks(),
    )(x, logits, w_gu, w_d)
    back = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(
        np.asarray(back.call(x, logits, w_gu, w_d)).view(np.uint16),
        np.asarray(jax.jit(layer)(x, logits, w_gu, w_d)).view(np.uint16),
    )
