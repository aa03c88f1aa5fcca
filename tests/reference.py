"""An independent float64 NumPy model of NVFP4 and of the matmul, written from the format's
definition (not from jax_fp4's code), plus random-input helpers shared by the tests."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


def e2m1_decode(codes) -> np.ndarray:
    """4-bit codes -> float64: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    codes = np.asarray(codes, np.int64)
    sign = np.where(codes & 8, -1.0, 1.0)
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    magnitude = np.where(
        exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * np.exp2(exponent - 1.0)
    )
    return sign * magnitude


def e4m3_decode(bytes_) -> np.ndarray:
    """E4M3FN bytes -> float64: bias 7, subnormal m * 2^-9, NaN at S.1111.111, no Inf."""
    b = np.asarray(bytes_, np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exponent = (b >> 3) & 0xF
    mantissa = b & 7
    magnitude = np.where(
        exponent == 0, mantissa * 2.0**-9, (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    )
    magnitude = np.where((exponent == 15) & (mantissa == 7), np.nan, magnitude)
    return sign * magnitude


def unpack(packed) -> np.ndarray:
    """uint8 [..., K/2] -> codes [..., K]: element 2j in the low nibble, 2j+1 in the high one."""
    packed = np.asarray(packed, np.uint8)
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def dequantize(packed, scale_bytes, global_scale, block_size) -> np.ndarray:
    """float64 W[n, k] = e2m1(code) * e4m3(scale[n, k // block_size]) * global_scale."""
    codes = unpack(packed)
    k = codes.shape[-1]
    block_of_k = np.arange(k) // block_size
    scale = e4m3_decode(np.asarray(scale_bytes))[..., block_of_k]
    return e2m1_decode(codes) * scale * np.float64(global_scale)


_INF_BITS = {"bfloat16": (0x7F80, 2.0**128), "float16": (0x7C00, 2.0**16)}


def round_once(x, dtype) -> np.ndarray:
    """float64 values -> `dtype` (float32, float16 or bfloat16), rounded once to nearest, ties to
    even: for the 16-bit types the nearest of the three neighbours around a first guess, by exact
    float64 distances (infinity counted as the next power of two past the largest finite value,
    so that values from the largest finite one plus half an ulp up round to it)."""
    x = np.asarray(x, np.float64)
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        with np.errstate(over="ignore"):
            return x.astype(np.float32)  # one IEEE rounding
    inf_bits, inf_value = _INF_BITS[dtype.name]
    with np.errstate(over="ignore", invalid="ignore"):
        guess = x.astype(np.float32).astype(dtype)  # may be one ulp off (two roundings)
    magnitude = guess.view(np.uint16).astype(np.int64) & 0x7FFF
    candidates = np.clip(np.stack([magnitude - 1, magnitude, magnitude + 1], axis=-1), 0, inf_bits)
    values = candidates.astype(np.uint16).view(dtype).astype(np.float64)
    values = np.where(candidates == inf_bits, inf_value, values)
    dist = np.abs(values - np.abs(x)[..., None])
    nearest = dist == dist.min(axis=-1, keepdims=True)
    pick = np.where(nearest & (candidates % 2 == 0), candidates, 1 << 20).min(
        axis=-1
    )  # a tie: even
    pick = np.where(
        nearest.sum(axis=-1) == 1,
        np.take_along_axis(candidates, nearest.argmax(axis=-1)[..., None], axis=-1)[..., 0],
        pick,
    )
    bits = (pick | np.where(np.signbit(x), 0x8000, 0)).astype(np.uint16)
    out = bits.view(dtype)
    return np.where(np.isnan(x), guess, out).astype(dtype)


def dequantize_as(packed, scale_bytes, global_scale, block_size, dtype) -> np.ndarray:
    """`dequantize` correctly rounded to `dtype` (one rounding of the exact float64 product)."""
    with np.errstate(invalid="ignore"):
        return round_once(dequantize(packed, scale_bytes, global_scale, block_size), dtype)


def matmul(
    a, packed, scale_bytes, global_scale, block_size, bias=None, *, weight_dtype=None
) -> np.ndarray:
    """float64 Y = A @ W^T (+ bias).

    `weight_dtype` (fp16/bf16): W as the dequantizing paths (xla, dequant) hold it, the exact
    product rounded once to that dtype (`round_once`). Their weight rounding then is part of the model, not of the
    error: with few terms that cancel it alone can exceed the output's rounding tolerance."""
    w = dequantize(packed, scale_bytes, global_scale, block_size)
    if weight_dtype is not None:
        w = round_once(w, weight_dtype).astype(np.float64)
    y = np.asarray(a, np.float64) @ w.T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    return y


def modelopt_quantize(w, block_size=16):
    """NVIDIA ModelOpt's NVFP4 weight quantizer in NumPy float32 (IEEE, correctly rounded like
    torch): [N, K] float32 -> (codes uint8 [N, K], E4M3 scale bytes [N, ceil(K / block_size)],
    global scale float32). Ties of E2M1 and E4M3 rounding go to the even code."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    amax = np.abs(w).max() if w.size else np.float32(0)
    gs = np.float32(amax / np.float32(6.0 * 448.0)) if amax > 0 else np.float32(1.0)
    kb = math.ceil(k / block_size)
    blocks = np.zeros((n, kb * block_size), np.float32)
    blocks[:, :k] = w
    blocks = blocks.reshape(n, kb, block_size)
    s = (np.abs(blocks).max(axis=-1) / np.float32(np.float32(6.0) * gs)).astype(np.float32)
    s = np.clip(np.where(s == 0, np.float32(1.0), s), np.float32(2.0**-9), np.float32(448.0))
    scale_bytes = s.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)  # nearest even; s <= 448 fits
    code = round_to_e2m1(blocks, scale_bytes, gs)
    return code.reshape(n, kb * block_size)[:, :k], scale_bytes, gs


def round_to_e2m1(blocks, scale_bytes, gs):
    """E2M1 codes of float32 blocks [..., kb, bs] at step e4m3(scale) * gs (float32, as ModelOpt):
    x / step correctly rounded, clipped to [-6, 6], nearest magnitude, ties to the even code."""
    step = (e4m3_decode(scale_bytes).astype(np.float32) * np.float32(gs)).astype(np.float32)
    q = np.clip(blocks / step[..., None], np.float32(-6.0), np.float32(6.0)).astype(np.float32)
    grid = e2m1_decode(np.arange(8))  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
    mag = np.abs(q).astype(np.float64)[..., None]
    dist = np.abs(mag - grid)
    tied = dist == dist.min(axis=-1, keepdims=True)
    # nearest magnitude; among two tied neighbours the one with an even code (mantissa bit 0)
    code = np.where(tied & (np.arange(8) % 2 == 0), np.arange(8), 99).min(axis=-1)
    code = np.where(tied.sum(axis=-1) == 1, tied.argmax(axis=-1), code).astype(np.uint8)
    # The sign bit wherever the quotient is below zero, also where it rounds to zero (code 0x8,
    # -0): ModelOpt's `_cast_fp4` and compressed-tensors both set it from `x < 0`.
    return np.where(q < 0, code | 8, code).astype(np.uint8)


def random_weight(rng, n, k, block_size=16, scale_low=0x28, scale_high=0x48, *, unit_gain=False):
    """Random packed codes (all 16 codes), E4M3 scale bytes in [scale_low, scale_high)
    (about 2^-2 .. 2^2) and a random positive global scale (unit_gain: unit_gain_global_scale's)."""
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = rng.integers(scale_low, scale_high, size=(n, math.ceil(k / block_size)), dtype=np.uint8)
    global_scale = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-8, 1))
    if unit_gain:
        global_scale = unit_gain_global_scale(packed, scale, block_size)
    return packed, scale, global_scale


def unit_gain_global_scale(packed, scale, block_size=16):
    """The global scale that gives the dequantized rows unit root-mean-square norm, for stacks of
    layers (tanh(h @ W^T) chains): with random_weight's global scale the pre-activations reach
    ~100, and the few that land in tanh's linear region carry rounding errors through each layer
    multiplied by the row norm, so a float32 chain's error would be set by the draw, not the kernel."""
    unit = dequantize(packed, scale, np.float32(1.0), block_size)
    return np.float32(1.0 / np.sqrt(np.mean(np.sum(unit**2, axis=-1))))


def relative_error(y, ref) -> float:
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / (denom if denom else 1.0))


# Norm-wise tolerance: output rounding (2^-8 bf16, 2^-11 fp16) plus fp32 accumulation, with margin.
TOLERANCE = {"bfloat16": 8e-3, "float16": 1.5e-3, "float32": 1e-5}
