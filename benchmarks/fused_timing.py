"""Times the fused sm_90 NVFP4 GEMM (jax_fp4_fused_cuda) against jnp.dot on bf16 weights, the
dequant path (dequantize kernel + XLA dot) and the GEMV kernel (jax_fp4_gemv_cuda), all in the same
run.

Each measurement is a jitted chain of L matmuls over L distinct weights (L chosen so that the
weights of a chain exceed the 60 MB L2 several times over), timed as the median over repeats of a
batch of back-to-back calls, divided by the number of matmuls.

    python benchmarks/fused_timing.py [--shapes 11008x4096,4096x11008] [--ms 16,64,256] [--json PATH]
    python benchmarks/fused_timing.py --variants bf16,fused,gemv --ms 16,32,64,128
    python benchmarks/fused_timing.py --layout tiled ...   # prepacked weights (jax_fp4.prepack)
    python benchmarks/fused_timing.py --tuning fused_split=3 ...   # fixed kernel choices
    python benchmarks/fused_timing.py --plot-from results/fused_h200.json --png plots/fused.png

Needs jax_fp4 built with its CUDA module (both targets registered) and an sm_90 device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
from jax_fp4 import fused as _fused
from jax_fp4 import layout as _layout

FUSED = "jax_fp4_fused_cuda"
DEQUANT = "jax_fp4_dequant_cuda"
GEMV = "jax_fp4_gemv_cuda"
# Variants that are `fused` with a kernel choice fixed (FFI attributes, jax_fp4.KernelTuning):
# the multistage kernel at every tile or the warp-specialized one (64-row tiles and up: M > 32),
# 128 weight rows per CTA at the 128-row tile (M = 65-128), and cluster split-K or stream-K forced
# for the warp-specialized kernel (stream-K: M > 64 only).
TUNED_VARIANTS = {
    "fused_multistage": {"fused_warp_specialized": False},
    "fused_ws": {"fused_warp_specialized": True},
    "fused_tile_n128": {"fused_tile_n": 128},
    "fused_cluster": {"fused_stream_k": False},
    "fused_stream_k": {"fused_stream_k": True},
}
VARIANTS = ("bf16", "dequant", "dequant16", "fused", *TUNED_VARIANTS, "fused_own_a", "gemv")
DEFAULT_SHAPES = "11008x4096,4096x11008,17408x5120,28672x8192"
DEFAULT_MS = "16,32,64,128,256,512,1024,2048,4096"
CHAIN_BYTES = 200e6  # each chain's fp4 weights exceed the 60 MB L2 about 3x
TILED = False  # --layout tiled: the weights prepacked, every kernel told so (set once by main)
TUNING = jax_fp4.KernelTuning()  # --tuning: the kernel choices of every variant (set once by main)


def register_targets() -> str:
    """Checks that the package registered the fused and dequant targets."""
    from jax_fp4 import ffi as _ffi

    got = _ffi.REGISTERED_TARGETS.get("CUDA", [])
    if FUSED not in got or DEQUANT not in got:
        raise SystemExit(
            "jax_fp4's CUDA module lacks the fused/dequant targets (built without nvcc?)"
        )
    return "package"


def _attributes(attributes: dict) -> dict:
    return {k: v if isinstance(v, bool) else np.int64(v) for k, v in attributes.items()}


def fused_call(a, packed, scale, gs, tuning=None):
    (m, k), n = a.shape, packed.shape[0]
    tuning = TUNING if tuning is None else tuning
    call = jax.ffi.ffi_call(
        FUSED,
        (
            jax.ShapeDtypeStruct((m, n), a.dtype),
            jax.ShapeDtypeStruct((_fused.fused_workspace_elems(m, n, k),), jnp.float32),
        ),
    )
    y, _ = call(
        _fused.to_fragment_order(a, TILED),
        packed,
        scale,
        gs,
        jnp.zeros((0,), a.dtype),
        jnp.zeros((0,), a.dtype),
        block_size=np.int64(16),
        tiled=TILED,
        activation=np.int64(0),
        **_attributes(tuning.fused_attributes()),
    )
    return y


def gemv_call(a, packed, scale, gs):
    # The tensor-core kernel (K % 128 == 0 here, sm_90).
    call = jax.ffi.ffi_call(GEMV, jax.ShapeDtypeStruct((a.shape[0], packed.shape[0]), a.dtype))
    return call(
        a,
        packed,
        scale,
        gs,
        jnp.zeros((0,), a.dtype),
        block_size=np.int64(16),
        tiled=TILED,
        tensor_cores=True,
        row_tiling=True,
        **_attributes(TUNING.gemv_attributes()),
    )


def dequantize(a, packed, scale, gs):
    """The dequant kernel's [N, K] weight in a's dtype."""
    call = jax.ffi.ffi_call(DEQUANT, jax.ShapeDtypeStruct((packed.shape[0], a.shape[-1]), a.dtype))
    return call(packed, scale, gs, block_size=np.int64(16), tiled=TILED)


def dequant_call(a, packed, scale, gs):
    # jax_fp4's "dequant" path as it was first written (f32 [M, N] result, then the cast); with a
    # bias it still is (lowering._dequant).
    w = dequantize(a, packed, scale, gs)
    return jnp.matmul(a, w.T, preferred_element_type=jnp.float32).astype(a.dtype)


def dequant16_call(a, packed, scale, gs):
    # jax_fp4's "dequant" path without bias: the dot emits a's dtype (cuBLAS rounds in its epilogue).
    return jnp.matmul(a, dequantize(a, packed, scale, gs).T)


def bf16_call(a, w):
    return jnp.dot(a, w.T)


def time_chain(fn, args, n_mm, target_s=0.015, reps=5):
    """Median seconds per matmul of fn(*args) (a chain of n_mm matmuls)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, min(200, int(target_s / one)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (inner * n_mm))
    return statistics.median(samples), (max(samples) - min(samples)) / statistics.median(samples)


def write_json(path, dev, dtype, records):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "device": dev.device_kind,
                "dtype": dtype.name,
                "jax": jax.__version__,
                "layout": "tiled" if TILED else "spec",
                "tuning": dataclasses.asdict(TUNING),
                "method": "jitted chain of distinct weights, median of 5 batches, per matmul",
                "records": records,
            },
            f,
            indent=1,
        )


def plot(json_path, png_path):
    """TFLOP/s and speedup over bf16 jnp.dot against M, one column per shape."""
    from jax_fp4.extras import import_extra

    matplotlib = import_extra("matplotlib", "plot", "benchmarks/fused_timing.py --plot-from")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    shapes = sorted({(r["n"], r["k"]) for r in data["records"]})
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.2 * len(shapes), 7), squeeze=False)
    styles = {
        "bf16": "tab:blue",
        "dequant": "tab:red",
        "dequant16": "tab:orange",
        "fused": "tab:green",
        "fused_multistage": "tab:olive",
        "fused_ws": "tab:gray",
        "fused_tile_n128": "tab:cyan",
        "fused_cluster": "tab:brown",
        "fused_stream_k": "tab:pink",
        "gemv": "tab:purple",
    }
    for col, (n, k) in enumerate(shapes):
        rows = sorted(
            (r for r in data["records"] if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"]
        )
        ms = [r["m"] for r in rows]
        top, bottom = axes[0][col], axes[1][col]
        for v, color in styles.items():
            if rows and rows[0].get(f"{v}_us") is not None:
                top.plot(ms, [r[f"{v}_tflops"] for r in rows], marker="o", color=color, label=v)
                if v != "bf16":
                    bottom.plot(
                        ms,
                        [r["bf16_us"] / r[f"{v}_us"] for r in rows],
                        marker="o",
                        color=color,
                        label=f"{v} vs bf16",
                    )
        top.set(title=f"N={n} K={k}", xscale="log", yscale="log", ylabel="TFLOP/s")
        bottom.axhline(1.0, color="gray", ls="--")
        bottom.set(xscale="log", xlabel="M", ylabel="speedup over bf16 jnp.dot")
        for ax in (top, bottom):
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.tick_params(axis="x", labelrotation=45)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"fused sm_90 NVFP4 GEMM vs dequant + dot vs bf16, {data['device']}, {data['dtype']}"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--plot-from", metavar="JSON", help="only plot an earlier run's JSON (with --png)"
    )
    ap.add_argument("--png", default="fused_timing.png")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxK,NxK,...")
    ap.add_argument("--ms", default=DEFAULT_MS)
    ap.add_argument("--variants", default="bf16,dequant,fused", help=",".join(VARIANTS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="spec",
        help="weights in the spec's layout or prepacked (tiled: N %% 16 == 0, K %% 128 == 0)",
    )
    ap.add_argument(
        "--tuning",
        default=None,
        help="kernel choices for every variant (jax_fp4.KernelTuning fields), e.g. "
        "'fused_split=3,programmatic_launch=1'; a tuned variant's own field wins",
    )
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fused_timing.json"))
    args = ap.parse_args()
    if args.plot_from:
        plot(args.plot_from, args.png)
        return
    source = register_targets()
    global TILED, TUNING
    TILED = args.layout == "tiled"
    import bench  # benchmarks/ is this script's directory: on sys.path

    try:
        TUNING = bench.parse_tuning(args.tuning) or jax_fp4.KernelTuning()
    except ValueError as err:
        raise SystemExit(f"--tuning: {err}") from None
    dtype = jnp.dtype(args.dtype)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    dev = jax.devices()[0]
    print(
        f"device {dev.device_kind}, targets from {source}, dtype {dtype.name}, "
        f"layout {args.layout}",
        flush=True,
    )

    records = []
    key = jax.random.PRNGKey(0)
    for shape in args.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        fp4_bytes = n * k // 2 + n * (k // 16)
        n_mm = max(2, math.ceil(CHAIN_BYTES / fp4_bytes))
        keys = jax.random.split(jax.random.fold_in(key, n * 7 + k), 3 * n_mm + 1)
        weights = []
        for i in range(n_mm):
            packed = jax.random.randint(keys[3 * i], (n, k // 2), 0, 256, jnp.int32).astype(
                jnp.uint8
            )
            scale = jax.random.randint(keys[3 * i + 1], (n, k // 16), 0x28, 0x48, jnp.int32).astype(
                jnp.uint8
            )
            if TILED:
                packed, scale = _layout.tile_packed(packed), _layout.tile_scale(scale)
            weights.append((packed, scale, jnp.full((1,), 2.0**-6, jnp.float32)))
        w16 = [None] * n_mm
        if "bf16" in variants:
            w16 = [
                (jax.random.normal(keys[3 * i + 2], (n, k), jnp.float32) * 0.02).astype(dtype)
                for i in range(n_mm)
            ]
        jax.block_until_ready((weights, w16))

        @jax.jit
        def chain_fused(a, ws):
            return [fused_call(a, *w) for w in ws]

        # One executable per tuned variant: the kernel choices are attributes of its calls.
        tuned_chains = {
            v: jax.jit(
                functools.partial(
                    lambda a, ws, tuning: [fused_call(a, *w, tuning=tuning) for w in ws],
                    tuning=dataclasses.replace(TUNING, **fields),
                )
            )
            for v, fields in TUNED_VARIANTS.items()
        }

        @jax.jit
        def chain_fused_own_a(acts, ws):
            # One activation per layer: each layer's to_fragment_order is its own XLA transpose
            # kernel (with the shared `a` of chain_fused XLA computes it once per chain).
            return [fused_call(x, *w) for x, w in zip(acts, ws)]

        @jax.jit
        def chain_dequant(a, ws):
            return [dequant_call(a, *w) for w in ws]

        @jax.jit
        def chain_dequant16(a, ws):
            return [dequant16_call(a, *w) for w in ws]

        @jax.jit
        def chain_bf16(a, ws):
            return [bf16_call(a, w) for w in ws]

        @jax.jit
        def chain_gemv(a, ws):
            return [gemv_call(a, *w) for w in ws]

        for m in (int(x) for x in args.ms.split(",")):
            a = (jax.random.normal(keys[-1], (m, k), jnp.float32)).astype(dtype)
            row = {"n": n, "k": k, "m": m, "chain": n_mm}
            for v in variants:
                fn, ws = {
                    "fused": (chain_fused, weights),
                    "dequant": (chain_dequant, weights),
                    "dequant16": (chain_dequant16, weights),
                    "bf16": (chain_bf16, w16),
                    "gemv": (chain_gemv, weights),
                    "fused_own_a": (None, weights),
                    **{e: (tuned_chains[e], weights) for e in TUNED_VARIANTS},
                }[v]
                if v == "fused_own_a":
                    fn, a_arg = chain_fused_own_a, [a * (1.0 + 2.0**-8 * i) for i in range(n_mm)]
                else:
                    a_arg = a
                try:
                    sec, spread = time_chain(fn, (a_arg, ws), n_mm)
                except Exception as err:  # report and keep going
                    print(
                        f"  {v} N={n} K={k} M={m}: FAILED {type(err).__name__}: {err}", flush=True
                    )
                    row[f"{v}_us"] = None
                    continue
                row[f"{v}_us"] = sec * 1e6
                row[f"{v}_spread"] = spread
                row[f"{v}_tflops"] = 2.0 * m * n * k / sec / 1e12
                wbytes = (n * k * 2) if v == "bf16" else fp4_bytes
                row[f"{v}_weight_tbps"] = wbytes / sec / 1e12
            for v in variants:
                if v != "bf16" and row.get("bf16_us") and row.get(f"{v}_us"):
                    row[f"{v}_speedup_vs_bf16"] = row["bf16_us"] / row[f"{v}_us"]
            records.append(row)
            print(
                "  "
                + json.dumps(
                    {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in row.items()}
                ),
                flush=True,
            )
            write_json(args.json, dev, dtype, records)  # after every row: partial runs keep data
        del weights, w16

    others = [v for v in variants if v != "bf16"]
    print(
        f"\n{'N':>6} {'K':>6} {'M':>5} | "
        + " ".join(f"{v + ' us':>11}" for v in variants)
        + " | "
        + " ".join(f"{v + ' x':>11}" for v in others)
    )
    for r in records:

        def f(key, fmt="11.1f"):
            v = r.get(key)
            return format(v, fmt) if v is not None else " " * 10 + "-"

        print(
            f"{r['n']:>6} {r['k']:>6} {r['m']:>5} | "
            + " ".join(f(f"{v}_us") for v in variants)
            + " | "
            + " ".join(f(f"{v}_speedup_vs_bf16", "11.2f") for v in others)
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
