"""Lowering of the `nvfp4_matmul` primitive: the implementation of each path, and the rule that
picks one per platform from static shapes (`dispatch.plan`).

Operands: a [..., K] (fp16/bf16/fp32), packed uint8 [N, K/2], scale [N, ceil(K/bs)] (E4M3,
float8_e4m3fn or uint8 bytes as the weight holds them), global_scale float32 [], bias [N] (a's
dtype) when has_bias, and the prepacked SM120 scales (`prepack`) when has_swizzled. Static `layout`: the byte order of packed and scale ("spec" or
"tiled", jax_fp4/layout.py); the kernels (CPU, tensor-core GEMV, dequant, fused) read "tiled"
directly, the reference, xla, native and scalar-GEMV paths through the inverse transform.
The chosen path shows in the HLO as the FFI custom-call target, or, for pure-JAX paths, as a
`jax_fp4/<path>` op name. Everything a kernel is told comes as FFI attributes decided here: the
GEMV's kernel variant (`dispatch.plan`), the user switches (jax_fp4/config.py), and the static
`tuning` (config.KernelTuning, None: the kernels' heuristics).

Fusions (static `norm_eps`, `activation`, `has_residual`; operands norm_weight [K] and residual
[..., N_out] after the others): an RMSNorm of `a` before the product, "silu_mul" on a gate/up
weight, a residual added last, all in float32 with one rounding (`rms_norm`, `epilogue`). The
decode GEMV (`_gemv`) and the fused GEMM up to dispatch.FUSED_EPILOGUE_MAX_M rows
(`_fused_gemm`) run silu_mul and the residual in their kernels' epilogues, after the RMSNorm as
its own XLA fusion (or, on the GEMV under KernelTuning.gemv_norm_scale, split around it:
`_norm_scaled`); every other path, and these where their kernels cannot (a multi-device
program, whose partitioning rules know the plain product only; on the tiled layout silu_mul with
N / 2 % 16 != 0; a `tuning` with gemv_col_tiles=1 and silu_mul, or fused_stream_k=True), composes
all of them around its product (`_composed`), taken in float32 where the path can give it
(reference, xla, cpu; dequant in single-device programs) and else rounded to a's dtype first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp4 import config as _config
from jax_fp4 import dispatch as _dispatch
from jax_fp4 import ffi as _ffi
from jax_fp4 import fused as _fused
from jax_fp4 import layout as _layout
from jax_fp4 import native as _native
from jax_fp4 import sharding as _sharding
from jax_fp4.explicit_axes import (
    axes_size,
    explicit_type,
    spec_axes,
    spec_entry,
    typed_like,
    typed_mesh,
)
from jax_fp4.format import NVFP4Weight, dense_weight


def split_operands(operands, has_bias, has_swizzled):
    """The operand tuple -> (a, packed, scale, global_scale, bias or None, swizzled or None)."""
    return split_fused_operands(operands, has_bias, has_swizzled, False, False)[:6]


def split_fused_operands(operands, has_bias, has_swizzled, has_norm, has_residual):
    """The operand tuple -> (a, packed, scale, global_scale, bias, swizzled, norm_weight,
    residual), each optional one None when absent."""
    a, packed, scale, global_scale, *rest = operands
    optional = []
    for present in (has_bias, has_swizzled, has_norm, has_residual):
        optional.append(rest.pop(0) if present else None)
    return (a, packed, scale, global_scale, *optional)


# ---- the fusions' semantics (the composition every path but the fused GEMV kernel runs) --------

ACTIVATIONS = ("silu_mul",)


def _replicated(x):
    """x with no sharding type (a small operand broadcast against sharded ones under Explicit
    axes, where two different axes on one dimension would be a type error)."""
    sharding = explicit_type(jax.typeof(x))
    if sharding is None:
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, P()))


def rms_norm(a, norm_weight, eps):
    """The RMSNorm of each row of a: (a32 * rsqrt(mean(a32^2) + eps) * norm_weight32), rounded
    once to a's dtype (a32 = a in float32)."""
    a32 = a.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(a32), axis=-1, keepdims=True)
    weight = _replicated(norm_weight.astype(jnp.float32))
    return (a32 * jax.lax.rsqrt(mean_square + jnp.float32(eps)) * weight).astype(a.dtype)


def _gate_and_up(y):
    """y [..., 2 I] -> (y[..., :I], y[..., I:]); under Explicit axes a last dim whose shards
    would split unevenly is gathered first."""
    sharding = explicit_type(jax.typeof(y))
    if sharding is not None:
        *lead, last = spec_axes(sharding, y.ndim)
        if last and (y.shape[-1] // 2) % axes_size(sharding.mesh, last):
            spec = P(*(spec_entry(e) for e in lead), None)
            y = jax.sharding.reshard(y, NamedSharding(sharding.mesh, spec))
    half = y.shape[-1] // 2
    return y[..., :half], y[..., half:]


def epilogue(y32, activation, residual, dtype):
    """The product's epilogue in float32, then the one rounding to `dtype`: silu(gate) * up for
    activation "silu_mul" (y32 [..., 2 I] -> [..., I]), then + residual."""
    if activation == "silu_mul":
        gate, up = _gate_and_up(y32)
        y32 = jax.nn.silu(gate) * up
    elif activation is not None:
        raise ValueError(f"activation must be one of {ACTIVATIONS} or None, got {activation!r}")
    if residual is not None:
        y32 = y32 + typed_like(residual.astype(jnp.float32), jax.typeof(y32))
    return y32.astype(dtype)


# ---- path implementations (traced inside the lowering) ----------------------------------------


def _empty(a, packed, scale, global_scale, bias, *, block_size, **_):
    out = jnp.zeros(a.shape[:-1] + (packed.shape[0],), a.dtype)
    return out if bias is None else out + bias


def dense(packed, scale, global_scale, block_size, layout="spec", dtype=jnp.float32):
    """The dequantized weight [N, K]: computed in float32 and rounded once to `dtype` (float32 for
    the reference decomposition and dA, the activations' dtype for the xla path)."""
    return dense_weight(
        NVFP4Weight.tree_unflatten((block_size, layout), (packed, scale, global_scale)), dtype
    )


def _times_transposed(a, w, **kwargs):
    """a @ w^T by XLA's dot. Under explicit mesh axes the result takes the primitive's result
    type (`result_sharding`); a row-parallel K, sharded on both sides, is then summed."""
    out_sharding = _sharding.result_sharding(jax.typeof(a), jax.typeof(w))
    return jnp.matmul(a, w.T, out_sharding=out_sharding, **kwargs)


def _reference(a, packed, scale, global_scale, bias, *, block_size, **_):
    w = dense(packed, scale, global_scale, block_size)
    y = _times_transposed(a.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(a.dtype)


def _as_2d(fn):
    """Run a kernel on a [M, K] view of a [..., K] activation."""

    @functools.wraps(fn)
    def wrapped(a, *args, **kwargs):
        lead = a.shape[:-1]
        y = fn(_sharding.merge_leading(a), *args, **kwargs)
        return y.reshape(*lead, y.shape[-1])

    return wrapped


def _bias_operand(bias, dtype):
    # The handlers take bias [N], or an empty array for "no bias", so one target serves both.
    return jnp.zeros((0,), dtype) if bias is None else bias


def _int_attributes(attributes: dict) -> dict:
    """FFI attributes: Python ints as int64 (bools stay bools)."""
    return {
        name: value if isinstance(value, bool) else np.int64(value)
        for name, value in attributes.items()
    }


@_as_2d
def _cpu(a, packed, scale, global_scale, bias, *, block_size, tiled=False, avx512=True, **_):
    out = jax.ShapeDtypeStruct((a.shape[0], packed.shape[0]), a.dtype)
    call = jax.ffi.ffi_call("jax_fp4_matmul_cpu", out)
    return call(
        a,
        packed,
        scale,
        global_scale,
        _bias_operand(bias, a.dtype),
        block_size=np.int64(block_size),
        tiled=tiled,
        avx512=avx512,
    )


@_as_2d
def _gemv(
    a,
    packed,
    scale,
    global_scale,
    bias,
    *,
    block_size,
    activation=None,
    residual=None,
    row_sq_sum=None,
    norm_eps=None,
    tiled=False,
    tensor_cores=False,
    row_tiling=True,
    tuning=_config.DEFAULT_TUNING,
    **_,
):
    """The GEMV kernel. With `activation`, `residual` or `row_sq_sum` its fused instances, the
    epilogue fusions in the kernel: the target's extra operands residual ([M, N_out]) and
    row_sq_sum ([M] float32: each row's product scaled by rsqrt(row_sq_sum / K + norm_eps)), each
    [0] when absent, and its attributes activation (0 none, 1 silu_mul) and norm_eps."""
    fused = activation is not None or residual is not None or row_sq_sum is not None
    n_out = packed.shape[0] // 2 if activation == "silu_mul" else packed.shape[0]
    attributes = dict(
        block_size=block_size, tiled=tiled, tensor_cores=tensor_cores, row_tiling=row_tiling
    )
    fused_operands, fused_attributes = [], {}
    if fused:
        fused_operands = [
            jnp.zeros((0,), a.dtype) if residual is None else residual.reshape(a.shape[0], n_out),
            jnp.zeros((0,), jnp.float32) if row_sq_sum is None else row_sq_sum.reshape(-1),
        ]
        attributes["activation"] = 1 if activation == "silu_mul" else 0
        fused_attributes["norm_eps"] = np.float32(0.0 if norm_eps is None else norm_eps)
    call = jax.ffi.ffi_call("jax_fp4_gemv_cuda", jax.ShapeDtypeStruct((a.shape[0], n_out), a.dtype))
    return call(
        a,
        packed,
        scale,
        global_scale,
        _bias_operand(bias, a.dtype),
        *fused_operands,
        **_int_attributes({**attributes, **tuning.gemv_attributes()}),
        **fused_attributes,
    )


def _dequant(a, packed, scale, global_scale, bias, *, block_size, tiled=False, **_):
    n, k = packed.shape[0], a.shape[-1]
    call = jax.ffi.ffi_call("jax_fp4_dequant_cuda", jax.ShapeDtypeStruct((n, k), a.dtype))
    w = call(packed, scale, global_scale, block_size=np.int64(block_size), tiled=tiled)
    return _dot_dequantized(a, w, bias)


def _xla(a, packed, scale, global_scale, bias, *, block_size, **_):
    # The dequant path's weight (same rounding), made by XLA: XLA may fuse it into its GEMM's
    # operand instead of writing it to memory (dequantize is elementwise, no table lookup).
    return _dot_dequantized(a, dense(packed, scale, global_scale, block_size, dtype=a.dtype), bias)


def _dot_dequantized(a, w, bias):
    """a @ w^T (+ bias) by XLA's dot, w [N, K] in a's dtype."""
    if bias is None:
        # cuBLAS accumulates in fp32 and rounds once in its epilogue; asking for an f32 [M, N]
        # result and casting measured 5-14% slower at M >= 512 on the H200 (benchmarks/RESULTS.md).
        return _times_transposed(a, w)
    y = _times_transposed(a, w, preferred_element_type=jnp.float32)
    return (y + bias.astype(jnp.float32)).astype(a.dtype)


@_as_2d
def _fused_gemm(
    a,
    packed,
    scale,
    global_scale,
    bias,
    *,
    block_size,
    activation=None,
    residual=None,
    tiled=False,
    tuning=_config.DEFAULT_TUNING,
    **_,
):
    """The fused GEMM, with the epilogue fusions in its kernel: the operand residual ([M, N_out],
    or [0] when absent) and the attribute activation (0 none, 1 silu_mul)."""
    m, n, k = a.shape[0], packed.shape[0], a.shape[1]
    n_out = n // 2 if activation == "silu_mul" else n
    outs = (
        jax.ShapeDtypeStruct((m, n_out), a.dtype),
        jax.ShapeDtypeStruct((_fused.fused_workspace_elems(m, n, k),), jnp.float32),
    )
    y, _ = jax.ffi.ffi_call(_fused.TARGET, outs)(
        _fused.to_fragment_order(a, tiled),
        packed,
        scale,
        global_scale,
        _bias_operand(bias, a.dtype),
        jnp.zeros((0,), a.dtype) if residual is None else residual.reshape(m, n_out),
        block_size=np.int64(block_size),
        tiled=tiled,
        activation=np.int64(1 if activation == "silu_mul" else 0),
        **_int_attributes(tuning.fused_attributes()),
    )
    return y


_PATHS = {
    "empty": _empty,
    "reference": _reference,
    "cpu": _cpu,
    "gemv": _gemv,
    "dequant": _dequant,
    "fused": _fused_gemm,
    "native": _native.native_matmul,
    "xla": _xla,
}


def _reading_spec_layout(impl):
    """`impl` on a tiled weight: the weight's spec layout back first (traced into the program)."""

    @functools.wraps(impl)
    def wrapped(a, packed, scale, global_scale, bias, **kwargs):
        return impl(
            a,
            _layout.untile_packed(packed),
            _layout.untile_scale(scale),
            global_scale,
            bias,
            **kwargs,
        )

    return wrapped


def _reading_tiled_layout(impl):
    """`impl` (a kernel with a `tiled` flag) reading the tiled layout itself."""

    @functools.wraps(impl)
    def wrapped(a, packed, scale, global_scale, bias, *, block_size, **kwargs):
        kwargs.pop("tiled", None)
        return impl(
            a, packed, scale, global_scale, bias, block_size=block_size, tiled=True, **kwargs
        )

    return wrapped


# Module-level so that each (path, layout) is one function (the partitioning rules cache on it).
# The kernels read the tiled layout; the reference, xla and native paths transform it back.
_TILED_PATHS = {path: _reading_spec_layout(impl) for path, impl in _PATHS.items()}
_SCALAR_GEMV_ON_TILED = _TILED_PATHS["gemv"]
_TILED_PATHS.update(
    empty=_empty,
    cpu=_reading_tiled_layout(_cpu),
    gemv=_reading_tiled_layout(_gemv),
    dequant=_reading_tiled_layout(_dequant),
    fused=_reading_tiled_layout(_fused_gemm),
)


# Products in float32 (bias added, no rounding) for the composed fusions, on paths that can give
# them without a kernel of their own: reference, xla, empty, and dequant (its kernel makes the
# weight, XLA's dot the product).
def _empty_f32(a, packed, scale, global_scale, bias, *, block_size, **_):
    out = jnp.zeros(a.shape[:-1] + (packed.shape[0],), jnp.float32)
    return out if bias is None else out + bias.astype(jnp.float32)


def _reference_f32(a, packed, scale, global_scale, bias, *, block_size, **_):
    w = dense(packed, scale, global_scale, block_size)
    y = _times_transposed(a.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return y if bias is None else y + bias.astype(jnp.float32)


def _dot_dequantized_f32(a, w, bias):
    y = _times_transposed(a, w, preferred_element_type=jnp.float32)
    return y if bias is None else y + bias.astype(jnp.float32)


def _xla_f32(a, packed, scale, global_scale, bias, *, block_size, **_):
    w = dense(packed, scale, global_scale, block_size, dtype=a.dtype)
    return _dot_dequantized_f32(a, w, bias)


def _dequant_f32(a, packed, scale, global_scale, bias, *, block_size, tiled=False, **_):
    n, k = packed.shape[0], a.shape[-1]
    call = jax.ffi.ffi_call("jax_fp4_dequant_cuda", jax.ShapeDtypeStruct((n, k), a.dtype))
    w = call(packed, scale, global_scale, block_size=np.int64(block_size), tiled=tiled)
    return _dot_dequantized_f32(a, w, bias)


_F32_PATHS = {
    "spec": {
        "empty": _empty_f32,
        "reference": _reference_f32,
        "xla": _xla_f32,
        "dequant": _dequant_f32,
    },
    "tiled": {
        "empty": _empty_f32,
        "reference": _reading_spec_layout(_reference_f32),
        "xla": _reading_spec_layout(_xla_f32),
        "dequant": _reading_tiled_layout(_dequant_f32),
    },
}


def _impl_for(plan: _dispatch.Plan, layout: str):
    """The implementation of `plan`'s path for operands in `layout`."""
    if layout == "spec":
        return _PATHS[plan.path]
    if plan.path == "gemv" and not plan.gemv_tensor_cores:
        return _SCALAR_GEMV_ON_TILED  # the tiled layout is the tensor-core kernel's
    return _TILED_PATHS[plan.path]


def _kernel_attributes(plan: _dispatch.Plan, tuning) -> dict:
    """The static keyword arguments of `plan`'s path implementation: its FFI attributes."""
    tuning = _config.DEFAULT_TUNING if tuning is None else tuning
    if plan.path == "cpu":
        return dict(avx512=_config.cpu_avx512())
    if plan.path == "gemv":
        return dict(
            tensor_cores=plan.gemv_tensor_cores, row_tiling=_config.gemv_row_tiling(), tuning=tuning
        )
    if plan.path == "fused":
        return dict(tuning=tuning)
    return {}


def problem_of(a_shape, a_dtype, packed_shape, block_size, layout) -> _dispatch.Problem:
    return _dispatch.Problem(
        m=math.prod(a_shape[:-1]),
        n=packed_shape[0],
        k=2 * packed_shape[1],
        block_size=block_size,
        dtype=np.dtype(a_dtype),
        tiled=layout == "tiled",
    )


def cuda_capability():
    """The compute capability the CUDA lowering picks kernels for: JAX_FP4_CUDA_CAPABILITY when
    set (exporting for another GPU), else this machine's first GPU's (None without one)."""
    return _config.cuda_capability_override() or _native.device_capability()


def cuda_device_kind():
    """The device kind whose crossovers the CUDA lowering uses: this machine's first GPU's, or
    None (JAX_FP4_CUDA_CAPABILITY set, or no GPU): the capability's entry then."""
    if _config.cuda_capability_override() is not None:
        return None
    return _native.device_kind()


def target_for(platform: str) -> _dispatch.Target:
    """The dispatch's view of `platform` ('cpu', 'cuda' or another) on this machine."""
    if platform != "cuda":
        return _dispatch.Target(platform)
    capability = cuda_capability()
    # Kernels this GPU can run: an older GPU than the architectures compiled in takes the xla path.
    has_kernels = _ffi.has_cuda_kernels() and _dispatch.cuda_kernels_run_on(
        _ffi.cuda_architectures(), capability
    )
    return _dispatch.Target(
        "cuda",
        capability=capability,
        device_kind=cuda_device_kind(),
        has_cuda_kernels=has_kernels,
        native_enabled=_config.native_sm120(),
        gemv_mma=_config.gemv_tensor_cores(),
    )


def plan_for(
    platform, a_shape, a_dtype, packed_shape, block_size, backend, layout
) -> _dispatch.Plan:
    return _dispatch.plan(
        problem_of(a_shape, a_dtype, packed_shape, block_size, layout),
        target_for(platform),
        backend,
    )


def path_for(platform, a_shape, a_dtype, packed_shape, block_size, backend, layout) -> str:
    return plan_for(platform, a_shape, a_dtype, packed_shape, block_size, backend, layout).path


def _lowering(
    ctx,
    *operands,
    block_size,
    backend,
    layout,
    has_bias,
    has_swizzled,
    tuning=None,
    platform,
    norm_eps=None,
    activation=None,
    has_residual=False,
):
    a_aval, packed_aval = ctx.avals_in[0], ctx.avals_in[1]
    plan = plan_for(
        platform, a_aval.shape, a_aval.dtype, packed_aval.shape, block_size, backend, layout
    )
    path = plan.path
    attributes = _kernel_attributes(plan, tuning)
    if norm_eps is not None or activation is not None or has_residual:
        fusions = dict(norm_eps=norm_eps, activation=activation, has_residual=has_residual)
        return _fused_lowering(
            ctx, operands, plan, attributes, block_size, layout, has_bias, has_swizzled, fusions
        )
    impl = _wrapped_impl(ctx, plan, attributes, block_size, layout, has_bias)

    def lowered(*ops):
        *five, swizzled = split_operands(ops, has_bias, has_swizzled)
        # Only the native SM120 path reads prepacked (swizzled) scales; the others ignore them.
        extra = {"swizzled_scale": swizzled} if path == "native" and swizzled is not None else {}
        with jax.named_scope(f"jax_fp4/{path}"):
            return impl(*five, block_size=block_size, **extra)

    return mlir.lower_fun(lowered, multiple_results=False)(ctx, *operands)


def _partitioned(ctx, path: str) -> bool:
    """Whether the partitioning rules wrap `path` in this lowering (sharding.wrap_impl): a kernel
    path in a multi-device program (laid out by its sharding types, or by custom_partitioning)."""
    if path not in _sharding.KERNEL_PATHS or not _config.custom_partitioning():
        return False
    return typed_mesh(ctx.avals_in[0]) is not None or _sharding._needs_rule(ctx)


def _fuses_in_kernel(
    plan: _dispatch.Plan,
    layout: str,
    n: int,
    activation,
    has_residual: bool,
    tuning,
    norm_scaled: bool = False,
) -> bool:
    """Whether `plan` runs silu_mul and the residual in its kernel (the GEMV's fused instances,
    the fused GEMM's epilogue) in a single-device program, rather than composed around its
    product. An RMSNorm alone leaves the kernel plain, unless `norm_scaled` (`_norm_scaled`)."""
    if not plan.epilogue_in_kernel or (activation is None and not has_residual and not norm_scaled):
        return False
    tuning = _config.DEFAULT_TUNING if tuning is None else tuning
    # The tiled kernels pair a 16-row gate tile with its up tile (a warp's two column tiles in
    # the GEMV, the two halves of a CTA tile in the fused GEMM).
    if activation == "silu_mul" and layout == "tiled" and (n // 2) % 16:
        return False
    if plan.path == "fused":
        return tuning.fused_stream_k is not True  # stream-K runs no fusion
    if activation == "silu_mul" and plan.gemv_tensor_cores and tuning.gemv_col_tiles == 1:
        return False
    return True


def _norm_scaled(plan: _dispatch.Plan, a_dtype, tuning) -> bool:
    """Whether a call's RMSNorm is split around the GEMV (KernelTuning.gemv_norm_scale, on
    bfloat16 activations: a * norm_weight rounded to float16 could overflow where the normalized
    value would not): `_norm_operands` before it, each row's 1 / RMS in its epilogue."""
    return (
        tuning is not None
        and tuning.gemv_norm_scale
        and plan.path == "gemv"
        and np.dtype(a_dtype) == np.dtype(jnp.bfloat16)
    )


def _norm_operands(a, norm_weight):
    """The GEMV's operands of a split RMSNorm: a * norm_weight in float32 rounded once to a's
    dtype, and each row's sum of squares over K in float32 ([M]); one XLA fusion of a."""
    a32 = a.astype(jnp.float32)
    scaled = (a32 * _replicated(norm_weight.astype(jnp.float32))).astype(a.dtype)
    return scaled, jnp.sum(a32 * a32, axis=-1)


def _wrapped_impl(ctx, plan, attributes, block_size, layout, has_bias):
    """The plan's implementation as the lowering runs it: under the sharding rules where the
    operands are sharded, with the plan's kernel attributes."""
    return _sharding.wrap_impl(
        ctx,
        plan.path,
        _impl_for(plan, layout),
        block_size=block_size,
        has_bias=has_bias,
        tiled=layout == "tiled",
        impl_kwargs=tuple(sorted(attributes.items())),
    )


def _fused_lowering(
    ctx, operands, plan, attributes, block_size, layout, has_bias, has_swizzled, fusions
):
    """The lowering of a call with fusions: silu_mul and the residual in the GEMV's kernel where
    it can, everything else composed around the product."""
    norm_eps, activation = fusions["norm_eps"], fusions["activation"]
    has_norm = norm_eps is not None
    path, n = plan.path, ctx.avals_in[1].shape[0]

    def split(ops):
        return split_fused_operands(ops, has_bias, has_swizzled, has_norm, fusions["has_residual"])

    tuning = attributes.get("tuning")
    norm_scaled = has_norm and _norm_scaled(plan, ctx.avals_in[0].dtype, tuning)
    in_kernel = _fuses_in_kernel(
        plan, layout, n, activation, fusions["has_residual"], tuning, norm_scaled
    )
    if in_kernel and not _partitioned(ctx, path):
        impl = _impl_for(plan, layout)

        def lowered(*ops):
            a, packed, scale, global_scale, bias, _, norm_weight, residual = split(ops)
            with jax.named_scope(f"jax_fp4/{path}"):
                # The RMSNorm is an XLA fusion before the kernel (in the kernel, each block
                # normalizing its rows before its first mma, or folded into the GEMV's loop, it
                # measured slower: docs/design.md), or with `norm_scaled` split around it.
                norm = {}
                if norm_scaled:
                    a_n, row_sq_sum = _norm_operands(a, norm_weight)
                    norm = dict(row_sq_sum=row_sq_sum, norm_eps=norm_eps)
                else:
                    a_n = rms_norm(a, norm_weight, norm_eps) if has_norm else a
                return impl(
                    a_n,
                    packed,
                    scale,
                    global_scale,
                    bias,
                    block_size=block_size,
                    activation=activation,
                    residual=residual,
                    **norm,
                    **attributes,
                )

        return mlir.lower_fun(lowered, multiple_results=False)(ctx, *operands)

    product = _product_f32(ctx, plan, attributes, block_size, layout, has_bias)

    def composed(*ops):
        a, packed, scale, global_scale, bias, swizzled, norm_weight, residual = split(ops)
        with jax.named_scope(f"jax_fp4/{path}"):
            a_n = rms_norm(a, norm_weight, norm_eps) if has_norm else a
            y32 = product(a_n, packed, scale, global_scale, bias, swizzled)
            return epilogue(y32, activation, residual, a.dtype)

    return mlir.lower_fun(composed, multiple_results=False)(ctx, *operands)


def _product_f32(ctx, plan, attributes, block_size, layout, has_bias):
    """fn(a, packed, scale, global_scale, bias, swizzled) -> the product (+ bias) in float32, by
    `plan`'s path under the partitioning rules that apply: unrounded on reference, xla, empty,
    cpu (its kernel run on float32 activations) and dequant in a single-device program; rounded
    to a's dtype first on the other kernels (gemv, fused, native, and dequant when partitioned),
    which write a's dtype."""
    path = plan.path
    if path in _F32_PATHS[layout] and not _partitioned(ctx, path):
        impl = _F32_PATHS[layout][path]

        def product(a, packed, scale, global_scale, bias, swizzled):
            return impl(a, packed, scale, global_scale, bias, block_size=block_size)

        return product
    impl = _wrapped_impl(ctx, plan, attributes, block_size, layout, has_bias)

    def product(a, packed, scale, global_scale, bias, swizzled):
        if path == "cpu":  # its float32 build: the product unrounded
            a = a.astype(jnp.float32)
            bias = None if bias is None else bias.astype(jnp.float32)
        extra = {"swizzled_scale": swizzled} if path == "native" and swizzled is not None else {}
        y = impl(a, packed, scale, global_scale, bias, block_size=block_size, **extra)
        return y.astype(jnp.float32)

    return product


def register(primitive) -> None:
    """Register the lowerings of `primitive`; other platforms (no kernels) lower to the pure-JAX
    paths: xla, or reference for float32."""
    mlir.register_lowering(primitive, functools.partial(_lowering, platform="other"))
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(
            primitive, functools.partial(_lowering, platform=platform), platform=platform
        )
