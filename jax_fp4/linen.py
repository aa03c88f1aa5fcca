"""Flax Linen layers with NVFP4 weights (needs the optional extra ``flax``).

    from jax_fp4 import linen as fp4nn
    layer = fp4nn.FP4Dense(features=256)                 # drop-in for nn.Dense(features=256)
    params = fp4nn.quantize_params(float_params)         # nn.Dense params -> FP4Dense params
    stats = fp4nn.calibrate(model, float_params, batch)  # or: calibrated block scales
    params = fp4nn.quantize_params(float_params, method="mse", calibration=stats)
    params = fp4nn.prepack_params(params)                # decode GEMV layout; FP4Dense(layout="tiled")

`FP4Dense`'s params are the NVFP4 tensors in the [out, in] layout, ``packed`` uint8 [N, K/2],
``scale`` float8_e4m3fn [N, ceil(K/16)], ``global_scale`` float32 [], plus ``bias`` [N] as in
nn.Dense. Partitioning metadata follows nn.Dense's idiom: a `kernel_init` wrapped in
``nn.with_partitioning(init, (in_axis, out_axis))`` (or ``nn.with_logical_partitioning``) boxes
``packed`` and ``scale`` with ``(out_axis, in_axis)`` (and ``global_scale`` with the leading,
stacked axes only); `quantize_params` does the same for boxed nn.Dense params. So
``(None, "model")`` is column-parallel (packed, scale and, with a partitioned bias_init, bias
sharded along N) and ``("model", None)`` row-parallel (packed and scale sharded along K).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jax_fp4.extras import missing_extra
from jax_fp4.flax_common import (
    check_calibration_method,
    compute_dtype,
    input_square_sums,
    layer_importance,
    quantize_kernel,
)

try:
    from flax import linen as nn
    from flax.core import meta
    from flax.core.frozen_dict import FrozenDict
except ModuleNotFoundError as err:
    if err.name != "flax":
        raise
    raise missing_extra("flax", "flax", "jax_fp4.linen") from err

from jax_fp4.format import NVFP4Weight
from jax_fp4.ops import matmul
from jax_fp4.prepacking import prepack

__all__ = ["FP4Dense", "calibrate", "params_from_weight", "quantize_params", "weight_from_params"]

default_kernel_init = nn.initializers.lecun_normal()

_FP4_KEYS = ("packed", "scale", "global_scale")


def _quantize_boxed(
    kernel, block_size: int, where: str, method: str = "modelopt", importance=None
) -> dict[str, Any]:
    """A (possibly nn.Partitioned-boxed) kernel [..., in, out] -> packed / scale / global_scale,
    boxed the same way with the axis names moved to the [..., out, in] layout."""
    box = kernel if isinstance(kernel, meta.AxisMetadata) else None
    if box is not None and not isinstance(box, meta.Partitioned):
        raise TypeError(
            f"{where}: cannot carry kernel metadata of type {type(box).__name__} over to "
            "the NVFP4 arrays (supported: nn.Partitioned, nn.LogicallyPartitioned)"
        )
    value = jnp.asarray(kernel.value if box is not None else kernel)
    if value.ndim < 2:
        raise ValueError(f"{where}: kernel must be [..., in, out], got shape {tuple(value.shape)}")
    if value.shape[-2] % 2:
        raise ValueError(
            f"{where}: the kernel's in-features (K) must be even to pack two E2M1 codes "
            f"per byte, got kernel shape {tuple(value.shape)}"
        )
    try:
        w = quantize_kernel(value, block_size, method, importance)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    arrays = dict(zip(_FP4_KEYS, (w.packed, w.scale, w.global_scale)))
    if box is None:
        return arrays
    names = tuple(box.names) + (None,) * (value.ndim - len(box.names))
    *lead, ax_in, ax_out = names
    matrix_names = (*lead, ax_out, ax_in)
    return {
        "packed": box.replace(value=arrays["packed"], names=matrix_names),
        "scale": box.replace(value=arrays["scale"], names=matrix_names),
        "global_scale": box.replace(value=arrays["global_scale"], names=tuple(lead)),
    }


def _unboxed(x):
    return x.unbox() if isinstance(x, meta.AxisMetadata) else x


class FP4Dense(nn.Module):
    """A linear layer over the last axis with an NVFP4 weight: ``y = x @ W^T + b``.

    Drop-in for `flax.linen.Dense` (same attributes plus `block_size` and `backend`). At init it
    draws a float kernel [in, out] with `kernel_init` and quantizes it with ModelOpt's algorithm;
    `quantize_params` converts trained nn.Dense params instead.

    Attributes:
      features: N, the number of output features.
      use_bias: whether to add a bias (param ``bias`` [N] of `param_dtype`).
      dtype: the computation dtype (inputs are cast to it; the output has it). None promotes the
        inputs' dtype with `param_dtype`, as nn.Dense does. Must be float16, bfloat16 or float32.
      param_dtype: dtype of the bias and of the float kernel drawn before quantization.
      kernel_init: initializer of the float kernel [in, out]; wrap it in nn.with_partitioning /
        nn.with_logical_partitioning to shard the NVFP4 arrays (see the module docstring).
      bias_init: initializer of the bias.
      block_size: elements per E4M3 block scale (16 for NVFP4).
      layout: "spec", or "tiled" for params holding the decode GEMV's layout (`prepack_params`).
      backend: the jax_fp4.matmul backend (None: pick from shapes and platform).
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = default_kernel_init
    bias_init: Callable = nn.initializers.zeros_init()
    block_size: int = 16
    layout: str = "spec"  # "tiled": params hold jax_fp4.prepack's layout (prepack_params)
    backend: str | None = None

    @nn.compact
    def __call__(self, inputs):
        """[..., K] -> [..., features]."""
        inputs = jnp.asarray(inputs)
        if inputs.ndim < 1:
            raise ValueError(
                f"FP4Dense: inputs must be [..., K], got a scalar of shape {inputs.shape}"
            )
        k, n = inputs.shape[-1], self.features
        # One float kernel feeds all three NVFP4 params, so they are drawn from one key. Outside init
        # the initializer only runs abstractly (flax's shape check), so any key does.
        key = (
            self.make_rng("params")
            if self.is_initializing() and not self.has_variable("params", "packed")
            else jax.random.key(0)
        )

        def init(name):
            def fn(_rng, key):
                kernel = self.kernel_init(key, (k, n), self.param_dtype)
                return _quantize_boxed(kernel, self.block_size, "FP4Dense")[name]

            return fn

        packed = self.param("packed", init("packed"), key)
        scale = self.param("scale", init("scale"), key)
        global_scale = self.param("global_scale", init("global_scale"), key)
        bias = self.param("bias", self.bias_init, (n,), self.param_dtype) if self.use_bias else None
        weight = NVFP4Weight(
            packed, scale, global_scale, block_size=self.block_size, layout=self.layout
        )
        if weight.shape != (n, k):
            raise ValueError(
                f"FP4Dense: params hold a weight [N, K] = {weight.shape}, expected "
                f"{(n, k)} for features={n} and inputs of shape {tuple(inputs.shape)}"
            )
        dtype = compute_dtype(inputs, self.dtype, self.param_dtype, bias)
        return matmul(inputs.astype(dtype), weight, bias, backend=self.backend)


def params_from_weight(weight: NVFP4Weight, bias=None) -> dict[str, Any]:
    """FP4Dense params ``{packed, scale, global_scale[, bias]}`` holding `weight` (an NVFP4Weight
    [N, K], e.g. from jax_fp4.checkpoint) and an optional bias [N]."""
    if not isinstance(weight, NVFP4Weight):
        raise TypeError(
            f"params_from_weight: weight must be an NVFP4Weight, got {type(weight).__name__}"
        )
    params = {
        "packed": jnp.asarray(weight.packed),
        "scale": jnp.asarray(weight.scale),
        "global_scale": jnp.asarray(weight.global_scale, jnp.float32),
    }
    if bias is not None:
        bias = jnp.asarray(bias)
        if tuple(bias.shape) != weight.shape[:-1]:
            raise ValueError(
                f"params_from_weight: bias must have shape {weight.shape[:-1]} for a weight "
                f"[N, K] = {weight.shape}, got {tuple(bias.shape)}"
            )
        params["bias"] = bias
    return params


def weight_from_params(
    params: Mapping[str, Any], block_size: int = 16, layout: str = "spec"
) -> NVFP4Weight:
    """The NVFP4Weight held by FP4Dense params (boxed or not)."""
    missing = [k for k in _FP4_KEYS if k not in params]
    if missing:
        raise KeyError(
            f"weight_from_params: FP4Dense params need {list(_FP4_KEYS)}; missing {missing}"
        )
    return NVFP4Weight(
        *(_unboxed(params[k]) for k in _FP4_KEYS), block_size=block_size, layout=layout
    )


def _is_dense(tree) -> bool:
    if not isinstance(tree, Mapping) or "kernel" not in tree or not set(tree) <= {"kernel", "bias"}:
        return False
    kernel = _unboxed(tree["kernel"])
    return (
        hasattr(kernel, "ndim") and kernel.ndim >= 2 and jnp.issubdtype(kernel.dtype, jnp.floating)
    )


_AUTONAME = re.compile(r"Dense_(\d+)")


def quantize_params(
    params,
    filter: Callable[[tuple], bool] | None = None,
    *,
    block_size: int = 16,
    rename: bool = True,
    method: str = "modelopt",
    calibration: Mapping[tuple, Any] | None = None,
):
    """Convert nn.Dense params into FP4Dense params.

    `params` is the params of one Dense (``{"kernel", "bias"}``) or of a whole model (any nesting
    of dicts / FrozenDicts, e.g. ``variables`` with its ``"params"`` collection). Every dict that
    holds exactly a float ``kernel`` (and optionally ``bias``) is a Dense layer; by default those
    with a 2-D kernel [in, out] are converted. `filter`, a predicate on the dict's path (a tuple
    of keys, e.g. ``("params", "Dense_0")``), chooses instead; a kernel with more than two axes
    that it selects is treated as a stack of Dense kernels [..., in, out] (nn.scan / nn.vmap
    layers). Select only Dense layers (a Conv kernel is also just "kernel").

    With `rename` (default), converted layers with Flax's automatic names ``Dense_<i>`` are renamed
    to the names Flax gives the FP4Dense modules that replace them in the model code:
    ``FP4Dense_<j>``, j counting the converted layers of the same parent in order of i. Layers with
    explicit names keep them.

    `method` is `jax_fp4.quantize`'s: "modelopt" (ModelOpt's algorithm, bit for bit) or "mse"
    (block scales searched for the least error). With "mse", `calibration` (from `calibrate`)
    weights each layer's input channels by their mean square; every converted layer needs an
    entry (its module path, the layer's path with a leading "params" key dropped). Without it the
    channels weigh equally.

    Returns a new tree of the same kind (the input is not modified); boxed (nn.Partitioned)
    kernels give boxed NVFP4 params with the axis names moved to the [out, in] layout.
    """

    check_calibration_method("quantize_params", method, calibration)

    def convert(tree, path):
        if _is_dense(tree):
            ndim = _unboxed(tree["kernel"]).ndim
            selected = ndim == 2 if filter is None else bool(filter(path))
            if selected:
                where = f"quantize_params: layer {'/'.join(map(str, path)) or '<root>'}"
                module_path = path[1:] if path[:1] == ("params",) else path
                try:
                    importance = layer_importance(calibration, module_path)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                out = _quantize_boxed(tree["kernel"], block_size, where, method, importance)
                if "bias" in tree:
                    out["bias"] = tree["bias"]
                return out, True
            return tree, False
        if isinstance(tree, Mapping):
            converted = {key: convert(value, (*path, key)) for key, value in tree.items()}
            names = {key: key for key in converted}
            if rename:
                auto = sorted(
                    (int(m.group(1)), key)
                    for key, (_, done) in converted.items()
                    if done and isinstance(key, str) and (m := _AUTONAME.fullmatch(key))
                )
                for j, (_, key) in enumerate(auto):
                    names[key] = f"FP4Dense_{j}"
                taken = set(converted) - {key for _, key in auto}
                clash = taken & {names[key] for _, key in auto}
                if clash:
                    raise ValueError(
                        f"quantize_params: renaming Dense_<i> layers under "
                        f"{'/'.join(map(str, path)) or '<root>'} would overwrite {sorted(clash)}; "
                        "pass rename=False"
                    )
            out = {names[key]: value for key, (value, _) in converted.items()}
            return (FrozenDict(out) if isinstance(tree, FrozenDict) else out), False
        return tree, False

    return convert(params, ())[0]


def prepack_params(params, filter: Callable[[tuple], bool] | None = None):
    """FP4Dense params with the weights in the decode GEMV's tiled layout (`jax_fp4.prepack`): every
    dict holding ``packed``, ``scale`` and ``global_scale`` (or those whose path `filter` accepts)
    is converted; boxes (nn.Partitioned) are kept. The modules reading them need
    ``FP4Dense(..., layout="tiled")``. A selected layer whose shape the layout cannot take (N % 16,
    K % 128) is an error: filter it out and leave that module's layout "spec". Returns a new tree.
    Apply it once, to spec-layout params: plain arrays carry no layout mark, so a second pass
    would reorder the bytes again (FP4Dense's `layout` field is the record)."""

    def convert(tree, path):
        if isinstance(tree, Mapping) and all(key in tree for key in _FP4_KEYS):
            if filter is not None and not filter(path):
                return tree
            where = f"prepack_params: layer {'/'.join(map(str, path)) or '<root>'}"
            try:
                tiled = prepack(weight_from_params(tree))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            out = dict(tree)
            for key, value in (("packed", tiled.packed), ("scale", tiled.scale)):
                out[key] = (
                    tree[key].replace_boxed(value)
                    if isinstance(tree[key], meta.AxisMetadata)
                    else value
                )
            return FrozenDict(out) if isinstance(tree, FrozenDict) else out
        if isinstance(tree, Mapping):
            out = {key: convert(value, (*path, key)) for key, value in tree.items()}
            return FrozenDict(out) if isinstance(tree, FrozenDict) else out
        return tree

    return convert(params, ())


_CALIBRATION = "jax_fp4_calibration"


def _record_dense_inputs(next_fun, args, kwargs, context):
    """nn.intercept_methods interceptor: sows the per-channel sum of squared inputs of nn.Dense."""
    if isinstance(context.module, nn.Dense) and context.method_name == "__call__":
        sums, rows = input_square_sums(args[0])
        add = dict(reduce_fn=lambda total, value: total + value, init_fn=lambda: 0)
        context.module.sow(_CALIBRATION, "sum_squares", sums, **add)
        context.module.sow(_CALIBRATION, "rows", rows, **add)
    return next_fun(*args, **kwargs)


def calibrate(module: nn.Module, variables, *args, method=None, **kwargs) -> dict[tuple, jax.Array]:
    """Input statistics of every `nn.Dense` in `module` for ``quantize_params(method="mse")``.

    Runs ``module.apply(variables, *args, method=method, **kwargs)`` once, recording what each
    nn.Dense receives, and returns {module path (e.g. ``("Dense_0",)`` or ``("block", "proj")``):
    mean of the squared inputs per input channel [in]}. Use calibration data that the model will
    see in use, not the evaluation data. Dense layers inside nn.scan / nn.vmap are not supported.
    """
    with nn.intercept_methods(_record_dense_inputs):
        _, state = module.apply(variables, *args, method=method, mutable=[_CALIBRATION], **kwargs)
    stats = {}

    def walk(tree, path):
        if "sum_squares" in tree and "rows" in tree:
            stats[path] = jnp.asarray(tree["sum_squares"], jnp.float32) / jnp.float32(tree["rows"])
        for key, value in tree.items():
            if isinstance(value, Mapping):
                walk(value, (*path, key))

    walk(state.get(_CALIBRATION, {}), ())
    return stats
