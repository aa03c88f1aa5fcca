"""The decode benchmark: a model's decode step end to end, and its GEMVs in a dependent chain.

    python benchmarks/decode.py                       # every part on llama3-8b shapes
    python benchmarks/decode.py --batches 1,8 --no-long-prompt --no-prefill --no-gemv
    python benchmarks/decode.py --no-runs --no-gemv --prefill-lens 512,2048 --prefill-batches 1,4
    python benchmarks/decode.py --no-runs --no-prefill --gemv-m 1,8
    python benchmarks/decode.py --quick               # a tiny model and shapes: a CPU smoke run
    python benchmarks/decode.py --markdown-from benchmarks/results/decode_h200.json

Writes {"runs": [...], "prefill": [...], "gemv": [...], "mlp": [...]} to --json (default
benchmarks/results/decode_<gpu>.json, e.g. decode_h200.json; written after each part), each record
with the "command" that measured it and each part's setup in "runs_setup" / "prefill_setup" /
"gemv_setup", and prints them as Markdown tables. The records of earlier calls on the same device
stay in the file unless this call measures them again (the same model, layers, batch and context
or prompt; the same N, K, M and layout), so a benchmark too long for one call runs in several (the
runs compile the model's steps at every batch, the gemv rows two chains per row and variant:
minutes each on an H200); --fresh starts the file over.

runs: examples/llm_generate.py's model of --model's shapes with random weights (built once, in
NVFP4 and dequantized to bf16), its own generate loop per batch (--batches, after a --prompt-len
prompt) and after a --long-prompt prompt at --long-prompt-batches (default 1), --new-tokens each;
each row of a batch its own random prompt (the example's random_prompts, seed 0: row i the same at
every batch size). Per run the example's record (its --json "runs" entries): "nvfp4_ms" and
"bf16_ms" (the loop's time per decode step), "ratio" (bf16_ms / nvfp4_ms), "gpu_busy_ms" (the GPU's
busy time per step from a jax.profiler trace of --gpu-busy-steps more steps; null on a CPU) with,
from the same trace, "non_matmul_ms" (the NVFP4 step's busy time outside jax_fp4's kernels and the
lm_head GEMM: the attention, its dots included, the norms, RoPE, the cache writes, the converts;
the example's kernel_breakdown) and "kernels_per_step" ("bf16_kernels_per_step" the twin's;
"nvfp4"'s "kernel_kinds": each kind of kernel's count and ms per step),
"floor_ms" (the bytes a step reads, weights and KV cache, at the streaming-read bandwidth measured
at the start), "nvfp4_over_floor" and "loop_over_gpu_busy"; a mixture-of-experts model's
"active_experts" (the distinct experts a layer's decode step activated, averaged over the layers and
steps, measured on the generated tokens: the experts its floor reads) beside
"expected_active_experts" (uniform random routing's). --attention xla,cudnn runs each case with
each way of running the decode steps' attention in turn (the example's --attention, default auto;
each record's "attention" says which ran, auto resolved). Each batch compiles its prefill and
decode step once per model and attention.

prefill: the example's prefill of the same model (the prompt's forward pass writing the caches and
choosing the first token, as a run starts) at each --prefill-lens prompt length and
--prefill-batches batch, each row its own random prompt, NVFP4 and bf16: compiled once, then timed
warm (a run's "prefill_ms" includes the compilation), --prefill-repeats calls of each alternating.
Per row "nvfp4_ms" and "bf16_ms" (the median call), "ratio" (bf16_ms / nvfp4_ms), "tokens_per_s",
"compile_s" and the jax_fp4 "path" of the prompt's batch x length rows.

gemv: jax_fp4.matmul at M = --gemv-m on --gemv-shapes (default the model's fused q/k/v, o, fused
gate/up and down projections, tiled layout) in a chain whose every matmul takes the previous one's
output (bench.dependent_chain_of): where N != K a small XLA kernel joins them, measured alone in the
same run (bench.glue_chain) and subtracted. Times per matmul by bench.py's method (two chain
lengths, the weights cycling through more memory than the L2; benchmarks/README.md). Per row "us",
"tbps" (NVFP4 bytes + activations + outputs over us), "fraction_of_read_bw" (over the same-run
streaming read of buffers of the weight's size, bench.py's yardstick), "bf16_us" and "x_bf16"
(jnp.dot on the same weights in bf16, in the same dependent chain), "glue_us".

mlp: the model's MLP as a decoder layer runs it, with no joint to subtract: gate/up (SiLU(gate) * up
in the epilogue) then down (the residual added in the epilogue), each pair's output the next
pair's input, at each --gemv-m. Per row "us" (the pair), "tbps", "fraction_of_read_bw" (over the
same-run read of both weights' bytes), "bf16_us" and "x_bf16".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_BENCHMARKS = Path(__file__).resolve().parent
_ROOT = _BENCHMARKS.parent
for _path in (_BENCHMARKS, _ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench  # noqa: E402

import jax_fp4  # noqa: E402
from tests._helpers import load_repo_package  # noqa: E402

RESULTS = _BENCHMARKS / "results"

DEFAULT_BATCHES = (1, 8, 16, 32, 64)
DEFAULT_PROMPT_LEN = 8
DEFAULT_LONG_PROMPT = 2048
DEFAULT_NEW_TOKENS = 64
DEFAULT_GPU_BUSY_STEPS = 8
DEFAULT_GEMV_M = tuple(range(1, 9))
# Llama-3-8B's projections as the example runs them: q/k/v fused, o, gate/up fused, down.
DEFAULT_GEMV_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))

# --quick: a one-layer model of a few hundred features and tiny GEMVs (one of each joint), every
# part of the benchmark in seconds on a CPU.
QUICK_MODEL = {
    "hidden_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
DEFAULT_PREFILL_LENS = (512, 2048)
DEFAULT_PREFILL_BATCHES = (1, 4)
DEFAULT_PREFILL_REPEATS = 10
QUICK = {
    "model": "quick",
    "batches": (2,),
    "prompt_len": 4,
    "long_prompt": 12,
    "new_tokens": 6,
    "gpu_busy_steps": 2,
    "prefill_lens": (8,),
    "prefill_batches": (1, 2),
    "prefill_repeats": 2,
    "gemv_m": (1,),
    "gemv_shapes": ((384, 256), (256, 512)),
}
QUICK_READ_BYTES = 1 << 22


_log = bench.log_progress


def gpu_tag(device_kind: str, platform: str) -> str:
    """The short name of a device for a results file: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB
    HBM3" -> "h100"; "cpu" for a CPU."""
    if platform == "cpu":
        return "cpu"
    words = re.sub(r"^nvidia\s+", "", device_kind.strip().lower()).split()
    return re.sub(r"[^a-z0-9]+", "", words[0]) if words else platform


def results_path(device_kind: str, platform: str) -> Path:
    """Where a run on this device goes by default: benchmarks/results/decode_<gpu>.json."""
    return RESULTS / f"decode_{gpu_tag(device_kind, platform)}.json"


# ---- runs: the example's generate loop ----------------------------------------------------------


def load_example():
    return load_repo_package("examples/llm")


def model_config(llm, model: str) -> dict:
    """A preset of the example ("quick": QUICK_MODEL), or a config.json's path."""
    if model == "quick":
        return QUICK_MODEL
    if model in llm.PRESETS:
        return llm.PRESETS[model]
    path = Path(model)
    if not path.is_file():
        raise SystemExit(
            f"--model: {model!r} is neither a preset ({', '.join(llm.PRESETS)}) nor a file"
        )
    return json.loads(path.read_text())


@dataclasses.dataclass(frozen=True)
class Model:
    """The example's model of a config's shapes with random weights (NVFP4), and its bf16 twin
    (the same weights dequantized)."""

    name: str
    cfg: object  # the example's Config
    params: dict
    dense: dict


def build_model(model: str, *, layout: str = "tiled", layers: int | None = None, log=_log) -> Model:
    """`model`'s (a preset or a config.json) model, `layers` decoder layers deep (default the
    config's), built once for the runs and the prefill rows."""
    llm = load_example()
    started = time.perf_counter()
    config = dict(model_config(llm, model))
    if layers is not None:
        config["num_hidden_layers"] = layers
    cfg, params = llm.random_model(config, layout=layout)
    log(f"model {model}: built in {time.perf_counter() - started:.1f} s")
    return Model(model, cfg, params, llm.dense_twin(params))


def decode_runs(
    model: Model,
    cases: Sequence[tuple[int, int]],
    new_tokens: int,
    *,
    gpu_busy_steps: int,
    read_bps: float,
    attention: Sequence[str] = ("auto",),
    log: Callable[[str], None] = _log,
) -> list[dict]:
    """The example's run record for each (batch, prompt length) of `cases` and each way of
    running the decode steps' attention (the example's Config.attention) in `attention`, in
    turn for each case, NVFP4 and bf16, each with the model's "layers" and its "attention";
    `read_bps` the streaming-read bandwidth of the floors."""
    llm = load_example()
    runs = []
    cache_dtype = model.params["embed"].dtype
    for batch, prompt_len in cases:
        prompt = llm.random_prompts(model.cfg.vocab, batch, prompt_len)
        for asked in attention:
            started = time.perf_counter()
            cfg = dataclasses.replace(model.cfg, attention=asked)
            kind = llm.decode_attention(cfg, cache_dtype)  # "auto" resolved
            run = llm.run_batch(
                cfg,
                model.params,
                model.dense,
                prompt,
                new_tokens,
                model=model.name,
                read_bps=read_bps,
                gpu_busy_steps=gpu_busy_steps,
            )
            runs.append({**run, "layers": model.cfg.layers, "attention": kind})
            log(
                f"batch {batch}, prompt {prompt_len}, attention {kind}: "
                f"{time.perf_counter() - started:.1f} s"
            )
    return runs


# ---- prefill: the prompt's forward pass, warm ---------------------------------------------------


def prefill_rows(
    model: Model,
    cases: Sequence[tuple[int, int]],
    new_tokens: int,
    *,
    repeats: int,
    warmup: int = 2,
    log: Callable[[str], None] = _log,
) -> list[dict]:
    """The example's prefill (its generation.prefill_step: the prompt's forward pass writing the
    caches, and the first token) of each (batch, prompt length) of `cases`, into caches of the
    prompt + `new_tokens` positions as a run's, NVFP4 and bf16: each compiled once ("compile_s"),
    `warmup` calls, then `repeats` calls of each alternating (every call waited for; the caches
    each returns, donated on GPUs, are the next one's). Per row the median "nvfp4_ms" and
    "bf16_ms", their fastest calls, "ratio" = bf16_ms / nvfp4_ms (>= 1: NVFP4 as fast as bf16),
    "tokens_per_s" (NVFP4's) and the jax_fp4 path of the prompt's M = batch x length rows."""
    llm = load_example()
    cfg = model.cfg
    weight = llm.first_nvfp4_weight(model.params["layers"])
    rows = []
    for batch, length in cases:
        started = time.perf_counter()
        prompt = jnp.asarray(llm.random_prompts(cfg.vocab, batch, length), jnp.int32)
        context = length + new_tokens
        sides = {}
        for side, params in (("nvfp4", model.params), ("bf16", model.dense)):
            caches = llm.empty_cache(cfg, params, batch, context)
            compile_started = time.perf_counter()
            step = llm.prefill_step(cfg).lower(params, prompt, *caches, context).compile()
            compile_s = time.perf_counter() - compile_started
            sides[side] = dict(step=step, params=params, caches=caches, compile_s=compile_s, ms=[])

        def call(side: dict) -> float:
            t0 = time.perf_counter()
            state = jax.block_until_ready(side["step"](side["params"], prompt, *side["caches"]))
            side["caches"] = state[2:]  # donated to the next call on GPUs
            return (time.perf_counter() - t0) * 1e3

        for _ in range(warmup):
            for side in sides.values():
                call(side)
        for _ in range(repeats):
            for side in sides.values():
                side["ms"].append(call(side))
        ms = {name: float(np.median(side["ms"])) for name, side in sides.items()}
        row = {
            "model": model.name,
            "layers": cfg.layers,
            "batch": batch,
            "prompt_len": length,
            "context": context,
            "nvfp4_ms": ms["nvfp4"],
            "bf16_ms": ms["bf16"],
            "ratio": ms["bf16"] / ms["nvfp4"],
            "nvfp4_min_ms": min(sides["nvfp4"]["ms"]),
            "bf16_min_ms": min(sides["bf16"]["ms"]),
            "tokens_per_s": batch * length / (ms["nvfp4"] * 1e-3),
            "compile_s": {name: side["compile_s"] for name, side in sides.items()},
            "repeats": repeats,
            "path": jax_fp4.dispatch_path(
                jnp.zeros((batch * length, weight.k), model.params["embed"].dtype), weight
            ),
        }
        log(
            f"prefill batch {batch} x {length} tokens: NVFP4 {row['nvfp4_ms']:.2f} ms, bf16 "
            f"{row['bf16_ms']:.2f} ms (x{row['ratio']:.2f}); path {row['path']}   "
            f"[{time.perf_counter() - started:.1f} s]"
        )
        rows.append(row)
    return rows


# ---- gemv: matmuls in a dependent chain ---------------------------------------------------------


def with_floors(row: dict, flops: int, peak_tflops: float | None) -> dict:
    """`row` with its compute floor (the flops at the same run's bf16 peak, `peak_tflops`) and
    "over_floor", its time over the larger of the byte and the compute floor."""
    compute_us = flops / (peak_tflops * 1e6) if peak_tflops else 0.0
    return {
        **row,
        "compute_floor_us": compute_us,
        "over_floor": row["us"] / max(row["floor_us"], compute_us),
    }


def with_m1_ratio(rows: list[dict], key: Sequence[str] = ("n", "k")) -> list[dict]:
    """Each row with "over_m1", its time over the M = 1 row of the same weights (`key`) in `rows`
    (None where `rows` has none): how far a batch is from costing what one sequence costs."""
    m1 = {tuple(r[f] for f in key): r["us"] for r in rows if r["m"] == 1}
    return [
        {**r, "over_m1": r["us"] / m1[ident] if (ident := tuple(r[f] for f in key)) in m1 else None}
        for r in rows
    ]


def gemv_rows(
    shapes: Sequence[tuple[int, int]],
    ms: Sequence[int],
    settings: bench.Settings,
    seed: int,
    log: Callable[[str], None] = _log,
    peak_tflops: float | None = None,
) -> list[dict]:
    """One row per (shape, M): jax_fp4.matmul and bf16 jnp.dot per matmul in a dependent chain,
    the chain's joint subtracted, against the same-run streaming read of the weight's bytes and
    the compute floor at `peak_tflops` (the same run's bf16 rate on a large GEMM)."""
    runner = bench.Bench(settings, jax.random.key(seed), log=log)
    itemsize = np.dtype(settings.dtype).itemsize
    rows = []
    for n, k in shapes:
        shape = bench.Shape(n, k)
        weight_bytes = bench.nvfp4_weight_bytes(n, k)
        read = runner.read_bandwidth(weight_bytes)
        l1, l2 = bench.chain_lengths(weight_bytes, n * k * itemsize, settings.budget)
        dense_ws, fp4_ws = bench.make_weights(runner._next_key(), shape, l2, settings.dtype)
        fp4_ws = [runner.laid_out(w) for w in fp4_ws]
        for m in ms:
            started = time.perf_counter()
            x = bench.make_activations(runner._next_key(), m, k, 1, settings.dtype)[0]
            layer = bench.fp4_layer(settings.backend, settings.tuning)
            fp4 = runner._time(bench.dependent_chain_of(layer), (x, fp4_ws), l1, l2)
            dense = runner._time(bench.dependent_chain_of(bench.dense_layer), (x, dense_ws), l1, l2)
            glue = (
                runner._time(bench.glue_chain(n), (x, fp4_ws), l1, l2)
                if n != k
                else bench.ChainTiming(0.0, l1, l2, 0.0, 0.0)
            )
            row = with_floors(
                gemv_row(n, k, m, itemsize, fp4, dense, glue, read), 2 * m * n * k, peak_tflops
            )
            row.update(
                path=jax_fp4.dispatch_path(x, fp4_ws[0], backend=settings.backend),
                layout=fp4_ws[0].layout,
                dtype=settings.dtype_name,
                **variant_fields(settings),
            )
            log(f"{format_gemv_row(row)}   [{time.perf_counter() - started:.1f} s]")
            rows.append(row)
    return with_m1_ratio(rows)


def variant_fields(settings: bench.Settings) -> dict:
    """What a row records of a forced backend or tuning (None: the defaults)."""
    tuning = settings.tuning
    return {
        "backend": settings.backend,
        "tuning": None
        if tuning is None
        else {
            f.name: getattr(tuning, f.name)
            for f in dataclasses.fields(tuning)
            if getattr(tuning, f.name) != f.default
        },
    }


def mlp_rows(
    hidden: int,
    intermediate: int,
    ms: Sequence[int],
    settings: bench.Settings,
    seed: int,
    log: Callable[[str], None] = _log,
    peak_tflops: float | None = None,
) -> list[dict]:
    """The MLP's two GEMVs as a decoder layer runs them, in a dependent chain with no joint to
    subtract: x [M, hidden] -> gate_up [2I, hidden] with SiLU(gate) * up in the epilogue -> down
    [hidden, I] with the residual x added in the epilogue -> the next pair's x. One row per M: the
    pair's us, TB/s (both weights' NVFP4 bytes + activations + outputs), fraction of the same-run
    streaming read of the weights' bytes, and bf16 jnp.dot with XLA's SiLU * up and residual."""
    runner = bench.Bench(settings, jax.random.key(seed), log=log)
    itemsize = np.dtype(settings.dtype).itemsize
    gate_up, down = bench.Shape(2 * intermediate, hidden), bench.Shape(hidden, intermediate)
    weight_bytes = sum(bench.nvfp4_weight_bytes(s.n, s.k) for s in (gate_up, down))
    read = runner.read_bandwidth(weight_bytes)
    l1, l2 = bench.chain_lengths(
        weight_bytes, 3 * intermediate * hidden * itemsize, settings.budget
    )
    dense_gu, fp4_gu = bench.make_weights(runner._next_key(), gate_up, l2, settings.dtype)
    dense_down, fp4_down = bench.make_weights(runner._next_key(), down, l2, settings.dtype)
    fp4_pairs = [(runner.laid_out(g), runner.laid_out(d)) for g, d in zip(fp4_gu, fp4_down)]
    dense_pairs = list(zip(dense_gu, dense_down))
    options = dict(backend=settings.backend, tuning=settings.tuning)

    def fp4_mlp(x, pair):
        h = jax_fp4.matmul(x, pair[0], activation="silu_mul", **options)
        return jax_fp4.matmul(h, pair[1], residual=x, **options)

    def dense_mlp(x, pair):
        gate, up = jnp.split((x @ pair[0].T).astype(jnp.float32), 2, axis=-1)
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        return (x.astype(jnp.float32) + (h @ pair[1].T).astype(jnp.float32)).astype(x.dtype)

    rows = []
    for m in ms:
        started = time.perf_counter()
        x = bench.make_activations(runner._next_key(), m, hidden, 1, settings.dtype)[0]
        fp4 = runner._time(bench.dependent_chain_of(fp4_mlp), (x, fp4_pairs), l1, l2)
        dense = runner._time(bench.dependent_chain_of(dense_mlp), (x, dense_pairs), l1, l2)
        # x, h and the residual read, h and the output written
        nbytes = weight_bytes + (3 * m * hidden + 2 * m * intermediate) * itemsize
        tbps = bench.tbps(nbytes, fp4.us)
        row = {
            "hidden": hidden,
            "intermediate": intermediate,
            "m": m,
            "us": fp4.us,
            "tbps": tbps,
            "fraction_of_read_bw": tbps / read.tbps,
            "bf16_us": dense.us,
            "x_bf16": dense.us / fp4.us,
            "read_bw_tbps": read.tbps,
            "floor_us": nbytes / (read.tbps * 1e12) * 1e6,
            "bytes": nbytes,
            "layers": [fp4.l1, fp4.l2],
            "path": jax_fp4.dispatch_path(x, fp4_pairs[0][0], backend=settings.backend),
            "noisy": fp4.noisy or dense.noisy or read.noisy,
            **variant_fields(settings),
        }
        row = with_floors(row, 2 * m * 3 * intermediate * hidden, peak_tflops)
        log(
            f"MLP {hidden}->{2 * intermediate}->{hidden} M={m}: {fp4.us:.2f} us, {tbps:.2f} TB/s, "
            f"{100 * row['fraction_of_read_bw']:.0f}% of read; bf16 {dense.us:.2f} us "
            f"(x{row['x_bf16']:.2f})"
            + ("  (noisy)" if row["noisy"] else "")
            + f"   [{time.perf_counter() - started:.1f} s]"
        )
        rows.append(row)
    return with_m1_ratio(rows, ("hidden", "intermediate"))


def gemv_row(n, k, m, itemsize, fp4, dense, glue, read) -> dict:
    """A gemv row from the chain timings (bench.ChainTiming, per layer) and the read bandwidth
    (bench.ReadBandwidth). A joint slower than the matmul's whole chain time (a noisy CPU) leaves
    the chain time as it is."""

    def net(t):
        return t.us - glue.us if t.us > glue.us else t.us

    us, bf16_us = net(fp4), net(dense)
    nbytes = bench.nvfp4_weight_bytes(n, k) + bench.io_bytes(m, n, k, itemsize)
    tbps = bench.tbps(nbytes, us)
    return {
        "n": n,
        "k": k,
        "m": m,
        "us": us,
        "tbps": tbps,
        "fraction_of_read_bw": tbps / read.tbps,
        "bf16_us": bf16_us,
        "x_bf16": bf16_us / us,
        "glue_us": glue.us,
        "chain_us": fp4.us,
        "bf16_chain_us": dense.us,
        "read_bw_tbps": read.tbps,
        "floor_us": nbytes / (read.tbps * 1e12) * 1e6,
        "bytes": nbytes,
        "layers": [fp4.l1, fp4.l2],
        "noisy": fp4.noisy or dense.noisy or glue.noisy or read.noisy,
    }


def format_gemv_row(r: dict) -> str:
    return (
        f"{r['n']}x{r['k']} M={r['m']}: {r['us']:.2f} us, {r['tbps']:.3g} TB/s, "
        f"{100 * r['fraction_of_read_bw']:.0f}% of read; bf16 {r['bf16_us']:.2f} us "
        f"(x{r['x_bf16']:.2f}); joint {r['glue_us']:.2f} us" + ("  (noisy)" if r["noisy"] else "")
    )


# ---- output -------------------------------------------------------------------------------------


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"


_RUN_COLUMNS = (
    ("model", lambda r: str(r["model"])),
    ("layers", lambda r: str(r["layers"]) if r.get("layers") else "-"),
    ("batch", lambda r: str(r["batch"])),
    ("context", lambda r: str(r["context"])),
    ("attention", lambda r: r.get("attention") or "-"),
    ("NVFP4 ms", lambda r: _num(r.get("nvfp4_ms"))),
    ("bf16 ms", lambda r: _num(r.get("bf16_ms"))),
    ("x bf16", lambda r: _num(r.get("ratio"))),
    ("GPU busy ms", lambda r: _num(r.get("gpu_busy_ms"))),
    ("non-matmul ms", lambda r: _num(r.get("non_matmul_ms"))),
    ("kernels", lambda r: f"{r['kernels_per_step']:.0f}" if r.get("kernels_per_step") else "-"),
    ("loop / busy", lambda r: _num(r.get("loop_over_gpu_busy"))),
    ("floor ms", lambda r: _num(r.get("floor_ms"))),
    ("NVFP4 / floor", lambda r: _num(r.get("nvfp4_over_floor"))),
    ("active experts", lambda r: _num(r.get("active_experts"))),
    ("expected", lambda r: _num(r.get("expected_active_experts"))),
)
_PREFILL_COLUMNS = (
    ("model", lambda r: str(r["model"])),
    ("layers", lambda r: str(r["layers"])),
    ("batch", lambda r: str(r["batch"])),
    ("prompt", lambda r: str(r["prompt_len"])),
    ("NVFP4 ms", lambda r: _num(r["nvfp4_ms"])),
    ("bf16 ms", lambda r: _num(r["bf16_ms"])),
    ("x bf16", lambda r: _num(r["ratio"])),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
    ("path", lambda r: str(r["path"])),
)
_TIMING_COLUMNS = (  # the gemv and mlp rows' own columns, after what they name
    ("M", lambda r: str(r["m"])),
    ("us", lambda r: _num(r["us"]) + ("?" if r.get("noisy") else "")),
    ("TB/s", lambda r: _num(r["tbps"])),
    ("% of read BW", lambda r: f"{100 * r['fraction_of_read_bw']:.0f}%"),
    ("bf16 us", lambda r: _num(r["bf16_us"])),
    ("x bf16", lambda r: _num(r["x_bf16"])),
    ("/ floor", lambda r: _num(r.get("over_floor"))),
)
_GEMV_COLUMNS = (
    ("N x K", lambda r: f"{r['n']}x{r['k']}"),
    *_TIMING_COLUMNS,
    ("/ M=1", lambda r: _num(r.get("over_m1"))),
    ("joint us", lambda r: _num(r["glue_us"])),
)
_MLP_COLUMNS = (
    ("hidden -> 2I -> hidden", lambda r: f"{r['hidden']}->{2 * r['intermediate']}->{r['hidden']}"),
    *_TIMING_COLUMNS,
    ("/ M=1", lambda r: _num(r.get("over_m1"))),
)
_TEXT_COLUMNS = {"model", "N x K", "hidden -> 2I -> hidden", "path"}


def markdown(results: dict) -> str:
    """The runs, prefill, gemv and mlp rows of a results dict as Markdown tables ('?': a noisy
    row)."""
    parts = []
    if results.get("runs"):
        parts.append(bench.markdown_table(_RUN_COLUMNS, results["runs"], _TEXT_COLUMNS))
    if results.get("prefill"):
        parts.append(bench.markdown_table(_PREFILL_COLUMNS, results["prefill"], _TEXT_COLUMNS))
    if results.get("gemv"):
        parts.append(bench.markdown_table(_GEMV_COLUMNS, results["gemv"], _TEXT_COLUMNS))
    if results.get("mlp"):
        parts.append(bench.markdown_table(_MLP_COLUMNS, results["mlp"], _TEXT_COLUMNS))
    return "\n\n".join(parts)


# ---- command line -------------------------------------------------------------------------------


def earlier_results(path: Path, current: dict) -> dict:
    """The results file at `path` as an earlier call on this call's device (`current`'s "device"
    and "platform") wrote it; {} where there is none or it holds another device's."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    if (earlier.get("device"), earlier.get("platform")) != (current["device"], current["platform"]):
        _log(f"{path} holds another device's results ({earlier.get('device')}): starting over")
        return {}
    return earlier


RUN_KEY = ("model", "layers", "batch", "context", "attention")
PREFILL_KEY = ("model", "layers", "batch", "prompt_len")
GEMV_KEY = ("n", "k", "m", "layout", "backend", "tuning")
MLP_KEY = ("hidden", "intermediate", "m", "backend", "tuning")


def merged(earlier: Sequence[dict], new: Sequence[dict], key: Sequence[str]) -> list[dict]:
    """The earlier records with the ones `new` measures again (equal `key` fields) replaced in
    place, then the rest of `new`."""

    def ident(r):
        return tuple(json.dumps(r.get(f), sort_keys=True) for f in key)

    again = {ident(r): r for r in new}
    out = [again.pop(ident(r), r) for r in earlier]
    return out + list(again.values())


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, e.g. '1,8,64'; got {text!r}")
    return values


def _attention_kinds(text: str) -> list[str]:
    kinds = text.replace(",", " ").split()
    known = load_example().ATTENTION
    if not kinds or any(k not in known for k in kinds) or len(set(kinds)) < len(kinds):
        raise argparse.ArgumentTypeError(
            f"expected some of auto, xla, cudnn, e.g. xla,cudnn; got {text!r}"
        )
    return kinds


def _shapes(text: str) -> list[tuple[int, int]]:
    return [(s.n, s.k) for s in (bench.parse_shape(x) for x in text.replace(",", " ").split())]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/decode.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runs = p.add_argument_group("runs (the example's generate loop)")
    runs.add_argument(
        "--model",
        default=None,
        help="a preset of examples/llm_generate.py or a config.json (default llama3-8b)",
    )
    runs.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the model's decoder layers (default the config's; an H100 holds qwen3-30b-a3b's "
        "bf16 twin beside the NVFP4 model only at about half its 48)",
    )
    runs.add_argument(
        "--batches",
        type=_ints,
        default=None,
        help=f"batch sizes after the short prompt (default {','.join(map(str, DEFAULT_BATCHES))})",
    )
    runs.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help=f"the short prompt's tokens (default {DEFAULT_PROMPT_LEN})",
    )
    runs.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        help=f"the batch-1 run's long prompt, in tokens (default {DEFAULT_LONG_PROMPT})",
    )
    runs.add_argument("--no-long-prompt", action="store_true", help="skip the long-prompt run")
    runs.add_argument(
        "--long-prompt-batches",
        type=_ints,
        default=[1],
        help="the batches run after the long prompt (default 1)",
    )
    runs.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help=f"tokens generated per run (default {DEFAULT_NEW_TOKENS})",
    )
    runs.add_argument(
        "--gpu-busy-steps",
        type=int,
        default=None,
        help=f"decode steps profiled for the GPU-busy time (default {DEFAULT_GPU_BUSY_STEPS}; "
        "0: none)",
    )
    runs.add_argument(
        "--attention",
        type=_attention_kinds,
        default=["auto"],
        help="what runs the decode steps' attention, each in turn per run: xla (XLA's batched "
        "dots and softmax), cudnn (cuDNN's fused attention: a CUDA GPU) and auto (cudnn where it "
        "runs, else xla: the example's default), e.g. xla,cudnn",
    )
    runs.add_argument("--no-runs", action="store_true", help="skip the runs")
    prefill = p.add_argument_group("prefill (the example's prefill, compiled once, timed warm)")
    prefill.add_argument(
        "--prefill-lens",
        type=_ints,
        default=None,
        help="prompt lengths, in tokens (default " + ",".join(map(str, DEFAULT_PREFILL_LENS)) + ")",
    )
    prefill.add_argument(
        "--prefill-batches",
        type=_ints,
        default=None,
        help="batch sizes (default " + ",".join(map(str, DEFAULT_PREFILL_BATCHES)) + ")",
    )
    prefill.add_argument(
        "--prefill-repeats",
        type=int,
        default=None,
        help=f"timed calls per row and side (default {DEFAULT_PREFILL_REPEATS})",
    )
    prefill.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    gemv = p.add_argument_group("gemv (matmuls in a dependent chain)")
    gemv.add_argument(
        "--gemv-m",
        type=_ints,
        default=None,
        help=f"M values (default {','.join(map(str, DEFAULT_GEMV_M))})",
    )
    gemv.add_argument(
        "--gemv-shapes",
        type=_shapes,
        default=None,
        help="weight shapes NxK (default "
        + ",".join(f"{n}x{k}" for n, k in DEFAULT_GEMV_SHAPES)
        + ")",
    )
    gemv.add_argument(
        "--repeats", type=int, default=None, help="timed calls per chain (default 10, quick 1)"
    )
    gemv.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="seconds of timed calls per chain pair at least (default 0.2, quick 0)",
    )
    gemv.add_argument("--no-gemv", action="store_true", help="skip the gemv rows")
    gemv.add_argument(
        "--backend",
        default=None,
        help="force a jax_fp4 backend in the gemv and mlp rows (default auto)",
    )
    gemv.add_argument(
        "--tuning",
        type=bench._tuning,
        default=None,
        help="KernelTuning fields for the gemv and mlp rows, e.g. gemv_k_split=4 (bench.py's "
        "--tuning)",
    )
    p.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="tiled",
        help="the NVFP4 weights' layout (default tiled: prepacked where the shape allows)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="where the results go (default benchmarks/results/decode_<gpu>.json)",
    )
    p.add_argument("--seed", type=int, default=None, help="the gemv part's random seed")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start the results file over (default: keep the records of earlier calls on this "
        "device that this call does not measure again)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny model and shapes: a CPU smoke run")
    p.add_argument(
        "--markdown-from",
        metavar="JSON",
        help="print an earlier result's tables and exit (no device work)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.markdown_from:
        print(markdown(json.loads(Path(args.markdown_from).read_text())))
        return 0

    def pick(value, name, default):
        return value if value is not None else (QUICK[name] if args.quick else default)

    model = pick(args.model, "model", "llama3-8b")
    batches = pick(args.batches, "batches", DEFAULT_BATCHES)
    prompt_len = pick(args.prompt_len, "prompt_len", DEFAULT_PROMPT_LEN)
    long_prompt = pick(args.long_prompt, "long_prompt", DEFAULT_LONG_PROMPT)
    new_tokens = pick(args.new_tokens, "new_tokens", DEFAULT_NEW_TOKENS)
    busy_steps = pick(args.gpu_busy_steps, "gpu_busy_steps", DEFAULT_GPU_BUSY_STEPS)
    gemv_m = pick(args.gemv_m, "gemv_m", DEFAULT_GEMV_M)
    gemv_shapes = pick(args.gemv_shapes, "gemv_shapes", DEFAULT_GEMV_SHAPES)
    prefill_lens = pick(args.prefill_lens, "prefill_lens", DEFAULT_PREFILL_LENS)
    prefill_batches = pick(args.prefill_batches, "prefill_batches", DEFAULT_PREFILL_BATCHES)
    prefill_repeats = pick(args.prefill_repeats, "prefill_repeats", DEFAULT_PREFILL_REPEATS)
    if min(prompt_len, long_prompt, new_tokens) < 1:
        raise SystemExit(
            f"--prompt-len, --long-prompt and --new-tokens must be >= 1, got {prompt_len}, "
            f"{long_prompt} and {new_tokens}"
        )
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {args.layers}")
    if busy_steps < 0:
        raise SystemExit(f"--gpu-busy-steps must be >= 0, got {busy_steps}")
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if prefill_repeats < 1:
        raise SystemExit(f"--prefill-repeats must be >= 1, got {prefill_repeats}")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")

    device = bench.default_device()
    out = Path(args.json) if args.json else results_path(device.device_kind, device.platform)
    command = " ".join(["python benchmarks/decode.py", *(sys.argv[1:] if argv is None else argv)])
    results = {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "jax_fp4": jax_fp4.__version__,
        "runs": [],
        "runs_setup": None,
        "prefill": [],
        "prefill_setup": None,
        "gemv": [],
        "gemv_setup": None,
        "mlp": [],
    }
    if not args.fresh:
        earlier = earlier_results(out, results)
        results.update(
            {
                key: earlier[key]
                for key in (
                    "runs",
                    "runs_setup",
                    "prefill",
                    "prefill_setup",
                    "gemv",
                    "gemv_setup",
                    "mlp",
                )
                if earlier.get(key) is not None
            }
        )
    _log(f"{command}: {device.platform} ({device.device_kind}), jax {jax.__version__}")

    def write():
        out.parent.mkdir(parents=True, exist_ok=True)
        bench.write_json_file(str(out), results)

    if not (args.no_runs and args.no_prefill):
        llm = load_example()
        read_bps = None
        if not args.no_runs:  # before the weights take the device's memory
            read_bps = llm.read_bandwidth(QUICK_READ_BYTES if args.quick else None)
            _log(f"streaming read: {read_bps / 1e9:.0f} GB/s")
        built = build_model(model, layout=args.layout, layers=args.layers)
        setup = {
            "command": command,
            "model": model,
            "new_tokens": new_tokens,
            "layout": args.layout,
            "config": dataclasses.asdict(built.cfg),
        }
        if not args.no_runs:
            cases = [(b, prompt_len) for b in batches]
            if not args.no_long_prompt:
                cases += [(batch, long_prompt) for batch in args.long_prompt_batches]
            runs = decode_runs(
                built,
                cases,
                new_tokens,
                gpu_busy_steps=busy_steps,
                read_bps=read_bps,
                attention=args.attention,
            )
            for run in runs:
                run["command"] = command
            results["runs"] = merged(results["runs"], runs, RUN_KEY)
            results["runs_setup"] = {
                **setup,
                "attention": args.attention,
                "read_gb_per_s": read_bps / 1e9,
            }
            write()
        if not args.no_prefill:
            cases = [(batch, length) for length in prefill_lens for batch in prefill_batches]
            rows = prefill_rows(
                built, cases, new_tokens, repeats=prefill_repeats, warmup=1 if args.quick else 2
            )
            for row in rows:
                row["command"] = command
            results["prefill"] = merged(results["prefill"], rows, PREFILL_KEY)
            results["prefill_setup"] = {**setup, "repeats": prefill_repeats}
            write()
        del built  # the gemv part's weights take the memory next
    if not args.no_gemv:
        if not args.quick:
            bench.warm_up_device(1.0)
        settings = bench.Settings(
            backend=args.backend,
            tuning=args.tuning,
            layout=args.layout,
            repeats=args.repeats or (1 if args.quick else 10),
            warmup=1 if args.quick else 2,
            min_time_s=args.min_time if args.min_time is not None else (0 if args.quick else 0.2),
            read_kernels=("sum",) if args.quick else tuple(bench.READ_KERNELS),
            budget=bench.Budget(
                cache_bytes=bench.QUICK_CACHE_BYTES, max_layers=bench.QUICK_MAX_LAYERS
            )
            if args.quick
            else bench.Budget(),
        )
        # The compute ceiling of the compute floors: the bf16 rate on a large GEMM, this run.
        peak = bench.bf16_peak_tflops(512 if args.quick else 8192)
        _log(f"bf16 jnp.dot on a large GEMM: {peak:.0f} TFLOP/s")
        rows = gemv_rows(gemv_shapes, gemv_m, settings, seed, peak_tflops=peak)
        for row in rows:
            row["command"] = command
        results["gemv"] = merged(results["gemv"], rows, GEMV_KEY)
        config = model_config(load_example(), model)
        mlp = mlp_rows(
            config["hidden_size"],
            config["intermediate_size"],
            gemv_m,
            settings,
            seed,
            peak_tflops=peak,
        )
        for row in mlp:
            row["command"] = command
        results["mlp"] = merged(results["mlp"], mlp, MLP_KEY)
        results["gemv_setup"] = {
            "command": command,
            "layout": args.layout,
            "dtype": settings.dtype_name,
            "repeats": settings.repeats,
            "min_time_s": settings.min_time_s,
            "seed": seed,
            "bf16_peak_tflops": peak,
            **variant_fields(settings),
        }
        write()
    _log(f"wrote {out}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
