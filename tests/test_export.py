"""jax.export of programs that call jax_fp4: serialized, deserialized and run, on one device, in a
fresh process, and sharded over 8 CPU devices under Explicit mesh axes."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp4
from tests import reference

KERNEL = "jax_fp4_matmul_cpu"


def _random_problem(rng, n, k, lead, dtype, layout="spec"):
    """(a, w, bias) and the float64 reference of a @ w^T + bias."""
    packed, scale, gs = reference.random_weight(rng, n, k)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    if layout == "tiled":
        w = jax_fp4.prepack(w)
    a = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
    bias = jnp.asarray(rng.standard_normal(n), dtype)
    ref = np.asarray(a, np.float64) @ reference.dequantize(packed, scale, gs, 16).T + np.asarray(
        bias, np.float64
    )
    return (a, w, bias), ref


def _export_for_cpu(fn, *args):
    # For the CPU by name: export's default platform is jax's default backend, the GPU where there
    # is one, even under jax.default_device(cpu) (tests/conftest.py).
    return jax.export.export(
        jax.jit(fn), platforms=("cpu",), disabled_checks=jax_fp4.export_disabled_checks()
    )(*args)


def _export(fn, *args):
    """`fn` exported for the CPU, serialized and deserialized."""
    return jax.export.deserialize(_export_for_cpu(fn, *args).serialize())


def _check(y, ref, dtype):
    y64 = np.asarray(y).astype(np.float64)
    assert y64.shape == ref.shape and np.isfinite(y64).all()
    assert reference.relative_error(y64, ref) < reference.TOLERANCE[np.dtype(dtype).name]


@pytest.mark.parametrize("layout", ["spec", "tiled"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_export_round_trip_on_one_device(dtype, layout):
    rng = np.random.default_rng()
    n, k = (40, 96) if layout == "spec" else (48, 256)
    args, ref = _random_problem(rng, n, k, (3, 5), dtype, layout)
    exported = _export(jax_fp4.matmul, *args)

    assert KERNEL in exported.mlir_module()  # the kernel, not a pure-JAX path
    assert exported.in_tree == jax.tree.structure((args, {}))  # the weight is an argument
    y = exported.call(*args)
    _check(y, ref, dtype)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(jax_fp4.matmul)(*args)))


_FRESH_PROCESS = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import jax_fp4                      # registers the FFI targets and the weight's pytree type
    d = np.load(sys.argv[2])
    exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    w = jax_fp4.NVFP4Weight(d["packed"], d["scale"], d["global_scale"])
    y = exported.call(d["a"].view(jax.numpy.bfloat16), w, d["bias"].view(jax.numpy.bfloat16))
    np.save(sys.argv[3], np.asarray(y).view(np.uint16))
""")


def test_exported_program_runs_in_a_fresh_process(tmp_path: pathlib.Path):
    rng = np.random.default_rng()
    (a, w, bias), ref = _random_problem(rng, 24, 64, (7,), "bfloat16")

    def layer(a, w, bias):
        return jax.nn.gelu(jax_fp4.matmul(a, w, bias))

    (tmp_path / "layer.bin").write_bytes(_export_for_cpu(layer, a, w, bias).serialize())
    np.savez(
        tmp_path / "inputs.npz",
        a=np.asarray(a).view(np.uint16),
        packed=w.packed,
        scale=w.scale,
        global_scale=w.global_scale,
        bias=np.asarray(bias).view(np.uint16),
    )
    subprocess.run(
        [
            sys.executable,
            "-c",
            _FRESH_PROCESS,
            str(tmp_path / "layer.bin"),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "y.npy"),
        ],
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # the CPU beside a GPU too

    y = np.load(tmp_path / "y.npy").view(jnp.bfloat16)
    np.testing.assert_array_equal(y, np.asarray(jax.jit(layer)(a, w, bias)))
    _check(y, np.asarray(jax.nn.gelu(ref)), "bfloat16")


def test_one_artifact_for_this_cpu_and_an_h200(monkeypatch):
    """Export for ("cpu", "cuda") on a machine without the GPU: JAX_FP4_CUDA_CAPABILITY names it,
    so the CUDA branch holds the kernel auto picks on an H200 (the fused GEMM at M = 64), and the
    artifact runs here through its CPU branch."""
    from jax_fp4 import ffi as _ffi
    from jax_fp4 import native as _native

    monkeypatch.setattr(_native, "device_capability", lambda device=None: None)
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)  # a CUDA build (CI's is)
    monkeypatch.setattr(_ffi, "cuda_architectures", lambda: _ffi.ALL_CUDA_ARCHITECTURES)
    monkeypatch.setenv("JAX_FP4_CUDA_CAPABILITY", "9.0")
    rng = np.random.default_rng()
    # N = 1088: past the small-N rule of the H200 entry (dispatch.TABLES: N <= small_n takes the
    # GEMV to gemv_max_m_small); M = 64 is past its other GEMV bounds.
    args, ref = _random_problem(rng, 1088, 256, (64,), "bfloat16")
    exported = jax.export.export(
        jax.jit(jax_fp4.matmul),
        platforms=("cpu", "cuda"),
        disabled_checks=jax_fp4.export_disabled_checks(),
    )(*args)
    exported = jax.export.deserialize(exported.serialize())

    text = exported.mlir_module()
    assert exported.platforms == ("cpu", "cuda")
    assert KERNEL in text and "jax_fp4_fused_cuda" in text
    _check(exported.call(*args), ref, "bfloat16")


# ---- sharded programs ------------------------------------------------------------------------------

needs_8_cpu_devices = pytest.mark.skipif(
    jax.device_count() < 8 or jax.devices()[0].platform != "cpu",
    reason="needs 8 CPU devices (tests/conftest.py sets XLA_FLAGS before jax is imported)",
)


def _sharded_problem(rng, mesh, w_spec, a_spec, bias_spec):
    (a, w, bias), ref = _random_problem(rng, 64, 256, (10,), "bfloat16")
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    w = jax_fp4.NVFP4Weight(put(w.packed, w_spec), put(w.scale, w_spec), put(w.global_scale, P()))
    return (put(a, a_spec), w, put(bias, bias_spec)), ref


@needs_8_cpu_devices
@pytest.mark.parametrize("mode", ["column", "row"])
def test_sharded_export_under_explicit_axes(mode):
    """jax.make_mesh's default axes: the kernels are laid out by a shard_map, which exports."""
    rng = np.random.default_rng()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    w_spec, a_spec, bias_spec, out_spec = {
        "column": (P("model", None), P("data", None), P("model"), P("data", "model")),
        "row": (P(None, "model"), P("data", "model"), P(), P("data", None)),
    }[mode]
    args, ref = _sharded_problem(rng, mesh, w_spec, a_spec, bias_spec)
    exported = _export(jax_fp4.matmul, *args)

    text = exported.mlir_module()
    assert exported.nr_devices == 8
    assert "CustomSPMDPartitioning" not in text and "sdy.manual_computation" in text
    assert text.count("stablehlo.all_reduce") == int(mode == "row")  # row parallel: one sum
    y = exported.call(*args)
    _check(y, ref, "bfloat16")
    assert y.sharding.spec == out_spec
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(jax_fp4.matmul)(*args)))


@needs_8_cpu_devices
def test_sharded_export_under_auto_axes_is_refused_by_jax():
    """The limit _export.py documents: the partitioning rules are callbacks jax cannot serialize.
    If this starts passing, jax can export them and the documentation should say so."""
    rng = np.random.default_rng()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    args, _ = _sharded_problem(rng, mesh, P("model", None), P("data", None), P("model"))
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        _export(jax_fp4.matmul, *args)
