"""Sharded inference on 8 CPU devices (tests/conftest.py sets the device count), and on every
CUDA device of the machine (marked `gpu`; skipped below two CUDA devices).

Each sharding pattern is checked three ways: values against the float64 NumPy reference on fresh
random inputs, the output sharding, and facts read from the compiled (partitioned) HLO: which
collectives XLA inserted and the per-device shapes the kernel custom call runs on. On the GPUs the
CUDA kernels run per shard under jit + NamedSharding (Auto and Explicit mesh axes), shard_map and
pmap, with the same checks but the kernel's per-device shapes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp4
from jax_fp4 import sharding as _sharding
from tests import reference
from tests._helpers import gpus, load_repo_script, skip_without_several_devices


@pytest.fixture(autouse=True)
def _needs_its_devices(request):
    skip_without_several_devices(request)


KERNEL = "jax_fp4_matmul_cpu"
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


# ---- helpers ------------------------------------------------------------------------------------


def _mesh(shape, names, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _weight(rng, n, k, mesh, spec, *, block_size=16, scale_spec=None):
    """A random NVFP4 weight placed with `spec` (packed and scale), plus its float64 dequant."""
    packed, scale, gs = reference.random_weight(rng, n, k, block_size)
    w = jax_fp4.NVFP4Weight(
        _put(packed, mesh, spec),
        _put(scale, mesh, spec if scale_spec is None else scale_spec),
        _put(gs, mesh, P()),
        block_size=block_size,
    )
    return w, reference.dequantize(packed, scale, gs, block_size)


def _activation(rng, shape, dtype, mesh, spec):
    a = jnp.asarray(rng.standard_normal(shape), dtype)
    return _put(a, mesh, spec), np.asarray(a, np.float64)


def _collectives(hlo: str) -> dict:
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def _kernel_calls(hlo: str) -> list:
    """Per kernel custom call: (result shape, [operand shapes]) as tuples of ints."""
    calls = []
    for line in hlo.splitlines():
        if f'custom_call_target="{KERNEL}"' not in line:
            continue
        result = re.search(r"=\s*\w+\[([\d,]*)\]", line).group(1)
        start = line.index("operand_layout_constraints={") + len("operand_layout_constraints={")
        depth, end = 1, start
        while depth:  # the matching brace (layouts nest {1,0})
            depth += {"{": 1, "}": -1}.get(line[end], 0)
            end += 1
        operands = line[start : end - 1]
        shape = lambda s: tuple(int(d) for d in s.split(",") if d)  # noqa: E731
        calls.append((shape(result), [shape(s) for s in re.findall(r"\w+\[([\d,]*)\]", operands)]))
    return calls


def _compile(f, *args):
    lowered = jax.jit(f).lower(*args)
    return lowered, lowered.compile().as_text()


def _check(y, ref, dtype):
    y64 = np.asarray(y).astype(np.float64)
    assert y64.shape == ref.shape and np.isfinite(y64).all()
    assert reference.relative_error(y64, ref) < reference.TOLERANCE[np.dtype(dtype).name]


def _spec(y):
    return tuple(y.sharding.spec) + (None,) * (y.ndim - len(y.sharding.spec))


def _assert_laid_out_by(lowered, explicit):
    """Auto axes: the kernel sits inside custom_partitioning's call until XLA partitions it.
    Explicit axes: the sharding types lay it out at trace time, as a shard_map (no callback)."""
    text = lowered.as_text()
    assert ("CustomSPMDPartitioning" in text) == (not explicit)
    assert ("sdy.manual_computation" in text) == explicit


# ---- the three patterns on a 1-D mesh -----------------------------------------------------------


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_column_parallel_shards_n_with_no_collective(dtype, explicit):
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",), explicit)
    n, k = 128, 96
    w, w64 = _weight(rng, n, k, mesh, P("x", None))
    a, a64 = _activation(rng, (3, 5, k), dtype, mesh, P())  # leading dims, replicated
    bias = _put(jnp.asarray(rng.standard_normal(n), dtype), mesh, P("x"))
    lowered, hlo = _compile(jax_fp4.matmul, a, w, bias)

    y = jax.jit(jax_fp4.matmul)(a, w, bias)
    _check(y, a64 @ w64.T + np.asarray(bias, np.float64), dtype)
    assert _spec(y) == (None, None, "x")
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    # One kernel call per device on its 16 columns: a [15, K], packed [16, K/2], scale [16, KB],
    # bias [16]; the result [15, 16].
    [(out, ops)] = _kernel_calls(hlo)
    assert out == (15, n // 8)
    assert ops == [(15, k), (n // 8, k // 2), (n // 8, k // 16), (), (n // 8,)]
    _assert_laid_out_by(lowered, explicit)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_parallel_is_one_all_reduce_and_adds_bias_once(dtype, explicit):
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",), explicit)
    n, k = 48, 512  # 8 shards of 4 scale blocks
    w, w64 = _weight(rng, n, k, mesh, P(None, "x"))
    a, a64 = _activation(rng, (2, 6, k), dtype, mesh, P(None, None, "x"))
    # A large bias: adding it on every shard (8x) would be far outside the tolerance.
    bias_np = 50.0 * rng.standard_normal(n)
    bias = _put(jnp.asarray(bias_np, dtype), mesh, P())
    lowered, hlo = _compile(jax_fp4.matmul, a, w, bias)
    _assert_laid_out_by(lowered, explicit)

    y = jax.jit(jax_fp4.matmul)(a, w, bias)
    _check(y, a64 @ w64.T + np.asarray(bias, np.float64), dtype)
    assert _spec(y) == (None, None, None)
    counts = _collectives(hlo)
    assert counts["all-gather"] == 0
    assert counts == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    # The all-reduce sums float32 partial products of the whole output [2, 6, N].
    [reduce_line] = [ln for ln in hlo.splitlines() if re.search(r"\ball-reduce(?:-start)?\(", ln)]
    assert re.search(rf"= f32\[2,6,{n}\]", reduce_line), reduce_line
    # Each device multiplies its K slice (64 = 4 blocks), without bias (empty bias operand).
    [(out, ops)] = _kernel_calls(hlo)
    assert out == (12, n)
    assert ops == [(12, k // 8), (n, k // 16), (n, k // 128), (), (0,)]


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
@pytest.mark.parametrize("lead_spec", [P("x", None, None), P(None, "x", None)])
def test_data_parallel_keeps_leading_dims_sharded(lead_spec, explicit):
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",), explicit)
    n, k = 40, 80
    w, w64 = _weight(rng, n, k, mesh, P())  # replicated weight
    a, a64 = _activation(rng, (8, 16, k), "bfloat16", mesh, lead_spec)
    lowered, hlo = _compile(jax_fp4.matmul, a, w)
    _assert_laid_out_by(lowered, explicit)

    y = jax.jit(jax_fp4.matmul)(a, w)
    _check(y, a64 @ w64.T, "bfloat16")
    assert _spec(y) == tuple(lead_spec)
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    [(out, ops)] = _kernel_calls(hlo)
    assert out == (128 // 8, n) and ops[0] == (128 // 8, k) and ops[1] == (n, k // 2)


# ---- 2-D meshes: data parallel combined with tensor parallel -------------------------------------


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_2d_mesh_data_and_tensor_parallel(mode, explicit):
    rng = np.random.default_rng()
    mesh = _mesh((2, 4), ("data", "model"), explicit)
    n, k = 64, 256
    w_spec, a_spec, out_spec = {
        "column": (P("model", None), P("data", None), ("data", "model")),
        "row": (P(None, "model"), P("data", "model"), ("data", None)),
    }[mode]
    w, w64 = _weight(rng, n, k, mesh, w_spec)
    a, a64 = _activation(rng, (10, k), "float32", mesh, a_spec)
    lowered, hlo = _compile(jax_fp4.matmul, a, w)
    _assert_laid_out_by(lowered, explicit)

    y = jax.jit(jax_fp4.matmul)(a, w)
    _check(y, a64 @ w64.T, "float32")
    assert _spec(y) == out_spec
    counts = _collectives(hlo)
    assert counts == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": int(mode == "row")}
    if mode == "row":  # reduced over the 4 "model" devices of each data replica only
        assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in hlo or "replica_groups=[2,4]<=[8]" in hlo
    [(out, ops)] = _kernel_calls(hlo)
    assert ops[0] == ((5, k) if mode == "column" else (5, k // 4))
    assert out == ((5, n // 4) if mode == "column" else (5, n))


def test_two_layer_tensor_parallel_mlp_needs_one_all_reduce():
    """Column-parallel up projection -> gelu -> row-parallel down projection (Megatron)."""
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",))
    d, h = 64, 256
    up, up64 = _weight(rng, h, d, mesh, P("x", None))
    down, down64 = _weight(rng, d, h, mesh, P(None, "x"))
    b_up = _put(jnp.asarray(rng.standard_normal(h), jnp.float32), mesh, P("x"))
    b_down = _put(jnp.asarray(rng.standard_normal(d), jnp.float32), mesh, P())
    x, x64 = _activation(rng, (4, 3, d), "float32", mesh, P())

    def mlp(x, up, b_up, down, b_down):
        return jax_fp4.matmul(jax.nn.relu(jax_fp4.matmul(x, up, b_up)), down, b_down)

    _, hlo = _compile(mlp, x, up, b_up, down, b_down)
    y = jax.jit(mlp)(x, up, b_up, down, b_down)
    hid = np.maximum(x64 @ up64.T + np.asarray(b_up, np.float64), 0)
    _check(y, hid @ down64.T + np.asarray(b_down, np.float64), "float32")
    assert _collectives(hlo) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    shapes = sorted(ops[1] for _, ops in _kernel_calls(hlo))
    assert shapes == sorted([(h // 8, d // 2), (d, h // 16)])  # local weight shards only


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_grad_under_tensor_parallel_weights(mode, explicit):
    """dA = dY @ dequant(W) partitions too (pure JAX in the transpose rule): no weight gather.
    Under explicit axes dA is typed like a."""
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",), explicit)
    w_spec, a_spec = {"column": (P("x", None), P()), "row": (P(None, "x"), P(None, "x"))}[mode]
    w, w64 = _weight(rng, 64, 256, mesh, w_spec)
    a, _ = _activation(rng, (6, 256), "float32", mesh, a_spec)
    bias = _put(jnp.asarray(rng.standard_normal(64), jnp.float32), mesh, P(w_spec[0]))  # like N
    ct = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    f = jax.grad(lambda a, b, w: jnp.sum(jax_fp4.matmul(a, w, b) * ct), argnums=(0, 1))
    _, hlo = _compile(f, a, bias, w)
    da, db = jax.jit(f)(a, bias, w)
    _check(da, np.asarray(ct, np.float64) @ w64, "float32")
    _check(db, np.asarray(ct, np.float64).sum(0), "float32")
    if explicit:
        assert _spec(da) == _spec(a)
    # Column parallel: dA contracts over the sharded N, so one all-reduce; row parallel: none.
    assert _collectives(hlo) == {
        **dict.fromkeys(COLLECTIVES, 0),
        "all-reduce": int(mode == "column"),
    }


def _stacked(rng, e, n, k, mesh, spec, *, unit_gain=False):
    parts = [reference.random_weight(rng, n, k, unit_gain=unit_gain) for _ in range(e)]
    packed, scale, gs = (np.stack(x) for x in zip(*parts))
    ws = jax_fp4.NVFP4Weight(_put(packed, mesh, spec), _put(scale, mesh, spec), _put(gs, mesh, P()))
    return ws, np.stack([reference.dequantize(*p, 16) for p in parts])


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_vmap_over_column_parallel_experts(explicit):
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",), explicit)
    ws, w64 = _stacked(rng, 3, 64, 96, mesh, P(None, "x", None))  # each expert N-sharded
    a, a64 = _activation(rng, (5, 96), "float32", mesh, P())
    f = jax.vmap(jax_fp4.matmul, in_axes=(None, 0))
    _, hlo = _compile(f, a, ws)
    y = jax.jit(f)(a, ws)
    _check(y, np.einsum("mk,enk->emn", a64, w64), "float32")
    assert _spec(y) == (None, None, "x")
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    [(_, ops)] = _kernel_calls(hlo)
    assert ops[1] == (8, 48)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_scan_over_row_parallel_layers(explicit):
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",), explicit)
    layers, d = 3, 128
    # Each layer K-sharded; unit gain keeps the tanh chain conditioned (reference.py says why).
    ws, w64 = _stacked(rng, layers, d, d, mesh, P(None, None, "x"), unit_gain=True)
    h0, h64 = _activation(rng, (4, d), "float32", mesh, P())

    def net(h, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(jax_fp4.matmul(h, w)), None), h, ws)[0]

    _, hlo = _compile(net, h0, ws)
    y = jax.jit(net)(h0, ws)
    for i in range(layers):
        h64 = np.tanh(h64 @ w64[i].T)
    _check(y, h64, "float32")
    # One all-reduce in the loop body (once per layer at run time), and no gather of any layer.
    # Under explicit axes the partitioner keeps the carry K-sharded inside the loop (the kernel's
    # operand) and gathers the [4, d] activation once, after it.
    assert _collectives(hlo) == {
        **dict.fromkeys(COLLECTIVES, 0),
        "all-reduce": 1,
        "all-gather": int(explicit),
    }
    assert re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo) == [f"4,{d}"] * int(explicit)
    [(_, ops)] = _kernel_calls(hlo)
    assert ops[1] == (d, d // 16)


def _dequant_then_dot(a, packed, scale, global_scale, bias, *, block_size):
    """A pure-JAX path implementation shaped like the CUDA dequant path (jax_fp4.dequantize holds
    no array constant, which the body custom_partitioning traces may not capture)."""
    w = jax_fp4.dequantize(jax_fp4.NVFP4Weight(packed, scale, global_scale, block_size=block_size))
    y = jnp.matmul(a.astype(jnp.float32), w.T, precision="highest")
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(a.dtype)


@pytest.mark.parametrize("mode", ["column", "row", "data"])
def test_rules_serve_any_path_implementation(mode):
    """The CUDA paths (gemv, dequant) get the same wrapper; they cannot run here, so wrap a pure-JAX
    implementation (N-D a, no reshape: like dequant) and check the plan and the values."""
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",))
    n, k = 64, 256
    w_spec, a_spec, b_spec = {
        "column": (P("x", None), P(), P("x")),
        "row": (P(None, "x"), P(None, None, "x"), P()),
        "data": (P(), P("x", None, None), P()),
    }[mode]
    w, w64 = _weight(rng, n, k, mesh, w_spec)
    a, a64 = _activation(rng, (8, 3, k), "bfloat16", mesh, a_spec)
    bias = _put(jnp.asarray(10 * rng.standard_normal(n), jnp.bfloat16), mesh, b_spec)
    call = _sharding.partitioned(_dequant_then_dot, block_size=16, has_bias=True, a_ndim=3, k=k)
    f = lambda a, w, b: call(a, w.packed, w.scale, w.global_scale, b, block_size=16)  # noqa: E731
    _, hlo = _compile(f, a, w, bias)
    _check(jax.jit(f)(a, w, bias), a64 @ w64.T + np.asarray(bias, np.float64), "bfloat16")
    assert _collectives(hlo) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": int(mode == "row")}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("mode", ["column", "row", "data"])
def test_pure_jax_paths_are_partitioned_by_xla_itself(mode, backend, explicit):
    """backends xla and reference are plain JAX (no custom call, no rule): XLA's partitioner
    keeps the weight where it is by itself, with the same collectives as the kernels' rules."""
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",), explicit)
    n, k = 64, 256
    w_spec, a_spec, out_spec = {
        "column": (P("x", None), P(), (None, "x")),
        "row": (P(None, "x"), P(None, "x"), (None, None)),
        "data": (P(), P("x", None), ("x", None)),
    }[mode]
    w, w64 = _weight(rng, n, k, mesh, w_spec)
    a, a64 = _activation(rng, (8, k), "bfloat16", mesh, a_spec)
    f = lambda a, w: jax_fp4.matmul(a, w, backend=backend)  # noqa: E731
    _, hlo = _compile(f, a, w)
    y = jax.jit(f)(a, w)
    _check(y, a64 @ w64.T, "bfloat16")
    assert _spec(y) == out_spec
    assert _collectives(hlo) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": int(mode == "row")}
    assert KERNEL not in hlo


# ---- fallbacks, and proof that the HLO checks would catch a gathered weight -----------------------


def test_without_the_rules_xla_gathers_the_weight(monkeypatch):
    """The check is meaningful: with the partitioning rules switched off, the same column-parallel
    program all-gathers the weight (what an FFI call without rules does)."""
    monkeypatch.setenv("JAX_FP4_CUSTOM_PARTITIONING", "0")
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",))
    w, w64 = _weight(rng, 64, 64, mesh, P("x", None))
    a, a64 = _activation(rng, (4, 64), "float32", mesh, P())
    f = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731 - a fresh function: no cached lowering
    _, hlo = _compile(f, a, w)
    _check(jax.jit(f)(a, w), a64 @ w64.T, "float32")
    assert _collectives(hlo)["all-gather"] >= 1
    [(_, ops)] = _kernel_calls(hlo)
    assert ops[1] == (64, 32)  # the whole weight on each device


@pytest.mark.parametrize(
    "k, block_size, scale_spec",
    [
        (192, 16, P()),  # 12 scale blocks do not split 8 ways
        (128, 32, P()),  # 8 shards of 16 elements would cut each 32-block in half
    ],
)
def test_row_parallel_on_unaligned_k_gathers_k(k, block_size, scale_spec):
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",))
    w, w64 = _weight(rng, 24, k, mesh, P(None, "x"), block_size=block_size, scale_spec=scale_spec)
    a, a64 = _activation(rng, (5, k), "float32", mesh, P(None, "x"))
    _, hlo = _compile(jax_fp4.matmul, a, w)
    _check(jax.jit(jax_fp4.matmul)(a, w), a64 @ w64.T, "float32")
    assert _collectives(hlo)["all-reduce"] == 0 and _collectives(hlo)["all-gather"] >= 1
    [(_, ops)] = _kernel_calls(hlo)
    assert ops[1] == (24, k // 2)


def test_plan_explains_each_fallback():
    mesh = _mesh((2, 4), ("data", "model"))
    sh = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    lead, n_axes, k_axes, why = _sharding.plan(
        mesh, (8, 64), sh("data", "model"), sh(None, "model"), n=32, k=64, block_size=16
    )
    assert (lead, n_axes, k_axes, why) == ([("data",)], (), ("model",), [])
    _, _, k_axes, why = _sharding.plan(
        mesh, (8, 48), sh(), sh(None, "model"), n=32, k=48, block_size=16
    )
    assert k_axes == () and "block_size" in why[0]
    _, n_axes, _, why = _sharding.plan(
        mesh, (8, 64), sh(), sh("model", None), n=30, k=64, block_size=16
    )
    assert n_axes == () and "not divisible" in why[0]
    lead, n_axes, _, why = _sharding.plan(
        mesh, (8, 64), sh("model", None), sh("model", None), n=32, k=64, block_size=16
    )
    assert lead == [()] and n_axes == ("model",) and "overlap" in why[0]
    # The path's own K limits hold for the local slice: gemv needs K % 32 == 0.
    gemv_check = _sharding._local_k_check("gemv", 16, np.dtype("float16"))
    _, _, k_axes, why = _sharding.plan(
        mesh, (8, 64), sh(), sh(None, "model"), n=32, k=64, block_size=16, local_k_check=gemv_check
    )
    assert k_axes == () and "multiple of 32" in why[0]
    _, _, k_axes, _ = _sharding.plan(
        mesh,
        (8, 128),
        sh(),
        sh(None, "model"),
        n=32,
        k=128,
        block_size=16,
        local_k_check=gemv_check,
    )
    assert k_axes == ("model",)
    assert _sharding._local_k_check("cpu", 16, np.dtype("float16")) is None
    fused_check = _sharding._local_k_check("fused", 16, np.dtype("float16"))
    assert fused_check(256) is None and "multiple of 128" in fused_check(192)


# ---- explicit sharding types, eager calls, what the lowered HLO shows ------------------------------


def test_explicit_axes_mesh_with_leading_dims():
    """jax.make_mesh's default (Explicit axes): a [B, S, K] sharded on S, column-parallel weight."""
    rng = np.random.default_rng()
    mesh = _mesh((2, 4), ("data", "model"), explicit=True)
    w, w64 = _weight(rng, 32, 64, mesh, P("model", None))
    a, a64 = _activation(rng, (3, 4, 64), "float32", mesh, P(None, "data", None))
    _, hlo = _compile(jax_fp4.matmul, a, w)
    y = jax.jit(jax_fp4.matmul)(a, w)
    _check(y, a64 @ w64.T, "float32")
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    [(out, _)] = _kernel_calls(hlo)
    assert out == (6, 8)


def test_result_sharding_type_for_explicit_axes():
    """The sharding type the result would carry under explicit axes (helper for abstract eval)."""
    mesh = _mesh((2, 4), ("data", "model"), explicit=True).abstract_mesh
    aval = lambda shape, spec, dtype=jnp.float32: jax.core.ShapedArray(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, spec)
    )
    row = _sharding.result_sharding(
        aval((4, 16, 256), P(None, "data", "model")), aval((64, 128), P(None, "model"), jnp.uint8)
    )
    assert row.spec == P(None, "data", None)
    col = _sharding.result_sharding(
        aval((16, 256), P("model", None)), aval((64, 128), P("model", None), jnp.uint8)
    )
    assert col.spec == P(None, "model")  # the weight's N wins over a's rows
    plain = jax.core.ShapedArray((16, 256), jnp.float32)
    assert _sharding.result_sharding(plain, jax.core.ShapedArray((64, 128), jnp.uint8)) is None


def test_weight_shardings_place_every_array():
    """NVFP4Weight.shardings: the logical [..., N, K] sharding -> one per array, for device_put
    (NamedSharding) and shard_map in_specs (PartitionSpec); stacked and SM120-prepacked too."""
    rng = np.random.default_rng()
    mesh = _mesh((2, 4), ("data", "model"))
    packed, scale, gs = reference.random_weight(rng, 64, 256)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    placed = jax.device_put(w, w.shardings(NamedSharding(mesh, P(None, "model"))))
    assert [x.sharding.spec for x in jax.tree.leaves(placed)] == [
        P(None, "model"),
        P(None, "model"),
        P(),
    ]
    assert [x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(placed)] == [
        (64, 32),
        (64, 4),
        (),
    ]
    a, a64 = _activation(rng, (6, 256), "float32", mesh, P(None, "model"))
    _check(
        jax.jit(jax_fp4.matmul)(a, placed),
        a64 @ reference.dequantize(packed, scale, gs, 16).T,
        "float32",
    )

    stacked = jax_fp4.NVFP4Weight(np.stack([packed] * 3), np.stack([scale] * 3), np.stack([gs] * 3))
    specs = stacked.shardings(P("data", "model"))  # missing trailing entries: replicated
    assert jax.tree.leaves(specs) == [P("data", "model", None)] * 2 + [P("data")]
    assert specs.block_size == 16 and specs.layout == "spec"
    tiled = jax_fp4.prepack(w).shardings(P("model"))
    assert tiled.layout == "tiled" and jax.tree.leaves(tiled) == [P("model", None)] * 2 + [P()]
    sm120 = jax_fp4.prepack(w, target="sm120").shardings(P("model", None))
    assert type(sm120) is jax_fp4.PrepackedNVFP4Weight
    assert jax.tree.leaves(sm120) == [P("model", None)] * 2 + [P(), P(None, None)]

    with pytest.raises(
        TypeError,
        match="sharding must be a PartitionSpec or NamedSharding over the "
        "weight's \\[..., N, K\\], got tuple",
    ):
        w.shardings(("model", None))
    with pytest.raises(ValueError, match="has 3 entries for a weight of rank 2"):
        w.shardings(P(None, "model", None))


@pytest.mark.parametrize("spec", [P("model", None), P(None, "model"), P("data", "model")])
def test_weight_transforms_under_explicit_axes(spec):
    """quantize, prepack (tiled, sm120), unprepack and dequantize on weights typed sharded (the
    layout transforms run per shard on whole tiles): the same bytes as unsharded, the input's
    sharding type kept, and matmul on the prepacked weight right on every CPU path."""
    rng = np.random.default_rng()
    mesh = _mesh((2, 4), ("data", "model"), explicit=True)
    n, k = 256, 512
    dense = rng.standard_normal((n, k)).astype(np.float32)
    sharded = _put(dense, mesh, spec)
    same = lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # noqa: E731
    for method in ("modelopt", "mse"):
        want = jax_fp4.quantize(dense, method=method)
        got = jax.jit(lambda w: jax_fp4.quantize(w, method=method))(sharded)
        jax.tree.map(same, got, want)
        assert _spec(got.packed) == _spec(sharded)
    w = got
    tiled = jax.jit(jax_fp4.prepack)(w)
    jax.tree.map(same, tiled, jax_fp4.prepack(want))
    assert tiled.layout == "tiled" and _spec(tiled.packed) == _spec(tiled.scale) == _spec(sharded)
    jax.tree.map(same, jax.jit(jax_fp4.unprepack)(tiled), want)
    sm120 = jax.jit(lambda w: jax_fp4.prepack(w, target="sm120"))(w)
    same(sm120.swizzled_scale, jax_fp4.prepack(want, target="sm120").swizzled_scale)
    same(jax.jit(jax_fp4.dequantize)(tiled), jax_fp4.dequantize(want))

    w64 = reference.dequantize(
        np.asarray(want.packed), np.asarray(want.scale_bytes), np.asarray(want.global_scale), 16
    )
    a, a64 = _activation(rng, (6, k), "bfloat16", mesh, P("data", None))
    for backend in ("cpu", "reference", "xla"):
        y = jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend=backend))(a, tiled)
        _check(y, a64 @ w64.T, "bfloat16")


def test_mesh_mixing_explicit_and_auto_axes():
    """Explicit "data", Auto "model": the partitioning rules (custom_partitioning) lay the kernel
    out, and the result's type carries the Explicit axis only."""
    rng = np.random.default_rng()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    w, w64 = _weight(rng, 64, 256, mesh, P("model", None))
    a, a64 = _activation(rng, (16, 256), "float32", mesh, P("data", None))
    lowered, hlo = _compile(jax_fp4.matmul, a, w)
    y = jax.jit(jax_fp4.matmul)(a, w)
    _check(y, a64 @ w64.T, "float32")
    assert _spec(y) == ("data", "model")
    assert tuple(jax.typeof(y).sharding.spec) in (("data",), ("data", None))
    _assert_laid_out_by(lowered, explicit=False)
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)


def test_eager_call_on_sharded_operands():
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",))
    w, w64 = _weight(rng, 64, 32, mesh, P("x", None))
    a, a64 = _activation(rng, (16, 32), "float16", mesh, P())
    y = jax_fp4.matmul(a, w)  # no jit
    _check(y, a64 @ w64.T, "float16")
    assert _spec(y) == (None, "x")
    assert [s.data.shape for s in y.addressable_shards] == [(16, 8)] * 8


def test_single_device_program_is_unchanged():
    """Without a mesh, 8 devices or not, the kernel call is inlined as before: the FFI target is in
    the lowered text and no custom_partitioning call is."""
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, 16, 32)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    a = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    text = jax.jit(jax_fp4.matmul).lower(a, w).as_text()
    assert KERNEL in text and "CustomSPMDPartitioning" not in text


# ---- shard_map and pmap: the kernel runs per shard -------------------------------------------------


def test_shard_map_tensor_parallel_mlp():
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",))
    d, h = 32, 128
    up, up64 = _weight(rng, h, d, mesh, P("x", None))
    down, down64 = _weight(rng, d, h, mesh, P(None, "x"))
    x, x64 = _activation(rng, (6, d), "float32", mesh, P())

    def local(x, up, down):  # x replicated, up: 16 of h rows, down: 16 of h columns
        hid = jax.nn.relu(jax_fp4.matmul(x, up))
        return jax.lax.psum(jax_fp4.matmul(hid, down), "x")

    f = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), up.shardings(P("x", None)), down.shardings(P(None, "x"))),
            out_specs=P(),
        )
    )
    y = f(x, up, down)
    _check(y, np.maximum(x64 @ up64.T, 0) @ down64.T, "float32")
    lowered = f.lower(x, up, down)
    assert KERNEL in lowered.as_text() and "CustomSPMDPartitioning" not in lowered.as_text()
    hlo = lowered.compile().as_text()
    assert _collectives(hlo) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    assert sorted(ops[1] for _, ops in _kernel_calls(hlo)) == sorted([(16, 16), (32, 8)])


def test_shard_map_over_some_axes_lays_the_rest_out_by_type():
    """A shard_map manual over "data" only, "model" Explicit: inside, the weight's type is still
    split over "model", and the kernel runs on those shards (nested by the types), not on a
    gathered weight. (The boundary itself replicates what in_specs do not name: that gather is
    shard_map's.)"""
    rng = np.random.default_rng()
    mesh = _mesh((2, 4), ("data", "model"), explicit=True)
    w, w64 = _weight(rng, 64, 256, mesh, P("model", None))
    a, a64 = _activation(rng, (8, 256), "float32", mesh, P("data", None))
    f = jax.jit(
        jax.shard_map(
            jax_fp4.matmul,
            mesh=mesh,
            in_specs=(P("data", None), w.shardings(P())),
            out_specs=P("data", None),
            axis_names={"data"},
        )
    )
    with jax.set_mesh(mesh):
        y = f(a, w)
        hlo = f.lower(a, w).compile().as_text()
    _check(y, a64 @ w64.T, "float32")
    [(out, ops)] = _kernel_calls(hlo)
    assert out == (4, 16) and ops[1] == (16, 128)


def test_pmap_runs_the_kernel_per_device():
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, 24, 48)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    w64 = reference.dequantize(packed, scale, gs, 16)
    a = jnp.asarray(rng.standard_normal((8, 3, 48)), jnp.bfloat16)
    y = jax.pmap(jax_fp4.matmul, in_axes=(0, None))(a, w)
    _check(y, np.asarray(a, np.float64) @ w64.T, "bfloat16")
    # Stacked weights: one per device.
    stacked = [reference.random_weight(rng, 24, 48) for _ in range(8)]
    ws = jax_fp4.NVFP4Weight(*(np.stack(x) for x in zip(*stacked)))
    y = jax.pmap(jax_fp4.matmul)(a, ws)
    ref = np.stack(
        [np.asarray(a[i], np.float64) @ reference.dequantize(*stacked[i], 16).T for i in range(8)]
    )
    _check(y, ref, "bfloat16")


def test_sharded_inference_example():
    example = load_repo_script("examples/sharded_inference.py")
    facts = example.main(verbose=False)
    assert facts["mesh"] == {"data": 2, "model": 4}
    for name in ("jit + NamedSharding", "shard_map", "explicit axes, exported"):
        assert facts[name]["relative_error"] < reference.TOLERANCE["bfloat16"]
        assert facts[name]["collectives"] == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
        spec = facts[name]["output_spec"]  # ("data",) or ("data", None)
        assert spec[0] == "data" and all(e is None for e in spec[1:]), spec


# ---- the GEMV's tiled layout (jax_fp4.prepack) ----------------------------------------------------


def _tiled_weight(rng, n, k, mesh, spec):
    """A random weight in the tiled layout placed with `spec`, plus its float64 dequant."""
    packed, scale, gs = reference.random_weight(rng, n, k)
    t = jax_fp4.prepack(jax_fp4.NVFP4Weight(packed, scale, gs))
    w = jax_fp4.NVFP4Weight(
        _put(np.asarray(t.packed), mesh, spec),
        _put(np.asarray(t.scale), mesh, spec),
        _put(gs, mesh, P()),
        layout="tiled",
    )
    return w, reference.dequantize(packed, scale, gs, 16)


@pytest.mark.parametrize(
    "n, spec, n_local, k_local",
    [
        (256, P("x", None), 32, 256),  # 8 shards of 32 rows keep the 16-row tiles whole
        (128, P("x", None), 16, 256),  # one tile per shard
        (64, P(None, "x"), 64, 256),  # row parallel would cut the tiles' K: K gathered
        (96, P("x", None), 96, 256),  # 12-row shards would cut the tiles: N gathered
    ],
)
def test_tiled_weights_shard_only_along_whole_tiles(n, spec, n_local, k_local):
    rng = np.random.default_rng()
    mesh = _mesh((8,), ("x",))
    k = 256
    w, w64 = _tiled_weight(rng, n, k, mesh, spec)
    a, a64 = _activation(rng, (5, k), "float32", mesh, P())
    _, hlo = _compile(jax_fp4.matmul, a, w)
    _check(jax.jit(jax_fp4.matmul)(a, w), a64 @ w64.T, "float32")
    [(_, ops)] = _kernel_calls(hlo)
    assert ops[1] == (n_local, k_local // 2)
    assert (_collectives(hlo)["all-gather"] >= 1) == (n_local == n)


def test_plan_for_the_tiled_layout():
    mesh = _mesh((2, 4), ("data", "model"))
    sh = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    _, n_axes, _, why = _sharding.plan(
        mesh, (8, 256), sh(), sh("model", None), n=96, k=256, block_size=16, tiled=True
    )
    assert n_axes == () and "16-row tiles" in why[0]  # 96 / 4 = 24 rows per shard
    _, n_axes, _, why = _sharding.plan(
        mesh, (8, 256), sh(), sh("model", None), n=128, k=256, block_size=16, tiled=True
    )
    assert n_axes == ("model",) and why == []
    _, _, k_axes, why = _sharding.plan(
        mesh, (8, 256), sh(), sh(None, "model"), n=128, k=256, block_size=16, tiled=True
    )
    assert k_axes == () and "hold all of K" in why[0]


# ---- the CUDA kernels on every GPU of the machine ---------------------------------------------------

CUDA_TARGETS = ("jax_fp4_gemv_cuda", "jax_fp4_dequant_cuda", "jax_fp4_fused_cuda")


def _gpu_mesh(explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    found = gpus()
    return jax.make_mesh((len(found),), ("x",), axis_types=(kind,), devices=found)


def _gpu_weight(rng, n, k, mesh, spec, layout):
    """A random weight in `layout`, its arrays placed by the logical [N, K] `spec`, and its
    float64 dequantization."""
    packed, scale, gs = reference.random_gpu_weight(rng, n, k)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    w64 = reference.dequantize(packed, scale, gs, 16)
    return jax.device_put(w, w.shardings(NamedSharding(mesh, spec))), w64


def _cuda_kernels(hlo: str) -> set:
    return {t for t in CUDA_TARGETS if f'custom_call_target="{t}"' in hlo}


# Decode (the GEMV), the fused GEMM's range and a prefill past it, per shard.
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 48, 640])
@pytest.mark.parametrize("layout", ["spec", "tiled"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_column_parallel_runs_the_kernels_per_gpu(m, layout, explicit):
    rng = np.random.default_rng()
    mesh = _gpu_mesh(explicit)
    n, k = 256 * len(gpus()), 1024
    w, w64 = _gpu_weight(rng, n, k, mesh, P("x", None), layout)
    a = _put(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), mesh, P())
    bias = _put(jnp.asarray(rng.standard_normal(n), jnp.bfloat16), mesh, P("x"))
    f = jax.jit(jax_fp4.matmul)
    hlo = f.lower(a, w, bias).compile().as_text()
    y = f(a, w, bias)
    _check(y, np.asarray(a, np.float64) @ w64.T + np.asarray(bias, np.float64), "bfloat16")
    assert _spec(y) == (None, "x")
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    assert _cuda_kernels(hlo), "no jax_fp4 CUDA kernel in the partitioned program"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 48])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_row_parallel_is_one_all_reduce_on_gpus(m, explicit):
    rng = np.random.default_rng()
    mesh = _gpu_mesh(explicit)
    n, k = 384, 512 * len(gpus())  # K shards of 512: whole blocks
    w, w64 = _gpu_weight(rng, n, k, mesh, P(None, "x"), "spec")
    a = _put(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), mesh, P(None, "x"))
    bias_np = 50.0 * rng.standard_normal(n)  # added per shard would show
    bias = _put(jnp.asarray(bias_np, jnp.bfloat16), mesh, P())
    f = jax.jit(jax_fp4.matmul)
    hlo = f.lower(a, w, bias).compile().as_text()
    y = f(a, w, bias)
    _check(y, np.asarray(a, np.float64) @ w64.T + np.asarray(bias, np.float64), "bfloat16")
    assert _collectives(hlo) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    assert _cuda_kernels(hlo)


@pytest.mark.gpu
def test_data_parallel_decode_keeps_the_batch_sharded():
    rng = np.random.default_rng()
    mesh = _gpu_mesh()
    n, k = 1000, 2048  # ragged N: the spec layout
    w, w64 = _gpu_weight(rng, n, k, mesh, P(), "spec")
    # The path is picked from the global M (here <= 16 on up to 8 GPUs: the GEMV), run on each
    # GPU's rows.
    a = _put(
        jnp.asarray(rng.standard_normal((2 * len(gpus()), k)), jnp.float16), mesh, P("x", None)
    )
    f = jax.jit(jax_fp4.matmul)
    hlo = f.lower(a, w).compile().as_text()
    y = f(a, w)
    _check(y, np.asarray(a, np.float64) @ w64.T, "float16")
    assert _spec(y) == ("x", None)
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    assert _cuda_kernels(hlo) == {"jax_fp4_gemv_cuda"}


@pytest.mark.gpu
def test_shard_map_tensor_parallel_mlp_on_gpus():
    rng = np.random.default_rng()
    mesh = _gpu_mesh()
    d, h = 512, 1024 * len(gpus())
    up, up64 = _gpu_weight(rng, h, d, mesh, P("x", None), "tiled")
    down, down64 = _gpu_weight(rng, d, h, mesh, P(None, "x"), "spec")
    x = jnp.asarray(rng.standard_normal((6, d)), jnp.bfloat16)

    def local(x, up, down):  # x replicated; up: this GPU's rows of h, down: its columns
        hid = jax.nn.relu(jax_fp4.matmul(x, up))
        return jax.lax.psum(jax_fp4.matmul(hid, down).astype(jnp.float32), "x")

    f = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), up.shardings(P("x", None)), down.shardings(P(None, "x"))),
            out_specs=P(),
        )
    )
    y = f(x, up, down)
    # The hidden activations are rounded to bf16 between the two matmuls, as the kernels see them.
    hid = np.maximum(np.asarray(x, np.float64) @ up64.T, 0)
    hid = np.asarray(jnp.asarray(hid, jnp.bfloat16), np.float64)
    _check(y, hid @ down64.T, "bfloat16")


@pytest.mark.gpu
def test_pmap_runs_the_kernels_per_gpu():
    rng = np.random.default_rng()
    count, n, k = len(gpus()), 300, 1024
    a = jnp.asarray(rng.standard_normal((count, 3, k)), jnp.bfloat16)
    stacked = [reference.random_gpu_weight(rng, n, k) for _ in range(count)]
    ws = jax_fp4.NVFP4Weight(*(np.stack(x) for x in zip(*stacked)))
    y = jax.pmap(jax_fp4.matmul, devices=gpus())(a, ws)
    assert {d.platform for d in y.sharding.device_set} == {"gpu"}
    ref = np.stack(
        [
            np.asarray(a[i], np.float64) @ reference.dequantize(*stacked[i], 16).T
            for i in range(count)
        ]
    )
    _check(y, ref, "bfloat16")


@pytest.mark.gpu
def test_sharded_inference_example_on_gpus():
    example = load_repo_script("examples/sharded_inference.py")
    facts = example.main(verbose=False)
    assert facts["mesh"]["data"] * facts["mesh"]["model"] == len(gpus())
    for name in ("jit + NamedSharding", "shard_map", "explicit axes, exported"):
        assert facts[name]["relative_error"] < reference.TOLERANCE["bfloat16"]
        expected = int(facts["mesh"]["model"] > 1)  # the row-parallel sum
        assert facts[name]["collectives"] == {
            **dict.fromkeys(COLLECTIVES, 0),
            "all-reduce": expected,
        }
