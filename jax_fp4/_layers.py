"""What the Flax front-ends (`jax_fp4.nnx`, `jax_fp4.linen`) share; free of flax imports."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_fp4._format import quantize


@functools.partial(jax.jit, static_argnames=("block_size", "method"))
def quantize_kernel(kernel, block_size, method="modelopt", importance=None):
    """A Flax kernel [..., in, out] -> NVFP4Weight [..., out, in] = [N, K] (see jax_fp4.quantize)."""
    return quantize(jnp.swapaxes(kernel, -1, -2), block_size=block_size, method=method,
                    importance=importance)


def compute_dtype(inputs, dtype, param_dtype, bias):
    """The dtype a layer computes in, as Flax's Linear/Dense (promote_dtype): `dtype` if given,
    else the inputs' dtype promoted with the parameters'."""
    if dtype is not None:
        return jnp.dtype(dtype)
    dtypes = [inputs.dtype, param_dtype] + ([bias.dtype] if bias is not None else [])
    return jnp.result_type(*dtypes)
