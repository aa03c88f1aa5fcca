"""The decode GEMV's tiled layout (jax_fp4/layout.py) and `jax_fp4.prepack(w)`, on any machine.

The byte map is checked element by element against the layout's definition written as loops, and
the GEMV's decode of the tiled words (DecodeTiled in ffi/cuda/gemv/mma.cuh) is modelled bit for
bit in NumPy: every fragment slot must hold exactly the E2M1 value the mma pairs with it.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import layout as _layout
from jax_fp4 import native as _native
from jax_fp4.format import E2M1_VALUES
from tests import reference


def _weight(rng, n, k, lead=()):
    packed = rng.integers(0, 256, size=(*lead, n, k // 2), dtype=np.uint8)
    scale = rng.integers(0, 256, size=(*lead, n, k // 16), dtype=np.uint8)
    gs = rng.uniform(0.5, 2, size=lead).astype(np.float32)
    return jax_fp4.NVFP4Weight(packed, scale, gs)


def _codes(packed):
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


@pytest.mark.parametrize("n, k", [(16, 128), (48, 384), (32, 1024)])
def test_tiled_bytes_follow_the_definition(n, k):
    rng = np.random.default_rng()
    w = _weight(rng, n, k)
    tiled = np.asarray(_layout.tile_packed(w.packed)).reshape(-1)
    tiled_scale = np.asarray(_layout.tile_scale(w.scale)).reshape(-1)
    spec_codes = _codes(w.packed)
    windows = k // 128
    for tile in range(n // 16):
        for win in range(windows):
            for h in range(2):
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    row = 16 * tile + 8 * h + g
                    base = ((tile * windows + win) * 2 + h) * 512 + 16 * lane
                    for word in range(4):
                        q = int.from_bytes(tiled[base + 4 * word : base + 4 * word + 4], "little")
                        for e in range(8):  # element e of the word: spec bits 4e..4e+3
                            code = spec_codes[row, 128 * win + 32 * t + 8 * word + e]
                            got = sum(
                                ((q >> int(_layout.WORD_BITS[4 * e + b])) & 1) << b
                                for b in range(4)
                            )
                            assert got == code, (tile, win, h, lane, word, e)
                    for i in range(2):
                        sbyte = tiled_scale[((tile * windows + win) * 32 + lane) * 4 + 2 * h + i]
                        assert sbyte == np.asarray(w.scale)[row, 8 * win + 2 * t + i]


def _decode_tiled(q, dtype):
    """NumPy model of DecodeTiled::Weights: uint32 words -> (pair S%2 = 0, 1, 2, 3) 16-bit pairs."""
    q = q.astype(np.uint64)

    def rotr(x, r):
        return ((x >> r) | (x << (32 - r))) & 0xFFFFFFFF

    pairs = [q, rotr(q, 3), rotr(q, 6), ((q & 0x001B001B) * 0x1084) & 0xFFFFFFFF]
    if dtype == "bfloat16":
        out = [p & 0x81C081C0 for p in pairs]
    else:
        out = [(((p & 0x01C001C0) << 3) | (p & 0x80008000)) & 0xFFFFFFFF for p in pairs]
    return [o.astype(np.uint32) for o in out]


def _half_values(bits, dtype):
    """uint32 pairs -> float64 (low half, high half)."""
    lo, hi = (bits & 0xFFFF).astype(np.uint16), (bits >> 16).astype(np.uint16)
    view = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    return lo.view(view).astype(np.float64), hi.view(view).astype(np.float64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gemv_decode_of_tiled_words_is_exact(dtype):
    """Every k-step's A-fragment pairs, decoded from the tiled words as the kernel does, hold the
    E2M1 values of the K elements the activations' natural pairs bring (x 2^-126 or 2^-14)."""
    rng = np.random.default_rng()
    n, k = 32, 512
    w = _weight(rng, n, k)
    codes = _codes(np.asarray(w.packed))
    windows = k // 128
    words = np.asarray(_layout.tile_packed(w.packed)).reshape(n // 16, windows, 2, 8, 4, 16)
    words = words.astype(np.uint32).reshape(
        n // 16, windows, 2, 8, 4, 4, 4
    )  # [T, w, h, g, t, W, byte]
    words = sum(words[..., i] << (8 * i) for i in range(4)).astype(np.uint32)  # [T, w, h, g, t, W]
    unit = 2.0**-126 if dtype == "bfloat16" else 2.0**-14
    decoded = _decode_tiled(words, dtype)
    # element index of pair p's even element inside word W of lane t of window w:
    tile, win, h, g, t, word = np.indices(words.shape)
    row = 16 * tile + 8 * h + g
    for p in range(4):
        lo, hi = _half_values(decoded[p], dtype)
        kk = 128 * win + 32 * t + 8 * word + 2 * p
        np.testing.assert_array_equal(lo, E2M1_VALUES[codes[row, kk]] * unit, err_msg=f"pair {p}")
        np.testing.assert_array_equal(
            hi, E2M1_VALUES[codes[row, kk + 1]] * unit, err_msg=f"pair {p}"
        )


@pytest.mark.parametrize(
    "lead, n, k", [((), 16, 128), ((), 64, 640), ((3,), 32, 256), ((2, 2), 48, 128)]
)
def test_prepack_round_trip_and_same_values(lead, n, k):
    rng = np.random.default_rng()
    w = _weight(rng, n, k, lead)
    p = jax_fp4.prepack(w)
    assert p.layout == "tiled" and p.shape == w.shape and p.packed.shape == w.packed.shape
    assert not np.array_equal(np.asarray(p.packed), np.asarray(w.packed))
    back = jax_fp4.unprepack(p)
    assert back.layout == "spec"
    np.testing.assert_array_equal(np.asarray(back.packed), np.asarray(w.packed))
    np.testing.assert_array_equal(np.asarray(back.scale), np.asarray(w.scale))
    np.testing.assert_array_equal(
        np.asarray(jax_fp4.dequantize(p)), np.asarray(jax_fp4.dequantize(w))
    )
    assert jax_fp4.prepack(p) is p and jax_fp4.unprepack(w) is w
    np.testing.assert_array_equal(
        np.asarray(jax_fp4.prepack(w, target="tiled").packed), np.asarray(p.packed)
    )


def test_prepack_is_a_jittable_pytree():
    rng = np.random.default_rng()
    w = _weight(rng, 32, 256)
    p = jax.jit(jax_fp4.prepack)(w)
    leaves, treedef = jax.tree_util.tree_flatten(p)
    q = jax.tree_util.tree_unflatten(treedef, leaves)
    assert q.layout == "tiled" and q.block_size == 16
    np.testing.assert_array_equal(np.asarray(q.packed), np.asarray(jax_fp4.prepack(w).packed))
    assert "layout='tiled'" in repr(p)
    # float8 scales stay float8
    w8 = jax_fp4.NVFP4Weight(
        w.packed, np.asarray(w.scale).view(ml_dtypes.float8_e4m3fn), w.global_scale
    )
    assert jax_fp4.prepack(w8).scale.dtype == jnp.float8_e4m3fn


@pytest.mark.parametrize("backend", ["reference", "cpu", "xla", None])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_matmul_on_prepacked_weights_is_bit_identical(backend, dtype):
    if backend == "xla" and dtype == jnp.float32:
        pytest.skip("the xla path serves fp16/bf16 only (tests/test_matmul.py checks its error)")
    rng = np.random.default_rng()
    packed, scale, gs = reference.random_weight(rng, 48, 384)
    w = jax_fp4.NVFP4Weight(packed, scale, gs)
    p = jax_fp4.prepack(w)
    a = jnp.asarray(rng.standard_normal((2, 3, 384)), dtype)
    bias = jnp.asarray(rng.standard_normal(48), dtype)
    f = jax.jit(lambda a, w, b: jax_fp4.matmul(a, w, b, backend=backend))
    np.testing.assert_array_equal(np.asarray(f(a, p, bias)), np.asarray(f(a, w, bias)))
    # vmap over stacked prepacked weights, and the gradients, see the same weight
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), p, jax_fp4.prepack(w))
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda w: f(a, w, bias))(stacked))[1], np.asarray(f(a, w, bias))
    )
    if dtype == jnp.float32:

        def loss(a, w, gs):
            w = jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(w), [w.packed, w.scale, gs]
            )
            return jnp.sum(jax_fp4.matmul(a, w, bias) ** 2)

        for argnum in (0, 2):
            grads = [jax.grad(loss, argnum)(a, x, x.global_scale) for x in (w, p)]
            np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))


def test_prepack_errors():
    rng = np.random.default_rng()
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 128 == 0, got N=40, K=256"):
        jax_fp4.prepack(_weight(rng, 40, 256))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128 == 0, got N=32, K=96"):
        jax_fp4.prepack(_weight(rng, 32, 96))
    w32 = jax_fp4.quantize(rng.standard_normal((32, 256)).astype(np.float32), block_size=32)
    with pytest.raises(ValueError, match="block_size 16, got 32"):
        jax_fp4.prepack(w32)
    with pytest.raises(ValueError, match="target must be one of"):
        jax_fp4.prepack(_weight(rng, 32, 256), target="sm90")
    with pytest.raises(TypeError, match="w must be an NVFP4Weight"):
        jax_fp4.prepack(np.zeros((32, 128), np.uint8))
    with pytest.raises(ValueError, match="layout must be one of"):
        jax_fp4.NVFP4Weight(
            np.zeros((16, 64), np.uint8), np.zeros((16, 8), np.uint8), 1.0, layout="swizzled"
        )
    with pytest.raises(ValueError, match="layout='tiled' needs N % 16"):
        jax_fp4.NVFP4Weight(
            np.zeros((8, 64), np.uint8), np.zeros((8, 8), np.uint8), 1.0, layout="tiled"
        )
    with pytest.raises(ValueError, match="target 'sm120' needs a weight in the spec layout"):
        _native.prepack(jax_fp4.prepack(_weight(rng, 32, 256)))


def test_sm120_prepack_of_a_tiled_weight_restores_the_spec_layout():
    rng = np.random.default_rng()
    w = _weight(rng, 32, 256)
    s = jax_fp4.prepack(jax_fp4.prepack(w), target="sm120")
    assert isinstance(s, _native.PrepackedNVFP4Weight) and s.layout == "spec"
    np.testing.assert_array_equal(np.asarray(s.packed), np.asarray(w.packed))
    np.testing.assert_array_equal(
        np.asarray(s.swizzled_scale), np.asarray(_native.prepack(w).swizzled_scale)
    )
