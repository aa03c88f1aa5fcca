"""Quantize a small MLP to NVFP4, run it jitted through jax_fp4, and compare it with the float model.

    python examples/quickstart.py

What it does: builds a two-layer MLP (256 -> 1024 -> 256, random float32 weights), quantizes both
weights to NVFP4 with jax_fp4.quantize, runs 4 bf16 tokens through it under jax.jit with
jax_fp4.matmul, then again with the weights prepacked (jax_fp4.prepack).

What it needs: jax_fp4 installed (`pip install .`); no GPU, no data, no downloads. It runs on the
first device JAX sees: a CPU (the C++ kernel) or a CUDA GPU (the decode GEMV kernel).

What it prints: the device, the kernel path each layer took, the weights' size in NVFP4 against
bf16, the relative error against the float32 MLP (NVFP4's quantization noise, about 0.13) and against
float32 on the dequantized weights (the kernels' own error, < 0.02), and the difference between
the prepacked and spec-layout weights. It exits with an error if any of these is out of range.
"""

import argparse


def parse_args(argv=None):
    """The command line; defined before the imports below so that --help answers without them."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and argument errors exit here, before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_fp4  # noqa: E402


def main():
    key_w1, key_w2, key_x = jax.random.split(jax.random.key(0), 3)
    d_model, d_hidden, tokens = 256, 1024, 4
    w1 = jax.random.normal(key_w1, (d_hidden, d_model)) / np.sqrt(d_model)  # [N, K] like nn.Linear
    w2 = jax.random.normal(key_w2, (d_model, d_hidden)) / np.sqrt(d_hidden)
    b1 = jnp.full((d_hidden,), 0.01)
    x = jax.random.normal(key_x, (tokens, d_model)).astype(jnp.bfloat16)

    def mlp_float(x):
        h = jax.nn.gelu(x.astype(jnp.float32) @ w1.T + b1)
        return h @ w2.T

    q1, q2 = jax_fp4.quantize(w1), jax_fp4.quantize(w2)  # NVFP4: 4-bit codes + E4M3 scales

    @jax.jit
    def mlp_fp4(x, q1, q2):
        h = jax.nn.gelu(jax_fp4.matmul(x, q1, b1))
        return jax_fp4.matmul(h, q2)

    def relative_error(y, ref):
        return float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

    y = mlp_fp4(x, q1, q2)
    rel = relative_error(y, mlp_float(x))
    # The same MLP in float32 on the dequantized weights: what is left is the kernels' own error
    # (bf16 rounding of activations and outputs), apart from NVFP4's quantization noise.
    d1, d2 = jax_fp4.dequantize(q1), jax_fp4.dequantize(q2)
    h_ref = jax.nn.gelu(x.astype(jnp.float32) @ d1.T + b1)
    rel_kernel = relative_error(y, h_ref @ d2.T)

    # Prepacked once at load: the same weights in the layout the CUDA kernels read fastest.
    p1, p2 = jax_fp4.prepack(q1), jax_fp4.prepack(q2)
    rel_prepacked = relative_error(mlp_fp4(x, p1, p2), y.astype(jnp.float32))

    bytes_fp4 = q1.nbytes + q2.nbytes
    bytes_bf16 = 2 * (w1.size + w2.size)
    print(f"device: {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    h = jax.ShapeDtypeStruct((tokens, d_hidden), jnp.bfloat16)
    print(
        f"path taken: layer 1 -> {jax_fp4.dispatch_path(x, q1)}, layer 2 -> {jax_fp4.dispatch_path(h, q2)}"
    )
    print(
        f"weights: {bytes_fp4 / 1e6:.2f} MB in NVFP4 vs {bytes_bf16 / 1e6:.2f} MB in bf16 "
        f"({bytes_bf16 / bytes_fp4:.2f}x smaller)"
    )
    print(
        f"relative error of the NVFP4 MLP against the float32 MLP: {rel:.4f} (NVFP4 quantization noise)"
    )
    print(
        f"relative error against float32 on the dequantized weights: {rel_kernel:.4f} (the kernels)"
    )
    print(
        f"prepacked weights (layout {p1.layout!r}): relative difference {rel_prepacked:.1e} from the "
        "spec layout (summation order only)"
    )
    if not (
        rel < 0.25 and rel_kernel < 0.02
    ):  # NVFP4 noise is ~9% rms per layer on Gaussian weights
        raise SystemExit(f"unexpectedly large error: {rel}, {rel_kernel}")
    if not rel_prepacked < 0.01:
        raise SystemExit(f"prepacked weights differ: {rel_prepacked}")


if __name__ == "__main__":
    main()
