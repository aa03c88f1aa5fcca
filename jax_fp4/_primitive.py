"""The `nvfp4_matmul` primitive and all its rules: abstract eval, per-platform lowering, batching,
JVP and transpose.

Operands: a [..., K] (fp16/bf16/fp32), packed uint8 [N, K/2], scale uint8 [N, ceil(K/bs)],
global_scale float32 [], bias [N] (a's dtype) when has_bias, and the prepacked SM120 scales
(`prepack`) when has_swizzled. Result: [..., N] in a's dtype. Static `layout`: the byte order of
packed and scale ("spec" or "tiled", jax_fp4/_layout.py); the kernels (CPU, tensor-core GEMV,
dequant, fused) read "tiled" directly, the reference, xla, native and scalar-GEMV paths through
the inverse transform.
The lowering picks a path from static shapes (`_dispatch.select_path`); the chosen path shows in
the HLO as the FFI custom-call target, or, for pure-JAX paths, as a `jax_fp4/<path>` op name.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp4 import _dispatch, _explicit_axes, _ffi, _fused, _layout, _native, _sharding
from jax_fp4._format import NVFP4Weight, dense_weight

nvfp4_matmul_p = Primitive("nvfp4_matmul")


def bind(a, packed, scale, global_scale, bias, *, block_size: int, backend: str,
         swizzled_scale=None, layout: str = "spec"):
    """Bind the primitive; `bias` and `swizzled_scale` (prepacked SM120 scales) may be None.
    Operands must already be validated."""
    operands = (a, packed, scale, global_scale) + tuple(
        x for x in (bias, swizzled_scale) if x is not None)
    return nvfp4_matmul_p.bind(*operands, block_size=block_size, backend=backend, layout=layout,
                               has_bias=bias is not None, has_swizzled=swizzled_scale is not None)


def _split(operands, has_bias, has_swizzled):
    """The operand tuple -> (a, packed, scale, global_scale, bias or None, swizzled or None)."""
    a, packed, scale, global_scale, *rest = operands
    bias = rest.pop(0) if has_bias else None
    return a, packed, scale, global_scale, bias, (rest.pop(0) if has_swizzled else None)


# ---- abstract evaluation ------------------------------------------------------------------------

def _abstract_eval(*operands, **params):
    del params
    a, packed = operands[0], operands[1]
    shape = a.shape[:-1] + (packed.shape[0],)
    sharding = _sharding.result_sharding(a, packed)  # only under explicit mesh axes
    if sharding is None:
        return jax.core.ShapedArray(shape, a.dtype)
    return jax.core.ShapedArray(shape, a.dtype, sharding=sharding)


nvfp4_matmul_p.def_abstract_eval(_abstract_eval)


@functools.lru_cache(maxsize=None)
def _jitted_bind(**params):
    return jax.jit(functools.partial(nvfp4_matmul_p.bind, **params))


# Eager (un-jitted) calls compile the primitive alone, like any jnp operation.
nvfp4_matmul_p.def_impl(lambda *operands, **params: _jitted_bind(**params)(*operands))
_sharding.register_primitive(nvfp4_matmul_p)  # the lowering needs the devices (partitioning)


# ---- path implementations (traced inside the lowering) ----------------------------------------

def _empty(a, packed, scale, global_scale, bias, *, block_size, **_):
    out = jnp.zeros(a.shape[:-1] + (packed.shape[0],), a.dtype)
    return out if bias is None else out + bias


def _dense(packed, scale, global_scale, block_size, layout="spec", dtype=jnp.float32):
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
    w = _dense(packed, scale, global_scale, block_size)
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
    return _dot_dequantized(a, _dense(packed, scale, global_scale, block_size, dtype=a.dtype), bias)


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
        *five, swizzled = _split(ops, has_bias, has_swizzled)
        # Only the native SM120 path reads prepacked (swizzled) scales; the others ignore them.
        extra = {"swizzled_scale": swizzled} if path == "native" and swizzled is not None else {}
        with jax.named_scope(f"jax_fp4/{path}"):
            return impl(*five, block_size=block_size, **extra)

    return mlir.lower_fun(lowered, multiple_results=False)(ctx, *operands)


# Other platforms (no kernels) lower to the pure-JAX paths: xla, or reference for float32.
mlir.register_lowering(nvfp4_matmul_p, functools.partial(_lowering, platform="other"))
mlir.register_lowering(nvfp4_matmul_p, functools.partial(_lowering, platform="cpu"), platform="cpu")
mlir.register_lowering(nvfp4_matmul_p, functools.partial(_lowering, platform="cuda"), platform="cuda")


# ---- batching -----------------------------------------------------------------------------------

def _batch(operands, dims, **params):
    a_dim, weight_dims = dims[0], dims[1:]
    if all(d is None for d in weight_dims):
        # vmap over activations only: the batch axis joins the leading (M) axes.
        a = jnp.moveaxis(operands[0], a_dim, 0)
        return nvfp4_matmul_p.bind(a, *operands[1:], **params), 0
    # vmap over stacked weights (experts, layers) or biases: one matmul per weight, in a loop.
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    batched = [jnp.moveaxis(x, d, 0) if d is not None else None
               for x, d in zip(operands, dims)]

    def one(sliced):
        ops = [s if b is not None else x for x, s, b in zip(operands, sliced, batched)]
        return nvfp4_matmul_p.bind(*ops, **params)

    xs = [b if b is not None else jnp.zeros((size,), jnp.int8) for b in batched]
    return jax.lax.map(one, xs), 0


batching.primitive_batchers[nvfp4_matmul_p] = _batch


# ---- autodiff -----------------------------------------------------------------------------------
# y = gs * (a @ D^T) + bias with D the block-scaled codes: linear in (a, bias) for a fixed global
# scale, and linear in the global scale for fixed a. The packed codes and block scales are integer
# data and have no tangent.

def _is_zero(t):
    return type(t) is ad.Zero


def _jvp(primals, tangents, *, block_size, backend, layout, has_bias, has_swizzled):
    a, packed, scale, global_scale, bias, swizzled = _split(primals, has_bias, has_swizzled)
    da, _, _, dgs, dbias, _ = _split(tangents, has_bias, has_swizzled)
    weight = dict(block_size=block_size, backend=backend, swizzled_scale=swizzled, layout=layout)
    y = bind(a, packed, scale, global_scale, bias, **weight)
    out_tangents = []
    dbias = None if dbias is None or _is_zero(dbias) else dbias
    if not _is_zero(da):
        out_tangents.append(bind(da, packed, scale, global_scale, dbias, **weight))
    elif dbias is not None:  # only the bias moves: no matmul needed
        out_tangents.append(_explicit_axes.typed_like(jnp.broadcast_to(dbias, y.shape), jax.typeof(y)))
    if not _is_zero(dgs):
        out_tangents.append(bind(a, packed, scale, dgs, None, **weight))
    if not out_tangents:
        return y, ad.Zero.from_primal_value(y)
    return y, functools.reduce(jnp.add, out_tangents)


def _transpose(ct, *operands, block_size, backend, layout, has_bias, has_swizzled):
    a, packed, scale, global_scale, bias, swizzled = _split(operands, has_bias, has_swizzled)
    if ad.is_undefined_primal(packed) or ad.is_undefined_primal(scale):
        raise TypeError("jax_fp4: the quantized weight (packed codes, block scales) is not differentiable")
    if _is_zero(ct):
        ct = jnp.zeros(ct.aval.shape, ct.aval.dtype)
    ct_a = ct_gs = ct_bias = None
    if ad.is_undefined_primal(global_scale):
        # y is linear in gs: dL/dgs = sum(ct * y(gs=1)), with `a` a known primal here.
        unit = bind(a, packed, scale, jnp.float32(1), None, block_size=block_size, backend=backend,
                    swizzled_scale=swizzled, layout=layout)
        ct_gs = jnp.sum(ct.astype(jnp.float32) * unit.astype(jnp.float32))
    else:
        if ad.is_undefined_primal(a):
            w = _dense(packed, scale, global_scale, block_size, layout)
            # Under explicit mesh axes a column-parallel weight makes N, the contracted axis here,
            # sharded on both sides: dA must be typed like a (the sum over N's shards is implied).
            ct_a = jnp.matmul(ct.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST,
                              out_sharding=_explicit_axes.explicit_type(a.aval)).astype(a.aval.dtype)
        if has_bias and ad.is_undefined_primal(bias):
            ct_bias = jnp.sum(ct.astype(jnp.float32), axis=tuple(range(ct.ndim - 1))).astype(
                bias.aval.dtype)
            ct_bias = _explicit_axes.typed_like(ct_bias, bias.aval)
    result = [ct_a, None, None, ct_gs]
    return result + ([ct_bias] if has_bias else []) + ([None] if has_swizzled else [])


ad.primitive_jvps[nvfp4_matmul_p] = _jvp
ad.primitive_transposes[nvfp4_matmul_p] = _transpose
