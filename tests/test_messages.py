"""Errors and reports that say what to do: the extra to install, the call that makes a weight, the
reason a path is not taken."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import extras as _extras
from jax_fp4 import ffi as _ffi
from jax_fp4 import native as _native

ROOT = Path(__file__).resolve().parents[1]


def _run_without(module: str, code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter where importing `module` fails as if it were not installed."""
    return subprocess.run(
        [sys.executable, "-c", f"import sys; sys.modules[{module!r}] = None\n{code}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize("submodule", ["nnx", "linen"])
def test_the_flax_front_ends_name_their_extra(submodule):
    out = _run_without("flax", f"import jax_fp4.{submodule}")
    assert out.returncode == 1
    assert (
        f"ModuleNotFoundError: jax_fp4.{submodule} needs flax, which comes with jax_fp4's "
        "optional extra 'flax': pip install 'jax_fp4[flax]'"
    ) in out.stderr


def test_the_minilm_example_names_what_it_lacks():
    out = _run_without(
        "flax",
        "import runpy; sys.argv = ['minilm_embeddings.py']\n"
        "runpy.run_path('examples/minilm_embeddings.py', run_name='__main__')",
    )
    assert out.returncode == 1
    first = out.stderr.splitlines()[0]
    assert first.startswith("minilm_embeddings.py needs flax")
    assert "pip install 'jax_fp4[flax]'" in first
    assert "Traceback" not in out.stderr


def test_import_extra_names_the_extra_and_passes_other_errors_on():
    with pytest.raises(ModuleNotFoundError) as err:
        _extras.import_extra("jax_fp4_no_such_package.pyplot", "plot", "plot.py")
    assert str(err.value) == (
        "plot.py needs jax_fp4_no_such_package, which comes with jax_fp4's optional extra "
        "'plot': pip install 'jax_fp4[plot]'"
    )
    assert err.value.name == "jax_fp4_no_such_package"
    # A module missing inside an installed package is that package's error, not an extra's.
    with pytest.raises(ModuleNotFoundError, match="No module named 'jax_fp4.no_such_module'"):
        _extras.import_extra("jax_fp4.no_such_module", "plot", "plot.py")


def test_a_plain_array_as_the_weight_points_to_quantize():
    a, dense = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((32, 64))
    expected = (
        r"w must be an NVFP4Weight, got \w+ of shape \(32, 64\); quantize .*jax_fp4\.quantize"
    )
    with pytest.raises(TypeError, match="matmul: " + expected):
        jax_fp4.matmul(a, dense)
    with pytest.raises(TypeError, match="prepack: " + expected):
        jax_fp4.prepack(dense)
    with pytest.raises(TypeError, match="ragged_matmul: w must be an NVFP4Weight, got \\w+ of"):
        jax_fp4.ragged_matmul(a, jnp.ones((2, 32, 64)), jnp.asarray([1, 1], jnp.int32))
    # Anything else is named without the hint.
    with pytest.raises(TypeError, match=r"got dict$"):
        jax_fp4.matmul(a, {})


def test_the_lazy_submodules_exist_and_nothing_else_is_offered():
    for name in jax_fp4._LAZY_SUBMODULES:
        assert getattr(jax_fp4, name).__name__ == f"jax_fp4.{name}"
    with pytest.raises(AttributeError, match="no attribute 'bench'"):
        jax_fp4.bench  # noqa: B018


def test_dispatch_reasons_say_why_each_path_is_not_taken(monkeypatch):
    """K = 11000 (11000 % 32 == 24): no GEMV or fused GEMM, whatever M; dequant serves it."""
    monkeypatch.setattr(_native, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_native, "device_kind", lambda device=None: None)
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(_ffi, "cuda_architectures", lambda: _ffi.ALL_CUDA_ARCHITECTURES)
    w = jax_fp4.quantize(np.ones((64, 11000), np.float32))
    a = jax.ShapeDtypeStruct((4, 11000), jnp.bfloat16)
    assert jax_fp4.dispatch_path(a, w, platform="cuda") == "dequant"
    reasons = jax_fp4.dispatch_reasons(a, w, platform="cuda")
    assert list(reasons) == ["gemv", "fused", "native", "xla"]
    assert reasons["gemv"] == "K must be a multiple of 32, got 11000"
    assert reasons["fused"] == "K must be a positive multiple of 128, got 11000"
    assert "compute capability 12.x" in reasons["native"]
    assert reasons["xla"].startswith("could serve it; auto prefers 'dequant'")
    # float32 activations: the reference path on a GPU, each kernel naming the dtype.
    a32 = jax.ShapeDtypeStruct((4, 11008), jnp.float32)
    w32 = jax_fp4.quantize(np.ones((64, 11008), np.float32))
    assert jax_fp4.dispatch_path(a32, w32, platform="cuda") == "reference"
    reasons = jax_fp4.dispatch_reasons(a32, w32, platform="cuda")
    assert reasons["gemv"] == reasons["dequant"] == "a must be float16 or bfloat16, got float32"
    # On the CPU the CPU kernel serves float32 too.
    assert jax_fp4.dispatch_path(a32, w32, platform="cpu") == "cpu"
    assert list(jax_fp4.dispatch_reasons(a32, w32, platform="cpu")) == ["xla"]
