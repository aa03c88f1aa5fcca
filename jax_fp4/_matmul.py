"""The public `matmul` entry point: argument checks at trace time, then the primitive."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4 import _dispatch, _primitive
from jax_fp4._format import NVFP4Weight, scale_as_bytes

_ACTIVATION_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"), np.dtype("float32"))


def _check_weight(w) -> None:
    if not isinstance(w, NVFP4Weight):
        raise TypeError(f"matmul: w must be an NVFP4Weight, got {type(w).__name__}")
    if w.packed.ndim != 2:
        raise ValueError(
            f"matmul: w must be a single [N, K] weight, got stacked shape {w.shape}; "
            "use jax.vmap or lax.scan over stacked weights")


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
            f"got a.shape = {tuple(a.shape)}")
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
        raise ValueError(f"matmul: backend must be one of {_dispatch.BACKENDS} or None, got {backend!r}")
    return backend


def matmul(a, w: NVFP4Weight, bias=None, *, backend: str | None = None):
    """Y = A @ dequant(W)^T (+ bias).

    Args:
      a: activations [..., K], float16 or bfloat16 (float32 on paths that serve it: cpu, reference).
      w: an NVFP4Weight of logical shape [N, K].
      bias: optional [N], cast to a's dtype.
      backend: None/"auto" picks a path from static shapes; one of BACKENDS ("reference", "xla",
        "cpu", "gemv", "dequant", "fused", "native") forces one, and raises ValueError if it
        cannot serve these shapes or this platform.

    Returns:
      [..., N] in a's dtype.
    """
    _check_weight(w)
    a = _check_activation(a, w)
    bias = _check_bias(bias, w, a.dtype)
    backend = _resolve_backend(backend)
    _dispatch.check_backend(backend, _primitive.problem_of(a.shape, a.dtype, w.packed.shape, w.block_size,
                                                           w.layout))
    return _primitive.bind(a, w.packed, scale_as_bytes(w.scale), jnp.asarray(w.global_scale, jnp.float32),
                           bias, block_size=w.block_size, backend=backend,
                           swizzled_scale=getattr(w, "swizzled_scale", None),  # prepack(target="sm120")
                           layout=w.layout)


def default_device():
    """The device jax computes on by default: `jax.default_device`'s where one is set (a device
    or a platform name), else the default backend's first device."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def dispatch_path(a, w: NVFP4Weight, *, backend: str | None = None, platform: str | None = None) -> str:
    """The path `matmul(a, w, backend=backend)` takes when lowered for `platform` (default: the
    default device's platform, `jax.default_device` honoured). `a` may be an array or a
    jax.ShapeDtypeStruct."""
    _check_weight(w)
    a = _check_activation(a, w)
    if platform is None:
        platform = default_device().platform
    platform = {"gpu": "cuda"}.get(platform, platform)
    return _primitive.path_for(platform, a.shape, a.dtype, w.packed.shape, w.block_size,
                               _resolve_backend(backend), w.layout)
