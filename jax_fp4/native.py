"""The native Blackwell SM120 NVFP4 x NVFP4 path (spec sections 6 and 7).

On compute capability 12.x devices, when enabled (JAX_FP4_NATIVE_SM120=1 or backend="native"),
a matmul with M > 8, block_size 16, K % 32 == 0 and N % 32 == 0 runs as:

  1. `jax_fp4_quantize_activation_cuda`: A [M, K] (fp16/bf16) -> packed NVFP4 [M, K/2], E4M3 scales
     per 16 elements (swizzled), and the activation global scale g_a (f32 [1]);
  2. weight scales in CUTLASS's SM1xx block-scaled "128x4" layout: prepared once by
     `prepack(w, target="sm120")`, or swizzled per call into scratch by `jax_fp4_swizzle_scales_cuda`;
  3. `jax_fp4_native_sm120_cuda`: the CUTLASS block-scaled NVFP4 x NVFP4 GEMM for sm_120a,
     Y = (g_a * g_w) * (A_q @ B_q^T) + bias, fp32 accumulation, output in A's dtype.

This changes the arithmetic from weight-only FP4 to activation-and-weight FP4 (W4A4): the result
matches `quantize_activation_reference(a)` dequantized times the dequantized weight, not A times
the weight.

Activation global scale: by default per call, g_a = amax(|A| over finite elements) / (6 * 448)
(1 when that amax is 0), computed on the device by a two-pass reduction (per-CTA partial maxima
into a scratch output, then every quantizer CTA reduces the partials). A static scale can be passed
instead (`activation_scale`, multiplied convention like ModelOpt's `input_scale`); elements beyond
6 * 448 * g_a then saturate. In both cases g_a is floored at 2^-126. The per-block rule is
ModelOpt's: s = amax_block / (6 g_a), 1 for a zero block, clamped to [2^-9, 448], rounded to E4M3
(nearest even); codes E2M1(x / (e4m3(s) g_a)), nearest even, saturating at 6. A block holding NaN
or Inf gets the E4M3 NaN byte 0x7F as its scale (and zero codes).

Swizzled scale layout (CuTe `Sm1xxBlockScaledConfig<16>::tile_atom_to_shape_SF{A,B}`): rows are
padded to a multiple of 128 and k-blocks to a multiple of 4; the byte of (row r, k-block kb) is at
  ((r // 128) * ceil(KB / 4) + kb // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + kb % 4.
Padding bytes are 0. Arrays here store it as uint8 [ceil(R / 128), 512 * ceil(KB / 4)] (one row
per 128-row tile, so a weight sharded along N in multiples of 128 rows keeps its tiles whole).

The native path assumes non-negative E4M3 block scales (the tensor cores read them as UE4M3), which
every NVFP4 quantizer produces.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_fp4 import config as _config
from jax_fp4.explicit_axes import by_row_tiles
from jax_fp4.format import NVFP4Weight, scale_as_bytes

NATIVE_ENV = _config.NATIVE_SM120_ENV  # "JAX_FP4_NATIVE_SM120"
QUANTIZE_ACTIVATION_TARGET = "jax_fp4_quantize_activation_cuda"
SWIZZLE_SCALES_TARGET = "jax_fp4_swizzle_scales_cuda"
NATIVE_GEMM_TARGET = "jax_fp4_native_sm120_cuda"

NATIVE_BLOCK_SIZE = 16
NATIVE_MIN_M = 9  # M <= 8 stays with the decode GEMV (spec section 3)
ACTIVATION_PARTIALS = 1024  # == kActivationPartials (ffi/cuda/native_sm120/handlers.h)
NATIVE_WORKSPACE_BYTES = 4096  # == kNativeWorkspaceBytes (ffi/cuda/native_sm120/handlers.h)

# The SM1xx "128x4" scale atom: 128 rows x 4 k-blocks in 512 bytes.
SF_ATOM_ROWS = 128
SF_ATOM_KBLOCKS = 4
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_KBLOCKS

_E2M1_MAX = np.float32(6.0)
_E4M3_MAX = np.float32(448.0)
_E4M3_MIN = np.float32(2.0**-9)
_MIN_GLOBAL_SCALE = np.float32(2.0**-126)
_E4M3_NAN = 0x7F
_HALF_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"))


# ---- the swizzled scale layout ------------------------------------------------------------------


def swizzled_scale_shape(rows: int, k_blocks: int) -> tuple[int, int]:
    """Shape of the swizzled scales of a [rows, k_blocks] scale matrix: one row per 128-row tile."""
    return (math.ceil(rows / SF_ATOM_ROWS), SF_ATOM_BYTES * math.ceil(k_blocks / SF_ATOM_KBLOCKS))


def swizzle_offsets(rows: int, k_blocks: int) -> np.ndarray:
    """int64 [rows, k_blocks]: the byte offset of each scale inside the flattened swizzled buffer."""
    r = np.arange(rows, dtype=np.int64)[:, None]
    kb = np.arange(k_blocks, dtype=np.int64)[None, :]
    k_tiles = math.ceil(k_blocks / SF_ATOM_KBLOCKS)
    return (
        ((r // 128) * k_tiles + kb // 4) * SF_ATOM_BYTES
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + kb % 4
    )


def swizzle_scales_np(scale) -> np.ndarray:
    """NumPy reference: plain scale bytes [R, KB] -> swizzled uint8 [ceil(R/128), 512 ceil(KB/4)],
    padding 0 (a scatter through `swizzle_offsets`)."""
    scale = np.asarray(_bytes_np(scale))
    if scale.ndim != 2:
        raise ValueError(f"swizzle_scales_np: scale must be [R, KB], got shape {scale.shape}")
    rows, k_blocks = scale.shape
    shape = swizzled_scale_shape(rows, k_blocks)
    out = np.zeros(shape[0] * shape[1], np.uint8)
    out[swizzle_offsets(rows, k_blocks).ravel()] = scale.ravel()
    return out.reshape(shape)


def unswizzle_scales_np(swizzled, rows: int, k_blocks: int) -> np.ndarray:
    """Inverse of `swizzle_scales_np` (drops the padding)."""
    flat = np.asarray(swizzled, np.uint8).reshape(-1)
    return flat[swizzle_offsets(rows, k_blocks)]


def swizzle_scales(scale):
    """Plain scales [..., R, KB] (uint8 or float8_e4m3fn) -> swizzled uint8
    [..., ceil(R/128), 512 ceil(KB/4)], padding 0. Pure jnp (a pad, reshape and transpose), so it
    runs on any platform, under jit and on stacked weights."""
    scale = jnp.asarray(scale_as_bytes(scale))
    if scale.ndim < 2:
        raise ValueError(f"swizzle_scales: scale must be [..., R, KB], got shape {scale.shape}")
    # Atoms of 128 rows: per shard under explicit mesh axes (N split in whole atoms).
    return by_row_tiles(_swizzle_local, scale, 128, keep_type=False)


def _swizzle_local(scale):
    *lead, rows, k_blocks = scale.shape
    row_tiles, k_tiles = math.ceil(rows / 128), math.ceil(k_blocks / 4)
    pad = [(0, 0)] * len(lead) + [(0, row_tiles * 128 - rows), (0, k_tiles * 4 - k_blocks)]
    padded = jnp.pad(scale, pad)
    # row = tr*128 + r1*32 + r0, kb = tk*4 + k0  ->  byte order (tr, tk, r0, r1, k0)
    tiled = padded.reshape(*lead, row_tiles, 4, 32, k_tiles, 4)
    n = len(lead)
    order = list(range(n)) + [n + 0, n + 3, n + 2, n + 1, n + 4]
    return jnp.transpose(tiled, order).reshape(*lead, row_tiles, k_tiles * SF_ATOM_BYTES)


def _bytes_np(scale):
    scale = np.asarray(scale)
    if scale.dtype == np.uint8:
        return scale
    if scale.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return scale.view(np.uint8)
    raise TypeError(f"scale must be uint8 or float8_e4m3fn, got {scale.dtype}")


# ---- activation quantization: NumPy reference, bit-exact with the CUDA kernel --------------------


def f32_to_e4m3_rne_np(s) -> np.ndarray:
    """float32 values in [2^-9, 448] -> E4M3FN bytes, nearest, ties to even (the kernel's bit
    arithmetic, written again in NumPy)."""
    s = np.asarray(s, np.float32)
    u = s.view(np.uint32).astype(np.int64)
    exponent = (u >> 23) - 127
    subnormal = exponent < -6
    code_sub = np.rint(s * np.float32(512.0)).astype(np.int64)
    mantissa = u & 0x7FFFFF
    code_norm = (np.maximum(exponent + 7, 0) << 3) | (mantissa >> 20)
    rest = mantissa & 0xFFFFF
    code_norm = code_norm + ((rest > 0x80000) | ((rest == 0x80000) & ((code_norm & 1) == 1)))
    return np.where(subnormal, code_sub, code_norm).astype(np.uint8)


def e4m3_to_f32_np(code) -> np.ndarray:
    """E4M3FN bytes -> float32 (exact)."""
    return np.asarray(code, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def e2m1_round_np(q) -> np.ndarray:
    """float32 -> E2M1 codes: nearest, ties to even, saturating at 6; the sign bit on every value
    below zero (a negative value that rounds to zero gets 0x8, -0, as ModelOpt writes it)."""
    q = np.asarray(q, np.float32)
    m = np.abs(q)
    code = (
        (m > 0.25).astype(np.uint8)
        + (m >= 0.75)
        + (m > 1.25)
        + (m >= 1.75)
        + (m > 2.5)
        + (m >= 3.5)
        + (m > 5.0)
    ).astype(np.uint8)
    return code | np.where(q < 0, 8, 0).astype(np.uint8)


def activation_global_scale_np(a) -> np.float32:
    """The dynamic activation global scale: amax over finite |a| / (6*448), or 1 when it is 0."""
    a32 = np.asarray(a).astype(np.float32)
    mags = np.abs(a32[np.isfinite(a32)])
    amax = np.float32(mags.max()) if mags.size else np.float32(0)
    return np.float32(amax / np.float32(6.0 * 448.0)) if amax > 0 else np.float32(1.0)


def quantize_activation_reference(a, activation_scale=None, block_size: int = NATIVE_BLOCK_SIZE):
    """NumPy model of `jax_fp4_quantize_activation_cuda`, bit for bit.

    Args:
      a: [M, K] float16/bfloat16 (anything castable to float32 exactly), K % 16 == 0.
      activation_scale: None for the dynamic scale, else the static global scale (float32).

    Returns:
      (packed uint8 [M, K/2], scale bytes uint8 [M, K/16] in the plain layout, global scale float32).
    """
    if block_size != NATIVE_BLOCK_SIZE:
        raise ValueError(f"quantize_activation_reference: block_size must be 16, got {block_size}")
    a32 = np.asarray(a).astype(np.float32)
    if a32.ndim != 2 or a32.shape[1] % 16:
        raise ValueError(
            f"quantize_activation_reference: a must be [M, K] with K % 16 == 0, got {a32.shape}"
        )
    m, k = a32.shape
    gs_in = (
        activation_global_scale_np(a32)
        if activation_scale is None
        else np.float32(np.asarray(activation_scale, np.float32).reshape(()))
    )
    gs_valid = bool(gs_in > 0 and np.isfinite(gs_in))
    gs = np.float32(max(gs_in, _MIN_GLOBAL_SCALE)) if gs_valid else gs_in

    blocks = a32.reshape(m, k // 16, 16)
    with np.errstate(all="ignore"):
        finite = np.isfinite(blocks).all(axis=-1) & gs_valid
        safe = np.where(finite[..., None], blocks, np.float32(0))
        bamax = np.abs(safe).max(axis=-1, initial=np.float32(0))
        six_gs = np.float32(np.float32(6.0) * gs) if gs_valid else np.float32(1)
        s = (bamax / six_gs).astype(np.float32)
        s = np.where(s == 0, np.float32(1), s)
        s = np.clip(s, _E4M3_MIN, _E4M3_MAX).astype(np.float32)
        code = f32_to_e4m3_rne_np(s)
        step = (e4m3_to_f32_np(code) * (gs if gs_valid else np.float32(1))).astype(np.float32)
        q = (safe / step[..., None]).astype(np.float32)
    codes = np.where(finite[..., None], e2m1_round_np(q), np.uint8(0)).reshape(m, k)
    scale = np.where(finite, code, np.uint8(_E4M3_NAN)).astype(np.uint8)
    packed = (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
    return packed.astype(np.uint8), scale, np.float32(gs)


# ---- dispatch -----------------------------------------------------------------------------------


def _format_capability(capability) -> str:
    return (
        "unknown (not a CUDA device)" if capability is None else f"{capability[0]}.{capability[1]}"
    )


def native_unsupported_reason(
    capability, m: int, n: int, k: int, block_size: int, dtype=None
) -> str | None:
    """Why the native SM120 GEMM cannot serve a matmul (None if it can), ignoring the M > 8 rule.

    `capability` is (major, minor) of the device, or None for a non-CUDA platform."""
    del m  # any M works for the GEMM itself
    if capability is None or not 12 <= int(capability[0]) < 13:
        return (
            "it needs a Blackwell SM120 GPU (compute capability 12.x), and this device has "
            f"compute capability {_format_capability(capability)}"
        )
    if block_size != NATIVE_BLOCK_SIZE:
        return f"block_size must be 16, got {block_size}"
    if k % 32:
        return f"K must be a multiple of 32, got {k}"
    if n % 32:
        return f"N must be a multiple of 32, got {n}"
    if dtype is not None and np.dtype(dtype) not in _HALF_DTYPES:
        return f"a must be float16 or bfloat16, got {np.dtype(dtype)}"
    return None


def native_path_applies(
    capability, env_enabled: bool, backend, m: int, n: int, k: int, block_size: int, dtype=None
) -> bool:
    """Whether a matmul takes the native SM120 NVFP4 x NVFP4 path (pure: no device, no environment).

    - backend "native" forces it for any non-empty matmul, and raises ValueError with the reason
      when it cannot run (wrong device, block size, K, N or dtype);
    - backend None/"auto" takes it only when `env_enabled` (JAX_FP4_NATIVE_SM120=1), M > 8 (the
      decode GEMV keeps at least M <= 8; the dispatcher tries the GEMV first, up to its table's
      gemv_max_m), and the device and shapes qualify;
    - any other forced backend never takes it.
    Empty matmuls (M, N or K zero) never take it: the empty path serves them.
    """
    backend = "auto" if backend is None else backend
    if backend == "native":
        reason = native_unsupported_reason(capability, m, n, k, block_size, dtype)
        if reason is not None:
            raise ValueError(f"backend='native' cannot serve this matmul: {reason}")
        return m > 0 and n > 0 and k > 0
    if backend != "auto" or not env_enabled:
        return False
    if m < NATIVE_MIN_M or n == 0 or k == 0:
        return False
    return native_unsupported_reason(capability, m, n, k, block_size, dtype) is None


def _first_gpu():
    try:
        return next((d for d in jax.devices() if d.platform == "gpu"), None)
    except RuntimeError:
        return None


def device_capability(device=None):
    """(major, minor) compute capability of a CUDA device (default: the first one), or None."""
    if device is None:
        device = _first_gpu()
        if device is None:
            return None
    text = getattr(device, "compute_capability", None)
    if not text:
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def device_kind(device=None) -> str | None:
    """The device kind JAX reports for a CUDA device (default: the first one), e.g. "NVIDIA H200",
    or None: the key of the dispatch's crossover table (jax_fp4/dispatch.py)."""
    if device is None:
        device = _first_gpu()
        if device is None:
            return None
    return getattr(device, "device_kind", None) or None


# ---- prepack (spec section 7) -------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class PrepackedNVFP4Weight(NVFP4Weight):
    """An NVFP4Weight that also carries its block scales in the SM120 swizzled layout.

    The plain `scale` stays (the decode GEMV and dequantize paths read it); `swizzled_scale` is
    uint8 [..., ceil(N/128), 512 ceil(K/64)] for the native SM120 GEMM.
    """

    def __init__(self, packed, scale, global_scale, block_size: int = 16, *, swizzled_scale):
        super().__init__(packed, scale, global_scale, block_size)
        expected = (*self.packed.shape[:-2], *swizzled_scale_shape(self.n, self.scale.shape[-1]))
        if not hasattr(swizzled_scale, "shape") or tuple(swizzled_scale.shape) != expected:
            raise ValueError(
                f"PrepackedNVFP4Weight: swizzled_scale must have shape {expected}, got "
                f"{getattr(swizzled_scale, 'shape', type(swizzled_scale).__name__)}"
            )
        if np.dtype(swizzled_scale.dtype) != np.uint8:
            raise TypeError(
                f"PrepackedNVFP4Weight: swizzled_scale must be uint8, got {swizzled_scale.dtype}"
            )
        self.swizzled_scale = swizzled_scale

    def tree_flatten(self):
        return (self.packed, self.scale, self.global_scale, self.swizzled_scale), self.block_size

    @classmethod
    def tree_unflatten(cls, block_size, children):
        obj = object.__new__(cls)
        obj.packed, obj.scale, obj.global_scale, obj.swizzled_scale = children
        obj.block_size, obj.layout = block_size, "spec"
        return obj

    def _array_specs(self, entries):
        # The swizzled scales interleave N and K in 128 x 64 atoms: sharded along leading dims only.
        lead = entries[:-2]
        return super()._array_specs(entries) + [jax.sharding.PartitionSpec(*lead, None, None)]

    @property
    def nbytes(self) -> int:
        return super().nbytes + int(np.prod(self.swizzled_scale.shape))

    def __repr__(self):
        return f"PrepackedNVFP4Weight(shape={self.shape}, block_size={self.block_size}, target='sm120')"


def prepack(w: NVFP4Weight, target: str = "sm120") -> PrepackedNVFP4Weight:
    """Prepare a weight once for the native SM120 path: its block scales in CUTLASS's swizzled
    layout, stored beside the plain ones (spec section 7, PrePack). Runs anywhere (pure jnp)."""
    if target != "sm120":
        raise ValueError(f"prepack: target must be 'sm120', got {target!r}")
    if not isinstance(w, NVFP4Weight):
        raise TypeError(f"prepack: w must be an NVFP4Weight, got {type(w).__name__}")
    if w.block_size != NATIVE_BLOCK_SIZE:
        raise ValueError(f"prepack: the SM120 native path needs block_size 16, got {w.block_size}")
    if w.layout != "spec":
        raise ValueError(
            f"prepack: target 'sm120' needs a weight in the spec layout, got layout "
            f"{w.layout!r} (jax_fp4.unprepack gives it back)"
        )
    return PrepackedNVFP4Weight(
        w.packed, w.scale, w.global_scale, w.block_size, swizzled_scale=swizzle_scales(w.scale)
    )


# ---- the FFI calls ------------------------------------------------------------------------------


def quantize_activation(a, activation_scale=None, *, swizzled: bool = True):
    """CUDA: A [M, K] fp16/bf16 -> (packed uint8 [M, K/2], scales, global scale float32 [1]).

    Scales are swizzled uint8 [ceil(M/128), 512 ceil(K/64)] (padding 0) or plain [M, K/16]."""
    m, k = a.shape
    k_blocks = k // NATIVE_BLOCK_SIZE
    scale_shape = swizzled_scale_shape(m, k_blocks) if swizzled else (m, k_blocks)
    dynamic = activation_scale is None
    outs = (
        jax.ShapeDtypeStruct((m, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct(scale_shape, jnp.uint8),
        jax.ShapeDtypeStruct((1,), jnp.float32),
        jax.ShapeDtypeStruct((ACTIVATION_PARTIALS if dynamic else 0,), jnp.float32),
    )
    static = (
        jnp.zeros((0,), jnp.float32)
        if dynamic
        else jnp.asarray(activation_scale, jnp.float32).reshape(1)
    )
    packed, scale, gs, _ = jax.ffi.ffi_call(QUANTIZE_ACTIVATION_TARGET, outs)(
        a, static, block_size=np.int64(NATIVE_BLOCK_SIZE), swizzled=bool(swizzled)
    )
    return packed, scale, gs


def swizzle_scales_cuda(scale):
    """CUDA: plain scale bytes [R, KB] -> swizzled uint8 [ceil(R/128), 512 ceil(KB/4)]."""
    scale = scale_as_bytes(scale)
    out = jax.ShapeDtypeStruct(swizzled_scale_shape(*scale.shape), jnp.uint8)
    return jax.ffi.ffi_call(SWIZZLE_SCALES_TARGET, out)(scale)


def native_matmul(
    a,
    packed,
    scale,
    global_scale,
    bias,
    *,
    block_size,
    swizzled_scale=None,
    activation_scale=None,
    **_,
):
    """The native SM120 path (CUDA only): Y [..., N] = W4A4 product of a [..., K] and the weight.

    Same operands as the other path implementations; `swizzled_scale` is the prepacked weight
    scale (else it is swizzled per call into scratch); `activation_scale` a static activation
    global scale (else per call, dynamic)."""
    if block_size != NATIVE_BLOCK_SIZE:
        raise ValueError(f"native_matmul: block_size must be 16, got {block_size}")
    lead, k = a.shape[:-1], a.shape[-1]
    n = packed.shape[0]
    a2 = a.reshape(math.prod(lead), k)
    m = a2.shape[0]
    k_blocks = k // NATIVE_BLOCK_SIZE
    a_packed, a_scale, a_gs = quantize_activation(a2, activation_scale, swizzled=True)
    if swizzled_scale is None:
        b_scale = swizzle_scales_cuda(scale)
    else:
        b_scale = jnp.asarray(swizzled_scale).reshape(swizzled_scale_shape(n, k_blocks))
    bias_operand = jnp.zeros((0,), a.dtype) if bias is None else bias.astype(a.dtype)
    outs = (
        jax.ShapeDtypeStruct((m, n), a.dtype),
        jax.ShapeDtypeStruct((NATIVE_WORKSPACE_BYTES,), jnp.uint8),
    )
    y, _ = jax.ffi.ffi_call(NATIVE_GEMM_TARGET, outs)(
        a_packed,
        a_scale,
        a_gs,
        packed,
        b_scale,
        jnp.asarray(global_scale, jnp.float32).reshape(1),
        bias_operand,
        block_size=np.int64(NATIVE_BLOCK_SIZE),
    )
    return y.reshape(*lead, n)
