"""What a decode step costs and what it could cost: the time the GPU is busy (from a jax.profiler
trace), the device's streaming-read bandwidth, and the bytes a step reads (its weights, the experts
its tokens visit, the KV cache)."""

from __future__ import annotations

import collections
import functools
import math
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .config import Config


def gpu_step_profile(run: Callable[[], object], steps: int) -> dict | None:
    """Calls run() (which launches `steps` steps, e.g. of a jitted decode step, and returns what
    they compute) under a jax.profiler trace and waits for its result; from the trace
    (`profile_summary`), per step: "gpu_busy_ms", the time the GPU's streams were busy (the union
    of their kernels' intervals; close to the wall time of the same steps run back to back, the
    GPU never waited for the host), "non_matmul_ms" (`kernel_breakdown`: the busy time but the
    matmuls'), "kernels_per_step" and "kernel_kinds" (each kind of kernel's count and ms per
    step, longest first: where the step's time and launches go). None where the trace holds no
    GPU (a CPU run)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(run())
        finally:
            jax.profiler.stop_trace()
        xplane = next(Path(trace_dir).rglob("*.xplane.pb"), None)
        if xplane is None:
            return None
        summary = profile_summary(xplane, steps)
    if not summary["gpu_events_per_step"]:
        return None
    return {
        "gpu_busy_ms": summary["gpu_busy_ms_per_step"],
        "non_matmul_ms": summary["non_matmul_ms_per_step"],
        "kernels_per_step": summary["gpu_events_per_step"],
        "kernel_kinds": summary["gpu_kinds_per_step"],
    }


# The kernels of a GPU matmul library (cuBLAS, cuBLASLt and the CUTLASS kernels inside them,
# XLA's Triton GEMM fusions): what a dense (bf16) dot runs as.
_LIBRARY_MATMUL = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|s16816|s1688", re.IGNORECASE)


def kernel_breakdown(kernels, steps: int) -> dict:
    """The NVFP4 decode step's GPU time by kind, per step, from the (name, duration in ns) of each
    kernel a trace of `steps` steps ran: "jax_fp4_ms" (jax_fp4's kernels: every name in its
    jax_fp4:: namespace), "lm_head_ms" (the dense lm_head's GEMM: the longest matmul-library
    kernel of each step, `steps` of them; the attention's dots and a MoE router's, a few percent
    of lm_head's bytes at the contexts measured, are the shorter ones), "other_ms" (everything
    else: the XLA kernels around the matmuls, the attention's dots whatever runs them) with
    "other_kernels_per_step"."""
    fp4, library, other = [], [], []
    for name, duration in kernels:
        kind = fp4 if "jax_fp4" in name else library if _LIBRARY_MATMUL.search(name) else other
        kind.append(duration)
    library.sort(reverse=True)
    lm_head, other = library[:steps], other + library[steps:]
    return {
        "jax_fp4_ms": sum(fp4) / steps / 1e6,
        "lm_head_ms": sum(lm_head) / steps / 1e6,
        "other_ms": sum(other) / steps / 1e6,
        "other_kernels_per_step": len(other) / steps,
    }


def _union_ns(intervals) -> int:
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy


def profile_summary(xplane, steps: int) -> dict:
    """What a jax.profiler trace (its .xplane.pb file) of `steps` steps says per step: the time
    the GPU's streams are busy (the union of the events on the "Stream" lines of the /device:GPU
    planes) and their event count, the span from the first to the last GPU event, the busy time
    less the matmuls' (`kernel_breakdown`'s jax_fp4 and lm_head kernels) and that breakdown, the
    events per GPU line, the GPU's longest kinds of kernels and the host's longest kinds of
    events."""
    data = jax.profiler.ProfileData.from_file(str(xplane))
    gpu, gpu_lines, host, kernels = [], {}, collections.Counter(), collections.Counter()
    counts = collections.Counter()  # kernels of each kind
    records = []  # (name, duration) of every GPU kernel
    for plane in data.planes:
        for line in plane.lines:
            if plane.name.startswith("/device:GPU"):
                events = [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
                gpu_lines[f"{plane.name} {line.name}"] = len(events)
                if line.name.startswith("Stream"):
                    gpu += events
                    for e in line.events:  # per kernel: "loop_fusion_12" -> "loop_fusion"
                        kind = re.sub(r"[._]\d+$", "", e.name.split("<")[0])[:60]
                        kernels[kind] += e.duration_ns
                        counts[kind] += 1
                        records.append((e.name, e.duration_ns))
            elif plane.name.startswith("/host:CPU") and line.name != "python":
                for e in line.events:  # per kind of op: "ffi_call.25" -> "ffi_call"
                    host[re.sub(r"\.\d+$", "", e.name)[:60]] += e.duration_ns
    window = (max(b for _, b in gpu) - min(a for a, _ in gpu)) if gpu else 0
    busy_ms = _union_ns(gpu) / steps / 1e6
    breakdown = kernel_breakdown(records, steps)
    return {
        "gpu_busy_ms_per_step": busy_ms,
        # The busy time less the matmuls', as the streams run one kernel at a time.
        "non_matmul_ms_per_step": busy_ms - breakdown["jax_fp4_ms"] - breakdown["lm_head_ms"],
        "kernel_breakdown": breakdown,
        "gpu_events_per_step": len(gpu) / steps,
        "gpu_window_ms_per_step": window / steps / 1e6,
        "gpu_lines": gpu_lines,
        "gpu_top_ms_per_step": {name: ns / steps / 1e6 for name, ns in kernels.most_common(16)},
        "gpu_kinds_per_step": {
            name: {"count": counts[name] / steps, "ms": ns / steps / 1e6}
            for name, ns in kernels.most_common()
        },
        "host_top_ms_per_step": {name: ns / steps / 1e6 for name, ns in host.most_common(12)},
    }


@functools.partial(jax.jit, static_argnums=1)
def _read(buffer, reads: int):
    # Each pass XORs the words with the sum so far (free inside the reduction): the passes depend
    # on each other, so XLA can neither merge them into one read nor run them side by side.
    def body(_, total):
        return total + jnp.sum(buffer ^ total, dtype=jnp.uint32)

    return jax.lax.fori_loop(0, reads, body, jnp.uint32(0))


def read_bandwidth(nbytes: int | None = None, *, reads: int = 8, repeats: int = 3) -> float:
    """The streaming-read bandwidth of jax's default device, in bytes/s: `reads` passes of a
    jitted uint32 sum over a buffer of `nbytes` (default 1 GiB on a GPU, several times its L2, or
    64 MiB elsewhere) in one call, the fastest of `repeats` calls. The yardstick of a decode
    step's byte floor: what an XLA kernel streaming that much memory reaches."""
    if nbytes is None:
        nbytes = 2**30 if jax.default_backend() == "gpu" else 2**26
    words = max(nbytes // 4, 1)
    buffer = jax.random.bits(jax.random.key(0), (words,), jnp.uint32)
    _read(buffer, reads).block_until_ready()  # compiles
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        _read(buffer, reads).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return reads * 4 * words / best


def expected_active_experts(cfg: Config, tokens: int) -> float:
    """Experts per MoE layer that `tokens` tokens visit, expected under uniform random top-k
    routing: E (1 - (1 - k / E)^tokens)."""
    if not cfg.experts:
        return 0.0
    return cfg.experts * (1 - (1 - cfg.experts_per_token / cfg.experts) ** tokens)


def active_experts(routed, first: int) -> float:
    """The distinct experts a MoE layer activates in one decode step, averaged over the layers and
    the steps: routed [layers, B, S, k] the experts of each (layer, row, position)
    (`routed_experts`), the steps those at positions first .. S - 1, each of which routes its B
    rows' tokens together."""
    routed = np.asarray(routed)[:, :, first:]
    layers, batch, steps, k = routed.shape
    if steps == 0:
        raise ValueError(f"active_experts: no position from {first} on in {routed.shape}")
    per_step = np.sort(routed.transpose(0, 2, 1, 3).reshape(layers * steps, batch * k), axis=1)
    distinct = 1 + np.count_nonzero(np.diff(per_step, axis=1), axis=1)
    return float(distinct.mean())


def step_bytes(params: dict, *, active_experts: float | None = None) -> int:
    """Bytes of weight a decode step reads: every array but the embedding table, of which a step
    gathers only its tokens' rows (a tied lm_head still reads it whole). MoE experts: all of them,
    or with active_experts (`active_experts`, `expected_active_experts`) that many of each
    layer's E."""

    def nbytes(tree) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))

    total = nbytes({name: value for name, value in params.items() if name != "embed"})
    if active_experts is None:
        return total
    layers = params["layers"]
    stacks = (
        [layer["experts"] for layer in layers if "experts" in layer]
        if isinstance(layers, list)
        else [layers["experts"]] * ("experts" in layers)
    )
    for experts in stacks:
        count = jax.tree.leaves(experts)[0].shape[-3]  # [..., E, N, K] stacks
        total -= round(nbytes(experts) * (1 - min(active_experts, count) / count))
    return total


def cache_bytes(cfg: Config, batch: int, length: int, dtype=jnp.bfloat16) -> int:
    """Bytes of the KV caches a decode step reads whole (keys and values of every layer)."""
    return 2 * cfg.layers * batch * cfg.kv_heads * length * cfg.head_dim * jnp.dtype(dtype).itemsize
