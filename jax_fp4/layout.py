"""The decode GEMV's tiled weight layout ("tiled"): array transforms to and from the spec layout.

The tensor-core GEMV (ffi/cuda/gemv/) has a warp read, per 128-wide K window, 16 bytes of
each of 16 weight rows per lane group and 2-byte scale pairs from 16 rows: many short runs. The
tiled layout stores exactly what one warp reads in one window as one contiguous run, and the
nibbles of each 32-bit word in the order the decode wants (no activation permutes, fewer ALU
instructions per word). The fused GEMM and the dequant kernel read it too. On the H200 the GEMV
runs 1.14-1.38x faster at M = 1 on it than on the spec layout, the fused GEMM 1.2-1.6x at
M = 16-64 (benchmarks/RESULTS.md; docs/design.md for why).

For a weight [N, K] (N % 16 == 0, K % 128 == 0, block_size 16), W = K / 128 windows, tile T of 16
rows, window w, lane L = 4 g + t of the warp (g = 0..7, t = 0..3):

  packed: byte ((T W + w) 2 + h) 512 + 16 L + b  (h = 0, 1; b = 0..15) holds spec byte
          [16 T + 8 h + g, 64 w + 16 t + b], each aligned 32-bit word's nibbles permuted
          (`WORD_BITS`);
  scale:  byte ((T W + w) 32 + L) 4 + 2 h + i  (h, i = 0, 1) holds spec scale
          [16 T + 8 h + g, 8 w + 2 t + i].

Both arrays keep their spec shapes [N, K/2] and [N, K/16] (tile T is rows 16 T .. 16 T + 15), so
a weight sharded along N in multiples of 16 rows keeps its tiles whole; the K axis is not
separable (a tile holds every window of its rows).

Word permutation: a spec word holds elements e = 0..7 of the row as nibbles at bits 4e..4e+3
(bit 0 mantissa, bits 1-2 exponent, bit 3 sign). Element e = 2p + h belongs to "pair" p; its
bits go to the bf16 positions (mantissa 6, exponent 7-8, sign 15) + 16 h, rotated left by 3 p for
pairs 0-2; pair 3 sits at bits {4, 0, 1, 3} + 16 h, from where one multiply by 0x1084 moves them
(the kernel's `DecodeTiled`). So `q & 0x81C081C0` is pair 0 as a bf16 pair (e2m1 * 2^-126, exact).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jax_fp4.explicit_axes import by_row_tiles

TILE_ROWS = 16
WINDOW = 128  # K elements per window (kGemvWindow)


def _word_bits() -> np.ndarray:
    """int [32]: WORD_BITS[src] = the bit of the tiled word that holds bit `src` of a spec word."""
    dst = np.empty(32, np.int64)
    bf16_pos = (6, 7, 8, 15)  # nibble bits (mantissa, exp0, exp1, sign) -> bf16 bits
    pair3_pos = (4, 0, 1, 3)  # where pair 3 keeps them (0x1084 adds 2, 7, 12: -> 6, 7, 8, 15)
    for e in range(8):
        p, h = divmod(e, 2)
        for bit in range(4):
            if p < 3:  # the bf16 position, the whole word rotated left by 3 p
                dst[4 * e + bit] = (bf16_pos[bit] + 16 * h + 3 * p) % 32
            else:
                dst[4 * e + bit] = pair3_pos[bit] + 16 * h
    assert sorted(dst.tolist()) == list(range(32))
    return dst


WORD_BITS = _word_bits()


def _permute_words(words, dst):
    """uint32 words -> words with bit i moved to bit dst[i]."""
    out = jnp.zeros_like(words)
    for src, d in enumerate(dst.tolist()):
        out = out | (((words >> src) & 1) << d)
    return out


def _bytes_to_words(b):
    """uint8 [..., 4 m] -> uint32 [..., m], little-endian (byte 0 lowest), independent of host."""
    b = b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4).astype(jnp.uint32)  # no -1: N may be 0
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _words_to_bytes(w):
    b = jnp.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).astype(jnp.uint8)
    return b.reshape(*w.shape[:-1], 4 * w.shape[-1])


def tiled_layout_unsupported(n: int, k: int, block_size: int) -> str | None:
    """Why a [N, K] weight cannot take the tiled layout (None if it can)."""
    if block_size != 16:
        return f"needs block_size 16, got {block_size}"
    if n % TILE_ROWS or k % WINDOW:
        return f"needs N % 16 == 0 and K % 128 == 0, got N={n}, K={k}"
    return None


def _check(shape, k_per_byte: int, what: str):
    *lead, n, cols = shape
    k = cols * k_per_byte
    if (reason := tiled_layout_unsupported(n, k, 16)) is not None:
        raise ValueError(f"tiled layout: {what} {reason} (shape {tuple(shape)})")
    return lead, n, k


def _row_tile_transform(k_per_byte: int, what: str):
    """A transform of the tiled layout's 16-row tiles: checked on the whole array, applied per
    shard under explicit mesh axes (`by_row_tiles`), same shape and type as its input."""

    def decorate(local):
        @functools.wraps(local)
        def transform(x):
            x = jnp.asarray(x)
            _check(x.shape, k_per_byte, what)
            return by_row_tiles(local, x, TILE_ROWS, keep_type=True)

        return transform

    return decorate


@_row_tile_transform(2, "packed")
def tile_packed(packed):
    """Spec packed codes uint8 [..., N, K/2] -> the tiled layout (same shape)."""
    packed = packed.astype(jnp.uint8)
    *lead, n, half_k = packed.shape
    k, nd = 2 * half_k, len(lead)
    x = packed.reshape(*lead, n // 16, 2, 8, k // WINDOW, 4, 16)  # [T, h, g, w, t, b]
    x = x.transpose(*range(nd), nd, nd + 3, nd + 1, nd + 2, nd + 4, nd + 5)  # [T, w, h, g, t, b]
    x = x.reshape(*lead, n, k // 2)
    return _words_to_bytes(_permute_words(_bytes_to_words(x), WORD_BITS))


@_row_tile_transform(2, "packed")
def untile_packed(packed):
    """The inverse of `tile_packed`."""
    packed = packed.astype(jnp.uint8)
    *lead, n, half_k = packed.shape
    k, nd = 2 * half_k, len(lead)
    x = _words_to_bytes(_permute_words(_bytes_to_words(packed), np.argsort(WORD_BITS)))
    x = x.reshape(*lead, n // 16, k // WINDOW, 2, 8, 4, 16)  # [T, w, h, g, t, b]
    x = x.transpose(*range(nd), nd, nd + 2, nd + 3, nd + 1, nd + 4, nd + 5)  # [T, h, g, w, t, b]
    return x.reshape(*lead, n, k // 2)


@_row_tile_transform(16, "scale")
def tile_scale(scale):
    """Spec block scales [..., N, K/16] (uint8 or float8_e4m3fn) -> the tiled layout (same shape
    and dtype)."""
    *lead, n, k_blocks = scale.shape
    k, nd = 16 * k_blocks, len(lead)
    x = scale.reshape(*lead, n // 16, 2, 8, k // WINDOW, 4, 2)  # [T, h, g, w, t, i]
    x = x.transpose(*range(nd), nd, nd + 3, nd + 2, nd + 4, nd + 1, nd + 5)  # [T, w, g, t, h, i]
    return x.reshape(*lead, n, k // 16)


@_row_tile_transform(16, "scale")
def untile_scale(scale):
    """The inverse of `tile_scale`."""
    *lead, n, k_blocks = scale.shape
    k, nd = 16 * k_blocks, len(lead)
    x = scale.reshape(*lead, n // 16, k // WINDOW, 8, 4, 2, 2)  # [T, w, g, t, h, i]
    x = x.transpose(*range(nd), nd, nd + 4, nd + 2, nd + 1, nd + 3, nd + 5)  # [T, h, g, w, t, i]
    return x.reshape(*lead, n, k // 16)
