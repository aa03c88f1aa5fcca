"""Static facts of the fused sm_90 NVFP4 GEMM (FFI target "jax_fp4_fused_cuda"): pure functions,
kept in sync with ffi/cuda/fused/fused.h, usable (and tested) on any machine.

The target takes (a [M, K] f16/bf16 in fragment K order (`to_fragment_order`), packed u8 [N, K/2],
scale [N, K/16] (E4M3: float8_e4m3fn or u8 bytes), global_scale f32 [1], bias [N] or [0]) and
returns (y [M, N] in a's dtype, workspace f32 [fused_workspace_elems(m, n, k)]), attribute
block_size (int64, 16). It runs on compute capability 9.0 devices only (sm_90a code);
the dispatcher must not choose it elsewhere.
"""

from __future__ import annotations

import numpy as np

TARGET = "jax_fp4_fused_cuda"

BLOCK_SIZE = 16  # NVFP4 block size, the only one served
K_MULTIPLE = 128  # K per pipeline stage
MAX_M_TILES = 65535  # grid.y limit
TILE_M_LARGE = 128  # the smallest activation tile above M = 64 (bounds the M tiles)
_INT_LIMIT = 2**31 - 1

_HALF_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"))


FRAGMENT_BLOCK = 64  # the fragment K order permutes K inside blocks of this many elements


def to_fragment_order(a, tiled: bool = False):
    """The activation [..., K] with K permuted inside each 64-element block as the fused kernel
    reads it: result[..., 64 b + k_log] = a[..., 64 b + p(k_log)], where
    k_log = 32 sb + 16 j1 + 8 j0 + 2 t + o  <->  p = 16 t + 8 sb + 4 o + 2 j1 + j0
    (ffi/cuda/fused/kernels.cuh, "Fragment K order": it lets every lane decode whole packed words);
    for weights in the tiled layout (tiled=True) p = 16 t + 8 sb + 4 j0 + 2 j1 + o.
    A reshape and a transpose (NumPy or jax arrays); K must be a multiple of 64."""
    *lead, k = a.shape
    if k % FRAGMENT_BLOCK:
        raise ValueError(f"to_fragment_order: K must be a multiple of {FRAGMENT_BLOCK}, got {k}")
    # Physical index bits, high to low: t (2 bits), sb, then o, j1, j0 (tiled: j0, j1, o).
    x = a.reshape(*lead, k // FRAGMENT_BLOCK, 2, 2, 2, 2, 2, 2)
    d = len(lead) + 1
    if tiled:
        t1, t0, sb, j0, j1, o = range(d, d + 6)
    else:
        t1, t0, sb, o, j1, j0 = range(d, d + 6)
    x = x.transpose(*range(d), sb, j1, j0, t1, t0, o)
    return x.reshape(*lead, k)


MAX_STREAM_K_CTAS = 132  # the most SMs of an sm_90 part
STREAM_K_TILE_ELEMS = 128 * 256  # the largest CTA tile (activation rows x weight rows)


def fused_workspace_elems(m: int, n: int, k: int) -> int:
    """f32 elements of the target's workspace result (mirror of fused::WorkspaceElems).

    For M > 64 (the 128- and 256-row tiles, where the warp-specialized kernel may run stream-K),
    the stream-K decomposition's fp32 partial tile per CTA (at most one CTA per SM) and one int32
    arrival counter per tile: a bound over the 128 x 256 and 256 x 128 tiles, at most ~17 MB. 0 up
    to M = 64 (split-K there is reduced on chip inside a thread-block cluster).
    """
    if m <= 64:
        return 0
    m128, n128 = -(-m // 128), -(-n // 128)
    tiles = max(m128 * -(-n // 256), -(-m // 256) * n128)
    ctas = min(MAX_STREAM_K_CTAS, tiles * (k // K_MULTIPLE))
    return ctas * STREAM_K_TILE_ELEMS + m128 * n128


def fused_supported(m: int, n: int, k: int, block_size: int, dtype) -> str | None:
    """None if the fused kernel can serve this problem (on an sm_90 device), else the reason."""
    dtype = np.dtype(dtype)
    if dtype not in _HALF_DTYPES:
        return f"a must be float16 or bfloat16, got {dtype}"
    if block_size != BLOCK_SIZE:
        return f"block_size must be {BLOCK_SIZE}, got {block_size}"
    if k <= 0 or k % K_MULTIPLE:
        return f"K must be a positive multiple of {K_MULTIPLE}, got {k}"
    if m <= 0 or n <= 0:
        return f"M and N must be positive, got M={m}, N={n}"
    if max(m, n, k) >= _INT_LIMIT:
        return "M, N and K must be below 2^31"
    if -(-m // TILE_M_LARGE) > MAX_M_TILES:
        return f"M must be at most {MAX_M_TILES * TILE_M_LARGE}, got {m}"
    return None
