"""One batch of the command line (`run_batch`): greedy generation with the NVFP4 weights and, with
--compare-bf16, their bf16 twin, printed and returned as the --json record."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4

from .config import Config
from .generation import TIMING_WINDOW, generate
from .measure import active_experts, cache_bytes, expected_active_experts, step_bytes
from .model import routed_experts


def _tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    file = path / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None


def _report(name: str, batch: int, timings: dict, weight_bytes: int, floor_bytes: int, read_bps):
    """Prints one run's timings; returns them as the --json record's entry."""
    steps = timings["decode_steps"]
    record = {
        "prefill_ms": timings["prefill_s"] * 1e3,
        "decode_steps": steps,
        "weight_bytes_per_step": weight_bytes,
        "floor_bytes_per_step": floor_bytes,
        "floor_ms": floor_bytes / read_bps * 1e3 if read_bps else None,
        "gpu_busy_ms": timings.get("gpu_busy_ms"),
        "kernels_per_step": timings.get("kernels_per_step"),
        "kernel_kinds": timings.get("kernel_kinds"),
    }
    if steps:
        step_s = timings["decode_s"] / steps
        windows = [w * 1e3 for w in timings.get("window_s_per_step", [])]
        record.update(
            ms_per_step=step_s * 1e3,
            tokens_per_s=batch / step_s,
            weight_gb_per_s=weight_bytes / step_s / 1e9,
            window_ms_per_step=windows,
        )
    spread = (
        f"; {TIMING_WINDOW}-step windows {min(record['window_ms_per_step']):.2f}-"
        f"{max(record['window_ms_per_step']):.2f} ms a step"
        if steps and len(record["window_ms_per_step"]) > 1
        else ""
    )
    extra = []
    if record["gpu_busy_ms"] is not None:
        extra.append(
            f"GPU busy {record['gpu_busy_ms']:.2f} ms a step, {record['kernels_per_step']:.0f} "
            "kernels"
        )
    if record["floor_ms"] is not None:
        extra.append(
            f"byte floor {record['floor_ms']:.2f} ms ({floor_bytes / 1e9:.3g} GB at "
            f"{read_bps / 1e9:.0f} GB/s)"
        )
    print(
        f"{name}: prefill {record['prefill_ms']:.0f} ms (compilation included)"
        + (
            f"; decode {record['tokens_per_s']:.1f} tokens/s ({record['ms_per_step']:.2f} ms a step, "
            f"batch {batch}, {steps} steps{spread}; weights read at "
            f"{record['weight_gb_per_s']:.1f} GB/s)"
            if steps
            else ""
        )
        + "".join(f"; {text}" for text in extra)
    )
    return record


_routed_experts = jax.jit(routed_experts, static_argnums=0)


def measured_active_experts(cfg: Config, params: dict, prompt, tokens) -> float | None:
    """`active_experts` of the decode steps that generated tokens [B, n] after prompt [B, P]: the
    routing of their inputs, positions P .. P + n - 2, from `routed_experts` on the sequence
    (None where n = 1: no decode step). Teacher-forced in one pass, outside the timed loop: the
    routing of a step's tokens as the loop computed it, up to the rounding of a prefill's matmuls
    against a decode step's."""
    length, new = np.shape(prompt)[1], np.shape(tokens)[1]
    if new < 2:
        return None
    sequence = jnp.asarray(np.concatenate([prompt, tokens[:, :-1]], axis=1), jnp.int32)
    return active_experts(_routed_experts(cfg, params, sequence), length)


def first_nvfp4_weight(layers):
    """Layer 0's first NVFP4 projection (None if it has none), for the dispatch path."""
    layer = jax.tree.map(lambda x: x[0], layers) if isinstance(layers, dict) else layers[0]
    for name in ("qkv_proj", "q_proj", "o_proj"):
        if isinstance(layer.get(name), jax_fp4.NVFP4Weight):
            return layer[name]
    return None


def run_batch(
    cfg: Config,
    params: dict,
    dense: dict | None,
    prompt,
    max_new_tokens: int,
    *,
    model: str,
    read_bps: float | None,
    gpu_busy_steps: int = 0,
    tokenizer=None,
    quantized: bool = False,
) -> dict:
    """One batch of the command line: greedy generation from prompt [B, P] with params, and with
    `dense` (its bf16 twin, or None), printed; returns the run's --json record ("model", "batch",
    "context" = P + max_new_tokens, "nvfp4_ms" = "loop_ms", "bf16_ms", "ratio" = bf16_ms /
    nvfp4_ms, "gpu_busy_ms", "non_matmul_ms" (the NVFP4 step's busy time outside jax_fp4's
    kernels and the lm_head GEMM: `kernel_breakdown`), "kernels_per_step", "floor_ms", ... and
    each side's details). read_bps: the streaming-read bandwidth (`read_bandwidth`) of the
    floors; quantized: the bf16 side holds the checkpoint's own weights (--quantize), not the
    NVFP4 ones dequantized.

    A mixture-of-experts model's floor reads the experts its decode steps activated: each side's
    "active_experts" as measured (`measured_active_experts`; the expected count where no step
    ran), the run's the NVFP4 side's, beside "expected_active_experts" (uniform random routing of
    B tokens, `expected_active_experts`). Rows with the same prompt route alike: B of them
    activate what one does."""
    prompt = np.asarray(prompt)
    batch, length = prompt.shape
    context = length + max_new_tokens
    paths, weight = {}, first_nvfp4_weight(params["layers"])
    if weight is not None:
        device = next(iter(params["embed"].devices()))
        paths = {
            stage: jax_fp4.dispatch_path(jnp.zeros((m, weight.k), params["embed"].dtype), weight)
            for stage, m in (("prefill", prompt.size), ("decode", batch))
        }
        print(
            f"batch {batch}: device {device.platform} ({device.device_kind}); jax_fp4 path: "
            f"prefill {paths['prefill']}, decode {paths['decode']}"
        )
    tokens, timings = generate(cfg, params, prompt, max_new_tokens, gpu_busy_steps=gpu_busy_steps)
    print(f"generated: {tokens[0].tolist()}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(tokens[0].tolist())!r}")
    expected = expected_active_experts(cfg, batch) if cfg.experts else None
    cache = cache_bytes(cfg, batch, context, params["embed"].dtype)

    def report(name, weights, tokens, timings):
        active = measured_active_experts(cfg, weights, prompt, tokens) if cfg.experts else None
        if active is None:
            active = expected
        floor = step_bytes(weights, active_experts=active) + cache
        record = _report(name, batch, timings, step_bytes(weights), floor, read_bps)
        return {**record, "active_experts": active}

    record = report("NVFP4 (jax_fp4)", params, tokens, timings)
    run = {
        "model": model,
        "batch": batch,
        "context": context,
        "prompt_len": length,
        "new_tokens": max_new_tokens,
        "nvfp4_ms": record.get("ms_per_step"),
        "loop_ms": record.get("ms_per_step"),
        "bf16_ms": None,
        "ratio": None,
        "gpu_busy_ms": record["gpu_busy_ms"],
        "non_matmul_ms": timings.get("non_matmul_ms"),
        "kernels_per_step": record["kernels_per_step"],
        "floor_ms": record["floor_ms"],
        "nvfp4_over_floor": _ratio(record.get("ms_per_step"), record["floor_ms"]),
        "loop_over_gpu_busy": _ratio(record.get("ms_per_step"), record["gpu_busy_ms"]),
        "active_experts": record["active_experts"],
        "expected_active_experts": expected,
        "cache_bytes": cache,
        "paths": paths,
        "nvfp4": record,
    }
    if dense is None:
        return run
    dense_tokens, dense_timings = generate(
        cfg, dense, prompt, max_new_tokens, gpu_busy_steps=gpu_busy_steps
    )
    source = "the checkpoint's weights" if quantized else "the same weights dequantized"
    bf16 = report(f"bf16 ({source}, XLA's dot)", dense, dense_tokens, dense_timings)
    same = int(np.sum(np.cumprod(dense_tokens[0] == tokens[0])))
    run.update(
        bf16_ms=bf16.get("ms_per_step"),
        ratio=_ratio(bf16.get("ms_per_step"), run["nvfp4_ms"]),
        bf16_gpu_busy_ms=bf16["gpu_busy_ms"],
        bf16_kernels_per_step=bf16["kernels_per_step"],
        bf16_floor_ms=bf16["floor_ms"],
        bf16=bf16,
        same_leading_tokens=same,
    )
    if run["ratio"] is not None:
        print(
            f"NVFP4 against bf16: {run['ratio']:.2f}x the decode rate; the first "
            f"{same} of {tokens.shape[1]} tokens the same"
        )
    return run


def _ratio(a, b):
    return a / b if a is not None and b else None
