"""jax_fp4.route_top_k against a float64 NumPy reference, on the CPU (the XLA composition) and the
GPU (the routing kernel at decode sizes, the composition past them): the experts
exactly (ties to the lower expert), the grouping exactly (NumPy's stable argsort, its inverse and
the bincount), the weights to float32 rounding; its dispatch, batching, derivatives and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import dispatch, routing


def reference(logits, k, renormalize):
    """(weights, experts, order, inverse, group_sizes) in float64 / int64 from logits [T, E]."""
    x = np.asarray(logits, np.float64)
    experts = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # the lower expert on ties
    exp = np.exp(x - x.max(-1, keepdims=True))
    chosen = np.take_along_axis(exp, experts, -1)
    weights = chosen / (chosen if renormalize else exp).sum(-1, keepdims=True)
    order = np.argsort(experts.reshape(-1), kind="stable")
    return (
        weights,
        experts,
        order,
        np.argsort(order),
        np.bincount(experts.ravel(), minlength=x.shape[1]),
    )


def check(got, logits, k, renormalize):
    want = reference(logits, k, renormalize)
    for name, g, w in zip(routing.TopKRouting._fields, got, want):
        g = np.asarray(g)
        assert g.shape == w.shape, name
        if name == "weights":
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-30, err_msg=name)
        else:
            assert g.dtype == np.int32, name
            np.testing.assert_array_equal(g, w, err_msg=name)


def kernel_serves(device, tokens, experts, k) -> bool:
    return device.is_gpu and routing.routing_path(tokens, experts, k, "cuda") == "kernel"


# (tokens, experts, k): decode (1, 8 and 16 tokens, Qwen3-30B-A3B's 128 experts, top 8; 16 is
# auto's last token count for the kernel, 17 the first past it), odd sizes, one expert, k = E, more
# experts than a warp's lanes times four, and the pair comparison's last pair count and the first
# past it.
SHAPES = [
    (1, 128, 8),
    (8, 128, 8),
    (16, 128, 8),
    (17, 128, 8),
    (5, 37, 3),
    (3, 1, 1),
    (4, 6, 6),
    (33, 300, 2),
    (128, 128, 8),
    (129, 128, 8),
]


@pytest.mark.parametrize("tokens,experts,k", SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_matches_the_float64_reference(device, tokens, experts, k, dtype):
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.standard_normal((tokens, experts)) * 3, dtype)
    for renormalize in (True, False):
        got = jax.jit(jax_fp4.route_top_k, static_argnums=1, static_argnames="renormalize")(
            logits, k, renormalize=renormalize
        )
        check(got, logits, k, renormalize)
    expected = "kernel" if kernel_serves(device, tokens, experts, k) else "xla"
    assert routing.routing_path(tokens, experts, k, device.platform.replace("gpu", "cuda")) == (
        expected
    )


def test_ties_take_the_lower_expert_and_skewed_routing_groups_stably(device):
    """Equal logits (one value repeated, and +0 against -0), experts that get every pair or none,
    and -inf logits (masked experts): still the reference's experts and grouping."""
    rng = np.random.default_rng()
    tokens, experts, k = 16, 64, 8
    logits = rng.integers(-2, 3, (tokens, experts)).astype(np.float32)  # many ties
    logits[3:, 10] = 50.0  # every other token picks expert 10 first
    logits[0] = -0.0
    logits[1, ::2] = 0.0
    logits[2, :] = -np.inf
    logits[2, 5] = 1.0
    got = jax_fp4.route_top_k(jnp.asarray(logits), k, renormalize=True)
    want = reference(np.where(logits == 0, 0.0, logits), k, renormalize=True)
    # Row 2: one finite logit, the rest -inf (exp 0): its chosen weights are 1, then zeros.
    np.testing.assert_array_equal(np.asarray(got.experts), want[1])
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(g), w)
    np.testing.assert_allclose(np.asarray(got.weights), want[0], rtol=2e-6)


def test_nan_logits_give_valid_distinct_experts_and_nan_weights(device):
    logits = np.random.default_rng().standard_normal((3, 20)).astype(np.float32)
    logits[1, 7] = np.nan
    logits[2, :] = np.nan
    got = jax_fp4.route_top_k(jnp.asarray(logits), 4)
    experts = np.asarray(got.experts)
    assert ((experts >= 0) & (experts < 20)).all()
    assert all(len(set(row)) == 4 for row in experts)
    assert np.isnan(np.asarray(got.weights)[1:]).all()
    check([x[:1] for x in got[:2]], logits[:1], 4, False)
    np.testing.assert_array_equal(np.bincount(experts.ravel(), minlength=20), got.group_sizes)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,experts,k",
    [(8, 128, 8), (33, 300, 2), (128, 128, 8), (2, 4096, 8), (3, 100, 40), (1, 64, 64)],
)
@pytest.mark.parametrize("ties", [False, True])
def test_the_kernel_matches_the_reference_up_to_its_block_s_capacity(tokens, experts, k, ties):
    """The routing kernel called directly, past the sizes auto gives it (up to the pairs and
    experts one block holds, and k past a warp's 32 lanes), on random logits and on small
    integers (many ties), and against the XLA composition."""
    from tests._helpers import gpus

    if not gpus() or not routing.has_routing_kernel():
        pytest.skip("needs a CUDA device and the routing kernel")
    assert tokens * k <= dispatch.ROUTING_BLOCK_MAX_PAIRS
    assert experts <= dispatch.ROUTING_BLOCK_MAX_EXPERTS
    rng = np.random.default_rng()
    values = (
        rng.integers(-2, 3, (tokens, experts)) if ties else rng.standard_normal((tokens, experts))
    )
    logits = jnp.asarray(values, jnp.bfloat16)
    with jax.default_device(gpus()[0]):
        for renormalize in (True, False):
            kernel = jax.jit(lambda x: routing._kernel(x, k=k, renormalize=renormalize))(logits)
            check(kernel, logits, k, renormalize)
        composed = jax.jit(lambda x: routing._composed(x, k=k, renormalize=False))(logits)
        auto = "kernel" if tokens * k <= dispatch.ROUTING_KERNEL_MAX_PAIRS else "xla"
        assert routing.routing_path(tokens, experts, k, "cuda") == auto
    for name, a, b in zip(routing.TopKRouting._fields, kernel, composed):
        if name == "weights":
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("pairs", [1, 7, 64, "max", "max+1"])
def test_expert_order_matches_a_stable_sort(device, pairs):
    """The composition's two ways of grouping the pairs by expert (every pair compared with every
    other; a sort and scatters) give NumPy's stable argsort, its inverse and the bincount, with
    ties, experts that get nothing and, past COMPARE_PAIRS_MAX, the sorting way."""
    rng = np.random.default_rng()
    limit = routing.COMPARE_PAIRS_MAX
    p = {"max": limit, "max+1": limit + 1}.get(pairs, pairs)
    for experts in (3, 128):
        flat = rng.integers(0, experts, p).astype(np.int32)
        if p > 2:
            flat[: p // 2] = experts - 1  # one expert holds half the pairs
        want_order = np.argsort(flat, kind="stable")
        want = (want_order, np.argsort(want_order), np.bincount(flat, minlength=experts))
        ways = [routing.expert_order]
        if p <= 64:
            ways += [routing._order_by_comparison, routing._order_by_sort]
        for way in ways:
            got = jax.jit(way, static_argnums=1)(jnp.asarray(flat), experts)
            for name, g, w in zip(("order", "inverse", "group_sizes"), got, want):
                assert g.dtype == jnp.int32, name
                np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{way.__name__} {name}")


def test_dispatch_keeps_the_kernel_to_decode_sizes():
    gpu = dispatch.Target("cuda", capability=(9, 0), has_cuda_kernels=True)
    limit = dispatch.ROUTING_KERNEL_MAX_PAIRS
    assert limit <= dispatch.ROUTING_BLOCK_MAX_PAIRS
    assert dispatch.routing_path(limit // 8, 128, 8, gpu, has_kernel=True) == "kernel"
    assert dispatch.routing_path(limit // 8 + 1, 128, 8, gpu, has_kernel=True) == "xla"
    big = dispatch.ROUTING_BLOCK_MAX_EXPERTS
    assert dispatch.routing_path(1, big, 8, gpu, has_kernel=True) == "kernel"
    assert dispatch.routing_path(1, big + 1, 8, gpu, has_kernel=True) == "xla"
    assert dispatch.routing_path(1, 128, 8, gpu, has_kernel=False) == "xla"
    assert dispatch.routing_path(1, 128, 8, dispatch.Target("cpu"), has_kernel=True) == "xla"
    no_kernels = dispatch.Target("cuda", capability=(7, 0), has_cuda_kernels=False)
    assert dispatch.routing_path(1, 128, 8, no_kernels, has_kernel=True) == "xla"


def test_vmap_routes_each_batch_element_alone(device):
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.bfloat16)
    got = jax.vmap(lambda x: jax_fp4.route_top_k(x, 4, renormalize=True))(logits)
    for b in range(3):
        check([x[b] for x in got], logits[b], 4, True)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_weights_derivative_is_the_softmax_s_with_the_experts_fixed(device, renormalize):
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.standard_normal((4, 12)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    experts = jax_fp4.route_top_k(logits, 3).experts

    def weights(x):
        return jax_fp4.route_top_k(x, 3, renormalize=renormalize).weights

    def by_hand(x):  # float64 softmax over the fixed experts
        e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
        chosen = jnp.take_along_axis(e, experts, -1)
        return chosen / jnp.sum(chosen if renormalize else e, -1, keepdims=True)

    got = jax.grad(lambda x: jnp.sum(weights(x) * cotangent))(logits)
    with jax.enable_x64():
        want = jax.grad(lambda x: jnp.sum(by_hand(x) * cotangent))(logits.astype(jnp.float64))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(want)).max() > 1e-3  # a derivative that could fail
    tangent = jnp.asarray(rng.standard_normal((4, 12)), jnp.float32)
    _, dw = jax.jvp(weights, (logits,), (tangent,))
    _, dw_want = jax.jvp(by_hand, (logits,), (tangent,))
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_want), rtol=1e-5, atol=1e-6)


def test_the_routing_feeds_ragged_matmul(device):
    """The docstring's three lines: the routed product equals a loop over tokens and their
    experts in float64."""
    rng = np.random.default_rng()
    tokens, experts, k, n, d = 5, 6, 2, 16, 128
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    w = jax_fp4.quantize(jnp.asarray(rng.standard_normal((experts, n, d)), jnp.float32))
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)

    @jax.jit
    def moe(x, logits, w):
        r = jax_fp4.route_top_k(logits, k, renormalize=True)
        y = jax_fp4.ragged_matmul(x[r.order // k], w, r.group_sizes)
        return jnp.sum(y[r.inverse].reshape(tokens, k, n) * r.weights[..., None], axis=1)

    got = np.asarray(moe(x, logits, w))
    dense = np.asarray(jax_fp4.dequantize(w, jnp.float32), np.float64)
    weights, chosen = reference(logits, k, True)[:2]
    want = np.zeros((tokens, n))
    for t in range(tokens):
        for j in range(k):
            want[t] += weights[t, j] * (dense[chosen[t, j]] @ np.asarray(x[t], np.float64))
    # Each expert's output rounds to bf16 once (relative 2^-8), then the weighted sum.
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize(
    "logits,k,kwargs,error,match",
    [
        (np.zeros((2, 3, 4), np.float32), 2, {}, ValueError, "logits must be a 2-D array"),
        (np.zeros((4,), np.float32), 2, {}, ValueError, "logits must be a 2-D array"),
        (
            np.zeros((2, 4), np.int32),
            2,
            {},
            TypeError,
            "float16, bfloat16 or float32, got dtype int32",
        ),
        (
            np.zeros((2, 4), np.float32),
            0,
            {},
            ValueError,
            r"k must be an int in \[1, E = 4\], got 0",
        ),
        (np.zeros((2, 4), np.float32), 5, {}, ValueError, "got 5"),
        (np.zeros((2, 4), np.float32), 2.0, {}, ValueError, "got 2.0"),
        (np.zeros((2, 4), np.float32), 2, {"renormalize": "yes"}, TypeError, "renormalize must be"),
    ],
)
def test_bad_arguments_raise_naming_them(logits, k, kwargs, error, match):
    with pytest.raises(error, match=match):
        jax_fp4.route_top_k(jnp.asarray(logits), k, **kwargs)


def test_no_tokens_gives_empty_pairs_and_zero_sizes(device):
    got = jax_fp4.route_top_k(jnp.zeros((0, 8), jnp.bfloat16), 2)
    assert got.weights.shape == (0, 2) and got.order.shape == (0,)
    np.testing.assert_array_equal(np.asarray(got.group_sizes), np.zeros(8, np.int32))
