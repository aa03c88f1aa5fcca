"""jax_fp4.checkpoint.load_experts: the experts of a mixture-of-experts layer, written per expert in
the ModelOpt and compressed-tensors conventions (as the tools export them), loaded into stacked
NVFP4 weights; gate and up fused only where their global scales are bit-equal; the errors bad
expert checkpoints give."""

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import checkpoint as ck
from tests import reference

PREFIX = "model.layers.1.mlp.experts"
CONVENTIONS = {"modelopt": ck.to_modelopt, "compressed-tensors": ck.to_compressed_tensors}
IGNORED = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}

quantize = jax.jit(jax_fp4.quantize, static_argnames="block_size")


def _float(rng, n, k):
    return (rng.standard_normal((n, k)) * rng.uniform(0.05, 3.0)).astype(np.float32)


def _rows(w: jax_fp4.NVFP4Weight, start: int, stop: int) -> jax_fp4.NVFP4Weight:
    return jax_fp4.NVFP4Weight(
        np.asarray(w.packed)[start:stop],
        np.asarray(w.scale)[start:stop],
        np.asarray(w.global_scale),
        w.block_size,
    )


def _make_experts(rng, num_experts, inter, hidden, *, shared=True, pad_to=None):
    """Per expert (gate, up, down) NVFP4 weights as a tool exports them: with `shared`, gate and up
    quantized together (one global scale, as ModelOpt and llm-compressor export them); else
    separately (different global scales). pad_to=(Kg, Kd): K stored padded with zero columns, as
    ModelOpt packs a K that is not a multiple of 16; the second list then holds the weights of the
    true K."""

    def quantized(gate, up, down):
        if not shared:
            return quantize(gate), quantize(up), quantize(down)
        both = quantize(np.concatenate([gate, up]))
        return _rows(both, 0, inter), _rows(both, inter, 2 * inter), quantize(down)

    stored, true = [], []
    for _ in range(num_experts):
        gate, up = _float(rng, inter, hidden), _float(rng, inter, hidden) * rng.uniform(2, 9)
        down = _float(rng, hidden, inter)
        true.append(quantized(gate, up, down))
        if pad_to is None:
            stored.append(true[-1])
        else:
            pad_gate, pad_up = (np.pad(x, ((0, 0), (0, pad_to[0] - hidden))) for x in (gate, up))
            stored.append(
                quantized(pad_gate, pad_up, np.pad(down, ((0, 0), (0, pad_to[1] - inter))))
            )
    return stored, true


def _expert_tensors(
    experts, convention, prefix=PREFIX, names=("gate_proj", "up_proj", "down_proj")
):
    to = CONVENTIONS[convention]
    tensors = {}
    for e, weights in enumerate(experts):
        for name, w in zip(names, weights):
            tensors.update(to(w, f"{prefix}.{e}.{name}"))
            tensors[f"{prefix}.{e}.{name}.{IGNORED[convention]}"] = np.ones(
                () if convention == "modelopt" else (1,), np.float32
            )
    return tensors


def _checkpoint(tmp_path, tensors):
    """`tensors` beside a router and another layer's tensors, through a file: the raw tensors."""
    rng = np.random.default_rng()
    others = {
        "model.layers.1.mlp.gate.weight": rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16),
        "model.layers.1.mlp.experts_norm.weight": np.ones(16, np.float32),  # not under PREFIX.
        "model.layers.10.mlp.experts.0.gate_proj.weight": np.zeros((2, 2), np.uint8),
    }
    path = tmp_path / "model.safetensors"
    ck.save_safetensors({**tensors, **others}, path)
    return ck.read_safetensors(path)


def _same_bits(a: jax_fp4.NVFP4Weight, b: jax_fp4.NVFP4Weight):
    assert a.shape == b.shape and a.block_size == b.block_size and a.layout == b.layout
    np.testing.assert_array_equal(np.asarray(a.packed), np.asarray(b.packed))
    np.testing.assert_array_equal(np.asarray(a.scale_bytes), np.asarray(b.scale_bytes))
    np.testing.assert_array_equal(
        np.asarray(a.global_scale, np.float32).view(np.uint32),
        np.asarray(b.global_scale, np.float32).view(np.uint32),
    )


def _expert(w: jax_fp4.NVFP4Weight, e: int) -> jax_fp4.NVFP4Weight:
    return jax_fp4.NVFP4Weight(
        np.asarray(w.packed)[e], np.asarray(w.scale)[e], np.asarray(w.global_scale)[e], w.block_size
    )


def _stacked(ws):
    return jax_fp4.NVFP4Weight(
        np.stack([np.asarray(w.packed) for w in ws]),
        np.stack([np.asarray(w.scale_bytes) for w in ws]).view(ml_dtypes.float8_e4m3fn),
        np.array([np.float32(w.global_scale) for w in ws], np.float32),
        ws[0].block_size,
    )


def _ref(w) -> np.ndarray:
    return reference.dequantize(
        np.asarray(w.packed),
        np.asarray(w.scale_bytes),
        np.float64(np.asarray(w.global_scale)),
        w.block_size,
    )


# ---- loading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_experts_load_stacked_and_fused_byte_for_byte(tmp_path, convention):
    """Gate and up sharing each expert's global scale: one [E, 2I, H] gate_up_proj, expert e's
    rows `fuse([gate_e, up_e])`'s bytes, and down_proj [E, H, I]; exactly what the dense loader
    gives for each expert's layers (compressed-tensors: 1 / the stored reciprocal, as there)."""
    rng = np.random.default_rng()
    num_experts, inter, hidden = 5, 48, 64
    experts, _ = _make_experts(rng, num_experts, inter, hidden)
    raw = _checkpoint(tmp_path, _expert_tensors(experts, convention))
    got = ck.load_experts(raw, PREFIX, num_experts)
    assert set(got) == {"gate_up_proj", "down_proj"}
    assert got["gate_up_proj"].shape == (num_experts, 2 * inter, hidden)
    assert got["down_proj"].shape == (num_experts, hidden, inter)
    assert got["gate_up_proj"].global_scale.shape == (num_experts,)
    assert all(
        isinstance(getattr(w, a), np.ndarray) for w in got.values() for a in ("packed", "scale")
    )
    dense = ck.from_tensors(raw)
    layer = [
        [dense[f"{PREFIX}.{e}.{p}"] for p in ("gate_proj", "up_proj", "down_proj")]
        for e in range(num_experts)
    ]
    _same_bits(got["gate_up_proj"], _stacked([ck.fuse([g, u]) for g, u, _ in layer]))
    _same_bits(got["down_proj"], _stacked([d for _, _, d in layer]))
    for e, (gate, up, down) in enumerate(experts):  # the codes and block scales as written
        fused = _expert(got["gate_up_proj"], e)
        np.testing.assert_array_equal(
            np.asarray(fused.packed),
            np.concatenate([np.asarray(gate.packed), np.asarray(up.packed)]),
        )
        np.testing.assert_array_equal(
            np.asarray(_expert(got["down_proj"], e).scale_bytes), np.asarray(down.scale_bytes)
        )
        if convention == "modelopt":
            assert np.float32(fused.global_scale) == np.float32(gate.global_scale)
    # Each expert computes what the float64 reference says its stored weights are.
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    for e in (0, num_experts - 1):
        gate, up, _ = layer[e]
        y = jax_fp4.matmul(jnp.asarray(x), _expert(got["gate_up_proj"], e))
        ref = x.astype(np.float64) @ np.concatenate([_ref(gate), _ref(up)]).T
        np.testing.assert_allclose(
            np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
        )


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_different_gate_up_scales_keep_every_expert_separate(tmp_path, convention, caplog):
    """One expert whose gate and up global scales differ: no expert is fused (all alike), the
    three projections come back stacked with their own bytes and global scales."""
    rng = np.random.default_rng()
    num_experts, inter, hidden = 4, 32, 48
    experts, _ = _make_experts(rng, num_experts, inter, hidden)
    odd = int(rng.integers(num_experts))
    experts[odd] = _make_experts(rng, 1, inter, hidden, shared=False)[0][0]
    assert np.float32(experts[odd][0].global_scale) != np.float32(experts[odd][1].global_scale)
    raw = _checkpoint(tmp_path, _expert_tensors(experts, convention))
    with caplog.at_level("INFO", logger="jax_fp4.checkpoint"):
        got = ck.load_experts(raw, PREFIX, num_experts)
    assert f"global scales differ in 1 of {num_experts} experts (e.g. expert {odd})" in caplog.text
    assert set(got) == {"gate_proj", "up_proj", "down_proj"}
    dense = ck.from_tensors(raw)
    for p in ("gate_proj", "up_proj", "down_proj"):
        _same_bits(got[p], _stacked([dense[f"{PREFIX}.{e}.{p}"] for e in range(num_experts)]))
        assert got[p].shape == (
            (num_experts, inter, hidden) if p != "down_proj" else (num_experts, hidden, inter)
        )


def test_converted_tiled_and_mixtral_named_experts_give_the_same_weights(tmp_path):
    """load_safetensors' converted layers (spec or prepacked), Mixtral's w1/w3/w2 names and
    layout="tiled" all give the bytes of the raw tensors' stacking; "tiled" prepacks each stacked
    weight whose shape the tiled layout takes (gate_up [E, 128, 128]) and keeps the others
    (down [E, 128, 64]: K % 128 != 0) in the spec layout."""
    rng = np.random.default_rng()
    num_experts, inter, hidden = 3, 64, 128
    experts, _ = _make_experts(rng, num_experts, inter, hidden)
    tensors = _expert_tensors(experts, "modelopt")
    ck.save_safetensors(tensors, tmp_path / "model.safetensors")
    raw = ck.read_safetensors(tmp_path)
    expected = ck.load_experts(raw, PREFIX, num_experts)
    for converted in (ck.load_safetensors(tmp_path), ck.load_safetensors(tmp_path, layout="tiled")):
        got = ck.load_experts(converted, PREFIX, num_experts)
        for name in expected:
            _same_bits(got[name], expected[name])
    mixtral = _expert_tensors(
        experts,
        "compressed-tensors",
        prefix="model.layers.1.block_sparse_moe.experts",
        names=("w1", "w3", "w2"),
    )
    got = ck.load_experts(mixtral, "model.layers.1.block_sparse_moe.experts", num_experts)
    for name in expected:  # the global scales: 1 / the stored reciprocal, within an ulp
        np.testing.assert_array_equal(got[name].packed, expected[name].packed)
        np.testing.assert_array_equal(got[name].scale_bytes, expected[name].scale_bytes)
        np.testing.assert_allclose(got[name].global_scale, expected[name].global_scale, rtol=2**-23)
    tiled = ck.load_experts(raw, PREFIX, num_experts, layout="tiled")
    assert {k: w.layout for k, w in tiled.items()} == {"gate_up_proj": "tiled", "down_proj": "spec"}
    assert isinstance(tiled["gate_up_proj"].packed, np.ndarray)
    _same_bits(tiled["gate_up_proj"], jax_fp4.prepack(expected["gate_up_proj"]))
    _same_bits(jax_fp4.unprepack(tiled["gate_up_proj"]), expected["gate_up_proj"])
    _same_bits(tiled["down_proj"], expected["down_proj"])


def test_padded_k_is_stripped_per_expert(tmp_path):
    """ModelOpt experts with H = 40 and I = 24 stored padded to K = 48 and 32: in_features (by
    projection or by layer name) gives each expert's true-K weights; without it the shapes do not
    chain and the error says why."""
    rng = np.random.default_rng()
    num_experts, inter, hidden = 3, 24, 40
    stored, true = _make_experts(rng, num_experts, inter, hidden, pad_to=(48, 32))
    raw = _checkpoint(tmp_path, _expert_tensors(stored, "modelopt"))
    by_name = {
        f"{PREFIX}.{e}.{p}": k
        for e in range(num_experts)
        for p, k in (("gate_proj", hidden), ("up_proj", hidden), ("down_proj", inter))
    }
    for in_features in (
        {"gate_proj": hidden, "up_proj": hidden, "down_proj": inter},
        by_name,
        by_name.get,
    ):
        got = ck.load_experts(raw, PREFIX, num_experts, in_features=in_features)
        _same_bits(got["gate_up_proj"], _stacked([ck.fuse([g, u]) for g, u, _ in true]))
        _same_bits(got["down_proj"], _stacked([d for _, _, d in true]))
    with pytest.raises(
        ck.CheckpointError,
        match=r"gate_proj \(24, 48\), up_proj \(24, 48\) and down_proj \(40, 32\)"
        r".*pass in_features",
    ):
        ck.load_experts(raw, PREFIX, num_experts)
    with pytest.raises(ck.CheckpointError, match="holds nonzero codes"):
        ck.load_experts(
            raw,
            PREFIX,
            num_experts,
            in_features={"gate_proj": 32, "up_proj": 32, "down_proj": inter},
        )


def test_real_tools_share_gate_up_global_scales_and_load_as_experts():
    """ModelOpt 0.47 and llm-compressor 0.14 give gate_proj and up_proj one global scale in every
    layer of their exports (and q/k/v one too), so experts they export fuse: the tools' real bytes,
    each dense layer's MLP renamed as one expert of an MoE layer, load fused and bit for bit."""
    data = Path(__file__).parent / "data" / "real_tools"
    for folder, scale_suffix in (
        ("modelopt_llama_nvfp4", "weight_scale_2"),
        ("llmc_llama_nvfp4a16", "weight_global_scale"),
    ):
        raw = ck.read_safetensors(data / folder)
        layers = sorted({k.split(".")[2] for k in raw if k.startswith("model.layers.")}, key=int)
        for i in layers:
            mlp, attn = f"model.layers.{i}.mlp", f"model.layers.{i}.self_attn"
            gate, up = (raw[f"{mlp}.{p}.{scale_suffix}"] for p in ("gate_proj", "up_proj"))
            assert gate.view(np.uint32) == up.view(np.uint32)
            q, k, v = (raw[f"{attn}.{p}.{scale_suffix}"] for p in ("q_proj", "k_proj", "v_proj"))
            assert q.view(np.uint32) == k.view(np.uint32) == v.view(np.uint32)
        moe = {
            k.replace(f"model.layers.{i}.mlp.", f"moe.experts.{i}."): v
            for i in layers
            for k, v in raw.items()
            if k.startswith(f"model.layers.{i}.mlp.")
        }
        got = ck.load_experts(moe, "moe.experts", len(layers))
        dense = ck.from_tensors(raw)
        parts = [
            [dense[f"model.layers.{i}.mlp.{p}"] for p in ("gate_proj", "up_proj", "down_proj")]
            for i in layers
        ]
        _same_bits(got["gate_up_proj"], _stacked([ck.fuse([g, u]) for g, u, _ in parts]))
        _same_bits(got["down_proj"], _stacked([d for _, _, d in parts]))


# ---- bad checkpoints --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_experts():
    """Four experts (I = 32, H = 32) with shared gate/up global scales, and one expert of another
    shape, quantized once for the error tests."""
    rng = np.random.default_rng()
    experts, _ = _make_experts(rng, 4, 32, 32)
    other, _ = _make_experts(rng, 1, 16, 32)
    return experts, other[0]


def _edit(tensors, drop=(), add=None):
    """`tensors` without the names starting with one of `drop`, with `add`'s."""
    out = {k: v for k, v in tensors.items() if not k.startswith(tuple(drop))}
    out.update(add or {})
    return out


def _bad_cases(experts, other):
    good = _expert_tensors(experts, "modelopt")
    ct_expert = _expert_tensors(experts[:3], "compressed-tensors")
    bf16 = np.ones((32, 32), ml_dtypes.bfloat16)
    p = PREFIX
    return {
        "missing expert": (
            _edit(good, [f"{p}.2."]),
            r"lacks expert\(s\) \[2\] of num_experts = 4 "
            r"\(no tensors model.layers.1.mlp.experts.2.\*\)",
        ),
        "extra expert": (
            {**good, **ck.to_modelopt(experts[0][0], f"{p}.4.gate_proj")},
            r"expert\(s\) \[4\] beyond num_experts = 4",
        ),
        "missing projection": (
            _edit(good, [f"{p}.1.up_proj."]),
            r"expert 1 of 'model.layers.1.mlp.experts' has no up_proj",
        ),
        "missing tensor": (
            _edit(good, [f"{p}.3.down_proj.weight_scale_2"]),
            r"'model.layers.1.mlp.experts.3.down_proj.weight_scale_2' is missing",
        ),
        "shapes differ": (
            {**good, **ck.to_modelopt(other[0], f"{p}.3.gate_proj")},
            r"experts.3.gate_proj' has shape \(16, 32\) \(N, K\), "
            r"but expert 0's gate_proj has \(32, 32\)",
        ),
        "mixed conventions": (
            _edit(
                good, [f"{p}.2."], {k: v for k, v in ct_expert.items() if k.startswith(f"{p}.2.")}
            ),
            r"mix conventions: 'model.layers.1.mlp.experts.0.gate_proj' is ModelOpt, "
            r"'model.layers.1.mlp.experts.2.gate_proj' compressed-tensors",
        ),
        "float expert": (
            _edit(good, [f"{p}.0.gate_proj."], {f"{p}.0.gate_proj.weight": bf16}),
            r"'model.layers.1.mlp.experts.0.gate_proj' is not NVFP4-quantized .*bfloat16",
        ),
        "fused experts": (
            {**good, f"{p}.gate_up_proj": np.ones((4, 64, 32), ml_dtypes.bfloat16)},
            r"holds all experts of 'model.layers.1.mlp.experts' in one tensor",
        ),
        "fused nvfp4 experts": (
            {f"{p}.gate_up_proj.weight": np.ones((4, 64, 16), np.uint8)},
            r"'model.layers.1.mlp.experts.gate_up_proj.weight' holds all experts",
        ),
        "bias": (
            {**good, f"{p}.0.down_proj.bias": np.ones(32, np.float32)},
            r"unexpected tensor 'model.layers.1.mlp.experts.0.down_proj.bias'",
        ),
        "other projection": (
            {**good, f"{p}.1.fc1.weight": bf16},
            r"expert 1 has a projection 'fc1'",
        ),
        "two names": (
            {**good, **ck.to_modelopt(experts[0][0], f"{p}.0.w1")},
            r"expert 0 .* has both 'model.layers.1.mlp.experts.0.gate_proj' and "
            r"'model.layers.1.mlp.experts.0.w1'",
        ),
        "block size": (
            {**good, f"{p}.1.down_proj.weight_scale": np.ones((32, 1), ml_dtypes.float8_e4m3fn)},
            r"experts.1.down_proj.weight_scale' must have shape \(32, 2\)",
        ),
        "not an expert": (
            {**good, f"{p}.router.weight": bf16},
            r"tensor 'model.layers.1.mlp.experts.router.weight' under .* is not an expert's",
        ),
        "nothing there": (
            ck.to_modelopt(experts[0][0], "model.layers.1.mlp.gate_proj"),
            r"lacks expert\(s\) \[0, 1, 2, 3\] .*no expert tensors",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing expert",
        "extra expert",
        "missing projection",
        "missing tensor",
        "shapes differ",
        "mixed conventions",
        "float expert",
        "fused experts",
        "fused nvfp4 experts",
        "bias",
        "other projection",
        "two names",
        "block size",
        "not an expert",
        "nothing there",
    ],
)
def test_bad_expert_checkpoints_raise_clearly(tools_experts, case):
    tensors, message = _bad_cases(*tools_experts)[case]
    with pytest.raises(ck.CheckpointError, match=message):
        ck.load_experts(tensors, PREFIX, 4)


def test_arguments(tools_experts):
    tensors = _expert_tensors(tools_experts[0], "modelopt")
    ck.load_experts(tensors, PREFIX + ".", 4)  # a trailing dot is the same prefix
    for num_experts in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_experts must be a positive int"):
            ck.load_experts(tensors, PREFIX, num_experts)
    with pytest.raises(ValueError, match="prefix must be a non-empty string"):
        ck.load_experts(tensors, "", 4)
    with pytest.raises(ValueError, match=r"load_experts: layout must be one of"):
        ck.load_experts(tensors, PREFIX, 4, layout="packed")
    with pytest.raises(TypeError, match="in_features must be a mapping or a callable"):
        ck.load_experts(tensors, PREFIX, 4, in_features=32)
