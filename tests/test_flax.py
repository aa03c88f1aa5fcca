"""jax_fp4.nnx (FP4Linear, quantize_model) and jax_fp4.linen (FP4Dense, quantize_params).

Values are checked two ways: against the float64 NumPy reference applied to the layer's own NVFP4
weight (tight: only activation/accumulation rounding), and against the float layer they replace
(loose: NVFP4 quantization noise, ~10% relative on a random weight). Skipped without flax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jax_fp4  # noqa: E402
from jax_fp4 import linen as fp4nn  # noqa: E402
from jax_fp4 import nnx as fp4nnx  # noqa: E402
from tests import reference  # noqa: E402

# NVFP4 round-to-nearest on Gaussian weights: ~9.5% relative weight error; outputs of random
# activations show about the same. Above 0.15 something is wrong; far below 0.05 nothing was quantized.
QUANT_NOISE = (0.05, 0.15)


def _ref_weight(w) -> np.ndarray:
    """float64 [..., N, K] from an NVFP4Weight, by the independent reference decoder."""
    return reference.dequantize(
        np.asarray(w.packed),
        np.asarray(w.scale_bytes),
        np.asarray(w.global_scale, np.float64)[..., None, None],
        w.block_size,
    )


def _ref_apply(x, w, bias=None) -> np.ndarray:
    y = np.asarray(x, np.float64) @ _ref_weight(w).swapaxes(-1, -2)
    return y if bias is None else y + np.asarray(bias, np.float64)


def _assert_close(y, ref, dtype=np.float32):
    y = np.asarray(y)
    assert y.shape == ref.shape, (y.shape, ref.shape)
    assert y.dtype == np.dtype(dtype), (y.dtype, dtype)
    assert reference.relative_error(y, ref) <= reference.TOLERANCE[np.dtype(dtype).name]


def _assert_quant_noise(y, y_float):
    err = reference.relative_error(y, y_float)
    assert QUANT_NOISE[0] < err < QUANT_NOISE[1], err


def _x(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# ---- nnx.FP4Linear ------------------------------------------------------------------------------


def test_fp4linear_quantizes_the_kernel_nnx_linear_would_draw():
    fp4 = fp4nnx.FP4Linear(64, 48, rngs=nnx.Rngs(3))
    lin = nnx.Linear(64, 48, rngs=nnx.Rngs(3))
    expected = jax_fp4.quantize(lin.kernel[...].T)
    assert (fp4.in_features, fp4.out_features, fp4.use_bias, fp4.block_size) == (64, 48, True, 16)
    np.testing.assert_array_equal(fp4.packed[...], expected.packed)
    np.testing.assert_array_equal(
        np.asarray(fp4.weight.scale_bytes), np.asarray(expected.scale_bytes)
    )
    assert np.float32(fp4.global_scale[...]) == np.float32(expected.global_scale)
    np.testing.assert_array_equal(fp4.bias[...], lin.bias[...])
    x = _x(0, (5, 64))
    _assert_close(fp4(x), _ref_apply(x, fp4.weight, fp4.bias[...]))
    _assert_quant_noise(fp4(x), lin(x))


@pytest.mark.parametrize("use_bias", [True, False])
def test_from_linear_matches_reference_and_float_layer(use_bias):
    lin = nnx.Linear(
        96, 40, use_bias=use_bias, rngs=nnx.Rngs(1), bias_init=nnx.initializers.normal(1.0)
    )
    fp4 = fp4nnx.FP4Linear.from_linear(lin)
    assert isinstance(fp4.weight, jax_fp4.NVFP4Weight) and fp4.weight.shape == (40, 96)
    assert fp4.use_bias == use_bias and (fp4.bias is None) == (not use_bias)
    x = _x(1, (2, 3, 96))
    bias = fp4.bias[...] if use_bias else None
    ref = _ref_apply(x, fp4.weight, bias)
    _assert_close(fp4(x), ref)
    _assert_close(jax.jit(lambda x: fp4(x))(x), ref)
    _assert_close(nnx.jit(lambda m, x: m(x))(fp4, x), ref)
    _assert_quant_noise(fp4(x), lin(x))
    # The Linear is left as it was.
    assert isinstance(lin.kernel[...], jax.Array) and lin.kernel[...].shape == (96, 40)


@pytest.mark.parametrize(
    "x_dtype, dtype, param_dtype",
    [
        (jnp.bfloat16, None, jnp.float32),  # promoted to float32, like nnx.Linear
        (jnp.bfloat16, None, jnp.bfloat16),  # bfloat16 end to end
        (jnp.float32, jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.float16, jnp.float32),
    ],
)
def test_dtype_handling_follows_nnx_linear(x_dtype, dtype, param_dtype):
    lin = nnx.Linear(
        64,
        32,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=nnx.Rngs(2),
        bias_init=nnx.initializers.normal(1.0),
    )
    fp4 = fp4nnx.FP4Linear.from_linear(lin)
    assert fp4.dtype == dtype and fp4.param_dtype == param_dtype
    assert fp4.bias[...].dtype == jnp.dtype(param_dtype)
    x = _x(2, (4, 64), x_dtype)
    y = fp4(x)
    assert y.dtype == lin(x).dtype
    ref = _ref_apply(
        np.asarray(x.astype(y.dtype), np.float64),
        fp4.weight,
        np.asarray(fp4.bias[...].astype(y.dtype), np.float64),
    )
    _assert_close(y, ref, y.dtype)


def test_from_weight_and_placeholder():
    rng = np.random.default_rng(4)
    packed, scale, gs = reference.random_weight(rng, 24, 64)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    bias = rng.standard_normal(24).astype(np.float32)
    layer = fp4nnx.FP4Linear.from_weight(w, bias)
    assert (layer.in_features, layer.out_features, layer.param_dtype) == (64, 24, np.float32)
    x = _x(4, (3, 64))
    _assert_close(
        layer(x), reference.matmul(np.asarray(x, np.float64), packed, scale, gs, 16, bias)
    )
    placeholder = fp4nnx.FP4Linear(64, 24, rngs=None)
    assert not np.any(np.asarray(placeholder(x)))
    with pytest.raises(ValueError, match=r"bias must have shape \(24,\)"):
        fp4nnx.FP4Linear.from_weight(w, np.zeros(23, np.float32))
    with pytest.raises(TypeError, match="must be an NVFP4Weight"):
        fp4nnx.FP4Linear.from_weight(np.zeros((24, 64)))


def test_fp4linear_bad_arguments():
    with pytest.raises(ValueError, match="in_features .* must be even"):
        fp4nnx.FP4Linear(33, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features .* must be even"):
        fp4nnx.FP4Linear.from_linear(nnx.Linear(33, 8, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="expected an nnx.Linear"):
        fp4nnx.FP4Linear.from_linear(nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    layer = fp4nnx.FP4Linear(32, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"in_features=32.*got shape \(2, 16\)"):
        layer(jnp.ones((2, 16)))


def test_vmap_over_activations_and_grad_of_bias():
    layer = fp4nnx.FP4Linear(32, 16, rngs=nnx.Rngs(5))
    xs = _x(5, (3, 4, 32))
    ys = jax.vmap(lambda x: layer(x))(xs)
    _assert_close(ys, _ref_apply(xs, layer.weight, layer.bias[...]))
    # Training the rest of a model: gradients flow to the bias (an nnx.Param), not the codes.
    grads = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(layer, xs[0])
    assert set(grads.keys()) == {"bias"}
    y = np.asarray(_ref_apply(xs[0], layer.weight, layer.bias[...]))
    np.testing.assert_allclose(grads["bias"][...], 2 * y.sum(0), rtol=1e-4, atol=1e-4)


class _Block(nnx.Module):
    def __init__(self, rngs, linear=fp4nnx.FP4Linear, **kwargs):
        self.proj = linear(32, 32, rngs=rngs, **kwargs)

    def __call__(self, x):
        return jnp.tanh(self.proj(x))


def _scan_apply(blocks, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
        return block(x)

    return forward(x, blocks)


def _stacked_reference(x, w, bias):
    x = np.asarray(x, np.float64)
    for i in range(w.packed.shape[0]):
        layer = jax_fp4.NVFP4Weight(
            np.asarray(w.packed)[i], np.asarray(w.scale)[i], np.asarray(w.global_scale)[i]
        )
        x = np.tanh(_ref_apply(x, layer, np.asarray(bias)[i]))
    return x


def test_nnx_vmap_created_layers_run_under_scan():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return _Block(rngs)

    blocks = create(nnx.Rngs(6))
    assert blocks.proj.packed[...].shape == (3, 32, 16) and blocks.proj.global_scale[...].shape == (
        3,
    )
    x = _x(6, (4, 32))
    ref = _stacked_reference(x, blocks.proj.weight, blocks.proj.bias[...])
    _assert_close(_scan_apply(blocks, x), ref)
    _assert_close(nnx.jit(_scan_apply)(blocks, x), ref)


def test_quantize_model_converts_stacked_linears_for_scan():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return _Block(rngs, linear=nnx.Linear, bias_init=nnx.initializers.normal(0.5))

    blocks = create(nnx.Rngs(7))
    x = _x(7, (4, 32))
    y_float = _scan_apply(blocks, x)
    kernels = np.asarray(blocks.proj.kernel[...])
    fp4nnx.quantize_model(blocks)
    assert isinstance(blocks.proj, fp4nnx.FP4Linear)
    w = blocks.proj.weight
    assert w.shape == (3, 32, 32) and w.global_scale.shape == (3,)
    for i in range(3):  # each layer has its own global scale, as if quantized alone
        single = jax_fp4.quantize(kernels[i].T)
        np.testing.assert_array_equal(np.asarray(w.packed)[i], single.packed)
        assert np.float32(np.asarray(w.global_scale)[i]) == np.float32(single.global_scale)
    y = _scan_apply(blocks, x)
    _assert_close(y, _stacked_reference(x, w, blocks.proj.bias[...]))
    _assert_quant_noise(y, y_float)


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 48, rngs=rngs)])
        self.heads = nnx.Dict({"a": nnx.Linear(48, 8, use_bias=False, rngs=rngs)})
        self.tied = self.layers[1]
        self.norm = nnx.LayerNorm(48, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.layers[0](x))
        x = self.norm(self.tied(x))
        return self.heads["a"](x)


def test_quantize_model_in_place_with_filter_and_shared_layers():
    net = _Net(nnx.Rngs(8))
    x = _x(8, (5, 32))
    y_float = net(x)
    originals = {
        name: np.asarray(lin.kernel[...])
        for name, lin in (("l0", net.layers[0]), ("l1", net.layers[1]), ("head", net.heads["a"]))
    }
    out = fp4nnx.quantize_model(net, filter=lambda path: path != ("heads", "a"))
    assert out is net
    assert isinstance(net.layers[0], fp4nnx.FP4Linear) and isinstance(
        net.layers[1], fp4nnx.FP4Linear
    )
    assert net.tied is net.layers[1]  # one shared FP4Linear
    assert type(net.heads["a"]) is nnx.Linear  # filtered out
    np.testing.assert_array_equal(net.heads["a"].kernel[...], originals["head"])
    # float64 re-implementation of the quantized network
    h = np.maximum(_ref_apply(x, net.layers[0].weight, net.layers[0].bias[...]), 0)
    h = np.asarray(
        net.norm(
            jnp.asarray(_ref_apply(h, net.layers[1].weight, net.layers[1].bias[...]), jnp.float32)
        ),
        np.float64,
    )
    ref = h @ originals["head"].astype(np.float64)
    y = net(x)
    assert reference.relative_error(y, ref) < 1e-5
    assert reference.relative_error(nnx.jit(lambda m, x: m(x))(net, x), ref) < 1e-5
    assert reference.relative_error(y, y_float) < 0.3
    fp4nnx.quantize_model(net)  # the rest, idempotent for converted ones
    assert isinstance(net.heads["a"], fp4nnx.FP4Linear) and net.tied is net.layers[1]


def test_quantize_model_error_names_the_layer():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.good = nnx.Linear(16, 8, rngs=rngs)
            self.bad = nnx.Linear(7, 8, rngs=rngs)

    with pytest.raises(ValueError, match=r"Linear at 'bad'.*must be even"):
        fp4nnx.quantize_model(Odd(nnx.Rngs(0)))
    model = fp4nnx.quantize_model(Odd(nnx.Rngs(0)), filter=lambda path: path != ("bad",))
    assert isinstance(model.good, fp4nnx.FP4Linear) and type(model.bad) is nnx.Linear
    with pytest.raises(TypeError, match="from_linear"):
        fp4nnx.quantize_model(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    model = Odd(nnx.Rngs(0))
    model.bad = nnx.Linear(16, 8, rngs=nnx.Rngs(1))
    model.bad.kernel[...] = model.bad.kernel[...].at[3, 5].set(jnp.inf)
    with pytest.raises(
        ValueError,
        match=r"Linear at 'bad'.*finite.*index \(5, 3\) of shape \(8, 16\)\).*Flax kernel transposed",
    ):
        fp4nnx.quantize_model(model)


def test_calibrate_records_each_linears_mean_square_input():
    net = _Net(nnx.Rngs(9))
    a, b = _x(9, (5, 32)), _x(10, (3, 32)) * 3.0
    stats = fp4nnx.calibrate(net, lambda m, a, b: (m(a), m(b)), a, b)
    assert all(
        type(n) is nnx.Linear for n in (net.layers[0], net.layers[1], net.heads["a"])
    )  # untouched
    assert set(stats) == {("layers", 0), ("layers", 1), ("heads", "a")}  # the tied layer once

    def inputs(x):
        h0 = np.asarray(x, np.float64)
        h1 = np.asarray(jax.nn.relu(net.layers[0](x)), np.float64)
        h2 = np.asarray(net.norm(net.tied(jax.nn.relu(net.layers[0](x)))), np.float64)
        return h0, h1, h2

    for path, ha, hb in zip([("layers", 0), ("layers", 1), ("heads", "a")], inputs(a), inputs(b)):
        expected = (np.concatenate([ha, hb]) ** 2).mean(axis=0)
        np.testing.assert_allclose(np.asarray(stats[path]), expected, rtol=1e-5, err_msg=str(path))
    jitted = fp4nnx.calibrate(net, nnx.jit(lambda m, a, b: (m(a), m(b))), a, b)
    for path in stats:
        np.testing.assert_allclose(np.asarray(jitted[path]), np.asarray(stats[path]), rtol=1e-6)


def test_quantize_model_with_calibrated_scales():
    net = _Net(nnx.Rngs(11))
    x = _x(11, (64, 32))
    kernels = {
        ("layers", 0): np.asarray(net.layers[0].kernel[...]),
        ("layers", 1): np.asarray(net.layers[1].kernel[...]),
        ("heads", "a"): np.asarray(net.heads["a"].kernel[...]),
    }
    stats = fp4nnx.calibrate(net, lambda m, x: m(x), x)
    with pytest.raises(ValueError, match="method='mse' only"):
        fp4nnx.quantize_model(nnx.clone(net), calibration=stats)
    partial = {k: v for k, v in stats.items() if k != ("heads", "a")}
    with pytest.raises(ValueError, match=r"Linear at 'heads.a'.*no statistics"):
        fp4nnx.quantize_model(nnx.clone(net), method="mse", calibration=partial)
    fp4nnx.quantize_model(net, method="mse", calibration=stats)
    layers = {
        ("layers", 0): net.layers[0],
        ("layers", 1): net.layers[1],
        ("heads", "a"): net.heads["a"],
    }
    for path, layer in layers.items():
        expected = jax_fp4.quantize(kernels[path].T, method="mse", importance=stats[path])
        np.testing.assert_array_equal(np.asarray(layer.packed[...]), np.asarray(expected.packed))
        np.testing.assert_array_equal(
            np.asarray(layer.scale[...]).view(np.uint8), np.asarray(expected.scale_bytes)
        )
    assert net.tied is net.layers[1]


def test_calibrate_rejects_stacked_linears():
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return _Block(rngs, linear=nnx.Linear)

    with pytest.raises(ValueError, match=r"Linear at 'proj' has a stacked kernel"):
        fp4nnx.calibrate(create(nnx.Rngs(0)), _scan_apply, _x(0, (2, 32)))


@pytest.mark.parametrize(
    "axes, packed_spec, gs_spec",
    [
        ((None, "model"), ("model", None), None),  # column-parallel
        (("model", None), (None, "model"), None),  # row-parallel
        (("layers", "data", "model"), ("layers", "model", "data"), ("layers",)),  # stacked
    ],
)
def test_sharding_metadata_moves_to_the_nvfp4_layout(axes, packed_spec, gs_spec):
    lead = (2,) if len(axes) == 3 else ()
    kernel = jnp.asarray(np.random.default_rng(9).standard_normal((*lead, 32, 16)), jnp.float32)
    lin = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
    lin.kernel = nnx.Param(kernel, out_sharding=axes, eager_sharding=False)
    lin.bias = nnx.Param(
        jnp.zeros((*lead, 16)), out_sharding=(*axes[:-2], axes[-1]), eager_sharding=False
    )
    fp4 = fp4nnx.FP4Linear.from_linear(lin)
    specs = nnx.get_partition_spec(nnx.state(fp4))
    assert specs["packed"].get_value() == P(*packed_spec)
    assert specs["scale"].get_value() == P(*packed_spec)
    assert specs["global_scale"].get_value() == (P(*gs_spec) if gs_spec else P())
    assert specs["bias"].get_value() == P(*axes[:-2], axes[-1])
    direct = fp4nnx.FP4Linear(
        32,
        16,
        rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": axes[-2:], "eager_sharding": False},
    )
    assert nnx.get_partition_spec(nnx.state(direct))["packed"].get_value() == P(*packed_spec[-2:])


needs_8_devices = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py forces 8 CPU devices)"
)


@needs_8_devices
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize(
    "axes, packed_spec", [((None, "model"), P("model", None)), (("model", None), P(None, "model"))]
)
def test_nnx_layers_shard_on_a_mesh(axes, packed_spec, axis_type):
    mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2
    )
    bias_axes = (axes[1],)
    with jax.set_mesh(mesh):
        layer = fp4nnx.FP4Linear(
            128,
            64,
            rngs=nnx.Rngs(10),
            bias_init=nnx.initializers.normal(1.0),
            kernel_metadata={"out_sharding": axes},
            bias_metadata={"out_sharding": bias_axes},
        )
        assert layer.packed[...].sharding.spec == packed_spec
        assert layer.scale[...].sharding.spec == packed_spec
        assert layer.bias[...].sharding.spec == P(*bias_axes)
        x = jax.device_put(_x(10, (8, 128)), NamedSharding(mesh, P("data", None)))
        y = nnx.jit(lambda m, x: m(x))(layer, x)
        y_constrained = nnx.jit(lambda m, x: m(x, out_sharding=P(None, "model")))(layer, x)
        assert y_constrained.sharding.spec == P(None, "model")
        # quantize_model on a sharded float model keeps the layout
        lin = nnx.Linear(128, 64, rngs=nnx.Rngs(10), kernel_metadata={"out_sharding": axes})
        converted = fp4nnx.FP4Linear.from_linear(lin)
        assert converted.packed[...].sharding.spec == packed_spec
    ref = _ref_apply(np.asarray(x), layer.weight, layer.bias[...])
    _assert_close(y, ref)
    np.testing.assert_array_equal(y_constrained, y)
    with jax.set_mesh(mesh):
        fp4nnx.prepack_model(layer)  # in place, keeps the shardings
        assert layer.packed[...].sharding.is_equivalent_to(NamedSharding(mesh, packed_spec), 2)
        y_tiled = nnx.jit(lambda m, x: m(x))(layer, x)
    _assert_close(y_tiled, ref)  # row parallel: K gathered for tiles, so not y's summation order


# ---- linen.FP4Dense -----------------------------------------------------------------------------


class _DenseNet(nn.Module):
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x):
        x = nn.relu(self.dense(64, bias_init=nn.initializers.normal(1.0))(x))
        x = self.dense(48, name="proj", bias_init=nn.initializers.normal(1.0))(x)
        return self.dense(8, use_bias=False)(x)


def _dense_reference(params, x):
    p = params["params"]
    w0 = fp4nn.weight_from_params(p["FP4Dense_0"])
    h = np.maximum(_ref_apply(x, w0, p["FP4Dense_0"]["bias"]), 0)
    h = _ref_apply(h, fp4nn.weight_from_params(p["proj"]), p["proj"]["bias"])
    return _ref_apply(h, fp4nn.weight_from_params(p["FP4Dense_1"]))


def test_fp4dense_init_and_apply():
    x = _x(11, (3, 5, 32))
    params = _DenseNet(dense=fp4nn.FP4Dense).init(jax.random.key(0), x)
    layer = params["params"]["FP4Dense_0"]
    assert layer["packed"].shape == (64, 16) and layer["packed"].dtype == jnp.uint8
    assert layer["scale"].shape == (64, 2) and layer["scale"].dtype == jnp.float8_e4m3fn
    assert layer["global_scale"].shape == () and layer["bias"].shape == (64,)
    assert "bias" not in params["params"]["FP4Dense_1"]
    y = _DenseNet(dense=fp4nn.FP4Dense).apply(params, x)
    _assert_close(y, _dense_reference(params, x))
    _assert_close(
        jax.jit(_DenseNet(dense=fp4nn.FP4Dense).apply)(params, x), _dense_reference(params, x)
    )


def test_quantize_params_of_a_model():
    x = _x(12, (4, 32))
    float_params = _DenseNet().init(jax.random.key(1), x)
    y_float = _DenseNet().apply(float_params, x)
    params = fp4nn.quantize_params(float_params)
    assert set(params["params"]) == {"FP4Dense_0", "proj", "FP4Dense_1"}  # auto-names follow
    assert set(float_params["params"]["Dense_0"]) == {"kernel", "bias"}  # input untouched
    w = fp4nn.weight_from_params(params["params"]["proj"])
    expected = jax_fp4.quantize(float_params["params"]["proj"]["kernel"].T)
    np.testing.assert_array_equal(w.packed, expected.packed)
    np.testing.assert_array_equal(np.asarray(w.scale_bytes), np.asarray(expected.scale_bytes))
    y = _DenseNet(dense=fp4nn.FP4Dense).apply(params, x)
    _assert_close(y, _dense_reference(params, x))
    assert reference.relative_error(y, y_float) < 0.3
    # One Dense's params, a filter, and no renaming
    single = fp4nn.quantize_params(float_params["params"]["proj"])
    assert set(single) == {"packed", "scale", "global_scale", "bias"}
    kept = fp4nn.quantize_params(float_params, filter=lambda path: path[-1] == "proj", rename=False)
    assert (
        set(kept["params"]["Dense_0"]) == {"kernel", "bias"} and "packed" in kept["params"]["proj"]
    )
    frozen = fp4nn.quantize_params(nn.FrozenDict(float_params))
    assert isinstance(frozen, nn.FrozenDict) and "packed" in frozen["params"]["proj"]
    searched = fp4nn.weight_from_params(
        fp4nn.quantize_params(float_params, method="mse")["params"]["proj"]
    )
    expected = jax_fp4.quantize(float_params["params"]["proj"]["kernel"].T, method="mse")
    np.testing.assert_array_equal(
        np.asarray(searched.scale_bytes), np.asarray(expected.scale_bytes)
    )
    assert not np.array_equal(np.asarray(searched.scale_bytes), np.asarray(w.scale_bytes))
    broken = jax.tree.map(lambda x: x, float_params)
    broken["params"]["proj"]["kernel"] = broken["params"]["proj"]["kernel"].at[0, 1].set(jnp.nan)
    with pytest.raises(
        ValueError,
        match=r"layer params/proj: quantize: w must be finite.*index \(1, 0\).*Flax kernel transposed",
    ):
        fp4nn.quantize_params(broken)


def test_quantized_models_export_and_run_from_the_serialized_program():
    """jax.export of a quantized nnx model (its state passed as leaves: flax registers no export
    serialization for nnx.State) and of a Linen model (plain dict params)."""
    x = _x(13, (4, 32), jnp.bfloat16)
    model = nnx.Sequential(
        nnx.Linear(32, 48, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(48, 16, rngs=nnx.Rngs(1))
    )
    graphdef, state = nnx.split(fp4nnx.quantize_model(model))
    leaves, treedef = jax.tree.flatten(state)
    run = jax.jit(lambda leaves, x: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(x))
    params = fp4nn.quantize_params(_DenseNet().init(jax.random.key(1), x.astype(jnp.float32)))
    apply = jax.jit(_DenseNet(dense=fp4nn.FP4Dense).apply)
    for fn, args in ((run, (leaves, x)), (apply, (params, x))):
        exported = jax.export.export(
            fn,
            platforms=("cpu",),  # not the GPU beside it, if any
            disabled_checks=jax_fp4.export_disabled_checks(),
        )(*args)
        assert "jax_fp4_matmul_cpu" in exported.mlir_module()
        y = jax.export.deserialize(exported.serialize()).call(*args)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(fn(*args)))


def test_linen_calibrate_and_calibrated_quantize_params():
    x = _x(13, (6, 32))
    float_params = _DenseNet().init(jax.random.key(2), x)
    stats = fp4nn.calibrate(_DenseNet(), float_params, x)
    p = {
        k: {n: np.asarray(a, np.float64) for n, a in v.items()}
        for k, v in float_params["params"].items()
    }
    h0 = np.asarray(x, np.float64)
    h1 = np.maximum(h0 @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0)
    h2 = h1 @ p["proj"]["kernel"] + p["proj"]["bias"]
    assert set(stats) == {("Dense_0",), ("proj",), ("Dense_1",)}
    for path, h in ((("Dense_0",), h0), (("proj",), h1), (("Dense_1",), h2)):
        np.testing.assert_allclose(
            np.asarray(stats[path]), (h**2).mean(axis=0), rtol=1e-4, err_msg=str(path)
        )

    whole = fp4nn.quantize_params(float_params, method="mse", calibration=stats)
    inner = fp4nn.quantize_params(float_params["params"], method="mse", calibration=stats)
    for new_name, old_name in (
        ("FP4Dense_0", "Dense_0"),
        ("proj", "proj"),
        ("FP4Dense_1", "Dense_1"),
    ):
        expected = jax_fp4.quantize(
            float_params["params"][old_name]["kernel"].T,
            method="mse",
            importance=stats[(old_name,)],
        )
        for tree in (whole["params"], inner):
            got = fp4nn.weight_from_params(tree[new_name])
            np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(expected.packed))
            np.testing.assert_array_equal(
                np.asarray(got.scale_bytes), np.asarray(expected.scale_bytes)
            )
    with pytest.raises(ValueError, match="method='mse' only"):
        fp4nn.quantize_params(float_params, calibration=stats)
    with pytest.raises(ValueError, match=r"layer params/proj: calibration has no statistics"):
        fp4nn.quantize_params(
            float_params,
            method="mse",
            calibration={k: v for k, v in stats.items() if k != ("proj",)},
        )


def test_fp4dense_dtype_and_errors():
    x = _x(13, (2, 32), jnp.bfloat16)
    params = fp4nn.FP4Dense(16).init(jax.random.key(0), x)
    assert fp4nn.FP4Dense(16).apply(params, x).dtype == jnp.float32  # promoted, like nn.Dense
    y = fp4nn.FP4Dense(16, dtype=jnp.bfloat16).apply(params, x)
    assert y.dtype == jnp.bfloat16
    p = params["params"]
    ref = _ref_apply(
        np.asarray(x, np.float64),
        fp4nn.weight_from_params(p),
        np.asarray(p["bias"].astype(jnp.bfloat16), np.float64),
    )
    _assert_close(y, ref, jnp.bfloat16)
    with pytest.raises(Exception, match="packed"):
        fp4nn.FP4Dense(16).apply(params, jnp.ones((2, 64)))  # params for K=32
    with pytest.raises(ValueError, match="must be even"):
        fp4nn.quantize_params({"kernel": jnp.ones((7, 4)), "bias": jnp.ones(4)})
    with pytest.raises(KeyError, match="missing"):
        fp4nn.weight_from_params({"packed": p["packed"]})


class _ScanBlock(nn.Module):
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(self.dense(32, bias_init=nn.initializers.normal(0.5))(x)), None


def _scanned(dense):
    return nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(
        dense=dense
    )


def test_nn_scan_of_fp4dense_and_stacked_quantize_params():
    x = _x(14, (4, 32))
    float_params = _scanned(nn.Dense).init(jax.random.key(2), x, None)
    assert float_params["params"]["Dense_0"]["kernel"].shape == (3, 32, 32)
    y_float, _ = _scanned(nn.Dense).apply(float_params, x, None)
    assert (
        "packed" not in fp4nn.quantize_params(float_params)["params"]["Dense_0"]
    )  # 3-D: not by default
    params = fp4nn.quantize_params(float_params, filter=lambda path: path[-1] == "Dense_0")
    p = params["params"]["FP4Dense_0"]
    assert p["packed"].shape == (3, 32, 16) and p["global_scale"].shape == (3,)
    y, _ = _scanned(fp4nn.FP4Dense).apply(params, x, None)
    _assert_close(y, _stacked_reference(x, fp4nn.weight_from_params(p), p["bias"]))
    _assert_quant_noise(y, y_float)
    fresh = _scanned(fp4nn.FP4Dense).init(jax.random.key(3), x, None)
    assert fresh["params"]["FP4Dense_0"]["packed"].shape == (3, 32, 16)


def test_linen_partitioning_metadata():
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    float_params = nn.Dense(16, kernel_init=init).init(jax.random.key(0), jnp.ones((1, 32)))
    specs = nn.get_partition_spec(fp4nn.quantize_params(float_params))["params"]
    assert specs["packed"] == P("model", None) and specs["scale"] == P("model", None)
    assert specs["global_scale"] == P()
    row = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))
    params = fp4nn.FP4Dense(16, kernel_init=row).init(jax.random.key(0), jnp.ones((1, 32)))
    specs = nn.get_partition_spec(params)["params"]
    assert specs["packed"] == P(None, "model") and specs["scale"] == P(None, "model")


@needs_8_devices
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_linen_params_shard_on_a_mesh(axis_type):
    mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2
    )
    dense = fp4nn.FP4Dense(
        64,
        kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")),
        bias_init=nn.with_partitioning(nn.initializers.normal(1.0), ("model",)),
    )
    x = _x(15, (8, 128))
    boxed = dense.init(jax.random.key(4), x)
    shardings = nn.get_sharding(boxed, mesh)
    params = jax.device_put(nn.unbox(boxed), shardings)
    assert params["params"]["packed"].sharding.spec == P("model", None)
    assert params["params"]["bias"].sharding.spec == P("model")
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    y = jax.jit(dense.apply)(params, x_sharded)
    p = params["params"]
    _assert_close(y, _ref_apply(x, fp4nn.weight_from_params(p), p["bias"]))
    tiled = jax.jit(fp4nn.prepack_params)(params)  # keeps the params' shardings
    assert tiled["params"]["packed"].sharding.is_equivalent_to(
        NamedSharding(mesh, P("model", None)), 2
    )
    y_tiled = jax.jit(fp4nn.FP4Dense(64, layout="tiled").apply)(tiled, x_sharded)
    np.testing.assert_array_equal(np.asarray(y_tiled), np.asarray(y))


# ---- the decode GEMV's tiled layout (jax_fp4.prepack) -----------------------------------------


def test_nnx_prepack_model_keeps_results_and_round_trips_checkpoints():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(128, 48, rngs=rngs)
            self.odd = nnx.Linear(48, 40, rngs=rngs)  # K = 48: stays in the spec layout

        def __call__(self, x):
            return self.odd(jnp.tanh(self.up(x)))

    model = fp4nnx.quantize_model(Net(nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(90).standard_normal((3, 128)), jnp.float32)
    before = np.asarray(model(x))
    spec_up = model.up.weight
    assert fp4nnx.prepack_model(model) is model
    assert (model.up.layout, model.odd.layout) == ("tiled", "spec")
    np.testing.assert_array_equal(np.asarray(model(x)), before)
    np.testing.assert_array_equal(
        np.asarray(jax_fp4.unprepack(model.up.weight).packed), spec_up.packed
    )
    # export writes the spec layout; loading into a tiled layer prepacks again
    tensors = fp4nnx.export_weights(model)
    fresh = fp4nnx.prepack_model(fp4nnx.quantize_model(Net(nnx.Rngs(1))))
    fp4nnx.load_weights(
        fresh,
        {
            k: (jax_fp4.unprepack(v) if isinstance(v, jax_fp4.NVFP4Weight) else v)
            for k, v in tensors.items()
        },
    )
    assert fresh.up.layout == "tiled"
    np.testing.assert_array_equal(np.asarray(fresh(x)), before)
    # from_weight keeps a tiled weight's layout; split/merge (jit) keep it too
    layer = fp4nnx.FP4Linear.from_weight(jax_fp4.prepack(spec_up))
    assert layer.layout == "tiled"
    graphdef, state = nnx.split(layer)
    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(model.up(x)))


def test_linen_prepack_params_with_tiled_modules():
    class Net(nn.Module):
        layout: str = "spec"

        @nn.compact
        def __call__(self, x):
            return fp4nn.FP4Dense(32, layout=self.layout)(x)

    x = _x(91, (4, 128))
    params = Net().init(jax.random.key(2), x)
    tiled = fp4nn.prepack_params(params)
    layer = tiled["params"]["FP4Dense_0"]
    assert layer["packed"].shape == (32, 64)
    assert not np.array_equal(layer["packed"], params["params"]["FP4Dense_0"]["packed"])
    np.testing.assert_array_equal(
        np.asarray(Net(layout="tiled").apply(tiled, x)), np.asarray(Net().apply(params, x))
    )
    w = fp4nn.weight_from_params(layer, layout="tiled")
    assert w.layout == "tiled"
    untouched = fp4nn.prepack_params(params, filter=lambda path: False)
    np.testing.assert_array_equal(
        untouched["params"]["FP4Dense_0"]["packed"], params["params"]["FP4Dense_0"]["packed"]
    )
    narrow = Net().init(jax.random.key(3), _x(92, (4, 48)))  # K = 48
    with pytest.raises(ValueError, match=r"prepack_params: layer params/FP4Dense_0: .*K % 128"):
        fp4nn.prepack_params(narrow)
