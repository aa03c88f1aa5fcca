"""NVFP4 decoding, packing and ModelOpt quantization against hand-worked values."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4.checkpoint import read_safetensors
from jax_fp4.format import e2m1_to_float32, e4m3_to_float32
from tests import reference

E2M1_BY_HAND = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
SCALE_ONE = 0x38  # E4M3 byte of 1.0


def test_reference_decoders_match_hand_values():
    np.testing.assert_array_equal(reference.e2m1_decode(np.arange(16)), E2M1_BY_HAND)
    hand = {
        0x00: 0.0,
        0x01: 2.0**-9,
        0x07: 7 * 2.0**-9,
        0x08: 2.0**-6,
        0x38: 1.0,
        0x3A: 1.25,
        0x7E: 448.0,
        0x80: -0.0,
        0xB8: -1.0,
        0xFE: -448.0,
    }
    for byte, value in hand.items():
        assert reference.e4m3_decode(byte) == value, hex(byte)
    assert np.isnan(reference.e4m3_decode(0x7F)) and np.isnan(reference.e4m3_decode(0xFF))


def test_all_e2m1_codes_decode():
    codes = np.arange(16, dtype=np.uint8)
    w = jax_fp4.NVFP4Weight(
        jax_fp4.pack_codes(codes[None]), np.full((1, 1), SCALE_ONE, np.uint8), 1.0, block_size=16
    )
    got = np.asarray(jax_fp4.dequantize(w))[0]
    np.testing.assert_array_equal(got, E2M1_BY_HAND)
    assert np.signbit(got[8])  # code 0x8 is -0 and decodes to zero


def test_all_packed_bytes_decode_to_two_e2m1_values():
    all_bytes = np.arange(256, dtype=np.uint8).reshape(2, 128)  # leading axes kept
    got = np.asarray(e2m1_to_float32(all_bytes))
    want = reference.e2m1_decode(reference.unpack(all_bytes))  # low nibble first
    assert got.shape == (2, 256) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 for code 0x8 too
    # The same when XLA sees the bytes as a constant (a weight captured by jit) and may fold.
    folded = np.asarray(jax.jit(lambda: e2m1_to_float32(all_bytes))())
    np.testing.assert_array_equal(folded, want)
    np.testing.assert_array_equal(np.signbit(folded), np.signbit(want))


def test_all_e4m3_bytes_decode():
    all_bytes = np.arange(256, dtype=np.uint8)
    got = np.asarray(e4m3_to_float32(all_bytes), np.float64)
    want = reference.e4m3_decode(all_bytes)
    np.testing.assert_array_equal(got, want)  # NaN positions must match too
    assert np.isnan(got[[0x7F, 0xFF]]).all() and np.isnan(got).sum() == 2
    # float8_e4m3fn input gives the same values as raw bytes
    as_fp8 = all_bytes.view(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(e4m3_to_float32(as_fp8), np.float64), want)


def test_pack_unpack_round_trip():
    rng = np.random.default_rng()
    codes = rng.integers(0, 16, size=(5, 3, 38), dtype=np.uint8)
    packed = np.asarray(jax_fp4.pack_codes(codes))
    assert packed.shape == (5, 3, 19) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed & 0xF, codes[..., 0::2])  # even element: low nibble
    np.testing.assert_array_equal(packed >> 4, codes[..., 1::2])
    np.testing.assert_array_equal(np.asarray(jax_fp4.unpack_codes(packed)), codes)
    np.testing.assert_array_equal(reference.unpack(packed), codes)


def test_dequantize_matches_reference_any_block_size():
    rng = np.random.default_rng()
    for n, k, bs in [(7, 38, 16), (5, 34, 7), (3, 10, 3), (4, 64, 32), (2, 6, 1)]:
        packed, scale, gs = reference.random_weight(rng, n, k, bs)
        w = jax_fp4.NVFP4Weight(packed, scale, gs, block_size=bs)
        got = np.asarray(jax_fp4.dequantize(w, jnp.float32), np.float64)
        np.testing.assert_allclose(got, reference.dequantize(packed, scale, gs, bs), rtol=1e-7)


# Global scales for the rounding tests: amax / 2688 of a bf16 amax (a repeating mantissa, where
# float32 lands on bf16 / fp16 midpoints far more often than random bits do; 0x3A855555 is the
# issue's), plain ones, one whose products are bf16 subnormals, one past fp16's range and one past
# float32's (448 * 6 * 3e38).
ROUNDING_GLOBAL_SCALES = [
    np.uint32(0x3A855555).view(np.float32),
    np.float32(1.0),
    np.float32(0.37),
    np.float32(np.float32(0.8125) / np.float32(2688)),
    np.float32(2.0**-135),
    np.float32(60.0),
    np.float32(3e38),
]


def _np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)


def _every_code_and_scale_byte(gs, nan_scales=True):
    """A weight of every E4M3 scale byte (one per row) against every E2M1 code (16 a block)."""
    bytes_ = np.arange(256, dtype=np.uint8)
    if not nan_scales:
        bytes_ = bytes_[(bytes_ & 0x7F) != 0x7F]
    codes = np.tile(np.arange(16, dtype=np.uint8), (bytes_.size, 2))
    packed = np.asarray(jax_fp4.pack_codes(codes))
    scale = np.repeat(bytes_[:, None], 2, axis=1)
    return jax_fp4.NVFP4Weight(packed, scale, gs, block_size=16)


def _assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(
        np.where(nan, 0, got.view(bits)), np.where(nan, 0, want.view(bits))
    )


def test_dequantize_to_bf16_is_correctly_rounded_the_issues_value():
    """Global scale 0x3A855555, block scale 0x57 (15.0), code 0xF (-6): the exact product is
    -0.0915527..., which float32 rounds to a bf16 midpoint; rounded twice it became
    -0.091796875, the correctly rounded value (and ModelOpt's) is -0.09130859375."""
    gs = np.uint32(0x3A855555).view(np.float32)
    w = jax_fp4.NVFP4Weight(np.full((1, 8), 0xFF, np.uint8), np.full((1, 1), 0x57, np.uint8), gs)
    got = np.asarray(jax_fp4.dequantize(w, jnp.bfloat16), np.float64)
    np.testing.assert_array_equal(got, np.full((1, 16), -0.09130859375))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dequantize_rounds_once_every_code_and_scale_byte(dtype):
    """Every code against every scale byte at several global scales: the correctly rounded value of
    the exact float64 product, bit for bit (subnormals, overflow to inf, -0 and NaN included)."""
    np_dtype = _np_dtype(dtype)
    for gs in ROUNDING_GLOBAL_SCALES:
        if dtype == "float32" and gs < 2.0**-116:
            continue  # subnormal float32 products: XLA's CPU programs flush them (dequantize's doc)
        w = _every_code_and_scale_byte(gs)
        want = reference.dequantize_as(w.packed, w.scale_bytes, gs, 16, np_dtype)
        _assert_same_bits(jax_fp4.dequantize(w, np_dtype), want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequantize_rounds_once_quantized_weights(dtype):
    """Weights as quantize makes them (global scale amax / 2688): the double rounding this replaces
    was one ulp off in ~0.1-0.25% of these values."""
    np_dtype = _np_dtype(dtype)
    rng = np.random.default_rng()
    w = jax_fp4.quantize((rng.standard_normal((256, 512)) * 0.02).astype(np.float32))
    want = reference.dequantize_as(w.packed, w.scale_bytes, w.global_scale, 16, np_dtype)
    _assert_same_bits(jax_fp4.dequantize(w, np_dtype), want)


def _identity_product(w, dtype, backend):
    """matmul(I, w) = w^T exactly when w's entries are exact in dtype (finite, no NaN)."""
    eye = jnp.eye(w.k, dtype=dtype)
    return np.asarray(jax_fp4.matmul(eye, w, backend=backend)).T


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_xla_path_weight_rounds_once(dtype):
    """The xla path's dense weight (lowering.dense -> format.dense_weight in the activation's dtype)
    is the correctly rounded one: I @ W^T returns it exactly."""
    np_dtype = _np_dtype(dtype)
    for gs in ROUNDING_GLOBAL_SCALES[:4]:  # finite products in both dtypes
        w = _every_code_and_scale_byte(gs, nan_scales=False)
        want = reference.dequantize_as(w.packed, w.scale_bytes, gs, 16, np_dtype)
        np.testing.assert_array_equal(
            _identity_product(w, np_dtype, "xla").astype(np.float64), want.astype(np.float64)
        )


def _has_cuda() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_dequantize_paths_round_once(dtype):
    """On the GPU: the CUDA dequantize kernel (jax_fp4_dequant_cuda, spec and tiled layouts), the
    dequant path of matmul and XLA's dequantize all give the correctly rounded bits."""
    from jax_fp4 import layout as _layout

    np_dtype = _np_dtype(dtype)
    for gs in ROUNDING_GLOBAL_SCALES:
        w = _every_code_and_scale_byte(gs)
        want = reference.dequantize_as(w.packed, w.scale_bytes, gs, 16, np_dtype)
        _assert_same_bits(jax_fp4.dequantize(w, np_dtype), want)
        call = jax.ffi.ffi_call("jax_fp4_dequant_cuda", jax.ShapeDtypeStruct((w.n, w.k), np_dtype))
        _assert_same_bits(
            call(w.packed, w.scale_bytes, gs, block_size=np.int64(16), tiled=False), want
        )
        # The tiled layout needs K % 128 == 0: the same 32 columns four times over.
        wide = jax.ShapeDtypeStruct((w.n, 4 * w.k), np_dtype)
        tiled = jax.ffi.ffi_call("jax_fp4_dequant_cuda", wide)(
            _layout.tile_packed(np.tile(np.asarray(w.packed), (1, 4))),
            _layout.tile_scale(np.tile(np.asarray(w.scale_bytes), (1, 4))),
            gs,
            block_size=np.int64(16),
            tiled=True,
        )
        _assert_same_bits(tiled, np.tile(want, (1, 4)))
    rng = np.random.default_rng()
    w = jax_fp4.quantize((rng.standard_normal((256, 512)) * 0.02).astype(np.float32))
    want = reference.dequantize_as(w.packed, w.scale_bytes, w.global_scale, 16, np_dtype)
    call = jax.ffi.ffi_call("jax_fp4_dequant_cuda", jax.ShapeDtypeStruct((w.n, w.k), np_dtype))
    _assert_same_bits(
        call(w.packed, w.scale_bytes, w.global_scale, block_size=np.int64(16), tiled=False), want
    )
    for gs in ROUNDING_GLOBAL_SCALES[:4]:
        w = _every_code_and_scale_byte(gs, nan_scales=False)
        want = reference.dequantize_as(w.packed, w.scale_bytes, gs, 16, np_dtype)
        np.testing.assert_array_equal(
            _identity_product(w, np_dtype, "dequant").astype(np.float64), want.astype(np.float64)
        )


def _one_block(values):
    return np.asarray(values, np.float32)[None, :]


def test_quantize_ties_and_codes_by_hand():
    # Global amax 2688 gives g = 1, so each block scale is amax_block / 6.
    ties = [
        0.25,
        0.75,
        1.25,
        1.75,
        2.5,
        3.5,
        5.0,
        6.0,
        -0.25,
        -0.75,
        -1.25,
        -1.75,
        -2.5,
        -3.5,
        -5.0,
        -6.0,
    ]
    w = np.concatenate([_one_block(ties), _one_block([2688.0] + [0.0] * 15)], axis=1)
    q = jax_fp4.quantize(w)
    assert float(q.global_scale) == 1.0
    np.testing.assert_array_equal(np.asarray(q.scale_bytes), [[SCALE_ONE, 0x7E]])  # 1.0 and 448
    codes = np.asarray(jax_fp4.unpack_codes(q.packed))[0]
    # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4, 6->6. -0.25 rounds to zero and
    # keeps its sign, code 0x8 (-0): ModelOpt and compressed-tensors write 0x8 there, and a quantizer
    # that claims ModelOpt's bytes must too (tests/data/real_tools/modelopt_quantize holds them).
    np.testing.assert_array_equal(
        codes[:16], [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    )
    np.testing.assert_array_equal(codes[16:], [7] + [0] * 15)


def test_quantize_scale_rounding_saturation_zero_and_tiny_blocks():
    g_block = [2688.0] + [0.0] * 15
    saturating = [6.375] + [
        0.0
    ] * 15  # s = 1.0625 rounds (tie, to even) to 1.0; 6.375/1 saturates to 6
    tie_up = [6 * 1.1875] + [0.0] * 15  # s = 1.1875 is a tie between 1.125 and 1.25: even is 1.25
    zeros = [0.0] * 16  # zero block: scale 1.0, codes 0
    tiny = [1e-6] + [0.0] * 15  # s below 2^-9 is clamped to the smallest subnormal
    w = np.concatenate([_one_block(b) for b in (g_block, saturating, tie_up, zeros, tiny)], axis=1)
    q = jax_fp4.quantize(w)
    np.testing.assert_array_equal(np.asarray(q.scale_bytes), [[0x7E, 0x38, 0x3A, 0x38, 0x01]])
    codes = np.asarray(jax_fp4.unpack_codes(q.packed))[0].reshape(5, 16)
    assert codes[1, 0] == 7 and codes[2, 0] == 7 and (codes[3] == 0).all() and codes[4, 0] == 0


def test_quantize_is_bit_exact_with_modelopt():
    # bf16 weights (as checkpoints are) across binades: their short mantissas put quotients right
    # next to E2M1 ties, where a reciprocal-multiply (XLA's rewrite of a division by a broadcast)
    # lands on the wrong side about once per thousand elements.
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 1040)) * np.exp2(rng.integers(-6, 6, (256, 1)))
    w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    w[3, :16] = 0.0
    for bs in (16, 13):
        codes, scale, gs = reference.modelopt_quantize(w, bs)
        q = jax_fp4.quantize(w, block_size=bs)
        assert np.asarray(q.global_scale) == gs
        np.testing.assert_array_equal(np.asarray(q.scale_bytes), scale)
        np.testing.assert_array_equal(np.asarray(jax_fp4.unpack_codes(q.packed)), codes)


REAL_TOOLS = Path(__file__).parent / "data" / "real_tools"


@pytest.mark.parametrize(
    "name", ["normal_f32_256x512", "normal_bf16_256x512", "zero_row_f32_128x256", "ties_f32_64x256"]
)
def test_quantize_gives_modelopts_exported_bytes(name):
    """The bytes nvidia-modelopt 0.47 exports for four known matrices (its README says how they were
    made): codes, block scales and global scale equal, -0 codes (negative values that round to
    zero) included."""
    inputs = np.load(REAL_TOOLS / "modelopt_quantize" / "inputs.npz")
    w = inputs[name]
    if w.dtype == np.uint16:
        w = w.view(ml_dtypes.bfloat16)
    stored = read_safetensors(REAL_TOOLS / "modelopt_quantize" / f"modelopt_{name}.safetensors")
    layer = "model.layers.0.self_attn.o_proj"
    q = jax_fp4.quantize(w)
    np.testing.assert_array_equal(np.asarray(q.packed), stored[f"{layer}.weight"])
    np.testing.assert_array_equal(
        np.asarray(q.scale_bytes), stored[f"{layer}.weight_scale"].view(np.uint8)
    )
    assert np.asarray(q.global_scale).view(np.uint32) == stored[f"{layer}.weight_scale_2"].view(
        np.uint32
    )
    # The NumPy stand-in of ModelOpt in tests/reference.py agrees (it checks quantize elsewhere).
    codes, scale, gs = reference.modelopt_quantize(np.asarray(w, np.float32))
    np.testing.assert_array_equal(codes, reference.unpack(stored[f"{layer}.weight"]))
    np.testing.assert_array_equal(scale, stored[f"{layer}.weight_scale"].view(np.uint8))


def test_negative_values_that_round_to_zero_get_code_0x8():
    """The issue's reproduction: ModelOpt and compressed-tensors both give codes [7, 8]; an exact
    -0.0 is not below zero and gets 0x0 in both."""
    w = np.zeros((1, 16), np.float32)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, -0.1, -0.0
    codes = np.asarray(jax_fp4.unpack_codes(jax_fp4.quantize(w).packed))[0]
    np.testing.assert_array_equal(codes[:3], [7, 8, 0])
    np.testing.assert_array_equal(reference.modelopt_quantize(w)[0][0, :3], [7, 8, 0])


def _blocks(w, bs):
    n, k = w.shape
    kb = -(-k // bs)
    out = np.zeros((n, kb * bs), np.float64)
    out[:, :k] = w
    return out.reshape(n, kb, bs)


@pytest.mark.parametrize("bs, with_importance", [(16, True), (16, False), (7, True)])
def test_quantize_mse_picks_the_least_error_scale(bs, with_importance):
    rng = np.random.default_rng()
    w = (rng.standard_normal((48, 202)) * np.exp2(rng.integers(-4, 4, (48, 1)))).astype(np.float32)
    importance = rng.random(202).astype(np.float32) if with_importance else None
    if with_importance:
        importance[rng.random(202) < 0.2] = 0.0
    q = jax_fp4.quantize(w, block_size=bs, method="mse", importance=importance)
    codes0, scale0, gs = reference.modelopt_quantize(w, bs)
    assert np.asarray(q.global_scale) == gs  # the global scale is ModelOpt's

    blocks32 = _blocks(w, bs).astype(np.float32)
    weights = _blocks((np.ones(202) if importance is None else importance)[None, :], bs)[0]
    got_scale = np.asarray(q.scale_bytes)
    got_codes = np.asarray(jax_fp4.unpack_codes(q.packed))

    def error(scale_bytes):
        codes = reference.round_to_e2m1(blocks32, scale_bytes, gs)
        deq = (
            reference.e2m1_decode(codes) * reference.e4m3_decode(scale_bytes)[..., None] * float(gs)
        )
        return codes, np.sum(weights * (deq - blocks32) ** 2, axis=-1)

    candidates = np.stack(
        [
            error(np.clip(scale0.astype(int) + d, 1, 0x7E).astype(np.uint8))[1]
            for d in (-2, -1, 0, 1, 2)
        ]
    )
    assert (np.abs(got_scale.astype(int) - scale0.astype(int)) <= 2).all()
    codes, err = error(got_scale)
    # The codes are round-to-nearest at the chosen scale, and no neighbour does clearly better.
    np.testing.assert_array_equal(got_codes, codes.reshape(48, -1)[:, :202])
    np.testing.assert_array_less(err, candidates.min(axis=0) * (1 + 1e-5) + 1e-30)
    assert err.sum() < candidates[2].sum()  # better than ModelOpt's scales overall
    if with_importance:  # blocks whose inputs are all unimportant keep ModelOpt's scale
        idle = (weights == 0).all(axis=-1)
        np.testing.assert_array_equal(got_scale[:, idle], scale0[:, idle])


def test_quantize_mse_under_jit_and_stacked():
    rng = np.random.default_rng()
    w = rng.standard_normal((3, 32, 64)).astype(np.float32)
    importance = rng.random((3, 64)).astype(np.float32)
    eager = jax_fp4.quantize(w, method="mse", importance=importance)
    jitted = jax.jit(lambda w, i: jax_fp4.quantize(w, method="mse", importance=i))(w, importance)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    one = jax_fp4.quantize(w[1], method="mse", importance=importance[1])
    np.testing.assert_array_equal(np.asarray(eager.packed[1]), np.asarray(one.packed))
    np.testing.assert_array_equal(np.asarray(eager.scale_bytes[1]), np.asarray(one.scale_bytes))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="gptq"), "method must be one of"),
        (dict(importance=np.ones(64, np.float32)), "importance weights only method='mse'"),
        (
            dict(method="mse", importance=np.ones(63, np.float32)),
            r"importance must have shape \(64,\)",
        ),
        (dict(method="mse", importance=-np.ones(64, np.float32)), "finite and non-negative"),
        (dict(method="mse", importance=np.full(64, np.nan, np.float32)), "finite and non-negative"),
    ],
)
def test_quantize_rejects_bad_method_and_importance(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax_fp4.quantize(np.ones((8, 64), np.float32), **kwargs)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("method", ["modelopt", "mse"])
def test_quantize_rejects_non_finite_weights(bad, method):
    # One inf would make the global scale inf (every value NaN), one NaN the default 1.0.
    rng = np.random.default_rng()
    w = rng.standard_normal((3, 24, 64)).astype(np.float32)  # stacked
    idx = (int(rng.integers(3)), int(rng.integers(24)), int(rng.integers(64)))
    w[idx] = bad
    with pytest.raises(
        ValueError,
        match=rf"w must be finite, got 1 NaN or infinite value \(the "
        rf"first at index \{re.escape(str(idx))[1:]}",
    ):
        jax_fp4.quantize(w, method=method)
    w[0, 0, :2] = np.nan
    with pytest.raises(ValueError, match=r"got \d+ NaN or infinite values"):
        jax_fp4.quantize(jnp.asarray(w, jnp.bfloat16), method=method)
    # Traced, the values are unknown: no error, and the other stacked matrices are unaffected.
    w[1:] = rng.standard_normal((2, 24, 64))
    traced = jax.jit(lambda w: jax_fp4.quantize(w, method=method))(w)
    clean = jax_fp4.quantize(w[1:], method=method)
    for got, want in zip(jax.tree.leaves(traced), jax.tree.leaves(clean)):
        np.testing.assert_array_equal(np.asarray(got)[1:], np.asarray(want))


def test_quantize_error_is_quantization_noise():
    rng = np.random.default_rng()
    w = rng.standard_normal((64, 200)).astype(np.float32)  # K not a multiple of the block
    for bs in (16, 32, 7):
        q = jax_fp4.quantize(w, block_size=bs)
        assert q.shape == (64, 200) and q.scale.shape == (64, -(-200 // bs))
        deq = reference.dequantize(q.packed, q.scale_bytes, q.global_scale, bs)
        assert reference.relative_error(deq, w) < 0.12  # E2M1 with per-block scale: ~9% rms


def test_quantize_all_zero_and_stacked():
    q = jax_fp4.quantize(np.zeros((3, 32), np.float32))
    assert float(q.global_scale) == 1.0 and not np.asarray(jax_fp4.dequantize(q)).any()
    rng = np.random.default_rng()
    stack = rng.standard_normal((2, 8, 32)).astype(np.float32)
    qs = jax_fp4.quantize(stack)
    assert qs.shape == (2, 8, 32) and qs.global_scale.shape == (2,)
    one = jax_fp4.quantize(stack[1])
    np.testing.assert_array_equal(np.asarray(qs.packed[1]), np.asarray(one.packed))


@pytest.mark.parametrize("shape", [(0, 128), (5, 0), (16, 0), (2, 0, 128), (0, 16, 128)])
def test_empty_weights(shape):
    """Empty weights (N or K = 0, or no stacked entries) quantize to empty arrays of the right
    shapes with global scale 1.0 (as an all-zero matrix), dequantize, prepack and unprepack, and
    multiply to zeros in both layouts."""
    tileable = shape[-2] % 16 == 0
    for method in ("modelopt", "mse"):
        q = jax_fp4.quantize(np.zeros(shape, np.float32), method=method)
        assert q.shape == shape and q.scale.shape == (*shape[:-1], -(-shape[-1] // 16))
        assert q.global_scale.shape == shape[:-2] and (np.asarray(q.global_scale) == 1.0).all()
        assert jax_fp4.dequantize(q).shape == shape
    layouts = [q] + ([jax_fp4.prepack(q)] if tileable else [])
    if tileable:
        assert layouts[1].layout == "tiled" and jax_fp4.dequantize(layouts[1]).shape == shape
        assert jax_fp4.unprepack(layouts[1]).shape == shape
    if len(shape) == 2:
        for w in layouts:
            a = np.ones((3, shape[1]), np.float32)
            np.testing.assert_array_equal(np.asarray(jax_fp4.matmul(a, w)), np.zeros((3, shape[0])))


def test_weight_container_pytree_and_transforms():
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, 6, 32)
    w_bytes = jax_fp4.NVFP4Weight(packed, scale, gs)
    w_fp8 = jax_fp4.NVFP4Weight(packed, scale.view(ml_dtypes.float8_e4m3fn), gs)
    assert w_bytes.shape == (6, 32) and w_bytes.n == 6 and w_bytes.k == 32
    np.testing.assert_array_equal(
        np.asarray(jax_fp4.dequantize(w_bytes)), np.asarray(jax_fp4.dequantize(w_fp8))
    )
    leaves, treedef = jax.tree_util.tree_flatten(w_fp8)
    assert len(leaves) == 3
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.block_size == 16 and rebuilt.shape == (6, 32)
    # Through jit, device_put and scan as a leaf container.
    doubled = jax.jit(lambda w: jax_fp4.NVFP4Weight(w.packed, w.scale, 2 * w.global_scale))(w_fp8)
    np.testing.assert_allclose(
        np.asarray(jax_fp4.dequantize(doubled)), 2 * np.asarray(jax_fp4.dequantize(w_fp8))
    )
    placed = jax.device_put(w_fp8, jax.devices()[0])
    assert isinstance(placed, jax_fp4.NVFP4Weight) and placed.block_size == 16


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(packed=np.zeros((4, 8), np.int8)), TypeError),
        (dict(packed=np.zeros((8,), np.uint8)), ValueError),
        (dict(scale=np.zeros((4, 2), np.float32)), TypeError),
        (dict(scale=np.zeros((4, 3), np.uint8)), ValueError),
        (dict(global_scale=np.ones((2,), np.float32)), ValueError),
        (dict(global_scale=np.int32(1)), TypeError),
        (dict(block_size=0), ValueError),
        (dict(block_size=1.5), TypeError),
    ],
)
def test_weight_container_rejects_bad_input(bad, error):
    args = dict(
        packed=np.zeros((4, 8), np.uint8),
        scale=np.zeros((4, 1), np.uint8),
        global_scale=np.float32(1),
        block_size=16,
    )
    args.update(bad)
    with pytest.raises(error, match="NVFP4Weight"):
        jax_fp4.NVFP4Weight(**args)


def test_pack_and_unpack_reject_bad_codes():
    rng = np.random.default_rng()
    codes = rng.integers(0, 16, size=(3, 10))
    where = (int(rng.integers(3)), int(rng.integers(10)))
    for bad in (16, 255, -1):
        codes[where] = bad
        with pytest.raises(
            ValueError,
            match=rf"codes must be 0-15 \(4 bits\), got {bad} at index "
            rf"\({where[0]}, {where[1]}\)",
        ):
            jax_fp4.pack_codes(codes)
    codes[where] = 15
    np.testing.assert_array_equal(
        np.asarray(jax_fp4.unpack_codes(jax_fp4.pack_codes(codes))), codes
    )
    with pytest.raises(TypeError, match="pack_codes: codes must be integers"):
        jax_fp4.pack_codes(codes.astype(np.float32))
    with pytest.raises(TypeError, match="unpack_codes: packed must be uint8"):
        jax_fp4.unpack_codes(codes.astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.int32, np.uint8, "foo", bool])
def test_dequantize_rejects_non_float_dtypes(dtype):
    w = jax_fp4.quantize(np.random.default_rng().standard_normal((16, 32)).astype(np.float32))
    with pytest.raises(TypeError, match="dequantize: dtype must be a float dtype"):
        jax_fp4.dequantize(w, dtype)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        jax_fp4.quantize(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="float"):
        jax_fp4.quantize(np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="block_size"):
        jax_fp4.quantize(np.ones((2, 4), np.float32), block_size=0)
    with pytest.raises(ValueError, match="rank"):
        jax_fp4.quantize(np.ones((4,), np.float32))
