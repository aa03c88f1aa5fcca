"""The CUDA lowering, checked on any machine: jit(...).trace(...).lower(lowering_platforms=("cuda",))
builds the HLO a CUDA device would run, so the dispatch's choice shows as custom-call targets.
The device facts the dispatcher reads (compute capability, device kind, CUDA kernels compiled in)
are pinned with monkeypatch, so the test does not depend on the build or the machine. The rule
edges are read from the dispatch's table (jax_fp4/dispatch.py).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import dispatch as _dispatch
from jax_fp4 import ffi as _ffi
from jax_fp4 import native as _native
from tests import reference

H200 = "NVIDIA H200"


def _targets(fn, *args):
    # A fresh wrapper each time: jit caches traces per function, and the environment variables the
    # dispatcher reads are not part of that cache key.
    text = jax.jit(lambda *xs: fn(*xs)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return sorted(set(re.findall(r"custom_call @(\w+)", text)))


@pytest.fixture
def cuda_device(monkeypatch):
    """Pretend to lower for a CUDA device of a chosen compute capability."""
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)

    def set_capability(capability, architectures=_ffi.ALL_CUDA_ARCHITECTURES, kind=None):
        monkeypatch.setattr(_native, "device_capability", lambda device=None: capability)
        monkeypatch.setattr(_native, "device_kind", lambda device=None: kind)
        monkeypatch.setattr(_ffi, "cuda_architectures", lambda: architectures)

    set_capability((9, 0), kind=H200)
    return set_capability


SPEC, TILED = _dispatch.TABLES[H200].spec, _dispatch.TABLES[H200].tiled
# 2112 x 4096: past both small-weight rules (N <= small_n and K <= long_k; on the spec layout
# N * K <= small_weight), so that auto takes the fused GEMM right past gemv_max_m; N % 32 == 0
# (native).
N_PLAIN = max(SPEC.small_n, SPEC.small_weight // 4096) + 64


def _case(m, n=N_PLAIN, k=4096, dtype=jnp.bfloat16):
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, n, k)
    return jnp.asarray(rng.standard_normal((m, k)), dtype), jax_fp4.NVFP4Weight(packed, scale, gs)


GEMV, FUSED, DEQUANT = ["jax_fp4_gemv_cuda"], ["jax_fp4_fused_cuda"], ["jax_fp4_dequant_cuda"]


def test_auto_dispatch_targets_on_hopper(cuda_device):
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    assert N_PLAIN * 4096 > SPEC.small_weight and N_PLAIN < SPEC.narrow_n
    assert _targets(matmul, *_case(1)) == GEMV
    assert _targets(matmul, *_case(SPEC.gemv_max_m)) == GEMV
    assert _targets(matmul, *_case(SPEC.gemv_max_m + 1)) == FUSED
    assert _targets(matmul, *_case(SPEC.fused_max_m)) == FUSED
    assert _targets(matmul, *_case(SPEC.fused_max_m + 1)) == DEQUANT
    # From fused_min_m_wide_long: the fused GEMM only on prepacked weights with N >= wide_n and
    # K >= long_k (the spec layout has no such rule).
    assert SPEC.fused_min_m_wide_long is None
    wide, long_k = TILED.wide_n, TILED.long_k
    a, w = _case(TILED.fused_min_m_wide_long, n=wide, k=long_k)
    assert _targets(matmul, a, w) == GEMV  # spec layout: the GEMV
    tiled = jax_fp4.prepack(w)
    assert _targets(matmul, a, tiled) == FUSED  # prepacked, wide, long K
    assert _targets(matmul, a[: _dispatch.DECODE_MAX_M], tiled) == GEMV  # decode
    a, w = _case(TILED.gemv_max_m, n=wide, k=long_k - 128 * 24)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == GEMV  # K too short
    a, w = _case(TILED.gemv_max_m, n=wide - 128, k=long_k)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == GEMV  # N too narrow
    assert _targets(matmul, *_case(64, k=160)) == DEQUANT  # K % 128 != 0
    # Past gemv_max_m: the GEMV to gemv_max_m_narrow_long on prepacked narrow weights with long
    # rows, the fused GEMM on the spec layout.
    bound = TILED.gemv_max_m_narrow_long
    a, w = _case(bound, n=TILED.narrow_n, k=long_k)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == GEMV
    assert _targets(matmul, a, w) == FUSED
    a, w = _case(bound + 1, n=TILED.narrow_n, k=long_k)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == FUSED
    # The GEMV to gemv_max_m_small on small weights (N <= small_n, K <= long_k), either layout.
    assert SPEC.gemv_max_m_small == TILED.gemv_max_m_small and SPEC.small_n == TILED.small_n
    a, w = _case(SPEC.gemv_max_m_small, n=SPEC.small_n, k=long_k)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == GEMV
    assert _targets(matmul, a, w) == GEMV
    a, w = _case(SPEC.gemv_max_m_small + 1, n=SPEC.small_n, k=long_k)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == FUSED
    assert _targets(matmul, a, w) == FUSED
    a, w = _case(SPEC.gemv_max_m_small, n=SPEC.small_n + 16, k=4096)
    assert _targets(matmul, a, jax_fp4.prepack(w)) == FUSED
    # The GEMV to gemv_max_m_small_weight on weights of at most small_weight elements (each
    # layout its own bound and size).
    for table, layout in ((SPEC, lambda w: w), (TILED, jax_fp4.prepack)):

        def path(m, n):
            a, w = _case(m, n=n, k=4096)
            return _targets(matmul, a, layout(w))

        bound, n = table.gemv_max_m_small_weight, table.small_weight // 4096
        assert path(bound, n) == GEMV
        assert path(bound, n + 32) == FUSED
        assert path(bound + 1, n) == FUSED
    # Past fused_max_m to fused_max_m_large: the fused GEMM on large wide weights (N >= wide_n,
    # N * K >= large_weight) only.
    large = SPEC.fused_max_m_large
    a, w = _case(large, n=wide, k=long_k)
    assert _targets(matmul, a, w) == FUSED
    assert _targets(matmul, a[:, :4096], _case(1, n=wide, k=4096)[1]) == DEQUANT
    assert _targets(matmul, *_case(large + 1, n=wide, k=long_k)) == DEQUANT
    assert _targets(matmul, *_case(large, n=SPEC.large_weight // 4096, k=4096)) == FUSED  # the edge
    assert (
        _targets(matmul, *_case(SPEC.gemv_max_m + 1, dtype=jnp.float32)) == []
    )  # float32 -> reference
    assert _targets(lambda a, w: jax_fp4.matmul(a, w, backend="fused"), *_case(64)) == FUSED


def test_every_hopper_name_takes_the_hopper_entry(cuda_device):
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    a, w = _case(SPEC.gemv_max_m + 1)
    for kind in _dispatch.TABLES:
        cuda_device((9, 0), kind=kind)
        assert _targets(matmul, a, w) == FUSED, kind
    cuda_device((9, 0), kind="NVIDIA GH200 480GB")  # not in the table: capability 9.0's entry
    assert _targets(matmul, a, w) == FUSED


def test_auto_dispatch_targets_without_the_fused_gemm(cuda_device):
    """Off Hopper (the default entry) the GEMV takes M <= gemv_max_m_without_fused where it runs
    on tensor cores (sm_80+), then dequant."""
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    default = _dispatch.DEFAULT.spec
    for capability, kind in (((8, 0), "NVIDIA A100-SXM4-80GB"), ((8, 9), None), ((12, 0), None)):
        cuda_device(capability, kind=kind)
        bound = default.gemv_max_m_without_fused
        assert _targets(matmul, *_case(bound)) == GEMV, capability
        assert _targets(matmul, *_case(bound + 1)) == DEQUANT, capability
        assert _targets(matmul, *_case(default.gemv_max_m + 1, k=160)) == DEQUANT  # scalar GEMV
    cuda_device((7, 5), "75;80-real")  # a build with sm_75 code: the scalar GEMV to gemv_max_m
    assert _targets(matmul, *_case(default.gemv_max_m)) == GEMV
    assert _targets(matmul, *_case(default.gemv_max_m + 1)) == DEQUANT


def test_native_path_only_when_enabled_on_sm120(cuda_device, monkeypatch):
    cuda_device((12, 0))
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    assert _targets(matmul, *_case(80)) == ["jax_fp4_dequant_cuda"]  # off by default
    monkeypatch.setenv("JAX_FP4_NATIVE_SM120", "1")
    native = [
        "jax_fp4_native_sm120_cuda",
        "jax_fp4_quantize_activation_cuda",
        "jax_fp4_swizzle_scales_cuda",
    ]
    assert _targets(matmul, *_case(64)) == native
    decode = _dispatch.DEFAULT.spec.gemv_max_m
    assert _targets(matmul, *_case(decode)) == GEMV  # the GEMV keeps its decode range
    cuda_device((9, 0))
    assert _targets(matmul, *_case(64)) == ["jax_fp4_fused_cuda"]
    with pytest.raises(ValueError, match="compute capability 12.x"):
        _targets(lambda a, w: jax_fp4.matmul(a, w, backend="native"), *_case(64))


def test_prepacked_scales_skip_the_per_call_swizzle(cuda_device):
    cuda_device((12, 0))
    a, w = _case(32)
    forced = lambda a, w: jax_fp4.matmul(a, w, backend="native")  # noqa: E731
    assert "jax_fp4_swizzle_scales_cuda" in _targets(forced, a, w)
    assert _targets(forced, a, _native.prepack(w)) == [
        "jax_fp4_native_sm120_cuda",
        "jax_fp4_quantize_activation_cuda",
    ]


def test_prepacked_weight_runs_every_other_path_unchanged():
    a, w = _case(5, n=48, k=96)
    p = _native.prepack(w)
    want = np.asarray(jax_fp4.matmul(a, w))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax_fp4.matmul)(a, p)), want)
    # stacked prepacked weights under vmap, and gradients, carry the extra operand along
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), p)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda w: jax_fp4.matmul(a, w))(stacked)), np.stack([want, want])
    )
    a32 = a.astype(jnp.float32)
    grads = [jax.grad(lambda a, w: jnp.sum(jax_fp4.matmul(a, w) ** 2))(a32, x) for x in (w, p)]
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))


def _attributes(fn, *args, platform="cuda"):
    """{target: {attribute: value text}} of the program's FFI calls."""
    text = jax.jit(lambda *xs: fn(*xs)).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    found = {}
    for target, config in re.findall(r"custom_call @(\w+)\(.*?backend_config = \{([^}]*)\}", text):
        found[target] = dict(re.findall(r"(\w+) = ([\w.-]+)", config))
    return found


def _gemv_tiled_attrs(fn, *args):
    attributes = _attributes(fn, *args)
    return [attributes["jax_fp4_gemv_cuda"]["tiled"]] if "jax_fp4_gemv_cuda" in attributes else []


def test_the_kernels_get_every_choice_as_attributes(cuda_device, monkeypatch):
    """The GEMV's variant (dispatch.plan), the switches and the tuning reach the kernels as FFI
    attributes: the handlers decide nothing themselves."""
    a, w = _case(4)
    matmul = lambda a, w: jax_fp4.matmul(a, w)  # noqa: E731
    assert _attributes(matmul, a, w)["jax_fp4_gemv_cuda"] == {
        "block_size": "16",
        "tiled": "false",
        "tensor_cores": "true",
        "row_tiling": "true",
        "col_tiles": "0",
        "k_split": "0",
        "rows_per_block": "0",
        "programmatic": "false",
    }
    assert _attributes(matmul, *_case(4, k=160))["jax_fp4_gemv_cuda"]["tensor_cores"] == "false"
    tuning = jax_fp4.KernelTuning(
        gemv_col_tiles=2,
        gemv_k_split=4,
        gemv_rows_per_block=1,
        fused_split=3,
        fused_tile_m=64,
        fused_tile_n=128,
        fused_warp_specialized=False,
        fused_stream_k=True,
        programmatic_launch=True,
    )
    tuned = lambda backend: lambda a, w: jax_fp4.matmul(a, w, backend=backend, tuning=tuning)  # noqa: E731
    assert _attributes(tuned(None), a, w)["jax_fp4_gemv_cuda"] == {
        "block_size": "16",
        "tiled": "false",
        "tensor_cores": "true",
        "row_tiling": "true",
        "col_tiles": "2",
        "k_split": "4",
        "rows_per_block": "1",
        "programmatic": "true",
    }
    assert _attributes(matmul, *_case(64))["jax_fp4_fused_cuda"] == {
        "block_size": "16",
        "tiled": "false",
        "activation": "0",
        "split": "0",
        "tile_m": "0",
        "tile_n": "0",
        "warp_specialized": "-1",
        "stream_k": "-1",
        "programmatic": "false",
    }
    assert _attributes(tuned("fused"), a, jax_fp4.prepack(w))["jax_fp4_fused_cuda"] == {
        "block_size": "16",
        "tiled": "true",
        "activation": "0",
        "split": "3",
        "tile_m": "64",
        "tile_n": "128",
        "warp_specialized": "0",
        "stream_k": "1",
        "programmatic": "true",
    }
    monkeypatch.setenv("JAX_FP4_GEMV_ROW_TILING", "0")
    assert _attributes(matmul, a, w)["jax_fp4_gemv_cuda"]["row_tiling"] == "false"
    assert _attributes(matmul, a, w, platform="cpu")["jax_fp4_matmul_cpu"] == {
        "avx512": "true",
        "block_size": "16",
        "tiled": "false",
    }
    monkeypatch.setenv("JAX_FP4_CPU_AVX512", "0")
    assert _attributes(matmul, a, w, platform="cpu")["jax_fp4_matmul_cpu"]["avx512"] == "false"
    with pytest.raises(TypeError, match="tuning must be a jax_fp4.KernelTuning"):
        jax_fp4.matmul(a, w, tuning={"fused_split": 3})


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
    text = (
        jax.jit(lambda a, w: jax_fp4.matmul(a, w))
        .trace(a, w)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "dot_general" in text and _targets(lambda a, w: jax_fp4.matmul(a, w), a, w) == []
    assert jax_fp4.dispatch_path(a, w, platform="cuda") == "xla"
    with pytest.raises(
        ValueError,
        match=r"backend='gemv' needs platform 'cuda', but this jax_fp4 "
        r"build has no CUDA kernels for this GPU",
    ):
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
    cuda_device((8, 0), kind="NVIDIA A100-SXM4-80GB")  # the override's entry, not this GPU's
    assert _targets(matmul, a, w) == ["jax_fp4_fused_cuda"]
    monkeypatch.setenv("JAX_FP4_CUDA_CAPABILITY", "7.5")  # no image of the default build
    assert _targets(matmul, a, w) == []  # the xla path: plain JAX
    monkeypatch.setenv("JAX_FP4_CUDA_CAPABILITY", "sm_90")
    with pytest.raises(
        ValueError, match=r"JAX_FP4_CUDA_CAPABILITY: expected MAJOR.MINOR .* 'sm_90'"
    ):
        _targets(matmul, a, w)
