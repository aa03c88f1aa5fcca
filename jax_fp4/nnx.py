"""Flax NNX layers with NVFP4 weights (needs the optional extra ``flax``).

    from jax_fp4 import nnx as fp4nnx
    model = fp4nnx.quantize_model(model)            # every nnx.Linear -> FP4Linear, in place
    stats = fp4nnx.calibrate(model, run, batch)     # or: calibrated block scales, from run(model, batch)
    model = fp4nnx.quantize_model(model, method="mse", calibration=stats)
    layer = fp4nnx.FP4Linear.from_linear(linear)    # one layer
    layer = fp4nnx.FP4Linear.from_weight(w, bias)   # from an NVFP4Weight (e.g. a checkpoint)
    model = fp4nnx.prepack_model(model)             # the decode GEMV's layout, once, in place

`FP4Linear` is a drop-in for `flax.nnx.Linear`: same call signature, `in_features`,
`out_features`, `use_bias`, `dtype` / `param_dtype` handling and `kernel_metadata` /
`bias_metadata`. Its weight lives in three `QuantizedWeight` variables in NVFP4's [out, in] layout
(`packed` uint8 [N, K/2], `scale` float8_e4m3fn [N, K/16], `global_scale` float32 []) and the bias
in an `nnx.Param`. `QuantizedWeight` is not an `nnx.Param`, so optimizers built with
``wrt=nnx.Param`` train the bias (and the rest of the model) and leave the codes alone; select
both with ``nnx.state(model, (nnx.Param, QuantizedWeight))``.

Sharding: ``kernel_metadata={"out_sharding": (in_axis, out_axis)}`` means what it means for
nnx.Linear's [in, out] kernel; FP4Linear moves the names to the [out, in] arrays:
``packed`` and ``scale`` get ``(out_axis, in_axis)``, ``global_scale`` none. So
``(None, "model")`` is column-parallel (packed, scale and bias sharded along N) and
``("model", None)`` row-parallel (packed and scale sharded along K). `from_linear` and
`quantize_model` carry a Linear's metadata over the same way, stacked (nnx.vmap'd) axes included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4.extras import missing_extra
from jax_fp4.flax_common import (
    check_calibration_method,
    compute_dtype,
    input_square_sums,
    layer_importance,
    quantize_kernel,
)

try:
    from flax import nnx
except ModuleNotFoundError as err:
    if err.name != "flax":
        raise
    raise missing_extra("flax", "flax", "jax_fp4.nnx") from err

from jax_fp4.format import NVFP4Weight
from jax_fp4.layout import tiled_layout_unsupported
from jax_fp4.ops import matmul
from jax_fp4.prepacking import prepack, unprepack

__all__ = [
    "FP4Linear",
    "QuantizedWeight",
    "calibrate",
    "export_weights",
    "load_weights",
    "quantize_model",
]

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

# Metadata keys naming an array's mesh axes (newest flax first) and keys not to copy.
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")
_HOOK_KEYS = ("on_get_value", "on_set_value", "on_create_value", "on_add_axis", "on_remove_axis")


class QuantizedWeight(nnx.Variable):
    """The NVFP4 arrays of an FP4Linear (codes, block scales, global scale): model state that is
    not an `nnx.Param`, so gradient transforms and optimizers over `nnx.Param` skip it."""


def _sharding_entry(metadata: Mapping) -> tuple[str | None, Any]:
    for key in _SHARDING_KEYS:
        if metadata.get(key) is not None:
            return key, metadata[key]
    return None, None


def _axes_tuple(value, ndim: int, where: str) -> tuple:
    if isinstance(value, jax.sharding.PartitionSpec):
        value = tuple(value) + (None,) * (ndim - len(value))
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"{where}: the sharding metadata must be a tuple of mesh axis names (one per "
            f"kernel axis) or a PartitionSpec, got {value!r}"
        )
    value = tuple(value)
    if len(value) != ndim:
        raise ValueError(
            f"{where}: the sharding metadata {value!r} must name {ndim} axes (kernel "
            f"[..., in_features, out_features]), got {len(value)}"
        )
    return value


def _weight_metadata(kernel_metadata: Mapping, kernel_ndim: int, where: str):
    """nnx.Linear kernel metadata ([..., in, out]) -> metadata for packed/scale and global_scale."""
    base = {k: v for k, v in kernel_metadata.items() if k not in _HOOK_KEYS}
    key, value = _sharding_entry(base)
    if key is None:
        return base, dict(base)
    for k in _SHARDING_KEYS:
        base.pop(k, None)
    axes = _axes_tuple(value, kernel_ndim, where)
    *lead, ax_in, ax_out = axes
    matrix = {**base, key: (*lead, ax_out, ax_in)}
    scalar = dict(base)
    if lead:
        scalar[key] = tuple(lead)
    return matrix, scalar


def _bias_metadata(bias_metadata: Mapping) -> dict:
    return {k: v for k, v in bias_metadata.items() if k not in _HOOK_KEYS}


class FP4Linear(nnx.Module):
    """A linear layer over the last axis with an NVFP4 weight: ``y = x @ W^T + b``.

    Drop-in for `flax.nnx.Linear`. Constructed directly, it draws a float kernel [in, out] with
    `kernel_init` (the same random numbers nnx.Linear would draw from the same `rngs`) and
    quantizes it; `from_linear`, `from_weight` and `quantize_model` build it from existing weights.

    Args:
      in_features: K, the input size (even: two E2M1 codes per byte).
      out_features: N, the output size.
      use_bias: whether to add a bias (an `nnx.Param` [out_features] of `param_dtype`).
      dtype: the computation dtype: inputs are cast to it and the output has it. None (default)
        promotes the inputs' dtype with `param_dtype`, as nnx.Linear does (so bfloat16 inputs with
        float32 params compute in float32). Must be float16, bfloat16 or float32.
      param_dtype: the dtype of the bias and of the float kernel drawn before quantization.
      block_size: elements per E4M3 block scale (16 for NVFP4).
      kernel_init, bias_init: initializers, as for nnx.Linear.
      rngs: an `nnx.Rngs`; None gives an all-zero weight and bias (a placeholder to load into).
      kernel_metadata: metadata as for nnx.Linear's [in, out] kernel (e.g.
        ``{"out_sharding": (None, "model")}``), carried to the [out, in] NVFP4 arrays.
      bias_metadata: metadata for the bias, as for nnx.Linear.
      backend: the jax_fp4.matmul backend (None: pick from shapes and platform).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        block_size: int = 16,
        kernel_init: Callable = default_kernel_init,
        bias_init: Callable = default_bias_init,
        rngs: nnx.Rngs | None = None,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        backend: str | None = None,
        _weights: tuple
        | None = None,  # internal: (NVFP4Weight, bias) from from_linear / from_weight
    ):
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"FP4Linear: {arg} must be a non-negative int, got {value!r}")
        if _weights is not None:
            weight, bias = _weights
        else:
            if in_features % 2:
                raise ValueError(
                    f"FP4Linear: in_features (K) must be even to pack two E2M1 codes per "
                    f"byte, got {in_features}"
                )
            shape = (in_features, out_features)
            if rngs is None:
                kernel = jnp.zeros(shape, param_dtype)
                bias = jnp.zeros((out_features,), param_dtype) if use_bias else None
            else:
                kernel = kernel_init(rngs.params(), shape, param_dtype)
                bias = bias_init(rngs.params(), (out_features,), param_dtype) if use_bias else None
            weight = quantize_kernel(kernel, block_size)
        matrix_meta, scalar_meta = _weight_metadata(
            kernel_metadata, weight.packed.ndim, "FP4Linear"
        )
        self.packed = QuantizedWeight(jnp.asarray(weight.packed), **matrix_meta)
        self.scale = QuantizedWeight(jnp.asarray(weight.scale), **matrix_meta)
        self.global_scale = QuantizedWeight(
            jnp.asarray(weight.global_scale, jnp.float32), **scalar_meta
        )
        if bias is not None:
            self.bias = nnx.Param(jnp.asarray(bias), **_bias_metadata(bias_metadata))
        else:
            self.bias = nnx.data(None)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.use_bias = bias is not None
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.block_size = int(weight.block_size)
        self.layout = weight.layout  # "tiled" after prepack(): the arrays hold the GEMV's layout
        self.backend = backend

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        *,
        block_size: int = 16,
        backend: str | None = None,
        method: str = "modelopt",
        importance=None,
    ) -> FP4Linear:
        """Quantize an `nnx.Linear` (kernel [..., in, out]; leading axes from nnx.vmap/scan stay
        stacked) with `jax_fp4.quantize`: ModelOpt's NVFP4 algorithm by default, or
        ``method="mse"`` with the optional per-input-channel `importance` [in] (from `calibrate`).
        Bias, dtype, param_dtype and the variables' metadata (sharding) are carried over; the
        Linear is left unchanged. A Linear whose variables carry ``out_sharding`` is converted
        onto the same layout, which (as creating it did) needs the mesh: call this under the same
        ``jax.set_mesh`` context."""
        if not isinstance(linear, nnx.Linear):
            raise TypeError(
                f"FP4Linear.from_linear: expected an nnx.Linear, got {type(linear).__name__}"
            )
        kernel = linear.kernel[...]
        if kernel.ndim < 2:
            raise ValueError(
                f"FP4Linear.from_linear: kernel must be [..., in, out], got shape {kernel.shape}"
            )
        in_features, out_features = kernel.shape[-2:]
        if in_features % 2:
            raise ValueError(
                f"FP4Linear.from_linear: in_features (K) must be even to pack two E2M1 "
                f"codes per byte, got kernel shape {tuple(kernel.shape)}"
            )
        weight = quantize_kernel(kernel, block_size, method, importance)
        bias = None if linear.bias is None else linear.bias[...]
        return cls(
            in_features,
            out_features,
            use_bias=bias is not None,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            block_size=block_size,
            kernel_metadata=linear.kernel.get_metadata(),
            bias_metadata={} if linear.bias is None else linear.bias.get_metadata(),
            backend=backend,
            _weights=(weight, bias),
        )

    @classmethod
    def from_weight(
        cls,
        weight: NVFP4Weight,
        bias=None,
        *,
        dtype=None,
        param_dtype=None,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        backend: str | None = None,
    ) -> FP4Linear:
        """An FP4Linear holding `weight` (an NVFP4Weight [N, K], e.g. from jax_fp4.checkpoint) and
        an optional `bias` [N]. `param_dtype` defaults to the bias dtype (float32 without bias)."""
        if not isinstance(weight, NVFP4Weight):
            raise TypeError(
                f"FP4Linear.from_weight: weight must be an NVFP4Weight, got {type(weight).__name__}"
            )
        *lead, n, k = weight.shape
        if bias is not None:
            bias = jnp.asarray(bias)
            if tuple(bias.shape) != (*lead, n):
                raise ValueError(
                    f"FP4Linear.from_weight: bias must have shape {(*lead, n)} to match the "
                    f"weight [N, K] = {weight.shape}, got {tuple(bias.shape)}"
                )
        if param_dtype is None:
            param_dtype = bias.dtype if bias is not None else jnp.float32
        return cls(
            k,
            n,
            use_bias=bias is not None,
            dtype=dtype,
            param_dtype=param_dtype,
            block_size=weight.block_size,
            kernel_metadata=kernel_metadata,
            bias_metadata=bias_metadata,
            backend=backend,
            _weights=(weight, bias),
        )

    @property
    def weight(self) -> NVFP4Weight:
        """The layer's NVFP4Weight [out_features, in_features]."""
        return NVFP4Weight.tree_unflatten(
            (self.block_size, self.layout),
            (self.packed[...], self.scale[...], self.global_scale[...]),
        )

    def prepack(self) -> bool:
        """Put the weight in the decode GEMV's tiled layout (`jax_fp4.prepack`), in place.
        Returns False (and changes nothing) where the shape cannot take it (N % 16, K % 128 or
        block_size 16); the layer computes the same either way."""
        weight = self.weight
        if tiled_layout_unsupported(weight.n, weight.k, weight.block_size) is not None:
            return False
        tiled = prepack(weight)
        self.packed.set_value(tiled.packed)
        self.scale.set_value(tiled.scale)
        self.layout = tiled.layout
        return True

    def __call__(self, inputs, out_sharding=None):
        """``inputs @ W^T + bias`` over the last axis: [..., in_features] -> [..., out_features].

        Args:
          inputs: the activations.
          out_sharding: optional sharding (PartitionSpec or NamedSharding) for the output, as for
            nnx.Linear; applied as a sharding constraint (a reshard on an explicit mesh).
        """
        inputs = jnp.asarray(inputs)
        weight = self.weight
        if weight.packed.ndim != 2:
            raise ValueError(
                f"FP4Linear: this layer holds stacked weights of shape {weight.shape}; call it "
                "inside nnx.scan / nnx.vmap over the stacked axis"
            )
        if inputs.ndim < 1 or inputs.shape[-1] != weight.k:
            raise ValueError(
                f"FP4Linear: inputs must be [..., in_features={weight.k}], got shape "
                f"{tuple(inputs.shape)}"
            )
        bias = self.bias[...] if self.bias is not None else None
        dtype = compute_dtype(inputs, self.dtype, self.param_dtype, bias)
        y = matmul(inputs.astype(dtype), weight, bias, backend=self.backend)
        if out_sharding is not None:
            y = _constrain(y, out_sharding)
        return y


def _constrain(y, sharding):
    mesh = jax.sharding.get_abstract_mesh()
    if (
        isinstance(sharding, jax.sharding.PartitionSpec)
        and not mesh.empty
        and mesh.are_all_axes_explicit
    ):
        return jax.sharding.reshard(y, sharding)
    return jax.lax.with_sharding_constraint(y, sharding)


# ---- whole models -----------------------------------------------------------------------------


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def _by_item(node, key) -> bool:
    return isinstance(node, Mapping) or not isinstance(key, str)


def _child(node, key):
    return node[key] if _by_item(node, key) else getattr(node, key)


def _set_child(node, key, value, path):
    if isinstance(node, tuple):
        raise TypeError(
            f"quantize_model: cannot replace the Linear at {_path_name(path)!r}: it sits in "
            "a tuple; use a list (nnx.List) or a filter that skips it"
        )
    if _by_item(node, key):
        node[key] = value
    else:
        setattr(node, key, value)


def quantize_model(
    model,
    filter: Callable[[tuple], bool] | None = None,
    *,
    block_size: int = 16,
    backend: str | None = None,
    method: str = "modelopt",
    calibration: Mapping[tuple, Any] | None = None,
):
    """Replace the `nnx.Linear` layers of `model` by FP4Linear layers, in place, and return it.

    Args:
      model: an nnx graph node (a Module, or a list/dict of them).
      filter: None converts every Linear; otherwise a predicate on the layer's path (a tuple of
        attribute names and list indices, e.g. ``("blocks", 0, "mlp", "up")``) choosing which to
        convert, e.g. ``lambda path: "head" not in path``.
      block_size: elements per block scale (16 for NVFP4).
      backend: the jax_fp4.matmul backend for the new layers.
      method: "modelopt" (ModelOpt's algorithm, bit for bit) or "mse" (block scales searched for
        the least error; see `jax_fp4.quantize`).
      calibration: with method="mse", the per-layer input statistics from `calibrate` (path ->
        importance [in]); every converted layer must have an entry. None weights inputs equally.

    A Linear referenced from several places becomes one FP4Linear shared the same way. Layers
    made by nnx.vmap (kernel [L, in, out]) become stacked FP4Linear layers for nnx.scan.
    """
    if isinstance(model, nnx.Linear) and not isinstance(model, FP4Linear):
        raise TypeError(
            "quantize_model: model is itself an nnx.Linear; use FP4Linear.from_linear(model)"
        )
    check_calibration_method("quantize_model", method, calibration)
    converted: dict[int, FP4Linear] = {}
    declined: set[int] = set()
    while True:
        todo = [
            (path, node)
            for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Linear) and id(node) not in declined
        ]
        if not todo:
            return model
        for path, linear in todo:
            if id(linear) not in converted:
                if filter is not None and not filter(tuple(path)):
                    declined.add(id(linear))
                    continue
                try:
                    converted[id(linear)] = FP4Linear.from_linear(
                        linear,
                        block_size=block_size,
                        backend=backend,
                        method=method,
                        importance=layer_importance(calibration, path),
                    )
                except (TypeError, ValueError) as e:
                    where = f"quantize_model: cannot quantize the Linear at {_path_name(path)!r}"
                    if type(e) not in (TypeError, ValueError):  # e.g. JAX's tracer errors
                        e.add_note(where)
                        raise
                    raise type(e)(f"{where}: {e}") from e
            parent = model
            for key in path[:-1]:
                parent = _child(parent, key)
            _set_child(parent, path[-1], converted[id(linear)], path)


def _record_inputs(call):
    """`call` (a Linear's __call__) that also sums its inputs' squares per channel."""

    def recording_call(self, inputs, *args, **kwargs):
        sums, rows = input_square_sums(inputs)
        self.calibration_sum_squares.set_value(self.calibration_sum_squares[...] + sums)
        self.calibration_rows.set_value(self.calibration_rows[...] + rows)
        return call(self, inputs, *args, **kwargs)

    return recording_call


@functools.cache
def _recording(cls: type) -> type:
    """A subclass of a Linear class that records its inputs (the same object layout as `cls`, so a
    calibration probe's layers can switch to it in place)."""
    return type(f"_Recording{cls.__name__}", (cls,), {"__call__": _record_inputs(cls.__call__)})


def calibrate(model, forward: Callable[..., Any], *args, **kwargs) -> dict[tuple, jax.Array]:
    """Input statistics of every `nnx.Linear` in `model` for ``quantize_model(method="mse")``.

    Runs ``forward(probe, *args, **kwargs)`` once on a copy of `model` whose Linear layers also
    record their inputs, and returns {layer path: mean of the squared inputs per input channel
    [in]}, the importance that weights each channel's quantization error. `forward` may run the
    model eagerly or under `nnx.jit`; call it on calibration data that the model will see in use,
    not on the evaluation data. `model` itself is left unchanged. Layers from nnx.vmap (stacked
    kernels) are not supported.
    """
    probe = nnx.clone(model)
    layers = {}
    for path, node in list(nnx.iter_graph(probe)):
        if not isinstance(node, nnx.Linear) or isinstance(node, FP4Linear):
            continue
        if node.kernel.ndim != 2:
            raise ValueError(
                f"calibrate: the Linear at {_path_name(path)!r} has a stacked kernel of shape "
                f"{tuple(node.kernel.shape)}; only 2-D kernels [in, out] are supported"
            )
        node.calibration_sum_squares = nnx.Variable(jnp.zeros((node.kernel.shape[0],), jnp.float32))
        node.calibration_rows = nnx.Variable(jnp.zeros((), jnp.int32))
        # Every reference to the layer records (shared layers); past nnx's __setattr__, which would
        # register "__class__" as an attribute of the module.
        object.__setattr__(node, "__class__", _recording(type(node)))
        layers[tuple(path)] = node
    forward(probe, *args, **kwargs)
    return {
        path: layer.calibration_sum_squares[...] / layer.calibration_rows[...].astype(jnp.float32)
        for path, layer in layers.items()
        if int(layer.calibration_rows[...]) > 0
    }


def _fp4_layers(model, prefix: str) -> dict[str, FP4Linear]:
    layers = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, FP4Linear):
            name = prefix + _path_name(path)
            if not name:
                raise ValueError("the model is a single FP4Linear: pass prefix='name' to name it")
            layers[name] = node
    return layers


def export_weights(model, *, prefix: str = "") -> dict[str, Any]:
    """The NVFP4 weights of every FP4Linear in `model`, by dotted path (``prefix`` + e.g.
    ``"blocks.0.mlp.up"``), with each bias as ``"<path>.bias"``: ready for
    ``jax_fp4.checkpoint.save_safetensors`` (which writes each NVFP4Weight in the ModelOpt layout)."""
    tensors: dict[str, Any] = {}
    for name, layer in _fp4_layers(model, prefix).items():
        tensors[name] = layer.weight
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias[...]
    return tensors


def load_weights(model, tensors: Mapping[str, Any], *, prefix: str = "", strict: bool = True):
    """Set the weights of every FP4Linear in `model` from `tensors` (e.g. from
    ``jax_fp4.checkpoint.load_safetensors``): the NVFP4Weight under ``prefix + path`` and the bias
    under ``prefix + path + ".bias"``. Returns `model`.

    With `strict` (default), a layer missing from `tensors` is an error; otherwise it is skipped.
    Shapes, block sizes and bias presence must match the layer; tensors for other parts of the
    model are ignored (load those with your own mapping)."""
    from jax_fp4.checkpoint import CheckpointError

    for name, layer in _fp4_layers(model, prefix).items():
        weight = tensors.get(name)
        if weight is None:
            if strict:
                raise CheckpointError(
                    f"load_weights: no NVFP4 weight {name!r} in the tensors for the "
                    f"FP4Linear at that path"
                )
            continue
        if not isinstance(weight, NVFP4Weight):
            raise CheckpointError(
                f"load_weights: {name!r} must be an NVFP4Weight, got "
                f"{type(weight).__name__} (load the file with load_safetensors)"
            )
        if weight.shape != layer.weight.shape or weight.block_size != layer.block_size:
            raise CheckpointError(
                f"load_weights: {name!r} has shape {weight.shape} and block_size {weight.block_size}, the "
                f"FP4Linear expects {layer.weight.shape} and block_size {layer.block_size}"
            )
        bias_name = f"{name}.bias"
        if layer.use_bias:
            if bias_name not in tensors:
                raise CheckpointError(
                    f"load_weights: the FP4Linear {name!r} has a bias but {bias_name!r} is missing"
                )
            bias = jnp.asarray(tensors[bias_name])
            expected = tuple(layer.bias[...].shape)
            if tuple(bias.shape) != expected:
                raise CheckpointError(
                    f"load_weights: {bias_name!r} must have shape {expected}, got "
                    f"{tuple(bias.shape)}"
                )
            layer.bias.set_value(bias.astype(layer.bias[...].dtype))
        elif bias_name in tensors:
            raise CheckpointError(
                f"load_weights: {bias_name!r} is given but the FP4Linear {name!r} "
                "has no bias (use_bias=False)"
            )
        weight = prepack(weight) if layer.layout == "tiled" else unprepack(weight)
        layer.packed.set_value(jnp.asarray(weight.packed))
        layer.scale.set_value(jnp.asarray(weight.scale))
        layer.global_scale.set_value(jnp.asarray(weight.global_scale, jnp.float32))
    return model


def prepack_model(model, filter: Callable[[tuple], bool] | None = None):
    """Put every FP4Linear of `model` (or those whose path `filter` accepts) in the decode GEMV's
    tiled layout (`jax_fp4.prepack`), in place, and return `model`. Layers whose shape the layout
    cannot take (N % 16, K % 128, block_size 16) keep the spec layout; results do not change."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, FP4Linear) and (filter is None or filter(tuple(path))):
            node.prepack()
    return model
