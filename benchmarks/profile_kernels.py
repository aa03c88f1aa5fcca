"""Runs each jax_fp4 CUDA kernel once per case, for Nsight Compute to profile (kernel-only time
with a cold L2, launch shape, stall reasons). Run it under ncu, e.g.

    ncu --clock-control none -k regex:"Gemv|Fused" --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats python benchmarks/profile_kernels.py

Cases are "backend:M:NxK" (default: the decode GEMV and the fused GEMM at the shapes docs/design.md
discusses), or "grouped:TOKENS:NxK" for jax_fp4.ragged_matmul over --experts stacked [N, K] weights
with TOKENS tokens routed uniformly at random to --top-k distinct experts each (M = TOKENS x top-k
rows; the grouped GEMV or GEMM, whichever the dispatch picks). Every case runs twice (compile +
warm) before the profiled third call. `--layout tiled` prepacks the weights (jax_fp4.prepack), as
the default bench sweep times them; `--tuning` fixes the matmul cases' kernel choices (e.g.
`gemv_k_split=4` for the GEMV's K split). Given more than once, each matmul case runs under each
tuning in turn ("" for the heuristics' own choices), so one process (one ncu report) compares
them:

    ncu ... python benchmarks/profile_kernels.py --layout tiled --cases fused:32:4096x4096 \
        --tuning "" --tuning fused_split=4 --tuning fused_warp_specialized=0
"""

from __future__ import annotations

import argparse

import bench  # --tuning's parser
import jax
import jax.numpy as jnp
import moe  # the grouped cases' routing (benchmarks/ is this script's directory)
import numpy as np

import jax_fp4

DEFAULT_CASES = "gemv:1:11008x4096,gemv:4:248320x2048,fused:16:11008x4096,fused:128:11008x4096"


def run_case(backend: str, m: int, n: int, k: int, tiled: bool = False, tuning=None) -> None:
    rng = np.random.default_rng(0)
    w = jax_fp4.quantize(jnp.asarray(rng.standard_normal((n, k), np.float32)))
    if tiled:
        w = jax_fp4.prepack(w)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    f = jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend=backend, tuning=tuning))
    for _ in range(3):
        jax.block_until_ready(f(a, w))


def run_grouped_case(tokens: int, n: int, k: int, experts: int, top_k: int, tiled: bool) -> None:
    rng = np.random.default_rng(0)
    w = jax_fp4.quantize(jnp.asarray(rng.standard_normal((experts, n, k), np.float32)))
    if tiled:
        w = jax_fp4.prepack(w)
    choice = moe.route(rng, "uniform", tokens, experts, top_k, zipf=0.0)
    sizes = jnp.asarray(moe.group_sizes(choice, experts))
    a = jnp.asarray(rng.standard_normal((tokens * top_k, k), np.float32), jnp.bfloat16)
    f = jax.jit(jax_fp4.ragged_matmul)
    for _ in range(3):
        jax.block_until_ready(f(a, w, sizes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT_CASES, help="backend:M:NxK,...")
    ap.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="spec",
        help="weights in the spec's layout or prepacked (N %% 16 == 0, K %% 128 == 0)",
    )
    ap.add_argument("--experts", type=int, default=128, help="grouped cases: stacked experts")
    ap.add_argument("--top-k", type=int, default=8, help="grouped cases: experts per token")
    ap.add_argument(
        "--tuning",
        type=bench._tuning,
        action="append",
        help="kernel choices for the matmul cases, as bench.py's --tuning (e.g. gemv_k_split=4); "
        'repeat it to run each case under each ("" for the heuristics)',
    )
    args = ap.parse_args()
    tiled = args.layout == "tiled"
    tunings = args.tuning or [None]
    for case in args.cases.split(","):
        backend, m, shape = case.split(":")
        n, k = (int(x) for x in shape.split("x"))
        if backend == "grouped":
            print(
                f"case grouped tokens={m} x top-{args.top_k} of {args.experts} experts N={n} K={k} "
                f"layout {args.layout}",
                flush=True,
            )
            run_grouped_case(int(m), n, k, args.experts, args.top_k, tiled)
        else:
            for tuning in tunings:
                print(
                    f"case {backend} M={m} N={n} K={k} layout {args.layout} tuning {tuning}",
                    flush=True,
                )
                run_case(backend, int(m), n, k, tiled=tiled, tuning=tuning)


if __name__ == "__main__":
    main()
