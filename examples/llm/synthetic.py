"""Models without a checkpoint: random weights of a config's shapes drawn on the device
(`random_model`, for timing a model's shapes), and a small random checkpoint written in ModelOpt's
or llm-compressor's layout (`write_demo_checkpoint`, for --demo and the tests)."""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
import jax_fp4.checkpoint as ckpt

from .config import DEMO_CONFIG, Config
from .weights import FUSED, _quantized, assemble, projection_shapes, split_rows


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


def random_prompts(vocab: int, batch: int, length: int, *, seed: int = 0) -> np.ndarray:
    """Token ids [batch, length] in [0, vocab), each row a prompt of its own (so a
    mixture-of-experts model's rows route as distinct sequences do), row i drawn from (seed, i)
    alone: the same at every batch size."""
    return np.stack(
        [np.random.default_rng([seed, row]).integers(0, vocab, length) for row in range(batch)]
    )


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
