"""A checkpoint's tensors -> the params of the forward pass (`assemble`, `load_model`): NVFP4 layers
as jax_fp4.checkpoint converts them, FP8 layers dequantized with their own scales, q/k/v and
gate/up fused where the parts concatenate exactly, each MoE layer's experts stacked, the layers a
list (unrolled) or stacked for lax.scan; and a model's dense twin (`dense_twin`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
import jax_fp4.checkpoint as ckpt

from .config import Config, rope_frequencies

# Projections run as one matmul: the fused layer's name -> its parts, in the order of their rows.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_MODULE = {
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}
_MODULE.update({part: _MODULE[fused] for fused, parts in FUSED.items() for part in parts})


def _tensor(tensors: Mapping, name: str):
    """tensors[name] (an NVFP4 layer as the loader names it) or tensors[name + ".weight"] (a
    dense one; an FP8 one dequantized to float32 with its own scale, jax_fp4.checkpoint.from_fp8);
    None if neither is there. A weight that is neither float nor NVFP4 (integer codes of another
    quantization, a compressed-tensors layer that did not convert) raises CheckpointError: used
    as is it would give wrong logits without a sign."""
    w = tensors.get(name)
    if w is not None:
        return w
    w = tensors.get(f"{name}.weight")
    if w is None:
        if f"{name}.weight_packed" in tensors:
            raise ckpt.CheckpointError(
                f"layer {name!r}: {name}.weight_packed is not an NVFP4 layer "
                f"(dtype {np.dtype(tensors[f'{name}.weight_packed'].dtype)}, no "
                "weight_global_scale); this example runs NVFP4, FP8 and float layers"
            )
        return None
    dtype = np.dtype(w.dtype)
    if ckpt.is_fp8(dtype):
        return ckpt.from_fp8(tensors, name)
    if not (np.issubdtype(dtype, np.floating) or dtype == jnp.bfloat16):
        raise ckpt.CheckpointError(
            f"layer {name!r}: {name}.weight has dtype {dtype}, neither a float weight nor an "
            "NVFP4 or FP8 layer's; this example cannot run its quantization"
        )
    return w


def _has(tensors: Mapping, name: str) -> bool:
    return name in tensors or f"{name}.weight" in tensors


def _projection(tensors: Mapping, name: str, dtype, quantize: bool = False):
    """An NVFP4Weight as loaded, or a dense [..., N, K] weight: in the compute dtype, or quantized
    here (jax_fp4.quantize, ModelOpt's algorithm) if `quantize`."""
    w = _tensor(tensors, name)
    if w is None:
        raise KeyError(f"the checkpoint has no layer {name!r}")
    return _dense_or_quantized(w, dtype, quantize)


def _dense_or_quantized(w, dtype, quantize: bool):
    if isinstance(w, jax_fp4.NVFP4Weight):
        return w
    if quantize:
        return jax_fp4.quantize(jnp.asarray(w, jnp.float32))
    return jnp.asarray(w, dtype)


def _quantized(w, layout: str) -> jax_fp4.NVFP4Weight:
    """jax_fp4.quantize(w), in `layout` where the shape allows it."""
    return _laid_out(jax_fp4.quantize(w), layout)


def _laid_out(w, layout: str | None):
    """An NVFP4 weight prepacked if `layout` is "tiled" and its shape allows it (what
    jax_fp4.prepack's layout takes); anything else as it is."""
    if layout != "tiled" or not isinstance(w, jax_fp4.NVFP4Weight) or w.layout == "tiled":
        return w
    return jax_fp4.prepack(w) if w.block_size == 16 and w.n % 16 == 0 and w.k % 128 == 0 else w


def _same_global_scales(parts) -> bool:
    scales = [np.asarray(w.global_scale, np.float32) for w in parts]
    return all(
        s.shape == scales[0].shape and np.array_equal(s.view(np.uint32), scales[0].view(np.uint32))
        for s in scales[1:]
    )


def _fusable(parts) -> bool:
    """Whether parts concatenate into one exact weight: all dense, or all NVFP4 of one K and block
    size with bit-equal global scales (jax_fp4.checkpoint.fuse's condition)."""
    nvfp4 = [isinstance(w, jax_fp4.NVFP4Weight) for w in parts]
    if not any(nvfp4):
        return True
    return (
        all(nvfp4)
        and len({(w.k, w.block_size, w.shape[:-2]) for w in parts}) == 1
        and _same_global_scales(parts)
    )


def _fused_group(tensors, prefix: str, fused: str, dtype, quantize: bool, fuse: bool) -> dict:
    """A layer's entries for one fused group ("qkv_proj" or "gate_up_proj"): the fused weight (and
    bias) where the mapping stores it fused or its parts concatenate exactly (`fuse`), else the
    parts. Dense parts are concatenated, and quantized after (one global scale) with `quantize`."""
    module, parts = _MODULE[fused], FUSED[fused]
    stored = _tensor(tensors, f"{prefix}.{module}.{fused}")
    if stored is not None:  # stored fused (random weights; some exports)
        out = {fused: _dense_or_quantized(stored, dtype, quantize)}
        bias = tensors.get(f"{prefix}.{module}.{fused}.bias")
        return out if bias is None else {**out, f"{fused}_bias": jnp.asarray(bias, dtype)}
    names = [f"{prefix}.{module}.{part}" for part in parts]
    weights = []
    for name in names:
        w = _tensor(tensors, name)
        if w is None:
            raise KeyError(f"the checkpoint has no layer {name!r}")
        weights.append(w)
    biases = [tensors.get(f"{name}.bias") for name in names]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        raise KeyError(f"{prefix}.{module}: some of {parts} have a bias, not all")
    if fuse and _fusable(weights):
        if isinstance(weights[0], jax_fp4.NVFP4Weight):
            w = ckpt.fuse(dict(zip(names, weights)))
        else:
            w = np.concatenate([np.asarray(x, np.float32) for x in weights], axis=-2)
            w = _dense_or_quantized(w, dtype, quantize)
        out = {fused: w}
        if biases[0] is not None:
            out[f"{fused}_bias"] = jnp.concatenate([jnp.asarray(b, dtype) for b in biases])
        return out
    out = {part: _dense_or_quantized(w, dtype, quantize) for part, w in zip(parts, weights)}
    if biases[0] is not None:
        out.update({f"{part}_bias": jnp.asarray(b, dtype) for part, b in zip(parts, biases)})
    return out


def split_rows(w, sizes):
    """A weight [..., N, K] (NVFP4 or dense) cut along N into parts of `sizes` rows: a fused
    projection's parts, exactly (an NVFP4 weight's parts keep its global scale)."""
    bounds = np.cumsum(sizes)[:-1].tolist()
    if not isinstance(w, jax_fp4.NVFP4Weight):
        return jnp.split(jnp.asarray(w), bounds, axis=-2)
    w = jax_fp4.unprepack(w)
    packed, scale = jnp.split(w.packed, bounds, axis=-2), jnp.split(w.scale, bounds, axis=-2)
    return [jax_fp4.NVFP4Weight(p, s, w.global_scale, w.block_size) for p, s in zip(packed, scale)]


def _part_sizes(cfg: Config, fused: str, experts: bool = False) -> list[int]:
    if fused == "qkv_proj":
        return [cfg.heads * cfg.head_dim] + [cfg.kv_heads * cfg.head_dim] * 2
    return [cfg.moe_intermediate if experts else cfg.intermediate] * 2


def _unfuse(cfg: Config, layer: dict, fused: str, experts: bool = False) -> dict:
    """`layer` with its fused `fused` weight (and bias) as separate parts."""
    if fused not in layer:
        return layer
    layer, sizes = dict(layer), _part_sizes(cfg, fused, experts)
    bounds = np.cumsum(sizes)[:-1].tolist()
    w = layer.pop(fused)
    if experts and not isinstance(w, jax_fp4.NVFP4Weight):  # dense experts: [E, K, N]
        layer.update(zip(FUSED[fused], jnp.split(w, bounds, axis=-1)))
    else:
        layer.update(zip(FUSED[fused], split_rows(w, sizes)))
    bias = layer.pop(f"{fused}_bias", None)
    if bias is not None:
        layer.update(
            (f"{part}_bias", b) for part, b in zip(FUSED[fused], jnp.split(bias, bounds, -1))
        )
    return layer


def _alike(cfg: Config, layers: list[dict]) -> list[dict]:
    """The layers in one structure, for stacking: a group fused in some layers but not in others
    is split in all of them; any other difference raises ValueError."""
    for fused in FUSED:
        if len({fused in layer for layer in layers}) > 1:
            layers = [_unfuse(cfg, layer, fused) for layer in layers]
    experts = [layer["experts"] for layer in layers if "experts" in layer]
    if len({"gate_up_proj" in e for e in experts}) > 1:
        layers = [
            {**layer, "experts": _unfuse(cfg, layer["experts"], "gate_up_proj", experts=True)}
            for layer in layers
        ]
    first = jax.tree.structure(layers[0])
    for i, layer in enumerate(layers[1:], 1):
        if jax.tree.structure(layer) != first:
            raise ValueError(
                f"stack_layers: layer {i} is stored unlike layer 0 ({sorted(layer)} against "
                f"{sorted(layers[0])}, or other layouts or dtypes); run the layers unrolled"
            )
    return layers


def _stack(per_layer: list):
    """One pytree with a leading layer axis (NVFP4Weight leaves stack like arrays)."""
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *per_layer)


def projection_shapes(cfg: Config) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection of a layer, as checkpoints store them (unfused; no experts)."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (q, cfg.hidden),
        "k_proj": (kv, cfg.hidden),
        "v_proj": (kv, cfg.hidden),
        "o_proj": (cfg.hidden, q),
    }
    if not cfg.experts:
        shapes.update(
            gate_proj=(cfg.intermediate, cfg.hidden),
            up_proj=(cfg.intermediate, cfg.hidden),
            down_proj=(cfg.hidden, cfg.intermediate),
        )
    return shapes


def expert_in_features(cfg: Config) -> dict[str, int]:
    """The true K of each expert projection (jax_fp4.checkpoint.load_experts' in_features)."""
    return {"gate_proj": cfg.hidden, "up_proj": cfg.hidden, "down_proj": cfg.moe_intermediate}


def in_features(cfg: Config) -> dict[str, int]:
    """Each projection's true K (in_features) by layer name, as config.json implies it: what the
    loader needs to strip the zero padding ModelOpt adds to a K that is not a multiple of 16."""
    out = {
        f"model.layers.{i}.{_MODULE[name]}.{name}": k
        for i in range(cfg.layers)
        for name, (_, k) in projection_shapes(cfg).items()
    }
    out["lm_head"] = cfg.hidden
    return out


def _experts(cfg: Config, tensors, prefix: str, dtype, quantize: bool, fuse: bool) -> dict:
    """A layer's stacked experts: NVFP4 {"gate_up_proj" [E, 2I, H] or "gate_proj" and "up_proj"
    [E, I, H], "down_proj" [E, H, I]}, from a mapping that stores them stacked (random weights) or
    per expert (jax_fp4.checkpoint.load_experts: gate and up fused where their global scales are
    equal). Dense per-expert weights are stacked here: quantized with `quantize` (gate and up of
    each expert jointly, as ModelOpt gives them one global scale), else kept dense in
    jax.lax.ragged_dot's layout [E, K, N]."""
    name = f"{prefix}.mlp.experts"
    if _has(tensors, f"{name}.down_proj"):  # stored stacked
        return {
            part: _projection(tensors, f"{name}.{part}", dtype, quantize)
            for part in ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
            if _has(tensors, f"{name}.{part}")
        }
    first = tensors.get(f"{name}.0.gate_proj.weight")
    if first is None or _is_nvfp4_codes(tensors, f"{name}.0.gate_proj"):
        experts = ckpt.load_experts(tensors, name, cfg.experts, in_features=expert_in_features(cfg))
        if not fuse and "gate_up_proj" in experts:
            experts = _unfuse(cfg, experts, "gate_up_proj", experts=True)
        return experts
    dense = {
        part: np.stack(
            [
                np.asarray(_tensor(tensors, f"{name}.{e}.{part}"), np.float32)
                for e in range(cfg.experts)
            ]
        )
        for part in ("gate_proj", "up_proj", "down_proj")
    }
    if fuse:
        dense["gate_up_proj"] = np.concatenate([dense.pop("gate_proj"), dense.pop("up_proj")], -2)
    if quantize:
        return {part: jax_fp4.quantize(w) for part, w in dense.items()}
    return {part: jnp.asarray(w, dtype).swapaxes(-1, -2) for part, w in dense.items()}


def _is_nvfp4_codes(tensors, name: str) -> bool:
    """Whether layer `name` is stored as NVFP4 (ModelOpt's uint8 weight, or compressed-tensors'
    weight_packed), not as a dense float weight."""
    w = tensors.get(f"{name}.weight")
    return f"{name}.weight_packed" in tensors or (w is not None and np.dtype(w.dtype) == np.uint8)


def _assemble_layer(cfg: Config, tensors, i: int, dtype, quantize: bool, fuse: bool) -> dict:
    prefix = f"model.layers.{i}"
    layer = _fused_group(tensors, prefix, "qkv_proj", dtype, quantize, fuse)
    layer["o_proj"] = _projection(tensors, f"{prefix}.self_attn.o_proj", dtype, quantize)
    if cfg.experts:
        layer["router"] = _projection(tensors, f"{prefix}.mlp.gate", dtype)  # kept dense
        layer["experts"] = _experts(cfg, tensors, prefix, dtype, quantize, fuse)
    else:
        layer.update(_fused_group(tensors, prefix, "gate_up_proj", dtype, quantize, fuse))
        layer["down_proj"] = _projection(tensors, f"{prefix}.mlp.down_proj", dtype, quantize)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        layer[norm] = jnp.asarray(tensors[f"{prefix}.{norm}.weight"], jnp.float32)
    for norm in ("q_norm", "k_norm"):  # Qwen3
        if f"{prefix}.self_attn.{norm}.weight" in tensors:
            layer[norm] = jnp.asarray(tensors[f"{prefix}.self_attn.{norm}.weight"], jnp.float32)
    return layer


def assemble(
    cfg: Config,
    tensors,
    dtype=jnp.bfloat16,
    *,
    layout: str | None = None,
    quantize: bool = False,
    fuse: bool = True,
    stack_layers: bool = False,
) -> dict:
    """The params of `forward` from a checkpoint's tensors (a mapping of Hugging Face names to
    NVFP4Weight or arrays, as jax_fp4.checkpoint.from_tensors returns them; MoE experts as
    read_safetensors does), on the default device.

    "layers": a list of per-layer dicts, or with stack_layers one dict of weights with a leading
    layer axis for lax.scan (every layer must then be stored alike, as quantized checkpoints are).
    A layer holds "qkv_proj" (q, k, v rows) and "gate_up_proj" (gate, up rows) where `fuse` and
    the parts concatenate exactly (dense, or NVFP4 with bit-equal global scales), else the parts;
    MoE layers hold "router" and "experts" (stacked, gate_up fused likewise) instead of the MLP.
    layout: "tiled" prepacks every NVFP4 weight whose shape the layout takes; "spec" or None
    keeps them as given. quantize: the decoder layers' dense projections and experts are
    quantized here (a bf16 checkpoint run as NVFP4; fused parts jointly, one global scale, as
    ModelOpt exports them); the router, lm_head and embeddings stay dense."""
    if layout not in (None, "spec", "tiled"):
        raise ValueError(f"assemble: layout must be 'spec', 'tiled' or None, got {layout!r}")
    layers = [_assemble_layer(cfg, tensors, i, dtype, quantize, fuse) for i in range(cfg.layers)]
    if stack_layers:
        layers = _alike(cfg, layers)
    layers = [
        jax.tree.map(
            lambda w: _laid_out(jax.device_put(w), layout),
            layer,
            is_leaf=lambda x: isinstance(x, jax_fp4.NVFP4Weight),
        )
        for layer in layers
    ]
    embed = _projection(tensors, "model.embed_tokens", dtype)
    head = embed if cfg.tie_embeddings else _projection(tensors, "lm_head", dtype)
    return {
        "embed": embed,
        "layers": _stack(layers) if stack_layers else layers,
        "lm_head": _laid_out(jax.device_put(head), layout),
        "norm": jnp.asarray(tensors["model.norm.weight"], jnp.float32),
        "inv_freq": jnp.asarray(rope_frequencies(cfg), jnp.float32),
    }


def load_model(
    path,
    *,
    dtype=jnp.bfloat16,
    layout: str = "tiled",
    quantize: bool = False,
    fuse: bool = True,
    stack_layers: bool = False,
) -> tuple[Config, dict]:
    """config.json and the weights of a checkpoint directory: (config, params), see `assemble`.
    quantize: the decoder layers' dense (bf16 / fp16 / fp32) projections are quantized to NVFP4
    on load. fuse=False keeps q/k/v and gate/up as separate projections."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    cfg = Config.from_json(config)
    raw = ckpt.read_safetensors(path)
    quant_file = path / "hf_quant_config.json"
    quant = json.loads(quant_file.read_text()) if quant_file.exists() else None
    ckpt.check_quantization(quant or config.get("quantization_config"), raw)
    awq = next((name for name in raw if name.endswith(".pre_quant_scale")), None)
    if awq is not None:
        raise ckpt.CheckpointError(
            f"tensor {awq!r}: AWQ's activation pre-scaling is not applied by this example"
        )
    # Experts stay as stored for load_experts, which stacks them (converting each one as a layer
    # of its own would hold every expert twice).
    experts = {name: value for name, value in raw.items() if ".mlp.experts." in name}
    tensors = ckpt.from_tensors(
        {name: value for name, value in raw.items() if name not in experts},
        in_features=in_features(cfg),
    )
    tensors.update(experts)
    params = assemble(
        cfg,
        tensors,
        dtype,
        layout=layout,
        quantize=quantize,
        fuse=fuse,
        stack_layers=stack_layers,
    )
    return cfg, params


def dense_twin(params: dict, dtype=jnp.bfloat16) -> dict:
    """The same model with every NVFP4 weight dequantized to `dtype`, in the same structure (fused
    projections fused, experts stacked): XLA's dot, and jax.lax.ragged_dot on the experts, which
    are transposed once to its [E, K, N]."""

    def dense(tree, experts: bool = False):
        def one(w):
            if not isinstance(w, jax_fp4.NVFP4Weight):
                return w
            w = jax_fp4.dequantize(w, dtype)
            return w.swapaxes(-1, -2) if experts else w

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, jax_fp4.NVFP4Weight))

    def layer(weights: dict) -> dict:
        out = dense({name: w for name, w in weights.items() if name != "experts"})
        return (
            out if "experts" not in weights else {**out, "experts": dense(weights["experts"], True)}
        )

    layers = params["layers"]
    return {
        **dense({name: value for name, value in params.items() if name != "layers"}),
        "layers": layer(layers) if isinstance(layers, dict) else [layer(w) for w in layers],
    }
