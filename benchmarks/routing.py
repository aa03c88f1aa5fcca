"""Routing benchmark: jax_fp4.route_top_k's GPU kernel against its XLA composition.

    python benchmarks/routing.py --json benchmarks/results/routing_<gpu>.json
    python benchmarks/routing.py --quick            # tiny chains: a CPU smoke run (seconds)

For each token count (default 1, 8, 16, 32, 64, 128 tokens of 128 experts, top 8, bfloat16
logits, renormalised as Qwen3-MoE) it times both ways of computing the routing: "kernel" (the
one-block CUDA kernel, ffi/cuda/routing.cu, wherever one block holds the call, whatever
jax_fp4.dispatch.ROUTING_KERNEL_MAX_PAIRS says) and "xla" (softmax, top_k and the pair grouping
as XLA runs them). The rows say where "auto" should take the kernel: dispatch's crossover.

Method (as benchmarks/bench.py): a jitted chain of L calls, each call's logits the previous
logits plus 0 * its weights (one small elementwise kernel per call on both sides, so that the
calls run in order); per-call time = (t(L2) - t(L1)) / (L2 - L1). Without a CUDA kernel (CPU,
--quick) only "xla" runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS, _BENCHMARKS.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_fp4  # noqa: E402
from jax_fp4 import dispatch, routing  # noqa: E402

TABLE_HEADER = (
    "| tokens | experts | k | kernel us | xla us | kernel / xla | auto |\n"
    "|---:|---:|---:|---:|---:|---:|---|"
)
# What "auto" picks on a GPU with the routing kernel, whatever this machine has.
_KERNEL_GPU = dispatch.Target("cuda", has_cuda_kernels=True)


def chain(way: str, calls: int, k: int):
    """A function of logits [T, E] running `calls` routings in a row, in `way`'s lowering."""
    run = routing._PATHS[way]

    def fn(logits):
        total = jnp.int32(0)
        for _ in range(calls):
            weights, _, order, _, sizes = run(logits, k=k, renormalize=True)
            logits = logits + (weights[:, :1] * 0).astype(logits.dtype)
            total = total + order[0] + sizes[0]
        return logits, total

    return fn


def ways() -> tuple[str, ...]:
    on_gpu = bench.default_device().platform == "gpu" and routing.has_routing_kernel()
    return ("kernel", "xla") if on_gpu else ("xla",)


def measure(tokens: Sequence[int], experts: int, k: int, args) -> list[dict]:
    rows = []
    rng = np.random.default_rng(args.seed)
    for t in tokens:
        logits = jnp.asarray(rng.standard_normal((t, experts)) * 2, jnp.bfloat16)
        row = {"tokens": t, "experts": experts, "k": k, "pairs": t * k}
        for way in ways():
            too_big = (
                t * k > dispatch.ROUTING_BLOCK_MAX_PAIRS
                or experts > dispatch.ROUTING_BLOCK_MAX_EXPERTS
            )
            if way == "kernel" and too_big:
                continue
            timing = bench.time_chain(
                lambda calls, way=way: chain(way, calls, k),
                (logits,),
                args.l1,
                args.l2,
                args.repeats,
                warmup=2,
            )
            row[f"{way}_us"] = timing.us
            row[f"{way}_noisy"] = timing.noisy
        if "kernel_us" in row:
            row["kernel_over_xla"] = row["kernel_us"] / row["xla_us"]
        row["auto"] = dispatch.routing_path(t, experts, k, _KERNEL_GPU, has_kernel=True)
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    def us(name):
        return f"{r[name]:.1f}" if name in r else "-"

    ratio = f"{r['kernel_over_xla']:.2f}" if "kernel_over_xla" in r else "-"
    return (
        f"| {r['tokens']} | {r['experts']} | {r['k']} | {us('kernel_us')} | {us('xla_us')} "
        f"| {ratio} | {r['auto']} |"
    )


def markdown(results: dict) -> str:
    lines = [
        f"route_top_k on {results['device']} (us a call in a chain of calls)",
        "",
        TABLE_HEADER,
    ]
    return "\n".join(lines + [format_row(r) for r in results["rows"]])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/routing.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", default="1,8,16,32,64,128", help="token counts (comma-separated)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--l1", type=int, default=10, help="calls in the short chain")
    p.add_argument("--l2", type=int, default=50, help="calls in the long chain")
    p.add_argument("--repeats", type=int, default=10, help="timed pairs of chains")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="tiny chains: a CPU smoke run")
    p.add_argument("--markdown-from", metavar="JSON", help="print an earlier result and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.markdown_from:
        print(markdown(json.loads(Path(args.markdown_from).read_text())))
        return 0
    if args.quick:
        args.tokens, args.l1, args.l2, args.repeats = "1,4", 1, 3, 2
    tokens = [int(t) for t in args.tokens.split(",")]
    print(TABLE_HEADER)
    rows = measure(tokens, args.experts, args.top_k, args)
    results = {
        "command": " ".join(["python benchmarks/routing.py", *(argv or sys.argv[1:])]),
        "device": bench.device_description(),
        "jax_version": jax.__version__,
        "jax_fp4_version": jax_fp4.__version__,
        "l1": args.l1,
        "l2": args.l2,
        "repeats": args.repeats,
        "seed": args.seed,
        "rows": rows,
    }
    if args.json:
        bench.write_json_file(args.json, results)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
