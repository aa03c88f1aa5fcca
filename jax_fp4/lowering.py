"""Lowering of the `nvfp4_matmul` primitive: the implementation of each path, and the rule that
picks one per platform from static shapes (`dispatch.plan`).

Operands: a [..., K] (fp16/bf16/fp32), packed uint8 [N, K/2], scale uint8 [N, ceil(K/bs)],
global_scale float32 [], bias [N] (a's dtype) when has_bias, and the prepacked SM120 scales
(`prepack`) when has_swizzled. Static `layout`: the byte order of packed and scale ("spec" or
"tiled", jax_fp4/layout.py); the kernels (CPU, tensor-core GEMV, dequant, fused) read "tiled"
directly, the reference, xla, native and scalar-GEMV paths through the inverse transform.
The chosen path shows in the HLO as the FFI custom-call target, or, for pure-JAX paths, as a
`jax_fp4/<path>` op name. Everything a kernel is told comes as FFI attributes decided here: the
GEMV's kernel variant (`dispatch.plan`), the user switches (jax_fp4/config.py), and the static
`tuning` (config.KernelTuning, None: the kernels' heuristics).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_fp4 import config as _config
from jax_fp4 import dispatch as _dispatch
from jax_fp4 import ffi as _ffi
from jax_fp4 import fused as _fused
from jax_fp4 import layout as _layout
from jax_fp4 import native as _native
from jax_fp4 import sharding as _sharding
from jax_fp4.format import NVFP4Weight, dense_weight


def split_operands(operands, has_bias, has_swizzled):
    """The operand tuple -> (a, packed, scale, global_scale, bias or None, swizzled or None)."""
    a, packed, scale, global_scale, *rest = operands
    bias = rest.pop(0) if has_bias else None
    return a, packed, scale, global_scale, bias, (rest.pop(0) if has_swizzled else None)


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
    tiled=False,
    tensor_cores=False,
    row_tiling=True,
    tuning=_config.DEFAULT_TUNING,
    **_,
):
    out = jax.ShapeDtypeStruct((a.shape[0], packed.shape[0]), a.dtype)
    call = jax.ffi.ffi_call("jax_fp4_gemv_cuda", out)
    return call(
        a,
        packed,
        scale,
        global_scale,
        _bias_operand(bias, a.dtype),
        block_size=np.int64(block_size),
        tiled=tiled,
        tensor_cores=tensor_cores,
        row_tiling=row_tiling,
        **_int_attributes(tuning.gemv_attributes()),
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
    tiled=False,
    tuning=_config.DEFAULT_TUNING,
    **_,
):
    m, n, k = a.shape[0], packed.shape[0], a.shape[1]
    outs = (
        jax.ShapeDtypeStruct((m, n), a.dtype),
        jax.ShapeDtypeStruct((_fused.fused_workspace_elems(m, n, k),), jnp.float32),
    )
    y, _ = jax.ffi.ffi_call(_fused.TARGET, outs)(
        _fused.to_fragment_order(a, tiled),
        packed,
        scale,
        global_scale,
        _bias_operand(bias, a.dtype),
        block_size=np.int64(block_size),
        tiled=tiled,
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
    ctx, *operands, block_size, backend, layout, has_bias, has_swizzled, tuning=None, platform
):
    a_aval, packed_aval = ctx.avals_in[0], ctx.avals_in[1]
    plan = plan_for(
        platform, a_aval.shape, a_aval.dtype, packed_aval.shape, block_size, backend, layout
    )
    path = plan.path
    attributes = _kernel_attributes(plan, tuning)
    impl = _sharding.wrap_impl(
        ctx,
        path,
        _impl_for(plan, layout),
        block_size=block_size,
        has_bias=has_bias,
        tiled=layout == "tiled",
        impl_kwargs=tuple(sorted(attributes.items())),
    )

    def lowered(*ops):
        *five, swizzled = split_operands(ops, has_bias, has_swizzled)
        # Only the native SM120 path reads prepacked (swizzled) scales; the others ignore them.
        extra = {"swizzled_scale": swizzled} if path == "native" and swizzled is not None else {}
        with jax.named_scope(f"jax_fp4/{path}"):
            return impl(*five, block_size=block_size, **extra)

    return mlir.lower_fun(lowered, multiple_results=False)(ctx, *operands)


def register(primitive) -> None:
    """Register the lowerings of `primitive`; other platforms (no kernels) lower to the pure-JAX
    paths: xla, or reference for float32."""
    mlir.register_lowering(primitive, functools.partial(_lowering, platform="other"))
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(
            primitive, functools.partial(_lowering, platform=platform), platform=platform
        )
