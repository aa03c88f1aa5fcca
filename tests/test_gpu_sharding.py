"""Sharded inference across several CUDA devices: the CUDA kernels run per shard under jit +
NamedSharding (Auto and Explicit mesh axes), shard_map and pmap, against the float64 reference.
The same patterns on 8 CPU devices, with the HLO facts they rest on, are test_sharding.py's.
Skipped below two CUDA devices (`benchmarks/device_run.sh multi-gpu` on a machine of two or more).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp4
from tests import reference
from tests.repo_scripts import load_repo_script
from tests.test_sharding import COLLECTIVES, _check, _collectives, _put, _spec


def _gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


GPUS = _gpus()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(GPUS) < 2, reason="needs two or more CUDA devices")]
CUDA_TARGETS = ("jax_fp4_gemv_cuda", "jax_fp4_dequant_cuda", "jax_fp4_fused_cuda")


def _mesh(explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh((len(GPUS),), ("x",), axis_types=(kind,), devices=GPUS)


def _weight(rng, n, k, mesh, spec, layout):
    """A random weight in `layout`, its arrays placed by the logical [N, K] `spec`, and its
    float64 dequantization."""
    packed, scale, gs = reference.random_weight(rng, n, k)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    w64 = reference.dequantize(packed, scale, gs, 16)
    return jax.device_put(w, w.shardings(NamedSharding(mesh, spec))), w64


def _cuda_kernels(hlo: str) -> set:
    return {t for t in CUDA_TARGETS if f'custom_call_target="{t}"' in hlo}


# Decode (the GEMV), the fused GEMM's range and a prefill past it, per shard.
@pytest.mark.parametrize("m", [1, 48, 640])
@pytest.mark.parametrize("layout", ["spec", "tiled"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_column_parallel_runs_the_kernels_per_gpu(m, layout, explicit):
    rng = np.random.default_rng()
    mesh = _mesh(explicit)
    n, k = 256 * len(GPUS), 1024
    w, w64 = _weight(rng, n, k, mesh, P("x", None), layout)
    a = _put(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), mesh, P())
    bias = _put(jnp.asarray(rng.standard_normal(n), jnp.bfloat16), mesh, P("x"))
    f = jax.jit(jax_fp4.matmul)
    hlo = f.lower(a, w, bias).compile().as_text()
    y = f(a, w, bias)
    _check(y, np.asarray(a, np.float64) @ w64.T + np.asarray(bias, np.float64), "bfloat16")
    assert _spec(y) == (None, "x")
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    assert _cuda_kernels(hlo), "no jax_fp4 CUDA kernel in the partitioned program"


@pytest.mark.parametrize("m", [1, 48])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_row_parallel_is_one_all_reduce_on_gpus(m, explicit):
    rng = np.random.default_rng()
    mesh = _mesh(explicit)
    n, k = 384, 512 * len(GPUS)                                   # K shards of 512: whole blocks
    w, w64 = _weight(rng, n, k, mesh, P(None, "x"), "spec")
    a = _put(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), mesh, P(None, "x"))
    bias_np = 50.0 * rng.standard_normal(n)                       # added per shard would show
    bias = _put(jnp.asarray(bias_np, jnp.bfloat16), mesh, P())
    f = jax.jit(jax_fp4.matmul)
    hlo = f.lower(a, w, bias).compile().as_text()
    y = f(a, w, bias)
    _check(y, np.asarray(a, np.float64) @ w64.T + np.asarray(bias, np.float64), "bfloat16")
    assert _collectives(hlo) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    assert _cuda_kernels(hlo)


def test_data_parallel_decode_keeps_the_batch_sharded():
    rng = np.random.default_rng()
    mesh = _mesh()
    n, k = 1000, 2048                                             # ragged N: the spec layout
    w, w64 = _weight(rng, n, k, mesh, P(), "spec")
    # The path is picked from the global M (here <= 16 on up to 8 GPUs: the GEMV), run on each
    # GPU's rows.
    a = _put(jnp.asarray(rng.standard_normal((2 * len(GPUS), k)), jnp.float16), mesh, P("x", None))
    f = jax.jit(jax_fp4.matmul)
    hlo = f.lower(a, w).compile().as_text()
    y = f(a, w)
    _check(y, np.asarray(a, np.float64) @ w64.T, "float16")
    assert _spec(y) == ("x", None)
    assert _collectives(hlo) == dict.fromkeys(COLLECTIVES, 0)
    assert _cuda_kernels(hlo) == {"jax_fp4_gemv_cuda"}


def test_shard_map_tensor_parallel_mlp_on_gpus():
    rng = np.random.default_rng()
    mesh = _mesh()
    d, h = 512, 1024 * len(GPUS)
    up, up64 = _weight(rng, h, d, mesh, P("x", None), "tiled")
    down, down64 = _weight(rng, d, h, mesh, P(None, "x"), "spec")
    x = jnp.asarray(rng.standard_normal((6, d)), jnp.bfloat16)

    def local(x, up, down):  # x replicated; up: this GPU's rows of h, down: its columns
        hid = jax.nn.relu(jax_fp4.matmul(x, up))
        return jax.lax.psum(jax_fp4.matmul(hid, down).astype(jnp.float32), "x")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), up.shardings(P("x", None)),
                                                          down.shardings(P(None, "x"))),
                              out_specs=P()))
    y = f(x, up, down)
    # The hidden activations are rounded to bf16 between the two matmuls, as the kernels see them.
    hid = np.maximum(np.asarray(x, np.float64) @ up64.T, 0)
    hid = np.asarray(jnp.asarray(hid, jnp.bfloat16), np.float64)
    _check(y, hid @ down64.T, "bfloat16")


def test_pmap_runs_the_kernels_per_gpu():
    rng = np.random.default_rng()
    count, n, k = len(GPUS), 300, 1024
    a = jnp.asarray(rng.standard_normal((count, 3, k)), jnp.bfloat16)
    stacked = [reference.random_weight(rng, n, k) for _ in range(count)]
    ws = jax_fp4.NVFP4Weight(*(np.stack(x) for x in zip(*stacked)))
    y = jax.pmap(jax_fp4.matmul, devices=GPUS)(a, ws)
    assert {d.platform for d in y.sharding.device_set} == {"gpu"}
    ref = np.stack([np.asarray(a[i], np.float64) @ reference.dequantize(*stacked[i], 16).T
                    for i in range(count)])
    _check(y, ref, "bfloat16")


def test_sharded_inference_example_on_gpus():
    example = load_repo_script("examples/sharded_inference.py")
    facts = example.main(verbose=False)
    assert facts["mesh"]["data"] * facts["mesh"]["model"] == len(GPUS)
    for name in ("jit + NamedSharding", "shard_map", "explicit axes, exported"):
        assert facts[name]["relative_error"] < reference.TOLERANCE["bfloat16"]
        expected = int(facts["mesh"]["model"] > 1)                # the row-parallel sum
        assert facts[name]["collectives"] == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": expected}
