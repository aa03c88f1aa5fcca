"""The CUDA lowering, checked on any machine: jit(...).trace(...).lower(lowering_platforms=("cuda",))
builds the HLO a CUDA device would run, so the dispatch's choice shows as custom-call targets.
The device facts the dispatcher reads (compute capability, CUDA kernels compiled in) are pinned
with monkeypatch, so the test does not depend on the build or the machine.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import ffi as _ffi, native as _native
from tests import reference


def _targets(fn, *args):
    # A fresh wrapper each time: jit caches traces per function, and the environment variables the
    # dispatcher reads are not part of that cache key.
    text = jax.jit(lambda *xs: fn(*xs)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return sorted(set(re.findall(r"custom_call @(\w+)", text)))


@pytest.fixture
def cuda_device(monkeypatch):
    """Pretend to lower for a CUDA device of a chosen compute capability."""
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)

    def set_capability(capability, architectures=_ffi.DEFAULT_CUDA_ARCHITECTURES):
        monkeypatch.setattr(_native, "device_capability", lambda device=None: capability)
        monkeypatch.setattr(_ffi, "cuda_architectures", lambda: architectures)

    set_capability((9, 0))
    return set_capability


# 2112 x 4096: past both small-weight rules (N <= 1024 and K <= 8192: the GEMV to M = 64; on the
# spec layout N * K <= 2^23: to M = 32), so that auto takes the fused GEMM from M = 17; N % 32 == 0
# (native).
def _case(m, n=2112, k=4096, dtype=jnp.bfloat16):
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, n, k)
    return jnp.asarray(rng.standard_normal((m, k)), dtype), jax_fp4.NVFP4Weight(packed, scale, gs)


def test_auto_dispatch_targets_on_hopper(cuda_device):
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    assert _targets(matmul, *_case(1)) == ["jax_fp4_gemv_cuda"]
    assert _targets(matmul, *_case(16)) == ["jax_fp4_gemv_cuda"]
    assert _targets(matmul, *_case(17)) == ["jax_fp4_fused_cuda"]
    assert _targets(matmul, *_case(1024)) == ["jax_fp4_fused_cuda"]
    assert _targets(matmul, *_case(1025)) == ["jax_fp4_dequant_cuda"]
    # M = 9-16: the fused GEMM only on prepacked weights with N >= 8192 and K >= 8192.
    a, w = _case(9, n=8192, k=8192)
    assert _targets(matmul, a, w) == ["jax_fp4_gemv_cuda"]  # spec layout: the GEMV
    tiled = jax_fp4.prepack(w)
    assert _targets(matmul, a, tiled) == ["jax_fp4_fused_cuda"]  # prepacked, wide, long K
    assert _targets(matmul, a[:8], tiled) == ["jax_fp4_gemv_cuda"]  # decode
    a, w = _case(16, n=8192, k=5120)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_gemv_cuda"]  # K too short
    a, w = _case(16, n=8064, k=8192)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_gemv_cuda"]  # N too narrow
    assert _targets(matmul, *_case(64, k=160)) == ["jax_fp4_dequant_cuda"]  # K % 128 != 0
    # M = 17-32: the GEMV on prepacked narrow weights with long rows, the fused GEMM on the spec layout.
    a, w = _case(32, n=4096, k=8192)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_gemv_cuda"]
    assert _targets(matmul, a, w) == ["jax_fp4_fused_cuda"]
    a, w = _case(33, n=4096, k=8192)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_fused_cuda"]
    # M = 17-64: the GEMV on small weights (N <= 1024, K <= 8192), either layout.
    a, w = _case(64, n=1024, k=8192)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_gemv_cuda"]
    assert _targets(matmul, a, w) == ["jax_fp4_gemv_cuda"]
    a, w = _case(65, n=1024, k=8192)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_fused_cuda"]
    assert _targets(matmul, a, w) == ["jax_fp4_fused_cuda"]
    a, w = _case(64, n=1040, k=4096)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_fused_cuda"]
    # M = 17-32: the GEMV on spec-layout weights of at most 2^23 elements.
    a, w = _case(32, n=2048, k=4096)
    assert _targets(matmul, a, w) == ["jax_fp4_gemv_cuda"]
    assert _targets(matmul, a, jax_fp4.prepack(w)) == ["jax_fp4_fused_cuda"]
    assert _targets(matmul, *_case(33, n=2048, k=4096)) == ["jax_fp4_fused_cuda"]
    # M = 1025-2048: the fused GEMM on large wide weights (N >= 8192, N * K >= 3 * 2^24) only.
    a, w = _case(2048, n=8192, k=8192)
    assert _targets(matmul, a, w) == ["jax_fp4_fused_cuda"]
    assert _targets(matmul, a[:, :4096], _case(1, n=8192, k=4096)[1]) == ["jax_fp4_dequant_cuda"]
    assert _targets(matmul, *_case(2049, n=8192, k=8192)) == ["jax_fp4_dequant_cuda"]
    assert _targets(matmul, *_case(2048, n=12288, k=4096)) == ["jax_fp4_fused_cuda"]  # 3 * 2^24
    assert _targets(matmul, *_case(17, dtype=jnp.float32)) == []  # float32 -> reference (pure JAX)
    assert _targets(lambda a, w: jax_fp4.matmul(a, w, backend="fused"), *_case(64)) == [
        "jax_fp4_fused_cuda"]


def test_auto_dispatch_targets_without_the_fused_gemm(cuda_device):
    """Off Hopper the GEMV takes M <= 64 where it runs on tensor cores (sm_80+), then dequant."""
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    for capability in ((8, 0), (8, 9), (12, 0)):
        cuda_device(capability)
        assert _targets(matmul, *_case(64)) == ["jax_fp4_gemv_cuda"], capability
        assert _targets(matmul, *_case(65)) == ["jax_fp4_dequant_cuda"], capability
        assert _targets(matmul, *_case(17, k=160)) == ["jax_fp4_dequant_cuda"]  # scalar GEMV
    cuda_device((7, 5), "75;80-real")  # a build with sm_75 code: the scalar GEMV to M = 16
    assert _targets(matmul, *_case(16)) == ["jax_fp4_gemv_cuda"]
    assert _targets(matmul, *_case(17)) == ["jax_fp4_dequant_cuda"]


def test_native_path_only_when_enabled_on_sm120(cuda_device, monkeypatch):
    cuda_device((12, 0))
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    assert _targets(matmul, *_case(80)) == ["jax_fp4_dequant_cuda"]  # off by default
    monkeypatch.setenv("JAX_FP4_NATIVE_SM120", "1")
    native = ["jax_fp4_native_sm120_cuda", "jax_fp4_quantize_activation_cuda",
              "jax_fp4_swizzle_scales_cuda"]
    assert _targets(matmul, *_case(64)) == native
    assert _targets(matmul, *_case(16)) == ["jax_fp4_gemv_cuda"]  # the decode GEMV keeps M <= 16
    cuda_device((9, 0))
    assert _targets(matmul, *_case(64)) == ["jax_fp4_fused_cuda"]
    with pytest.raises(ValueError, match="compute capability 12.x"):
        _targets(lambda a, w: jax_fp4.matmul(a, w, backend="native"), *_case(64))


def test_prepacked_scales_skip_the_per_call_swizzle(cuda_device):
    cuda_device((12, 0))
    a, w = _case(32)
    forced = lambda a, w: jax_fp4.matmul(a, w, backend="native")  # noqa: E731
    assert "jax_fp4_swizzle_scales_cuda" in _targets(forced, a, w)
    assert _targets(forced, a, _native.prepack(w)) == ["jax_fp4_native_sm120_cuda",
                                                       "jax_fp4_quantize_activation_cuda"]


def test_prepacked_weight_runs_every_other_path_unchanged():
    a, w = _case(5, n=48, k=96)
    p = _native.prepack(w)
    want = np.asarray(jax_fp4.matmul(a, w))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax_fp4.matmul)(a, p)), want)
    # stacked prepacked weights under vmap, and gradients, carry the extra operand along
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), p)
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda w: jax_fp4.matmul(a, w))(stacked)),
                                  np.stack([want, want]))
    a32 = a.astype(jnp.float32)
    grads = [jax.grad(lambda a, w: jnp.sum(jax_fp4.matmul(a, w) ** 2))(a32, x) for x in (w, p)]
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))


def _gemv_tiled_attrs(fn, *args):
    text = jax.jit(lambda *xs: fn(*xs)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"custom_call @jax_fp4_gemv_cuda.*?tiled = (true|false)", text)


def test_tiled_weights_reach_the_tensor_core_gemv_as_they_are(cuda_device, monkeypatch):
    a, w = _case(4)
    p = jax_fp4.prepack(w)
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    assert _gemv_tiled_attrs(matmul, a, w) == ["false"]
    assert _gemv_tiled_attrs(matmul, a, p) == ["true"]
    # the scalar kernel (pre-sm_80, or the tensor-core kernel switched off) gets the spec layout back
    monkeypatch.setenv("JAX_FP4_GEMV_MMA", "0")
    assert _gemv_tiled_attrs(matmul, a, p) == ["false"]
    monkeypatch.delenv("JAX_FP4_GEMV_MMA")
    cuda_device((7, 5), "75;80-real")  # a build with sm_75 code
    assert _gemv_tiled_attrs(matmul, a, p) == ["false"]
    cuda_device((9, 0))
    # the other paths read the spec layout (transformed back inside the program)
    assert _targets(matmul, *(_case(65)[0], p)) == ["jax_fp4_fused_cuda"]
    assert _targets(matmul, *(_case(1100)[0], p)) == ["jax_fp4_dequant_cuda"]


def test_a_gpu_older_than_the_build_lowers_to_xla(cuda_device):
    """A T4 (7.5) runs none of the default build's code (sm_80+ cubins and PTX): auto lowers to
    plain XLA, and a forced kernel path is a clear error, not a launch failure on the device."""
    cuda_device((7, 5))
    a, w = _case(4)
    text = jax.jit(lambda a, w: jax_fp4.matmul(a, w)).trace(a, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "dot_general" in text and _targets(lambda a, w: jax_fp4.matmul(a, w), a, w) == []
    assert jax_fp4.dispatch_path(a, w, platform="cuda") == "xla"
    with pytest.raises(ValueError, match=r"backend='gemv' needs platform 'cuda', but this jax_fp4 "
                                         r"build has no CUDA kernels for this GPU"):
        _targets(lambda a, w: jax_fp4.matmul(a, w, backend="gemv"), a, w)


def test_capability_override_lowers_for_another_gpu(cuda_device, monkeypatch):
    """JAX_FP4_CUDA_CAPABILITY: a machine without that GPU lowers (e.g. for jax.export) the
    kernels auto picks on it; unset, it picks for the GPU it sees (none here: no fused GEMM)."""
    cuda_device(None)
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    a, w = _case(17)
    assert _targets(matmul, a, w) == ["jax_fp4_dequant_cuda"]
    monkeypatch.setenv("JAX_FP4_CUDA_CAPABILITY", "9.0")
    assert _targets(matmul, a, w) == ["jax_fp4_fused_cuda"]
    monkeypatch.setenv("JAX_FP4_CUDA_CAPABILITY", "7.5")        # no image of the default build
    assert _targets(matmul, a, w) == []                         # the xla path: plain JAX
    monkeypatch.setenv("JAX_FP4_CUDA_CAPABILITY", "sm_90")
    with pytest.raises(ValueError, match=r"JAX_FP4_CUDA_CAPABILITY: expected MAJOR.MINOR .* 'sm_90'"):
        _targets(matmul, a, w)
