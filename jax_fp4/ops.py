"""The `nvfp4_matmul` primitive and its public entry point.

`matmul` checks its arguments at trace time and binds the primitive; the primitive carries
abstract evaluation, batching, JVP and transpose here, and its per-platform lowering in
jax_fp4/lowering.py. Operands: a [..., K], packed uint8 [N, K/2], scale uint8 [N, ceil(K/bs)],
global_scale float32 [], then bias [N] when has_bias, the prepacked SM120 scales when
has_swizzled, norm_weight [K] when norm_eps is not None and residual [..., N_out] when
has_residual. Result: [..., N_out] in a's dtype (N_out = N / 2 with activation "silu_mul", else N).

A call with fusions (norm_eps, activation, has_residual) is one primitive too: its JVP is that of
the unfused composition (`unfused`: RMSNorm, the plain primitive, the epilogue), so no transpose
of a fused call is ever needed; batching is the plain one's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp4 import dispatch as _dispatch
from jax_fp4 import explicit_axes as _explicit_axes
from jax_fp4 import lowering as _lowering
from jax_fp4 import sharding as _sharding
from jax_fp4.config import KernelTuning
from jax_fp4.explicit_axes import axes_size, spec_axes, spec_entry
from jax_fp4.format import NVFP4Weight, kernel_scale, not_a_weight_error

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
    norm_weight=None,
    norm_eps: float | None = None,
    activation: str | None = None,
    residual=None,
):
    """Bind the primitive; `bias`, `swizzled_scale` (prepacked SM120 scales), `norm_weight` and
    `residual` may be None. Operands must already be validated; `tuning`, `norm_eps` (read only
    with a norm_weight) and `activation` are static (None: the kernels' heuristics, no norm, no
    activation)."""
    operands = (a, packed, scale, global_scale) + tuple(
        x for x in (bias, swizzled_scale, norm_weight, residual) if x is not None
    )
    return nvfp4_matmul_p.bind(
        *operands,
        block_size=block_size,
        backend=backend,
        layout=layout,
        has_bias=bias is not None,
        has_swizzled=swizzled_scale is not None,
        tuning=tuning,
        norm_eps=None if norm_weight is None else float(norm_eps),
        activation=activation,
        has_residual=residual is not None,
    )


def unfused(
    a,
    packed,
    scale,
    global_scale,
    bias,
    *,
    norm_weight=None,
    norm_eps=None,
    activation=None,
    residual=None,
    **weight,
):
    """A fused call as its composition: RMSNorm, the plain primitive, the epilogue (float32, one
    rounding; jax_fp4/lowering.py). `weight`: bind's static arguments of the product."""
    a_n = a if norm_weight is None else _lowering.rms_norm(a, norm_weight, norm_eps)
    y = bind(a_n, packed, scale, global_scale, bias, **weight)
    return _lowering.epilogue(y.astype(jnp.float32), activation, residual, a.dtype)


# ---- abstract evaluation ------------------------------------------------------------------------


def _abstract_eval(*operands, activation=None, **params):
    del params
    a, packed = operands[0], operands[1]
    n_out = packed.shape[0] // 2 if activation == "silu_mul" else packed.shape[0]
    shape = a.shape[:-1] + (n_out,)
    sharding = _sharding.result_sharding(a, packed)  # only under explicit mesh axes
    if sharding is None:
        return jax.core.ShapedArray(shape, a.dtype)
    if n_out != packed.shape[0]:
        # silu_mul halves N: keep N's axes only where they split the half evenly.
        spec = spec_axes(sharding, len(shape))
        if spec[-1] and n_out % axes_size(sharding.mesh, spec[-1]):
            sharding = NamedSharding(sharding.mesh, P(*(spec_entry(e) for e in spec[:-1]), None))
    return jax.core.ShapedArray(shape, a.dtype, sharding=sharding)


nvfp4_matmul_p.def_abstract_eval(_abstract_eval)


def def_compiled_impl(primitive) -> None:
    """Eager (un-jitted) calls of `primitive` compile it alone, like any jnp operation (one
    compiled program per set of static parameters, cached)."""
    jitted = functools.cache(lambda **params: jax.jit(functools.partial(primitive.bind, **params)))
    primitive.def_impl(lambda *operands, **params: jitted(**params)(*operands))


def_compiled_impl(nvfp4_matmul_p)
_sharding.register_primitive(nvfp4_matmul_p)  # the lowering needs the devices (partitioning)
_lowering.register(nvfp4_matmul_p)


# ---- batching -----------------------------------------------------------------------------------


def _batch(operands, dims, **params):
    # The activations and the residual (the last operand, when has_residual) share the leading
    # dims; every other operand belongs to the weight.
    row_operands = (0, len(operands) - 1) if params.get("has_residual") else (0,)
    weight_dims = [d for i, d in enumerate(dims) if i not in row_operands]
    if all(d is None for d in weight_dims):
        # vmap over activations (and residuals) only: the batch axis joins the leading (M) axes.
        size = next(operands[i].shape[dims[i]] for i in row_operands if dims[i] is not None)
        ops = list(operands)
        for i in row_operands:
            x, d = operands[i], dims[i]
            ops[i] = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        return nvfp4_matmul_p.bind(*ops, **params), 0
    # vmap over stacked weights (experts, layers) or biases: one matmul per weight, in a loop.
    return bind_per_batch_element(nvfp4_matmul_p, operands, dims, params)


def bind_per_batch_element(primitive, operands, dims, params):
    """vmap's rule where the batch cannot fold into M: `primitive` once per batch element, in a
    loop (lax.map) over the batched operands; the batch axis of the result is 0."""
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    batched = [jnp.moveaxis(x, d, 0) if d is not None else None for x, d in zip(operands, dims)]

    def one(sliced):
        ops = [s if b is not None else x for x, s, b in zip(operands, sliced, batched)]
        return primitive.bind(*ops, **params)

    xs = [b if b is not None else jnp.zeros((size,), jnp.int8) for b in batched]
    return jax.lax.map(one, xs), 0


batching.primitive_batchers[nvfp4_matmul_p] = _batch


# ---- autodiff -----------------------------------------------------------------------------------
# y = gs * (a @ D^T) + bias with D the block-scaled codes: linear in (a, bias) for a fixed global
# scale, and linear in the global scale for fixed a. The packed codes and block scales are integer
# data and have no tangent.


def is_zero(t):
    """Whether a tangent or cotangent is JAX's symbolic zero."""
    return type(t) is ad.Zero


def composition_jvp(y, composition, primal_in, tangent_in):
    """(y, the tangent of composition(*primal_in)) for a fused primitive's value y and its unfused
    composition, differentiated in the operands that move only: a None or zero tangent keeps its
    operand a constant (so that, e.g., a fixed global scale costs no product)."""
    moving = [i for i, t in enumerate(tangent_in) if t is not None and not is_zero(t)]
    if not moving:
        return y, ad.Zero.from_primal_value(y)

    def of_moving(*moved):
        x = list(primal_in)
        for i, value in zip(moving, moved):
            x[i] = value
        return composition(*x)

    _, dy = jax.jvp(of_moving, [primal_in[i] for i in moving], [tangent_in[i] for i in moving])
    return y, _explicit_axes.typed_like(dy, jax.typeof(y))


def _fused_jvp(primals, tangents, *, norm_eps, activation, has_residual, **params):
    """The JVP of a fused call: the fused primitive's value, and the tangent of its unfused
    composition (differentiable in a, the global scale, bias, norm_weight and residual)."""
    has_bias, has_swizzled = params["has_bias"], params["has_swizzled"]
    split = functools.partial(
        _lowering.split_fused_operands,
        has_bias=has_bias,
        has_swizzled=has_swizzled,
        has_norm=norm_eps is not None,
        has_residual=has_residual,
    )
    a, packed, scale, global_scale, bias, swizzled, norm_weight, residual = split(primals)
    da, _, _, dgs, dbias, _, dnorm, dres = split(tangents)
    y = nvfp4_matmul_p.bind(
        *primals, norm_eps=norm_eps, activation=activation, has_residual=has_residual, **params
    )
    weight = dict(
        block_size=params["block_size"],
        backend=params["backend"],
        swizzled_scale=swizzled,
        layout=params["layout"],
        tuning=params.get("tuning"),
    )

    def composition(a, global_scale, bias, norm_weight, residual):
        return unfused(
            a,
            packed,
            scale,
            global_scale,
            bias,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            activation=activation,
            residual=residual,
            **weight,
        )

    return composition_jvp(
        y,
        composition,
        (a, global_scale, bias, norm_weight, residual),
        (da, dgs, dbias, dnorm, dres),
    )


def _jvp(
    primals,
    tangents,
    *,
    block_size,
    backend,
    layout,
    has_bias,
    has_swizzled,
    tuning=None,
    norm_eps=None,
    activation=None,
    has_residual=False,
):
    if norm_eps is not None or activation is not None or has_residual:
        return _fused_jvp(
            primals,
            tangents,
            norm_eps=norm_eps,
            activation=activation,
            has_residual=has_residual,
            block_size=block_size,
            backend=backend,
            layout=layout,
            has_bias=has_bias,
            has_swizzled=has_swizzled,
            tuning=tuning,
        )
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
    dbias = None if dbias is None or is_zero(dbias) else dbias
    if not is_zero(da):
        out_tangents.append(bind(da, packed, scale, global_scale, dbias, **weight))
    elif dbias is not None:  # only the bias moves: no matmul needed
        out_tangents.append(
            _explicit_axes.typed_like(jnp.broadcast_to(dbias, y.shape), jax.typeof(y))
        )
    if not is_zero(dgs):
        out_tangents.append(bind(a, packed, scale, dgs, None, **weight))
    if not out_tangents:
        return y, ad.Zero.from_primal_value(y)
    return y, functools.reduce(jnp.add, out_tangents)


def _transpose(
    ct,
    *operands,
    block_size,
    backend,
    layout,
    has_bias,
    has_swizzled,
    tuning=None,
    norm_eps=None,
    activation=None,
    has_residual=False,
):
    if norm_eps is not None or activation is not None or has_residual:
        # Fused calls differentiate through their composition (_fused_jvp), whose linear part
        # holds plain calls only.
        raise NotImplementedError("jax_fp4: a fused matmul call is never linear in its operands")
    a, packed, scale, global_scale, bias, swizzled = _lowering.split_operands(
        operands, has_bias, has_swizzled
    )
    if ad.is_undefined_primal(packed) or ad.is_undefined_primal(scale):
        raise TypeError(
            "jax_fp4: the quantized weight (packed codes, block scales) is not differentiable"
        )
    if is_zero(ct):
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
        raise not_a_weight_error("matmul", w)
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


def check_bias(bias, expected: tuple[int, ...], dtype, *, op: str = "matmul", axes=("N",)):
    """bias (None, or a float array of shape `expected`, whose axes are named `axes`) in dtype;
    a clear error naming `op` otherwise."""
    if bias is None:
        return None
    if not hasattr(bias, "dtype"):
        bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"{op}: bias must be a float array [{', '.join(axes)}], got {bias.dtype}")
    if tuple(bias.shape) != tuple(expected):
        named = f"({', '.join(axes)}{',' if len(axes) == 1 else ''})"
        raise ValueError(
            f"{op}: bias must have shape {named} = {tuple(expected)}, got {tuple(bias.shape)}"
        )
    return bias.astype(dtype)


def check_activation_name(activation, w: NVFP4Weight, *, op: str = "matmul"):
    """`activation` checked against w (None or one of ACTIVATIONS; silu_mul needs an even N)."""
    if activation is None:
        return None
    if not isinstance(activation, str) or activation not in _lowering.ACTIVATIONS:
        raise ValueError(
            f"{op}: activation must be one of {_lowering.ACTIVATIONS} or None, got {activation!r}"
        )
    if w.n % 2:
        raise ValueError(
            f"{op}: activation='silu_mul' needs a fused gate/up weight [2 I, K] (rows [:I] the "
            f"gate, [I:] the up projection), so an even N; got w.shape = {w.shape}"
        )
    return activation


def _check_norm(norm_weight, norm_eps, w: NVFP4Weight):
    """(norm_weight or None, norm_eps as a float)."""
    if norm_weight is None:
        return None, None
    if not hasattr(norm_weight, "dtype"):
        norm_weight = jnp.asarray(norm_weight)
    if not jnp.issubdtype(norm_weight.dtype, jnp.floating):
        raise TypeError(
            f"matmul: norm_weight must be a float array [K], got dtype {norm_weight.dtype}"
        )
    if norm_weight.shape != (w.k,):
        raise ValueError(
            f"matmul: norm_weight must have shape (K,) = ({w.k},), got {tuple(norm_weight.shape)}"
        )
    if isinstance(norm_eps, jax.core.Tracer) or not isinstance(
        norm_eps, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"matmul: norm_eps must be a Python float (static), got {type(norm_eps).__name__}"
        )
    norm_eps = float(norm_eps)
    if not (np.isfinite(norm_eps) and norm_eps >= 0):
        raise ValueError(f"matmul: norm_eps must be finite and >= 0, got {norm_eps}")
    return norm_weight, norm_eps


def _check_residual(residual, a, n_out: int):
    if residual is None:
        return None
    if not hasattr(residual, "dtype"):
        residual = jnp.asarray(residual)
    want = tuple(a.shape[:-1]) + (n_out,)
    if tuple(residual.shape) != want:
        raise ValueError(
            f"matmul: residual must have the result's shape a.shape[:-1] + (N_out,) = {want}, "
            f"got {tuple(residual.shape)}"
        )
    if residual.dtype != a.dtype:
        raise TypeError(
            f"matmul: residual must have a's dtype {a.dtype}, got {residual.dtype} (cast it: the "
            "sum is rounded once, to a's dtype)"
        )
    return residual


def resolve_backend(backend, backends=_dispatch.BACKENDS, *, op: str = "matmul") -> str:
    """backend (None: "auto") if it is one of `backends`; a clear error naming `op` otherwise."""
    backend = "auto" if backend is None else backend
    if not isinstance(backend, str) or backend not in backends:
        raise ValueError(f"{op}: backend must be one of {backends} or None, got {backend!r}")
    return backend


def check_tuning(tuning, *, op: str = "matmul") -> KernelTuning | None:
    if tuning is not None and not isinstance(tuning, KernelTuning):
        raise TypeError(
            f"{op}: tuning must be a jax_fp4.KernelTuning or None, got {type(tuning).__name__}"
        )
    return tuning


def matmul(
    a,
    w: NVFP4Weight,
    bias=None,
    *,
    norm_weight=None,
    norm_eps: float = 1e-6,
    activation: str | None = None,
    residual=None,
    backend: str | None = None,
    tuning: KernelTuning | None = None,
):
    """Y = A @ dequant(W)^T (+ bias), with a decoder layer's fusions around it.

    Args:
      a: activations [..., K], float16 or bfloat16 (float32 on paths that serve it: cpu, reference).
      w: an NVFP4Weight of logical shape [N, K].
      bias: optional [N], cast to a's dtype.
      norm_weight: optional [K] (any float dtype): an RMSNorm of each row of `a` first,
        a_n = (a32 * rsqrt(mean(a32 ** 2, -1) + norm_eps) * norm_weight32).astype(a.dtype) with
        a32 = a in float32; the product is a_n @ dequant(W)^T.
      norm_eps: the RMSNorm's epsilon (a static Python float, >= 0).
      activation: None, or "silu_mul": w is a fused gate/up weight [2 I, K] (rows [:I] the gate,
        [I:] the up projection, e.g. jax_fp4.checkpoint.fuse([gate, up])), bias (if any) [2 I],
        and the result [..., I] = silu(g) * u of the float32 products g, u (+ bias).
      residual: optional [..., N_out] (the result's shape) in a's dtype, added last.
      backend: None/"auto" picks a path from static shapes; one of BACKENDS ("reference", "xla",
        "cpu", "gemv", "dequant", "fused", "native") forces one, and raises ValueError if it
        cannot serve these shapes or this platform.
      tuning: a jax_fp4.KernelTuning fixing kernel choices (tile sizes, split-K, launch mode) in
        place of the kernels' heuristics, for measurements; None (the default) leaves them be.
        Paths without those choices ignore it.

    The fusions follow the unfused composition in float32 with one rounding at the end (to
    a's dtype). The CUDA decode GEMV, and the fused Hopper GEMM up to M = 64, run silu_mul and
    the residual in their kernels; the other paths compose them around their product
    (jax_fp4/lowering.py). Differentiable in a, bias, the global scale,
    norm_weight and residual.

    Returns:
      [..., N_out] in a's dtype: N_out = I with activation "silu_mul", else N.
    """
    _check_weight(w)
    a = _check_activation(a, w)
    activation = check_activation_name(activation, w)
    bias = check_bias(bias, (w.n,), a.dtype)
    norm_weight, norm_eps = _check_norm(norm_weight, norm_eps, w)
    residual = _check_residual(residual, a, w.n // 2 if activation == "silu_mul" else w.n)
    backend = resolve_backend(backend)
    tuning = check_tuning(tuning)
    _dispatch.check_backend(
        backend, _lowering.problem_of(a.shape, a.dtype, w.packed.shape, w.block_size, w.layout)
    )
    return bind(
        a,
        w.packed,
        kernel_scale(w.scale),
        jnp.asarray(w.global_scale, jnp.float32),
        bias,
        block_size=w.block_size,
        backend=backend,
        swizzled_scale=getattr(w, "swizzled_scale", None),  # prepack(target="sm120")
        layout=w.layout,
        tuning=tuning,
        norm_weight=norm_weight,
        norm_eps=norm_eps,
        activation=activation,
        residual=residual,
    )


def default_device():
    """The device jax computes on by default: `jax.default_device`'s where one is set (a device
    or a platform name), else the default backend's first device."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def _platform_name(platform: str | None) -> str:
    if platform is None:
        platform = default_device().platform
    return {"gpu": "cuda"}.get(platform, platform)


def dispatch_reasons(a, w: NVFP4Weight, *, platform: str | None = None) -> dict[str, str]:
    """Why `matmul(a, w)` (backend "auto") does not take each other path of `platform` (as in
    `dispatch_path`): {path: reason}, e.g. {'gemv': 'K must be a multiple of 32, got 11000'} for
    a weight whose K the GEMV's 32-wide loads cannot cover, or that the path could serve and loses
    on the measured crossovers."""
    from jax_fp4 import explain as _explain

    _check_weight(w)
    a = _check_activation(a, w)
    problem = _lowering.problem_of(a.shape, a.dtype, w.packed.shape, w.block_size, w.layout)
    return _explain.not_taken(problem, _lowering.target_for(_platform_name(platform)))


def dispatch_path(
    a, w: NVFP4Weight, *, backend: str | None = None, platform: str | None = None
) -> str:
    """The path `matmul(a, w, backend=backend)` takes when lowered for `platform` (default: the
    default device's platform, `jax.default_device` honoured). `a` may be an array or a
    jax.ShapeDtypeStruct. `dispatch_reasons(a, w)` says why the other paths were not taken."""
    _check_weight(w)
    a = _check_activation(a, w)
    platform = _platform_name(platform)
    return _lowering.path_for(
        platform,
        a.shape,
        a.dtype,
        w.packed.shape,
        w.block_size,
        resolve_backend(backend),
        w.layout,
    )
