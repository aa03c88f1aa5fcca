"""vmap, scan and autodiff of jax_fp4.matmul against the float64 NumPy reference.

Fresh random inputs for every check. Batched results are also compared bit for bit with the
un-batched call (folding a batch into M, or looping over stacked weights, must not change a result),
and the jaxprs are checked for the structure the batching rule promises.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from tests import reference
from tests._helpers import load_repo_script

TOL = reference.TOLERANCE


def _weight(rng, n, k, block_size=16):
    packed, scale, gs = reference.random_weight(rng, n, k, block_size)
    return (
        jax_fp4.NVFP4Weight(packed, scale, gs, block_size=block_size),
        reference.dequantize(packed, scale, gs, block_size),
    )


def _stacked(rng, e, n, k, block_size=16, *, unit_gain=False):
    parts = [reference.random_weight(rng, n, k, block_size, unit_gain=unit_gain) for _ in range(e)]
    packed, scale, gs = (np.stack(x) for x in zip(*parts))
    w64 = np.stack([reference.dequantize(*p, block_size) for p in parts])
    return jax_fp4.NVFP4Weight(packed, scale, gs, block_size=block_size), w64


def _randn(rng, shape, dtype="float32"):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _close(y, ref, dtype="float32"):
    y = _f64(y)
    assert y.shape == ref.shape and np.isfinite(y).all()
    assert reference.relative_error(y, ref) < TOL[np.dtype(dtype).name]


def _prims(fn, *args):
    """Multiset of primitive names in fn's jaxpr, nested jaxprs included."""
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.append(eqn.primitive.name)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


# ---- vmap over activations: folds into M ------------------------------------------------------


@pytest.mark.parametrize(
    "a_shape, axis",
    [((5, 3, 64), 0), ((3, 5, 64), 1), ((64, 5), 1), ((2, 5, 3, 64), 1), ((3, 64, 5), -1)],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vmap_over_activations_folds_into_m(a_shape, axis, dtype):
    rng = np.random.default_rng()
    w, w64 = _weight(rng, 24, 64)
    bias = _randn(rng, 24, dtype)
    a = _randn(rng, a_shape, dtype)
    f = jax.vmap(lambda a: jax_fp4.matmul(a, w, bias), in_axes=axis)
    y = jax.jit(f)(a)
    a_moved = np.moveaxis(_f64(a), axis, 0)
    _close(y, a_moved @ w64.T + _f64(bias), dtype)
    # Exactly the un-batched result for every example.
    for i in range(a_moved.shape[0]):
        example = jnp.moveaxis(a, axis, 0)[i]
        np.testing.assert_array_equal(
            np.asarray(y[i]), np.asarray(jax_fp4.matmul(example, w, bias))
        )
    names = _prims(f, a)
    assert names.count("nvfp4_matmul") == 1 and "while" not in names and "scan" not in names


def test_nested_vmap_and_out_axes():
    rng = np.random.default_rng()
    w, w64 = _weight(rng, 16, 32)
    a = _randn(rng, (4, 32, 3))  # batch axes 0 and 2
    f = jax.vmap(jax.vmap(lambda a: jax_fp4.matmul(a, w), in_axes=1, out_axes=1), in_axes=0)
    y = jax.jit(f)(a)  # [4, 16, 3]
    _close(y, np.einsum("bkc,nk->bnc", _f64(a), w64))
    assert _prims(f, a).count("nvfp4_matmul") == 1


# ---- vmap over stacked weights: a loop inside one program --------------------------------------


@pytest.mark.parametrize("a_batched", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_vmap_over_stacked_weights(a_batched, with_bias):
    rng = np.random.default_rng()
    e, n, k = 4, 24, 48
    ws, w64 = _stacked(rng, e, n, k)
    bias = _randn(rng, (e, n)) if with_bias else None
    a = _randn(rng, (e, 5, k) if a_batched else (5, k))
    fn = lambda a, w, b: jax_fp4.matmul(a, w, b)  # noqa: E731
    f = jax.vmap(fn, in_axes=(0 if a_batched else None, 0, None if bias is None else 0))
    y = jax.jit(f)(a, ws, bias)
    a64 = _f64(a)
    ref = np.stack([(a64[i] if a_batched else a64) @ w64[i].T for i in range(e)])
    if with_bias:
        ref = ref + _f64(bias)[:, None, :]
    _close(y, ref)
    for i in range(e):  # same as calling each weight alone
        wi = jax.tree.map(lambda x: x[i], ws)
        yi = jax_fp4.matmul(a[i] if a_batched else a, wi, None if bias is None else bias[i])
        np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(yi))
    names = _prims(f, a, ws, bias)
    assert names.count("nvfp4_matmul") == 1 and ("while" in names or "scan" in names)
    # One XLA program whose kernel runs inside a loop.
    hlo = jax.jit(f).lower(a, ws, bias).compile().as_text()
    assert "while" in hlo and "jax_fp4_matmul_cpu" in hlo


def test_vmap_over_experts_on_a_non_leading_axis_and_global_scale_only():
    rng = np.random.default_rng()
    ws, w64 = _stacked(rng, 3, 16, 32)
    a = _randn(rng, (2, 32))
    # Experts stacked on axis 1 of packed and scale.
    moved = jax_fp4.NVFP4Weight.tree_unflatten(
        16, (jnp.moveaxis(ws.packed, 0, 1), jnp.moveaxis(ws.scale, 0, 1), ws.global_scale)
    )
    axes = jax_fp4.NVFP4Weight.tree_unflatten(16, (1, 1, 0))
    y = jax.jit(jax.vmap(jax_fp4.matmul, in_axes=(None, axes)))(a, moved)
    _close(y, np.einsum("mk,enk->emn", _f64(a), w64))
    # Only the global scale batched: one weight at several scales.
    w, w1 = _weight(rng, 16, 32)
    scales = jnp.asarray(rng.uniform(0.5, 2.0, 4), jnp.float32)
    only_gs = jax_fp4.NVFP4Weight.tree_unflatten(16, (None, None, 0))
    vary = jax_fp4.NVFP4Weight.tree_unflatten(16, (w.packed, w.scale, scales))
    y = jax.jit(jax.vmap(jax_fp4.matmul, in_axes=(None, only_gs)))(a, vary)
    unit = w1 / np.float64(w.global_scale)
    _close(y, np.stack([_f64(a) @ (unit * np.float64(s)).T for s in np.asarray(scales)]))


def test_scan_over_stacked_layers_jitted():
    rng = np.random.default_rng()
    layers, d = 3, 64
    ws, w64 = _stacked(rng, layers, d, d, unit_gain=True)  # a conditioned tanh chain (reference.py)
    biases = _randn(rng, (layers, d))
    h0 = _randn(rng, (4, d))

    def net(h, ws, biases):
        def layer(h, wb):
            w, b = wb
            return jnp.tanh(jax_fp4.matmul(h, w, b)), None

        return jax.lax.scan(layer, h, (ws, biases))[0]

    y = jax.jit(net)(h0, ws, biases)
    h = _f64(h0)
    for i in range(layers):
        h = np.tanh(h @ w64[i].T + _f64(biases[i]))
    _close(y, h)
    # The same as the unrolled Python loop of single-weight calls.
    h = h0
    for i in range(layers):
        h = jnp.tanh(jax_fp4.matmul(h, jax.tree.map(lambda x: x[i], ws), biases[i]))
    np.testing.assert_allclose(np.asarray(y), np.asarray(h), rtol=1e-6, atol=1e-6)
    assert "scan" in _prims(net, h0, ws, biases)
    # Differentiable through the scan: against the same network on dequantized float weights.
    loss = lambda h0, ws: jnp.sum(net(h0, ws, biases) ** 2)  # noqa: E731
    w32 = jnp.asarray(w64, jnp.float32)

    def dense_loss(h0):
        h = h0
        for i in range(layers):
            h = jnp.tanh(jnp.matmul(h, w32[i].T, precision="highest") + biases[i])
        return jnp.sum(h**2)

    grad = jax.jit(jax.grad(loss))(h0, ws)
    # Both sides are float32: where tanh saturates, 1 - tanh^2 keeps few significant bits, so
    # a correct gradient lands up to ~3e-4 away on some draws (CI saw 3.2e-4); a wrong one is O(1).
    assert reference.relative_error(grad, _f64(jax.grad(dense_loss)(h0))) < 2e-3


# ---- autodiff with respect to a, bias and the global scale --------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grad_wrt_activations_and_bias(dtype):
    rng = np.random.default_rng()
    w, w64 = _weight(rng, 40, 96)
    a, bias = _randn(rng, (2, 3, 96), dtype), _randn(rng, 40, dtype)
    ct = _randn(rng, (2, 3, 40), dtype)
    loss = lambda a, b: jnp.sum(jax_fp4.matmul(a, w, b).astype(jnp.float32) * ct)  # noqa: E731
    da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, bias)
    assert da.dtype == a.dtype and db.dtype == bias.dtype
    _close(da, _f64(ct) @ w64, dtype)  # dA = dY @ dequant(W)
    _close(db, _f64(ct).reshape(-1, 40).sum(0), dtype)  # dbias = sum of dY


@pytest.mark.parametrize("m, n, k", [(3, 0, 32), (3, 16, 0), (0, 16, 32)])
def test_grads_of_empty_shapes(m, n, k):
    """Gradients with respect to a, bias and the global scale where M, N or K is zero: the
    shapes of the operands, dbias = the sum of dY over M (zeros when M = 0), dA and dgs zero."""
    w = jax_fp4.quantize(np.random.default_rng().standard_normal((n, k)).astype(np.float32))

    def loss(a, b, g):
        return jnp.sum(jax_fp4.matmul(a, jax_fp4.NVFP4Weight(w.packed, w.scale, g), b))

    da, db, dg = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
        jnp.ones((m, k)), jnp.ones((n,)), w.global_scale
    )
    assert da.shape == (m, k) and db.shape == (n,) and dg.shape == ()
    np.testing.assert_array_equal(np.asarray(db), np.full((n,), float(m)))
    assert not np.asarray(da).any() and float(dg) == 0.0  # no product term to differentiate


def test_jvp_vjp_and_linear_transpose():
    rng = np.random.default_rng()
    w, w64 = _weight(rng, 24, 32)
    a, bias = _randn(rng, (5, 32)), _randn(rng, 24)
    da, dbias = _randn(rng, (5, 32)), _randn(rng, 24)
    f = lambda a, b: jax_fp4.matmul(a, w, b)  # noqa: E731
    y, y_dot = jax.jvp(f, (a, bias), (da, dbias))
    _close(y, _f64(a) @ w64.T + _f64(bias))
    _close(y_dot, _f64(da) @ w64.T + _f64(dbias))
    # Tangent for bias only, and for a only.
    _, y_dot = jax.jvp(f, (a, bias), (jnp.zeros_like(a), dbias))
    _close(y_dot, np.broadcast_to(_f64(dbias), (5, 24)))
    _, y_dot = jax.jvp(lambda a: jax_fp4.matmul(a, w), (a,), (da,))
    _close(y_dot, _f64(da) @ w64.T)

    ct = _randn(rng, (5, 24))
    _, vjp = jax.vjp(f, a, bias)
    ct_a, ct_b = vjp(ct)
    _close(ct_a, _f64(ct) @ w64)
    _close(ct_b, _f64(ct).sum(0))
    (ct_a,) = jax.linear_transpose(lambda a: jax_fp4.matmul(a, w), a)(ct)
    _close(ct_a, _f64(ct) @ w64)


def test_jacfwd_jacrev_hessian():
    rng = np.random.default_rng()
    w, w64 = _weight(rng, 6, 16)
    a = _randn(rng, (3, 16))
    f = lambda a: jax_fp4.matmul(a, w)  # noqa: E731
    expected = np.einsum("mp,nk->mnpk", np.eye(3), w64)  # dY[m,n]/dA[p,k]
    _close(jax.jacfwd(f)(a), expected)
    _close(jax.jit(jax.jacrev(f))(a), expected)
    x = _randn(rng, 16)
    h = jax.hessian(lambda x: jnp.sum(jax_fp4.matmul(x, w) ** 2))(x)
    _close(h, 2.0 * w64.T @ w64)


def test_global_scale_is_differentiable():
    """y is linear in the global scale: dL/dgs = sum(dY * (a @ W_unit^T)), W_unit = W / gs."""
    rng = np.random.default_rng()
    w, w64 = _weight(rng, 24, 48)
    a, bias, ct = _randn(rng, (4, 48)), _randn(rng, 24), _randn(rng, (4, 24))
    unit = _f64(a) @ (w64 / np.float64(w.global_scale)).T
    expected = np.sum(_f64(ct) * unit)
    # float32 sums of N*M terms: compare on the scale of the terms, not of their (cancelling) sum.
    tol = 1e-5 * np.sum(np.abs(_f64(ct) * unit))

    def loss(gs):
        wg = jax_fp4.NVFP4Weight(w.packed, w.scale, gs)
        return jnp.sum(jax_fp4.matmul(a, wg, bias) * ct)

    g = jax.jit(jax.grad(loss))(jnp.float32(w.global_scale))
    assert abs(float(g) - expected) < tol
    # Through the weight pytree (allow_int: the codes get float0 cotangents).
    g_w = jax.grad(lambda w: jnp.sum(jax_fp4.matmul(a, w, bias) * ct), allow_int=True)(w)
    assert abs(float(g_w.global_scale) - expected) < tol
    assert g_w.packed.dtype == jax.dtypes.float0
    # Forward mode.
    _, t = jax.jvp(loss, (jnp.float32(w.global_scale),), (jnp.float32(1.0),))
    assert abs(float(t) - expected) < tol


def test_quantized_weight_is_not_differentiable():
    rng = np.random.default_rng()
    w, _ = _weight(rng, 8, 32)
    a = _randn(rng, (2, 32))
    with pytest.raises(TypeError, match="integer|int"):
        jax.grad(lambda w: jnp.sum(jax_fp4.matmul(a, w)))(w)  # packed codes are uint8
    # The primitive's own transpose rule refuses a linear packed/scale operand.
    from jax.interpreters import ad

    from jax_fp4 import ops as _ops

    ct = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(TypeError, match="quantized weight .* not differentiable"):
        _ops._transpose(
            ct,
            a,
            ad.UndefinedPrimal(jax.core.ShapedArray((8, 16), jnp.uint8)),
            w.scale,
            w.global_scale,
            block_size=16,
            backend="auto",
            layout="spec",
            has_bias=False,
            has_swizzled=False,
        )


def test_grad_through_vmap_over_experts():
    rng = np.random.default_rng()
    ws, w64 = _stacked(rng, 3, 16, 32)
    a, ct = _randn(rng, (5, 32)), _randn(rng, (3, 5, 16))
    loss = lambda a: jnp.sum(jax.vmap(jax_fp4.matmul, in_axes=(None, 0))(a, ws) * ct)  # noqa: E731
    _close(jax.jit(jax.grad(loss))(a), np.einsum("emn,enk->mk", _f64(ct), w64))


def test_eager_transforms():
    """No jit anywhere: the primitive's impl compiles it alone under each transform."""
    rng = np.random.default_rng()
    w, w64 = _weight(rng, 12, 32)
    a, ct = _randn(rng, (4, 32), "float16"), _randn(rng, (4, 12), "float16")
    _close(jax.vmap(lambda x: jax_fp4.matmul(x, w))(a), _f64(a) @ w64.T, "float16")
    da = jax.grad(lambda a: jnp.sum(jax_fp4.matmul(a, w).astype(jnp.float32) * ct))(a)
    _close(da, _f64(ct) @ w64, "float16")


def test_lora_example_loss_goes_down():
    lora = load_repo_script("examples/lora_finetune.py")
    losses = lora.main(steps=15, seed=int(np.random.default_rng().integers(1000)), verbose=False)
    assert all(np.isfinite(losses))
    assert losses[5] < losses[0] and losses[10] < losses[5] and losses[15] < losses[10]
    assert losses[-1] < 0.8 * losses[0]
