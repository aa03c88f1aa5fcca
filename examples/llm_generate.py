"""Greedy text generation from an NVFP4 checkpoint of a Llama / Qwen-style decoder, dense or
mixture-of-experts (Qwen3-MoE), in plain JAX.

A Hugging Face checkpoint directory (config.json + *.safetensors) quantized by NVIDIA ModelOpt or
llm-compressor (compressed-tensors, nvfp4-pack-quantized) loads with jax_fp4.checkpoint, its NVFP4
layers prepacked (a bf16 checkpoint with --quantize: jax_fp4.quantize on load); every projection
then runs through jax_fp4.matmul: the prompt as one prefill (M = batch x prompt length: the fused
GEMM or dequantize + GEMM on a GPU), each new token as a decode step (M = batch: the decode GEMV),
with a KV cache, one jitted call per token:

    python examples/llm_generate.py CHECKPOINT_DIR --prompt "The capital of France is" --max-new-tokens 32
    python examples/llm_generate.py BF16_CHECKPOINT_DIR --quantize --compare-bf16   # NVFP4 against bf16
    python examples/llm_generate.py --demo        # a small random model, written and read back here
    python examples/llm_generate.py --random llama3-8b --batch 1,8 --compare-bf16 --gpu-busy
    python examples/llm_generate.py --random qwen3-30b-a3b --prompt-len 2048 --json run.json

A layer runs four matmuls: q/k/v as one weight ("qkv_proj", the rows of q, k then v), gate/up as
one ("gate_up_proj", gate rows first), o_proj and down_proj. ModelOpt and llm-compressor give the
parts of each one global scale, so the loader concatenates them exactly (jax_fp4.checkpoint.fuse);
parts whose global scales differ stay separate projections. On NVFP4 weights jax_fp4.matmul applies
the layer's RMSNorm as it reads the activations of qkv_proj and gate_up_proj, SiLU(gate) * up on
gate_up_proj's output and the residual add on o_proj's and down_proj's; on dense weights XLA runs
the same ops around its dot.

Qwen3-MoE (config.json with "num_experts", or transformers 5's "num_local_experts" with model_type
"qwen3_moe"; every layer an MoE layer): a bf16 router (mlp.gate),
softmax in float32, top-k renormalised where norm_topk_prob, no shared expert. jax_fp4.route_top_k
takes the top k and sorts the (token, expert) pairs by expert (one GPU kernel when decoding);
they run through jax_fp4.ragged_matmul on the layer's stacked experts
(gate/up [E, 2I, H], down [E, H, I]), which reads only the experts that have tokens; the outputs,
weighted by the router, are summed back per token. jax_fp4.checkpoint.load_experts reads the
per-expert tensors (model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj).

--random draws a model of a preset's (or a config.json's) shapes with random weights on the
device (q/k/v, gate/up and each layer's experts quantized jointly, as the tools export them);
--compare-bf16 decodes the same weights dequantized to bf16 through XLA's dot (jax.lax.ragged_dot
for experts) and prints the ratio of the decode times (one jitted call per token, compilation
excluded; the tokens, the position and the caches stay on the device, donated to each step). --gpu-busy reads the time the GPU is busy per step
from a jax.profiler trace of a few more steps: the loop's time per step close to it means the host
keeps up. Each run also prints its byte floor: the bytes a step reads (weights, the experts the
batch's tokens visit, the KV cache) at the streaming-read bandwidth measured at the start.
The layers are unrolled by default, each weight its own buffer, which every kernel reads where it
lies; --scan-layers stacks them under lax.scan instead (one layer compiled), where XLA copies each
layer's dense weights out of the stack before their dot: on an H100 the bf16 step took 2.5x as
long that way, the NVFP4 one 1.1x (benchmarks/RESULTS.md). Unrolled, each layer's KV cache is its
own buffer, updated in place.

Mixed-precision exports (ModelOpt quant_algo "MIXED_PRECISION", compressed-tensors format
"mixed-precision") run their FP8 layers dense: each dequantized at load with its own scale
(per tensor or per output channel) to the activation dtype, then through XLA's dot; q/k/v or
gate/up parts in FP8 fuse after that dequantization, NVFP4 parts as above, mixed groups stay
separate. Quantization the example does not run (AWQ, INT4 / INT8, a float8 weight without its
scale) is refused at load, naming the layer and the tensor.

Architectures: Llama (2, 3 and 3.1's "llama3" RoPE scaling), Mistral, Qwen2 (q/k/v biases),
Qwen3 (q/k RMS norms) and Qwen3-MoE, told apart by the tensors present and "num_experts"
(sliding-window attention is not applied: exact while the sequence fits the window). Embeddings,
norms, routers and any layer the checkpoint keeps in bf16 (often lm_head) stay dense. With
`tokenizers` installed and a tokenizer.json beside the weights the prompt is text, otherwise token
ids (`--prompt-ids 1,2,3`, or `--prompt-len N` random ones).

config.json: the RoPE settings are read from "rope_parameters" (transformers 5, which current
ModelOpt and llm-compressor exports use) or from the top-level "rope_theta" and "rope_scaling"
(older files); RoPE types other than "default" and "llama3" are refused with an error rather than
run with the wrong frequencies. Each projection's true in_features (hidden_size,
intermediate_size, the head counts) is passed to the loader, which drops the zero padding ModelOpt
adds to a K that is not a multiple of 16 and logs what it dropped.

--json writes {"runs": [...]} with one entry per batch: "model", "batch", "context" (prompt
tokens + new tokens: the KV cache's length, which every decode step's attention reads whole),
"nvfp4_ms" and "bf16_ms" (the loop's time per decode step; "loop_ms" is nvfp4_ms), "ratio"
(bf16_ms / nvfp4_ms), "gpu_busy_ms", "floor_ms" (NVFP4's byte floor), with the bf16 run's busy time
and floor, the bytes and the per-window times beside them; and the setup around the runs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import math
import re
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
import jax_fp4.checkpoint as ckpt


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of config.json the forward pass needs. experts = 0: a dense MLP per layer;
    else a Qwen3-MoE layer (experts_per_token of `experts` routed experts, each of
    moe_intermediate features)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    rope_theta: float
    rope_scaling: (
        tuple | None
    )  # ("llama3", factor, low_freq_factor, high_freq_factor, original_max)
    tie_embeddings: bool
    qk_norm: bool = False  # Qwen3's q/k RMS norms (random weights; checkpoints: as stored)
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = False
    # The fused projections' rows as `shards` groups, each holding its share of every part in
    # turn (q, k, v heads; gate, up features): a tensor-parallel placement, where each device's
    # contiguous rows are one group (examples/llm_tensor_parallel.py). 1: the parts in order.
    shards: int = 1

    @classmethod
    def from_json(cls, config: dict) -> Config:
        heads = config["num_attention_heads"]
        theta, scaling = rope_settings(config)
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config.get("intermediate_size", 0),
            vocab=config["vocab_size"],
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=str(config.get("model_type", "")).startswith("qwen3"),
            **moe_settings(config),
        )


# Keys of other mixture-of-experts architectures (Mixtral / Llama 4, DeepSeek): their routing or
# experts differ from Qwen3-MoE's, so they are refused rather than run as it. transformers 5 writes
# Qwen3-MoE's expert count as "num_local_experts" too (and no "num_experts").
_OTHER_MOE_KEYS = ("num_local_experts", "n_routed_experts", "moe_num_experts")
_QWEN3_MOE = "qwen3_moe"


def moe_settings(config: dict) -> dict:
    """Config's mixture-of-experts fields from a config.json with HF Qwen3MoeConfig's keys
    (num_experts, or transformers 5's num_local_experts with model_type "qwen3_moe";
    num_experts_per_tok, moe_intermediate_size, norm_topk_prob); a dense model gives experts = 0.
    What this example does not run raises ValueError: dense MLP layers among the MoE ones
    (mlp_only_layers, decoder_sparse_step > 1), a shared expert (Qwen2-MoE) and other
    architectures' experts."""
    qwen3_moe = config.get("model_type") == _QWEN3_MOE
    for key in _OTHER_MOE_KEYS:
        if config.get(key) and not (qwen3_moe and key == "num_local_experts"):
            raise ValueError(
                f"config.json: {key} = {config[key]} belongs to a mixture-of-experts architecture "
                "this example does not run; it runs Qwen3-MoE's experts (num_experts, or "
                f"num_local_experts with model_type {_QWEN3_MOE!r})"
            )
    experts = int(config.get("num_experts") or 0)
    local = int(config.get("num_local_experts") or 0) if qwen3_moe else 0
    if experts and local and experts != local:
        raise ValueError(
            f"config.json: num_experts = {experts} and num_local_experts = {local} disagree"
        )
    experts = experts or local
    if experts == 0:
        return {}
    if config.get("shared_expert_intermediate_size"):
        raise ValueError(
            "config.json: shared_expert_intermediate_size = "
            f"{config['shared_expert_intermediate_size']}: a shared expert (Qwen2-MoE) is not "
            "supported; this example runs Qwen3-MoE, which has none"
        )
    layers, step = config["num_hidden_layers"], int(config.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    dense = [i for i in range(layers) if i in mlp_only or (i + 1) % step != 0]
    if dense:
        raise ValueError(
            f"config.json: layers {dense[:8]}{'...' if len(dense) > 8 else ''} have a dense MLP "
            f"(mlp_only_layers {sorted(mlp_only)}, decoder_sparse_step {step}); this example runs "
            "every layer as a mixture-of-experts layer"
        )
    top_k = config.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(
            f"config.json: num_experts_per_tok must be an int in [1, num_experts = {experts}], "
            f"got {top_k!r}"
        )
    if not config.get("moe_intermediate_size"):
        raise ValueError("config.json: num_experts is set but moe_intermediate_size is not")
    return {
        "experts": experts,
        "experts_per_token": top_k,
        "moe_intermediate": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
    }


ROPE_TYPES = ("default", "llama3")  # the RoPE types rope_frequencies implements
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_settings(config: dict) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling) of a config.json in either form: transformers 5's
    "rope_parameters" ({"rope_theta", "rope_type", and the type's parameters}; per layer type
    where the model has several, accepted here when all are the same), or the older top-level
    "rope_theta" with "rope_scaling" (None or {"rope_type" / "type", ...}). "rope_parameters"
    wins where both are given. A RoPE type other than ROPE_TYPES, or a partial rotary factor,
    raises ValueError: running it as plain RoPE moves the logits silently."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):  # one entry per layer type
        if len({json.dumps(v, sort_keys=True) for v in params.values()}) > 1:
            raise ValueError(
                f"config.json: rope_parameters differ by layer type ({', '.join(params)}); "
                "this example applies one RoPE to every layer"
            )
        params = next(iter(params.values()))
    legacy = config.get("rope_scaling") or {}
    if not isinstance(legacy, dict):
        raise ValueError(f"config.json: rope_scaling must be an object or null, got {legacy!r}")
    merged = {**legacy, **(params or {})}
    theta = merged.get("rope_theta", config.get("rope_theta"))
    theta = 10000.0 if theta is None else float(theta)
    kind = merged.get("rope_type", merged.get("type")) or "default"
    where = "rope_parameters" if params else "rope_scaling"
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config.json: RoPE type {kind!r} ({where}) is not supported: this example "
            f"implements {' and '.join(map(repr, ROPE_TYPES))}, and any other would give "
            "wrong logits"
        )
    partial = merged.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"config.json: partial_rotary_factor {partial} is not supported (RoPE on "
            "the whole head only)"
        )
    if kind == "default":
        return theta, None
    missing = [key for key in _LLAMA3_KEYS if key not in merged]
    if missing:
        raise ValueError(f"config.json: the llama3 RoPE scaling ({where}) lacks {missing}")
    return theta, ("llama3", *(float(merged[key]) for key in _LLAMA3_KEYS))


def rope_frequencies(cfg: Config) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] (Hugging Face's, llama3 scaling included)."""
    inv_freq = 1.0 / cfg.rope_theta ** (
        np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim
    )
    if cfg.rope_scaling is None:
        return inv_freq
    _, factor, low, high, original = cfg.rope_scaling
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


# ---- weights --------------------------------------------------------------------------------------

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
    embed = jnp.asarray(_tensor(tensors, "model.embed_tokens"), dtype)
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


class RandomTensors(Mapping):
    """A checkpoint's tensors drawn on demand, on the default device, for timing a model's shapes
    without its checkpoint (`random_model`): NVFP4 projections (normal weights / sqrt(K)), stored
    fused (q/k/v and gate/up each quantized as one matrix, so the parts share a global scale, as
    ModelOpt and llm-compressor export them) and, for MoE layers, stacked experts (each expert
    its own global scale) with a bf16 router; unit norms, bf16 embeddings and lm_head. Each
    tensor depends on the seed and its name only."""

    def __init__(self, cfg: Config, *, seed: int = 0, layout: str = "tiled"):
        self._cfg, self._layout, self._key = cfg, layout, jax.random.key(seed)
        q, kv, h = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden
        self._quantized = {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q)}
        if cfg.experts:
            e, i = cfg.experts, cfg.moe_intermediate
            self._quantized.update(
                {"mlp.experts.gate_up_proj": (e, 2 * i, h), "mlp.experts.down_proj": (e, h, i)}
            )
            self._dense = {"mlp.gate.weight": (e, h)}
        else:
            i = cfg.intermediate
            self._quantized.update({"mlp.gate_up_proj": (2 * i, h), "mlp.down_proj": (h, i)})
            self._dense = {}
        self._ones = {"input_layernorm.weight": h, "post_attention_layernorm.weight": h}
        if cfg.qk_norm:
            self._ones.update({"self_attn.q_norm.weight": cfg.head_dim})
            self._ones.update({"self_attn.k_norm.weight": cfg.head_dim})

    def _normal(self, name, shape, scale):
        key = jax.random.fold_in(self._key, zlib.crc32(name.encode()))
        return _normal(key, shape, scale)

    def _recipe(self, name: str) -> Callable | None:
        """How to draw tensor `name`; None if the model has no such tensor."""
        cfg = self._cfg
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if layer is not None:
            if int(layer.group(1)) >= cfg.layers:
                return None
            part = layer.group(2)
            if part in self._quantized:
                shape = self._quantized[part]
                return lambda: _quantized(
                    self._normal(name, shape, 1 / math.sqrt(shape[-1])), self._layout
                )
            if part in self._dense:
                shape = self._dense[part]
                return lambda: self._normal(name, shape, 1 / math.sqrt(shape[-1])).astype(
                    jnp.bfloat16
                )
            if part in self._ones:
                return functools.partial(jnp.ones, (self._ones[part],), jnp.float32)
            return None
        if name == "model.norm.weight":
            return functools.partial(jnp.ones, (cfg.hidden,), jnp.float32)
        if name == "model.embed_tokens.weight":
            return lambda: self._normal(name, (cfg.vocab, cfg.hidden), 1.0).astype(jnp.bfloat16)
        if name == "lm_head.weight":
            scale = 1 / math.sqrt(cfg.hidden)
            return lambda: self._normal(name, (cfg.vocab, cfg.hidden), scale).astype(jnp.bfloat16)
        return None

    def __getitem__(self, name: str):
        recipe = self._recipe(name)
        if recipe is None:
            raise KeyError(name)
        return recipe()

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and self._recipe(name) is not None

    def __iter__(self):
        raise TypeError("RandomTensors draws its tensors by name; it cannot list them")

    def __len__(self):
        raise TypeError("RandomTensors draws its tensors by name; it has no length")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, scale):
    return jax.random.normal(key, shape, jnp.float32) * scale


def random_model(
    config: dict,
    *,
    seed: int = 0,
    dtype=jnp.bfloat16,
    layout: str = "tiled",
    stack_layers: bool = False,
):
    """(config, params) of a model of this config.json with random weights (`RandomTensors`)."""
    cfg = Config.from_json(config)
    return cfg, assemble(
        cfg, RandomTensors(cfg, seed=seed, layout=layout), dtype, stack_layers=stack_layers
    )


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


# ---- the forward pass -----------------------------------------------------------------------------

ACTIVATIONS = (None, "silu_mul")


def linear(x, w, bias=None, *, norm=None, norm_eps=1e-6, activation=None, residual=None):
    """x [..., K] @ w^T (+ bias) with a decoder layer's fusions: `norm` an RMSNorm weight [K]
    applied to x first (eps `norm_eps`); activation "silu_mul" for a fused gate/up weight [2I, K]
    (rows [:I] gate, [I:] up), giving silu(gate) * up [..., I]; `residual` [..., N out] added last.
    An NVFP4 weight runs through jax_fp4.matmul, which takes them as arguments (the decode GEMV
    applies them in its kernel: no separate launches, no normed copy of x); a dense one through
    XLA's dot, the norm before it and the rest after it in float32, rounded once (XLA fuses them
    into the ops around the dot)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(w, jax_fp4.NVFP4Weight):
        return jax_fp4.matmul(
            x,
            w,
            bias,
            norm_weight=norm,
            norm_eps=norm_eps,
            activation=activation,
            residual=residual,
        )
    if norm is not None:
        x = rms_norm(x, norm, norm_eps)
    y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype))
    return _epilogue(y if bias is None else y + bias.astype(y.dtype), activation, residual)


def _epilogue(y, activation, residual):
    """silu(gate) * up of y's halves (activation "silu_mul") and + residual, in float32, rounded
    once to y's dtype."""
    if activation is None and residual is None:
        return y
    out = y.astype(jnp.float32)
    if activation == "silu_mul":
        gate, up = jnp.split(out, 2, axis=-1)
        out = jax.nn.silu(gate) * up
    if residual is not None:
        out = out + residual.astype(jnp.float32)
    return out.astype(y.dtype)


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * weight).astype(
        x.dtype
    )


def apply_rope(x, positions, inv_freq):
    """x [B, S, heads, head_dim] rotated by positions [S] (Hugging Face's rotate-half pairing)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [S, hd / 2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(cfg: Config, h, layer):
    """q [B, S, heads, head_dim], k and v [B, S, kv_heads, head_dim] of the layer's input h: one
    matmul with the input norm folded in (fused q/k/v), or the norm then three."""
    b, s, _ = h.shape
    q_size, kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if "qkv_proj" in layer:
        qkv = linear(
            h,
            layer["qkv_proj"],
            layer.get("qkv_proj_bias"),
            norm=layer["input_layernorm"],
            norm_eps=cfg.rms_eps,
        )
        q, k, v = split_fused(qkv, [q_size, kv_size, kv_size], cfg.shards)
    else:
        x = rms_norm(h, layer["input_layernorm"], cfg.rms_eps)
        q, k, v = (linear(x, layer[p], layer.get(f"{p}_bias")) for p in FUSED["qkv_proj"])
    return (
        q.reshape(b, s, cfg.heads, cfg.head_dim),
        k.reshape(b, s, cfg.kv_heads, cfg.head_dim),
        v.reshape(b, s, cfg.kv_heads, cfg.head_dim),
    )


def _mlp(cfg: Config, h, layer):
    """h + the MLP of h: gate/up as one matmul with the norm and SiLU(gate) * up folded in, then
    down_proj adding the residual; or the norm and the parts one by one."""
    if "gate_up_proj" in layer and cfg.shards > 1:
        # Each shard's gate rows pair with its own up rows, not with row j + I of the whole.
        y = linear(
            h, layer["gate_up_proj"], norm=layer["post_attention_layernorm"], norm_eps=cfg.rms_eps
        )
        gated = silu_mul(*split_fused(y, [cfg.intermediate] * 2, cfg.shards))
    elif "gate_up_proj" in layer:
        gated = linear(
            h,
            layer["gate_up_proj"],
            norm=layer["post_attention_layernorm"],
            norm_eps=cfg.rms_eps,
            activation="silu_mul",
        )
    else:
        x = rms_norm(h, layer["post_attention_layernorm"], cfg.rms_eps)
        gated = silu_mul(linear(x, layer["gate_proj"]), linear(x, layer["up_proj"]))
    return linear(gated, layer["down_proj"], residual=h)


def split_fused(y, sizes, shards: int = 1):
    """The parts [..., size] of a fused projection's output y [..., sum(sizes)] whose rows are
    `shards` groups, each holding sizes / shards rows of every part in turn (Config.shards)."""
    if shards == 1:
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    grouped = y.reshape(*y.shape[:-1], shards, y.shape[-1] // shards)
    parts = jnp.split(grouped, np.cumsum([s // shards for s in sizes])[:-1].tolist(), axis=-1)
    return [p.reshape(*y.shape[:-1], size) for p, size in zip(parts, sizes)]


def silu_mul(gate, up):
    """silu(gate) * up in float32, rounded once to gate's dtype."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def experts_matmul(a, w, group_sizes, activation=None):
    """a [M, K], rows sorted by expert (group_sizes [E] of them each), times each row's expert:
    [M, N] in a's dtype; activation "silu_mul" on fused gate/up experts gives silu(gate) * up
    [M, N / 2]. NVFP4 experts w [E, N, K] (as checkpoints store each expert) through
    jax_fp4.ragged_matmul, which reads only the experts that have rows and runs silu_mul in its
    kernel; dense ones [E, K, N] (jax.lax.ragged_dot's own layout) through ragged_dot."""
    if isinstance(w, jax_fp4.NVFP4Weight):
        return jax_fp4.ragged_matmul(a, w, group_sizes, activation=activation)
    y = jax.lax.ragged_dot(a, w.astype(a.dtype), group_sizes)
    return silu_mul(*jnp.split(y, 2, -1)) if activation == "silu_mul" else y


def mixture_of_experts(cfg: Config, x, router, experts: dict):
    """The MoE block on normed tokens x [T, H]: float32 [T, H], the sum over each token's top-k
    experts of its router weight times the expert's down(silu(gate(x)) * up(x))."""
    t, k = x.shape[0], cfg.experts_per_token
    # The router's logits in x's dtype, as HF's; their float32 softmax, top k (renormalised where
    # norm_topk_prob) and the (token, slot) pairs grouped by expert: one GPU kernel when decoding.
    r = jax_fp4.route_top_k(linear(x, router), k, renormalize=cfg.norm_topk_prob)
    group_sizes = r.group_sizes
    rows = x[r.order // k]
    if "gate_up_proj" in experts:
        hidden = experts_matmul(rows, experts["gate_up_proj"], group_sizes, "silu_mul")
    else:
        gate = experts_matmul(rows, experts["gate_proj"], group_sizes)
        hidden = silu_mul(gate, experts_matmul(rows, experts["up_proj"], group_sizes))
    out = experts_matmul(hidden, experts["down_proj"], group_sizes)
    # Back to (token, slot) order through the inverse permutation, then each token's k outputs
    # summed in slot order: a gather and a fixed-order sum, where a scatter-add of the pairs onto
    # their tokens would add in the order the GPU's atomics happen to land (not bit-reproducible).
    out = out[r.inverse].astype(jnp.float32).reshape(t, k, -1)
    return jnp.sum(out * r.weights[..., None], axis=1)


def _moe(cfg: Config, h, layer):
    """h + the MoE block of h (its post-attention norm first)."""
    b, s, d = h.shape
    x = rms_norm(h, layer["post_attention_layernorm"], cfg.rms_eps).reshape(b * s, d)
    y = mixture_of_experts(cfg, x, layer["router"], layer["experts"]).reshape(b, s, d)
    return (h.astype(jnp.float32) + y).astype(h.dtype)


def _layer(cfg: Config, inv_freq, positions, h, layer, k_cache, v_cache):
    """One decoder layer on h [B, S, hidden] at positions [S]; caches [B, kv_heads, T, head_dim]."""
    b, s, _ = h.shape
    q, k, v = _qkv(cfg, h, layer)
    if "q_norm" in layer:
        q, k = rms_norm(q, layer["q_norm"], cfg.rms_eps), rms_norm(k, layer["k_norm"], cfg.rms_eps)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    # The caches hold each head's positions together ([B, kv_heads, T, head_dim]): the layout of
    # the attention's batched matmuls, read where it lies. Caches of [B, T, kv_heads, head_dim]
    # were transposed whole, every layer of every step (XLA's CPU program; docs/design.md).
    k_cache = jax.lax.dynamic_update_slice_in_dim(
        k_cache, k.swapaxes(1, 2).astype(k_cache.dtype), positions[0], axis=2
    )
    v_cache = jax.lax.dynamic_update_slice_in_dim(
        v_cache, v.swapaxes(1, 2).astype(v_cache.dtype), positions[0], axis=2
    )

    # Grouped-query attention on the caches' own dtype, accumulated in float32 (the product with
    # the values rounds to that dtype, as the next projection takes it): no float32 copy of the
    # caches to read (an H100 at 1024-2048 new tokens: 3-4% off the step; benchmarks/RESULTS.md).
    group = cfg.heads // cfg.kv_heads
    qg = q.reshape(b, s, cfg.kv_heads, group, cfg.head_dim).astype(k_cache.dtype)
    scores = jnp.einsum(
        "bskgd,bktd->bkgst", qg, k_cache, preferred_element_type=jnp.float32
    ) / math.sqrt(cfg.head_dim)
    visible = jnp.arange(k_cache.shape[2])[None, :] <= positions[:, None]  # [S, T], causal
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(v_cache.dtype)
    attn = jnp.einsum("bkgst,bktd->bskgd", probs, v_cache)
    attn = attn.reshape(b, s, cfg.heads * cfg.head_dim).astype(h.dtype)
    h = linear(attn, layer["o_proj"], residual=h)
    h = _moe(cfg, h, layer) if "experts" in layer else _mlp(cfg, h, layer)
    return h, k_cache, v_cache


def forward(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """Logits [B, S, vocab] (float32) of tokens [B, S] placed at positions start .. start + S - 1,
    and the caches with their keys and values written. The caches are `empty_cache`'s for these
    params: a list of [B, kv_heads, T, head_dim] arrays per layer for unrolled layers, one
    [layers, B, kv_heads, T, head_dim] array for stacked ones."""
    positions = start + jnp.arange(tokens.shape[1])
    h = params["embed"][tokens]
    layer_step = functools.partial(_layer, cfg, params["inv_freq"], positions)
    stacked = isinstance(params["layers"], dict)
    if stacked == isinstance(k_cache, (list, tuple)):
        expected = "one stacked array" if stacked else "a list of arrays, one per layer"
        raise TypeError(
            f"forward: k_cache must be {expected} for these params' "
            f"{'stacked' if stacked else 'unrolled'} layers (empty_cache makes it), "
            f"got {type(k_cache).__name__}"
        )
    if stacked:  # assemble's stack_layers: one layer compiled, under lax.scan

        def body(h, xs):
            h, k_layer, v_layer = layer_step(h, *xs)
            return h, (k_layer, v_layer)

        h, (k_cache, v_cache) = jax.lax.scan(body, h, (params["layers"], k_cache, v_cache))
    else:  # unrolled: every weight passed to its kernel as the buffer it is, and each layer's
        # cache its own buffer, which the step's keys and values update in place (a stacked cache
        # was copied a layer at a time through .at[i].set: an H100 at batch 1 and 2048 new tokens
        # took 3.98 ms a step that way, 3.30 this way).
        k_cache, v_cache = list(k_cache), list(v_cache)
        for i, layer in enumerate(params["layers"]):
            h, k_cache[i], v_cache[i] = layer_step(h, layer, k_cache[i], v_cache[i])
    logits = linear(rms_norm(h, params["norm"], cfg.rms_eps), params["lm_head"])
    return logits.astype(jnp.float32), k_cache, v_cache


def empty_cache(cfg: Config, params: dict, batch: int, max_len: int, sharding=None):
    """Zeroed key and value caches for `forward` on these params, in their embedding's dtype;
    `sharding` (e.g. a NamedSharding of one cache array) places each array, else the default
    device holds them."""
    shape, dtype = (batch, cfg.kv_heads, max_len, cfg.head_dim), params["embed"].dtype
    if isinstance(params["layers"], dict):
        shape, count = (cfg.layers, *shape), 2
    else:
        count = 2 * cfg.layers
    zeros = [jnp.zeros(shape, dtype, device=sharding) for _ in range(count)]
    if isinstance(params["layers"], dict):
        return zeros[0], zeros[1]
    return zeros[: cfg.layers], zeros[cfg.layers :]


def greedy_step(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """`forward`, then each sequence's next token [B, 1] (argmax of the last position's logits),
    and the caches."""
    logits, k_cache, v_cache = forward(cfg, params, tokens, start, k_cache, v_cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], k_cache, v_cache


def advance(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """`greedy_step`, and the position after these tokens: (next tokens [B, 1], start + S,
    k_cache, v_cache). A loop feeds the position back as it came, an int32 array on the device, so
    a step takes no value from the host."""
    token, k_cache, v_cache = greedy_step(cfg, params, tokens, start, k_cache, v_cache)
    return token, start + tokens.shape[1], k_cache, v_cache


def prefill(cfg: Config, params: dict, prompt, k_cache, v_cache, length: int):
    """`advance` over prompt [B, P] from position 0, as the decode state `decode` steps on:
    (history [B, length] int32 holding the prompt and the first new token at column P, start = P,
    k_cache, v_cache)."""
    token, start, k_cache, v_cache = advance(
        cfg, params, prompt, jnp.zeros((), jnp.int32), k_cache, v_cache
    )
    batch, p = prompt.shape
    history = jnp.zeros((batch, length), jnp.int32).at[:, :p].set(prompt).at[:, p].set(token[:, 0])
    return history, start, k_cache, v_cache


def decode(cfg: Config, params: dict, history, start, k_cache, v_cache):
    """One decode step on the state `prefill` makes: the tokens at column `start` of history
    [B, T] go through `forward` at that position, and the next ones are written at start + 1:
    (history, start + 1, k_cache, v_cache). Every buffer of the state comes back as the step's
    output, donated on GPUs, so a step allocates nothing and XLA's CUDA graphs keep their
    addresses: an H100 at batch 1 spends 0.9 ms of host time on a Llama-3-8B step this way,
    1.4 ms when each step returns a new token array, 2.9 ms when the loop also keeps them."""
    tokens = jax.lax.dynamic_slice_in_dim(history, start, 1, axis=1)
    token, start, k_cache, v_cache = advance(cfg, params, tokens, start, k_cache, v_cache)
    history = jax.lax.dynamic_update_slice_in_dim(history, token, start, axis=1)
    return history, start, k_cache, v_cache


def _donated_on_gpus(*argnums) -> tuple:
    return argnums if jax.default_backend() != "cpu" else ()


@functools.cache
def _jitted_prefill(cfg: Config, donate: tuple):
    return jax.jit(functools.partial(prefill, cfg), static_argnums=4, donate_argnums=donate)


@functools.cache
def _jitted_decode(cfg: Config, donate: tuple):
    return jax.jit(functools.partial(decode, cfg), donate_argnums=donate)


def prefill_step(cfg: Config):
    """`prefill` jitted (params, prompt, k_cache, v_cache, length), its caches donated on GPUs;
    one per config, so every `generate` of a model reuses its compiled programs."""
    return _jitted_prefill(cfg, _donated_on_gpus(2, 3))


def decode_step(cfg: Config):
    """`decode` jitted (params, history, start, k_cache, v_cache), its whole state donated
    (updated in place) on GPUs; one per config, as `prefill_step`."""
    return _jitted_decode(cfg, _donated_on_gpus(1, 2, 3, 4))


TIMING_WINDOW = 16  # decode steps between the timer's host syncs
GPU_BUSY_STEPS = 8  # decode steps in --gpu-busy's profile


def generate(
    cfg: Config,
    params: dict,
    prompt,
    max_new_tokens: int,
    *,
    gpu_busy_steps: int = 0,
    cache_sharding=None,
) -> tuple[np.ndarray, dict]:
    """Greedy continuation of prompt [B, P] (equal lengths): (tokens [B, max_new_tokens], timings).
    One jitted call per token (`decode_step`) on a state that stays on the device: the tokens so
    far, the position (an int32) and the caches [B, kv_heads, P + max_new_tokens, head_dim], all
    updated in place on GPUs.

    gpu_busy_steps > 0: afterwards, that many more decode steps (at most max_new_tokens, over the
    last positions again: a step's work does not depend on its position, attention reading the
    whole cache) run under a jax.profiler trace; timings["gpu_busy_ms"] is the GPU's busy time per
    step (`gpu_busy_ms`; None without a GPU). cache_sharding: where each cache array lives
    (`empty_cache`), e.g. split over kv heads for a tensor-parallel model."""
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be at least 1, got {max_new_tokens}")
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    total = length + max_new_tokens
    k_cache, v_cache = empty_cache(cfg, params, batch, total, cache_sharding)
    step = decode_step(cfg)
    t0 = time.perf_counter()
    state = prefill_step(cfg)(params, prompt, k_cache, v_cache, total)
    state[0].block_until_ready()
    prefill_s = time.perf_counter() - t0  # compilation included
    timed_from = 3  # steps 1-2 compile and warm the decode step
    # The host waits for the GPU every TIMING_WINDOW steps (a few us a step): each window's rate
    # tells a one-off stall apart from the steady rate (a batch-1 run on the H200 once took 7.4 ms
    # a step over 61 steps where the same step took 3.1 in the runs around it).
    marks = []  # (step, time) at the window bounds
    for i in range(1, max_new_tokens):
        if i >= timed_from and (i - timed_from) % TIMING_WINDOW == 0:
            state[0].block_until_ready()
            marks.append((i, time.perf_counter()))
        state = step(params, *state)
    state[0].block_until_ready()
    if marks:
        marks.append((max_new_tokens, time.perf_counter()))
    decode_s = marks[-1][1] - marks[0][1] if marks else 0.0
    windows = [(t1 - t0) / (i1 - i0) for (i0, t0), (i1, t1) in zip(marks, marks[1:])]
    history, _, k_cache, v_cache = state
    tokens = np.asarray(history[:, length:])
    timings = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": max(max_new_tokens - timed_from, 0),
        "window_s_per_step": windows,
    }
    if gpu_busy_steps > 0:
        n = min(gpu_busy_steps, max_new_tokens)
        # From position total - n the steps write history up to its last column (and once past
        # it, which dynamic_update_slice clamps): the tokens above are already read. One step
        # outside the trace compiles the decode step where the loop did not.
        state = step(params, history, jnp.full((), total - n, jnp.int32), k_cache, v_cache)

        def run():
            nonlocal state
            for _ in range(n):
                state = step(params, *state)
            return state[0]

        timings["gpu_busy_ms"] = gpu_busy_ms(run, n)
    return tokens, timings


# ---- measurements: GPU-busy time, streaming-read bandwidth, bytes a step reads --------------------


def gpu_busy_ms(run: Callable[[], object], steps: int) -> float | None:
    """Calls run() (which launches `steps` steps, e.g. of a jitted decode step, and returns what
    they compute) under a jax.profiler trace and waits for its result: the time per step, in ms,
    that the GPU's streams were busy (the union of their kernels' intervals, from
    `profile_summary`). None where the trace holds no GPU (a CPU run). Close to the wall time of
    the same steps run back to back, the GPU never waited for the host."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(run())
        finally:
            jax.profiler.stop_trace()
        xplane = next(Path(trace_dir).rglob("*.xplane.pb"), None)
        if xplane is None:
            return None
        summary = profile_summary(xplane, steps)
    return summary["gpu_busy_ms_per_step"] if summary["gpu_events_per_step"] else None


def _union_ns(intervals) -> int:
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy


def profile_summary(xplane, steps: int) -> dict:
    """What a jax.profiler trace (its .xplane.pb file) of `steps` steps says per step: the time
    the GPU's streams are busy (the union of the events on the "Stream" lines of the /device:GPU
    planes) and their event count, the span from the first to the last GPU event, the events per
    GPU line, the GPU's longest kinds of kernels and the host's longest kinds of events."""
    data = jax.profiler.ProfileData.from_file(str(xplane))
    gpu, gpu_lines, host, kernels = [], {}, collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if plane.name.startswith("/device:GPU"):
                events = [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
                gpu_lines[f"{plane.name} {line.name}"] = len(events)
                if line.name.startswith("Stream"):
                    gpu += events
                    for e in line.events:  # per kernel: "loop_fusion_12" -> "loop_fusion"
                        kernels[re.sub(r"[._]\d+$", "", e.name.split("<")[0])[:60]] += e.duration_ns
            elif plane.name.startswith("/host:CPU") and line.name != "python":
                for e in line.events:  # per kind of op: "ffi_call.25" -> "ffi_call"
                    host[re.sub(r"\.\d+$", "", e.name)[:60]] += e.duration_ns
    window = (max(b for _, b in gpu) - min(a for a, _ in gpu)) if gpu else 0
    return {
        "gpu_busy_ms_per_step": _union_ns(gpu) / steps / 1e6,
        "gpu_events_per_step": len(gpu) / steps,
        "gpu_window_ms_per_step": window / steps / 1e6,
        "gpu_lines": gpu_lines,
        "gpu_top_ms_per_step": {name: ns / steps / 1e6 for name, ns in kernels.most_common(16)},
        "host_top_ms_per_step": {name: ns / steps / 1e6 for name, ns in host.most_common(12)},
    }


@functools.partial(jax.jit, static_argnums=1)
def _read(buffer, reads: int):
    # Each pass XORs the words with the sum so far (free inside the reduction): the passes depend
    # on each other, so XLA can neither merge them into one read nor run them side by side.
    def body(_, total):
        return total + jnp.sum(buffer ^ total, dtype=jnp.uint32)

    return jax.lax.fori_loop(0, reads, body, jnp.uint32(0))


def read_bandwidth(nbytes: int | None = None, *, reads: int = 8, repeats: int = 3) -> float:
    """The streaming-read bandwidth of jax's default device, in bytes/s: `reads` passes of a
    jitted uint32 sum over a buffer of `nbytes` (default 1 GiB on a GPU, several times its L2, or
    64 MiB elsewhere) in one call, the fastest of `repeats` calls. The yardstick of a decode
    step's byte floor: what an XLA kernel streaming that much memory reaches."""
    if nbytes is None:
        nbytes = 2**30 if jax.default_backend() == "gpu" else 2**26
    words = max(nbytes // 4, 1)
    buffer = jax.random.bits(jax.random.key(0), (words,), jnp.uint32)
    _read(buffer, reads).block_until_ready()  # compiles
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        _read(buffer, reads).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return reads * 4 * words / best


def expected_active_experts(cfg: Config, tokens: int) -> float:
    """Experts per MoE layer that `tokens` tokens visit, expected under uniform random top-k
    routing: E (1 - (1 - k / E)^tokens)."""
    if not cfg.experts:
        return 0.0
    return cfg.experts * (1 - (1 - cfg.experts_per_token / cfg.experts) ** tokens)


def step_bytes(params: dict, *, active_experts: float | None = None) -> int:
    """Bytes of weight a decode step reads: every array but the embedding table, of which a step
    gathers only its tokens' rows (a tied lm_head still reads it whole). MoE experts: all of them,
    or with active_experts (e.g. `expected_active_experts`) that many of each layer's E."""

    def nbytes(tree) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))

    total = nbytes({name: value for name, value in params.items() if name != "embed"})
    if active_experts is None:
        return total
    layers = params["layers"]
    stacks = (
        [layer["experts"] for layer in layers if "experts" in layer]
        if isinstance(layers, list)
        else [layers["experts"]] * ("experts" in layers)
    )
    for experts in stacks:
        count = jax.tree.leaves(experts)[0].shape[-3]  # [..., E, N, K] stacks
        total -= round(nbytes(experts) * (1 - min(active_experts, count) / count))
    return total


def cache_bytes(cfg: Config, batch: int, length: int, dtype=jnp.bfloat16) -> int:
    """Bytes of the KV caches a decode step reads whole (keys and values of every layer)."""
    return 2 * cfg.layers * batch * cfg.kv_heads * length * cfg.head_dim * jnp.dtype(dtype).itemsize


# ---- the demo checkpoint and the command line -----------------------------------------------------

DEMO_CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}

ROUTER_SCALE = 2.0  # the demo routers' logits have about this standard deviation


def write_demo_checkpoint(
    path,
    config: dict = DEMO_CONFIG,
    *,
    seed: int = 0,
    qk_norm: bool = False,
    qkv_bias: bool = False,
    convention: str = "modelopt",
    shared_scales: bool = True,
) -> dict:
    """A random Llama-style model at `path` as an NVFP4 checkpoint in the layout of ModelOpt or of
    llm-compressor (`convention` "compressed-tensors"): projections NVFP4, embeddings, norms and
    lm_head bf16; or, `convention` "bf16", all of it bf16 (the model before quantization). A
    config with "num_experts" makes it a Qwen3-MoE model: a bf16 router (mlp.gate) and per-expert
    projections mlp.experts.{e}.{gate,up,down}_proj in place of the MLP.
    shared_scales: q/k/v, and gate/up (of the MLP or of each expert), are each quantized as one
    matrix and stored as their parts, which then share one global scale, as the tools export
    them; False quantizes every projection alone (different global scales).
    Returns its tensors (NVFP4Weight per projection, or bf16 arrays), by Hugging Face name."""
    if convention not in ("modelopt", "compressed-tensors", "bf16"):
        raise ValueError(
            f"convention must be 'modelopt', 'compressed-tensors' or 'bf16', got {convention!r}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = Config.from_json(config)
    rng = np.random.default_rng(seed)
    dense = {
        "model.embed_tokens.weight": rng.standard_normal((cfg.vocab, cfg.hidden)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(cfg.hidden),
        "lm_head.weight": rng.standard_normal((cfg.vocab, cfg.hidden)) / math.sqrt(cfg.hidden),
    }
    quantized = {}

    def group(names, shapes):
        """Random [N, K] / sqrt(K) weights of one group of projections, stored by name."""
        ws = [rng.standard_normal((n, k)) / math.sqrt(k) for n, k in shapes]
        if convention == "bf16":
            dense.update((f"{name}.weight", w) for name, w in zip(names, ws))
        elif shared_scales and len(ws) > 1:
            joint = jax_fp4.quantize(np.concatenate(ws).astype(np.float32))
            quantized.update(zip(names, split_rows(joint, [n for n, _ in shapes])))
        else:
            quantized.update(
                (name, jax_fp4.quantize(w.astype(np.float32))) for name, w in zip(names, ws)
            )

    shapes = projection_shapes(cfg)
    for i in range(cfg.layers):
        prefix = f"model.layers.{i}"
        attention = [f"{prefix}.self_attn.{name}" for name in FUSED["qkv_proj"]]
        group(attention, [shapes[name] for name in FUSED["qkv_proj"]])
        group([f"{prefix}.self_attn.o_proj"], [shapes["o_proj"]])
        if qkv_bias:
            for name, (n, _) in zip(attention, (shapes[p] for p in FUSED["qkv_proj"])):
                dense[f"{name}.bias"] = 0.1 * rng.standard_normal(n)
        if cfg.experts:
            dense[f"{prefix}.mlp.gate.weight"] = (
                ROUTER_SCALE
                * rng.standard_normal((cfg.experts, cfg.hidden))
                / math.sqrt(cfg.hidden)
            )
            inter = cfg.moe_intermediate
            for e in range(cfg.experts):
                expert = f"{prefix}.mlp.experts.{e}"
                group([f"{expert}.gate_proj", f"{expert}.up_proj"], [(inter, cfg.hidden)] * 2)
                group([f"{expert}.down_proj"], [(cfg.hidden, inter)])
        else:
            group(
                [f"{prefix}.mlp.{name}" for name in FUSED["gate_up_proj"]],
                [shapes[name] for name in FUSED["gate_up_proj"]],
            )
            group([f"{prefix}.mlp.down_proj"], [shapes["down_proj"]])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[f"{prefix}.{norm}.weight"] = 1 + 0.1 * rng.standard_normal(cfg.hidden)
        if qk_norm:
            for norm in ("q_norm", "k_norm"):
                dense[f"{prefix}.self_attn.{norm}.weight"] = 1 + 0.1 * rng.standard_normal(
                    cfg.head_dim
                )
    tensors = {name: np.asarray(v, np.float32).astype(jnp.bfloat16) for name, v in dense.items()}
    tensors.update(quantized)
    if convention != "compressed-tensors":
        ckpt.save_safetensors(
            tensors, path / "model.safetensors"
        )  # writes NVFP4Weight the ModelOpt way
    else:
        stored = {name: v for name, v in tensors.items() if name not in quantized}
        for name, w in quantized.items():
            stored.update(ckpt.to_compressed_tensors(w, name))
        ckpt.save_safetensors(stored, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return tensors


PRESETS = {  # config.json of public models, for --random
    "llama3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
    },
    "qwen3-moe-tiny": {  # Qwen3-MoE's structure at test size
        "model_type": "qwen3_moe",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "vocab_size": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
    },
    "demo": DEMO_CONFIG,
}


def _tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    file = path / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None


def _report(name: str, batch: int, timings: dict, weight_bytes: int, floor_bytes: int, read_bps):
    """Prints one run's timings; returns them as the --json record's entry."""
    steps = timings["decode_steps"]
    record = {
        "prefill_ms": timings["prefill_s"] * 1e3,
        "decode_steps": steps,
        "weight_bytes_per_step": weight_bytes,
        "floor_bytes_per_step": floor_bytes,
        "floor_ms": floor_bytes / read_bps * 1e3 if read_bps else None,
        "gpu_busy_ms": timings.get("gpu_busy_ms"),
    }
    if steps:
        step_s = timings["decode_s"] / steps
        windows = [w * 1e3 for w in timings.get("window_s_per_step", [])]
        record.update(
            ms_per_step=step_s * 1e3,
            tokens_per_s=batch / step_s,
            weight_gb_per_s=weight_bytes / step_s / 1e9,
            window_ms_per_step=windows,
        )
    spread = (
        f"; {TIMING_WINDOW}-step windows {min(record['window_ms_per_step']):.2f}-"
        f"{max(record['window_ms_per_step']):.2f} ms a step"
        if steps and len(record["window_ms_per_step"]) > 1
        else ""
    )
    extra = []
    if record["gpu_busy_ms"] is not None:
        extra.append(f"GPU busy {record['gpu_busy_ms']:.2f} ms a step")
    if record["floor_ms"] is not None:
        extra.append(
            f"byte floor {record['floor_ms']:.2f} ms ({floor_bytes / 1e9:.3g} GB at "
            f"{read_bps / 1e9:.0f} GB/s)"
        )
    print(
        f"{name}: prefill {record['prefill_ms']:.0f} ms (compilation included)"
        + (
            f"; decode {record['tokens_per_s']:.1f} tokens/s ({record['ms_per_step']:.2f} ms a step, "
            f"batch {batch}, {steps} steps{spread}; weights read at "
            f"{record['weight_gb_per_s']:.1f} GB/s)"
            if steps
            else ""
        )
        + "".join(f"; {text}" for text in extra)
    )
    return record


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive int or a comma-separated list of them, got {text!r}"
        )
    return values


def _first_nvfp4(layers):
    """Layer 0's first NVFP4 projection (None if it has none), for the dispatch path."""
    layer = jax.tree.map(lambda x: x[0], layers) if isinstance(layers, dict) else layers[0]
    for name in ("qkv_proj", "q_proj", "o_proj"):
        if isinstance(layer.get(name), jax_fp4.NVFP4Weight):
            return layer[name]
    return None


def run_batch(
    cfg: Config,
    params: dict,
    dense: dict | None,
    prompt,
    max_new_tokens: int,
    *,
    model: str,
    read_bps: float | None,
    gpu_busy_steps: int = 0,
    tokenizer=None,
    quantized: bool = False,
) -> dict:
    """One batch of the command line: greedy generation from prompt [B, P] with params, and with
    `dense` (its bf16 twin, or None), printed; returns the run's --json record ("model", "batch",
    "context" = P + max_new_tokens, "nvfp4_ms" = "loop_ms", "bf16_ms", "ratio" = bf16_ms /
    nvfp4_ms, "gpu_busy_ms", "floor_ms", ... and each side's details). read_bps: the
    streaming-read bandwidth (`read_bandwidth`) of the floors; quantized: the bf16 side holds the
    checkpoint's own weights (--quantize), not the NVFP4 ones dequantized."""
    prompt = np.asarray(prompt)
    batch, length = prompt.shape
    context = length + max_new_tokens
    paths, weight = {}, _first_nvfp4(params["layers"])
    if weight is not None:
        device = next(iter(params["embed"].devices()))
        paths = {
            stage: jax_fp4.dispatch_path(jnp.zeros((m, weight.k), params["embed"].dtype), weight)
            for stage, m in (("prefill", prompt.size), ("decode", batch))
        }
        print(
            f"batch {batch}: device {device.platform} ({device.device_kind}); jax_fp4 path: "
            f"prefill {paths['prefill']}, decode {paths['decode']}"
        )
    tokens, timings = generate(cfg, params, prompt, max_new_tokens, gpu_busy_steps=gpu_busy_steps)
    print(f"generated: {tokens[0].tolist()}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(tokens[0].tolist())!r}")
    active = expected_active_experts(cfg, batch) if cfg.experts else None
    cache = cache_bytes(cfg, batch, context, params["embed"].dtype)

    def report(name, weights, timings):
        floor = step_bytes(weights, active_experts=active) + cache
        return _report(name, batch, timings, step_bytes(weights), floor, read_bps)

    record = report("NVFP4 (jax_fp4)", params, timings)
    run = {
        "model": model,
        "batch": batch,
        "context": context,
        "prompt_len": length,
        "new_tokens": max_new_tokens,
        "nvfp4_ms": record.get("ms_per_step"),
        "loop_ms": record.get("ms_per_step"),
        "bf16_ms": None,
        "ratio": None,
        "gpu_busy_ms": record["gpu_busy_ms"],
        "floor_ms": record["floor_ms"],
        "nvfp4_over_floor": _ratio(record.get("ms_per_step"), record["floor_ms"]),
        "loop_over_gpu_busy": _ratio(record.get("ms_per_step"), record["gpu_busy_ms"]),
        "expected_active_experts": active,
        "cache_bytes": cache,
        "paths": paths,
        "nvfp4": record,
    }
    if dense is None:
        return run
    dense_tokens, dense_timings = generate(
        cfg, dense, prompt, max_new_tokens, gpu_busy_steps=gpu_busy_steps
    )
    source = "the checkpoint's weights" if quantized else "the same weights dequantized"
    bf16 = report(f"bf16 ({source}, XLA's dot)", dense, dense_timings)
    same = int(np.sum(np.cumprod(dense_tokens[0] == tokens[0])))
    run.update(
        bf16_ms=bf16.get("ms_per_step"),
        ratio=_ratio(bf16.get("ms_per_step"), run["nvfp4_ms"]),
        bf16_gpu_busy_ms=bf16["gpu_busy_ms"],
        bf16_floor_ms=bf16["floor_ms"],
        bf16=bf16,
        same_leading_tokens=same,
    )
    if run["ratio"] is not None:
        print(
            f"NVFP4 against bf16: {run['ratio']:.2f}x the decode rate; the first "
            f"{same} of {tokens.shape[1]} tokens the same"
        )
    return run


def _ratio(a, b):
    return a / b if a is not None and b else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/llm_generate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "checkpoint", nargs="?", help="checkpoint directory (config.json, *.safetensors)"
    )
    source.add_argument(
        "--demo", action="store_true", help="write, read back and run a small random model"
    )
    source.add_argument(
        "--random",
        metavar="PRESET|CONFIG_JSON",
        help=f"random weights for a config.json or a preset ({', '.join(PRESETS)}): timing",
    )
    parser.add_argument(
        "--prompt",
        default="The capital of France is",
        help="the prompt text (needs `tokenizers` and a tokenizer.json beside the weights)",
    )
    parser.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    parser.add_argument(
        "--prompt-len",
        type=int,
        metavar="N",
        help="a prompt of N random token ids (seeded) instead of --prompt",
    )
    parser.add_argument(
        "--batch",
        type=_positive_ints,
        default=[1],
        help="sequences decoded together (the prompt repeated); a comma-separated list "
        "(e.g. 1,8,16) runs each batch size in turn on the same weights",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated greedily")
    parser.add_argument(
        "--num-layers",
        type=int,
        metavar="N",
        help="--random: only the first N layers of the model (its other shapes unchanged)",
    )
    parser.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="tiled",
        help="the NVFP4 weights' layout (tiled: prepacked on load where the shape allows)",
    )
    parser.add_argument(
        "--quantize",
        action="store_true",
        help="quantize a bf16 checkpoint's decoder projections to NVFP4 on load",
    )
    parser.add_argument(
        "--compare-bf16",
        action="store_true",
        help="also run the same weights dequantized to bf16 (XLA's dot) and compare",
    )
    parser.add_argument(
        "--gpu-busy",
        action="store_true",
        help=f"also profile {GPU_BUSY_STEPS} more decode steps (jax.profiler) and print the "
        "time the GPU is busy per step",
    )
    parser.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the layers under lax.scan (compiles one layer; XLA copies each "
        "layer's dense weights out of the stack every step) instead of unrolling them",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help='write {"runs": [...]} (one entry per batch: model, batch, context, nvfp4_ms, '
        "bf16_ms, ratio, gpu_busy_ms, floor_ms, ...) and the setup to this JSON file",
    )
    args = parser.parse_args(argv)
    # The loader says where it dropped a K padding (ModelOpt's, for a K not a multiple of 16).
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jax_fp4.checkpoint").setLevel(logging.INFO)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.prompt_len is not None and (args.prompt_len < 1 or args.prompt_ids):
        parser.error("--prompt-len must be at least 1, and not given with --prompt-ids")
    if args.num_layers is not None and (args.num_layers < 1 or not args.random):
        parser.error("--num-layers takes a count of at least 1, with --random")

    # Measured before the weights take the device's memory.
    read_bps = read_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) if args.demo else Path(args.checkpoint or tmp)
        if args.random:
            config = PRESETS.get(args.random) or json.loads(Path(args.random).read_text())
            if args.num_layers:
                config = dict(config, num_hidden_layers=args.num_layers)
            cfg, params = random_model(config, layout=args.layout, stack_layers=args.scan_layers)
        else:
            if args.demo:
                write_demo_checkpoint(path)
            cfg, params = load_model(
                path, layout=args.layout, quantize=args.quantize, stack_layers=args.scan_layers
            )
        tokenizer = None if args.random else _tokenizer(path)
        # The baseline of --compare-bf16: the checkpoint's own weights in bf16 where --quantize made
        # the NVFP4 ones (a layer stored in NVFP4 dequantized), else the NVFP4 weights dequantized.
        dense = None
        if args.compare_bf16:
            dense = dense_twin(
                load_model(path, layout=args.layout, stack_layers=args.scan_layers)[1]
                if args.quantize
                else params
            )
    model_name = args.random or ("demo" if args.demo else str(args.checkpoint))
    if args.prompt_len:
        ids = np.random.default_rng(0).integers(0, cfg.vocab, args.prompt_len).tolist()
    elif args.prompt_ids or tokenizer is None:
        ids = [int(t) for t in (args.prompt_ids or "1,2,3,4,5").split(",")]
        if not all(0 <= t < cfg.vocab for t in ids):
            parser.error(f"--prompt-ids: token ids must be in [0, {cfg.vocab}), got {ids}")
    else:
        ids = tokenizer.encode(args.prompt).ids

    nvfp4 = [
        w
        for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, jax_fp4.NVFP4Weight))
        if isinstance(w, jax_fp4.NVFP4Weight)
    ]
    device = next(iter(params["embed"].devices()))  # where the model lives, and so runs
    experts = f", {cfg.experts} experts (top {cfg.experts_per_token})" if cfg.experts else ""
    print(
        f"model: {cfg.layers} layers, hidden {cfg.hidden}{experts}, vocab {cfg.vocab}; NVFP4 "
        f"weights {sum(w.nbytes for w in nvfp4) / 2**20:.1f} MiB; streaming read "
        f"{read_bps / 1e9:.0f} GB/s"
    )
    print(f"prompt ({len(ids)} tokens): {ids if len(ids) <= 32 else ids[:32] + ['...']}")
    runs = [
        run_batch(
            cfg,
            params,
            dense,
            np.asarray([ids] * batch),
            args.max_new_tokens,
            model=model_name,
            read_bps=read_bps,
            gpu_busy_steps=GPU_BUSY_STEPS if args.gpu_busy else 0,
            tokenizer=tokenizer,
            quantized=args.quantize,
        )
        for batch in args.batch
    ]
    if args.json:
        record = {
            "command": "python examples/llm_generate.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "device": device.device_kind,
            "platform": device.platform,
            "jax": jax.__version__,
            "model": model_name,
            "config": dataclasses.asdict(cfg),
            "layout": args.layout,
            "scan_layers": args.scan_layers,
            "read_gb_per_s": read_bps / 1e9,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
