"""examples/llm (the LLM example's package; examples/llm_generate.py its command line): a Llama /
Qwen-style decoder from an NVFP4 checkpoint, against a float64 NumPy forward pass (full causal
attention recomputed at every length, no cache) on the checkpoint's dequantized weights."""

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from tests import reference
from tests._helpers import ROOT, load_repo_package, load_repo_script

CONFIG = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.fixture(scope="module")
def example():
    return load_repo_package("examples/llm")


def _as_float(tensors: dict, name: str) -> np.ndarray:
    """Tensor `name` in float64: an NVFP4 layer dequantized, or a dense one (`name` or, for a
    bf16 checkpoint's projections, `name`.weight)."""
    value = tensors[name] if name in tensors else tensors[f"{name}.weight"]
    if isinstance(value, jax_fp4.NVFP4Weight):
        return reference.dequantize(
            value.packed, value.scale_bytes, value.global_scale, value.block_size
        )
    return np.asarray(value, np.float64)


def _inv_freq(config: dict) -> np.ndarray:
    """Hugging Face's rotary frequencies, frequency by frequency (transformers 5's
    "rope_parameters" or the older top-level "rope_theta" and "rope_scaling")."""
    if "rope_parameters" in config:
        params = config["rope_parameters"]
        theta, scaling = params["rope_theta"], params if params["rope_type"] == "llama3" else None
    else:
        theta, scaling = config["rope_theta"], config.get("rope_scaling")
    d = config["head_dim"]
    out = []
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        s = scaling
        if s:
            wavelen = 2 * math.pi / f
            low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
            high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
            if wavelen > low_wl:
                f = f / s["factor"]
            elif wavelen >= high_wl:
                t = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                    s["high_freq_factor"] - s["low_freq_factor"]
                )
                f = (1 - t) * f / s["factor"] + t * f
        out.append(f)
    return np.array(out)


def reference_logits(config: dict, t: dict, tokens, *, routing: dict | None = None) -> np.ndarray:
    """Logits [S, vocab] of one sequence, float64, no cache. A config with "num_experts" runs
    Qwen3-MoE layers (loops over tokens and their top-k experts); `routing`, a dict, then receives
    "margin" [S]: per position, the least gap over the layers between the k-th and (k+1)-th
    router logit (a small one: the model's rounding may pick another expert), and "experts"
    [layers, S, k]: each layer's chosen experts, largest logit first."""
    hd, heads, kvh = (
        config["head_dim"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    eps = config["rms_norm_eps"]
    inv_freq = _inv_freq(config)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rope(x):  # [S, heads, hd]
        out = np.empty_like(x)
        for p in range(x.shape[0]):
            for i in range(hd // 2):
                c, s = math.cos(p * inv_freq[i]), math.sin(p * inv_freq[i])
                a, b = x[p, :, i], x[p, :, i + hd // 2]
                out[p, :, i], out[p, :, i + hd // 2] = a * c - b * s, b * c + a * s
        return out

    s = len(tokens)
    margins, chosen = np.full(s, np.inf), []
    h = _as_float(t, "model.embed_tokens.weight")[np.asarray(tokens)]
    for layer in range(config["num_hidden_layers"]):
        pre = f"model.layers.{layer}"

        def proj(x, name):
            y = x @ _as_float(t, f"{pre}.{name}").T
            return y + _as_float(t, f"{pre}.{name}.bias") if f"{pre}.{name}.bias" in t else y

        x = norm(h, _as_float(t, f"{pre}.input_layernorm.weight"))
        q = proj(x, "self_attn.q_proj").reshape(s, heads, hd)
        k = proj(x, "self_attn.k_proj").reshape(s, kvh, hd)
        v = proj(x, "self_attn.v_proj").reshape(s, kvh, hd)
        if f"{pre}.self_attn.q_norm.weight" in t:
            q = norm(q, _as_float(t, f"{pre}.self_attn.q_norm.weight"))
            k = norm(k, _as_float(t, f"{pre}.self_attn.k_norm.weight"))
        q, k = rope(q), rope(k)
        attn = np.zeros((s, heads, hd))
        for head in range(heads):
            kv = head // (heads // kvh)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            scores[np.triu_indices(s, 1)] = -np.inf
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            attn[:, head] = (p / p.sum(axis=-1, keepdims=True)) @ v[:, kv]
        h = h + proj(attn.reshape(s, heads * hd), "self_attn.o_proj")
        x = norm(h, _as_float(t, f"{pre}.post_attention_layernorm.weight"))
        if config.get("num_experts"):
            y, margin, experts = _reference_moe(config, t, f"{pre}.mlp", x)
            margins = np.minimum(margins, margin)
            chosen.append(experts)
            h = h + y
        else:
            gate, up = proj(x, "mlp.gate_proj"), proj(x, "mlp.up_proj")
            h = h + proj(gate / (1 + np.exp(-gate)) * up, "mlp.down_proj")
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if routing is not None:
        routing.update(margin=margins, experts=np.asarray(chosen))
    return norm(h, _as_float(t, "model.norm.weight")) @ _as_float(t, head).T


def _reference_moe(config: dict, t: dict, prefix: str, x: np.ndarray):
    """Qwen3-MoE's block on normed tokens x [S, H], token by token: softmax of the router's
    logits, the top k experts (the lower index first on ties), their weights renormalised where
    norm_topk_prob, the weighted sum of down(silu(gate x) * up x). Also each token's gap between
    the k-th and (k+1)-th logit (inf with k = E), and its experts [S, k], largest logit first."""
    k, experts = config["num_experts_per_tok"], config["num_experts"]
    router = _as_float(t, f"{prefix}.gate.weight")
    y, margin = np.zeros_like(x), np.full(len(x), np.inf)
    chosen = np.zeros((len(x), k), np.int64)
    for s, token in enumerate(x):
        logits = router @ token
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-logits, kind="stable")
        if k < experts:
            margin[s] = logits[top[k - 1]] - logits[top[k]]
        weights, chosen[s] = probs[top[:k]], top[:k]
        if config.get("norm_topk_prob"):
            weights = weights / weights.sum()
        for e, weight in zip(top[:k], weights):
            pre = f"{prefix}.experts.{e}"
            gate = _as_float(t, f"{pre}.gate_proj") @ token
            up = _as_float(t, f"{pre}.up_proj") @ token
            y[s] += weight * (_as_float(t, f"{pre}.down_proj") @ (gate / (1 + np.exp(-gate)) * up))
    return y, margin, chosen


def _config(variant: str) -> dict:
    if variant == "llama31_rope_parameters":  # transformers 5's form of Llama-3.1's config.json
        config = {key: value for key, value in CONFIG.items() if key != "rope_theta"}
        return dict(config, rope_parameters=dict(LLAMA3_SCALING, rope_theta=500000.0))
    return dict(CONFIG, rope_scaling=LLAMA3_SCALING if variant == "llama3_rope" else None)


def cached_logits(example, cfg, params, tokens, prompt_len: int) -> np.ndarray:
    """Logits [S, vocab] of one sequence: the prefill of its first prompt_len tokens, then one
    token at a time through the cache (teacher-forced), into a cache whose unwritten positions
    hold large values: they must stay masked."""
    total = len(tokens)
    forward = jax.jit(example.forward, static_argnums=0)  # once for the prompt, once per token
    k_cache, v_cache = jax.tree.map(
        lambda c: jnp.full_like(c, 3e4), example.empty_cache(cfg, params, 1, total)
    )
    logits, k_cache, v_cache = forward(
        cfg, params, jnp.asarray(tokens[None, :prompt_len]), 0, k_cache, v_cache
    )
    got = [np.asarray(logits[0])]
    for p in range(prompt_len, total):
        logits, k_cache, v_cache = forward(
            cfg, params, jnp.asarray(tokens[None, p : p + 1]), jnp.int32(p), k_cache, v_cache
        )
        got.append(np.asarray(logits[0]))
    return np.concatenate(got)


@pytest.mark.parametrize(
    "variant, layout, convention, stack_layers, shared_scales",
    [
        ("llama", "tiled", "modelopt", False, True),
        ("llama3_rope", "spec", "compressed-tensors", True, False),
        ("qwen2_bias", "tiled", "compressed-tensors", False, True),
        ("qwen3_qk_norm", "tiled", "modelopt", True, True),
        ("llama31_rope_parameters", "tiled", "modelopt", False, False),
    ],
)
def test_prefill_and_cached_decode_match_the_float64_reference(
    example, tmp_path, variant, layout, convention, stack_layers, shared_scales
):
    config = _config(variant)
    rng = np.random.default_rng()
    tensors = example.write_demo_checkpoint(
        tmp_path,
        config,
        seed=int(rng.integers(2**31)),
        qkv_bias=variant == "qwen2_bias",
        qk_norm=variant == "qwen3_qk_norm",
        convention=convention,
        shared_scales=shared_scales,
    )
    stored = example.ckpt.read_safetensors(tmp_path / "model.safetensors")
    assert ("model.layers.1.mlp.down_proj.weight_packed" in stored) == (
        convention == "compressed-tensors"
    )
    cfg, params = example.load_model(tmp_path, layout=layout, stack_layers=stack_layers)
    # Stacked: one dict of [layers, ...] weights (lax.scan); else a dict per layer (unrolled).
    layer = params["layers"] if stack_layers else params["layers"][1]
    assert isinstance(params["layers"], dict if stack_layers else list)
    # q/k/v and gate/up fused where the checkpoint gave the parts one global scale.
    assert ("qkv_proj" in layer) == ("gate_up_proj" in layer) == shared_scales
    assert ("q_proj" in layer) == ("up_proj" in layer) == (not shared_scales)
    first = layer["qkv_proj" if shared_scales else "q_proj"]
    assert isinstance(first, jax_fp4.NVFP4Weight) and first.layout == layout
    assert first.packed.shape[0] == cfg.layers if stack_layers else first.packed.ndim == 2
    rows = (cfg.heads + 2 * cfg.kv_heads if shared_scales else cfg.heads) * cfg.head_dim
    assert first.n == rows
    assert (f"{'qkv' if shared_scales else 'q'}_proj_bias" in layer) == (variant == "qwen2_bias")
    assert ("q_norm" in layer) == (variant == "qwen3_qk_norm")

    total, prompt_len = 24, 9  # past the llama3 scaling's original 16 positions
    tokens = rng.integers(0, cfg.vocab, size=total)
    expected = reference_logits(config, tensors, tokens)
    got = cached_logits(example, cfg, params, tokens, prompt_len)
    assert got.shape == expected.shape and np.isfinite(got).all()
    # bf16 activations through two layers: per-position error a few percent of the logits' norm.
    for p in range(total):
        assert reference.relative_error(got[p], expected[p]) < 0.05, f"position {p}"


def test_fused_and_separate_projections_give_the_same_logits(example, tmp_path):
    """One checkpoint (q/k/v and gate/up sharing global scales) run fused (4 matmuls a layer,
    the norms and the activation folded into them) and unfused (7, fuse=False): the same logits,
    NVFP4 and dense twin, and both the float64 reference's."""
    rng = np.random.default_rng()
    config = dict(_config("qwen2_bias"), intermediate_size=96)  # gate_up N = 192, K = 96 spec
    tensors = example.write_demo_checkpoint(
        tmp_path, config, seed=int(rng.integers(2**31)), qkv_bias=True, qk_norm=True
    )
    tokens = rng.integers(0, config["vocab_size"], size=12)
    expected = reference_logits(config, tensors, tokens)
    logits = {}
    for fuse in (True, False):
        cfg, params = example.load_model(tmp_path, dtype=jnp.float32, layout="spec", fuse=fuse)
        assert (
            ("qkv_proj" in params["layers"][0]) == ("gate_up_proj" in params["layers"][0]) == fuse
        )
        for name, model in (("nvfp4", params), ("dense", example.dense_twin(params, jnp.float32))):
            empty = example.empty_cache(cfg, model, 1, len(tokens))
            out, _, _ = example.forward(cfg, model, jnp.asarray(tokens[None]), 0, *empty)
            logits[name, fuse] = np.asarray(out[0])
        # What each jax_fp4.matmul of a layer does: fused, the input norm folded into q/k/v, the
        # post-attention norm and SiLU(gate) * up into gate/up, the residual adds into o and down.
        jaxpr = jax.make_jaxpr(lambda p, t, c: example.forward(cfg, p, t, 0, *c))(
            params, jnp.ones((1, 1), jnp.int32), empty
        )
        calls = [
            (e.params["norm_eps"], e.params["activation"], e.params["has_residual"])
            for e in jaxpr.jaxpr.eqns
            if e.primitive is jax_fp4.nvfp4_matmul_p
        ]
        eps = cfg.rms_eps
        per_layer = (
            [(eps, None, False), (None, None, True), (eps, "silu_mul", False), (None, None, True)]
            if fuse
            else [(None, None, False)] * 3
            + [(None, None, True)]
            + [(None, None, False)] * 2
            + [(None, None, True)]
        )
        assert calls == per_layer * cfg.layers
    for name in ("nvfp4", "dense"):
        assert reference.relative_error(logits[name, True], logits[name, False]) < 1e-5
        scale = max(1.0, np.abs(expected).max())
        assert np.abs(logits[name, True] - expected).max() <= 1e-4 * scale


def test_the_loader_fuses_only_parts_with_equal_global_scales(example, tmp_path):
    """A checkpoint whose layer 1 has gate and up quantized apart (different global scales): that
    layer keeps them separate, the others fuse, and under stack_layers (every layer alike) all
    run separate; every form gives the reference's logits. A random model's fused weights are
    each one quantized matrix: its parts share a global scale."""
    rng = np.random.default_rng()
    tensors = example.write_demo_checkpoint(tmp_path, CONFIG, seed=int(rng.integers(2**31)))
    for name in ("gate_proj", "up_proj"):
        key = f"model.layers.1.mlp.{name}"
        tensors[key] = jax_fp4.quantize(
            np.asarray(_as_float(tensors, key) * rng.uniform(0.5, 2.0), np.float32)
        )
    assert float(tensors["model.layers.1.mlp.gate_proj"].global_scale) != float(
        tensors["model.layers.1.mlp.up_proj"].global_scale
    )
    example.ckpt.save_safetensors(tensors, tmp_path / "model.safetensors")
    tokens = rng.integers(0, CONFIG["vocab_size"], size=10)
    expected = reference_logits(CONFIG, tensors, tokens)
    cfg, params = example.load_model(tmp_path, dtype=jnp.float32)
    first, second = params["layers"]
    assert "gate_up_proj" in first and "gate_up_proj" not in second
    assert "qkv_proj" in first and "qkv_proj" in second
    _, stacked = example.load_model(tmp_path, dtype=jnp.float32, stack_layers=True)
    assert "gate_up_proj" not in stacked["layers"] and "qkv_proj" in stacked["layers"]
    assert stacked["layers"]["up_proj"].packed.shape[0] == 2
    for model in (params, stacked):
        empty = example.empty_cache(cfg, model, 1, len(tokens))
        logits, _, _ = example.forward(cfg, model, jnp.asarray(tokens[None]), 0, *empty)
        scale = max(1.0, np.abs(expected).max())
        assert np.abs(np.asarray(logits[0]) - expected).max() <= 1e-4 * scale

    random_cfg, random_params = example.random_model(example.DEMO_CONFIG, layout="spec")
    layer = random_params["layers"][0]
    assert sorted(k for k in layer if k.endswith("proj")) == [
        "down_proj",
        "gate_up_proj",
        "o_proj",
        "qkv_proj",
    ]
    assert layer["gate_up_proj"].shape == (2 * random_cfg.intermediate, random_cfg.hidden)


def test_generate_is_greedy_and_the_cli_runs(example, tmp_path, capsys, monkeypatch):
    config = dict(CONFIG, tie_word_embeddings=True)
    example.write_demo_checkpoint(
        tmp_path, config, seed=int(np.random.default_rng().integers(2**31))
    )
    cfg, params = example.load_model(tmp_path)
    assert params["lm_head"] is params["embed"]
    prompt = np.random.default_rng().integers(0, cfg.vocab, size=(2, 5))
    tokens, timings = example.generate(cfg, params, prompt, 6)
    assert tokens.shape == (2, 6) and timings["decode_steps"] == 3 and timings["decode_s"] > 0
    # The timed steps (3..7 of 8) in windows of 2, 2 and 1 step, which add up to the whole.
    monkeypatch.setattr(example.generation, "TIMING_WINDOW", 2)
    tokens8, timings8 = example.generate(cfg, params, prompt, 8, gpu_busy_steps=3)
    np.testing.assert_array_equal(tokens8[:, :6], tokens)
    windows = timings8["window_s_per_step"]
    assert timings8["decode_steps"] == 5 and len(windows) == 3 and min(windows) > 0
    assert 2 * windows[0] + 2 * windows[1] + windows[2] == pytest.approx(timings8["decode_s"])
    assert timings8["gpu_busy_ms"] is None  # a CPU trace holds no GPU
    # Each generated token is the argmax of the logits of everything before it, recomputed whole.
    sequence = np.concatenate([prompt, tokens], axis=1)
    logits, _, _ = example.forward(
        cfg, params, jnp.asarray(sequence[:, :-1]), 0, *example.empty_cache(cfg, params, 2, 11)
    )
    np.testing.assert_array_equal(np.argmax(np.asarray(logits)[:, 4:], axis=-1), tokens)
    # The same model stacked under lax.scan: the same logits but for the bf16 activations' rounding
    # (XLA fuses the two programs differently).
    _, stacked = example.load_model(tmp_path, stack_layers=True)
    empty = example.empty_cache(cfg, stacked, 2, 11)
    scanned, _, _ = example.forward(cfg, stacked, jnp.asarray(sequence[:, :-1]), 0, *empty)
    assert reference.relative_error(np.asarray(scanned), np.asarray(logits)) < 0.02
    # Each layout of the layers takes its own caches only.
    with pytest.raises(TypeError, match="k_cache must be a list of arrays, one per layer"):
        example.forward(cfg, params, jnp.asarray(sequence[:, :-1]), 0, *empty)

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert example.main([str(tmp_path), "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    generated = next(line for line in out.splitlines() if line.startswith("generated: "))
    assert len(json.loads(generated.removeprefix("generated: "))) == 4
    assert "prompt (5 tokens): [3, 1, 4, 1, 5]" in out and "jax_fp4 path: prefill" in out
    # Random weights of a preset's shapes, decoded with NVFP4 and with the same weights in bf16,
    # at two batch sizes after a random prompt.
    record_file = tmp_path / "timings.json"
    argv = ["--random", "demo", "--batch", "2,3", "--max-new-tokens", "5", "--prompt-len", "7"]
    argv += ["--compare-bf16", "--scan-layers", "--gpu-busy", "--json", str(record_file)]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "NVFP4 (jax_fp4): prefill" in out and "batch 2, 2 steps" in out and "batch 3, 2" in out
    assert "bf16 (the same weights dequantized, XLA's dot)" in out and "NVFP4 against bf16: " in out
    assert "prompt (7 tokens)" in out and "byte floor" in out
    record = json.loads(record_file.read_text())
    assert record["model"] == "demo" and record["scan_layers"] is True
    assert record["config"]["layers"] == example.DEMO_CONFIG["num_hidden_layers"]
    assert record["read_gb_per_s"] > 0
    runs = record["runs"]
    assert [run["batch"] for run in runs] == [2, 3]
    # A step reads every weight but the embedding table: the projections and lm_head (bf16, or
    # NVFP4 at ~0.28 of it), the fp32 norms and RoPE frequencies.
    cfg = example.Config.from_json(example.DEMO_CONFIG)
    projections = cfg.layers * (
        (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim * cfg.hidden
        + cfg.heads * cfg.head_dim * cfg.hidden
        + 3 * cfg.hidden * cfg.intermediate
    )
    fp32 = cfg.layers * 2 * cfg.hidden + cfg.hidden + cfg.head_dim // 2
    dense_bytes = 2 * (projections + cfg.vocab * cfg.hidden) + 4 * fp32
    # NVFP4: half a byte a weight, a byte a block of 16, a float32 global scale a matrix (four a
    # layer: q/k/v and gate/up fused).
    nvfp4_bytes = projections * 9 // 16 + 4 * 4 * cfg.layers + 2 * cfg.vocab * cfg.hidden + 4 * fp32
    for run in runs:
        assert run["context"] == 7 + 5 and run["prompt_len"] == 7 and run["new_tokens"] == 5
        assert run["paths"]["decode"] == "cpu"  # tests/conftest.py: the CPU device beside a GPU
        assert run["bf16"]["weight_bytes_per_step"] == dense_bytes
        assert run["nvfp4"]["weight_bytes_per_step"] == nvfp4_bytes
        # The floor: those bytes and the KV caches (2 bytes a value) at the measured bandwidth.
        cache = 2 * cfg.layers * run["batch"] * cfg.kv_heads * 12 * cfg.head_dim * 2
        assert run["cache_bytes"] == cache
        for name in ("nvfp4", "bf16"):
            step = run[name]["ms_per_step"] / 1e3
            assert run[name]["decode_steps"] == 2 and step > 0
            assert run[name]["tokens_per_s"] == pytest.approx(run["batch"] / step)
            assert run[name]["weight_gb_per_s"] == pytest.approx(
                run[name]["weight_bytes_per_step"] / step / 1e9
            )
            floor = (run[name]["weight_bytes_per_step"] + cache) / (record["read_gb_per_s"] * 1e9)
            assert run[name]["floor_ms"] == pytest.approx(floor * 1e3)
        assert run["nvfp4_ms"] == run["loop_ms"] == run["nvfp4"]["ms_per_step"]
        assert run["bf16_ms"] == run["bf16"]["ms_per_step"] and run["floor_ms"] > 0
        assert run["ratio"] == pytest.approx(run["bf16_ms"] / run["nvfp4_ms"])
        assert run["gpu_busy_ms"] is None and run["bf16_gpu_busy_ms"] is None  # no GPU here
        assert f"{run['nvfp4']['tokens_per_s']:.1f} tokens/s" in out
    for bad in (
        [],
        ["--random", "demo", "--prompt-ids", "1,512"],
        ["--random", "demo", "--batch", "2,0"],
        ["--random", "demo", "--prompt-len", "3", "--prompt-ids", "1"],
    ):
        with pytest.raises(SystemExit):
            example.main(bad)
    err = capsys.readouterr().err
    assert "token ids must be in [0, 512), got [1, 512]" in err
    assert "expected a positive int or a comma-separated list of them, got '2,0'" in err
    assert "not given with --prompt-ids" in err


def test_a_bf16_checkpoint_quantized_on_load(example, tmp_path, capsys):
    """A bf16 checkpoint runs dense with its parts concatenated, or quantized on load with each
    fused group quantized as one matrix (one global scale, as ModelOpt would export it)."""
    tensors = example.write_demo_checkpoint(
        tmp_path, CONFIG, convention="bf16", seed=int(np.random.default_rng().integers(2**31))
    )
    cfg, dense = example.load_model(tmp_path)
    layer = dense["layers"][1]
    assert not isinstance(layer["qkv_proj"], jax_fp4.NVFP4Weight)

    def stored(*names):
        return np.concatenate([np.asarray(tensors[f"model.layers.1.{n}.weight"]) for n in names])

    qkv = stored("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    np.testing.assert_array_equal(np.asarray(layer["qkv_proj"]), qkv)
    _, params = example.load_model(tmp_path, quantize=True)
    for name, parts in (
        ("qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        ("down_proj", ("mlp.down_proj",)),
    ):
        w = params["layers"][1][name]
        assert w.layout == "tiled"
        expected = jax_fp4.prepack(jax_fp4.quantize(stored(*parts).astype(np.float32)))
        for got, want in zip(jax.tree.leaves(w), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not isinstance(params["lm_head"], jax_fp4.NVFP4Weight)
    assert (
        example.main([str(tmp_path), "--quantize", "--compare-bf16", "--max-new-tokens", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert "bf16 (the checkpoint's weights, XLA's dot)" in out and "NVFP4 against bf16: " in out


def test_rope_parameters_are_read_like_the_older_top_level_keys(example):
    """transformers 5 writes rope_theta and the scaling under "rope_parameters" (current ModelOpt
    and llm-compressor exports): read like the older top-level keys, not defaulted to theta 10000
    without scaling (which moved a Qwen3 export's logits by half the largest logit)."""
    legacy = example.Config.from_json(
        dict(CONFIG, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    )
    new = example.Config.from_json(_config("llama31_rope_parameters"))
    assert new.rope_theta == 500000.0 and new.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 16.0)
    np.testing.assert_array_equal(example.rope_frequencies(new), example.rope_frequencies(legacy))
    qwen3 = example.Config.from_json(
        dict(CONFIG, rope_theta=None, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    )
    assert qwen3.rope_theta == 1e6 and qwen3.rope_scaling is None
    # One entry per layer type, all alike (as transformers writes for models with several).
    per_type = {
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e6, "rope_type": "default"},
    }
    assert example.Config.from_json(dict(CONFIG, rope_parameters=per_type)).rope_theta == 1e6
    assert example.Config.from_json(CONFIG).rope_theta == 10000.0  # no RoPE keys: the default


@pytest.mark.parametrize(
    "rope, match",
    [
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            r"RoPE type 'yarn' \(rope_scaling\) is not supported",
        ),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "RoPE type 'linear'"),
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            r"RoPE type 'dynamic' \(rope_parameters\) is not supported",
        ),
        (
            dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
            "RoPE type 'longrope'",
        ),
        (
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            ),
            "rope_parameters differ by layer type",
        ),
        (
            dict(
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            ),
            "partial_rotary_factor 0.5 is not supported",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
            "the llama3 RoPE scaling .rope_parameters. lacks",
        ),
    ],
)
def test_unsupported_rope_is_refused(example, rope, match):
    with pytest.raises(ValueError, match=match):
        example.Config.from_json(dict(CONFIG, **rope))


def test_k_not_a_multiple_of_16_as_modelopt_pads_it(example, tmp_path, caplog):
    """hidden 40 and intermediate 72: ModelOpt stores those K padded to 48 and 80 (zero codes);
    the example passes each projection's true K from config.json, and the loader strips the
    padding (and says so), where the file alone loaded as K = 48 and 80."""
    config = dict(
        CONFIG,
        hidden_size=40,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=72,
    )
    tensors = example.write_demo_checkpoint(
        tmp_path, config, seed=int(np.random.default_rng().integers(2**31))
    )
    stored = {}
    for name, value in tensors.items():
        if isinstance(value, jax_fp4.NVFP4Weight) and value.k % 16:
            padded = -(-value.k // 16) * 16
            packed = np.pad(np.asarray(value.packed), ((0, 0), (0, (padded - value.k) // 2)))
            value = jax_fp4.NVFP4Weight(packed, np.asarray(value.scale), value.global_scale)
        stored[name] = value
    example.ckpt.save_safetensors(stored, tmp_path / "model.safetensors")
    assert example.ckpt.load_safetensors(tmp_path)["model.layers.0.mlp.down_proj"].k == 80
    with caplog.at_level("INFO", logger="jax_fp4.checkpoint"):
        cfg, params = example.load_model(tmp_path, dtype=jnp.float32, layout="spec")
    assert (
        "layer 'model.layers.0.mlp.down_proj': K = 80 in the file (padded), 72 from in_features"
        in caplog.text
    )
    assert params["layers"][0]["qkv_proj"].k == 40 and params["layers"][1]["down_proj"].k == 72
    tokens = np.random.default_rng().integers(0, cfg.vocab, size=10)
    logits, _, _ = example.forward(
        cfg, params, jnp.asarray(tokens[None]), 0, *example.empty_cache(cfg, params, 1, 10)
    )
    expected = reference_logits(config, tensors, tokens)
    assert np.abs(np.asarray(logits[0]) - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


REAL_TOOLS = Path(__file__).parent / "data" / "real_tools"


@pytest.mark.parametrize(
    "checkpoint",
    [
        "modelopt_llama_nvfp4",
        "llmc_llama_nvfp4a16",
        "modelopt_qwen3_nvfp4",
        "modelopt_qwen3moe_nvfp4",
        "llmc_llama_mixed",
    ],
)
def test_real_tool_checkpoints_match_transformers(example, checkpoint):
    """Checkpoints exported by ModelOpt 0.47 and llm-compressor 0.14 (tests/data/real_tools, whose
    README.md says how they were made), run by the example with float32 activations on the CPU:
    the prefill logits within 1e-4 of the largest logit of those transformers + torch compute from
    the tool's own dequantized weights, and the same 8 greedy tokens. The Qwen3 exports keep
    rope_theta 1e6 under "rope_parameters"; the Qwen3-MoE one names its expert count
    "num_local_experts" (transformers 5); the mixed one holds FP8 attention projections with
    per-channel bf16 scales beside NVFP4 MLPs."""
    path = REAL_TOOLS / checkpoint
    oracle = np.load(path / "oracle.npz")
    cfg, params = example.load_model(path, dtype=jnp.float32)
    prompt = oracle["prompt_ids"][None].astype(np.int32)
    logits, _, _ = example.forward(
        cfg, params, jnp.asarray(prompt), 0, *example.empty_cache(cfg, params, 1, prompt.shape[1])
    )
    expected = oracle["prefill_logits"]
    error = np.abs(np.asarray(logits[0]) - expected).max()
    assert error <= 1e-4 * max(1.0, np.abs(expected).max()), error
    tokens, _ = example.generate(cfg, params, prompt, len(oracle["greedy_ids"]))
    np.testing.assert_array_equal(tokens[0], oracle["greedy_ids"])


def _fp8_per_tensor(w: np.ndarray):
    """ModelOpt's FP8 quantization of a float matrix: float8_e4m3fn codes and the float32 scale
    amax / 448 (multiplied)."""
    scale = np.float32(np.abs(w).max() / 448.0)
    return (w / scale).astype(np.float32).astype(jnp.float8_e4m3fn), scale


# Layers held in FP8 by the mixed-precision checkpoint below: all of layer 0's attention (q, k, v
# with three different scales), and in layer 1 k_proj alone (q/k/v then neither all FP8 nor all
# NVFP4) and down_proj.
FP8_LAYERS = [
    *(f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "model.layers.1.self_attn.k_proj",
    "model.layers.1.mlp.down_proj",
]


def _write_modelopt_mixed(example, path, rng) -> dict:
    """A ModelOpt MIXED_PRECISION checkpoint at `path`: the FP8_LAYERS as ModelOpt writes FP8
    layers (weight float8_e4m3fn [N, K], weight_scale float32 [] per tensor, input_scale float32
    []), every other projection NVFP4 (W4A16_NVFP4), hf_quant_config.json listing each layer's
    algorithm. Returns the float64 values the model means: {layer: dequantized weight, other:
    tensor}."""
    tensors = example.write_demo_checkpoint(path, CONFIG, seed=int(rng.integers(2**31)))
    stored = dict(tensors)
    for i, name in enumerate(FP8_LAYERS):
        n, k = tensors[name].shape
        w = rng.standard_normal((n, k)) / math.sqrt(k) * (1 + i)  # a scale of its own each
        codes, scale = _fp8_per_tensor(w)
        del stored[name]
        stored[f"{name}.weight"] = codes
        stored[f"{name}.weight_scale"] = np.array(scale, np.float32)
        stored[f"{name}.input_scale"] = np.array(0.01, np.float32)  # activations: not applied
        tensors[name] = codes.astype(np.float64) * np.float64(scale)
    jax_fp4.checkpoint.save_safetensors(stored, path / "model.safetensors")
    layers = {
        name: {"quant_algo": "FP8"} if name in FP8_LAYERS else {"quant_algo": "W4A16_NVFP4"}
        for name, w in tensors.items()
        if name in FP8_LAYERS or isinstance(w, jax_fp4.NVFP4Weight)
    }
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None}
    (path / "hf_quant_config.json").write_text(
        json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": quant | {"quantized_layers": layers}}
        )
    )
    return tensors


def test_a_modelopt_mixed_precision_checkpoint_matches_the_float64_reference(example, tmp_path):
    """FP8 layers run with their own per-tensor scales (dequantized at load; q/k/v fused only
    where all three are FP8, each part with its own scale), NVFP4 layers through jax_fp4: the
    prefill and the cached decode of float32 activations within 1e-4 of the largest float64
    logit."""
    rng = np.random.default_rng()
    tensors = _write_modelopt_mixed(example, tmp_path, rng)
    scales = [
        float(example.ckpt.read_safetensors(tmp_path)[f"{name}.weight_scale"])
        for name in FP8_LAYERS[:3]
    ]
    assert len(set(scales)) == 3  # q, k and v scaled differently: one scale for all is wrong
    cfg, params = example.load_model(tmp_path, dtype=jnp.float32)
    first, second = params["layers"]
    assert not isinstance(first["qkv_proj"], jax_fp4.NVFP4Weight)
    assert isinstance(first["gate_up_proj"], jax_fp4.NVFP4Weight)
    assert {"q_proj", "k_proj", "v_proj"} <= set(second) and "qkv_proj" not in second
    assert isinstance(second["q_proj"], jax_fp4.NVFP4Weight)
    assert not isinstance(second["k_proj"], jax_fp4.NVFP4Weight)
    assert not isinstance(second["down_proj"], jax_fp4.NVFP4Weight)

    tokens = rng.integers(0, cfg.vocab, size=12)
    expected = reference_logits(CONFIG, tensors, tokens)
    got = cached_logits(example, cfg, params, tokens, 7)
    assert np.abs(got - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


BF16 = jnp.bfloat16


def _replace(raw: dict, layer: str, weight: np.ndarray) -> None:
    """Layer `layer` of raw tensors stored as `weight` alone (its other tensors removed)."""
    for name in [name for name in raw if name.startswith(f"{layer}.")]:
        del raw[name]
    raw[f"{layer}.weight"] = weight


def _edit_checkpoint(example, path, change):
    """Rewrite path/model.safetensors with `change` applied to its raw tensors."""
    raw = dict(example.ckpt.read_safetensors(path))
    change(raw)
    raw = {name: np.array(value) for name, value in raw.items()}
    example.ckpt.save_safetensors(raw, path / "model.safetensors")


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda raw: raw.pop("model.layers.0.self_attn.k_proj.weight_scale"),
            "'model.layers.0.self_attn.k_proj.weight_scale' is missing",
        ),
        (
            lambda raw: raw.update(
                {"model.layers.1.mlp.down_proj.weight_scale": np.ones((3, 2), np.float32)}
            ),
            r"'model.layers.1.mlp.down_proj.weight_scale' has shape \(3, 2\)",
        ),
        (
            lambda raw: _replace(raw, "model.layers.1.self_attn.o_proj", np.ones((128, 128), BF16)),
            "declared W4A16_NVFP4 but model.layers.1.self_attn.o_proj.weight is stored as float",
        ),
        (
            lambda raw: _replace(
                raw, "model.layers.1.self_attn.o_proj", np.ones((128, 128), np.int8)
            ),
            "declared W4A16_NVFP4 but model.layers.1.self_attn.o_proj.weight is stored as int8",
        ),
        (
            lambda raw: raw.update(
                {"model.layers.0.self_attn.o_proj.pre_quant_scale": np.ones(128, np.float32)}
            ),
            "'model.layers.0.self_attn.o_proj.pre_quant_scale': AWQ",
        ),
    ],
)
def test_what_the_loader_cannot_run_is_refused_naming_the_tensor(example, tmp_path, change, match):
    _write_modelopt_mixed(example, tmp_path, np.random.default_rng(0))
    _edit_checkpoint(example, tmp_path, change)
    with pytest.raises(jax_fp4.checkpoint.CheckpointError, match=match):
        example.load_model(tmp_path, dtype=jnp.float32)


@pytest.mark.parametrize(
    "quant, match",
    [
        ({"quantization": {"quant_algo": "W4A8_AWQ"}}, "quant_algo 'W4A8_AWQ' is not supported"),
        (
            {
                "quantization": {
                    "quant_algo": "MIXED_PRECISION",
                    "quantized_layers": {"model.layers.0.mlp.down_proj": {"quant_algo": "INT8"}},
                }
            },
            "layer 'model.layers.0.mlp.down_proj' has quant_algo 'INT8'",
        ),
        (
            {
                "quantization": {
                    "quant_algo": "MIXED_PRECISION",
                    "quantized_layers": {"model.layers.0.mlp.down_proj": {"quant_algo": "FP8"}},
                }
            },
            "'model.layers.0.mlp.down_proj' is declared FP8 but .* stored as nvfp4",
        ),
    ],
)
def test_quantization_configs_the_loader_cannot_run_are_refused(example, tmp_path, quant, match):
    example.write_demo_checkpoint(tmp_path, CONFIG)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(jax_fp4.checkpoint.CheckpointError, match=match):
        example.load_model(tmp_path)


def test_integer_codes_of_another_quantization_are_refused_not_cast(example, tmp_path):
    """Without a quantization config to say so, an integer weight (another tool's codes) is
    refused naming the tensor: cast to floats it would run and give wrong logits."""
    example.write_demo_checkpoint(tmp_path, CONFIG)
    layer = "model.layers.0.mlp.down_proj"
    _edit_checkpoint(
        example, tmp_path, lambda raw: _replace(raw, layer, np.ones((128, 128), np.int8))
    )
    with pytest.raises(jax_fp4.checkpoint.CheckpointError, match=f"{layer}.weight has dtype int8"):
        example.load_model(tmp_path)


def test_a_compressed_tensors_format_the_loader_cannot_run_is_refused(example, tmp_path):
    example.write_demo_checkpoint(tmp_path, CONFIG, convention="compressed-tensors")
    groups = {"group_0": {"format": "pack-quantized", "targets": ["Linear"]}}
    quantization = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": groups,
    }
    (tmp_path / "config.json").write_text(
        json.dumps(dict(CONFIG, quantization_config=quantization))
    )
    with pytest.raises(
        jax_fp4.checkpoint.CheckpointError, match="group 'group_0' .* format 'pack-quantized'"
    ):
        example.load_model(tmp_path)


def test_help_describes_the_example_and_runs_nothing(example, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in (
        "Greedy text generation from an NVFP4 checkpoint",
        "rope_parameters",
        "--compare-bf16",
        "--prompt-ids",
        "--scan-layers",
        "in_features",
        "--prompt-len",
        "--gpu-busy",
        "Qwen3-MoE",
        '"nvfp4_ms"',
    ):
        assert text in out


def test_the_entry_point_gives_the_package_and_parses_before_importing_jax(example):
    """examples/llm_generate.py, imported by its path, gives the package's functions under their
    names (scripts outside the repository import them from there); run, it answers --help
    without importing jax."""
    script = load_repo_script("examples/llm_generate.py")
    for name in ("load_model", "empty_cache", "forward", "generate", "Config", "main"):
        assert getattr(script, name) is getattr(example, name)
    code = (
        "import runpy, sys\n"
        "sys.argv = ['llm_generate.py', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'examples' / 'llm_generate.py')!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('jax imported:', 'jax' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Greedy text generation from an NVFP4 checkpoint" in done.stdout
    assert done.stdout.rstrip().endswith("jax imported: False")


def test_the_decode_step_probe_counts_the_kernels_it_launches(tmp_path, capsys):
    """benchmarks/probes/llm_step_host.py on the demo preset: one jax_fp4 call per projection of
    every layer (lm_head stays dense), none in the bf16 twin, and a profile read back."""
    probe = load_repo_script("benchmarks/probes/llm_step_host.py")
    record_file = tmp_path / "probe.json"
    assert probe.main(["--random", "demo", "--steps", "2", "--json", str(record_file)]) == 0
    record = json.loads(record_file.read_text())
    layers = probe.llm.DEMO_CONFIG["num_hidden_layers"]
    assert record["nvfp4"]["thunks"]["jax_fp4 custom calls"] == 4 * layers  # q/k/v, gate/up fused
    assert "jax_fp4 custom calls" not in record["bf16"]["thunks"]
    for run in ("nvfp4", "bf16"):
        assert record[run]["wall_ms_per_step"] > 0 and record[run]["host_top_ms_per_step"]
    assert "nvfp4: " in capsys.readouterr().out


def test_the_decode_step_never_transposes_a_cache(capsys):
    """benchmarks/probes/llm_step_hlo.py: the caches are stored in the layout of the attention's
    batched matmuls, so the compiled step moves none of them through a transpose (caches of
    [B, T, kv_heads, head_dim] were transposed whole, K and V of every layer, every step)."""
    probe = load_repo_script("benchmarks/probes/llm_step_hlo.py")
    assert probe.main(["--preset", "demo", "--batch", "2", "--max-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "cache-sized copies / transposes / converts" in out and "transpose(" not in out


def test_kernel_census_counts_the_launches_of_a_compiled_step(capsys):
    """benchmarks/probes/llm_step_hlo.py --census: every kernel-launching op outside fusion bodies
    and reducers, a command buffer's computation walked like the ENTRY's; on the demo model's
    compiled step, jax_fp4's four matmuls a layer among them."""
    probe = load_repo_script("benchmarks/probes/llm_step_hlo.py")
    hlo = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %e = f32[8]{0} exponential(%p)
  ROOT %m = f32[8]{0} multiply(%e, %p)
}
%command_buffer (x: f32[8]) -> (f32[8], f32[]) {
  %x = f32[8]{0} parameter(0)
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %z = f32[] constant(0)
  %r = f32[] reduce(%f, %z), dimensions={0}, to_apply=%add
  ROOT %t = (f32[8]{0}, f32[]) tuple(%f, %r)
}
ENTRY %main (x: f32[8]) -> (f32[8], f32[]) {
  %x = f32[8]{0} parameter(0)
  %c = (f32[8]{0}, f32[]) call(%x), to_apply=%command_buffer
  %g = f32[8]{0} custom-call(%x), custom_call_target="my_kernel"
  ROOT %t = (f32[8]{0}, f32[]) tuple(%g, %x)
}
"""
    assert probe.kernel_census(hlo) == {
        "fusion(kLoop): exponential, multiply": 1,
        "reduce": 1,
        "custom-call: my_kernel": 1,
    }
    assert probe.main(["--preset", "demo", "--batch", "1", "--max-len", "64", "--census"]) == 0
    out = capsys.readouterr().out
    layers = probe.llm.DEMO_CONFIG["num_hidden_layers"]
    launches = re.search(r"(\d+) kernels a step", out)
    assert launches and int(launches.group(1)) > 4 * layers
    assert re.search(rf"^ +{4 * layers}  custom-call: jax_fp4_matmul_cpu$", out, re.MULTILINE)


def test_kernel_breakdown_splits_a_step_into_matmuls_and_the_rest(example):
    """A trace's kernels of two NVFP4 decode steps by name: jax_fp4's (demangled or not), the
    lm_head GEMM (each step's longest matmul-library kernel), and the rest, the attention's
    library dots and cuBLAS's split-K reduce included."""
    fp4 = [
        ("void jax_fp4::cuda::GemvMmaKernel<4, 2, true>(jax_fp4::cuda::GemvArgs)", 10_000),
        ("void jax_fp4::cuda::GemvMmaKernel<8, 1, true>(jax_fp4::cuda::GemvArgs)", 12_000),
        ("_ZN7jax_fp44cuda16GemvScalarKernelILi8EEEvNS0_8GemvArgsE", 5_000),
    ]
    step = fp4 + [
        ("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNN", 240_000),  # lm_head
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 3_000),
        ("void gemv2N_kernel<int, int, __nv_bfloat16, float, 128, 16, 4, 4>", 2_000),  # q.k
        ("void gemv2N_kernel<int, int, __nv_bfloat16, float, 128, 16, 4, 4>", 2_500),  # p.v
        ("loop_convert_fusion_3", 1_300),
        ("input_reduce_fusion_1", 1_100),
    ]
    got = example.kernel_breakdown(step + step, 2)
    assert got["jax_fp4_ms"] == pytest.approx(0.027)
    assert got["lm_head_ms"] == pytest.approx(0.240)
    assert got["other_ms"] == pytest.approx(0.0099)
    assert got["other_kernels_per_step"] == 5
    assert example.kernel_breakdown([], 4) == dict.fromkeys(
        ("jax_fp4_ms", "lm_head_ms", "other_ms", "other_kernels_per_step"), 0.0
    )


def test_the_attention_choice_and_what_cudnn_refuses(example):
    """Config.attention: "auto" (the default), "xla" or "cudnn", nothing else; "cudnn" takes a
    decode step's attention only (a prefill's stays XLA's, the same program on any device) and
    refuses float32 caches at trace time, where "auto" takes XLA's (as on any device but a CUDA
    GPU)."""
    cfg, params = example.random_model(example.DEMO_CONFIG, dtype=jnp.float32)
    assert cfg.attention == "auto" and example.decode_attention(cfg, jnp.float32) == "xla"
    pattern = "attention must be one of .'auto', 'xla', 'cudnn'., got 'flash'"
    with pytest.raises(ValueError, match=pattern):
        dataclasses.replace(cfg, attention="flash")
    for kind in ("xla", "cudnn"):
        assert (
            example.decode_attention(dataclasses.replace(cfg, attention=kind), "bfloat16") == kind
        )
    assert example.decode_attention(cfg, jnp.bfloat16) == "xla"  # the CPU device (conftest.py)
    with jax.default_device(jax.devices()[0]):  # a GPU where there is one
        on_gpu = jax.devices()[0].platform == "gpu"
        assert example.decode_attention(cfg, jnp.bfloat16) == ("cudnn" if on_gpu else "xla")
    assert example.decode_attention(dataclasses.replace(cfg, shards=2), jnp.bfloat16) == "xla"
    cudnn = dataclasses.replace(cfg, attention="cudnn")
    tokens = jnp.asarray(example.random_prompts(cfg.vocab, 2, 5), jnp.int32)
    caches = example.empty_cache(cfg, params, 2, 8)
    prefill = [example.forward(c, params, tokens, 0, *caches)[0] for c in (cfg, cudnn)]
    np.testing.assert_array_equal(np.asarray(prefill[0]), np.asarray(prefill[1]))
    with pytest.raises(ValueError, match="attention 'cudnn' runs bfloat16 or float16 caches"):
        jax.eval_shape(lambda: example.forward(cudnn, params, tokens[:, :1], 5, *caches))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["gpu"], indirect=True)
def test_cudnn_decode_attention_matches_xla(example, device):
    """A decode step's logits with cuDNN's fused attention (the default "auto" on a GPU of
    compute capability 8.0+) as with XLA's, after a prefill, at batch 3 (each row its own prompt,
    so each attends to its own cache)."""
    cfg, params = example.random_model(example.DEMO_CONFIG)
    cudnn = dataclasses.replace(cfg, attention="cudnn")
    assert example.decode_attention(cfg, params["embed"].dtype) == "cudnn"
    cfg = dataclasses.replace(cfg, attention="xla")
    forward = jax.jit(example.forward, static_argnums=0)
    prompt = jnp.asarray(example.random_prompts(cfg.vocab, 3, 9), jnp.int32)
    _, k_cache, v_cache = forward(cfg, params, prompt, 0, *example.empty_cache(cfg, params, 3, 16))
    token = prompt[:, -1:]
    for position in (9, 10):
        xla, k_next, v_next = forward(cfg, params, token, jnp.int32(position), k_cache, v_cache)
        got, k_got, v_got = forward(cudnn, params, token, jnp.int32(position), k_cache, v_cache)
        for b in range(3):
            assert reference.relative_error(np.asarray(got[b]), np.asarray(xla[b])) < 0.02
        np.testing.assert_array_equal(np.asarray(k_got[0]), np.asarray(k_next[0]))
        token, k_cache, v_cache = jnp.argmax(xla[:, -1:], axis=-1).astype(jnp.int32), k_next, v_next
