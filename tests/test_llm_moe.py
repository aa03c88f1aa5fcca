"""examples/llm's Qwen3-MoE architecture: a tiny MoE model's forward pass against an
independent float64 NumPy one (loops over tokens and their top-k experts on the checkpoint's
dequantized weights), greedy tokens, checkpoints of both conventions read back, random weights of
the presets, and the configs it refuses."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from tests import reference
from tests._helpers import load_repo_package
from tests.test_llm_generate import cached_logits, reference_logits

TINY = {
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
    "vocab_size": 96,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}
# Odd sizes: K = 80 and 48 (the tiled layout takes neither), 5 experts, top 3, no renormalising.
ODD = dict(
    TINY,
    hidden_size=80,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    moe_intermediate_size=48,
    num_experts=5,
    num_experts_per_tok=3,
    norm_topk_prob=False,
)


@pytest.fixture(scope="module")
def example():
    return load_repo_package("examples/llm")


def _tokens_clear_of_routing_ties(
    rng, config, tensors, total, threshold, clear_until=None, accept=lambda logits: True
):
    """Random tokens [total] whose float64 routing has every k-th/(k+1)-th router logit gap of the
    first `clear_until` positions (all by default) above `threshold`, where a model's rounding
    cannot pick another expert, and whose reference logits `accept` takes; and the reference
    logits and routing (reference_logits': "margin", "experts") of those tokens."""
    clear_until = total if clear_until is None else clear_until
    for _ in range(100):
        tokens = rng.integers(0, config["vocab_size"], size=total)
        routing = {}
        expected = reference_logits(config, tensors, tokens, routing=routing)
        if (routing["margin"][:clear_until] > threshold).all() and accept(expected):
            return tokens, expected, routing
    raise AssertionError(f"no tokens clear of routing ties above {threshold} in 100 draws")


def _clear_argmax(logits) -> bool:
    """Whether the largest logit leads the next by 5% of the largest magnitude."""
    top2 = np.sort(logits)[-2:]
    return top2[1] - top2[0] > 0.05 * np.abs(logits).max()


@pytest.mark.parametrize(
    "config, convention, layout, stack_layers, shared_scales",
    [
        (TINY, "modelopt", "tiled", False, True),
        (TINY, "compressed-tensors", "spec", True, False),
        (ODD, "compressed-tensors", "tiled", False, True),
        (ODD, "modelopt", "spec", True, True),
    ],
    ids=["tiny-modelopt", "tiny-ct-stacked-unshared", "odd-ct", "odd-modelopt-stacked"],
)
def test_float32_forward_matches_the_float64_reference(
    example, tmp_path, config, convention, layout, stack_layers, shared_scales
):
    """float32 activations: prefill, then the cached decode, within 1e-4 of the largest reference
    logit, routing included (tokens drawn clear of router ties)."""
    rng = np.random.default_rng()
    tensors = example.write_demo_checkpoint(
        tmp_path,
        config,
        seed=int(rng.integers(2**31)),
        qk_norm=True,
        convention=convention,
        shared_scales=shared_scales,
    )
    cfg, params = example.load_model(
        tmp_path, dtype=jnp.float32, layout=layout, stack_layers=stack_layers
    )
    assert cfg.experts == config["num_experts"] and cfg.qk_norm
    layer = params["layers"] if stack_layers else params["layers"][0]
    assert "router" in layer and "gate_up_proj" not in layer and "down_proj" not in layer
    assert ("gate_up_proj" in layer["experts"]) == shared_scales
    assert ("gate_proj" in layer["experts"]) == (not shared_scales)
    down = layer["experts"]["down_proj"]
    lead = (cfg.layers, cfg.experts) if stack_layers else (cfg.experts,)
    assert down.shape == (*lead, cfg.hidden, cfg.moe_intermediate)
    assert np.asarray(down.global_scale).shape == lead  # one global scale per expert
    tiled = cfg.hidden % 128 == 0 and cfg.moe_intermediate % 128 == 0
    assert down.layout == ("tiled" if layout == "tiled" and tiled else "spec")

    tokens, expected, routing = _tokens_clear_of_routing_ties(rng, config, tensors, 20, 1e-3)
    got = cached_logits(example, cfg, params, tokens, 7)
    assert got.shape == expected.shape
    scale = max(1.0, np.abs(expected).max())
    assert np.abs(got - expected).max() <= 1e-4 * scale
    # The measurement forward (what a run's active_experts counts) routes as the reference does.
    routed = np.asarray(example.routed_experts(cfg, params, jnp.asarray(tokens[None])))
    assert routed.shape == (cfg.layers, 1, len(tokens), cfg.experts_per_token)
    np.testing.assert_array_equal(routed[:, 0], routing["experts"])


def test_bf16_forward_and_greedy_tokens_match_the_float64_reference(example, tmp_path, device):
    """bf16 activations (the decode kernels on a GPU): each position's logits within a few
    percent of the reference while the routing is clear of ties; greedy generation's tokens the
    reference's argmax where its top two logits are apart and the routing clear."""
    rng = np.random.default_rng()
    tensors = example.write_demo_checkpoint(
        tmp_path, TINY, seed=int(rng.integers(2**31)), qk_norm=True
    )
    cfg, params = example.load_model(tmp_path)
    total, prompt_len = 16, 5
    tokens, expected, routing = _tokens_clear_of_routing_ties(
        rng,
        TINY,
        tensors,
        total,
        0.05,
        clear_until=8,
        accept=lambda logits: _clear_argmax(logits[prompt_len - 1]),
    )
    got = cached_logits(example, cfg, params, tokens, prompt_len)
    margin = routing["margin"]
    clear = int(np.argmin(margin > 0.05)) if (margin <= 0.05).any() else total
    for p in range(clear):
        assert reference.relative_error(got[p], expected[p]) < 0.05, f"position {p}"

    # The first generated token has clear routing and a clear argmax (drawn so); the others are
    # checked while theirs are.
    prompt = tokens[:prompt_len]
    generated, _ = example.generate(cfg, params, prompt[None], 8)
    sequence = np.concatenate([prompt, generated[0]])
    routing = {}
    logits = reference_logits(TINY, tensors, sequence[:-1], routing=routing)
    checked = 0
    for i, token in enumerate(generated[0]):
        p = len(prompt) - 1 + i  # the position whose logits chose this token
        if (routing["margin"][: p + 1] <= 0.05).any():
            break
        if _clear_argmax(logits[p]):
            assert token == np.argmax(logits[p]), f"token {i}"
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors"])
def test_checkpoint_round_trip(example, tmp_path, convention):
    """A tiny MoE checkpoint written per expert in the tool's convention loads into stacked
    experts bit for bit: gate and up fused per expert where their global scales are equal,
    separate where not; the router and the rest as written."""
    rng = np.random.default_rng()
    for shared in (True, False):
        path = tmp_path / str(shared)
        tensors = example.write_demo_checkpoint(
            path,
            ODD,
            seed=int(rng.integers(2**31)),
            convention=convention,
            shared_scales=shared,
        )
        stored = example.ckpt.read_safetensors(path / "model.safetensors")
        key = "model.layers.1.mlp.experts.4.down_proj"
        assert (f"{key}.weight_packed" in stored) == (convention == "compressed-tensors")
        cfg, params = example.load_model(path, layout="spec")
        reader = (
            example.ckpt.from_modelopt
            if convention == "modelopt"
            else example.ckpt.from_compressed_tensors
        )

        def read(name):
            return np.asarray(reader(stored, name).global_scale, np.float32)

        for i, layer in enumerate(params["layers"]):
            prefix = f"model.layers.{i}.mlp"
            np.testing.assert_array_equal(
                np.asarray(layer["router"]), np.asarray(tensors[f"{prefix}.gate.weight"])
            )

            def written(part):
                ws = [tensors[f"{prefix}.experts.{e}.{part}"] for e in range(cfg.experts)]
                return ws

            experts = layer["experts"]
            assert sorted(experts) == (
                ["down_proj", "gate_up_proj"] if shared else ["down_proj", "gate_proj", "up_proj"]
            )
            expected = {"down_proj": written("down_proj")}
            if shared:
                pairs = zip(written("gate_proj"), written("up_proj"))
                expected["gate_up_proj"] = [example.ckpt.fuse([g, u]) for g, u in pairs]
            else:
                expected.update((p, written(p)) for p in ("gate_proj", "up_proj"))
            for part, ws in expected.items():
                got = experts[part]
                np.testing.assert_array_equal(
                    np.asarray(got.packed), np.stack([np.asarray(w.packed) for w in ws])
                )
                np.testing.assert_array_equal(
                    np.asarray(got.scale_bytes), np.stack([np.asarray(w.scale_bytes) for w in ws])
                )
                # Global scales: as the per-expert reader gives them (compressed-tensors stores
                # the reciprocal; its inverse is within half an ulp of the written one).
                gs = np.stack([np.asarray(w.global_scale, np.float32) for w in ws])
                np.testing.assert_allclose(np.asarray(got.global_scale), gs, rtol=2**-23)
                source = "gate_proj" if part == "gate_up_proj" else part
                gs = np.stack([read(f"{prefix}.experts.{e}.{source}") for e in range(cfg.experts)])
                np.testing.assert_array_equal(
                    np.asarray(got.global_scale).view(np.uint32), gs.view(np.uint32)
                )


def test_a_bf16_moe_checkpoint_runs_dense_or_quantized_on_load(example, tmp_path):
    """A bf16 MoE checkpoint: its experts stacked dense (jax.lax.ragged_dot), or quantized on load
    with each expert's gate and up as one matrix (one global scale per expert); both near the
    float64 reference."""
    rng = np.random.default_rng()
    tensors = example.write_demo_checkpoint(
        tmp_path, TINY, seed=int(rng.integers(2**31)), convention="bf16"
    )
    tokens, expected, _ = _tokens_clear_of_routing_ties(rng, TINY, tensors, 8, 1e-3)
    cfg, dense = example.load_model(tmp_path, dtype=jnp.float32)
    gate_up = dense["layers"][0]["experts"]["gate_up_proj"]
    assert not isinstance(gate_up, jax_fp4.NVFP4Weight)
    assert gate_up.shape == (cfg.experts, cfg.hidden, 2 * cfg.moe_intermediate)  # ragged_dot's
    _, params = example.load_model(tmp_path, dtype=jnp.float32, quantize=True)
    experts = params["layers"][1]["experts"]
    for e in (0, cfg.experts - 1):
        both = np.concatenate(
            [
                np.asarray(tensors[f"model.layers.1.mlp.experts.{e}.{p}.weight"], np.float32)
                for p in ("gate_proj", "up_proj")
            ]
        )
        want = jax_fp4.quantize(both)
        got = jax_fp4.unprepack(experts["gate_up_proj"])
        np.testing.assert_array_equal(np.asarray(got.packed[e]), np.asarray(want.packed))
        assert float(got.global_scale[e]) == float(want.global_scale)
    assert not isinstance(params["layers"][1]["router"], jax_fp4.NVFP4Weight)
    empty = example.empty_cache(cfg, dense, 1, len(tokens))
    dense_logits, _, _ = example.forward(cfg, dense, jnp.asarray(tokens[None]), 0, *empty)
    scale = max(1.0, np.abs(expected).max())
    assert np.abs(np.asarray(dense_logits[0]) - expected).max() <= 1e-4 * scale
    # Quantized: the weights moved by NVFP4's rounding, the logits by a few percent.
    empty = example.empty_cache(cfg, params, 1, len(tokens))
    logits, _, _ = example.forward(cfg, params, jnp.asarray(tokens[None]), 0, *empty)
    assert reference.relative_error(np.asarray(logits[0]), expected) < 0.4


def test_mixture_of_experts_matches_a_loop_over_tokens(example, device):
    """The MoE block alone on random float32 tokens: experts fused or separate, NVFP4 or dense,
    with experts that get no token and one that gets many, against a loop over tokens in
    float64; bit-identical when rerun."""
    rng = np.random.default_rng()
    for config in (TINY, ODD):
        cfg = example.Config.from_json(config)
        e, inter, h, k = cfg.experts, cfg.moe_intermediate, cfg.hidden, cfg.experts_per_token
        tokens = 13
        x = rng.standard_normal((tokens, h)).astype(np.float32)
        router = rng.standard_normal((e, h)).astype(np.float32) / np.sqrt(h)
        # Through a constant feature: expert 1 never chosen, expert E-1 by (nearly) every token.
        x[:, 0] = 1
        router[1, 0], router[e - 1, 0] = -100, 3
        floats = {
            "gate_up_proj": rng.standard_normal((e, 2 * inter, h)) / np.sqrt(h),
            "down_proj": rng.standard_normal((e, h, inter)) / np.sqrt(inter),
        }
        nvfp4 = {name: jax_fp4.quantize(w.astype(np.float32)) for name, w in floats.items()}
        weights = {name: np.asarray(jax_fp4.dequantize(w), np.float64) for name, w in nvfp4.items()}
        # Dense experts as jax.lax.ragged_dot takes them, [E, K, N].
        dense = {name: jnp.asarray(w.swapaxes(-1, -2), jnp.float32) for name, w in weights.items()}

        logits = x.astype(np.float64) @ router.T.astype(np.float64)
        expected = np.zeros((tokens, h))
        for t in range(tokens):
            probs = np.exp(logits[t] - logits[t].max())
            probs /= probs.sum()
            top = np.argsort(-logits[t], kind="stable")[:k]
            assert 1 not in top
            w = probs[top] / (probs[top].sum() if cfg.norm_topk_prob else 1.0)
            for expert, weight in zip(top, w):
                gate_up = weights["gate_up_proj"][expert] @ x[t]
                gate, up = gate_up[:inter], gate_up[inter:]
                expected[t] += weight * (
                    weights["down_proj"][expert] @ (gate / (1 + np.exp(-gate)) * up)
                )

        moe = jax.jit(example.mixture_of_experts, static_argnums=0)
        separate = example._unfuse(cfg, nvfp4, "gate_up_proj", experts=True)
        assert sorted(separate) == ["down_proj", "gate_proj", "up_proj"]
        dense_separate = example._unfuse(cfg, dense, "gate_up_proj", experts=True)
        assert dense_separate["up_proj"].shape == (e, h, inter)
        for experts in (nvfp4, separate, dense, dense_separate):
            # float32 products in full precision: a GPU's default is TF32 (a 1e-3 relative error).
            with jax.default_matmul_precision("highest"):
                got = np.asarray(moe(cfg, jnp.asarray(x), jnp.asarray(router), experts))
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
        again = np.asarray(moe(cfg, jnp.asarray(x), jnp.asarray(router), nvfp4))
        np.testing.assert_array_equal(
            again, np.asarray(moe(cfg, jnp.asarray(x), jnp.asarray(router), nvfp4))
        )


def test_random_presets_and_the_cli(example, tmp_path, capsys):
    """qwen3-30b-a3b's config as HF Qwen3MoeConfig spells it (random weights drawn by name, here
    only checked for their shapes); the tiny preset's random model unrolled and stacked, its bf16
    twin, and the command line's runs with the active experts' bytes in the floor."""
    cfg = example.Config.from_json(example.PRESETS["qwen3-30b-a3b"])
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim) == (48, 2048, 32, 4, 128)
    assert (cfg.experts, cfg.experts_per_token, cfg.moe_intermediate) == (128, 8, 768)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.rope_theta == 1e6 and cfg.rms_eps == 1e-6
    assert cfg.vocab == 151936 and cfg.rope_scaling is None
    random = example.RandomTensors(cfg)
    assert "model.layers.47.mlp.experts.gate_up_proj" in random
    assert "model.layers.48.mlp.experts.gate_up_proj" not in random
    assert (
        "model.layers.0.mlp.gate_up_proj" not in random
        and "model.layers.0.mlp.gate.weight" in random
    )
    assert example.expected_active_experts(cfg, 1) == pytest.approx(8)
    assert example.expected_active_experts(cfg, 64) == pytest.approx(
        128 * (1 - (1 - 8 / 128) ** 64)
    )

    tiny = example.PRESETS["qwen3-moe-tiny"]
    cfg, params = example.random_model(tiny, layout="spec")
    gate_up = params["layers"][1]["experts"]["gate_up_proj"]
    assert gate_up.shape == (cfg.experts, 2 * cfg.moe_intermediate, cfg.hidden)
    assert np.asarray(gate_up.global_scale).shape == (cfg.experts,)
    # quantize on a stack: each expert as if quantized alone (its own global scale).
    floats = np.random.default_rng().standard_normal((3, 32, 64)).astype(np.float32)
    floats[1] *= 10
    joint = jax_fp4.quantize(floats)
    for e in range(3):
        alone = jax_fp4.quantize(floats[e])
        np.testing.assert_array_equal(np.asarray(joint.packed[e]), np.asarray(alone.packed))
        assert float(joint.global_scale[e]) == float(alone.global_scale)
    twin = example.dense_twin(params)
    down = twin["layers"][0]["experts"]["down_proj"]  # transposed to ragged_dot's [E, K, N]
    assert down.shape == (cfg.experts, cfg.moe_intermediate, cfg.hidden)
    assert down.dtype == jnp.bfloat16
    tokens = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab, size=(2, 6)))
    # Stacked layers (lax.scan) against unrolled ones in float32: XLA rounds the two programs'
    # bf16 intermediates differently, enough to flip a near-tie of the router for some token
    # draws; in float32 they agree to a few 1e-7.
    stacked_32 = {
        stack: example.random_model(tiny, layout="spec", stack_layers=stack, dtype=jnp.float32)[1]
        for stack in (False, True)
    }
    out = {}
    for name, model in (
        ("unrolled", params),
        ("bf16", twin),
        ("unrolled f32", stacked_32[False]),
        ("stacked f32", stacked_32[True]),
    ):
        empty = example.empty_cache(cfg, model, 2, 6)
        out[name] = np.asarray(example.forward(cfg, model, tokens, 0, *empty)[0])
    assert reference.relative_error(out["stacked f32"], out["unrolled f32"]) < 1e-5
    # bf16 rounds differently from the kernels, which can flip a near-tie of the router for a
    # token (its logits then differ by design): most tokens must agree closely.
    per_token = [
        reference.relative_error(out["bf16"][b, t], out["unrolled"][b, t])
        for b in range(2)
        for t in range(6)
    ]
    assert sorted(per_token)[8] < 0.05, per_token
    # A step reads every expert at most; batch 1 with top 2 of 8 experts, ~2 of them a layer.
    full, one = example.step_bytes(params), example.step_bytes(params, active_experts=2)
    experts = sum(
        leaf.nbytes for layer in params["layers"] for leaf in jax.tree.leaves(layer["experts"])
    )
    assert full - one == pytest.approx(experts * 6 / 8, abs=2)

    # The floors read the experts the steps activated: the prompt repeated, a batch's rows route
    # as one row does (k experts a layer); each row its own random prompt, more.
    record_file = tmp_path / "moe.json"
    argv = ["--random", "qwen3-moe-tiny", "--batch", "1,4", "--max-new-tokens", "5"]
    runs = {}
    for prompt in (["--prompt-ids", "1,2,3"], ["--prompt-len", "3"]):
        assert example.main(argv + prompt + ["--compare-bf16", "--json", str(record_file)]) == 0
        text = capsys.readouterr().out
        assert "8 experts (top 2)" in text and "NVFP4 against bf16" in text
        record = json.loads(record_file.read_text())
        assert record["config"]["experts"] == 8 and record["model"] == "qwen3-moe-tiny"
        runs[prompt[0]] = record["runs"]
    for run in runs["--prompt-ids"] + runs["--prompt-len"]:
        expected = example.expected_active_experts(cfg, run["batch"])
        assert run["expected_active_experts"] == pytest.approx(expected)
        assert run["active_experts"] == run["nvfp4"]["active_experts"]
        for side, weights in (("nvfp4", params), ("bf16", twin)):
            floor = example.step_bytes(weights, active_experts=run[side]["active_experts"])
            assert run[side]["floor_bytes_per_step"] == floor + run["cache_bytes"]
        assert run["nvfp4"]["weight_bytes_per_step"] == example.step_bytes(params)
        assert run["ratio"] == pytest.approx(run["bf16_ms"] / run["nvfp4_ms"])
    repeated, distinct = runs["--prompt-ids"][1], runs["--prompt-len"][1]
    assert [r["active_experts"] for r in runs["--prompt-ids"]] == [2.0, 2.0]
    assert runs["--prompt-len"][0]["active_experts"] == 2.0
    assert repeated["bf16"]["active_experts"] == 2.0
    assert 2.0 < distinct["active_experts"] <= 8.0
    assert distinct["floor_ms"] > repeated["floor_ms"]


def test_active_experts_counts_each_steps_distinct_experts(example):
    """A step's tokens (one per row) route together: the distinct experts of each (layer,
    position) from `first` on, averaged."""
    routed = np.array(
        [
            [[[0, 1], [2, 3], [4, 5]], [[1, 0], [3, 6], [6, 7]]],  # layer 0: rows 0 and 1
            [[[0, 1], [0, 1], [0, 1]], [[0, 1], [0, 1], [2, 3]]],  # layer 1
        ]
    )
    # positions 1 and 2: layer 0 {2, 3, 6} and {4, 5, 6, 7}, layer 1 {0, 1} and {0, 1, 2, 3}
    assert example.active_experts(routed, 1) == pytest.approx((3 + 4 + 2 + 4) / 4)
    assert example.active_experts(routed, 0) == pytest.approx((2 + 3 + 4 + 2 + 2 + 4) / 6)
    assert example.active_experts(routed[:, :1], 0) == 2.0  # one row: its k experts
    with pytest.raises(ValueError, match="no position from 3 on"):
        example.active_experts(routed, 3)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(mlp_only_layers=[1]), r"layers \[1\] have a dense MLP"),
        (dict(decoder_sparse_step=2), r"layers \[0\] have a dense MLP"),
        (dict(shared_expert_intermediate_size=64), "a shared expert .Qwen2-MoE. is not supported"),
        (
            dict(num_experts_per_tok=9),
            r"num_experts_per_tok must be an int in \[1, num_experts = 8\]",
        ),
        (dict(moe_intermediate_size=None), "moe_intermediate_size is not"),
        (
            dict(model_type="mixtral", num_experts=0, num_local_experts=8),
            "num_local_experts = 8 belongs to a mixture",
        ),
        (dict(num_local_experts=4), "num_experts = 8 and num_local_experts = 4 disagree"),
        (dict(n_routed_experts=64), "n_routed_experts = 64"),
    ],
)
def test_unsupported_moe_configs_are_refused(example, change, match):
    with pytest.raises(ValueError, match=match):
        example.Config.from_json(dict(TINY, **change))


def test_transformers_5_names_qwen3_moe_experts_num_local_experts(example):
    """transformers 5's Qwen3MoeConfig writes "num_local_experts" and no "num_experts": the same
    model as the older key gives."""
    expected = example.Config.from_json(TINY)
    config = {key: value for key, value in TINY.items() if key != "num_experts"}
    assert example.Config.from_json(dict(config, num_local_experts=8)) == expected
    assert expected.experts == 8
