"""LoRA fine-tuning on a frozen NVFP4 base: a two-layer MLP whose weights are NVFP4, adapted with
low-rank adapters (and trainable biases) to fit a slightly different "teacher" network.

    python examples/lora_finetune.py [--steps 60] [--seed 0]

What it does: quantizes random "pretrained" weights (128 -> 256 -> 64) to NVFP4, makes a teacher
whose weights differ from them by a low-rank update, and trains rank-8 adapters and the biases
with a minimal Adam on 256 inputs, under jax.jit. Gradients flow through jax_fp4.matmul with
respect to its activations (dA = dY @ dequant(W), so the first layer's adapter learns through the
second layer's NVFP4 matmul) and its bias (dbias = sum dY). The quantized codes and block scales
stay frozen: they are integer data and are not differentiated.

What it needs: jax_fp4 installed; no GPU, no data (a few seconds on a CPU).

What it prints: the mean squared error every 10 steps and after the last, and how many times lower
it ends than it started (about 7x at the defaults).
"""

from __future__ import annotations

import argparse


def parse_args(argv=None):
    """The command line; defined before the imports below so that --help answers without them."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="optimisation steps (default 60)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the weights, inputs and adapters' initialisation (default 0)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help and argument errors exit here, before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_fp4  # noqa: E402

D_IN, D_HIDDEN, D_OUT, RANK = 128, 256, 64, 8


@jax.jit
def make_problem(key):
    """A frozen NVFP4 base (quantized from random 'pretrained' weights), a teacher network whose
    weights differ from the base by a low-rank update, and a batch of inputs."""
    keys = jax.random.split(key, 7)
    w1 = jax.random.normal(keys[0], (D_HIDDEN, D_IN)) / jnp.sqrt(D_IN)
    w2 = jax.random.normal(keys[1], (D_OUT, D_HIDDEN)) / jnp.sqrt(D_HIDDEN)
    base = {"w1": jax_fp4.quantize(w1), "w2": jax_fp4.quantize(w2)}

    def low_rank(k, n, m):
        ka, kb = jax.random.split(k)
        return 0.3 * jax.random.normal(ka, (n, 4)) @ jax.random.normal(kb, (4, m)) / jnp.sqrt(m)

    teacher = {
        "w1": w1 + low_rank(keys[2], D_HIDDEN, D_IN),
        "w2": w2 + low_rank(keys[3], D_OUT, D_HIDDEN),
    }
    x = jax.random.normal(keys[4], (256, D_IN), jnp.float32)
    y = jax.nn.gelu(x @ teacher["w1"].T) @ teacher["w2"].T
    return base, x, y


def init_adapters(key):
    """Standard LoRA init: A random, B zero, so training starts from the base model."""
    k1, k2 = jax.random.split(key)
    return {
        "a1": jax.random.normal(k1, (RANK, D_IN)) / jnp.sqrt(D_IN),
        "b1": jnp.zeros((D_HIDDEN, RANK)),
        "a2": jax.random.normal(k2, (RANK, D_HIDDEN)) / jnp.sqrt(D_HIDDEN),
        "b2": jnp.zeros((D_OUT, RANK)),
        "bias1": jnp.zeros((D_HIDDEN,)),
        "bias2": jnp.zeros((D_OUT,)),
    }


def lora_linear(x, w_fp4, bias, a, b):
    """NVFP4 base (frozen) + low-rank adapter: x @ W^T + bias + (x @ A^T) @ B^T."""
    return jax_fp4.matmul(x, w_fp4, bias) + (x @ a.T) @ b.T


def model(adapters, base, x):
    h = jax.nn.gelu(lora_linear(x, base["w1"], adapters["bias1"], adapters["a1"], adapters["b1"]))
    return lora_linear(h, base["w2"], adapters["bias2"], adapters["a2"], adapters["b2"])


def loss_fn(adapters, base, x, y):
    return jnp.mean((model(adapters, base, x) - y) ** 2)


def adam(lr=3e-3, b1=0.9, b2=0.999, eps=1e-8):
    """A minimal Adam (keeps the example free of optimizer libraries)."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}

    def update(grads, state, params):
        t = state["t"] + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        mhat = jax.tree.map(lambda m: m / (1 - b1**t), m)
        vhat = jax.tree.map(lambda v: v / (1 - b2**t), v)
        params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + eps), params, mhat, vhat)
        return params, {"m": m, "v": v, "t": t}

    return init, update


def main(steps: int = 60, seed: int = 0, verbose: bool = True) -> list[float]:
    """Run `steps` optimisation steps; returns the loss before each step and after the last."""
    base, x, y = make_problem(jax.random.key(seed))
    adapters = init_adapters(jax.random.key(seed + 1))
    opt_init, opt_update = adam()
    state = opt_init(adapters)

    @jax.jit
    def step(adapters, state):
        # Only the adapters are differentiated; the NVFP4 base is a frozen input.
        loss, grads = jax.value_and_grad(loss_fn)(adapters, base, x, y)
        adapters, state = opt_update(grads, state, adapters)
        return adapters, state, loss

    losses = []
    for i in range(steps):
        adapters, state, loss = step(adapters, state)
        losses.append(float(loss))
        if verbose and (i % 10 == 0 or i == steps - 1):
            print(f"step {i:3d}  loss {losses[-1]:.5f}")
    losses.append(float(jax.jit(loss_fn)(adapters, base, x, y)))
    if verbose:
        print(
            f"final     loss {losses[-1]:.5f}  ({losses[0] / losses[-1]:.1f}x lower than at start)"
        )
    return losses


if __name__ == "__main__":
    main(ARGS.steps, ARGS.seed)
