"""NVFP4 checkpoints: NVIDIA ModelOpt and compressed-tensors (llm-compressor) tensors <-> NVFP4Weight,
and a dependency-free safetensors reader/writer that handles float8 (F8_E4M3) without torch.

    tensors = jax_fp4.checkpoint.load_safetensors("ckpt_dir")    # {layer: NVFP4Weight, other: array}
    tensors = jax_fp4.checkpoint.load_safetensors("ckpt_dir", layout="tiled")   # prepacked on load
    w = tensors["model.layers.0.mlp.down_proj"]                  # an NVFP4Weight
    jax_fp4.checkpoint.save_safetensors({"proj": w}, "out.safetensors")   # ModelOpt layout

Conventions (per layer ``L``; block size 16, low nibble = even element):

  ModelOpt            ``L.weight`` uint8 [N, K/2], ``L.weight_scale`` float8_e4m3fn [N, K/16],
                      ``L.weight_scale_2`` float32 scalar, MULTIPLIED (= NVFP4Weight.global_scale);
                      ``L.input_scale`` (activation scale for W4A4) is ignored.
  compressed-tensors  ``L.weight_packed`` uint8 [N, K/2], ``L.weight_scale`` float8_e4m3fn [N, K/16],
                      ``L.weight_global_scale`` float32 [1] holding the RECIPROCAL (6*448/amax): the
                      dequantized weight is divided by it; ``L.input_global_scale`` is ignored.

Mixture-of-experts layers: both tools export every expert as its own layers
``{prefix}.{e}.{gate_proj,up_proj,down_proj}`` (``prefix`` e.g. ``model.layers.3.mlp.experts``),
each with its own global scales; current versions give an expert's gate and up one shared
global scale (ModelOpt syncs their amax, llm-compressor fuses their global scales), for runtimes
that fuse the two. `load_experts` stacks one layer's experts for ``jax_fp4.ragged_matmul``:

    raw = jax_fp4.checkpoint.read_safetensors("ckpt_dir")
    experts = jax_fp4.checkpoint.load_experts(raw, "model.layers.3.mlp.experts", 128)
    experts["gate_up_proj"], experts["down_proj"]   # NVFP4Weight [E, 2I, H] and [E, H, I]

It fuses gate and up (each expert's gate rows, then its up rows) only where every expert's two
global scales are bit-equal, and otherwise returns ``gate_proj``, ``up_proj`` and ``down_proj``
stacked separately; the codes and block scales are the file's bytes either way.

ModelOpt pads K to a multiple of its block size when it packs (a layer of in_features 40 is
stored as 24 bytes a row, K = 48). The files do not record the true K; pass it with
``in_features`` (a mapping or a callback from layer name to K, e.g. from config.json's
hidden_size, intermediate_size and head counts) and the loader drops the padding, after checking
that its codes are zero, and logs what it dropped (logger ``jax_fp4.checkpoint``, level INFO).

FP8 layers (mixed-precision exports, which quantize some layers to FP8 and the others to NVFP4)
pass through `from_tensors` as stored; `from_fp8` gives such a layer's dequantized float weight:

  ModelOpt            ``L.weight`` float8_e4m3fn [N, K], ``L.weight_scale`` float32 [] (per tensor,
                      multiplied), ``L.input_scale`` (the activations' scale) ignored.
  compressed-tensors  ``L.weight`` float8_e4m3fn [N, K], ``L.weight_scale`` [N, 1] (per output
                      channel, multiplied; bf16 or float32), or [N, K/G] (per group of G along K).

`check_quantization` compares a checkpoint's quantization config (ModelOpt's hf_quant_config.json
or config.json's ``quantization_config``) with its tensors and refuses algorithms and formats that
are neither NVFP4 nor FP8.

Arrays come back as host NumPy arrays (memory-mapped from the file where possible); put them on
devices with ``jax.device_put`` (with a sharding if you like) or let the first jit do it.

Nothing here imports torch or the ``safetensors`` package: the file format is an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}`` (plus an
optional ``__metadata__`` string map), then the raw little-endian bytes of every tensor.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from jax_fp4.format import LAYOUTS, NVFP4Weight
from jax_fp4.prepacking import in_layout, unprepack

__all__ = [
    "CheckpointError",
    "check_quantization",
    "from_fp8",
    "from_compressed_tensors",
    "from_modelopt",
    "from_tensors",
    "fuse",
    "is_fp8",
    "load_experts",
    "load_safetensors",
    "read_safetensors",
    "save_safetensors",
    "strip_k_padding",
    "to_compressed_tensors",
    "to_modelopt",
]

NVFP4_BLOCK_SIZE = 16

_log = logging.getLogger(__name__)

_F8 = np.dtype(ml_dtypes.float8_e4m3fn)
_U8 = np.dtype(np.uint8)
_F32 = np.dtype(np.float32)
_FP8 = (_F8, np.dtype(ml_dtypes.float8_e5m2))

# safetensors dtype names <-> NumPy / ml_dtypes dtypes.
_ST_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": _U8,
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": _F32,
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "F8_E4M3": _F8,
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _ST_DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}

_MODELOPT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")
_MODELOPT_IGNORED = ("input_scale",)
_CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
_CT_IGNORED = ("input_global_scale",)


def _is_float(dtype) -> bool:
    dtype = np.dtype(dtype)
    return bool(np.issubdtype(dtype, np.floating)) or dtype.name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
    )


class CheckpointError(ValueError):
    """A checkpoint's tensors do not form a valid NVFP4 layer (missing, mis-shaped or mistyped)."""


# ---- checkpoint tensors <-> NVFP4Weight ---------------------------------------------------------


def _get(tensors: Mapping, name: str, suffix: str, convention: str, needed: Sequence[str]):
    key = f"{name}.{suffix}"
    if key not in tensors:
        present = [f"{name}.{s}" for s in needed if f"{name}.{s}" in tensors]
        raise CheckpointError(
            f"{convention} layer {name!r}: tensor {key!r} is missing (a {convention} NVFP4 layer "
            f"needs {', '.join(repr(f'{name}.{s}') for s in needed)}; found {present})"
        )
    value = tensors[key]
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise CheckpointError(
            f"{convention} layer {name!r}: {key!r} must be an array, got {type(value).__name__}"
        )
    return key, np.asarray(value)


def _check_block_size(block_size, where: str) -> int:
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, (int, np.integer))
        or block_size <= 0
    ):
        raise ValueError(f"{where}: block_size must be a positive int, got {block_size!r}")
    return int(block_size)


def _check_layout(layout, where: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _host_device():
    """JAX's CPU device, where a load-time layout transform runs (None if this process has none)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def _in_layout_on_host(w: NVFP4Weight, layout: str) -> NVFP4Weight:
    """`in_layout(w, layout)` run on the host, so the arrays stay NumPy: a checkpoint larger than
    one GPU can still be placed with a sharding afterwards."""
    with jax.default_device(_host_device()):
        out = in_layout(w, layout)
    if out is w:
        return w
    return NVFP4Weight(
        np.asarray(out.packed),
        np.asarray(out.scale),
        w.global_scale,
        w.block_size,
        layout=out.layout,
    )


def _build(convention, name, packed_key, packed, scale_key, scale, gs_key, gs, block_size):
    """Validate one layer's three tensors and build the NVFP4Weight (gs already multiplicative)."""
    where = f"{convention} layer {name!r}"
    if packed.dtype != _U8:
        hint = (
            " (a float weight: this layer is not NVFP4-quantized)"
            if _is_float(packed.dtype)
            else ""
        )
        raise CheckpointError(
            f"{where}: {packed_key!r} must be uint8 (two E2M1 codes per byte), got "
            f"dtype {packed.dtype}{hint}"
        )
    if packed.ndim < 2:
        raise CheckpointError(
            f"{where}: {packed_key!r} must be [N, K/2] (rank >= 2), got shape {tuple(packed.shape)}"
        )
    if scale.dtype != _F8:
        hint = " (uint8 block scales are E8M0: an MXFP4 checkpoint?)" if scale.dtype == _U8 else ""
        raise CheckpointError(
            f"{where}: {scale_key!r} must be float8_e4m3fn (F8_E4M3), got dtype {scale.dtype}{hint}"
        )
    *lead, n, half_k = packed.shape
    k = 2 * half_k
    expected = (*lead, n, math.ceil(k / block_size))
    if tuple(scale.shape) != expected:
        raise CheckpointError(
            f"{where}: {scale_key!r} must have shape {expected} = [N, ceil(K/{block_size})] for "
            f"{packed_key!r} of shape {tuple(packed.shape)} (K = {k}), got {tuple(scale.shape)}"
        )
    if not _is_float(gs.dtype):
        raise CheckpointError(f"{where}: {gs_key!r} must be float32, got dtype {gs.dtype}")
    lead = tuple(lead)
    if gs.shape in ((), (1,)):
        gs = np.broadcast_to(gs.reshape(()), lead)  # one global scale (for every stacked weight)
    elif tuple(gs.shape) == (*lead, 1):
        gs = gs.reshape(lead)
    elif tuple(gs.shape) != lead:
        raise CheckpointError(
            f"{where}: {gs_key!r} must be a scalar (shape () or (1,)"
            f"{f' or {lead}' if lead else ''}), got shape {tuple(gs.shape)}"
        )
    gs = np.array(gs, np.float32)
    if not (np.all(np.isfinite(gs)) and np.all(gs > 0)):
        raise CheckpointError(f"{where}: {gs_key!r} must be finite and positive, got {gs.tolist()}")
    return NVFP4Weight(packed, scale, gs, block_size=block_size)


def from_modelopt(
    tensors: Mapping,
    name: str,
    *,
    block_size: int = NVFP4_BLOCK_SIZE,
    in_features: int | None = None,
) -> NVFP4Weight:
    """The NVFP4Weight of ModelOpt layer `name` from `name.weight` (uint8 [N, K/2]),
    `name.weight_scale` (float8_e4m3fn [N, K/16]) and `name.weight_scale_2` (float32 scalar,
    multiplied). `name.input_scale` is ignored. Raises CheckpointError naming the layer and the
    tensor when one is missing or has the wrong dtype or shape.

    in_features: the layer's true K where the file holds it padded (see `strip_k_padding`)."""
    block_size = _check_block_size(block_size, "from_modelopt")
    needed = _MODELOPT_SUFFIXES
    pk, packed = _get(tensors, name, "weight", "ModelOpt", needed)
    sk, scale = _get(tensors, name, "weight_scale", "ModelOpt", needed)
    gk, gs = _get(tensors, name, "weight_scale_2", "ModelOpt", needed)
    weight = _build("ModelOpt", name, pk, packed, sk, scale, gk, gs, block_size)
    return strip_k_padding(weight, in_features, f"ModelOpt layer {name!r}")


def from_compressed_tensors(
    tensors: Mapping,
    name: str,
    *,
    block_size: int = NVFP4_BLOCK_SIZE,
    in_features: int | None = None,
) -> NVFP4Weight:
    """The NVFP4Weight of compressed-tensors (``nvfp4-pack-quantized``) layer `name` from
    `name.weight_packed`, `name.weight_scale` and `name.weight_global_scale`.

    compressed-tensors stores the RECIPROCAL global scale (6*448/amax; dequantization divides by
    it); the returned weight holds the multiplicative float32 ``1 / weight_global_scale``, which
    equals the exact quotient within half an ulp of float32.

    in_features: the layer's true K where the file holds it padded (see `strip_k_padding`)."""
    block_size = _check_block_size(block_size, "from_compressed_tensors")
    needed = _CT_SUFFIXES
    pk, packed = _get(tensors, name, "weight_packed", "compressed-tensors", needed)
    sk, scale = _get(tensors, name, "weight_scale", "compressed-tensors", needed)
    gk, inv = _get(tensors, name, "weight_global_scale", "compressed-tensors", needed)
    if not _is_float(inv.dtype):
        raise CheckpointError(
            f"compressed-tensors layer {name!r}: {gk!r} must be float32, got dtype {inv.dtype}"
        )
    inv = inv.astype(np.float32)
    if not (np.all(np.isfinite(inv)) and np.all(inv > 0)):
        raise CheckpointError(
            f"compressed-tensors layer {name!r}: {gk!r} must be finite and "
            f"positive, got {inv.tolist()}"
        )
    weight = _build(
        "compressed-tensors", name, pk, packed, sk, scale, gk, np.float32(1.0) / inv, block_size
    )
    return strip_k_padding(weight, in_features, f"compressed-tensors layer {name!r}")


def strip_k_padding(w: NVFP4Weight, in_features: int | None, where: str = "strip_k_padding"):
    """`w` cut to its true K = `in_features` where the file holds K padded (ModelOpt pads K to a
    multiple of the block size when it packs: in_features 40 is stored as K = 48).

    The padding's codes must be zero (0x0 or 0x8), else CheckpointError: a nonzero code there
    means in_features is not this layer's. Block scales wholly inside the padding are dropped
    too. Logs what it dropped (INFO). None or the stored K: `w` unchanged."""
    if in_features is None:
        return w
    if (
        isinstance(in_features, bool)
        or not isinstance(in_features, (int, np.integer))
        or in_features <= 0
    ):
        raise ValueError(f"{where}: in_features must be a positive int, got {in_features!r}")
    k, stored = int(in_features), w.k
    if k == stored:
        return w
    if k > stored:
        raise CheckpointError(
            f"{where}: in_features is {k}, but the file holds K = {stored} "
            f"(packed {tuple(w.packed.shape)})"
        )
    if k % 2:
        raise CheckpointError(
            f"{where}: in_features {k} is odd; NVFP4Weight packs two codes a "
            "byte and needs an even K"
        )
    if w.layout != "spec":
        raise ValueError(f"{where}: strip the padding before prepacking (layout {w.layout!r})")
    packed, scale = np.asarray(w.packed), np.asarray(w.scale)
    pad = packed[..., k // 2 :]
    bad = np.argwhere(((pad & 0x7) != 0) | ((pad & 0x70) != 0))
    if len(bad):
        row = tuple(int(i) for i in bad[0][:-1])
        column = k + 2 * int(bad[0][-1])
        raise CheckpointError(
            f"{where}: in_features is {k}, but the padding (K {k}..{stored - 1} of the stored "
            f"{stored}) holds nonzero codes, e.g. row {row} at K = {column} or {column + 1}: the "
            "layer's true K is larger"
        )
    blocks = math.ceil(k / w.block_size)
    _log.info(
        "%s: K = %d in the file (padded), %d from in_features: dropped %d zero padding columns%s",
        where,
        stored,
        k,
        stored - k,
        f" and {scale.shape[-1] - blocks} block scales" if scale.shape[-1] > blocks else "",
    )
    return NVFP4Weight(
        np.ascontiguousarray(packed[..., : k // 2]),
        np.ascontiguousarray(scale[..., :blocks]),
        w.global_scale,
        w.block_size,
    )


def _weight_arrays(w, where: str):
    if not isinstance(w, NVFP4Weight):
        raise TypeError(f"{where}: w must be an NVFP4Weight, got {type(w).__name__}")
    if w.block_size != NVFP4_BLOCK_SIZE:
        raise ValueError(
            f"{where}: NVFP4 checkpoints use block_size {NVFP4_BLOCK_SIZE}, got {w.block_size}"
        )
    packed, scale = (np.asarray(x) for x in _spec_arrays(w))  # files hold the spec layout
    if scale.dtype == _U8:
        scale = scale.view(_F8)
    gs = np.asarray(w.global_scale, np.float32)
    return packed, scale, gs


def _spec_arrays(w: NVFP4Weight):
    """(packed, scale) in the spec layout; a tiled weight through the compiled `unprepack`."""
    spec = w if w.layout == "spec" else unprepack(w)
    return spec.packed, spec.scale


def _check_name(name, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty layer name, got {name!r}")
    return name


def to_modelopt(w: NVFP4Weight, name: str) -> dict[str, np.ndarray]:
    """The ModelOpt tensors of `w` as layer `name`: ``{name.weight: uint8 [N, K/2],
    name.weight_scale: float8_e4m3fn [N, K/16], name.weight_scale_2: float32 scalar}``, bit-exact
    (`from_modelopt` of the result gives back the same bytes)."""
    _check_name(name, "to_modelopt")
    packed, scale, gs = _weight_arrays(w, "to_modelopt")
    return {f"{name}.weight": packed, f"{name}.weight_scale": scale, f"{name}.weight_scale_2": gs}


def to_compressed_tensors(w: NVFP4Weight, name: str) -> dict[str, np.ndarray]:
    """The compressed-tensors tensors of `w` as layer `name`: ``weight_packed``, ``weight_scale``
    and ``weight_global_scale`` = float32(1 / global_scale) of shape [1] (per stacked weight:
    [..., 1]). The reciprocal is rounded to float32, so a round trip through this convention
    reproduces the global scale to within one ulp (codes and block scales exactly)."""
    _check_name(name, "to_compressed_tensors")
    packed, scale, gs = _weight_arrays(w, "to_compressed_tensors")
    inv = (np.float32(1.0) / gs).astype(np.float32).reshape(*gs.shape, 1)
    return {
        f"{name}.weight_packed": packed,
        f"{name}.weight_scale": scale,
        f"{name}.weight_global_scale": inv,
    }


def _dtype_of(tensors: Mapping, key: str):
    value = tensors.get(key)
    return None if value is None else np.dtype(getattr(value, "dtype", np.asarray(value).dtype))


def _layer_names(tensors: Mapping) -> dict[str, str]:
    """Layer name -> convention ('modelopt' or 'compressed-tensors') for every NVFP4 layer.

    A layer is NVFP4 if it has its global scale (``weight_scale_2`` / ``weight_global_scale``),
    or if it looks like one that lost it (uint8 codes with float8_e4m3fn block scales): those are
    then rejected with an error naming the missing tensor. Other quantized layers (FP8, int4
    ``pack-quantized`` with int32 ``weight_packed``, ...) are not NVFP4 and pass through."""
    layers: dict[str, str] = {}
    for key in tensors:
        if not isinstance(key, str):
            continue
        prefix, _, suffix = key.rpartition(".")
        if not prefix:
            continue
        convention = None
        if suffix == "weight_scale_2":
            convention = "modelopt"
        elif suffix == "weight_global_scale":
            convention = "compressed-tensors"
        elif suffix == "weight_scale" and _dtype_of(tensors, key) == _F8:
            if _dtype_of(tensors, f"{prefix}.weight_packed") == _U8:
                convention = "compressed-tensors"
            elif _dtype_of(tensors, f"{prefix}.weight") == _U8:
                convention = "modelopt"
        if convention is None:
            continue
        if layers.get(prefix, convention) != convention:
            raise CheckpointError(
                f"layer {prefix!r} mixes the ModelOpt ({prefix}.weight_scale_2) and "
                f"compressed-tensors ({prefix}.weight_global_scale) conventions"
            )
        layers[prefix] = convention
    return layers


InFeatures = Mapping[str, int] | Callable[[str], "int | None"] | None


def _in_features_of(in_features: InFeatures, name: str) -> int | None:
    if in_features is None:
        return None
    if isinstance(in_features, Mapping):
        return in_features.get(name)
    if callable(in_features):
        return in_features(name)
    raise TypeError(
        f"in_features must be a mapping or a callable from layer name to K, got "
        f"{type(in_features).__name__}"
    )


def is_fp8(dtype) -> bool:
    """Whether `dtype` is a float8 dtype (float8_e4m3fn or float8_e5m2): an FP8 layer's weight,
    which means nothing without its scale."""
    return np.dtype(dtype) in _FP8


def from_fp8(tensors: Mapping, name: str, *, dtype=np.float32) -> np.ndarray:
    """The dequantized weight [N, K] of FP8 layer `name`: ``name.weight`` (float8_e4m3fn [N, K])
    times ``name.weight_scale``, in `dtype` (float32 by default: the product of an FP8 value and
    a bf16 scale is exact there, with a float32 scale rounded once).

    The scale is per tensor (shape () or (1,), ModelOpt), per output channel ([N, 1] or [N],
    compressed-tensors' "channel" strategy) or per group along K ([N, K/G], "group"). The
    activations' ``name.input_scale`` is not applied (weight-only). Raises CheckpointError naming
    the layer and the tensor for a missing or non-float scale, a scale of another shape (e.g.
    2-D block scales), a non-finite scale, or a nonzero zero point."""
    where = f"FP8 layer {name!r}"
    key = f"{name}.weight"
    if key not in tensors:
        raise CheckpointError(f"{where}: tensor {key!r} is missing")
    weight = np.asarray(tensors[key])
    if not is_fp8(weight.dtype):
        raise CheckpointError(f"{where}: {key!r} must be float8_e4m3fn, got dtype {weight.dtype}")
    if weight.ndim != 2:
        raise CheckpointError(f"{where}: {key!r} must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    scale_key = f"{name}.weight_scale"
    if scale_key not in tensors:
        present = sorted(t for t in tensors if isinstance(t, str) and t.startswith(f"{name}."))
        raise CheckpointError(
            f"{where}: {key!r} is float8 ({weight.dtype}) but {scale_key!r} is missing (found "
            f"{present}); the raw FP8 values are not the weight, so the layer cannot run"
        )
    scale = np.asarray(tensors[scale_key])
    if is_fp8(scale.dtype) or not _is_float(scale.dtype):
        raise CheckpointError(
            f"{where}: {scale_key!r} must be a float32 / bf16 / fp16 scale, got dtype {scale.dtype}"
        )
    scale = scale.astype(np.float32)
    if scale.shape in ((), (1,)):
        scale = scale.reshape(1, 1)
    elif scale.shape in ((n,), (n, 1)):
        scale = scale.reshape(n, 1)
    elif scale.ndim == 2 and scale.shape[0] == n and 1 < scale.shape[1] and k % scale.shape[1] == 0:
        scale = np.repeat(scale, k // scale.shape[1], axis=1)
    else:
        raise CheckpointError(
            f"{where}: {scale_key!r} has shape {tuple(scale.shape)}; for {key!r} of shape "
            f"{(n, k)} it must be per tensor (), per output channel ({n}, 1) or per group along "
            f"K ({n}, K/G)"
        )
    if not np.all(np.isfinite(scale)):
        raise CheckpointError(f"{where}: {scale_key!r} holds non-finite values")
    zero_key = f"{name}.weight_zero_point"
    if zero_key in tensors and np.any(np.asarray(tensors[zero_key]) != 0):
        raise CheckpointError(f"{where}: {zero_key!r} is nonzero (asymmetric FP8 is not supported)")
    return (weight.astype(np.float32) * scale).astype(dtype)


# ModelOpt's quant_algo names and compressed-tensors' formats -> the format of their layers.
_MODELOPT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8"}
_CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "float-quantized": "fp8", "dense": None}


def _stored_format(tensors: Mapping, layer: str) -> str | None:
    """'nvfp4', 'fp8', 'float', another dtype's name, or None (no such layer): how `layer`'s
    tensors hold it."""
    value = tensors.get(layer)
    if isinstance(value, NVFP4Weight) or f"{layer}.weight_packed" in tensors:
        return "nvfp4"
    dtype = _dtype_of(tensors, f"{layer}.weight")
    if dtype is None:
        return None
    if dtype == _U8 and f"{layer}.weight_scale" in tensors:
        return "nvfp4"
    if is_fp8(dtype):
        return "fp8"
    return "float" if _is_float(dtype) else dtype.name


def check_quantization(quant_config: Mapping | None, tensors: Mapping) -> None:
    """Refuse a checkpoint whose quantization this module cannot run: `quant_config` is
    ModelOpt's hf_quant_config.json (or its "quantization" object) or config.json's
    ``quantization_config`` (ModelOpt or compressed-tensors); `tensors` its tensors, raw or
    converted (`from_tensors`).

    ModelOpt: quant_algo NVFP4, W4A16_NVFP4, FP8 or MIXED_PRECISION, whose ``quantized_layers``
    ({layer: {"quant_algo": ...}}) each name one of the others and must match how the layer is
    stored. compressed-tensors: format nvfp4-pack-quantized, float-quantized (FP8) or
    mixed-precision, each config group of a mixed one with one of those formats. Anything else
    (AWQ, INT4 / INT8, W4A8, ...) raises CheckpointError naming the algorithm and the layer or
    group, as does a layer stored unlike its declared format. None: nothing to check."""
    if not quant_config:
        return
    quant = quant_config.get("quantization", quant_config)
    # ModelOpt's config.json entry has config_groups too, beside its quant_algo.
    if quant.get("quant_method") == "compressed-tensors" or (
        "config_groups" in quant and "quant_algo" not in quant
    ):
        fmt = quant.get("format")
        if fmt == "mixed-precision":
            for group, spec in (quant.get("config_groups") or {}).items():
                if spec.get("format") not in _CT_FORMATS:
                    raise CheckpointError(
                        f"compressed-tensors config group {group!r} (targets "
                        f"{spec.get('targets')}) has format {spec.get('format')!r}; supported: "
                        f"{', '.join(_CT_FORMATS)}"
                    )
        elif fmt is not None and fmt not in _CT_FORMATS:
            raise CheckpointError(
                f"compressed-tensors format {fmt!r} is not supported (supported: "
                f"{', '.join(_CT_FORMATS)}, mixed-precision)"
            )
        return
    algo = quant.get("quant_algo")
    if algo is None or algo in _MODELOPT_ALGOS:
        return
    if algo != "MIXED_PRECISION":
        raise CheckpointError(
            f"ModelOpt quant_algo {algo!r} is not supported (supported: "
            f"{', '.join(_MODELOPT_ALGOS)}, MIXED_PRECISION)"
        )
    for layer, spec in (quant.get("quantized_layers") or {}).items():
        layer_algo = spec.get("quant_algo") if isinstance(spec, Mapping) else spec
        if layer_algo not in _MODELOPT_ALGOS:
            raise CheckpointError(
                f"ModelOpt MIXED_PRECISION layer {layer!r} has quant_algo {layer_algo!r}; "
                f"supported: {', '.join(_MODELOPT_ALGOS)}"
            )
        stored = _stored_format(tensors, layer)
        if stored is not None and stored != _MODELOPT_ALGOS[layer_algo]:
            raise CheckpointError(
                f"ModelOpt MIXED_PRECISION layer {layer!r} is declared {layer_algo} but "
                f"{layer}.weight is stored as {stored} ({_dtype_of(tensors, f'{layer}.weight')})"
            )


def from_tensors(
    tensors: Mapping,
    *,
    block_size: int = NVFP4_BLOCK_SIZE,
    layout: str = "spec",
    in_features: InFeatures = None,
) -> dict:
    """Convert every NVFP4 layer of a flat tensor mapping, detecting the convention per layer.

    Returns a dict from layer name to NVFP4Weight for ModelOpt layers (recognised by
    ``L.weight_scale_2``) and compressed-tensors layers (``L.weight_global_scale``), with every
    other tensor (biases, norms, embeddings, float, FP8 or int4 layers) passed through unchanged
    (an FP8 layer's weight is not usable without its scale: `from_fp8` dequantizes it).
    uint8 codes with float8_e4m3fn block scales but no global scale are an NVFP4 layer missing a
    tensor: CheckpointError. The activation scales
    ``L.input_scale`` / ``L.input_global_scale`` of converted layers are dropped.

    ``layout="tiled"`` prepacks (`jax_fp4.prepack`, on the host) every layer whose shape the tiled
    layout takes (block size 16, N % 16 == 0, K % 128 == 0); the others stay in the spec layout
    (``w.layout`` says which). Same values either way; the CUDA kernels read "tiled" faster.

    ``in_features``: each layer's true K, as a mapping from layer name to K or a callable of the
    layer name returning K (None or absent: the stored K). Where it is below the stored K (ModelOpt
    pads K to a multiple of 16), the zero padding is checked and dropped (`strip_k_padding`).
    Names that are not NVFP4 layers are ignored, so a mapping may list every projection."""
    block_size = _check_block_size(block_size, "from_tensors")
    layout = _check_layout(layout, "from_tensors")
    layers = _layer_names(tensors)
    out: dict = {}
    consumed: set = set()
    for name, convention in sorted(layers.items()):
        k = _in_features_of(in_features, name)
        if convention == "modelopt":
            weight = from_modelopt(tensors, name, block_size=block_size, in_features=k)
            suffixes = _MODELOPT_SUFFIXES + _MODELOPT_IGNORED
        else:
            weight = from_compressed_tensors(tensors, name, block_size=block_size, in_features=k)
            suffixes = _CT_SUFFIXES + _CT_IGNORED
        out[name] = _in_layout_on_host(weight, layout)
        consumed.update(f"{name}.{s}" for s in suffixes)
    for key, value in tensors.items():
        if key in consumed:
            continue
        if key in out:
            raise CheckpointError(
                f"tensor {key!r} has the same name as an NVFP4 layer built from "
                f"{key!r}.weight*; cannot return both"
            )
        out[key] = value
    return out


def fuse(weights) -> NVFP4Weight:
    """Concatenate NVFP4 weights along N (fused q/k/v or gate/up projections).

    `weights` is a sequence of NVFP4Weight, or a mapping from layer name to NVFP4Weight (the names
    then appear in errors). All must have the same K, block size and leading (stacked) shape, and
    bit-identical global scales: a fused layer has one global scale, and rescaling the block scales
    of a part would change its values. Quantize the concatenated float weights once to get parts
    that share a global scale (ModelOpt does this for the layers runtimes fuse)."""
    if isinstance(weights, Mapping):
        names, ws = [str(k) for k in weights], list(weights.values())
    else:
        ws = list(weights)
        names = [f"weights[{i}]" for i in range(len(ws))]
    if not ws:
        raise ValueError("fuse: weights is empty")
    for name, w in zip(names, ws):
        if not isinstance(w, NVFP4Weight):
            raise TypeError(f"fuse: {name} must be an NVFP4Weight, got {type(w).__name__}")
    first, first_name = ws[0], names[0]
    for name, w in zip(names[1:], ws[1:]):
        if w.block_size != first.block_size:
            raise ValueError(
                f"fuse: {name} has block_size {w.block_size}, expected "
                f"{first.block_size} (as {first_name})"
            )
        if w.k != first.k or w.shape[:-2] != first.shape[:-2]:
            raise ValueError(
                f"fuse: {name} has shape {w.shape}; every part needs K = {first.k} and "
                f"leading shape {first.shape[:-2]} (as {first_name}, shape {first.shape})"
            )
    scales = [np.asarray(w.global_scale, np.float32) for w in ws]
    if any(not np.array_equal(s.view(np.uint32), scales[0].view(np.uint32)) for s in scales[1:]):
        listed = ", ".join(f"{n}: {s.tolist()}" for n, s in zip(names, scales))
        raise ValueError(
            f"fuse: the parts have different global scales ({listed}); a fused layer needs one "
            "shared global scale. Quantize the concatenated float weights once "
            "(jax_fp4.quantize(jnp.concatenate([...], axis=-2))) instead of fusing separately "
            "quantized parts"
        )
    parts = [_spec_arrays(w) for w in ws]
    packed = np.concatenate([np.asarray(p) for p, _ in parts], axis=-2)
    scale = np.concatenate([np.asarray(s).view(_U8) for _, s in parts], axis=-2)
    if np.asarray(first.scale).dtype == _F8:
        scale = scale.view(_F8)
    return NVFP4Weight(packed, scale, scales[0].copy(), block_size=first.block_size)


# ---- mixture-of-experts layers ------------------------------------------------------------------

_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Mixtral's per-expert names (w1 gate, w3 up, w2 down), which ModelOpt exports unchanged.
_EXPERT_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Names of one tensor holding every expert of a layer (transformers' fused experts, serving
# engines' w13/w2): ModelOpt and llm-compressor split such experts into per-expert layers on export.
_FUSED_EXPERT_NAMES = ("gate_up_proj", "w13_weight", "w2_weight", *_EXPERT_PROJECTIONS)
_EXPERT_SUFFIXES = {
    "modelopt": _MODELOPT_SUFFIXES + _MODELOPT_IGNORED,
    "compressed-tensors": _CT_SUFFIXES + _CT_IGNORED,
    "NVFP4Weight": ("",),  # an already converted layer (load_safetensors' output)
}
_CONVENTION_NAMES = {
    "modelopt": "ModelOpt",
    "compressed-tensors": "compressed-tensors",
    "NVFP4Weight": "an NVFP4Weight",
}


def _expert_layers(tensors: Mapping, prefix: str, num_experts: int):
    """{expert: {projection: (stored layer name, {suffixes})}} of every tensor under `prefix`,
    refusing what is not an expert's tensor (fused experts, other projections, extra experts)."""
    head = f"{prefix}."
    layers: dict[int, dict[str, tuple[str, set]]] = {}
    extra: set[int] = set()
    for key in tensors:
        if not isinstance(key, str) or not key.startswith(head):
            continue
        first, _, tail = key[len(head) :].partition(".")
        if not (first.isascii() and first.isdigit() and first == str(int(first))):
            if first in _FUSED_EXPERT_NAMES:
                raise CheckpointError(
                    f"load_experts: {key!r} holds all experts of {prefix!r} in one tensor (a fused "
                    "experts layout). jax_fp4 loads NVFP4 experts stored one by one, "
                    f"{prefix}.<expert>.<gate_proj|up_proj|down_proj>.*, as ModelOpt and "
                    "llm-compressor export them; float experts quantize with jax_fp4.quantize"
                )
            raise CheckpointError(
                f"load_experts: tensor {key!r} under {prefix!r} is not an expert's (expected "
                f"{prefix}.<expert index>.<gate_proj|up_proj|down_proj>.*)"
            )
        expert = int(first)
        if expert >= num_experts:
            extra.add(expert)
            continue
        projection, _, suffix = tail.partition(".")
        canonical = projection if projection in _EXPERT_PROJECTIONS else None
        canonical = canonical or _EXPERT_ALIASES.get(projection)
        if canonical is None:
            raise CheckpointError(
                f"load_experts: tensor {key!r}: expert {expert} has a projection {projection!r}; "
                "an expert has gate_proj, up_proj and down_proj (or Mixtral's w1, w3, w2)"
            )
        stored, suffixes = layers.setdefault(expert, {}).setdefault(
            canonical, (f"{head}{expert}.{projection}", set())
        )
        if stored != f"{head}{expert}.{projection}":
            raise CheckpointError(
                f"load_experts: expert {expert} of {prefix!r} has both {stored!r} and "
                f"'{head}{expert}.{projection}' as its {canonical}"
            )
        suffixes.add(suffix)
    if extra:
        raise CheckpointError(
            f"load_experts: {prefix!r} has tensors of expert(s) {sorted(extra)[:8]} beyond "
            f"num_experts = {num_experts} (experts 0..{num_experts - 1})"
        )
    missing = [e for e in range(num_experts) if e not in layers]
    if missing:
        found = f"; it has experts {sorted(layers)[:8]}" if layers else "; it has no expert tensors"
        raise CheckpointError(
            f"load_experts: {prefix!r} lacks expert(s) {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} of num_experts = {num_experts} (no tensors "
            f"{prefix}.{missing[0]}.*){found}"
        )
    for expert, projections in sorted(layers.items()):
        absent = [p for p in _EXPERT_PROJECTIONS if p not in projections]
        if absent:
            raise CheckpointError(
                f"load_experts: expert {expert} of {prefix!r} has no {', '.join(absent)} "
                f"(its tensors: {sorted(n for n, _ in projections.values())})"
            )
    return layers


def _expert_weight(tensors, name, convention, block_size, k) -> NVFP4Weight:
    if convention == "modelopt":
        return from_modelopt(tensors, name, block_size=block_size, in_features=k)
    if convention == "compressed-tensors":
        return from_compressed_tensors(tensors, name, block_size=block_size, in_features=k)
    w = tensors[name]
    if w.block_size != block_size:
        raise CheckpointError(
            f"load_experts: {name!r} has block_size {w.block_size}, expected {block_size}"
        )
    if w.layout != "spec":
        with jax.default_device(_host_device()):
            w = unprepack(w)
    spec = NVFP4Weight(
        np.asarray(w.packed),
        np.asarray(w.scale),
        np.asarray(w.global_scale, np.float32),
        w.block_size,
    )
    return strip_k_padding(spec, k, f"load_experts: {name!r}")


def _stack_experts(parts: Sequence[Sequence[NVFP4Weight]]) -> NVFP4Weight:
    """One [E, rows, K] weight of per-expert parts: expert e's rows are parts[e] concatenated
    along N (one part: plain stacking; gate and up: the fused gate/up rows), bytes unchanged."""
    first = parts[0]
    rows = sum(w.n for w in first)
    packed = np.empty((len(parts), rows, first[0].k // 2), _U8)
    scale = np.empty((len(parts), rows, np.shape(first[0].scale)[-1]), _U8)
    for e, expert_parts in enumerate(parts):
        row = 0
        for w in expert_parts:
            packed[e, row : row + w.n] = np.asarray(w.packed)
            scale[e, row : row + w.n] = np.asarray(w.scale).view(_U8)
            row += w.n
    global_scale = np.array([np.float32(w[0].global_scale) for w in parts], np.float32)
    return NVFP4Weight(packed, scale.view(_F8), global_scale, first[0].block_size)


def load_experts(
    tensors: Mapping,
    prefix: str,
    num_experts: int,
    *,
    layout: str = "spec",
    in_features: InFeatures = None,
    block_size: int = NVFP4_BLOCK_SIZE,
) -> dict[str, NVFP4Weight]:
    """The NVFP4 experts of one mixture-of-experts layer, stacked on a leading expert axis.

    `tensors`: a checkpoint's tensors (`read_safetensors`; `load_safetensors`' converted layers
    work too). `prefix`: the experts' container, e.g. ``"model.layers.3.mlp.experts"``, whose
    experts ``{prefix}.{e}.{gate_proj,up_proj,down_proj}.*`` (Mixtral's ``w1``, ``w3``, ``w2``
    alike) are ModelOpt or compressed-tensors NVFP4 layers, all of one convention.

    Returns ``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}`` (each expert's gate rows
    first, then its up rows; `fuse`'s concatenation) where every expert's gate and up global
    scales are bit-equal, as ModelOpt and llm-compressor export them for runtimes that fuse the
    two; otherwise ``{"gate_proj", "up_proj", "down_proj"}`` each [E, N, K], for all experts
    alike (logged at INFO). Every global_scale is [E]; codes and block scales are the file's
    bytes. ``layout="tiled"`` prepacks each stacked weight whose shape the tiled layout takes.

    ``in_features``: the true K where ModelOpt padded it, as for `from_tensors` (a mapping or a
    callable from layer name, e.g. ``"model.layers.3.mlp.experts.7.down_proj"``, to K); a mapping
    may also key it by projection name (``{"gate_proj": H, "up_proj": H, "down_proj": I}``).

    Raises CheckpointError for a missing or extra expert (every index in 0..num_experts-1 and
    none beyond), a missing projection or tensor, experts of different shapes or conventions,
    gate/up/down shapes that do not chain (down's K must be gate's N), a float (unquantized)
    expert, tensors under `prefix` that are not an expert's, and fused-experts tensors
    (``{prefix}.gate_up_proj``: all experts in one tensor, which neither tool exports for NVFP4)."""
    layout = _check_layout(layout, "load_experts")
    block_size = _check_block_size(block_size, "load_experts")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"load_experts: prefix must be a non-empty string, got {prefix!r}")
    if (
        isinstance(num_experts, bool)
        or not isinstance(num_experts, (int, np.integer))
        or num_experts <= 0
    ):
        raise ValueError(f"load_experts: num_experts must be a positive int, got {num_experts!r}")
    num_experts = int(num_experts)
    prefix = prefix.rstrip(".")
    layers = _expert_layers(tensors, prefix, num_experts)
    under = {k: v for k, v in tensors.items() if isinstance(k, str) and k.startswith(f"{prefix}.")}
    detected = _layer_names(under)

    def convention_of(name: str, suffixes: set) -> str:
        if isinstance(tensors.get(name), NVFP4Weight):
            return "NVFP4Weight"
        if name in detected:
            return detected[name]
        weight = tensors.get(f"{name}.weight")
        if weight is not None and _is_float(_dtype_of(tensors, f"{name}.weight")):
            raise CheckpointError(
                f"load_experts: expert layer {name!r} is not NVFP4-quantized ({name}.weight is "
                f"{_dtype_of(tensors, f'{name}.weight')}); quantize float experts with "
                "jax_fp4.quantize"
            )
        raise CheckpointError(
            f"load_experts: expert layer {name!r} has no NVFP4 tensors (found "
            f"{sorted(f'{name}.{s}' if s else name for s in suffixes)}; a ModelOpt layer has "
            f"{', '.join(_MODELOPT_SUFFIXES)}, a compressed-tensors one {', '.join(_CT_SUFFIXES)})"
        )

    def k_of(name: str, projection: str) -> int | None:
        k = _in_features_of(in_features, name)
        if k is None and isinstance(in_features, Mapping):
            k = in_features.get(projection)
        return k

    first_convention, first_name = None, ""
    weights: dict[str, list[NVFP4Weight]] = {p: [] for p in _EXPERT_PROJECTIONS}
    for expert in range(num_experts):
        for projection in _EXPERT_PROJECTIONS:
            name, suffixes = layers[expert][projection]
            convention = convention_of(name, suffixes)
            if first_convention is None:
                first_convention, first_name = convention, name
            elif convention != first_convention:
                raise CheckpointError(
                    f"load_experts: the experts of {prefix!r} mix conventions: {first_name!r} is "
                    f"{_CONVENTION_NAMES[first_convention]}, {name!r} "
                    f"{_CONVENTION_NAMES[convention]}"
                )
            allowed = _EXPERT_SUFFIXES[convention]
            unexpected = sorted(s for s in suffixes if s not in allowed)
            if unexpected:
                raise CheckpointError(
                    f"load_experts: unexpected tensor '{name}.{unexpected[0]}' in an expert layer "
                    f"of the {_CONVENTION_NAMES[convention]} convention (which has "
                    f"{', '.join(repr(s) for s in allowed)}); expert biases are not supported"
                )
            w = _expert_weight(tensors, name, convention, block_size, k_of(name, projection))
            reference = weights[projection][0] if weights[projection] else None
            if reference is not None and w.shape != reference.shape:
                raise CheckpointError(
                    f"load_experts: {name!r} has shape {w.shape} (N, K), but expert 0's "
                    f"{projection} has {reference.shape}: the experts of a layer share one shape"
                )
            weights[projection].append(w)

    gate, up, down = (weights[p][0] for p in _EXPERT_PROJECTIONS)
    if gate.shape != up.shape or down.shape != (gate.k, gate.n):
        hint = (
            " (ModelOpt pads K to a multiple of 16: pass in_features with the true K)"
            if down.k > gate.n or gate.k > down.n
            else ""
        )
        raise CheckpointError(
            f"load_experts: the experts of {prefix!r} have gate_proj {gate.shape}, up_proj "
            f"{up.shape} and down_proj {down.shape} (N, K); expected gate and up [I, H] and down "
            f"[H, I]{hint}"
        )

    def bits(w):
        return np.float32(w.global_scale).view(np.uint32)

    differ = [
        e
        for e, (g, u) in enumerate(zip(weights["gate_proj"], weights["up_proj"]))
        if bits(g) != bits(u)
    ]
    if differ:
        _log.info(
            "%s: gate_proj and up_proj kept separate: their global scales differ in %d of %d "
            "experts (e.g. expert %d)",
            prefix,
            len(differ),
            num_experts,
            differ[0],
        )
        out = {p: _stack_experts([[w] for w in weights[p]]) for p in _EXPERT_PROJECTIONS}
    else:
        out = {
            "gate_up_proj": _stack_experts(list(zip(weights["gate_proj"], weights["up_proj"]))),
            "down_proj": _stack_experts([[w] for w in weights["down_proj"]]),
        }
    return {name: _in_layout_on_host(w, layout) for name, w in out.items()}


# ---- safetensors files ------------------------------------------------------------------------


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError(
            "jax_fp4.checkpoint reads and writes safetensors on little-endian hosts only"
        )


def _read_one(path: Path) -> dict[str, np.ndarray]:
    _check_little_endian()
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: not a safetensors file (shorter than its 8-byte header length)"
            )
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(
                f"{path}: header length {header_len} exceeds the file size {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"{path}: the safetensors header is not valid JSON ({e})"
            ) from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the safetensors header must be a JSON object")
        data_start = 8 + header_len
        data_len = size - data_start
        # The map outlives the file object: the arrays below are read-only views into it.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape, (begin, end) = (
                info["dtype"],
                [int(d) for d in info["shape"]],
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {info!r}"
            ) from None
        if st_dtype not in _ST_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {st_dtype!r}, which jax_fp4 "
                f"cannot read (supported: {', '.join(sorted(_ST_DTYPES))})"
            )
        dtype = _ST_DTYPES[st_dtype]
        count = math.prod(shape)
        if not (0 <= begin <= end <= data_len) or end - begin != count * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({st_dtype} {shape}) needs {count * dtype.itemsize} bytes, "
                f"its data_offsets are [{begin}, {end}) of a {data_len}-byte data section"
            )
        if count == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.frombuffer(
                buf, dtype=dtype, count=count, offset=data_start + begin
            ).reshape(shape)
    return out


def _index_weight_map(index: Path) -> dict:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("'weight_map' is not an object")
    except FileNotFoundError:
        raise
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{index}: not a safetensors index (needs a 'weight_map' object): {e}"
        ) from None
    return weight_map


def _sources(path_or_paths) -> tuple[list[Path], dict[str, Path]]:
    """The files to read, and the tensor names index files promise (name -> index file)."""
    if isinstance(path_or_paths, (str, os.PathLike)):
        items = [Path(path_or_paths)]
    else:
        items = [Path(p) for p in path_or_paths]
        if not items:
            raise FileNotFoundError("read_safetensors: no paths given")
    files: list[Path] = []
    promised: dict[str, Path] = {}

    def add_index(index: Path):
        weight_map = _index_weight_map(index)
        files.extend(index.parent / f for f in dict.fromkeys(weight_map.values()))
        promised.update((name, index) for name in weight_map)

    for item in items:
        if item.is_dir():
            indexes = sorted(item.glob("*.safetensors.index.json"))
            if len(indexes) > 1:
                raise CheckpointError(
                    f"{item}: several index files {[p.name for p in indexes]}; pass one"
                )
            if indexes:
                add_index(indexes[0])
            else:
                found = sorted(item.glob("*.safetensors"))
                if not found:
                    raise FileNotFoundError(f"{item}: no .safetensors files in this directory")
                files.extend(found)
        elif item.name.endswith(".json"):
            add_index(item)
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"{item}: no such safetensors file or directory")
    return list(dict.fromkeys(files)), promised


def read_safetensors(path_or_paths) -> dict[str, np.ndarray]:
    """The raw tensors of one or several .safetensors files, without any NVFP4 conversion.

    Accepts a file, a directory (its ``*.safetensors.index.json`` if it has one, else every
    ``*.safetensors`` file in it), a ``.safetensors.index.json`` file of a sharded checkpoint, or a
    list of any of these. Every dtype, F8_E4M3 included, is read with NumPy / ml_dtypes (no torch).
    Arrays are read-only views of memory-mapped files. A tensor present in two files is an error,
    and so is one listed in an index but absent from its file."""
    files, promised = _sources(path_or_paths)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no such safetensors file{' (listed in an index)' if promised else ''}"
            )
        for name, array in _read_one(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {origin[name]} and {path}")
            tensors[name] = array
            origin[name] = path
    missing = [name for name in promised if name not in tensors]
    if missing:
        raise CheckpointError(
            f"{promised[missing[0]]}: {len(missing)} tensor(s) listed in the index "
            f"are absent from their files, e.g. {missing[:5]}"
        )
    return tensors


def load_safetensors(
    path_or_paths,
    *,
    block_size: int = NVFP4_BLOCK_SIZE,
    layout: str = "spec",
    in_features: InFeatures = None,
) -> dict:
    """Read one or several .safetensors files (see `read_safetensors`) and convert every NVFP4
    layer, ModelOpt or compressed-tensors, detected per layer (see `from_tensors`).

    Returns a dict from layer name to NVFP4Weight, plus every other tensor unchanged (as NumPy).
    ``layout="tiled"``: the NVFP4 layers prepacked where their shape allows (see `from_tensors`).
    ``in_features``: each layer's true K (a mapping or a callable from layer name to K), where
    the file holds K padded; the files do not record it (config.json implies it)."""
    layout = _check_layout(layout, "load_safetensors")  # before reading any file
    return from_tensors(
        read_safetensors(path_or_paths),
        block_size=block_size,
        layout=layout,
        in_features=in_features,
    )


def save_safetensors(tensors: Mapping, path, *, metadata: Mapping[str, str] | None = None) -> None:
    """Write a .safetensors file readable by the `safetensors` library (torch included).

    `tensors` maps names to arrays (NumPy, JAX, anything `np.asarray` takes; float8 stays F8_E4M3
    / F8_E5M2, bfloat16 BF16) or to NVFP4Weight values, which are written in the ModelOpt layout
    under their name (`to_modelopt`). `metadata` is an optional str -> str map stored in the
    header's ``__metadata__``."""
    arrays: dict[str, np.ndarray] = {}

    def put(name, array):
        if name in arrays:
            raise ValueError(
                f"save_safetensors: tensor {name!r} appears twice (an NVFP4Weight "
                "expands to NAME.weight, NAME.weight_scale, NAME.weight_scale_2)"
            )
        arrays[name] = array

    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(
                f"save_safetensors: tensor names must be non-empty strings, got {name!r}"
            )
        if isinstance(value, NVFP4Weight):
            for key, array in to_modelopt(value, name).items():
                put(key, array)
            continue
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("="))
        if array.dtype not in _ST_NAMES:
            raise TypeError(
                f"save_safetensors: tensor {name!r} has dtype {array.dtype}, which "
                f"safetensors cannot store (supported: {sorted(map(str, _ST_NAMES))})"
            )
        put(name, array)
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError("save_safetensors: metadata must map str to str")

    _check_little_endian()
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    order = sorted(arrays)
    for name in order:
        array = arrays[name]
        nbytes = array.size * array.dtype.itemsize
        header[name] = {
            "dtype": _ST_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in order:
            array = arrays[name]
            f.write(np.ascontiguousarray(array).tobytes())
