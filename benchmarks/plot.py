"""Plot a `python benchmarks/bench.py --json PATH` result: one PNG per (shape, dtype).

    pip install 'jax_fp4[plot]'        # matplotlib
    python benchmarks/plot.py results.json --out plots/

Each figure has three panels against M (log scale):
  1. effective TB/s in the memory-bound range (M <= --max-m-bw, default 64) for jax_fp4, bf16
     jnp.dot and jnp dequantize-then-dot, with the measured streaming-read bandwidth as a line;
  2. TFLOP/s over all M;
  3. jax_fp4's speedup over bf16 jnp.dot and over dequantize-then-dot (1.0 dashed).
If the JSON has a decode step, a small bar chart of its step times is written too.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

SERIES = (  # (label, time key, TB/s key, TFLOP/s key, style)
    ("jax_fp4", "us", "tbps", "tflops", dict(color="tab:green", marker="o")),
    ("bf16 jnp.dot", "bf16_us", "bf16_tbps", "bf16_tflops", dict(color="tab:blue", marker="s")),
    (
        "jnp dequant + dot",
        "naive_us",
        "naive_tbps",
        "naive_tflops",
        dict(color="tab:red", marker="^"),
    ),
)


def group_rows(rows):
    """{(n, k, dtype): rows sorted by m}."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row["n"], row["k"], row["dtype"])].append(row)
    return {key: sorted(group, key=lambda r: r["m"]) for key, group in groups.items()}


def plot_shape(plt, rows, title: str, path: str, max_m_bw: int) -> None:
    from matplotlib.ticker import NullLocator

    fig, (ax_bw, ax_fl, ax_sp) = plt.subplots(1, 3, figsize=(16, 4.5))
    ms = [r["m"] for r in rows]
    bw_rows = [r for r in rows if r["m"] <= max_m_bw]

    for label, _, tb_key, fl_key, style in SERIES:
        if bw_rows:
            ax_bw.plot(
                [r["m"] for r in bw_rows], [r[tb_key] for r in bw_rows], label=label, **style
            )
        ax_fl.plot(ms, [r[fl_key] for r in rows], label=label, **style)
    if bw_rows:
        ax_bw.axhline(
            bw_rows[0]["read_bw_tbps"],
            color="gray",
            linestyle="--",
            label=f"streaming read {bw_rows[0]['read_bw_tbps']:.2f} TB/s",
        )
    ax_bw.set(title=f"memory-bound (M <= {max_m_bw})", xlabel="M", ylabel="effective TB/s")
    ax_fl.set(title="compute", xlabel="M", ylabel="TFLOP/s")
    ax_fl.set_yscale("log")

    ax_sp.plot(
        ms,
        [r["speedup_vs_bf16"] for r in rows],
        label="vs bf16 jnp.dot",
        color="tab:blue",
        marker="s",
    )
    ax_sp.plot(
        ms,
        [r["speedup_vs_naive"] for r in rows],
        label="vs jnp dequant + dot",
        color="tab:red",
        marker="^",
    )
    ax_sp.axhline(1.0, color="gray", linestyle="--")
    ax_sp.set(title="jax_fp4 speedup", xlabel="M", ylabel="x")

    for ax, xs in ((ax_bw, [r["m"] for r in bw_rows]), (ax_fl, ms), (ax_sp, ms)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(m) for m in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(plt, decode: dict, title: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = ["jax_fp4", "bf16 jnp.dot", "jnp dequant + dot", "floor"]
    values = [
        decode["step_us"],
        decode["bf16_step_us"],
        decode["naive_step_us"],
        decode["floor_us"],
    ]
    ax.bar(labels, values, color=["tab:green", "tab:blue", "tab:red", "gray"])
    for i, v in enumerate(values):
        ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom")
    ax.set(ylabel="us per decode step (device)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_results(results: dict, out_dir: str, max_m_bw: int = 64) -> list[str]:
    """Write the PNGs; returns their paths."""
    from jax_fp4.extras import import_extra

    matplotlib = import_extra("matplotlib", "plot", "benchmarks/plot.py")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    device = results.get("device", "?")
    written = []
    for (n, k, dtype), rows in group_rows(results.get("rows", [])).items():
        path = os.path.join(out_dir, f"{n}x{k}_{dtype}.png")
        paths = ", ".join(sorted({r["path"] for r in rows}))
        layouts = ", ".join(sorted({r.get("layout", "spec") for r in rows}))
        title = f"NVFP4 matmul N={n} K={k} {dtype} on {device} (path: {paths}; layout: {layouts})"
        plot_shape(plt, rows, title, path, max_m_bw)
        written.append(path)
    decode = results.get("decode_step")
    if decode:
        path = os.path.join(out_dir, "decode_step.png")
        plot_decode(
            plt, decode, f"decode step ({decode['matmuls']} matmuls, M=1) on {device}", path
        )
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json", help="results written by benchmarks/bench.py --json")
    parser.add_argument("--out", default="plots", help="output folder (default: plots/)")
    parser.add_argument("--max-m-bw", type=int, default=64, help="largest M on the TB/s panel")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        results = json.load(f)
    for path in plot_results(results, args.out, args.max_m_bw):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
