"""config.json -> Config: the shapes, RoPE and mixture-of-experts settings the forward pass
needs, read from either form of the file (transformers 5's "rope_parameters" and
"num_local_experts", or the older keys), refusing what the forward pass does not run; and the
presets (public models' config.json) the command line builds random models of."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

ATTENTION = ("auto", "xla", "cudnn")  # Config.attention's choices


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
    # What runs a decode step's attention (model.attend): "xla", XLA's batched dots and softmax
    # (every device); "cudnn", cuDNN's fused attention (a CUDA GPU of compute capability 8.0+,
    # bf16 or fp16 caches); "auto", cudnn where it runs and xla elsewhere
    # (model.decode_attention).
    attention: str = "auto"

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")

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
