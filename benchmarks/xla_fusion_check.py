"""Does XLA fuse the `xla` path's dequantize into its GEMM? Reads the compiled program, times nothing.

    python benchmarks/xla_fusion_check.py --shapes 11008x4096,28672x8192 --m 16,256,4096 --json out.json

For each (shape, M) jax_fp4.matmul(a, w, backend="xla") is compiled for the default device and its
optimized HLO read: which GEMM runs (a Triton GEMM fusion, a cuBLAS call, a cuDNN fusion or another
dot) and whether the dequantized weight is materialized, i.e. an instruction of the entry
computation produces a float [N, K] (or [K, N]) array, written to memory and read back by the GEMM.
"Not materialized" means XLA decodes the weight inside its GEMM: what the fused CUDA path does by
hand. Time it with `python benchmarks/dispatch_check.py --backends gemv,fused,dequant,xla`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import bench
import jax
import jax.numpy as jnp

import jax_fp4

GEMMS = (("triton", "__triton_gemm"), ("cublas", "__cublas$"), ("cudnn", "__cudnn$"))


def entry_lines(hlo: str) -> list[str]:
    """The instructions of the ENTRY computation of an HLO module's text."""
    lines, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            lines.append(line)
    return lines


def summarize(hlo: str, n: int, k: int) -> dict:
    """{"gemm": triton / cublas / cudnn / dot, "weight_materialized": bool} of a compiled module."""
    gemm = next((name for name, marker in GEMMS if marker in hlo), "dot")
    dense = re.compile(rf"=\s*(?:bf16|f16|f32)\[(?:{n},{k}|{k},{n})\]")
    materialized = any(dense.search(line) for line in entry_lines(hlo))
    return {"gemm": gemm, "weight_materialized": materialized}


def check(n: int, k: int, m: int, layout: str, dtype) -> dict:
    # Only the program matters, not the values: an all-zero weight compiles the same.
    w = jax_fp4.NVFP4Weight(
        jnp.zeros((n, k // 2), jnp.uint8), jnp.zeros((n, -(-k // 16)), jnp.uint8), jnp.float32(1.0)
    )
    w = bench.in_layout(w, layout)
    a = jax.ShapeDtypeStruct((m, k), dtype)
    hlo = jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="xla")).lower(a, w).compile().as_text()
    return {"n": n, "k": k, "m": m, "layout": w.layout, **summarize(hlo, n, k)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="11008x4096,4096x11008,17408x5120,28672x8192")
    p.add_argument("--m", default="16,64,256,1024,4096")
    p.add_argument("--layout", choices=("spec", "tiled"), default="tiled")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[args.dtype]
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    print("| N x K | M | layout | GEMM | dequantized weight in memory |\n|---|---:|---|---|---|")
    for shape in (bench.parse_shape(s) for s in args.shapes.split(",")):
        for m in (int(x) for x in args.m.split(",")):
            row = check(shape.n, shape.k, m, args.layout, dtype)
            rows.append(row)
            print(
                f"| {shape.n}x{shape.k} | {m} | {row['layout']} | {row['gemm']} | "
                f"{'yes' if row['weight_materialized'] else 'no (fused)'} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
