"""The native SM120 path: the swizzled ("128x4") scale layout, prepack, the activation quantizer's
NumPy model, and the path's CUDA targets.

The layout is checked index by index against an independent evaluator of CuTe's layout
algebra for the atom that CUTLASS defines (Sm1xxBlockScaledBasicChunk::SfKMajorAtom, tiled by
tile_to_shape with K first), and, where nvcc and the CUTLASS headers are at hand, against CuTe
itself through a small host program. The scale swizzle runs on each device present (the
`device` fixture: jnp everywhere, the CUDA kernel too on a GPU). The CUDA targets (marked `gpu`;
skipped without a CUDA device or where the CUDA module lacks them):

- jax_fp4_quantize_activation_cuda: bit-exact against the NumPy model
  (jax_fp4.native.quantize_activation_reference), dynamic and static scales, plain and swizzled
  scale layouts, non-finite and all-zero inputs, padding bytes 0;
- jax_fp4_native_sm120_cuda: on a device that is not compute capability 12.x it must answer a
  clear error; on SM120 (skipped elsewhere) the GEMM is compared with an activation-quantized
  float64 reference.

Inputs of the CUDA tests are fresh random draws (the seed is in every failure message); output
buffers are poisoned first (an array of the same size is filled and freed just before, so the
allocator hands its memory to the kernel's output).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import ffi as _ffi
from jax_fp4 import native as _native
from tests import reference
from tests._helpers import gpus

SHAPES = [
    (1, 1),
    (1, 2),
    (9, 6),
    (32, 4),
    (127, 3),
    (128, 4),
    (129, 5),
    (256, 8),
    (300, 10),
    (130, 256),
    (64, 1),
]


# ---- an independent CuTe layout evaluator --------------------------------------------------------


def _cute_eval(shape, stride, coord: int) -> int:
    """CuTe layout (nested shape, stride) applied to a 1-D coordinate (colexicographic order)."""
    if isinstance(shape, tuple):
        total = 0
        for s, d in zip(shape, stride):
            size = math.prod(_flatten(s))
            total += _cute_eval(s, d, coord % size)
            coord //= size
        return total
    return coord * stride


def _flatten(t):
    return [x for s in t for x in _flatten(s)] if isinstance(t, tuple) else [t]


# SfKMajorAtom = Layout<Shape<Shape<_32,_4>, Shape<Int<16>,_4>>, Stride<Stride<_16,_4>, Stride<_0,_1>>>
ATOM_SHAPE = ((32, 4), (16, 4))
ATOM_STRIDE = ((16, 4), (0, 1))


def _cute_sf_offset(rows: int, k: int, r: int, k_elem: int) -> int:
    """tile_to_shape(SfAtom, (rows, k), Step<_2,_1>): the atom repeated over the padded shape with
    the K repetition varying fastest (step 1), then the M repetition (step 2)."""
    atom_m, atom_k = 128, 64
    atom_size = 512
    reps_k = math.ceil(k / atom_k)
    in_atom = _cute_eval(ATOM_SHAPE[0], ATOM_STRIDE[0], r % atom_m) + _cute_eval(
        ATOM_SHAPE[1], ATOM_STRIDE[1], k_elem % atom_k
    )
    return in_atom + (k_elem // atom_k) * atom_size + (r // atom_m) * reps_k * atom_size


@pytest.mark.parametrize("rows,k_blocks", SHAPES)
def test_offsets_match_cute_layout_index_by_index(rows, k_blocks):
    offsets = _native.swizzle_offsets(rows, k_blocks)
    k = 16 * k_blocks
    for r in range(rows):
        for kb in range(k_blocks):
            expected = _cute_sf_offset(rows, k, r, 16 * kb)
            # every element of the 16-block maps to the same byte (stride 0 inside the block)
            assert _cute_sf_offset(rows, k, r, 16 * kb + 15) == expected
            assert offsets[r, kb] == expected, (r, kb)


@pytest.mark.parametrize("rows,k_blocks", SHAPES)
def test_offsets_are_a_bijection_into_the_padded_buffer(rows, k_blocks):
    shape = _native.swizzled_scale_shape(rows, k_blocks)
    assert shape == (math.ceil(rows / 128), 512 * math.ceil(k_blocks / 4))
    offsets = _native.swizzle_offsets(rows, k_blocks).ravel()
    assert len(np.unique(offsets)) == offsets.size
    assert offsets.min() >= 0 and offsets.max() < shape[0] * shape[1]


@pytest.mark.parametrize("rows,k_blocks", SHAPES)
def test_swizzle_np_index_by_index_and_padding(rows, k_blocks):
    rng = np.random.default_rng(rows * 1000 + k_blocks)
    scale = rng.integers(
        1, 256, size=(rows, k_blocks), dtype=np.uint8
    )  # no zero: padding stands out
    swz = _native.swizzle_scales_np(scale)
    flat = swz.ravel()
    covered = np.zeros(flat.size, bool)
    for r in range(rows):
        for kb in range(k_blocks):
            off = (
                ((r // 128) * math.ceil(k_blocks / 4) + kb // 4) * 512
                + (r % 32) * 16
                + ((r % 128) // 32) * 4
                + kb % 4
            )
            assert flat[off] == scale[r, kb]
            covered[off] = True
    assert not flat[~covered].any(), "padding bytes must be 0"
    np.testing.assert_array_equal(_native.unswizzle_scales_np(swz, rows, k_blocks), scale)


# The CUDA kernel's shapes beyond SHAPES: a real weight's scale and a ragged one.
KERNEL_SHAPES = [
    (1, 2),
    (32, 4),
    (127, 3),
    (128, 4),
    (129, 6),
    (300, 10),
    (11008, 256),
    (4096, 688),
]


@pytest.mark.parametrize("rows,k_blocks", SHAPES + [s for s in KERNEL_SHAPES if s not in SHAPES])
def test_swizzle_matches_numpy(device, rows, k_blocks):
    """jnp's swizzle (eager and jitted; uint8 and float8 scales) and, on a GPU, the CUDA kernel,
    against the NumPy layout model."""
    rng = np.random.default_rng()
    scale = rng.integers(0, 256, size=(rows, k_blocks), dtype=np.uint8)
    expected = _native.swizzle_scales_np(scale)
    np.testing.assert_array_equal(np.asarray(_native.swizzle_scales(scale)), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(_native.swizzle_scales)(scale)), expected)
    as_fp8 = jnp.asarray(scale.view(ml_dtypes.float8_e4m3fn))
    np.testing.assert_array_equal(np.asarray(jax.jit(_native.swizzle_scales)(as_fp8)), expected)
    if device.is_gpu and HAS_TARGETS:
        _poison(expected.size)
        got = np.asarray(jax.jit(_native.swizzle_scales_cuda)(jnp.asarray(scale)))
        np.testing.assert_array_equal(got, expected)


def test_swizzle_accepts_float8_and_stacks():
    rng = np.random.default_rng(3)
    scale = rng.integers(0x20, 0x50, size=(3, 200, 6), dtype=np.uint8)
    as_fp8 = scale.view(ml_dtypes.float8_e4m3fn)
    out = np.asarray(_native.swizzle_scales(as_fp8))
    assert out.shape == (3, 2, 1024) and out.dtype == np.uint8
    for i in range(3):
        np.testing.assert_array_equal(out[i], _native.swizzle_scales_np(scale[i]))


# ---- CuTe itself, when nvcc and the CUTLASS headers are at hand ---------------------------------

_CUTE_PROBE = r"""
#include <cstdio>
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
using namespace cute;
int main(int argc, char** argv) {
  using Cfg = cutlass::detail::Sm1xxBlockScaledConfig<16>;
  for (int i = 1; i + 1 < argc; i += 2) {
    int M = atoi(argv[i]), KB = atoi(argv[i + 1]);
    auto L = Cfg::tile_atom_to_shape_SFA(make_shape(M, 128, 16 * KB, 1));
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < KB; ++b) printf("%ld\n", long(L(make_coord(m, 16 * b, 0))));
  }
}
"""


def _cutlass_include():
    try:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
    except Exception:
        return None
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "source", "include")
    return path if os.path.exists(os.path.join(path, "cutlass", "cutlass.h")) else None


@pytest.mark.skipif(
    shutil.which("nvcc") is None or _cutlass_include() is None,
    reason="needs nvcc and the nvidia-cutlass headers",
)
def test_offsets_match_cute_itself(tmp_path):
    src = tmp_path / "probe.cu"
    src.write_text(_CUTE_PROBE)
    exe = tmp_path / "probe"
    subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-I",
            _cutlass_include(),
            str(src),
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
    )
    shapes = [(1, 2), (130, 6), (300, 10), (9, 256)]
    args = [str(x) for s in shapes for x in s]
    out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True).stdout
    got = np.array(out.split(), np.int64)
    expected = np.concatenate([_native.swizzle_offsets(r, kb).ravel() for r, kb in shapes])
    np.testing.assert_array_equal(got, expected)


# ---- prepack ------------------------------------------------------------------------------------


def _random_weight(rng, n, k):
    return jax_fp4.quantize(rng.standard_normal((n, k)).astype(np.float32))


@pytest.mark.parametrize("n,k", [(32, 32), (130, 96), (256, 4096), (96, 160)])
def test_prepack_index_by_index(n, k):
    rng = np.random.default_rng(n + k)
    w = _random_weight(rng, n, k)
    p = _native.prepack(w, target="sm120")
    assert isinstance(p, jax_fp4.NVFP4Weight) and isinstance(p, _native.PrepackedNVFP4Weight)
    plain = np.asarray(w.scale_bytes)
    # the plain layout stays available to the other paths
    np.testing.assert_array_equal(np.asarray(p.scale_bytes), plain)
    np.testing.assert_array_equal(np.asarray(p.packed), np.asarray(w.packed))
    swz = np.asarray(p.swizzled_scale)
    assert swz.shape == _native.swizzled_scale_shape(n, k // 16) and swz.dtype == np.uint8
    flat = swz.ravel()
    offsets = _native.swizzle_offsets(n, k // 16)
    covered = np.zeros(flat.size, bool)
    for r in range(n):
        for kb in range(k // 16):
            assert flat[offsets[r, kb]] == plain[r, kb]
            covered[offsets[r, kb]] = True
    assert not flat[~covered].any()


def test_prepack_is_a_pytree_and_jits():
    rng = np.random.default_rng(0)
    p = _native.prepack(_random_weight(rng, 64, 64))
    leaves, treedef = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 4
    q = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(q, _native.PrepackedNVFP4Weight) and q.block_size == 16
    doubled = jax.jit(lambda w: jax.tree_util.tree_map(lambda x: x, w))(p)
    np.testing.assert_array_equal(np.asarray(doubled.swizzled_scale), np.asarray(p.swizzled_scale))
    jitted = jax.jit(_native.prepack)(_random_weight(rng, 64, 64))
    assert isinstance(jitted, _native.PrepackedNVFP4Weight)
    assert p.nbytes == _random_weight(rng, 64, 64).nbytes + 512


def test_prepack_stacked_weights():
    rng = np.random.default_rng(1)
    w = jax_fp4.quantize(rng.standard_normal((3, 160, 64)).astype(np.float32))
    p = _native.prepack(w)
    assert p.swizzled_scale.shape == (3, 2, 512)
    for i in range(3):
        np.testing.assert_array_equal(
            np.asarray(p.swizzled_scale[i]), _native.swizzle_scales_np(np.asarray(w.scale_bytes[i]))
        )


def test_prepack_errors():
    rng = np.random.default_rng(2)
    w = _random_weight(rng, 32, 64)
    with pytest.raises(ValueError, match="target"):
        _native.prepack(w, target="sm90")
    with pytest.raises(TypeError):
        _native.prepack(np.zeros((32, 32), np.uint8))
    w32 = jax_fp4.quantize(rng.standard_normal((32, 64)).astype(np.float32), block_size=32)
    with pytest.raises(ValueError, match="block_size 16"):
        _native.prepack(w32)
    with pytest.raises(ValueError, match="swizzled_scale"):
        _native.PrepackedNVFP4Weight(
            w.packed, w.scale, w.global_scale, 16, swizzled_scale=jnp.zeros((1, 256), jnp.uint8)
        )


# ---- the quantizer's NumPy model ----------------------------------------------------------------


def test_e4m3_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(4)
    s = np.exp2(rng.uniform(-9, np.log2(448), 200_000)).astype(np.float32)
    # plus exact ties and the ends of the range
    grid = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    s = np.concatenate([s, grid, mids, np.float32([2.0**-9, 448.0])])
    s = s[(s >= 2.0**-9) & (s <= 448.0)]
    expected = s.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(_native.f32_to_e4m3_rne_np(s), expected)


def test_e2m1_rounding_ties_to_even():
    q = np.float32(
        [0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e30, -0.25, -0.75, -6, -0.0]
    )
    codes = _native.e2m1_round_np(q)
    values = jax_fp4.format.E2M1_VALUES[codes]
    np.testing.assert_array_equal(
        values, np.float32([0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 6, 0, -1, -6, 0])
    )
    # A negative value that rounds to zero keeps its sign (0x8), as ModelOpt's quantizer writes it;
    # an exact -0.0 is not below zero and gets 0x0.
    assert codes[-1] == 0 and codes[12] == 8


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_reference_matches_modelopt_quantize(dtype):
    """Dynamic-scale activation quantization is ModelOpt's weight quantizer applied to A."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((40, 256)) * np.exp2(rng.integers(-4, 4, (40, 1)))).astype(dtype)
    packed, scale, gs = _native.quantize_activation_reference(a)
    w = jax_fp4.quantize(np.asarray(a, np.float32))
    np.testing.assert_array_equal(packed, np.asarray(w.packed))
    np.testing.assert_array_equal(scale, np.asarray(w.scale_bytes))
    assert gs == np.float32(w.global_scale)


def test_reference_static_scale_nonfinite_and_zero():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    a[1, 3] = np.nan
    a[2, 40] = np.inf
    packed, scale, gs = _native.quantize_activation_reference(a)
    assert gs == np.float32(np.abs(a[np.isfinite(a)]).max() / np.float32(2688))
    assert scale[1, 0] == 0x7F and scale[2, 2] == 0x7F
    assert not packed[1, :8].any() and not packed[2, 16:24].any()
    assert (scale[0] != 0x7F).all()
    # all-zero input: global scale 1, block scale 1.0 (0x38), zero codes
    packed, scale, gs = _native.quantize_activation_reference(np.zeros((2, 32), np.float16))
    assert gs == 1.0 and (scale == 0x38).all() and not packed.any()
    # static scale: large values saturate at +-6 * 448 * g
    packed, scale, gs = _native.quantize_activation_reference(
        np.full((1, 16), 1000, np.float32), activation_scale=0.01
    )
    assert gs == np.float32(0.01) and scale[0, 0] == 0x7E  # 448
    # invalid static scale: NaN scales everywhere
    _, scale, _ = _native.quantize_activation_reference(a, activation_scale=0.0)
    assert (scale == 0x7F).all()


def test_reference_dequantizes_close_to_input():
    rng = np.random.default_rng(8)
    a = rng.standard_normal((16, 512)).astype(np.float32)
    packed, scale, gs = _native.quantize_activation_reference(a)
    from tests import reference

    deq = reference.dequantize(packed, scale, gs, 16)
    assert reference.relative_error(deq, a) < 0.12  # NVFP4 quantization noise


# ---- the CUDA targets -----------------------------------------------------------------------------

HAS_CUDA = bool(gpus())
_TARGETS = {
    _native.QUANTIZE_ACTIVATION_TARGET,
    _native.SWIZZLE_SCALES_TARGET,
    _native.NATIVE_GEMM_TARGET,
}
HAS_TARGETS = _TARGETS <= set(_ffi.REGISTERED_TARGETS.get("CUDA", []))


def cuda_targets(fn):
    """The CUDA tests: a CUDA device and the path's targets in the package's CUDA module."""
    fn = pytest.mark.skipif(
        HAS_CUDA and not HAS_TARGETS, reason="the CUDA module lacks the native SM120 targets"
    )(fn)
    fn = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


CAPABILITY = _native.device_capability() if HAS_CUDA else None
IS_SM120 = CAPABILITY is not None and CAPABILITY[0] == 12
DTYPES = [jnp.float16, jnp.bfloat16]


def _rng():
    seed = int(np.random.SeedSequence().entropy % (2**63))
    return np.random.default_rng(seed), seed


def _poison(nbytes: int, value: int = 0xA5) -> None:
    x = jnp.full((max(int(nbytes), 1),), value, jnp.uint8)
    x.block_until_ready()
    del x


def _activation(rng, m, k, dtype):
    """Random rows spanning several binades, plus an all-zero block and a tiny block."""
    a = rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 6, (m, 1)))
    if m > 2 and k >= 32:
        a[1, :16] = 0.0
        a[2, 16:32] *= 1e-4
    return jnp.asarray(a.astype(np.float32)).astype(dtype)


# ---- activation quantizer -----------------------------------------------------------------------


@cuda_targets
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "m,k", [(1, 16), (9, 32), (130, 96), (257, 160), (300, 4096), (1024, 1024)]
)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("swizzled", [True, False], ids=["swizzled", "plain"])
def test_quantizer_bit_exact(dtype, m, k, static, swizzled):
    rng, seed = _rng()
    a = _activation(rng, m, k, dtype)
    a_np = np.asarray(a)
    scale_in = None
    if static:  # a static scale below the dynamic one: some blocks saturate
        scale_in = np.float32(_native.activation_global_scale_np(a_np) * rng.uniform(0.3, 1.5))
    ref_packed, ref_scale, ref_gs = _native.quantize_activation_reference(a_np, scale_in)
    fn = jax.jit(functools.partial(_native.quantize_activation, swizzled=swizzled))
    _poison(m * k)
    packed, scale, gs = fn(a) if scale_in is None else fn(a, jnp.float32(scale_in))
    packed, scale, gs = np.asarray(packed), np.asarray(scale), np.asarray(gs)
    msg = f"seed={seed}"
    assert gs.shape == (1,) and gs[0] == ref_gs, msg
    np.testing.assert_array_equal(packed, ref_packed, err_msg=msg)
    expected_scale = _native.swizzle_scales_np(ref_scale) if swizzled else ref_scale
    np.testing.assert_array_equal(scale, expected_scale, err_msg=msg)  # padding bytes included


@cuda_targets
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_quantizer_nonfinite_and_zero(dtype):
    rng, seed = _rng()
    a = np.asarray(_activation(rng, 140, 128, dtype)).copy()
    a[3, 5] = np.nan
    a[7, 100] = np.inf
    a[139, 127] = -np.inf
    a = jnp.asarray(a)
    for inp in (a, jnp.zeros((20, 64), dtype)):
        ref_packed, ref_scale, ref_gs = _native.quantize_activation_reference(np.asarray(inp))
        packed, scale, gs = jax.jit(_native.quantize_activation)(inp)
        assert np.asarray(gs)[0] == ref_gs, f"seed={seed}"
        np.testing.assert_array_equal(np.asarray(packed), ref_packed, err_msg=f"seed={seed}")
        np.testing.assert_array_equal(np.asarray(scale), _native.swizzle_scales_np(ref_scale))
    _, scale, _ = jax.jit(functools.partial(_native.quantize_activation, swizzled=False))(a)
    assert np.asarray(scale)[3, 0] == 0x7F and np.asarray(scale)[7, 6] == 0x7F


@cuda_targets
def test_quantizer_is_deterministic_and_matches_modelopt():
    rng, seed = _rng()
    a = _activation(rng, 64, 512, jnp.bfloat16)
    first = jax.jit(functools.partial(_native.quantize_activation, swizzled=False))(a)
    second = jax.jit(functools.partial(_native.quantize_activation, swizzled=False))(a)
    for x, y in zip(first, second):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with jax.default_device(jax.devices("cpu")[0]):
        w = jax_fp4.quantize(np.asarray(a, np.float32))
    np.testing.assert_array_equal(
        np.asarray(first[0]), np.asarray(w.packed), err_msg=f"seed={seed}"
    )
    np.testing.assert_array_equal(
        np.asarray(first[1]), np.asarray(w.scale_bytes), err_msg=f"seed={seed}"
    )


# ---- the native GEMM ----------------------------------------------------------------------------


def _problem(rng, m, n, k, dtype, with_bias):
    w = jax_fp4.quantize(rng.standard_normal((n, k)).astype(np.float32))
    a = _activation(rng, m, k, dtype)
    bias = (
        jnp.asarray(rng.standard_normal(n).astype(np.float32)).astype(dtype) if with_bias else None
    )
    return a, w, bias


def _call_native(a, w, bias, prepacked):
    swz = _native.prepack(w).swizzled_scale if prepacked else None
    fn = jax.jit(
        lambda a, packed, scale, gs, bias, swz: _native.native_matmul(
            a, packed, scale, gs, bias, block_size=16, swizzled_scale=swz
        )
    )
    return fn(a, w.packed, w.scale_bytes, w.global_scale, bias, swz)


@cuda_targets
@pytest.mark.skipif(IS_SM120, reason="checks the error on devices other than SM120")
def test_native_gemm_errors_off_sm120():
    rng, _ = _rng()
    a, w, bias = _problem(rng, 64, 128, 256, jnp.bfloat16, True)
    with pytest.raises(Exception, match=r"compute capability 12\.x") as err:
        np.asarray(_call_native(a, w, bias, prepacked=False))
    assert f"{CAPABILITY[0]}.{CAPABILITY[1]}" in str(err.value)
    with pytest.raises(ValueError, match="backend='native' cannot serve"):
        _native.native_path_applies(CAPABILITY, True, "native", 64, 128, 256, 16)


@cuda_targets
@pytest.mark.skipif(
    not IS_SM120, reason="the native NVFP4 x NVFP4 GEMM needs compute capability 12.x"
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "m,n,k", [(9, 32, 32), (128, 256, 96), (300, 512, 4096), (1000, 11008, 512)]
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("prepacked", [False, True], ids=["scratch", "prepacked"])
def test_native_gemm_matches_activation_quantized_reference(dtype, m, n, k, with_bias, prepacked):
    rng, seed = _rng()
    a, w, bias = _problem(rng, m, n, k, dtype, with_bias)
    q_packed, q_scale, q_gs = _native.quantize_activation_reference(np.asarray(a))
    a_q = reference.dequantize(q_packed, q_scale, q_gs, 16)
    expected = reference.matmul(
        a_q,
        np.asarray(w.packed),
        np.asarray(w.scale_bytes),
        w.global_scale,
        16,
        None if bias is None else np.asarray(bias, np.float64),
    )
    _poison(m * n * 2, 0xFF)  # 0xFFFF is NaN in fp16 and bf16
    y = np.asarray(_call_native(a, w, bias, prepacked))
    assert y.shape == (m, n) and y.dtype == np.dtype(dtype)
    assert np.isfinite(y.astype(np.float32)).all(), f"seed={seed}"
    err = reference.relative_error(y, expected)
    assert err < reference.TOLERANCE[np.dtype(dtype).name], f"seed={seed} rel err {err}"
