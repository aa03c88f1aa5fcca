"""jax_fp4.checkpoint: ModelOpt / compressed-tensors conventions, the safetensors reader and writer,
fusing, and the errors bad checkpoints give. Needs neither torch nor the safetensors package; the
cross-checks against them run only where they are installed."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import checkpoint as ck
from tests import reference

F8 = np.dtype(ml_dtypes.float8_e4m3fn)

# jax_fp4.quantize, compiled once per shape (eagerly it dispatches dozens of small ops).
quantize = jax.jit(jax_fp4.quantize, static_argnames="block_size")


def _float_weight(seed, n=48, k=64):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * rng.uniform(0.01, 3.0)).astype(np.float32)


def _same_bits(a: jax_fp4.NVFP4Weight, b: jax_fp4.NVFP4Weight):
    assert a.shape == b.shape and a.block_size == b.block_size
    np.testing.assert_array_equal(np.asarray(a.packed), np.asarray(b.packed))
    np.testing.assert_array_equal(np.asarray(a.scale_bytes), np.asarray(b.scale_bytes))
    np.testing.assert_array_equal(
        np.asarray(a.global_scale, np.float32).view(np.uint32),
        np.asarray(b.global_scale, np.float32).view(np.uint32),
    )


def _ref_dense(w) -> np.ndarray:
    return reference.dequantize(
        np.asarray(w.packed),
        np.asarray(w.scale_bytes),
        np.float64(np.asarray(w.global_scale)),
        w.block_size,
    )


# ---- round trips ------------------------------------------------------------------------------


def test_modelopt_round_trip_through_a_file_is_bit_exact(tmp_path):
    w = quantize(_float_weight(0))
    tensors = ck.to_modelopt(w, "model.layers.0.mlp.down_proj")
    assert {k: (v.dtype, v.shape) for k, v in tensors.items()} == {
        "model.layers.0.mlp.down_proj.weight": (np.dtype(np.uint8), (48, 32)),
        "model.layers.0.mlp.down_proj.weight_scale": (F8, (48, 4)),
        "model.layers.0.mlp.down_proj.weight_scale_2": (np.dtype(np.float32), ()),
    }
    bias = np.random.default_rng(1).standard_normal(48).astype(np.float32)
    path = tmp_path / "model.safetensors"
    ck.save_safetensors(
        {
            **tensors,
            "model.layers.0.mlp.down_proj.bias": bias,
            "model.layers.0.mlp.down_proj.input_scale": np.float32(0.5),
        },
        path,
    )
    loaded = ck.load_safetensors(path)
    assert set(loaded) == {"model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj.bias"}
    _same_bits(loaded["model.layers.0.mlp.down_proj"], w)
    np.testing.assert_array_equal(loaded["model.layers.0.mlp.down_proj.bias"], bias)
    # Writing what was loaded gives the same bytes again.
    again = tmp_path / "again.safetensors"
    ck.save_safetensors(loaded, again)
    stripped = tmp_path / "stripped.safetensors"
    ck.save_safetensors({**tensors, "model.layers.0.mlp.down_proj.bias": bias}, stripped)
    assert again.read_bytes() == stripped.read_bytes()
    # The layer computes what the float64 reference says the stored weight is.
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    y = jax_fp4.matmul(jnp.asarray(x), loaded["model.layers.0.mlp.down_proj"])
    assert reference.relative_error(y, x @ _ref_dense(w).T) < 1e-5


def test_compressed_tensors_stores_the_reciprocal_global_scale(tmp_path):
    w = quantize(_float_weight(3))
    tensors = ck.to_compressed_tensors(w, "proj")
    inv = tensors["proj.weight_global_scale"]
    assert inv.dtype == np.float32 and inv.shape == (1,)
    np.testing.assert_allclose(
        np.float64(inv[0]) * np.float64(np.asarray(w.global_scale)), 1.0, rtol=2**-23
    )
    # Dequantization DIVIDES by the stored value (compressed-tensors' definition), in float64:
    expected = reference.dequantize(
        tensors["proj.weight_packed"], tensors["proj.weight_scale"].view(np.uint8), 1.0, 16
    ) / np.float64(inv[0])
    ck.save_safetensors(
        {**tensors, "proj.input_global_scale": np.ones(1, np.float32)}, tmp_path / "ct.safetensors"
    )
    loaded = ck.load_safetensors(tmp_path / "ct.safetensors")
    assert set(loaded) == {"proj"}
    got = loaded["proj"]
    np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(w.packed))
    np.testing.assert_array_equal(np.asarray(got.scale_bytes), np.asarray(w.scale_bytes))
    assert got.global_scale.dtype == np.float32
    assert np.float32(got.global_scale) == np.float32(1) / inv[0]
    np.testing.assert_allclose(_ref_dense(got), expected, rtol=2**-23, atol=0)
    np.testing.assert_allclose(np.asarray(jax_fp4.dequantize(got)), expected, rtol=2**-22, atol=0)


def test_a_checkpoint_with_both_conventions_and_other_tensors(tmp_path):
    a = quantize(_float_weight(4))
    b = quantize(_float_weight(5, n=32, k=32))
    fp8_weight = np.random.default_rng(6).standard_normal((8, 16)).astype(F8)
    others = {
        "embed.weight": np.random.default_rng(7)
        .standard_normal((10, 4))
        .astype(ml_dtypes.bfloat16),
        "norm.weight": np.ones(64, np.float16),
        "fp8.weight": fp8_weight,
        "fp8.weight_scale": np.float32(0.25),  # FP8 layer: passed through
        "w4.weight_packed": np.arange(8, dtype=np.int32).reshape(2, 4),  # int4 pack-quantized too
        "w4.weight_scale": np.ones((2, 1), ml_dtypes.bfloat16),
        "w4.weight_shape": np.array([2, 32]),
        "position_ids": np.arange(12, dtype=np.int64).reshape(1, 12),
        "flags": np.array([True, False]),
    }
    ck.save_safetensors(
        {
            **ck.to_modelopt(a, "q"),
            **ck.to_compressed_tensors(b, "k"),
            **others,
            "q.input_scale": np.float32(1.0),
        },
        tmp_path / "mixed.safetensors",
        metadata={"format": "pt"},
    )
    loaded = ck.load_safetensors(tmp_path / "mixed.safetensors")
    assert set(loaded) == {"q", "k", *others}
    _same_bits(loaded["q"], a)
    np.testing.assert_array_equal(np.asarray(loaded["k"].packed), np.asarray(b.packed))
    for name, value in others.items():
        assert loaded[name].dtype == np.asarray(value).dtype and loaded[name].shape == np.shape(
            value
        )
        np.testing.assert_array_equal(
            loaded[name].reshape(-1).view(np.uint8), np.asarray(value).reshape(-1).view(np.uint8)
        )


def test_sharded_checkpoint_with_index(tmp_path):
    weights = {f"layers.{i}.proj": quantize(_float_weight(10 + i)) for i in range(3)}
    files = {
        "model-00001-of-00002.safetensors": ["layers.0.proj", "layers.1.proj"],
        "model-00002-of-00002.safetensors": ["layers.2.proj"],
    }
    weight_map = {}
    for filename, names in files.items():
        tensors = {}
        for name in names:
            tensors.update(ck.to_modelopt(weights[name], name))
        if filename.startswith("model-00002"):
            # A layer split over two shards: its scale_2 sits in the other file.
            del tensors["layers.2.proj.weight_scale_2"]
            extra = {
                "layers.2.proj.weight_scale_2": np.asarray(weights["layers.2.proj"].global_scale)
            }
            ck.save_safetensors(extra, tmp_path / "model-extra.safetensors")
            weight_map["layers.2.proj.weight_scale_2"] = "model-extra.safetensors"
        ck.save_safetensors(tensors, tmp_path / filename)
        weight_map.update((key, filename) for key in tensors)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for source in (tmp_path, index, sorted(tmp_path.glob("*.safetensors"))):
        loaded = ck.load_safetensors(source)
        assert set(loaded) == set(weights)
        for name, w in weights.items():
            _same_bits(loaded[name], w)
    # An index promising a tensor its file lacks.
    weight_map["layers.9.proj.weight"] = "model-extra.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        ck.CheckpointError, match=r"absent from their files.*layers\.9\.proj\.weight"
    ):
        ck.load_safetensors(tmp_path)
    # The same tensor in two files.
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes((tmp_path / "model-extra.safetensors").read_bytes())
    with pytest.raises(ck.CheckpointError, match="'layers.2.proj.weight_scale_2' is in both"):
        ck.read_safetensors([tmp_path / "model-extra.safetensors", copy])


def test_stacked_weights_round_trip(tmp_path):
    stacked = quantize(np.stack([_float_weight(20), _float_weight(21)]))
    assert stacked.global_scale.shape == (2,)
    ck.save_safetensors({"experts": stacked}, tmp_path / "e.safetensors")
    _same_bits(ck.load_safetensors(tmp_path / "e.safetensors")["experts"], stacked)


def test_load_in_the_tiled_layout(tmp_path):
    """layout="tiled": every layer the tiled layout takes comes back prepacked, as host NumPy,
    bit for bit `jax_fp4.prepack`'s; the others stay in the spec layout; values are unchanged."""
    tileable = quantize(_float_weight(40, n=48, k=256))  # N % 16, K % 128
    stacked = quantize(np.stack([_float_weight(41, n=32, k=128), _float_weight(42, n=32, k=128)]))
    ragged = quantize(_float_weight(43, n=40, k=256))  # N % 16 != 0
    short = quantize(_float_weight(44, n=48, k=96))  # K % 128 != 0
    bias = np.arange(48, dtype=np.float32)
    ck.save_safetensors(
        {
            **ck.to_modelopt(tileable, "a"),
            **ck.to_compressed_tensors(ragged, "b"),
            "experts": stacked,
            "c": short,
            "a.bias": bias,
        },
        tmp_path / "m.safetensors",
    )
    spec = ck.load_safetensors(tmp_path / "m.safetensors")
    tiled = ck.load_safetensors(tmp_path / "m.safetensors", layout="tiled")
    assert {k: getattr(v, "layout", None) for k, v in tiled.items()} == {
        "a": "tiled",
        "experts": "tiled",
        "b": "spec",
        "c": "spec",
        "a.bias": None,
    }
    for name in ("a", "experts"):
        w, expected = tiled[name], jax_fp4.prepack(spec[name])
        assert isinstance(w.packed, np.ndarray) and isinstance(w.scale, np.ndarray)
        np.testing.assert_array_equal(w.packed, np.asarray(expected.packed))
        np.testing.assert_array_equal(np.asarray(w.scale_bytes), np.asarray(expected.scale_bytes))
        assert not np.array_equal(w.packed, np.asarray(spec[name].packed))  # really reordered
        _same_bits(jax_fp4.unprepack(w), spec[name])
    for name in ("b", "c"):
        _same_bits(tiled[name], spec[name])
    np.testing.assert_array_equal(tiled["a.bias"], bias)
    # Saved again, prepacked layers are written in the spec layout.
    ck.save_safetensors(tiled, tmp_path / "again.safetensors")
    again = ck.load_safetensors(tmp_path / "again.safetensors")
    for name in ("a", "b", "c", "experts"):
        _same_bits(again[name], spec[name])
    # The prepacked layer computes what the float64 reference says the stored weight is.
    x = np.random.default_rng(45).standard_normal((3, 256)).astype(np.float32)
    y = np.asarray(jax_fp4.matmul(jnp.asarray(x), tiled["a"]), np.float64)
    ref = x.astype(np.float64) @ _ref_dense(tileable).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match=r"load_safetensors: layout must be one of .*'packed'"):
        ck.load_safetensors(tmp_path / "m.safetensors", layout="packed")
    with pytest.raises(ValueError, match=r"from_tensors: layout must be one of .*'sm120'"):
        ck.from_tensors({}, layout="sm120")


# ---- fusing -----------------------------------------------------------------------------------


def test_fuse_parts_that_share_a_global_scale():
    q, k, v = _float_weight(30, n=32), _float_weight(31, n=16), _float_weight(32, n=16)
    whole = quantize(np.concatenate([q, k, v]))  # one global scale, as ModelOpt exports
    bounds = [(0, 32), (32, 48), (48, 64)]
    parts = {
        name: jax_fp4.NVFP4Weight(
            np.asarray(whole.packed)[a:b],
            np.asarray(whole.scale)[a:b],
            np.asarray(whole.global_scale),
        )
        for name, (a, b) in zip(("q_proj", "k_proj", "v_proj"), bounds)
    }
    _same_bits(ck.fuse(parts), whole)
    _same_bits(ck.fuse(list(parts.values())), whole)


def test_fuse_refuses_different_global_scales():
    q, k = quantize(_float_weight(33, n=32)), quantize(_float_weight(34, n=16) * 7)
    with pytest.raises(ValueError, match=r"different global scales \(gate_proj: .*, up_proj: .*\)"):
        ck.fuse({"gate_proj": q, "up_proj": k})
    with pytest.raises(ValueError, match=r"weights\[1\] has shape \(16, 32\).*K = 64"):
        ck.fuse([q, quantize(_float_weight(35, n=16, k=32))])
    with pytest.raises(ValueError, match="empty"):
        ck.fuse([])
    with pytest.raises(TypeError, match="must be an NVFP4Weight"):
        ck.fuse([q, np.zeros((4, 4))])


# ---- bad checkpoints --------------------------------------------------------------------------


def _modelopt(seed=40):
    return ck.to_modelopt(quantize(_float_weight(seed)), "layer")


def test_missing_companion_tensors_name_the_layer():
    t = _modelopt()
    del t["layer.weight_scale"]
    with pytest.raises(
        ck.CheckpointError, match=r"ModelOpt layer 'layer': tensor 'layer.weight_scale' is missing"
    ):
        ck.from_modelopt(t, "layer")
    t = _modelopt()
    del t["layer.weight_scale_2"]
    with pytest.raises(ck.CheckpointError, match=r"'layer.weight_scale_2' is missing"):
        ck.from_tensors(t)  # uint8 weight + block scales: recognised, then refused
    t = ck.to_compressed_tensors(quantize(_float_weight(41)), "ct")
    del t["ct.weight_global_scale"]
    with pytest.raises(
        ck.CheckpointError,
        match=r"compressed-tensors layer 'ct'.*'ct.weight_global_scale' is missing",
    ):
        ck.from_tensors(t)
    with pytest.raises(ck.CheckpointError, match=r"'absent.weight' is missing"):
        ck.from_modelopt(_modelopt(), "absent")


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "layer.weight_scale",
            np.zeros((48, 3), F8),
            r"must have shape \(48, 4\) = \[N, ceil\(K/16\)\].*got \(48, 3\)",
        ),
        ("layer.weight_scale", np.zeros((47, 4), F8), r"must have shape \(48, 4\).*got \(47, 4\)"),
        (
            "layer.weight_scale",
            np.ones((48, 4), np.float32),
            r"must be float8_e4m3fn \(F8_E4M3\), got dtype float32",
        ),
        (
            "layer.weight_scale",
            np.ones((48, 4), np.uint8),
            r"got dtype uint8 \(uint8 block scales are E8M0",
        ),
        (
            "layer.weight",
            np.ones((48, 64), np.float16),
            r"must be uint8 .* got dtype float16 \(a float weight",
        ),
        ("layer.weight", np.ones(32, np.uint8), r"must be \[N, K/2\] \(rank >= 2\)"),
        ("layer.weight_scale_2", np.ones(3, np.float32), r"must be a scalar .* got shape \(3,\)"),
        ("layer.weight_scale_2", np.int32(1), r"must be float32, got dtype int32"),
        ("layer.weight_scale_2", np.float32(np.nan), r"must be finite and positive"),
        ("layer.weight_scale_2", np.float32(-1.0), r"must be finite and positive"),
    ],
)
def test_wrong_shapes_and_dtypes_raise_clearly(key, value, message):
    t = _modelopt()
    t[key] = value
    with pytest.raises(ck.CheckpointError, match=r"ModelOpt layer 'layer': .*" + message):
        ck.from_modelopt(t, "layer")


def test_bad_files(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ck.CheckpointError, match="not a safetensors file"):
        ck.read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ck.CheckpointError, match="exceeds the file size"):
        ck.read_safetensors(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)  # truncated data
    with pytest.raises(ck.CheckpointError, match=r"tensor 'x' \(F32 \[4\]\) needs 16 bytes"):
        ck.read_safetensors(path)
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(ck.CheckpointError, match="dtype 'F4'"):
        ck.read_safetensors(path)
    with pytest.raises(FileNotFoundError):
        ck.load_safetensors(tmp_path / "nope.safetensors")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="no .safetensors files"):
        ck.load_safetensors(tmp_path / "empty_dir")


def test_writer_arguments():
    w = quantize(_float_weight(50), block_size=32)
    with pytest.raises(ValueError, match="block_size 16, got 32"):
        ck.to_modelopt(w, "x")
    with pytest.raises(ValueError, match="name must be a non-empty"):
        ck.to_modelopt(quantize(_float_weight(50)), "")
    with pytest.raises(TypeError, match="must be an NVFP4Weight"):
        ck.to_modelopt(np.zeros((4, 4)), "x")
    with pytest.raises(ValueError, match="appears twice"):
        ck.save_safetensors(
            {"x": quantize(_float_weight(50)), "x.weight": np.zeros(1)}, "/dev/null"
        )
    with pytest.raises(TypeError, match="cannot store"):
        ck.save_safetensors({"x": np.array(["a"])}, "/dev/null")


# ---- interoperability -------------------------------------------------------------------------


def test_files_read_by_the_safetensors_library(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.ones((0, 2), np.int64),
        "c": np.array([1.5], np.float16),
    }
    ck.save_safetensors(tensors, tmp_path / "x.safetensors", metadata={"format": "np"})
    theirs = safetensors_numpy.load_file(str(tmp_path / "x.safetensors"))
    for name, value in tensors.items():
        np.testing.assert_array_equal(theirs[name], value)
        assert theirs[name].dtype == value.dtype
    safetensors_numpy.save_file(tensors, str(tmp_path / "y.safetensors"))
    ours = ck.read_safetensors(tmp_path / "y.safetensors")
    for name, value in tensors.items():
        np.testing.assert_array_equal(ours[name], value)


def test_float8_interoperates_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    w = quantize(_float_weight(60))
    ck.save_safetensors({"layer": w}, tmp_path / "ours.safetensors")
    theirs = st_torch.load_file(str(tmp_path / "ours.safetensors"))
    assert theirs["layer.weight_scale"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(
        theirs["layer.weight_scale"].view(torch.uint8).numpy(), np.asarray(w.scale_bytes)
    )
    st_torch.save_file(theirs, str(tmp_path / "torch.safetensors"))
    _same_bits(ck.load_safetensors(tmp_path / "torch.safetensors")["layer"], w)


def test_core_imports_neither_flax_nor_safetensors():
    code = (
        "import sys, jax_fp4, jax_fp4.checkpoint; "
        "bad = [m for m in ('flax', 'safetensors', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nnx_model_save_and_load(tmp_path):
    pytest.importorskip("flax")
    from flax import nnx

    from jax_fp4 import nnx as fp4nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List(
                [
                    nnx.Linear(32, 32, rngs=rngs, bias_init=nnx.initializers.normal(1.0))
                    for _ in range(2)
                ]
            )
            self.out = nnx.Linear(32, 8, use_bias=False, rngs=rngs)

        def __call__(self, x):
            for block in self.blocks:
                x = jnp.tanh(block(x))
            return self.out(x)

    model = fp4nnx.quantize_model(Net(nnx.Rngs(0)))
    tensors = fp4nnx.export_weights(model)
    assert set(tensors) == {"blocks.0", "blocks.0.bias", "blocks.1", "blocks.1.bias", "out"}
    ck.save_safetensors(tensors, tmp_path / "net.safetensors")
    fresh = fp4nnx.quantize_model(Net(nnx.Rngs(1)))
    x = jnp.asarray(np.random.default_rng(70).standard_normal((3, 32)), jnp.float32)
    assert not np.array_equal(fresh(x), model(x))
    loaded = ck.load_safetensors(tmp_path / "net.safetensors")
    fp4nnx.load_weights(fresh, loaded)
    np.testing.assert_array_equal(fresh(x), model(x))
    del loaded["blocks.1.bias"]
    with pytest.raises(
        ck.CheckpointError, match=r"'blocks.1' has a bias but 'blocks.1.bias' is missing"
    ):
        fp4nnx.load_weights(fresh, loaded)
    loaded["blocks.1.bias"] = np.zeros(32, np.float32)
    loaded["out"] = quantize(_float_weight(71, n=8, k=64))
    with pytest.raises(ck.CheckpointError, match=r"'out' has shape \(8, 64\).*expects \(8, 32\)"):
        fp4nnx.load_weights(fresh, loaded)
    del loaded["out"]
    with pytest.raises(ck.CheckpointError, match=r"no NVFP4 weight 'out'"):
        fp4nnx.load_weights(fresh, loaded)
    fp4nnx.load_weights(fresh, loaded, strict=False)


def test_tiled_weights_save_and_fuse_in_the_spec_layout(tmp_path):
    """A prepacked (tiled) weight is written as the spec layout, and fuse() gives a spec weight."""
    w = quantize(_float_weight(80, n=32, k=256))
    tiled = jax_fp4.prepack(w)
    ck.save_safetensors(ck.to_modelopt(tiled, "layer"), tmp_path / "t.safetensors")
    ck.save_safetensors(ck.to_modelopt(w, "layer"), tmp_path / "s.safetensors")
    assert (tmp_path / "t.safetensors").read_bytes() == (tmp_path / "s.safetensors").read_bytes()
    _same_bits(ck.load_safetensors(tmp_path / "t.safetensors")["layer"], w)
    fused = ck.fuse([tiled, w])
    assert fused.layout == "spec"
    _same_bits(fused, ck.fuse([w, w]))


# ---- K padding (ModelOpt pads K to a multiple of 16 when it packs) -------------------------------


def _padded_modelopt_layer(tmp_path, k=40, padded=48, n=8):
    """A ModelOpt file of one layer with true K = k stored padded to `padded` (zero columns), as
    ModelOpt writes a layer whose in_features is not a multiple of its block; and the weight
    jax_fp4.quantize makes of the true K."""
    w = _float_weight(7, n, k)
    stored = quantize(np.pad(w, ((0, 0), (0, padded - k))))
    ck.save_safetensors({"model.layers.0.mlp.down_proj": stored}, tmp_path / "model.safetensors")
    return quantize(w)


def test_padded_k_is_stripped_with_in_features(tmp_path, caplog):
    expected = _padded_modelopt_layer(tmp_path)
    name = "model.layers.0.mlp.down_proj"
    assert ck.load_safetensors(tmp_path)[name].k == 48  # the file alone cannot tell
    for in_features in ({name: 40, "lm_head": 256}, lambda layer: 40 if layer == name else None):
        with caplog.at_level("INFO", logger="jax_fp4.checkpoint"):
            got = ck.load_safetensors(tmp_path, in_features=in_features)[name]
        assert got.shape == (8, 40)
        _same_bits(got, expected)
        assert (
            "K = 48 in the file (padded), 40 from in_features: dropped 8 zero padding"
            in caplog.text
        )
        caplog.clear()
    np.testing.assert_array_equal(
        np.asarray(jax_fp4.dequantize(got)),
        reference.dequantize_as(
            expected.packed, expected.scale_bytes, expected.global_scale, 16, np.float32
        ),
    )
    # The stored K itself, or no entry: unchanged, nothing logged.
    assert ck.load_safetensors(tmp_path, in_features={name: 48})[name].k == 48
    assert "padding" not in caplog.text


def test_padding_that_is_not_zero_or_a_wrong_k_is_refused(tmp_path):
    _padded_modelopt_layer(tmp_path, k=40, padded=64)
    name = "model.layers.0.mlp.down_proj"
    got = ck.load_safetensors(tmp_path, in_features={name: 40})[name]
    assert got.shape == (8, 40) and got.scale.shape == (8, 3)  # the padding's own block dropped
    with pytest.raises(ck.CheckpointError, match="holds nonzero codes, e.g. row"):
        ck.load_safetensors(tmp_path, in_features={name: 32})
    with pytest.raises(ck.CheckpointError, match="in_features is 80, but the file holds K = 64"):
        ck.load_safetensors(tmp_path, in_features={name: 80})
    with pytest.raises(ck.CheckpointError, match="in_features 39 is odd"):
        ck.load_safetensors(tmp_path, in_features={name: 39})
    with pytest.raises(TypeError, match="in_features must be a mapping or a callable"):
        ck.load_safetensors(tmp_path, in_features=40)


# ---- the real tools' exports (tests/data/real_tools; its README.md says how they were made) ------

REAL_TOOLS = Path(__file__).parent / "data" / "real_tools"


def test_real_exports_load_bit_exact_and_where_the_tools_differ():
    """ModelOpt 0.47 and llm-compressor 0.14 exports of the same tiny Llama load with their bytes
    unchanged, and differ from each other as docs/flax_and_checkpoints.md says: llm-compressor
    computes the global scale in bf16 (its weight_global_scale is a bf16 value), so its block
    scales differ from ModelOpt's by one E4M3 step (never more) in 3.3% of blocks."""
    modelopt_raw = ck.read_safetensors(REAL_TOOLS / "modelopt_llama_nvfp4")
    llmc_raw = ck.read_safetensors(REAL_TOOLS / "llmc_llama_nvfp4a16")
    modelopt, llmc = ck.from_tensors(modelopt_raw), ck.from_tensors(llmc_raw)
    layers = [k for k, v in modelopt.items() if isinstance(v, jax_fp4.NVFP4Weight)]
    assert len(layers) == 14 and all(isinstance(llmc[k], jax_fp4.NVFP4Weight) for k in layers)
    differ = blocks = 0
    for name in layers:
        a, b = modelopt[name], llmc[name]
        np.testing.assert_array_equal(np.asarray(a.packed), modelopt_raw[f"{name}.weight"])
        np.testing.assert_array_equal(np.asarray(b.packed), llmc_raw[f"{name}.weight_packed"])
        assert np.asarray(a.global_scale) == modelopt_raw[f"{name}.weight_scale_2"]
        inv = llmc_raw[f"{name}.weight_global_scale"].astype(np.float32)
        assert np.asarray(b.global_scale) == np.float32(1) / inv[0]
        assert inv.astype(ml_dtypes.bfloat16).astype(np.float32) == inv  # computed in bf16
        ratio = float(np.asarray(b.global_scale) / np.asarray(a.global_scale))
        assert 1 - 0.0016 <= ratio <= 1 + 0.0056
        step = np.abs(np.asarray(a.scale_bytes, np.int32) - np.asarray(b.scale_bytes, np.int32))
        assert step.max() == 1
        differ, blocks = differ + int((step > 0).sum()), blocks + step.size
    assert (differ, blocks) == (2439, 73728)


# ---- FP8 layers (mixed-precision exports) --------------------------------------------------------


@pytest.mark.parametrize(
    "scale_shape", [(), (1,), (24, 1), (24,), (24, 4)], ids=str
)  # per tensor (ModelOpt), per channel (compressed-tensors), per group of 16 along K
def test_fp8_layers_dequantize_with_their_scale(scale_shape):
    rng = np.random.default_rng(len(scale_shape) + sum(scale_shape))
    codes = (rng.standard_normal((24, 64)) * 50).astype(np.float32).astype(F8)
    scale = rng.uniform(0.001, 0.01, scale_shape).astype(ml_dtypes.bfloat16)
    got = ck.from_fp8({"p.weight": codes, "p.weight_scale": scale}, "p")
    s = np.asarray(scale, np.float64)
    if s.ndim == 2 and s.shape[1] > 1:
        s = np.repeat(s, 16, axis=1)
    elif s.ndim == 1 and s.size > 1:
        s = s[:, None]
    expected = codes.astype(np.float64) * s
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)  # an FP8 value times a bf16 scale is exact


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({"p.weight": np.ones((4, 32), F8)}, r"'p.weight_scale' is missing"),
        (
            {"p.weight": np.ones((4, 32), F8), "p.weight_scale": np.ones((4, 3), np.float32)},
            r"'p.weight_scale' has shape \(4, 3\)",
        ),
        (
            {"p.weight": np.ones((4, 32), F8), "p.weight_scale": np.ones((), F8)},
            "'p.weight_scale' must be a float32 / bf16 / fp16 scale",
        ),
        (
            {"p.weight": np.ones((4, 32), np.float32), "p.weight_scale": np.ones(())},
            "'p.weight' must be float8_e4m3fn",
        ),
        (
            {
                "p.weight": np.ones((4, 32), F8),
                "p.weight_scale": np.ones((4, 1), np.float32),
                "p.weight_zero_point": np.ones((4, 1), np.int8),
            },
            "'p.weight_zero_point' is nonzero",
        ),
    ],
)
def test_fp8_layers_that_cannot_run_are_refused_naming_the_tensor(tensors, match):
    with pytest.raises(ck.CheckpointError, match=f"FP8 layer 'p': .*{match}"):
        ck.from_fp8(tensors, "p")


@pytest.mark.parametrize(
    "quant_config",
    [
        {"quantization": {"quant_algo": "INT4_AWQ"}},  # hf_quant_config.json
        {"quant_method": "modelopt", "quant_algo": "INT4_AWQ", "config_groups": {}},  # config.json
    ],
)
def test_check_quantization_refuses_modelopt_algorithms_it_cannot_run(quant_config):
    with pytest.raises(ck.CheckpointError, match="quant_algo 'INT4_AWQ' is not supported"):
        ck.check_quantization(quant_config, {})
    ok = {"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {}}
    ck.check_quantization(ok, {})  # NVFP4: each layer's tensors say the rest
