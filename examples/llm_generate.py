"""Greedy text generation from an NVFP4 checkpoint of a Llama / Qwen-style decoder, in plain JAX.

A Hugging Face checkpoint directory (config.json + *.safetensors) quantized by NVIDIA ModelOpt or
llm-compressor (compressed-tensors, nvfp4-pack-quantized) loads with jax_fp4.checkpoint, its NVFP4
layers prepacked on the host (a bf16 checkpoint with --quantize: jax_fp4.quantize on load); every
projection then runs through jax_fp4.matmul: the prompt as one prefill (M = batch x prompt
length: the fused GEMM or dequantize + GEMM on a GPU), each new token as a decode step (M = batch:
the decode GEMV), with a KV cache, one jitted call per token:

    python examples/llm_generate.py CHECKPOINT_DIR --prompt "The capital of France is" --max-new-tokens 32
    python examples/llm_generate.py BF16_CHECKPOINT_DIR --quantize --compare-bf16   # NVFP4 against bf16
    python examples/llm_generate.py --demo        # a small random model, written and read back here
    python examples/llm_generate.py --random llama3-8b --batch 4 --compare-bf16   # timing, random weights

--random draws a model of a preset's (or a config.json's) shapes with random weights on the
device; --compare-bf16 decodes the same weights dequantized to bf16 through XLA's dot and prints
the ratio of the decode rates (tokens per second, one jitted call per token, compilation excluded).
The layers are unrolled by default, each weight its own buffer, which every kernel reads where it
lies; --scan-layers stacks them under lax.scan instead (one layer compiled), where XLA copies each
layer's dense weights out of the stack before their dot: on an H100 the bf16 step took 2.5x as
long that way, the NVFP4 one 1.1x (benchmarks/RESULTS.md). Unrolled, each layer's KV cache is its
own buffer, updated in place.

Architectures: Llama (2, 3 and 3.1's "llama3" RoPE scaling), Mistral, Qwen2 (q/k/v biases) and
Qwen3 (q/k RMS norms), told apart by the tensors present (sliding-window attention is not applied:
exact while the sequence fits the window). Embeddings, norms and any layer the
checkpoint keeps in bf16 (often lm_head) stay dense. With `tokenizers` installed and a
tokenizer.json beside the weights the prompt is text, otherwise token ids (`--prompt-ids 1,2,3`).

config.json: the RoPE settings are read from "rope_parameters" (transformers 5, which current
ModelOpt and llm-compressor exports use) or from the top-level "rope_theta" and "rope_scaling"
(older files); RoPE types other than "default" and "llama3" are refused with an error rather than
run with the wrong frequencies. Each projection's true in_features (hidden_size,
intermediate_size, the head counts) is passed to the loader, which drops the zero padding ModelOpt
adds to a K that is not a multiple of 16 and logs what it dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
import jax_fp4.checkpoint as ckpt


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of config.json the forward pass needs."""

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
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


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

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _projection(tensors: dict, name: str, dtype, quantize: str | None = None):
    """An NVFP4Weight as loaded, or a dense [N, K] weight: in the compute dtype, or quantized here
    (jax_fp4.quantize, ModelOpt's algorithm) into the layout `quantize` if that is given."""
    w = tensors.get(name)
    if w is None:
        w = tensors.get(f"{name}.weight")
    if w is None:
        raise KeyError(f"the checkpoint has no layer {name!r}")
    if isinstance(w, jax_fp4.NVFP4Weight):
        return w
    if quantize is None:
        return jnp.asarray(w, dtype)
    return _quantized(jnp.asarray(w, jnp.float32), quantize)


def _quantized(w, layout: str) -> jax_fp4.NVFP4Weight:
    """jax_fp4.quantize(w), prepacked if `layout` is "tiled" and the shape allows it."""
    q = jax_fp4.quantize(w)
    tileable = q.n % 16 == 0 and q.k % 128 == 0  # what jax_fp4.prepack's layout takes
    return jax_fp4.prepack(q) if layout == "tiled" and tileable else q


def _stack(per_layer: list):
    """One pytree with a leading layer axis (NVFP4Weight leaves stack like arrays)."""
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *per_layer)


def projection_shapes(cfg: Config) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection of a layer."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "q_proj": (q, cfg.hidden),
        "k_proj": (kv, cfg.hidden),
        "v_proj": (kv, cfg.hidden),
        "o_proj": (cfg.hidden, q),
        "gate_proj": (cfg.intermediate, cfg.hidden),
        "up_proj": (cfg.intermediate, cfg.hidden),
        "down_proj": (cfg.hidden, cfg.intermediate),
    }


def in_features(cfg: Config) -> dict[str, int]:
    """Each projection's true K (in_features) by layer name, as config.json implies it: what the
    loader needs to strip the zero padding ModelOpt adds to a K that is not a multiple of 16."""
    shapes = projection_shapes(cfg)
    out = {
        f"model.layers.{i}.{'self_attn' if name in _ATTENTION else 'mlp'}.{name}": k
        for i in range(cfg.layers)
        for name, (_, k) in shapes.items()
    }
    out["lm_head"] = cfg.hidden
    return out


def assemble(
    cfg: Config,
    tensors,
    dtype=jnp.bfloat16,
    *,
    quantize: str | None = None,
    stack_layers: bool = False,
) -> dict:
    """The params of `forward` from a checkpoint's tensors (a mapping of Hugging Face names to
    NVFP4Weight or arrays, as jax_fp4.checkpoint.load_safetensors returns): "layers" a list of
    per-layer dicts, or with stack_layers one dict of weights with a leading layer axis for
    lax.scan (every layer must then be stored alike, as quantized checkpoints are).
    quantize: None, or the layout ("spec" / "tiled") into which the decoder layers' dense
    projections are quantized here (a bf16 checkpoint run as NVFP4; lm_head stays dense)."""
    layers = []
    for i in range(cfg.layers):
        prefix = f"model.layers.{i}"
        layer = {
            name: _projection(tensors, f"{prefix}.self_attn.{name}", dtype, quantize)
            for name in _ATTENTION
        }
        layer.update(
            {name: _projection(tensors, f"{prefix}.mlp.{name}", dtype, quantize) for name in _MLP}
        )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            layer[norm] = jnp.asarray(tensors[f"{prefix}.{norm}.weight"], jnp.float32)
        for norm in ("q_norm", "k_norm"):  # Qwen3
            if f"{prefix}.self_attn.{norm}.weight" in tensors:
                layer[norm] = jnp.asarray(tensors[f"{prefix}.self_attn.{norm}.weight"], jnp.float32)
        for proj in ("q_proj", "k_proj", "v_proj"):  # Qwen2
            if f"{prefix}.self_attn.{proj}.bias" in tensors:
                layer[f"{proj}_bias"] = jnp.asarray(
                    tensors[f"{prefix}.self_attn.{proj}.bias"], dtype
                )
        layers.append(layer)
    embed = jnp.asarray(tensors["model.embed_tokens.weight"], dtype)
    head = embed if cfg.tie_embeddings else _projection(tensors, "lm_head", dtype)
    return {
        "embed": embed,
        "layers": _stack(layers) if stack_layers else layers,
        "lm_head": head,
        "norm": jnp.asarray(tensors["model.norm.weight"], jnp.float32),
        "inv_freq": jnp.asarray(rope_frequencies(cfg), jnp.float32),
    }


def load_model(
    path,
    *,
    dtype=jnp.bfloat16,
    layout: str = "tiled",
    quantize: bool = False,
    stack_layers: bool = False,
) -> tuple[Config, dict]:
    """config.json and the weights of a checkpoint directory: (config, params). quantize: the
    decoder layers' dense (bf16 / fp16 / fp32) projections are quantized to NVFP4 on load."""
    path = Path(path)
    cfg = Config.from_json(json.loads((path / "config.json").read_text()))
    tensors = ckpt.load_safetensors(path, layout=layout, in_features=in_features(cfg))
    return cfg, assemble(
        cfg, tensors, dtype, quantize=layout if quantize else None, stack_layers=stack_layers
    )


class RandomTensors(Mapping):
    """A checkpoint's tensors drawn on demand, on the default device: NVFP4 projections (normal
    weights / sqrt(K), quantized), unit norms, bf16 embeddings and lm_head. For timing a model's
    shapes without its checkpoint (`random_model`)."""

    def __init__(self, cfg: Config, *, seed: int = 0, layout: str = "tiled"):
        self._cfg, self._layout, self._key = cfg, layout, jax.random.key(seed)
        self._shapes = projection_shapes(cfg)
        self._count = 0

    def _normal(self, shape, scale):
        self._count += 1
        return _normal(jax.random.fold_in(self._key, self._count), shape, scale)

    def __getitem__(self, name: str):
        cfg, parts = self._cfg, name.split(".")  # model.layers.{i}.{self_attn | mlp}.{projection}
        if parts[:2] == ["model", "layers"] and len(parts) == 5 and parts[4] in self._shapes:
            n, k = self._shapes[parts[4]]
            return _quantized(self._normal((n, k), 1 / math.sqrt(k)), self._layout)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return jnp.ones((cfg.hidden,), jnp.float32)
        if name == "model.embed_tokens.weight":
            return self._normal((cfg.vocab, cfg.hidden), 1.0).astype(jnp.bfloat16)
        if name == "lm_head.weight":
            return self._normal((cfg.vocab, cfg.hidden), 1 / math.sqrt(cfg.hidden)).astype(
                jnp.bfloat16
            )
        raise KeyError(name)

    def __iter__(self):
        raise TypeError("RandomTensors draws its tensors by name; it cannot list them")

    def __len__(self):
        raise TypeError("RandomTensors draws its tensors by name; it has no length")

    def __contains__(self, name) -> bool:
        try:
            return self[name] is not None
        except KeyError:
            return False


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
    """The same model with every NVFP4 weight dequantized to `dtype`: XLA's dot on dense weights."""
    return jax.tree.map(
        lambda w: jax_fp4.dequantize(w, dtype) if isinstance(w, jax_fp4.NVFP4Weight) else w,
        params,
        is_leaf=lambda x: isinstance(x, jax_fp4.NVFP4Weight),
    )


# ---- the forward pass -----------------------------------------------------------------------------


def linear(x, w, bias=None):
    """x [..., K] @ w^T: jax_fp4 for an NVFP4 weight, XLA's dot for a dense one."""
    if isinstance(w, jax_fp4.NVFP4Weight):
        return jax_fp4.matmul(x, w, bias)
    y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype))
    return y if bias is None else y + bias


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


def _layer(cfg: Config, inv_freq, positions, h, layer, k_cache, v_cache):
    """One decoder layer on h [B, S, hidden] at positions [S]; caches [B, kv_heads, T, head_dim]."""
    b, s, _ = h.shape
    x = rms_norm(h, layer["input_layernorm"], cfg.rms_eps)
    q = linear(x, layer["q_proj"], layer.get("q_proj_bias")).reshape(b, s, cfg.heads, cfg.head_dim)
    k = linear(x, layer["k_proj"], layer.get("k_proj_bias")).reshape(
        b, s, cfg.kv_heads, cfg.head_dim
    )
    v = linear(x, layer["v_proj"], layer.get("v_proj_bias")).reshape(
        b, s, cfg.kv_heads, cfg.head_dim
    )
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
    h = h + linear(attn.reshape(b, s, cfg.heads * cfg.head_dim).astype(h.dtype), layer["o_proj"])

    x = rms_norm(h, layer["post_attention_layernorm"], cfg.rms_eps)
    gated = jax.nn.silu(linear(x, layer["gate_proj"])) * linear(x, layer["up_proj"])
    return h + linear(gated, layer["down_proj"]), k_cache, v_cache


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


def empty_cache(cfg: Config, params: dict, batch: int, max_len: int):
    """Zeroed key and value caches for `forward` on these params, in their embedding's dtype."""
    shape, dtype = (batch, cfg.kv_heads, max_len, cfg.head_dim), params["embed"].dtype
    if isinstance(params["layers"], dict):
        return jnp.zeros((cfg.layers, *shape), dtype), jnp.zeros((cfg.layers, *shape), dtype)
    return (
        [jnp.zeros(shape, dtype) for _ in range(cfg.layers)],
        [jnp.zeros(shape, dtype) for _ in range(cfg.layers)],
    )


def greedy_step(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """`forward`, then each sequence's next token [B, 1] (argmax of the last position's logits),
    and the caches."""
    logits, k_cache, v_cache = forward(cfg, params, tokens, start, k_cache, v_cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], k_cache, v_cache


TIMING_WINDOW = 16  # decode steps between the timer's host syncs


def generate(cfg: Config, params: dict, prompt, max_new_tokens: int) -> tuple[np.ndarray, dict]:
    """Greedy continuation of prompt [B, P] (equal lengths): (tokens [B, max_new_tokens], timings).
    One jitted call per token (`greedy_step`), the caches updated in place on GPUs."""
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    k_cache, v_cache = empty_cache(cfg, params, batch, length + max_new_tokens)
    donate = (3, 4) if jax.default_backend() != "cpu" else ()  # the caches, updated in place
    step = jax.jit(functools.partial(greedy_step, cfg), donate_argnums=donate)
    t0 = time.perf_counter()
    token, k_cache, v_cache = step(params, prompt, 0, k_cache, v_cache)
    token.block_until_ready()
    prefill_s = time.perf_counter() - t0  # compilation included
    out, timed_from = [token], 3  # steps 1-2 compile and warm the decode step
    # The host waits for the GPU every TIMING_WINDOW steps (a few us a step): each window's rate
    # tells a one-off stall apart from the steady rate (a batch-1 run on the H200 once took 7.4 ms
    # a step over 61 steps where the same step took 3.1 in the runs around it).
    marks = []  # (step, time) at the window bounds
    for i in range(1, max_new_tokens):
        if i >= timed_from and (i - timed_from) % TIMING_WINDOW == 0:
            token.block_until_ready()
            marks.append((i, time.perf_counter()))
        token, k_cache, v_cache = step(params, token, length + i - 1, k_cache, v_cache)
        out.append(token)
    token.block_until_ready()
    if marks:
        marks.append((max_new_tokens, time.perf_counter()))
    decode_s = marks[-1][1] - marks[0][1] if marks else 0.0
    windows = [(t1 - t0) / (i1 - i0) for (i0, t0), (i1, t1) in zip(marks, marks[1:])]
    # Joined only now: the first concatenate of this many tokens compiles a program, which inside
    # the timed loop added ~4 ms a step to the first of two runs on the H100.
    tokens = np.concatenate([np.asarray(t) for t in out], axis=1)
    return tokens, {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": max(max_new_tokens - timed_from, 0),
        "window_s_per_step": windows,
    }


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


def write_demo_checkpoint(
    path,
    config: dict = DEMO_CONFIG,
    *,
    seed: int = 0,
    qk_norm: bool = False,
    qkv_bias: bool = False,
    convention: str = "modelopt",
) -> dict:
    """A random Llama-style model at `path` as an NVFP4 checkpoint in the layout of ModelOpt or of
    llm-compressor (`convention` "compressed-tensors"): projections NVFP4, embeddings, norms and
    lm_head bf16; or, `convention` "bf16", all of it bf16 (the model before quantization).
    Returns its tensors (NVFP4Weight per projection, or bf16 arrays)."""
    if convention not in ("modelopt", "compressed-tensors", "bf16"):
        raise ValueError(
            f"convention must be 'modelopt', 'compressed-tensors' or 'bf16', got {convention!r}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = Config.from_json(config)
    rng = np.random.default_rng(seed)
    shapes = projection_shapes(cfg)
    dense = {
        "model.embed_tokens.weight": rng.standard_normal((cfg.vocab, cfg.hidden)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(cfg.hidden),
        "lm_head.weight": rng.standard_normal((cfg.vocab, cfg.hidden)) / math.sqrt(cfg.hidden),
    }
    quantized = {}
    for i in range(cfg.layers):
        prefix = f"model.layers.{i}"
        for name, (n, k) in shapes.items():
            kind = "self_attn" if name in _ATTENTION else "mlp"
            w = rng.standard_normal((n, k)) / math.sqrt(k)
            if convention == "bf16":
                dense[f"{prefix}.{kind}.{name}.weight"] = w
            else:
                quantized[f"{prefix}.{kind}.{name}"] = jax_fp4.quantize(w.astype(np.float32))
            if qkv_bias and name in ("q_proj", "k_proj", "v_proj"):
                dense[f"{prefix}.self_attn.{name}.bias"] = 0.1 * rng.standard_normal(n)
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
    "demo": DEMO_CONFIG,
}


def _tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    file = path / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None


def step_bytes(params: dict) -> int:
    """Bytes of weight a decode step reads: every array but the embedding table, of which a step
    gathers only its tokens' rows (a tied lm_head still reads it whole)."""
    return sum(
        leaf.nbytes
        for name, value in params.items()
        if name != "embed"
        for leaf in jax.tree.leaves(value)
    )


def _report(name: str, batch: int, timings: dict, params: dict) -> dict:
    """Prints one run's timings; returns them as the --json record's entry."""
    steps, weight_bytes = timings["decode_steps"], step_bytes(params)
    record = {
        "prefill_ms": timings["prefill_s"] * 1e3,
        "decode_steps": steps,
        "weight_bytes_per_step": weight_bytes,
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
    print(
        f"{name}: prefill {record['prefill_ms']:.0f} ms (compilation included)"
        + (
            f"; decode {record['tokens_per_s']:.1f} tokens/s ({record['ms_per_step']:.2f} ms a step, "
            f"batch {batch}, {steps} steps{spread}; weights read at "
            f"{record['weight_gb_per_s']:.1f} GB/s)"
            if steps
            else ""
        )
    )
    return record


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
        "--batch", type=int, default=1, help="sequences decoded together (the prompt repeated)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated greedily")
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
        "--scan-layers",
        action="store_true",
        help="stack the layers under lax.scan (compiles one layer; XLA copies each "
        "layer's dense weights out of the stack every step) instead of unrolling them",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the timings and the setup to this JSON file"
    )
    args = parser.parse_args(argv)
    # The loader says where it dropped a K padding (ModelOpt's, for a K not a multiple of 16).
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jax_fp4.checkpoint").setLevel(logging.INFO)
    if args.max_new_tokens < 1 or args.batch < 1:
        parser.error("--max-new-tokens and --batch must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) if args.demo else Path(args.checkpoint or tmp)
        if args.random:
            config = PRESETS.get(args.random) or json.loads(Path(args.random).read_text())
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
    if args.prompt_ids or tokenizer is None:
        ids = [int(t) for t in (args.prompt_ids or "1,2,3,4,5").split(",")]
        if not all(0 <= t < cfg.vocab for t in ids):
            parser.error(f"--prompt-ids: token ids must be in [0, {cfg.vocab}), got {ids}")
    else:
        ids = tokenizer.encode(args.prompt).ids
    prompt = np.asarray([ids] * args.batch)

    nvfp4 = [
        w
        for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, jax_fp4.NVFP4Weight))
        if isinstance(w, jax_fp4.NVFP4Weight)
    ]
    device = next(iter(params["embed"].devices()))  # where the model lives, and so runs
    print(
        f"model: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}; NVFP4 weights "
        f"{sum(w.nbytes for w in nvfp4) / 2**20:.1f} MiB"
    )
    layers = params["layers"]
    q_proj = (
        jax.tree.map(lambda x: x[0], layers["q_proj"])
        if isinstance(layers, dict)
        else layers[0]["q_proj"]
    )  # layer 0's
    paths = {}
    if isinstance(q_proj, jax_fp4.NVFP4Weight):
        paths = {
            stage: jax_fp4.dispatch_path(jnp.zeros((m, q_proj.k), params["embed"].dtype), q_proj)
            for stage, m in (("prefill", prompt.size), ("decode", args.batch))
        }
        print(
            f"device: {device.platform} ({device.device_kind}); jax_fp4 path: prefill "
            f"{paths['prefill']}, decode {paths['decode']}"
        )
    print(f"prompt ({len(ids)} tokens): {ids}")
    tokens, timings = generate(cfg, params, prompt, args.max_new_tokens)
    print(f"generated: {tokens[0].tolist()}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(tokens[0].tolist())!r}")
    record = {
        "command": "python examples/llm_generate.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "model": dataclasses.asdict(cfg),
        "batch": args.batch,
        "prompt_tokens": len(ids),
        "new_tokens": args.max_new_tokens,
        "layout": args.layout,
        "scan_layers": args.scan_layers,
        "paths": paths,
        "nvfp4": _report("NVFP4 (jax_fp4)", args.batch, timings, params),
    }
    if args.compare_bf16:
        dense_tokens, dense_timings = generate(cfg, dense, prompt, args.max_new_tokens)
        record["bf16"] = _report(
            "bf16 ("
            + ("the checkpoint's weights" if args.quantize else "the same weights dequantized")
            + ", XLA's dot)",
            args.batch,
            dense_timings,
            dense,
        )
        record["same_leading_tokens"] = int(np.sum(np.cumprod(dense_tokens[0] == tokens[0])))
        if "tokens_per_s" in record["bf16"]:
            record["speedup_over_bf16"] = (
                record["nvfp4"]["tokens_per_s"] / record["bf16"]["tokens_per_s"]
            )
            print(
                f"NVFP4 against bf16: {record['speedup_over_bf16']:.2f}x the decode rate; the first "
                f"{record['same_leading_tokens']} of {tokens.shape[1]} tokens the same"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
