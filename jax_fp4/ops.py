"""The `nvfp4_matmul` primitive and its public entry point.

`matmul` checks its arguments at trace time and binds the primitive; the primitive carries
abstract evaluation, batching, JVP and transpose here, and its per-platform lowering in
jax_fp4/lowering.py. Operands: a [..., K], packed uint8 [N, K/2], scale uint8 [N, ceil(K/bs)],
global_scale float32 [], then bias [N] when has_bias and the prepacked SM120 scales when
has_swizzled. Result: [..., N] in a's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from jax_fp4 import dispatch as _dispatch
from jax_fp4 import explicit_axes as _explicit_axes
from jax_fp4 import lowering as _lowering
from jax_fp4 import sharding as _sharding
from jax_fp4.config import KernelTuning
from jax_fp4.format import NVFP4Weight, scale_as_bytes

nvfp4_matmul_p = Primitive("nvfp4_matmul")


def bind(
    a,
    packed,
    scale,
    global_scale,
    bias,
    *,
    block_size: int,
    backend: str,
    swizzled_scale=None,
    layout: str = "spec",
    tuning: KernelTuning | None = None,
):
    """Bind the primitive; `bias` and `swizzled_scale` (prepacked SM120 scales) may be None.
    Operands must already be validated; `tuning` is static (None: the kernels' heuristics)."""
    operands = (a, packed, scale, global_scale) + tuple(
        x for x in (bias, swizzled_scale) if x is not None
    )
    return nvfp4_matmul_p.bind(
        *operands,
        block_size=block_size,
        backend=backend,
        layout=layout,
        has_bias=bias is not None,
        has_swizzled=swizzled_scale is not None,
        tuning=tuning,
    )


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


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(nvfp4_matmul_p.bind, **params))


# Eager (un-jitted) calls compile the primitive alone, like any jnp operation.
nvfp4_matmul_p.def_impl(lambda *operands, **params: _jitted_bind(**params)(*operands))
_sharding.register_primitive(nvfp4_matmul_p)  # the lowering needs the devices (partitioning)
_lowering.register(nvfp4_matmul_p)


# ---- batching -----------------------------------------------------------------------------------


def _batch(operands, dims, **params):
    a_dim, weight_dims = dims[0], dims[1:]
    if all(d is None for d in weight_dims):
        # vmap over activations only: the batch axis joins the leading (M) axes.
        a = jnp.moveaxis(operands[0], a_dim, 0)
        return nvfp4_matmul_p.bind(a, *operands[1:], **params), 0
    # vmap over stacked weights (experts, layers) or biases: one matmul per weight, in a loop.
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    batched = [jnp.moveaxis(x, d, 0) if d is not None else None for x, d in zip(operands, dims)]

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


def _jvp(primals, tangents, *, block_size, backend, layout, has_bias, has_swizzled, tuning=None):
    a, packed, scale, global_scale, bias, swizzled = _lowering.split_operands(
        primals, has_bias, has_swizzled
    )
    da, _, _, dgs, dbias, _ = _lowering.split_operands(tangents, has_bias, has_swizzled)
    weight = dict(
        block_size=block_size,
        backend=backend,
        swizzled_scale=swizzled,
        layout=layout,
        tuning=tuning,
    )
    y = bind(a, packed, scale, global_scale, bias, **weight)
    out_tangents = []
    dbias = None if dbias is None or _is_zero(dbias) else dbias
    if not _is_zero(da):
        out_tangents.append(bind(da, packed, scale, global_scale, dbias, **weight))
    elif dbias is not None:  # only the bias moves: no matmul needed
        out_tangents.append(
            _explicit_axes.typed_like(jnp.broadcast_to(dbias, y.shape), jax.typeof(y))
        )
    if not _is_zero(dgs):
        out_tangents.append(bind(a, packed, scale, dgs, None, **weight))
    if not out_tangents:
        return y, ad.Zero.from_primal_value(y)
    return y, functools.reduce(jnp.add, out_tangents)


def _transpose(ct, *operands, block_size, backend, layout, has_bias, has_swizzled, tuning=None):
    a, packed, scale, global_scale, bias, swizzled = _lowering.split_operands(
        operands, has_bias, has_swizzled
    )
    if ad.is_undefined_primal(packed) or ad.is_undefined_primal(scale):
        raise TypeError(
            "jax_fp4: the quantized weight (packed codes, block scales) is not differentiable"
        )
    if _is_zero(ct):
        ct = jnp.zeros(ct.aval.shape, ct.aval.dtype)
    ct_a = ct_gs = ct_bias = None
    if ad.is_undefined_primal(global_scale):
        # y is linear in gs: dL/dgs = sum(ct * y(gs=1)), with `a` a known primal here.
        unit = bind(
            a,
            packed,
            scale,
            jnp.float32(1),
            None,
            block_size=block_size,
            backend=backend,
            swizzled_scale=swizzled,
            layout=layout,
            tuning=tuning,
        )
        ct_gs = jnp.sum(ct.astype(jnp.float32) * unit.astype(jnp.float32))
    else:
        if ad.is_undefined_primal(a):
            w = _lowering.dense(packed, scale, global_scale, block_size, layout)
            # Under explicit mesh axes a column-parallel weight makes N, the contracted axis here,
            # sharded on both sides: dA must be typed like a (the sum over N's shards is implied).
            ct_a = jnp.matmul(
                ct.astype(jnp.float32),
                w,
                precision=jax.lax.Precision.HIGHEST,
                out_sharding=_explicit_axes.explicit_type(a.aval),
            ).astype(a.aval.dtype)
        if has_bias and ad.is_undefined_primal(bias):
            ct_bias = jnp.sum(ct.astype(jnp.float32), axis=tuple(range(ct.ndim - 1))).astype(
                bias.aval.dtype
            )
            ct_bias = _explicit_axes.typed_like(ct_bias, bias.aval)
    result = [ct_a, None, None, ct_gs]
    return result + ([ct_bias] if has_bias else []) + ([None] if has_swizzled else [])


ad.primitive_jvps[nvfp4_matmul_p] = _jvp
ad.primitive_transposes[nvfp4_matmul_p] = _transpose


# ---- the public entry point ---------------------------------------------------------------------

_ACTIVATION_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"), np.dtype("float32"))


def _check_weight(w) -> None:
    if not isinstance(w, NVFP4Weight):
        raise TypeError(f"matmul: w must be an NVFP4Weight, got {type(w).__name__}")
    if w.packed.ndim != 2:
        raise ValueError(
            f"matmul: w must be a single [N, K] weight, got stacked shape {w.shape}; "
            "use jax.vmap or lax.scan over stacked weights"
        )


def _check_activation(a, w: NVFP4Weight):
    if not hasattr(a, "dtype"):
        a = jnp.asarray(a)
    if np.dtype(a.dtype) not in _ACTIVATION_DTYPES:
        raise TypeError(f"matmul: a must be float16, bfloat16 or float32, got dtype {a.dtype}")
    if a.ndim < 1:
        raise ValueError(f"matmul: a must be [..., K] (rank >= 1), got a scalar of shape {a.shape}")
    if a.shape[-1] != w.k:
        raise ValueError(
            f"matmul: a's last axis must equal the weight's K = {w.k} (w.shape = {w.shape}), "
            f"got a.shape = {tuple(a.shape)}"
        )
    return a


def _check_bias(bias, w: NVFP4Weight, dtype):
    if bias is None:
        return None
    if not hasattr(bias, "dtype"):
        bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"matmul: bias must be a float array [N], got dtype {bias.dtype}")
    if bias.shape != (w.n,):
        raise ValueError(f"matmul: bias must have shape (N,) = ({w.n},), got {tuple(bias.shape)}")
    return bias.astype(dtype)


def _resolve_backend(backend) -> str:
    backend = "auto" if backend is None else backend
    if not isinstance(backend, str) or backend not in _dispatch.BACKENDS:
        raise ValueError(
            f"matmul: backend must be one of {_dispatch.BACKENDS} or None, got {backend!r}"
        )
    return backend


def _check_tuning(tuning) -> KernelTuning | None:
    if tuning is not None and not isinstance(tuning, KernelTuning):
        raise TypeError(
            f"matmul: tuning must be a jax_fp4.KernelTuning or None, got {type(tuning).__name__}"
        )
    return tuning


def matmul(
    a, w: NVFP4Weight, bias=None, *, backend: str | None = None, tuning: KernelTuning | None = None
):
    """Y = A @ dequant(W)^T (+ bias).

    Args:
      a: activations [..., K], float16 or bfloat16 (float32 on paths that serve it: cpu, reference).
      w: an NVFP4Weight of logical shape [N, K].
      bias: optional [N], cast to a's dtype.
      backend: None/"auto" picks a path from static shapes; one of BACKENDS ("reference", "xla",
        "cpu", "gemv", "dequant", "fused", "native") forces one, and raises ValueError if it
        cannot serve these shapes or this platform.
      tuning: a jax_fp4.KernelTuning fixing kernel choices (tile sizes, split-K, launch mode) in
        place of the kernels' heuristics, for measurements; None (the default) leaves them be.
        Paths without those choices ignore it.

    Returns:
      [..., N] in a's dtype.
    """
    _check_weight(w)
    a = _check_activation(a, w)
    bias = _check_bias(bias, w, a.dtype)
    backend = _resolve_backend(backend)
    tuning = _check_tuning(tuning)
    _dispatch.check_backend(
        backend, _lowering.problem_of(a.shape, a.dtype, w.packed.shape, w.block_size, w.layout)
    )
    return bind(
        a,
        w.packed,
        scale_as_bytes(w.scale),
        jnp.asarray(w.global_scale, jnp.float32),
        bias,
        block_size=w.block_size,
        backend=backend,
        swizzled_scale=getattr(w, "swizzled_scale", None),  # prepack(target="sm120")
        layout=w.layout,
        tuning=tuning,
    )


def default_device():
    """The device jax computes on by default: `jax.default_device`'s where one is set (a device
    or a platform name), else the default backend's first device."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def dispatch_path(
    a, w: NVFP4Weight, *, backend: str | None = None, platform: str | None = None
) -> str:
    """The path `matmul(a, w, backend=backend)` takes when lowered for `platform` (default: the
    default device's platform, `jax.default_device` honoured). `a` may be an array or a
    jax.ShapeDtypeStruct."""
    _check_weight(w)
    a = _check_activation(a, w)
    if platform is None:
        platform = default_device().platform
    platform = {"gpu": "cuda"}.get(platform, platform)
    return _lowering.path_for(
        platform,
        a.shape,
        a.dtype,
        w.packed.shape,
        w.block_size,
        _resolve_backend(backend),
        w.layout,
    )
