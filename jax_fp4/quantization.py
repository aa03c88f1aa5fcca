"""Quantization to NVFP4: ModelOpt's round-to-nearest block scales, or a calibrated search."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4.format import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    NVFP4Weight,
    e2m1_codes_to_float32,
    host_values,
    pack_codes,
)


def _e2m1_round(x):
    """Float32 values already clipped to [-6, 6] -> E2M1 codes, round to nearest, ties to even."""
    mag = jnp.abs(x)
    # Thresholds between neighbouring magnitudes; `<=` where the tie goes down to the even code.
    code = jnp.where(
        mag <= 0.25,
        0,
        jnp.where(
            mag < 0.75,
            1,
            jnp.where(
                mag <= 1.25,
                2,
                jnp.where(
                    mag < 1.75,
                    3,
                    jnp.where(mag <= 2.5, 4, jnp.where(mag < 3.5, 5, jnp.where(mag <= 5.0, 6, 7))),
                ),
            ),
        ),
    )
    # A negative value that rounds to zero keeps its sign (code 0x8, -0), as ModelOpt and
    # compressed-tensors write it; an exact -0.0 is not below zero and gets code 0x0, as theirs.
    sign = jnp.where(x < 0, 8, 0)
    return (code | sign).astype(jnp.uint8)


def _divide(x, y):
    """x / y correctly rounded (IEEE), as ModelOpt's torch division is.

    XLA rewrites a division by a broadcast or a constant into a multiplication by the reciprocal,
    which is off by one ulp for about a fifth of float32 operands and moves values across E2M1
    rounding ties; a divisor it cannot see through keeps the true division.
    """
    y = jnp.broadcast_to(jnp.asarray(y, x.dtype), jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y)))
    return x / jax.lax.optimization_barrier(y)


QUANTIZE_METHODS = ("modelopt", "mse")
MSE_SCALE_STEPS = 2  # E4M3 codes tried on each side of ModelOpt's block scale by method="mse"


def quantize(w, block_size: int = 16, *, method: str = "modelopt", importance=None) -> NVFP4Weight:
    """Quantize a float matrix [..., N, K] to NVFP4.

    method="modelopt" (default) is NVIDIA ModelOpt's algorithm, bit for bit: global scale
    g = amax|W| / (6 * 448) (1.0 for an all-zero matrix); per block s = amax_block / (6 g), 1.0 for
    a zero block, clamped to [2^-9, 448] and rounded to E4M3 (nearest, ties to even);
    codes = E2M1(W / (e4m3(s) g)), nearest, ties to even, saturating at 6.

    method="mse" keeps g and searches each block's E4M3 scale among ModelOpt's and the
    MSE_SCALE_STEPS codes on either side of it, keeping the one whose round-to-nearest codes give
    the least squared error sum_k importance[k] * (w_k - dequant(w)_k)^2 (ModelOpt's on ties). A
    smaller scale clips the block's largest values to trade them for finer steps elsewhere.
    `importance` ([K], or [..., K] for stacked weights; non-negative) weights the input channels,
    e.g. the mean square of the layer's inputs on calibration data (jax_fp4.nnx.calibrate);
    None weights them equally. The result is an ordinary NVFP4 weight.

    w must be finite: NaN or inf raises ValueError. Under `jit` (w traced) that cannot be
    checked, and a matrix holding them quantizes to an undefined weight.
    """
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, (int, np.integer))
        or block_size <= 0
    ):
        raise ValueError(f"quantize: block_size must be a positive int, got {block_size!r}")
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"quantize: method must be one of {QUANTIZE_METHODS}, got {method!r}")
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"quantize: w must be a float matrix [N, K], got dtype {w.dtype}")
    if w.ndim < 2:
        raise ValueError(f"quantize: w must be [N, K] (rank >= 2), got shape {w.shape}")
    k = w.shape[-1]
    if k % 2:
        raise ValueError(
            f"quantize: K (the last axis) must be even to pack two codes per byte, got {k}"
        )
    if importance is not None:
        if method != "mse":
            raise ValueError(
                "quantize: importance weights only method='mse'; got method='modelopt'"
            )
        importance = _check_importance(importance, w.shape)
    weight, finite = _quantize_compiled(w, importance, block_size=int(block_size), method=method)
    try:
        finite = bool(finite)
    except jax.errors.ConcretizationTypeError:
        finite = True  # traced: the values are unknown
    if not finite:
        _raise_nonfinite(w)
    return weight


def _raise_nonfinite(w):
    """NaN or inf in quantize's input: no NVFP4 code holds them, and one of them would set the
    global scale of the whole matrix (inf: every value NaN; NaN: the default scale 1.0, which
    coarsens every other block), so say where instead of returning a silently wrong weight."""
    bad = np.argwhere(~np.isfinite(np.asarray(w, np.float32)))
    count, where = len(bad), tuple(int(i) for i in bad[0])
    raise ValueError(
        f"quantize: w must be finite, got {count} NaN or infinite value"
        f"{'s' if count > 1 else ''} (the first at index {where} of shape {tuple(w.shape)})"
    )


@functools.partial(jax.jit, static_argnames=("block_size", "method"))
def _quantize_compiled(w, importance, *, block_size: int, method: str):
    """`quantize` of a checked float array (importance: None or checked float32), compiled once
    per shape like `dequantize` (above). Returns the weight and whether all of w is finite."""
    k = w.shape[-1]
    w = w.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(w))
    k_blocks = math.ceil(k / block_size)
    pad = [(0, 0)] * (w.ndim - 1) + [(0, k_blocks * block_size - k)]

    amax = jnp.max(jnp.abs(w), axis=(-2, -1), initial=0.0)  # 0 for an empty matrix (N or K = 0)
    gscale = jnp.where(amax > 0, _divide(amax, jnp.float32(E2M1_MAX * E4M3_MAX)), 1.0).astype(
        jnp.float32
    )

    blocks = jnp.pad(w, pad).reshape(*w.shape[:-1], k_blocks, block_size)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    s = _divide(block_amax, E2M1_MAX * gscale[..., None, None])
    s = jnp.where(s == 0, 1.0, s)
    s = jnp.clip(s, E4M3_MIN_SUBNORMAL, E4M3_MAX)
    scale = s.astype(jnp.float8_e4m3fn)
    gs_blocks = gscale[..., None, None, None]
    step = _step(scale, gs_blocks)
    codes = _round_blocks(blocks, step)

    if method == "mse":
        weights = (
            jnp.ones((k_blocks * block_size,), jnp.float32)
            if importance is None
            else jnp.pad(importance, [(0, 0)] * (importance.ndim - 1) + pad[-1:])
        )
        weights = weights.reshape(*weights.shape[:-1], 1, k_blocks, block_size)  # [..., 1, kb, bs]
        scale, codes = _search_scales(blocks, scale, step, codes, gs_blocks, weights)
    codes = codes.reshape(*w.shape[:-1], k_blocks * block_size)[..., :k]
    return NVFP4Weight(pack_codes(codes), scale, gscale, block_size=block_size), finite


def _step(scale, gs_blocks):
    """The quantization step of each element's block: e4m3 scale [..., kb] x global scale."""
    return scale.astype(jnp.float32)[..., None] * gs_blocks


def _round_blocks(blocks, step):
    """E2M1 codes of blocks [..., kb, bs] at their steps (round to nearest)."""
    return _e2m1_round(jnp.clip(_divide(blocks, step), -E2M1_MAX, E2M1_MAX))


def _search_scales(blocks, scale, step, codes, gs_blocks, weights):
    """method="mse": the least-error scale per block among ModelOpt's and its neighbours."""

    def error(step, codes):
        return jnp.sum(weights * jnp.square(e2m1_codes_to_float32(codes) * step - blocks), axis=-1)

    base = jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)  # positive: ordered
    best_err = error(step, codes)
    for delta in [d for n in range(1, MSE_SCALE_STEPS + 1) for d in (-n, n)]:
        cand = jax.lax.bitcast_convert_type(
            jnp.clip(base + delta, 1, 0x7E).astype(jnp.uint8), jnp.float8_e4m3fn
        )
        cand_step = _step(cand, gs_blocks)
        cand_codes = _round_blocks(blocks, cand_step)
        cand_err = error(cand_step, cand_codes)
        better = cand_err < best_err  # strict: ModelOpt's scale wins ties (and NaN errors)
        best_err = jnp.where(better, cand_err, best_err)
        scale = jnp.where(better, cand, scale)
        codes = jnp.where(better[..., None], cand_codes, codes)
    return scale, codes


def _check_importance(importance, w_shape):
    """importance: [K] or w's leading axes + [K], float, non-negative where its values are known."""
    k = w_shape[-1]
    allowed = [(k,), tuple(w_shape[:-2]) + (k,)]
    shape = tuple(np.shape(importance))
    if shape not in allowed:
        raise ValueError(
            f"quantize: importance must have shape {allowed[0]}"
            + (f" or {allowed[1]}" if allowed[1] != allowed[0] else "")
            + f" (one weight per input channel), got {shape}"
        )
    values = host_values(importance, np.float64)  # None when traced: unchecked here
    if values is not None and not (np.isfinite(values).all() and (values >= 0).all()):
        raise ValueError("quantize: importance must be finite and non-negative")
    return jnp.asarray(importance, jnp.float32)
