"""Greedy generation (`generate`): the prompt as one prefill, then one jitted decode step per token
on a state that stays on the device (the tokens, the position, the caches), donated to each step
on GPUs; the loop timed in windows of TIMING_WINDOW steps."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from .config import Config
from .measure import gpu_step_profile
from .model import empty_cache, hidden_states, lm_logits


def greedy_step(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """`forward`, then each sequence's next token [B, 1] (argmax of the last position's logits),
    and the caches. Only the last position goes through lm_head: XLA does not narrow a dot to the
    rows a slice of its output keeps, and a prefill of B x P tokens would otherwise run the
    [B P, hidden] x [hidden, vocab] GEMM (Llama-3-8B at 4 x 2048: 8.6 TFLOP, 4 GB of float32
    logits) for one row a sequence."""
    h, k_cache, v_cache = hidden_states(cfg, params, tokens, start, k_cache, v_cache)
    logits = lm_logits(cfg, params, h[:, -1])
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None], k_cache, v_cache


def advance(cfg: Config, params: dict, tokens, start, k_cache, v_cache):
    """`greedy_step`, and the position after these tokens: (next tokens [B, 1], start + S,
    k_cache, v_cache). A loop feeds the position back as it came, an int32 array on the device, so
    a step takes no value from the host."""
    token, k_cache, v_cache = greedy_step(cfg, params, tokens, start, k_cache, v_cache)
    return token, start + tokens.shape[1], k_cache, v_cache


def prefill(cfg: Config, params: dict, prompt, k_cache, v_cache, length: int):
    """`advance` over prompt [B, P] from position 0, as the decode state `decode` steps on:
    (history [B, length] int32 holding the prompt and the first new token at column P, start = P,
    k_cache, v_cache)."""
    token, start, k_cache, v_cache = advance(
        cfg, params, prompt, jnp.zeros((), jnp.int32), k_cache, v_cache
    )
    batch, p = prompt.shape
    history = jnp.zeros((batch, length), jnp.int32).at[:, :p].set(prompt).at[:, p].set(token[:, 0])
    return history, start, k_cache, v_cache


def decode(cfg: Config, params: dict, history, start, k_cache, v_cache):
    """One decode step on the state `prefill` makes: the tokens at column `start` of history
    [B, T] go through `forward` at that position, and the next ones are written at start + 1:
    (history, start + 1, k_cache, v_cache). Every buffer of the state comes back as the step's
    output, donated on GPUs, so a step allocates nothing and XLA's CUDA graphs keep their
    addresses: an H100 at batch 1 spends 0.9 ms of host time on a Llama-3-8B step this way,
    1.4 ms when each step returns a new token array, 2.9 ms when the loop also keeps them."""
    tokens = jax.lax.dynamic_slice_in_dim(history, start, 1, axis=1)
    token, start, k_cache, v_cache = advance(cfg, params, tokens, start, k_cache, v_cache)
    history = jax.lax.dynamic_update_slice_in_dim(history, token, start, axis=1)
    return history, start, k_cache, v_cache


def _donated_on_gpus(*argnums) -> tuple:
    return argnums if jax.default_backend() != "cpu" else ()


@functools.cache
def _jitted_prefill(cfg: Config, donate: tuple):
    return jax.jit(functools.partial(prefill, cfg), static_argnums=4, donate_argnums=donate)


@functools.cache
def _jitted_decode(cfg: Config, donate: tuple):
    return jax.jit(functools.partial(decode, cfg), donate_argnums=donate)


def prefill_step(cfg: Config):
    """`prefill` jitted (params, prompt, k_cache, v_cache, length), its caches donated on GPUs;
    one per config, so every `generate` of a model reuses its compiled programs."""
    return _jitted_prefill(cfg, _donated_on_gpus(2, 3))


def decode_step(cfg: Config):
    """`decode` jitted (params, history, start, k_cache, v_cache), its whole state donated
    (updated in place) on GPUs; one per config, as `prefill_step`."""
    return _jitted_decode(cfg, _donated_on_gpus(1, 2, 3, 4))


TIMING_WINDOW = 16  # decode steps between the timer's host syncs


def generate(
    cfg: Config,
    params: dict,
    prompt,
    max_new_tokens: int,
    *,
    gpu_busy_steps: int = 0,
    cache_sharding=None,
) -> tuple[np.ndarray, dict]:
    """Greedy continuation of prompt [B, P] (equal lengths): (tokens [B, max_new_tokens], timings).
    One jitted call per token (`decode_step`) on a state that stays on the device: the tokens so
    far, the position (an int32) and the caches [B, kv_heads, P + max_new_tokens, head_dim], all
    updated in place on GPUs.

    gpu_busy_steps > 0: afterwards, that many more decode steps (at most max_new_tokens, over the
    last positions again: a step's work does not depend on its position, attention reading the
    whole cache) run under a jax.profiler trace; timings["gpu_busy_ms"] is the GPU's busy time per
    step, timings["non_matmul_ms"] the part of it outside the matmuls and
    timings["kernels_per_step"] the kernels a step runs (`gpu_step_profile`; None without a GPU).
    cache_sharding: where each cache array lives
    (`empty_cache`), e.g. split over kv heads for a tensor-parallel model."""
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be at least 1, got {max_new_tokens}")
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    total = length + max_new_tokens
    k_cache, v_cache = empty_cache(cfg, params, batch, total, cache_sharding)
    step = decode_step(cfg)
    t0 = time.perf_counter()
    state = prefill_step(cfg)(params, prompt, k_cache, v_cache, total)
    state[0].block_until_ready()
    prefill_s = time.perf_counter() - t0  # compilation included
    timed_from = 3  # steps 1-2 compile and warm the decode step
    # The host waits for the GPU every TIMING_WINDOW steps (a few us a step): each window's rate
    # tells a one-off stall apart from the steady rate (a batch-1 run on the H200 once took 7.4 ms
    # a step over 61 steps where the same step took 3.1 in the runs around it).
    marks = []  # (step, time) at the window bounds
    for i in range(1, max_new_tokens):
        if i >= timed_from and (i - timed_from) % TIMING_WINDOW == 0:
            state[0].block_until_ready()
            marks.append((i, time.perf_counter()))
        state = step(params, *state)
    state[0].block_until_ready()
    if marks:
        marks.append((max_new_tokens, time.perf_counter()))
    decode_s = marks[-1][1] - marks[0][1] if marks else 0.0
    windows = [(t1 - t0) / (i1 - i0) for (i0, t0), (i1, t1) in zip(marks, marks[1:])]
    history, _, k_cache, v_cache = state
    tokens = np.asarray(history[:, length:])
    timings = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": max(max_new_tokens - timed_from, 0),
        "window_s_per_step": windows,
    }
    if gpu_busy_steps > 0:
        n = min(gpu_busy_steps, max_new_tokens)
        # From position total - n the steps write history up to its last column (and once past
        # it, which dynamic_update_slice clamps): the tokens above are already read. One step
        # outside the trace compiles the decode step where the loop did not.
        state = step(params, history, jnp.full((), total - n, jnp.int32), k_cache, v_cache)

        def run():
            nonlocal state
            for _ in range(n):
                state = step(params, *state)
            return state[0]

        profile = gpu_step_profile(run, n)
        timings.update(
            profile
            or dict.fromkeys(("gpu_busy_ms", "non_matmul_ms", "kernels_per_step", "kernel_kinds"))
        )
    return tokens, timings
