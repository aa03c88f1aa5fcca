"""Jitted chains of jax_fp4.matmul calls, each fed the previous call's output: what the
programmatic-dependent-launch tests (JAX_FP4_PDL) run with and without the flag."""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp

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


def matmul_chain(a, weights, *, backend: str, tiled: bool) -> list[np.ndarray]:
    """Every layer's output of one jitted chain (a fresh function: a new trace and kernel launch)."""
    ws = [jax_fp4.NVFP4Weight(jnp.asarray(p), jnp.asarray(s), jnp.asarray(g)) for p, s, g in weights]
    if tiled:
        ws = [jax_fp4.prepack(w) for w in ws]

    @jax.jit
    def chain(x, ws):
        outs = []
        for w in ws:
            x = jax_fp4.matmul(x, w, backend=backend)
            outs.append(x)
        return outs

    return [np.asarray(y) for y in chain(jnp.asarray(a), ws)]


def plain_and_programmatic(monkeypatch, a, weights, *, backend: str, tiled: bool):
    """The chain's outputs with JAX_FP4_PDL=0, then with JAX_FP4_PDL=1."""
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("JAX_FP4_PDL", flag)
        runs.append(matmul_chain(a, weights, backend=backend, tiled=tiled))
    return runs
