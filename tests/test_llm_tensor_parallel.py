"""examples/llm_tensor_parallel.py: the LLM example decoded tensor-parallel (heads and MLP features
split over a 1-D mesh, jit + NamedSharding) on 8 CPU devices (tests/conftest.py sets the count),
against the float64 NumPy forward pass of tests/test_llm_generate.py and the one-device run; and on
the GPUs present (marked `gpu`; skipped below two CUDA devices)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fp4
from tests import reference
from tests._helpers import gpus, load_repo_script, skip_without_several_devices
from tests.test_llm_generate import reference_logits


@pytest.fixture(autouse=True)
def _needs_its_devices(request):
    skip_without_several_devices(request, "tensor parallelism")


@pytest.fixture(scope="module")
def tp():
    return load_repo_script("examples/llm_tensor_parallel.py")


def _model(tp, tmp_path, *, seed, config=None, stack_layers=False, layout="tiled", **options):
    """(config.json, its tensors by name, cfg, one-device params) of a random demo checkpoint."""
    config = config or tp.PRESETS["tp-tiny"]
    tensors = tp.llm.write_demo_checkpoint(tmp_path, config, seed=seed, **options)
    cfg, params = tp.llm.load_model(tmp_path, layout=layout, stack_layers=stack_layers)
    return config, tensors, cfg, params


def _cached_logits(tp, cfg, params, tokens, prompt_len, sharding=None):
    """Logits [S, vocab] of one sequence: its prompt as one prefill, then one token at a time
    (teacher-forced) through caches placed by `sharding`, whose unwritten positions hold large
    values (they must stay masked)."""
    forward = jax.jit(tp.llm.forward, static_argnums=0)
    k_cache, v_cache = jax.tree.map(
        lambda c: jnp.full_like(c, 3e4),
        tp.llm.empty_cache(cfg, params, 1, len(tokens), sharding),
    )
    if sharding is not None:  # full_like keeps the placement: the forward gets sharded caches
        assert all(c.sharding == sharding for c in jax.tree.leaves((k_cache, v_cache)))
    logits, k_cache, v_cache = forward(
        cfg, params, jnp.asarray(tokens[None, :prompt_len]), 0, k_cache, v_cache
    )
    got = [np.asarray(logits[0])]
    for p in range(prompt_len, len(tokens)):
        logits, k_cache, v_cache = forward(
            cfg, params, jnp.asarray(tokens[None, p : p + 1]), jnp.int32(p), k_cache, v_cache
        )
        got.append(np.asarray(logits[0]))
    if sharding is not None:  # the caches stay split over kv heads
        for c in jax.tree.leaves((k_cache, v_cache)):
            assert c.sharding.spec == sharding.spec
    return np.concatenate(got)


def test_fused_row_order_gives_each_shard_its_own_parts(tp):
    """qkv_proj's rows [q; k; v] reordered for 4 shards: shard s's contiguous quarter holds q
    heads 4s..4s+3, then kv heads 2s, 2s+1 of k, then of v (head_dim 2 rows each here)."""
    heads, kv_heads, hd, shards = 16, 8, 2, 4
    q, kv = heads * hd, kv_heads * hd
    order = tp.fused_row_order([q, kv, kv], shards)
    assert sorted(order.tolist()) == list(range(q + 2 * kv))
    for s, rows in enumerate(np.split(order, shards)):
        q_rows, k_rows, v_rows = np.split(rows, [q // shards, q // shards + kv // shards])
        assert q_rows.tolist() == list(range(s * q // shards, (s + 1) * q // shards))
        assert (k_rows - q).tolist() == list(range(s * kv // shards, (s + 1) * kv // shards))
        assert (v_rows - q - kv).tolist() == (k_rows - q).tolist()
    # split_fused undoes it: each part's features come back in their own order.
    y = jnp.asarray(order, jnp.float32)[None]
    parts = tp.llm.split_fused(y, [q, kv, kv], shards)
    for part, start, size in zip(parts, (0, q, q + kv), (q, kv, kv)):
        np.testing.assert_array_equal(np.asarray(part[0]), np.arange(start, start + size))


CASES = [  # (width, stacked layers, fused q/k/v and gate/up, layout, biases and q/k norms)
    pytest.param(2, False, True, "tiled", True, id="tp2-fused-bias-qknorm"),
    pytest.param(4, True, True, "tiled", False, id="tp4-fused-stacked"),
    pytest.param(4, False, False, "spec", False, id="tp4-separate-spec"),
    pytest.param(8, False, True, "tiled", False, id="tp8-fused"),
]


@pytest.mark.parametrize("width, stacked, fused, layout, extras", CASES)
def test_tensor_parallel_decode_matches_float64_and_one_device(
    tp, tmp_path, width, stacked, fused, layout, extras
):
    rng = np.random.default_rng()
    config, tensors, cfg, params = _model(
        tp,
        tmp_path,
        seed=int(rng.integers(2**31)),
        stack_layers=stacked,
        layout=layout,
        shared_scales=fused,
        qkv_bias=extras,
        qk_norm=extras,
    )
    mesh = tp.make_mesh(width)
    tp_cfg, tp_params = tp.shard_params(cfg, params, mesh)
    assert tp_cfg.shards == width and cfg.shards == 1
    sharding = tp.cache_sharding(cfg, mesh, stacked=stacked)

    # Where each weight lives: column parallel along N, row parallel along K, every shard's rows
    # in whole 16-row tiles (so the tiled layout stays where it was asked for).
    layer = tp_params["layers"] if stacked else tp_params["layers"][0]
    lead = (None,) if stacked else ()
    column = ("qkv_proj", "gate_up_proj") if fused else ("q_proj", "k_proj", "gate_proj")
    for name in column:
        assert layer[name].packed.sharding.spec == P(*lead, "model", None), name
        assert layer[name].layout == layout
    for name in ("o_proj", "down_proj"):
        assert layer[name].packed.sharding.spec == P(*lead, None, "model"), name
        assert layer[name].layout == "spec"  # the tiled layout cannot split K

    total, prompt_len = 20, 7
    tokens = rng.integers(0, cfg.vocab, size=total)
    expected = reference_logits(config, tensors, tokens)
    one = _cached_logits(tp, cfg, params, tokens, prompt_len)
    got = _cached_logits(tp, tp_cfg, tp_params, tokens, prompt_len, sharding)
    assert got.shape == expected.shape and np.isfinite(got).all()
    for p in range(total):
        # bf16 activations through two layers: a few percent of the logits' norm off float64,
        # as the one-device run (tests/test_llm_generate.py); and within bf16 rounding of it.
        assert reference.relative_error(got[p], expected[p]) < 0.05, f"position {p}"
        assert reference.relative_error(got[p], one[p]) < 2e-2, f"position {p}"

    # Greedy decoding through llm_generate.generate, the caches split over kv heads.
    bound = 4 * np.abs(got - one).max()
    _same_tokens_up_to_a_near_tie(
        tp, cfg, params, tp_cfg, tp_params, sharding, tokens[:prompt_len], bound
    )


def _same_tokens_up_to_a_near_tie(tp, cfg, params, tp_cfg, tp_params, sharding, prompt, bound):
    """Greedy tokens of the tensor-parallel model equal the one-device model's until a step whose
    top two logits (one device, teacher-forced) lie within `bound` (ties of the bf16 logits of a
    small random model are common); there they may differ, and the sequences part."""
    prompt = np.asarray(prompt).reshape(1, -1)
    new = 6
    ref_tokens, _ = tp.llm.generate(cfg, params, prompt, new)
    tp_tokens, _ = tp.llm.generate(tp_cfg, tp_params, prompt, new, cache_sharding=sharding)
    sequence = np.concatenate([prompt[0], ref_tokens[0]])
    forced = _cached_logits(tp, cfg, params, sequence, prompt.shape[1])[prompt.shape[1] - 1 : -1]
    top2 = np.sort(forced, axis=-1)[:, -2:]
    for step, (a, b) in enumerate(zip(tp_tokens[0], ref_tokens[0])):
        if a != b:
            assert top2[step, 1] - top2[step, 0] <= bound, f"step {step}: {a} != {b}, {top2}"
            break


def _all_gathers(hlo: str) -> list[str]:
    return [ln for ln in hlo.splitlines() if re.search(r"\ball-gather(?:-start)?\(", ln)]


@pytest.mark.parametrize("width", [2, 4, 8])
def test_one_all_reduce_per_row_parallel_projection(tp, tmp_path, width):
    """The compiled decode step: one all-reduce after o_proj and one after down_proj per layer,
    each the float32 partial products of the [B, 1, hidden] output; no weight moves (the only
    all-gathers are the greedy argmax's per-device (max, index) pairs of the vocab-split
    lm_head); each kernel call runs on its shard."""
    _, _, cfg, params = _model(tp, tmp_path, seed=0)
    mesh = tp.make_mesh(width)
    tp_cfg, tp_params = tp.shard_params(cfg, params, mesh)
    batch = 3
    hlo = tp.compiled_step(tp_cfg, tp_params, batch, 16, tp.cache_sharding(cfg, mesh))
    counts = tp.collectives(hlo)
    assert counts == {
        **dict.fromkeys(tp.COLLECTIVES, 0),
        "all-reduce": 2 * cfg.layers,
        "all-gather": 2,
    }
    reduces = [ln for ln in hlo.splitlines() if re.search(r"\ball-reduce(?:-start)?\(", ln)]
    assert all(f"f32[{batch},1,{cfg.hidden}]" in ln for ln in reduces), reduces
    assert all(re.search(rf"[fs]32\[{batch},{width}\]", ln) for ln in _all_gathers(hlo))
    # Local [N, K/2] packed shapes of the kernel calls: q/k/v and gate/up split along N, o and
    # down along K.
    qkv = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    local = {
        (qkv // width, cfg.hidden // 2),
        (2 * cfg.intermediate // width, cfg.hidden // 2),
        (cfg.hidden, cfg.heads * cfg.head_dim // width // 2),
        (cfg.hidden, cfg.intermediate // width // 2),
    }
    calls = [ln for ln in hlo.splitlines() if 'custom_call_target="jax_fp4_matmul_cpu"' in ln]
    assert len(calls) == 4 * cfg.layers
    shapes = {tuple(map(int, m)) for m in re.findall(r"u8\[(\d+),(\d+)\]", " ".join(calls))}
    assert local <= shapes, (local, shapes)


def test_bf16_twin_tensor_parallel(tp, tmp_path):
    """llm_generate.dense_twin placed by the same shard_params: XLA's dot partitions it with the
    same two all-reduces a layer, and its logits are the one-device twin's."""
    _, _, cfg, params = _model(tp, tmp_path, seed=int(np.random.default_rng().integers(2**31)))
    dense = tp.llm.dense_twin(params)
    mesh = tp.make_mesh(4)
    tp_cfg, tp_dense = tp.shard_params(cfg, dense, mesh)
    sharding = tp.cache_sharding(cfg, mesh)
    assert tp_dense["layers"][0]["gate_up_proj"].sharding.spec == P("model", None)
    prompt = np.random.default_rng().integers(0, cfg.vocab, (2, 5))
    one = tp.first_step_logits(cfg, dense, prompt)
    got = tp.first_step_logits(tp_cfg, tp_dense, prompt, sharding)
    for b in range(2):
        assert reference.relative_error(got[b], one[b]) < 2e-2
    counts = tp.collectives(tp.compiled_step(tp_cfg, tp_dense, 2, 8, sharding))
    assert counts["all-reduce"] == 2 * cfg.layers and counts["all-to-all"] == 0
    assert counts["collective-permute"] == 0


def test_width_that_does_not_divide_the_heads_is_refused(tp, tmp_path, capsys):
    """kv heads (2 in the demo model) must divide by the width: each device holds whole heads and
    whole cache heads."""
    _, _, cfg, params = _model(tp, tmp_path, seed=0, config=tp.llm.DEMO_CONFIG)
    with pytest.raises(ValueError, match=r"width 4 must divide num_key_value_heads = 2"):
        tp.shard_params(cfg, params, tp.make_mesh(4))
    with pytest.raises(ValueError, match=r"width 4 must divide num_key_value_heads = 2"):
        tp.cache_sharding(cfg, tp.make_mesh(4))
    tp.shard_params(cfg, params, tp.make_mesh(2))  # 2 divides it
    with pytest.raises(SystemExit):
        tp.main(["--random", "demo", "--tp", "4", "--max-new-tokens", "2"])
    assert "--tp 4: tensor-parallel width 4 must divide num_key_value_heads" in (
        capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="tp must be in"):
        tp.make_mesh(16)


def test_a_split_that_jax_fp4_would_gather_is_refused(tp):
    """down_proj's K = intermediate 528 over 2 devices: 264 columns, not whole 16-column scale
    blocks per shard pair (K % (16 x 2) != 0): the rules would gather K on every step, so the
    placement says why instead."""
    config = dict(tp.PRESETS["tp-tiny"], intermediate_size=528, num_hidden_layers=1)
    cfg, params = tp.llm.random_model(config)
    with pytest.raises(ValueError, match=r"cannot be split: .*K=528 over 2 shards"):
        tp.shard_params(cfg, params, tp.make_mesh(2))


def test_mixture_of_experts_is_refused(tp):
    cfg, params = tp.llm.random_model(tp.llm.PRESETS["qwen3-moe-tiny"])
    with pytest.raises(ValueError, match="mixture-of-experts"):
        tp.shard_params(cfg, params, tp.make_mesh(2))


def test_the_cli_writes_its_json(tp, tmp_path, capsys):
    out = tmp_path / "results" / "tp_decode.json"
    assert (
        tp.main(
            ["--random", "tp-tiny", "--tp", "2", "--batch", "2", "--max-new-tokens", "5"]
            + ["--json", str(out)]
        )
        == 0
    )
    record = json.loads(out.read_text())
    [run] = record["runs"]
    assert {"gpus", "batch", "tp_ms", "one_gpu_ms", "bf16_tp_ms", "same_leading_tokens"} <= set(run)
    assert run["gpus"] == 2 and run["batch"] == 2
    assert all(run[k] > 0 for k in ("tp_ms", "one_gpu_ms", "bf16_tp_ms"))
    assert 0 <= run["first_step_max_logit_diff"] <= 0.05 * run["first_step_max_abs_logit"]
    assert run["collectives_per_step"]["all-reduce"] == 2 * record["config"]["layers"]
    assert "tp 2, batch 2: a decode step" in capsys.readouterr().out


def test_help_describes_the_example_and_runs_nothing(tp, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tp.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for words in ("What it does", "What it needs", "What it prints", "--tp", "tp-tiny"):
        assert words in text


@pytest.mark.gpu
def test_tensor_parallel_decode_on_gpus(tp, tmp_path):
    """Every GPU (up to 8, a width dividing the tiny model's 8 kv heads): the decode GEMV runs
    per shard under the partitioning rules; logits and greedy tokens as on one GPU, two
    all-reduces a layer, and the command line's record for the same run."""
    width = max(w for w in (2, 4, 8) if w <= len(gpus()))
    cfg, params = tp.llm.random_model(tp.PRESETS["tp-tiny"])
    assert (
        jax_fp4.dispatch_path(
            jnp.zeros((2, cfg.hidden), jnp.bfloat16), params["layers"][0]["qkv_proj"]
        )
        == "gemv"
    )
    mesh = tp.make_mesh(width)
    tp_cfg, tp_params = tp.shard_params(cfg, params, mesh)
    sharding = tp.cache_sharding(cfg, mesh)
    assert {d.platform for d in tp_params["layers"][0]["qkv_proj"].packed.devices()} == {"gpu"}
    prompt = np.random.default_rng().integers(0, cfg.vocab, (2, 6))
    one = tp.first_step_logits(cfg, params, prompt)
    got = tp.first_step_logits(tp_cfg, tp_params, prompt, sharding)
    for b in range(2):
        assert reference.relative_error(got[b], one[b]) < 2e-2
    bound = 4 * np.abs(got - one).max()
    _same_tokens_up_to_a_near_tie(tp, cfg, params, tp_cfg, tp_params, sharding, prompt[0], bound)
    counts = tp.collectives(tp.compiled_step(tp_cfg, tp_params, 2, 16, sharding))
    assert counts["all-reduce"] == 2 * cfg.layers and counts["all-to-all"] == 0
    assert counts["collective-permute"] == 0

    out = tmp_path / "tp_decode.json"
    args = ["--tp", str(width), "--batch", "1,2", "--max-new-tokens", "12", "--json", str(out)]
    assert tp.main(args) == 0
    record = json.loads(out.read_text())
    assert record["platform"] == "gpu" and len(record["runs"]) == 2
    for run in record["runs"]:
        assert run["gpus"] == width
        assert run["first_step_max_logit_diff"] <= 0.05 * run["first_step_max_abs_logit"]
        assert all(run[k] > 0 for k in ("tp_ms", "one_gpu_ms", "bf16_tp_ms"))
