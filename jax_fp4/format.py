"""The NVFP4 weight format: the `NVFP4Weight` container and dequantization (quantization is in
jax_fp4/quantization.py).

Layout (ONNX Runtime MatMulBlockQuantizedFp4Weight, NVIDIA ModelOpt):
  packed        uint8 [N, K/2]; logical element 2j in the low nibble, 2j+1 in the high nibble.
  scale         E4M3FN [N, ceil(K/block_size)], given as float8_e4m3fn or raw uint8 bytes.
  global_scale  float32 scalar, multiplied: W[n, k] = e2m1(code) * e4m3(scale[n, k // bs]) * gs.

Stacked weights (layers, experts) add leading axes to all three arrays; every function here keeps
them, so an NVFP4Weight works as a leaf container under vmap, scan and shardings.

A weight may instead hold its packed codes and scales in the decode GEMV's tile-major layout
(layout="tiled", made once by `jax_fp4.prepack`; jax_fp4/layout.py defines it): same array shapes,
other byte order. Functions that read the bytes themselves (dequantize) accept both.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_fp4 import layout as _layout

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9

# Decoded value of each 4-bit E2M1 code; bit 3 is the sign (0x8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

_SCALE_DTYPES = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn))

# "spec": the layout above (checkpoints, every path). "tiled": the decode GEMV's (jax_fp4/layout.py).
LAYOUTS = ("spec", "tiled")


class NVFP4Weight:
    """An NVFP4-quantized weight matrix of logical shape [..., N, K].

    Args:
      packed: uint8 [..., N, K/2], two E2M1 codes per byte (even element in the low nibble).
      scale: [..., N, ceil(K/block_size)] E4M3 block scales, float8_e4m3fn or raw uint8 bytes.
      global_scale: float32 scalar (per stacked weight: shape [...]), ModelOpt's weight_scale_2.
      block_size: elements per scale block (16 for NVFP4); static pytree metadata.
      layout: "spec" (the format above) or "tiled" (the bytes of packed and scale reordered for the
        decode GEMV by `jax_fp4.prepack`; needs block_size 16, N % 16 == 0, K % 128 == 0); static
        pytree metadata.
    """

    def __init__(
        self,
        packed,
        scale,
        global_scale,
        block_size: int = 16,
        *,
        layout: str = "spec",
        _pytree_layout: str | None = None,
    ):
        if _pytree_layout is not None:
            # Pytree unflattening (the registration below): the parts as they come, unchecked,
            # because transforms rebuild the container with tracers or placeholders.
            self.packed, self.scale, self.global_scale = packed, scale, global_scale
            self.block_size, self.layout = block_size, _pytree_layout
            return
        if layout not in LAYOUTS:
            raise ValueError(f"NVFP4Weight: layout must be one of {LAYOUTS}, got {layout!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
            raise TypeError(f"NVFP4Weight: block_size must be an int, got {block_size!r}")
        if block_size <= 0:
            raise ValueError(f"NVFP4Weight: block_size must be positive, got {block_size}")
        if isinstance(global_scale, (float, int, np.floating)):
            global_scale = np.float32(global_scale)
        for name, value in (("packed", packed), ("scale", scale), ("global_scale", global_scale)):
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise TypeError(f"NVFP4Weight: {name} must be an array, got {type(value).__name__}")
        if np.dtype(packed.dtype) != np.uint8:
            raise TypeError(f"NVFP4Weight: packed must be uint8 [N, K/2], got dtype {packed.dtype}")
        if packed.ndim < 2:
            raise ValueError(
                f"NVFP4Weight: packed must be [N, K/2] (rank >= 2), got shape {packed.shape}"
            )
        if np.dtype(scale.dtype) not in _SCALE_DTYPES:
            raise TypeError(
                f"NVFP4Weight: scale must be float8_e4m3fn or uint8 (raw E4M3 bytes), got dtype {scale.dtype}"
            )
        if not jnp.issubdtype(global_scale.dtype, jnp.floating):
            raise TypeError(
                f"NVFP4Weight: global_scale must be float32, got dtype {global_scale.dtype}"
            )
        *lead, n, half_k = packed.shape
        expected_scale = (*lead, n, math.ceil(2 * half_k / block_size))
        if tuple(scale.shape) != expected_scale:
            raise ValueError(
                f"NVFP4Weight: scale must have shape {expected_scale} = [N, ceil(K/block_size)] for "
                f"packed {tuple(packed.shape)} and block_size {block_size}, got {tuple(scale.shape)}"
            )
        if tuple(global_scale.shape) != tuple(lead):
            raise ValueError(
                f"NVFP4Weight: global_scale must be a scalar (shape {tuple(lead)}), got shape "
                f"{tuple(global_scale.shape)}"
            )
        if layout == "tiled":
            if (reason := _layout.tiled_layout_unsupported(n, 2 * half_k, block_size)) is not None:
                raise ValueError(f"NVFP4Weight: layout='tiled' {reason}")
        if global_scale.dtype != np.float32:
            global_scale = global_scale.astype(np.float32)
        self.packed = packed
        self.scale = scale
        self.global_scale = global_scale
        self.block_size = int(block_size)
        self.layout = layout

    # The pytree registration's name of the layout (see below the class). An alias, not a second
    # copy: `layout` stays the one attribute.
    _pytree_layout = property(operator.attrgetter("layout"))

    # The pytree protocol by hand: children are the arrays; (block_size, layout) is static.
    # Unflattening bypasses __init__ because transforms rebuild the container with tracers or
    # placeholders.
    def tree_flatten(self):
        return (self.packed, self.scale, self.global_scale), (self.block_size, self.layout)

    @classmethod
    def tree_unflatten(cls, static, children):
        """`static` is (block_size, layout), or a bare block_size for the spec layout (trees of
        in_axes or specs built by hand: tree_unflatten(16, (1, 1, 0)); for shardings, see
        `shardings`)."""
        obj = object.__new__(cls)
        obj.packed, obj.scale, obj.global_scale = children
        obj.block_size, obj.layout = static if isinstance(static, tuple) else (static, "spec")
        return obj

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., N, K]."""
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    @property
    def n(self) -> int:
        return self.packed.shape[-2]

    @property
    def k(self) -> int:
        return 2 * self.packed.shape[-1]

    @property
    def ndim(self) -> int:
        return self.packed.ndim

    @property
    def scale_bytes(self):
        """The block scales as raw uint8 E4M3 bytes (what the kernels read)."""
        return scale_as_bytes(self.scale)

    @property
    def nbytes(self) -> int:
        return sum(
            int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
            for x in (self.packed, self.scale, self.global_scale)
        )

    def shardings(self, sharding):
        """This weight's arrays sharded like its logical [..., N, K] array by `sharding`.

        `sharding`: a PartitionSpec or a NamedSharding over [..., N, K]. packed and scale take it
        (K's mesh axes split the packed bytes and the scale blocks alike), the global scale its
        leading entries. Returns an NVFP4Weight of the same kind of leaves, for jax.device_put,
        jit's in_shardings and shard_map's in_specs:

            w = jax.device_put(w, w.shardings(NamedSharding(mesh, P("model", None))))  # along N
        """
        mesh = None
        if isinstance(sharding, jax.sharding.NamedSharding):
            mesh, spec = sharding.mesh, sharding.spec
        elif isinstance(sharding, jax.sharding.PartitionSpec):
            spec = sharding
        else:
            raise TypeError(
                f"shardings: sharding must be a PartitionSpec or NamedSharding over the "
                f"weight's [..., N, K], got {type(sharding).__name__}"
            )
        if len(spec) > self.ndim:
            raise ValueError(
                f"shardings: {spec} has {len(spec)} entries for a weight of rank "
                f"{self.ndim} (shape {self.shape})"
            )
        entries = tuple(spec) + (None,) * (self.ndim - len(spec))
        specs = self._array_specs(entries)
        if mesh is not None:
            specs = [jax.sharding.NamedSharding(mesh, s) for s in specs]
        return type(self).tree_unflatten(self.tree_flatten()[1], specs)

    def _array_specs(self, entries):
        """PartitionSpecs of the arrays tree_flatten lists, from the logical [..., N, K] entries."""
        spec = jax.sharding.PartitionSpec
        return [spec(*entries), spec(*entries), spec(*entries[:-2])]

    def __repr__(self):
        layout = "" if self.layout == "spec" else f", layout={self.layout!r}"
        return f"NVFP4Weight(shape={self.shape}, block_size={self.block_size}{layout})"


# A pytree whose flattening runs in jaxlib's C++ (attribute reads), not a Python tree_flatten: a
# jitted call flattens every weight it is passed on every call, and a decode step passes hundreds
# (224 in a Llama-3-8B, 672 arrays): 2 CPU cores, 224 weights, tree_flatten 96 -> 63 us, a jitted
# call 282 -> 250 us (of which 200 us are the 672 arrays themselves). Leaves (packed, scale,
# global_scale), static data (block_size, layout): the same leaves and static data as
# `tree_flatten`, so jax.export's serialization of the static data holds; key paths name the
# arrays (`.packed`). Unflattening calls the class with the fields as keywords, the layout as
# `_pytree_layout`, which __init__ takes as "rebuild unchecked".
jax.tree_util.register_dataclass(
    NVFP4Weight,
    data_fields=["packed", "scale", "global_scale"],
    meta_fields=["block_size", "_pytree_layout"],
)


def not_a_weight_error(where: str, w, name: str = "w") -> TypeError:
    """The TypeError for a `w` that is not an NVFP4Weight; a plain (float) array gets the call
    that makes one."""
    message = f"{where}: {name} must be an NVFP4Weight, got {type(w).__name__}"
    if hasattr(w, "shape") and hasattr(w, "dtype"):
        message += (
            f" of shape {tuple(w.shape)}; quantize a float [N, K] weight first: "
            "jax_fp4.quantize(w) (or jax_fp4.NVFP4Weight(packed, scale, global_scale) from a "
            "checkpoint's tensors)"
        )
    return TypeError(message)


def spec_arrays(w: NVFP4Weight):
    """(packed, scale) of `w` in the spec layout (undoing the tiled layout if `w` has it)."""
    if w.layout == "tiled":
        return _layout.untile_packed(w.packed), _layout.untile_scale(w.scale)
    return w.packed, w.scale


def kernel_scale(scale):
    """E4M3 block scales as the primitives take them: as they are, float8_e4m3fn or uint8 bytes
    (NVFP4Weight accepts no other type). The kernels read either; a bitcast to bytes here would
    be a kernel in the caller's program copying every scale on every call."""
    return jnp.asarray(scale)


def scale_as_bytes(scale):
    """E4M3 scales as uint8 bytes, whether given as float8_e4m3fn or already as bytes."""
    if np.dtype(scale.dtype) == np.uint8:
        return scale
    return jax.lax.bitcast_convert_type(jnp.asarray(scale), jnp.uint8)


def host_values(x, dtype=None):
    """x as a NumPy array, or None where x is traced (its values unknown until run)."""
    try:
        return np.asarray(x, dtype)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def unpack_codes(packed):
    """uint8 [..., K/2] -> uint8 E2M1 codes [..., K] (low nibble first)."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8 or packed.ndim < 1:
        raise TypeError(
            f"unpack_codes: packed must be uint8 [..., K/2], got {packed.dtype} of shape "
            f"{packed.shape}"
        )
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_codes(codes):
    """Integer E2M1 codes 0-15 [..., K] (K even) -> packed uint8 [..., K/2]."""
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer) or codes.ndim < 1:
        raise TypeError(
            f"pack_codes: codes must be integers 0-15 [..., K], got {codes.dtype} of "
            f"shape {codes.shape}"
        )
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_codes: the last axis must be even, got {codes.shape[-1]}")
    values = host_values(codes)  # None when traced (quantize's own codes)
    if values is not None:
        bad = np.argwhere((values < 0) | (values > 15))
        if len(bad):
            where = tuple(int(i) for i in bad[0])
            raise ValueError(
                f"pack_codes: codes must be 0-15 (4 bits), got {values[where]} at index {where}"
            )
    codes = codes.astype(jnp.uint8)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def e2m1_to_float32(packed):
    """uint8 [..., K/2] -> the E2M1 values [..., K] in float32 (low nibble first), exactly.

    By integer arithmetic on the float32 bits, as nvfp4.h's e2m1_to_float: elementwise ops that
    XLA fuses into the consumer (on GPUs possibly into its GEMM's operand), where a 16-entry table
    would be a gather; and no array constant, which a custom_partitioning body may not capture.
    Not through XLA's float4_e2m1fn type: XLA (jaxlib 0.10.2) constant-folds a uint8 ->
    float4_e2m1fn bitcast of a captured constant weight to the wrong values."""
    packed = jnp.asarray(packed)
    pairs = jnp.broadcast_to(packed[..., None], (*packed.shape, 2))
    nibble = jax.lax.broadcasted_iota(jnp.uint8, pairs.shape, pairs.ndim - 1)  # 0: low, 1: high
    values = e2m1_codes_to_float32((pairs >> (4 * nibble)) & 0xF)  # [..., K/2, 2]
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def e2m1_codes_to_float32(codes):
    """uint8 E2M1 codes (0..15, one per element) -> float32, exactly, elementwise (no table
    gather, which sharded operands under explicit mesh axes would need typed)."""
    exponent = ((codes >> 1) & 3).astype(jnp.uint32)
    mantissa = (codes & 1).astype(jnp.uint32)
    # Exponent bias 1 -> 127, the mantissa bit on top of float32's; exponent 0 is 0 or 0.5 (126).
    magnitude = jnp.where(
        exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22)
    )
    bits = magnitude | ((codes & 8).astype(jnp.uint32) << 28)  # the sign, bit 3 -> bit 31
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def e4m3_to_float32(scale):
    """E4M3 scales (bytes or float8_e4m3fn) -> float32, exactly (NaN bytes stay NaN)."""
    as_fp8 = jax.lax.bitcast_convert_type(scale_as_bytes(scale), jnp.float8_e4m3fn)
    return as_fp8.astype(jnp.float32)


def dequantize(w: NVFP4Weight, dtype=jnp.float32):
    """The dense weight [..., N, K] = e2m1 * e4m3 block scale * global scale, rounded once to
    `dtype` (to nearest, ties to even): the correctly rounded value of the exact product.

    float32: the float32 product (e2m1 * e4m3 is exact in float32, so one IEEE rounding; XLA's
    CPU programs flush subnormal results to zero, which needs a global scale below 2^-116).
    bfloat16, float16 and other narrower floats: the exact product rounded to odd in float32 by
    integer arithmetic, then converted; float32 keeps at least two bits more than these, so the
    conversion rounds as the exact product would (float32 then bf16 rounds twice and is one ulp
    off in ~0.1-0.25% of values). NaN scale bytes give NaN."""
    if not isinstance(w, NVFP4Weight):
        raise TypeError(f"dequantize: w must be an NVFP4Weight, got {type(w).__name__}")
    try:
        float_dtype = jnp.dtype(dtype)
    except TypeError:
        float_dtype = None
    if float_dtype is None or not jnp.issubdtype(float_dtype, jnp.floating):
        raise TypeError(f"dequantize: dtype must be a float dtype, got {dtype!r}")
    return _dequantize_compiled(w, float_dtype)


def dense_weight(w: NVFP4Weight, dtype):
    """`dequantize`'s computation, traced into the caller's program (the primitive's lowerings)."""
    packed, scale = spec_arrays(w)
    k = w.k
    values = e2m1_to_float32(packed)
    # Each block scale over its block_size elements, by broadcast and reshape rather than
    # jnp.repeat: both keep a sharding of K (row-parallel weights under explicit mesh axes).
    block_scale = e4m3_to_float32(scale)
    block_scale = jax.lax.broadcast_in_dim(
        block_scale, (*block_scale.shape, w.block_size), tuple(range(block_scale.ndim))
    )
    *rows, k_blocks, block_size = block_scale.shape
    block_scale = block_scale.reshape(*rows, k_blocks * block_size)  # no -1: N or a stack may be 0
    if block_scale.shape[-1] != k:  # a partial last block
        block_scale = block_scale[..., :k]
    gs = jnp.asarray(w.global_scale, jnp.float32)[..., None, None]
    product = values * block_scale  # exact: at most 6 significant bits, never subnormal
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 8:  # float64 (x64): the whole product is exact
        return product.astype(dtype) * gs.astype(dtype)
    if dtype == jnp.float32:
        # One IEEE rounding. XLA's CPU programs flush subnormal products (below 2^-126, which
        # only global scales below 2^-116 reach) to zero; the 16-bit formats' integer arithmetic
        # below would keep them, at twice the time (4096 x 4096 on two CPU cores: 245 ms against
        # 128), which float32's users (the reference path, dA) should not pay.
        return product * gs
    if dtype.name in _ROUNDED_FORMATS:
        return _multiply_rounded(product, gs, dtype.name)
    return _multiply_rounded(product, gs, "odd").astype(dtype)


# Formats `_multiply_rounded` writes: (significand bits with the implicit one, smallest normal
# exponent, bits of +inf, the integer type of the result's bits).
_ROUNDED_FORMATS = {
    "bfloat16": (8, -126, 0x7F80, jnp.uint16),
    "float16": (11, -14, 0x7C00, jnp.uint16),
    "odd": (24, -126, 0x7F800000, jnp.uint32),
}


def _multiply_rounded(p, gs, target: str):
    """p * gs rounded once to bfloat16 or float16 (to nearest, ties to even), or with
    target "odd" rounded to odd in float32, for p an exact e2m1 * e4m3 product (zero, NaN, or
    normal with at most 6 significant bits) and gs any float32.

    By integer arithmetic on the bits: p's significand as a 7-bit integer times gs's 24-bit one
    fits in uint32, and the result's bits are assembled from it. Float arithmetic would round
    twice on the way to a 16-bit format, and XLA's CPU programs flush float32 subnormals to zero.
    Rounding to odd (truncate, set the last bit where inexact) keeps the exact product's place
    between the float32 neighbours, so a later round to nearest to any format with at least two
    bits less precision (the float8 formats) gives the correctly rounded product."""
    precision, min_exponent, inf_bits, bits_type = _ROUNDED_FORMATS[target]
    u32 = jnp.uint32
    pb = jax.lax.bitcast_convert_type(p, u32)
    gb = jax.lax.bitcast_convert_type(jnp.broadcast_to(gs, p.shape), u32)
    negative = ((pb ^ gb) >> 31) == 1
    p_biased = ((pb >> 23) & 0xFF).astype(jnp.int32)
    g_biased = ((gb >> 23) & 0xFF).astype(jnp.int32)
    p_int = ((pb & 0x7FFFFF) | 0x800000) >> 17  # the significand's low 17 bits are zero
    g_int = jnp.where(g_biased == 0, gb & 0x7FFFFF, (gb & 0x7FFFFF) | 0x800000)
    zero = ((pb & 0x7FFFFFFF) == 0) | ((gb & 0x7FFFFFFF) == 0)
    s = jnp.where(zero, u32(0), p_int * g_int)  # the exact product = s * 2^e_low
    e_low = (p_biased - 133) + jnp.where(g_biased == 0, -149, g_biased - 150)
    length = 32 - jax.lax.clz(s).astype(jnp.int32)  # significant bits of s
    exponent = jnp.maximum(e_low + length - 1, min_exponent)  # the result's exponent
    shift = exponent - (precision - 1) - e_low  # low bits of s below the result's last place
    right = jnp.clip(shift, 1, 31).astype(u32)
    kept = s >> right
    dropped = s & ((u32(1) << right) - u32(1))
    to_odd = target == "odd"
    if to_odd:  # the sticky bit
        rounded = kept | (dropped != 0).astype(u32)
    else:  # to nearest, ties to even (a carry past the significand moves into the exponent)
        half = u32(1) << (right - u32(1))
        rounded = kept + ((dropped > half) | ((dropped == half) & ((kept & 1) == 1))).astype(u32)
    q = jnp.where(shift <= 0, s << jnp.clip(-shift, 0, 31).astype(u32), rounded)
    # The exponent field above the significand q (q's implicit bit adds one to it; a subnormal
    # result has exponent == min_exponent, q below the implicit bit and a field of 0).
    bias = 1 - min_exponent
    bits = ((exponent + bias - 1).astype(u32) << (precision - 1)) + q
    if to_odd:
        bits = jnp.where(exponent > 127, u32(0x7F7FFFFF), bits)  # beyond float32: its largest, odd
    else:
        bits = jnp.where(exponent > bias, u32(inf_bits), jnp.minimum(bits, u32(inf_bits)))
    bits = jnp.where(s == 0, u32(0), bits)
    # NaN scale bytes and a NaN global scale give NaN, an infinite one inf (NaN times a zero code).
    # Chosen on the bits: a float select of a 16-bit type goes through float32 in XLA's CPU
    # programs, which flushes the subnormals.
    p_nan = (pb & 0x7FFFFFFF) > 0x7F800000
    g_nan = (gb & 0x7FFFFFFF) > 0x7F800000
    g_inf = (gb & 0x7FFFFFFF) == 0x7F800000
    nan = p_nan | g_nan | (g_inf & ((pb & 0x7FFFFFFF) == 0))
    bits = jnp.where(g_inf, u32(inf_bits), bits)
    width = 8 * jnp.dtype(bits_type).itemsize
    bits = bits | (negative.astype(u32) << (width - 1))
    bits = jnp.where(nan, u32(inf_bits | (1 << (precision - 2))), bits).astype(bits_type)
    return jax.lax.bitcast_convert_type(bits, jnp.float32 if to_odd else jnp.dtype(target))


# dequantize is compiled once per shape (as quantize is): run eagerly, its dozens of small ops take
# 18x longer, 4096x4096 on two CPU cores: 0.33 s against 0.018 (quantize_model and load-time
# conversions call it eagerly).
_dequantize_compiled = jax.jit(dense_weight, static_argnames="dtype")
