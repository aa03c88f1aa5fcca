"""Compares the sides of an A/B run: two builds (or two settings) timed in one device call, base,
new, base, each side a `benchmarks/fused_timing.py --json` or `benchmarks/bench.py --json` file,
given in the order they ran. Prints each shape's time per side, how far the base sides drifted
apart, and a verdict for the new side that counts only what lies outside that drift (identical
code can time up to ~15% apart between runs, so a base on both sides shows the drift).

    python benchmarks/ab_compare.py fused_ab_1_base.json fused_ab_2_new.json fused_ab_3_base.json

The side of a file is the last `_base` / `_new` in its name (or --sides). Verdicts per row:
`faster` (the new side beats every base), `slower` (every base beats it), `within drift`
(between the bases). With one base the drift is unknown and the verdict only compares to it.
Writes a Markdown table and a summary line to stdout.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys


def load_side(path: str, variant: str) -> dict[tuple[int, int, int], float]:
    """(n, k, m) -> microseconds of `variant` in one fused_timing.py JSON, or of jax_fp4 in one
    `benchmarks/bench.py --json` file (its "rows"; `variant` does not apply)."""
    results = json.loads(pathlib.Path(path).read_text())
    if "rows" in results:
        return {(r["n"], r["k"], r["m"]): float(r["us"]) for r in results["rows"]}
    records = results["records"]
    key = f"{variant}_us"
    times = {}
    for r in records:
        if key not in r:
            raise ValueError(
                f"{path}: record {r.get('n')}x{r.get('k')} M={r.get('m')} has no {key!r}"
            )
        times[(r["n"], r["k"], r["m"])] = float(r[key])
    return times


def side_of(path: str) -> str:
    found = re.findall(r"_(base|new)(?=[._])", pathlib.Path(path).name)
    if not found:
        raise ValueError(f"{path}: cannot tell the side from the name (pass --sides)")
    return found[-1]


def compare(sides: list[tuple[str, dict]]) -> tuple[list[dict], str]:
    """Rows (one per shape, in the first side's order) and the summary line."""
    bases = [t for s, t in sides if s == "base"]
    news = [t for s, t in sides if s == "new"]
    if len(bases) < 1 or len(news) != 1:
        raise ValueError(
            f"need one or more base sides and exactly one new side, got {[s for s, _ in sides]}"
        )
    new = news[0]
    rows = []
    for key in sides[0][1]:
        if any(key not in t for _, t in sides):
            raise ValueError(f"shape {key} is missing from a side")
        base_times = [t[key] for t in bases]
        lo, hi = min(base_times), max(base_times)
        if new[key] < lo:
            verdict = "faster"
        elif new[key] > hi:
            verdict = "slower"
        else:
            verdict = "within drift"
        rows.append(
            {
                "n": key[0],
                "k": key[1],
                "m": key[2],
                "base_us": base_times,
                "new_us": new[key],
                "drift": hi / lo - 1 if len(bases) > 1 else None,
                "speedup": statistics.mean(base_times) / new[key],
                "verdict": verdict,
            }
        )
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("faster", "slower", "within drift")}
    drift = (
        f"base drift up to {100 * max(r['drift'] for r in rows):.1f}%"
        if len(bases) > 1
        else "base drift unknown (one base side)"
    )
    summary = (
        f"{len(rows)} shapes: {counts['faster']} faster, {counts['slower']} slower, "
        f"{counts['within drift']} within drift; mean speedup (mean base / new) "
        f"{statistics.mean(r['speedup'] for r in rows):.3f}; {drift}"
    )
    return rows, summary


def markdown(rows: list[dict], n_bases: int) -> str:
    head = (
        ["N x K", "M"]
        + [f"base {i + 1} us" for i in range(n_bases)]
        + ["new us", "base drift", "mean base / new", "verdict"]
    )
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for r in rows:
        cells = (
            [f"{r['n']}x{r['k']}", str(r["m"])]
            + [f"{t:.1f}" for t in r["base_us"]]
            + [
                f"{r['new_us']:.1f}",
                "n/a" if r["drift"] is None else f"{100 * r['drift']:.1f}%",
                f"{r['speedup']:.3f}",
                r["verdict"],
            ]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "files", nargs="+", help="fused_timing.py (or bench) JSON per side, in run order"
    )
    parser.add_argument("--sides", help="comma-separated base/new per file (default: from names)")
    parser.add_argument("--variant", default="fused", help="the timed variant (default fused)")
    args = parser.parse_args(argv)
    names = args.sides.split(",") if args.sides else [side_of(f) for f in args.files]
    if len(names) != len(args.files) or not set(names) <= {"base", "new"}:
        parser.error(f"--sides needs one of base/new per file, got {names}")
    try:
        sides = [(s, load_side(f, args.variant)) for s, f in zip(names, args.files)]
        rows, summary = compare(sides)
    except (ValueError, KeyError, OSError) as e:
        print(f"ab_compare: {e}", file=sys.stderr)
        return 2
    print(markdown(rows, names.count("base")))
    print()
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
