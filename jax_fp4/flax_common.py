"""What the Flax front-ends (`jax_fp4.nnx`, `jax_fp4.linen`) share; free of flax imports."""

from __future__ import annotations

import jax.numpy as jnp

from jax_fp4.quantization import quantize


def quantize_kernel(kernel, block_size, method="modelopt", importance=None):
    """A Flax kernel [..., in, out] -> NVFP4Weight [..., out, in] = [N, K] (see jax_fp4.quantize).
    Not jitted itself (quantize compiles its work), so quantize sees a concrete kernel's values
    and can reject NaN or inf in it. Its errors say which matrix their indices refer to, in the
    message itself so that the converters' own wrapping (layer names) keeps it."""
    try:
        return quantize(
            jnp.swapaxes(kernel, -1, -2),
            block_size=block_size,
            method=method,
            importance=importance,
        )
    except ValueError as e:
        raise ValueError(
            f"{e} (quantize's w is the Flax kernel transposed: [..., out, in])"
        ) from None


def compute_dtype(inputs, dtype, param_dtype, bias):
    """The dtype a layer computes in, as Flax's Linear/Dense (promote_dtype): `dtype` if given,
    else the inputs' dtype promoted with the parameters'."""
    if dtype is not None:
        return jnp.dtype(dtype)
    dtypes = [inputs.dtype, param_dtype] + ([bias.dtype] if bias is not None else [])
    return jnp.result_type(*dtypes)


def input_square_sums(inputs):
    """Per-channel sum of the squared inputs [..., in] and the number of rows they span: what the
    calibration of either front-end accumulates for each layer."""
    x = jnp.asarray(inputs, jnp.float32).reshape(-1, inputs.shape[-1])
    return jnp.sum(x * x, axis=0), x.shape[0]


def check_calibration_method(caller: str, method: str, calibration) -> None:
    if calibration is not None and method != "mse":
        raise ValueError(
            f"{caller}: calibration is used by method='mse' only, got method={method!r}"
        )


def layer_importance(calibration, module_path: tuple):
    """A layer's calibration statistics (None without calibration); a missing layer is an error."""
    if calibration is None:
        return None
    importance = calibration.get(tuple(module_path))
    if importance is None:
        raise ValueError(
            "calibration has no statistics for it (was it called while calibrating?); "
            "skip it with a filter"
        )
    return importance
