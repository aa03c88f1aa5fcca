"""Jitted chains of jax_fp4.matmul calls, each fed the previous call's output: what the
programmatic-dependent-launch tests run with and without
`KernelTuning(programmatic_launch=True)`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4

CHAIN_DIMS = (4096, 8192, 1024, 384, 512)  # the first layer's K, then each layer's N


def chain_weights(random_weight, dims=CHAIN_DIMS):
    """(packed, scale, global_scale) per layer from random_weight(n, k), the global scale set so
    that outputs stay O(1) through the chain."""
    weights = []
    for k, n in zip(dims[:-1], dims[1:]):
        packed, scale, _ = random_weight(n, k)
        weights.append((packed, scale, np.float32(0.5 / math.sqrt(k))))
    return weights


def matmul_chain(
    a, weights, *, backend: str, tiled: bool, tuning: jax_fp4.KernelTuning | None = None
) -> list[np.ndarray]:
    """Every layer's output of one jitted chain (a fresh function: a new trace and kernel launch)."""
    ws = [
        jax_fp4.NVFP4Weight(jnp.asarray(p), jnp.asarray(s), jnp.asarray(g)) for p, s, g in weights
    ]
    if tiled:
        ws = [jax_fp4.prepack(w) for w in ws]

    @jax.jit
    def chain(x, ws):
        outs = []
        for w in ws:
            x = jax_fp4.matmul(x, w, backend=backend, tuning=tuning)
            outs.append(x)
        return outs

    return [np.asarray(y) for y in chain(jnp.asarray(a), ws)]


def plain_and_programmatic(a, weights, *, backend: str, tiled: bool):
    """The chain's outputs with plain launches, then with programmatic dependent launches."""
    return [
        matmul_chain(
            a,
            weights,
            backend=backend,
            tiled=tiled,
            tuning=jax_fp4.KernelTuning(programmatic_launch=flag),
        )
        for flag in (False, True)
    ]
