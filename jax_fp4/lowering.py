"""Lowering of the `nvfp4_matmul` primitive: the implementation of each path, and the rule that
picks one per platform from static shapes (`dispatch.select_path`).

Operands: a [..., K] (fp16/bf16/fp32), packed uint8 [N, K/2], scale uint8 [N, ceil(K/bs)],
global_scale float32 [], bias [N] (a's dtype) when has_bias, and the prepacked SM120 scales
(`prepack`) when has_swizzled. Static `layout`: the byte order of packed and scale ("spec" or
"tiled", jax_fp4/layout.py); the kernels (CPU, tensor-core GEMV, dequant, fused) read "tiled"
directly, the reference, xla, native and scalar-GEMV paths through the inverse transform.
The chosen path shows in the HLO as the FFI custom-call target, or, for pure-JAX paths, as a
`jax_fp4/<path>` op name.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_fp4 import dispatch as _dispatch, ffi as _ffi, fused as _fused, layout as _layout
from jax_fp4 import native as _native, sharding as _sharding
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
    return dense_weight(NVFP4Weight.tree_unflatten((block_size, layout), (packed, scale, global_scale)),
                        dtype)


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


CPU_AVX512_ENV = "JAX_FP4_CPU_AVX512"


@_as_2d
def _cpu(a, packed, scale, global_scale, bias, *, block_size, tiled=False, **_):
    # The kernel reads this itself, once per process (both builds give the same bits); checked
    # here so that a bad value is an error, not silently "on".
    _dispatch.env_flag(CPU_AVX512_ENV, True)
    out = jax.ShapeDtypeStruct((a.shape[0], packed.shape[0]), a.dtype)
    call = jax.ffi.ffi_call("jax_fp4_matmul_cpu", out)
    return call(a, packed, scale, global_scale, _bias_operand(bias, a.dtype),
                block_size=np.int64(block_size), tiled=tiled)


@_as_2d
def _gemv(a, packed, scale, global_scale, bias, *, block_size, tiled=False, **_):
    out = jax.ShapeDtypeStruct((a.shape[0], packed.shape[0]), a.dtype)
    call = jax.ffi.ffi_call("jax_fp4_gemv_cuda", out)
    return call(a, packed, scale, global_scale, _bias_operand(bias, a.dtype),
                block_size=np.int64(block_size), use_mma=gemv_uses_mma(), tiled=tiled,
                row_tiling=_dispatch.env_flag("JAX_FP4_GEMV_ROW_TILING", True))


def gemv_uses_mma() -> bool:
    """JAX_FP4_GEMV_MMA: the tensor-core GEMV (the only one that reads the tiled layout)."""
    return _dispatch.env_flag("JAX_FP4_GEMV_MMA", True)


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
        # result and casting measured 5-14% slower at M >= 512 on the H200 (fused_h200.json).
        return _times_transposed(a, w)
    y = _times_transposed(a, w, preferred_element_type=jnp.float32)
    return (y + bias.astype(jnp.float32)).astype(a.dtype)


@_as_2d
def _fused_gemm(a, packed, scale, global_scale, bias, *, block_size, tiled=False, **_):
    m, n, k = a.shape[0], packed.shape[0], a.shape[1]
    outs = (jax.ShapeDtypeStruct((m, n), a.dtype),
            jax.ShapeDtypeStruct((_fused.fused_workspace_elems(m, n, k),), jnp.float32))
    y, _ = jax.ffi.ffi_call(_fused.TARGET, outs)(
        _fused.to_fragment_order(a, tiled), packed, scale, global_scale,
        _bias_operand(bias, a.dtype), block_size=np.int64(block_size), tiled=tiled)
    return y


_PATHS = {"empty": _empty, "reference": _reference, "cpu": _cpu, "gemv": _gemv, "dequant": _dequant,
          "fused": _fused_gemm, "native": _native.native_matmul, "xla": _xla}


def _reading_spec_layout(impl):
    """`impl` on a tiled weight: the weight's spec layout back first (traced into the program)."""
    @functools.wraps(impl)
    def wrapped(a, packed, scale, global_scale, bias, **kwargs):
        return impl(a, _layout.untile_packed(packed), _layout.untile_scale(scale), global_scale,
                    bias, **kwargs)
    return wrapped


def _reading_tiled_layout(impl):
    """`impl` (a kernel with a `tiled` flag) reading the tiled layout itself."""
    @functools.wraps(impl)
    def wrapped(a, packed, scale, global_scale, bias, *, block_size, **_):
        return impl(a, packed, scale, global_scale, bias, block_size=block_size, tiled=True)
    return wrapped


# Module-level so that each (path, layout) is one function (the partitioning rules cache on it).
# The kernels read the tiled layout; the reference, xla and native paths transform it back.
_TILED_PATHS = {path: _reading_spec_layout(impl) for path, impl in _PATHS.items()}
_SCALAR_GEMV_ON_TILED = _TILED_PATHS["gemv"]
_TILED_PATHS.update(empty=_empty, cpu=_reading_tiled_layout(_cpu), gemv=_reading_tiled_layout(_gemv),
                    dequant=_reading_tiled_layout(_dequant), fused=_reading_tiled_layout(_fused_gemm))


def _impl_for(path: str, layout: str, platform: str):
    """The implementation of `path` for operands in `layout`."""
    if layout == "spec":
        return _PATHS[path]
    if path == "gemv":
        # The tiled layout is the tensor-core kernel's (sm_80+); the scalar one reads the spec's.
        capability = cuda_capability() if platform == "cuda" else None
        if not (gemv_uses_mma() and capability is not None and capability >= (8, 0)):
            return _SCALAR_GEMV_ON_TILED
    return _TILED_PATHS[path]


def problem_of(a_shape, a_dtype, packed_shape, block_size, layout) -> _dispatch.Problem:
    return _dispatch.Problem(m=math.prod(a_shape[:-1]), n=packed_shape[0], k=2 * packed_shape[1],
                             block_size=block_size, dtype=np.dtype(a_dtype),
                             tiled=layout == "tiled")


def cuda_capability():
    """The compute capability the CUDA lowering picks kernels for: JAX_FP4_CUDA_CAPABILITY when
    set (exporting for another GPU), else this machine's first GPU's (None without one)."""
    return _dispatch.env_capability() or _native.device_capability()


def path_for(platform, a_shape, a_dtype, packed_shape, block_size, backend, layout) -> str:
    on_cuda = platform == "cuda"
    capability = cuda_capability() if on_cuda else None
    # Kernels this GPU can run: an older GPU than the architectures compiled in takes the xla path.
    has_kernels = _ffi.has_cuda_kernels() and _dispatch.cuda_kernels_run_on(
        _ffi.cuda_architectures(), capability)
    return _dispatch.select_path(platform, backend,
                                 problem_of(a_shape, a_dtype, packed_shape, block_size, layout),
                                 has_cuda_kernels=has_kernels, capability=capability,
                                 native_enabled=on_cuda and _dispatch.env_flag(_native.NATIVE_ENV, False))


def _lowering(ctx, *operands, block_size, backend, layout, has_bias, has_swizzled, platform):
    a_aval, packed_aval = ctx.avals_in[0], ctx.avals_in[1]
    path = path_for(platform, a_aval.shape, a_aval.dtype, packed_aval.shape, block_size, backend,
                    layout)
    impl = _sharding.wrap_impl(ctx, path, _impl_for(path, layout, platform), block_size=block_size,
                               has_bias=has_bias, tiled=layout == "tiled")

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
        mlir.register_lowering(primitive, functools.partial(_lowering, platform=platform),
                               platform=platform)
